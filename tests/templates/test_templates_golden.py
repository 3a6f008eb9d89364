"""Rendered scripts compared word for word with tests/templates/golden/.

A difference or a missing golden file fails. To accept a change on purpose, run with
OMNI_WRITE_GOLDEN=1: the files are written and the test still fails once, so that nobody
regenerates by accident; review the diff and commit it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from render_support import DATA, GOLDEN, JOB_FILE

from slurm_omni.config.job import JobFile, load_job
from slurm_omni.config.site import SiteConfig
from slurm_omni.render import ArrayJobRequest, DrillRequest, HetJobRequest

GOLDEN_PYTHON = Path("/opt/slurm-omni/bin/python")
"""The site's ``python`` in the goldens: scripts run omni by absolute path, not whatever renders them."""


@pytest.fixture()
def site(site: SiteConfig) -> SiteConfig:
    return replace(site, python=GOLDEN_PYTHON)


def _compare(name: str, rendered: str, golden_dir: Path = GOLDEN) -> None:
    path = golden_dir / name
    if os.environ.get("OMNI_WRITE_GOLDEN") == "1":
        path.write_text(rendered)
        pytest.fail(f"wrote {path}: review the diff, commit it, and run again without OMNI_WRITE_GOLDEN")
    if not path.exists():
        pytest.fail(f"golden file {path} is missing (create it with OMNI_WRITE_GOLDEN=1 and review it)")
    expected = path.read_text()
    assert rendered == expected, f"{name} differs from its golden file"


@pytest.fixture
def job(job: JobFile) -> JobFile:
    """The job as if its file sat at JOB_FILE: its default workdir is that file's folder."""
    return at_job_file(job)


def at_job_file(job: JobFile) -> JobFile:
    return replace(job, job=replace(job.job, workdir=JOB_FILE.parent))


def test_het_job_matches_golden(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    script = HetJobRequest(job=job, site=site, job_file=JOB_FILE, job_sha256=job_sha256,
                           user="alice").materialize()
    _compare("het.sbatch", script)


def test_array_job_matches_golden(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    second = replace(job, job=replace(job.job, name="omni-tiny-lr2"))
    script = ArrayJobRequest(jobs=(job, second), site=site,
                             job_files=(JOB_FILE, JOB_FILE.with_name("job-lr2.toml")),
                             job_sha256s=(job_sha256, "0" * 64), max_parallel=1, user="alice").materialize()
    _compare("array.sbatch", script)


def test_drill_job_matches_golden(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    script = DrillRequest(job=job, site=site, job_file=JOB_FILE, job_sha256=job_sha256, rank=3,
                          after_s=30, user="alice").materialize()
    _compare("drill.sbatch", script)


def test_missing_golden_fails_rather_than_regenerates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_WRITE_GOLDEN", raising=False)
    with pytest.raises(pytest.fail.Exception, match="is missing"):
        _compare("het.sbatch", "x", golden_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_different_golden_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_WRITE_GOLDEN", raising=False)
    (tmp_path / "het.sbatch").write_text("y")
    with pytest.raises(AssertionError, match="differs"):
        _compare("het.sbatch", "x", golden_dir=tmp_path)
    assert (tmp_path / "het.sbatch").read_text() == "y"


def _in_allocation(site: SiteConfig, *, features: bool = False) -> SiteConfig:
    """The test site with both stages in one partition (and node features when asked), in-allocation
    recovery by default, one spare per stage."""
    stages = {name: replace(s, partition="gpu", feature=f"{name[:3]}" if features else "")
              for name, s in site.stages.items()}
    return replace(site, stages=stages, elasticity=replace(site.elasticity, recovery="in_allocation",
                                                           default_spares=1))


def test_in_allocation_job_matches_golden(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    script = HetJobRequest(job=job, site=_in_allocation(site), job_file=JOB_FILE, job_sha256=job_sha256,
                           user="alice").materialize()
    _compare("inalloc.sbatch", script)


def test_in_allocation_with_node_features_matches_golden(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    script = HetJobRequest(job=job, site=_in_allocation(site, features=True), job_file=JOB_FILE,
                           job_sha256=job_sha256, user="alice").materialize()
    _compare("inalloc-features.sbatch", script)


def test_in_allocation_drill_matches_golden(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    script = DrillRequest(job=job, site=_in_allocation(site), job_file=JOB_FILE, job_sha256=job_sha256, rank=3,
                          after_s=30, user="alice").materialize()
    _compare("inalloc-drill.sbatch", script)


def test_own_script_job_matches_golden(site: SiteConfig, job_sha256: str) -> None:
    """[training] command and env: fields filled in, every word quoted, the program checked first."""
    own = at_job_file(load_job(DATA / "job-own.toml"))
    script = HetJobRequest(job=own, site=site, job_file=JOB_FILE, job_sha256=job_sha256, user="alice").materialize()
    assert "/opt/slurm-omni/bin/python /shared/jobs/omni-tiny/train.py --name omni-own" in script
    _compare("own.sbatch", script)


def test_in_allocation_resubmission_asks_a_node_range(job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    """After losses the manager excludes the lost nodes: the next allocation takes the stages' nodes
    at least and spares as far as there are any."""
    script = HetJobRequest(job=job, site=_in_allocation(site), job_file=JOB_FILE, job_sha256=job_sha256,
                           incarnation_base=3).materialize()
    assert "#SBATCH --nodes=2-4\n" in script and "OMNI_INCARNATION_BASE=3" in script
