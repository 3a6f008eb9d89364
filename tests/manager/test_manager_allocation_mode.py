"""Allocation mode on the embedded cluster with the real trainer (docs/allocation-mode.md): the job's
nodes come from ``salloc --no-shell --no-kill`` and its step supervisor runs outside the allocation,
beside the manager, launching with ``srun --jobid``. The allocation's first node (the one that would
be the batch host) is lost and replaced by a spare in the same Slurm job, with the supervisor
SIGKILLed in the middle of that relaunch (the drill point after the launch's intent is journaled):
the manager starts another, which makes the launch exactly once. Then the supervisor is SIGKILLed
while that launch trains: the next one adopts the running step (at most one relaunch), and training
runs to its last step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import REPO, make_shards, manager_run
from omni_configs import site_toml
from support import wait_until

from slurm_omni.slurm.hostlist import expand
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path, read_status, status_path
from slurm_omni.supervisor.outside import process_alive, read_process

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]

MAX_STEPS = 60


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("manager-allocation-data"))


def _site(tmp: Path, spool: Path, spares: int = 1) -> str:
    text = site_toml(tmp, spool_dir=spool, tables='[elasticity]\nrecovery = "allocation"\nallow_allocation = true\n'
                                                  f'default_spares = {spares}\n')
    return text.replace('partition = "vision"', 'partition = "debug"').replace('partition = "text"',
                                                                                'partition = "debug"')


def journal_records(ckpt: Path, job_id: int) -> list[dict[str, object]]:
    return [json.loads(line) for line in journal_path(ckpt, str(job_id)).read_text().splitlines() if line.strip()]


def _resumed(log: Path) -> dict[int, int]:
    """Rank -> the step it resumed at, from a launch's log (runtime/loop.py's line)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {int(r): int(s) for r, s in re.findall(r"runtime: rank (\d+) resumed at step (\d+)", text)}


def test_allocation_mode_recovers_the_first_node_in_the_job_and_survives_its_supervisors_death(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-alloc",
                     max_steps=MAX_STEPS) as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool))
        job_id = run.submit(extra_env={"OMNI_SUPERVISOR_CRASH_AT": "relaunch:after_intent"})
        run.start_manager()
        run.wait_watching(job_id)
        ckpt = run.heartbeat_dir.parent
        sup_log = tmp_path / "logs" / f"mgr-alloc-{job_id}.supervisor.log"

        def say() -> str:
            return sup_log.read_text(errors="replace")[-3000:] if sup_log.exists() else "(no supervisor log)"

        wait_until(lambda: read_status(status_path(ckpt, str(job_id))), 120, f"the supervisor's status\n{say()}",
                   interval_s=0.5)
        run.wait_steps(job_id, 2, 6)
        shown = run.runner().run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        assert "BatchFlag=0" in shown                                    # no batch script
        first = expand(shown.split(" NodeList=")[1].split()[0])[0]       # what would be the batch host
        status = read_status(status_path(ckpt, str(job_id)))
        assert status is not None and first in status.nodes, status
        run.set_node(first, "DOWN")
        (rec,) = run.wait_recovery(1, "first_step", timeout_s=180)
        assert rec.path == "in_allocation" and first in rec.nodes, rec
        (inc0, inc1) = run.incarnations()
        assert inc0["slurm_job_id"] == inc1["slurm_job_id"] == str(job_id)
        assert (ckpt / "supervisor" / f"{job_id}.crashed").exists()      # the drill killed it mid-relaunch
        wait_until(lambda: len(_resumed(ckpt / "supervisor" / f"omni-{job_id}-launch-1.log")) == 2, 60,
                   "both ranks of launch 1 to log their resume")
        state = run.runner().run(["squeue", "-h", "-j", str(job_id), "-o", "%T"]).stdout.strip()
        assert state == "RUNNING"
        resumed = _resumed(ckpt / "supervisor" / f"omni-{job_id}-launch-1.log")
        assert len(resumed) == 2 and len(set(resumed.values())) == 1, resumed      # every rank the same step

        # the supervisor SIGKILLed while launch 1 trains: the manager starts another, which adopts it
        old = read_process(ckpt, str(job_id))
        assert old is not None and process_alive(old)
        launches_before = len(SupervisorJournal(journal_path(ckpt, str(job_id))).state.launches)
        os.kill(old.pid, signal.SIGKILL)
        new = wait_until(lambda: (p := read_process(ckpt, str(job_id))) is not None and p.pid != old.pid
                         and process_alive(p) and p, 60, f"a new supervisor\n{run.manager_log()}")
        assert new.host == old.host
        # training to its end, in the same Slurm job; the allocation is given back when it is done
        wait_until(lambda: (s := read_status(status_path(ckpt, str(job_id)))) is not None and s.phase == "done",
                   240, f"training to finish\n{say()}", interval_s=1.0)
        wait_until(lambda: not run.runner().run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(),
                   60, "the allocation to be released")
        beats = run.beats(job_id)
        assert {b["phase"] for b in beats.values()} == {"done"} and {b["step"] for b in beats.values()} == {MAX_STEPS}
        journal = SupervisorJournal(journal_path(ckpt, str(job_id))).state
        assert journal.outcome == "done" and len(journal.launches) - launches_before <= 1, journal.launches
        assert journal.launches[1].removed == (first,)
        launched = [r for r in journal_records(ckpt, job_id) if r["kind"] == "launched" and r["launch"] == 1]
        assert len(launched) == 1, launched                  # the relaunch the drill interrupted: made once
        wait_until(lambda: run.rows("SELECT state FROM jobs WHERE name = ?", run.key) == [("done",)], 60,
                   f"the manager to close the job\n{run.manager_log()}")
        restarts = run.rows("SELECT payload FROM decisions WHERE job = ? AND verdict = 'supervisor_started'", run.key)
        assert len(restarts) == 2, run.manager_log()         # after the drill's kill, after the test's


def test_allocation_mode_hands_a_lost_allocation_to_the_managers_resubmission_with_a_batch_script(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    """No spare and one replica: a lost node leaves no launch that fits, the supervisor hands over
    (gave_up), and the manager resubmits the job as an in-allocation batch job (the fallback), which
    trains in a new Slurm job without the lost node."""
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-alloc-gone") as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool, spares=0))
        job_id = run.submit()
        run.start_manager()
        run.wait_watching(job_id)
        ckpt = run.heartbeat_dir.parent
        wait_until(lambda: read_status(status_path(ckpt, str(job_id))), 120, "the supervisor's status", interval_s=0.5)
        run.wait_steps(job_id, 2, 6)
        status = read_status(status_path(ckpt, str(job_id)))
        assert status is not None
        lost = status.components[1][0]
        run.set_node(lost, "DOWN")
        (rec,) = run.wait_recovery(1, "first_step", timeout_s=240)
        assert rec.path == "resubmitted" and lost in rec.nodes, (rec, run.manager_log())
        (inc0, inc1) = run.incarnations()
        assert inc0["slurm_job_id"] == str(job_id) and inc1["slurm_job_id"] != str(job_id)
        new = inc1["slurm_job_id"]
        shown = run.runner().run(["scontrol", "show", "job", "-o", new]).stdout
        assert "BatchFlag=1" in shown and lost not in {n for nodes in inc1["layout"]["nodes"].values() for n in nodes}
        assert SupervisorJournal(journal_path(ckpt, str(job_id))).state.outcome == "fallback"
        run.wait_steps(int(new), 2, (rec.plan or {}).get("restore_step") or 7)
