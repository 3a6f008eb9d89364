"""A job the manager resubmits runs with the environment its user submitted it from (recorded by
``omni submit`` in the registration), not the manager's; SLURM_CONF stays the cluster's."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import REPO, make_shards, manager_run

from slurm_omni.render.registry import MAX_ENVIRONMENT_BYTES, bounded_environment
from slurm_omni.slurm.runner import CommandRunner

MARKER = "OMNI_TEST_SUBMITTER_MARKER"
VALUE = "from the submitter's shell: 'quoted' $NOT_EXPANDED"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("manager-env-data"))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resubmitted_job_runs_with_the_submitters_environment(slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-env") as run:
        job_id = run.submit(extra_env={MARKER: VALUE, "OMP_NUM_THREADS": "1"})
        record_path = tmp_path / "registry" / f"{job_id}.json"
        record = json.loads(record_path.read_text())
        assert record["environment"][MARKER] == VALUE
        assert stat.S_IMODE(record_path.stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "registry").stat().st_mode) == 0o700
        run.start_manager(OMP_NUM_THREADS="2")    # the manager's own environment differs
        run.wait_steps(job_id, 2, 4)
        assert run.proc is not None and run.proc.poll() is None
        manager_env = _environ(run.proc.pid)
        assert MARKER not in manager_env and manager_env["OMP_NUM_THREADS"] == "2"
        assert _environ(run.beats(job_id)[1]["pid"])[MARKER] == VALUE
        os.kill(run.beats(job_id)[1]["pid"], signal.SIGKILL)     # a rank dies; its node stays up
        run.wait_recovery(1, "first_step")
        new_id = int(run.incarnations()[1]["slurm_job_id"])
        assert new_id != job_id
        for rank, beat in run.wait_steps(new_id, 2, 1).items():
            env = _environ(beat["pid"])
            assert env.get(MARKER) == VALUE, (rank, sorted(env))
            assert env["OMP_NUM_THREADS"] == "1"                         # the submitter's, not the manager's
            assert env["SLURM_CONF"] == slurm_cluster.env["SLURM_CONF"]
            assert beat["incarnation"] == 1


def test_a_replaced_environment_keeps_the_clusters_slurm_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", "/ours/slurm.conf")
    monkeypatch.setenv("MANAGER_ONLY", "1")
    runner = CommandRunner({"RUNNER_SET": "r"})
    env = runner.environment({MARKER: VALUE, "SLURM_CONF": "/theirs/slurm.conf", "PATH": "/theirs/bin"})
    assert env == {MARKER: VALUE, "SLURM_CONF": "/ours/slurm.conf", "PATH": "/theirs/bin", "RUNNER_SET": "r"}
    out = runner.run(["env"], env={MARKER: VALUE, "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert f"{MARKER}={VALUE}" in out and "MANAGER_ONLY=1" not in out
    assert "MANAGER_ONLY=1" in runner.run(["env"]).stdout.splitlines()   # merged, as before


def test_the_recorded_environment_is_bounded_largest_values_first() -> None:
    env = {"PATH": "/usr/bin", "HUGE": "x" * MAX_ENVIRONMENT_BYTES, "OMP_NUM_THREADS": "8"}
    record = bounded_environment(env)
    assert record == {"environment": {"OMP_NUM_THREADS": "8", "PATH": "/usr/bin"}, "environment_dropped": ["HUGE"]}
    assert bounded_environment({"A": "1"}) == {"environment": {"A": "1"}}
