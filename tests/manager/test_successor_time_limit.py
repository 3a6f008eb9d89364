"""The time limit's successor allocation, on the embedded cluster with the real trainer
(docs/allocation-mode.md, "Time limit: a successor allocation"): a job in allocation mode with a
3-minute allocation (``--time`` counts minutes) and the stop 60 s before its end. Ahead of the stop
(the site's expected queue wait of 60 s times 1.5 plus the relaunch it measured, cut to half the
allocation: 90 s before its end) the supervisor asks
Slurm for a successor allocation of the job's whole shape while the step trains; it starts at once on
this idle cluster, the ranks checkpoint (a planned save, exit 75), the next launch runs on the
successor, and the first allocation is released: its Slurm job ends and no resubmission follows.
The manager follows the job to the new allocation (the supervisor's status names it); the
supervisor SIGKILLed while the job trains in the successor is started again by the manager and
adopts the launch there from its journal. Training runs
to its last step: every step once, the loss bitwise the reference's, every sample id exactly once.
About 2.5-3 minutes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import JOB, REPO, allocation_site, make_shards, manager_run
from support import wait_until

from slurm_omni.drill.equivalence import check_equivalence, compare_losses
from slurm_omni.drill.history import load_history
from slurm_omni.drill.reference import JOB_ENV as REFERENCE_ENV
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.elastic.codes import EXIT_CHECKPOINTED
from slurm_omni.formats.metrics import read_tree
from slurm_omni.formats.supervisor import SupervisorStatus
from slurm_omni.policy.pools import SUCCESSOR
from slurm_omni.supervisor.journal import Successor, SupervisorJournal, journal_path, read_status, status_path
from slurm_omni.supervisor.outside import process_alive, read_process

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(480)]

MAX_STEPS = 300
STEP_DELAY_S = "0.35"   # training outlasts the move (about 95 s into the allocation) on an idle machine
NAME = "successor"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("successor-data"))


def _site(tmp: Path, spool: Path) -> str:
    return allocation_site(tmp, spool, extra="successor_queue_wait_s = 60\n")


def _steps(metrics: Path) -> list[int]:
    steps = []
    for lines in read_tree(metrics).values():   # own files and node files
        for _, line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "step" in rec and "loss" in rec and rec.get("rank", 0) == 0:
                steps.append(int(rec["step"]))
    return sorted(steps)


def test_a_successor_allocation_asked_ahead_of_the_time_limit_takes_the_job_over(slurm_cluster, shards: Path,
                                                                               tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name=NAME, dp=1,
                     max_steps=MAX_STEPS) as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool))
        run.tmp.joinpath("job.toml").write_text(run.tmp.joinpath("job.toml").read_text().replace(
            'time_limit = "00:10:00"', 'time_limit = "00:03:00"'))
        assert 'time_limit = "00:10:00"' in JOB
        run.env.update(REFERENCE_ENV)
        run.env["OMNI_STEP_DELAY_S"] = STEP_DELAY_S
        job_id = run.submit()
        run.start_manager()
        run.wait_watching(job_id)
        ckpt = run.heartbeat_dir.parent
        sup_log = tmp_path / "logs" / f"{NAME}-{job_id}.supervisor.log"
        runner = run.runner()
        successor_name = f"omni-{job_id}-successor-0"

        def say() -> str:
            return sup_log.read_text(errors="replace")[-4000:] if sup_log.exists() else "(no supervisor log)"

        def status() -> SupervisorStatus:
            return read_status(status_path(ckpt, str(job_id))) or SupervisorStatus(
                slurm_job_id=str(job_id), phase="waiting", updated_at=0.0)

        def slurm_state(job: str) -> str:
            return runner.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()

        try:
            reference = start_reference(tmp_path / "job.toml", tmp_path / "reference")
            run.wait_steps(job_id, 2, 3, timeout_s=120)
            # asked for while the step trains, ahead of the stop
            def asked() -> Successor | None:
                succ = SupervisorJournal(journal_path(ckpt, str(job_id))).state.successors.get(successor_name)
                return succ if succ is not None and succ.job_id else None
            successor = wait_until(asked, 150, f"the successor's request\n{say()}", interval_s=0.5).job_id
            run.extra_jobs.add(int(successor))
            assert status().phase in ("running", "stopping"), say()
            shown = runner.run(["scontrol", "show", "job", "-o", successor]).stdout
            assert f"JobName={successor_name}" in shown and "Partition=debug" in shown and "NumNodes=2" in shown, shown
            # the next launch runs on it, the first allocation ends, the manager follows
            wait_until(lambda: any(la.allocation == successor for la in
                                   SupervisorJournal(journal_path(ckpt, str(job_id))).state.launches), 90,
                       f"the move\n{say()}", interval_s=0.5)
            wait_until(lambda: slurm_state(str(job_id)) == "", 60, f"allocation {job_id} to end\n{say()}")
            # the supervisor SIGKILLed once the job trains in the successor: the manager starts another,
            # which finds the allocation the job runs in from its journal and adopts the launch there
            def moved_and_stepping() -> bool:
                launches = SupervisorJournal(journal_path(ckpt, str(job_id))).state.launches
                return any(la.allocation == successor and la.first_step_at is not None for la in launches)
            wait_until(moved_and_stepping, 90, f"the first step on the successor\n{say()}", interval_s=0.5)
            old = read_process(ckpt, str(job_id))
            assert old is not None and process_alive(old)
            os.kill(old.pid, signal.SIGKILL)
            wait_until(lambda: (p := read_process(ckpt, str(job_id))) is not None and p.pid != old.pid
                       and process_alive(p), 60, f"a new supervisor\n{run.manager_log()[-3000:]}")
            wait_until(lambda: status().phase == "done", 240, f"training to finish\n{say()}", interval_s=1.0)
            held = {s.job_id for s in SupervisorJournal(journal_path(ckpt, str(job_id))).state.successors.values()}
            wait_until(lambda: all(slurm_state(j) == "" for j in held), 60, "every allocation to be released")
            wait_until(lambda: run.rows("SELECT state FROM jobs WHERE name = ?", run.key) == [("done",)], 60,
                       f"the manager to close the job\n{run.manager_log()}")
            ref_metrics = finish_reference(reference, tmp_path / "reference", 300)
        finally:
            for jid in runner.run(["squeue", "-h", "-o", "%i %j"], check=False).stdout.splitlines():
                if f"omni-{job_id}-successor-" in jid:
                    runner.run(["scancel", jid.split()[0]], check=False)

        journal = SupervisorJournal(journal_path(ckpt, str(job_id))).state
        assert journal.outcome == "done", say()
        moves = [la for la in journal.launches if la.cause == SUCCESSOR]
        assert moves and moves[0].allocation == successor, [(la.number, la.cause, la.allocation)
                                                           for la in journal.launches]
        before = journal.launches[moves[0].number - 1]
        assert before.ended == EXIT_CHECKPOINTED, say()               # the planned save
        assert set(moves[0].layout.nodes) <= set(journal.successors[successor_name].nodes)
        assert "asked for successor allocation" in say() and "released (the job runs in" in say()
        # the restarted supervisor ran in the successor: it adopted the launch there (no relaunch)
        full = sup_log.read_text(errors="replace")
        assert f"launch {moves[0].number} (" in full and ": adopted" in full, full[-4000:]
        assert [la.cause for la in journal.launches[1:]] == [SUCCESSOR] * (len(journal.launches) - 1), say()
        # the manager neither resubmitted nor lost the job: it followed it to the successor
        manager_log = run.manager_log()
        assert f"runs in allocation {successor} now (after Slurm job {job_id})" in manager_log, manager_log[-3000:]
        assert "submitted as Slurm job" not in manager_log and "not resubmitting" not in manager_log, manager_log
        # the launch on the successor resumed at the step the save wrote
        text = (ckpt / "supervisor" / f"omni-{job_id}-launch-{moves[0].number}.log").read_text(errors="replace")
        resumed = {line.split("resumed at step ")[1].split()[0] for line in text.splitlines()
                   if "resumed at step" in line}
        assert len(resumed) == 1, text[-2000:]
        steps = _steps(tmp_path / "metrics")
        assert steps == list(range(MAX_STEPS)) or len(set(steps)) == MAX_STEPS, steps[:5]
        hist, ref = load_history(tmp_path / "metrics" / NAME), load_history(ref_metrics)
        exact = compare_losses(hist.losses(), ref.losses(), bitwise=True, rtol=0.0)
        assert exact.ok and exact.steps_compared == MAX_STEPS, exact
        eq = check_equivalence(hist, ref)
        assert eq.ok, eq.summary()
        assert eq.data is not None and eq.data.ok, eq.summary()          # every sample id exactly once
