"""``omni render`` and ``omni config check`` through the real entry point (one line on errors)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from render_support import DATA

from slurm_omni.cli.main import main
from slurm_omni.cli.submit import parse_sbatch_id
from slurm_omni.errors import SlurmError
from slurm_omni.render.registry import RegistryRecord, read_registrations, register, registered_stages
from slurm_omni.render.request import StagePlan


def _omni(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_render_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _omni(capsys, "render", str(DATA / "job.toml"), "--site", str(DATA / "site.toml"))
    assert code == 0
    assert out.startswith("#!/bin/bash\n# Rendered by slurm-omni")
    assert f"# job file: {json.dumps(str((DATA / 'job.toml').resolve()))}" in out
    assert "#SBATCH hetjob" in out


def test_render_in_allocation_mode_says_what_submit_runs_instead(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    site = tmp_path / "site.toml"
    site.write_text((DATA / "site.toml").read_text().replace('partition = "text"', 'partition = "vision"')
                    + '\n[elasticity]\nrecovery = "allocation"\nallow_allocation = true\n')
    code, out, _ = _omni(capsys, "render", str(DATA / "job.toml"), "--site", str(site))
    assert code == 0 and out.startswith("#!/bin/bash\n# Allocation mode")
    assert "#   salloc --no-shell --no-kill --job-name=omni-tiny" in out and " supervise --allocation=J " in out
    assert "#SBATCH --no-kill" in out and "hetjob" not in out          # the in-allocation fallback script
    odd = tmp_path / "a\nrm -rf x" / "job.toml"                          # a newline in a path stays in the comment
    odd.parent.mkdir()
    odd.write_text((DATA / "job.toml").read_text())
    code, out, _ = _omni(capsys, "render", str(odd), "--site", str(site))
    lines = out.splitlines()
    head = lines[1:next(i for i, ln in enumerate(lines) if ln.startswith("# Rendered by"))]
    assert code == 0 and len(head) == 5 and all(ln.startswith("# ") for ln in head)


def test_render_sweep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    second = tmp_path / "job-b.toml"
    second.write_text((DATA / "job.toml").read_text().replace('name = "omni-tiny"', 'name = "omni-b"'))
    code, out, _ = _omni(capsys, "render", str(DATA / "job.toml"), str(second), "--site",
                         str(DATA / "site.toml"), "--max-parallel", "1")
    assert code == 0 and "#SBATCH --array=0-1%1" in out and "hetjob" not in out


def test_render_without_site_says_where_it_looked(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNI_SITE_CONFIG", str(tmp_path / "absent.toml"))
    code, out, err = _omni(capsys, "render", str(DATA / "job.toml"))
    assert code == 2 and out == ""
    expected = (f"omni: site: couldn't read {tmp_path / 'absent.toml'}: no such file (pass --site or set "
                "$OMNI_SITE_CONFIG; site-config/omni.toml is an annotated example)")
    assert err.splitlines() == [expected]


def test_config_check_job_against_site(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _omni(capsys, "config", "check", str(DATA / "job.toml"), "--site", str(DATA / "site.toml"))
    assert code == 0
    assert "vision on vision 1x2 gpu:h100:4, text on text 1x2 gpu:h100:4" in out


def test_config_check_site(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _omni(capsys, "config", "check", str(DATA / "site.toml"))
    assert (code, out.split(":")[0]) == (0, "ok")


def test_config_check_error_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "job.toml"
    bad.write_text((DATA / "job.toml").read_text().replace("data_parallel_size = 2", "data_parallel_size = -2"))
    code, out, err = _omni(capsys, "config", "check", str(bad))
    assert code == 2 and out == ""
    assert err == f"omni: {bad}: job: job.data_parallel_size = -2 is not allowed (expected >= 1)\n"


@pytest.mark.parametrize(("stdout", "job_id"), [("1234\n", 1234), ("77;omni\n", 77)])
def test_parse_sbatch_id(stdout: str, job_id: int) -> None:
    assert parse_sbatch_id(stdout) == job_id


@pytest.mark.parametrize("stdout", ["", "Submitted batch job 5", "x;y"])
def test_parse_sbatch_id_refused(stdout: str) -> None:
    with pytest.raises(SlurmError, match="couldn't read the job id"):
        parse_sbatch_id(stdout)


def test_registry_record_is_private_and_atomic(tmp_path: Path) -> None:
    stage = StagePlan(0, "vision", "vision", 1, 2, "gpu:h100:4", 1, "10:00", 0)
    registration = RegistryRecord(job_id=9, kind="het", name="omni-tiny", cluster="omni",
                                  job_file=Path("/j.toml"), job_sha256="ab", script=None,
                                  ckpt_dir=Path("/ck/omni-tiny"), data_parallel_size=2, max_requeues=3,
                                  stages=registered_stages((stage,)))
    path = register(tmp_path / "registry", registration)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["9.json"]
    (record,) = read_registrations(path.parent)
    assert record["job_id"] == 9 and record["stages"][0]["tasks_per_node"] == 2 and record["format"] == 1
    assert record["user"] and record["submitted_at"].endswith("Z")
