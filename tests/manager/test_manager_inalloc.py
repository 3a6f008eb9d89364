"""The manager beside a step supervisor, on the embedded cluster with the real trainer: a node lost
inside an in-allocation job is the supervisor's to recover (same Slurm job, a spare, no sbatch); the
manager neither cancels nor resubmits, and records the recovery with its path, the same job id, the
nodes removed and added and the spares left, through to the first step after the relaunch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from manager_cluster_support import BIN, REPO, list_jobs, make_shards, manager_run
from omni_configs import site_toml
from support import wait_until

from slurm_omni.supervisor.journal import read_status, status_path

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("manager-inalloc-data"))


def _site(tmp: Path, spool: Path) -> str:
    """One partition for both stages (one allocation), a spare per stage."""
    text = site_toml(tmp, spool_dir=spool, tables='[elasticity]\nrecovery = "in_allocation"\ndefault_spares = 1\n')
    return text.replace('partition = "vision"', 'partition = "debug"').replace('partition = "text"',
                                                                                'partition = "debug"')


def test_a_node_lost_in_the_allocation_is_the_supervisors_and_the_manager_shows_its_path(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-inalloc") as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool))
        job_id = run.submit()
        run.start_manager()
        run.wait_watching(job_id)
        ckpt = run.heartbeat_dir.parent
        status = wait_until(lambda: read_status(status_path(ckpt, str(job_id))), 120,
                            f"the step supervisor's status file\n{run.job_log(job_id)}", interval_s=0.5)
        run.wait_steps(job_id, 2, 6)
        status = read_status(status_path(ckpt, str(job_id)))
        assert status is not None and status.spares_left == 2
        text_node = status.components[1][0]
        run.set_node(text_node, "DOWN")
        (rec,) = run.wait_recovery(1, "first_step", timeout_s=180)
        assert rec.path == "in_allocation" and rec.new_incarnation == 1 and text_node in rec.nodes
        assert all(rec.times[p] is not None for p in ("confirmed", "resubmitted", "running", "first_step"))
        assert not run.rows("SELECT key FROM actions")           # no cancel, no sbatch: the supervisor's
        (inc0, inc1) = run.incarnations()
        assert inc0["slurm_job_id"] == inc1["slurm_job_id"] == str(job_id)

        out = subprocess.run([str(BIN / "omni"), "status", "--json", "--site-config", str(run.site),
                              "--state-dir", str(run.state_dir)], env=run.env, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        (job,) = json.loads(out)["jobs"]
        (view,) = job["recoveries"]
        assert view["path"] == "in_allocation" and view["complete"]
        assert view["slurm_job_id_before"] == view["slurm_job_id_after"] == str(job_id)
        assert view["nodes_removed"] == {"1": [text_node]}
        added: dict[str, Any] = view["nodes_added"]
        assert list(added) == ["1"] and len(added["1"]) == 1 and added["1"][0] != text_node
        # two spares in the allocation, one taken: one left, which either stage may use (one node kind)
        assert view["spares_left"] == {"0": 1, "1": 1}
        # the next life trains in the same job, on the spare
        beats = run.wait_steps(job_id, 2, (rec.plan or {}).get("restore_step") or 7)
        assert {b["incarnation"] for b in beats.values()} == {1}


def _supervisor_pids(job_id: int) -> list[int]:
    """The step supervisor of Slurm job ``job_id``: an ``omni supervise`` process whose environment
    carries that job id (the batch script runs it on the batch host)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"supervise" in argv and f"SLURM_JOB_ID={job_id}".encode() in env:
            pids.append(int(proc.name))
    return pids


def test_a_lost_batch_host_with_a_silent_supervisor_is_the_managers_to_resubmit(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    """The batch host lost, and the supervisor with it (stopped here: on this one-machine cluster its
    process outlives its node). 22.05 and 24.11 end the job; 26.05 keeps it RUNNING without the
    node (docs/slurm-versions.md): the manager takes over either way, cancels what is left of the
    allocation and resubmits, and the next life trains in a new job."""
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-batchhost") as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool))
        job_id = run.submit()
        run.start_manager()
        run.wait_watching(job_id)
        ckpt = run.heartbeat_dir.parent
        wait_until(lambda: read_status(status_path(ckpt, str(job_id))), 120,
                   f"the step supervisor's status file\n{run.job_log(job_id)}", interval_s=0.5)
        run.wait_steps(job_id, 2, 6)
        pids = wait_until(lambda: _supervisor_pids(job_id), 30, f"the supervisor of job {job_id}")
        batch_host = run.runner().run(["scontrol", "show", "job", "-o", str(job_id)]).stdout \
            .split(" BatchHost=")[1].split()[0]
        stopped = []
        try:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            run.set_node(batch_host, "DOWN")
            (rec,) = run.wait_recovery(1, "first_step", timeout_s=240)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert rec.path == "resubmitted" and batch_host in rec.nodes, (rec, run.manager_log())
        (inc0, inc1) = run.incarnations()
        assert inc0["slurm_job_id"] == str(job_id) and inc1["slurm_job_id"] != str(job_id)
        assert batch_host not in {n for nodes in inc1["layout"]["nodes"].values() for n in nodes}
        old = next((j for j in list_jobs(run.env) if j.job_id == job_id), None)
        assert old is None or old.state.finished, old              # nothing of the allocation left running
        takeovers = [json.loads(p) for (p,) in run.rows(
            "SELECT payload FROM decisions WHERE job = ? AND verdict = 'takeover'", run.key)]
        assert takeovers, run.manager_log()
