"""examples/own-script/train.py on the embedded cluster, submitted with ``omni submit`` from its job
file (fewer steps) and kept alive by the requeue manager, each run checked against the one
reference run that never failed (tests/elastic/conftest.py; the demo's equivalence check):

- the requeue signal as Slurm sends it before the time limit (``scancel --batch --signal=USR1``):
  the ranks save and exit 75, the batch script requeues the job, it resumes; then a SIGKILLed rank
  and then a node-down drill (``scontrol update state=DOWN``), each recovered by the manager; every
  life's loss is bitwise equal to the reference's at the same step;
- a node lost with no node to replace it (``spare_policy = "none"``): the manager shrinks dp 2 -> 1,
  the global batch stays 16 samples (accumulation 2 -> 4 micro-batches), and every sample id is
  consumed exactly once, read by StatefulDataLoader worker processes."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from manager.manager_cluster_support import BIN, ManagerRun, list_jobs
from omni_configs import site_toml
from own_script_support import own_job
from support import wait_until

from slurm_omni.drill.equivalence import check_equivalence
from slurm_omni.drill.history import RunHistory, load_history
from slurm_omni.drill.reference import JOB_ENV
from slurm_omni.elastic.codes import EXIT_CHECKPOINTED
from slurm_omni.slurm.types import JobState

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]

STEP_DELAY_S = "0.8"
"""Pacing (not part of the step's time, nor of the result): a fault lands between two steps."""


def _run(tmp: Path, cluster: Any, *, name: str, nodes: int, spare_policy: str) -> ManagerRun:
    own_job(tmp, name=name, nodes=nodes)
    tables = f'[elasticity]\nspare_policy = "{spare_policy}"\nquarantine_s = 3600\n'
    (tmp / "site.toml").write_text(site_toml(tmp, spool_dir=cluster.spool, tables=tables))
    env = {**os.environ, **cluster.env, **JOB_ENV, "OMNI_STEP_DELAY_S": STEP_DELAY_S,
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    return ManagerRun(tmp, env, name)


@pytest.fixture
def run_of(slurm_cluster: Any, tmp_path: Path) -> Iterator[Any]:
    runs: list[ManagerRun] = []

    def make(**kw: Any) -> ManagerRun:
        runs.append(_run(tmp_path, slurm_cluster, **kw))
        return runs[-1]
    yield make
    for run in runs:
        run.cleanup()


def _history(run: ManagerRun) -> RunHistory:
    return load_history(run.tmp / "metrics" / run.name)


def _wait_checkpointed(run: ManagerRun, job_id: int, ranks: int, step: int, saved: int) -> dict[int, dict[str, Any]]:
    """Every rank of ``job_id`` trains past ``step`` with step ``saved`` durable."""
    def probe() -> dict[int, dict[str, Any]] | None:
        b = run.beats(job_id)
        ok = len(b) == ranks and all(r["phase"] == "training" and r["step"] >= step
                                     and (r["last_checkpoint_step"] or 0) >= saved for r in b.values())
        return b if ok else None
    return wait_until(probe, 180, f"{ranks} ranks of job {job_id} past step {step} with step {saved} saved\n"
                      + run.job_log(job_id) + run.manager_log(), interval_s=0.2)


def _wait_done(run: ManagerRun) -> None:
    wait_until(lambda: run.rows("SELECT 1 FROM jobs WHERE name = ? AND state = 'done'", run.key), 240,
               f"{run.key} to finish\n{run.manager_log()}", interval_s=1.0)


def _bitwise_per_life(history: RunHistory, reference: RunHistory) -> set[int]:
    """Every logged step of every life has the reference's loss at that step, bit for bit; the lives."""
    ref = reference.losses()
    for r in history.records:
        assert r.loss is not None and r.loss == ref[r.step], (r, ref[r.step])
    return {r.incarnation for r in history.records}


def test_requeue_signal_then_a_killed_rank_then_a_node_down_each_resume_bitwise(
        run_of: Any, own_reference: Path) -> None:
    run = run_of(name="own-faults", nodes=1, spare_policy="any_switch")
    job_id = run.submit()
    run.start_manager()
    run.wait_watching(job_id)

    # (d) the requeue signal: save, exit 75, requeued by the batch script, resumed from that step
    run.wait_steps(job_id, 4, 3)
    runner = run.runner()
    runner.run(["scancel", "--batch", "--signal=USR1", str(job_id)])

    def requeued() -> bool:
        job = next((j for j in list_jobs(run.env) if j.job_id == job_id), None)
        return job is not None and job.restart_count == 1 and all(c.state is JobState.PENDING for c in job.components)
    wait_until(requeued, 120, f"job {job_id} to requeue itself\n{run.job_log(job_id)}", interval_s=0.5)
    beats = run.beats(job_id)
    saved = {b["last_checkpoint_step"] for b in beats.values()}
    assert {b["phase"] for b in beats.values()} == {"stopping"} and len(saved) == 1, beats
    assert {b["exit_code"] for b in beats.values()} == {EXIT_CHECKPOINTED}
    time.sleep(2)          # Slurm 22.05 holds a requeued job back (BeginTime): start it now
    for component in (job_id, job_id + 1):
        runner.run(["scontrol", "update", f"JobId={component}", "StartTime=now"], check=False)

    # (a) a SIGKILLed rank (its node stays up) in the requeued life, past the checkpoint of step 10
    beats = _wait_checkpointed(run, job_id, 4, 11, 10)
    assert {b["incarnation"] for b in beats.values()} == {1}
    os.kill(beats[3]["pid"], signal.SIGKILL)
    (killed,) = run.wait_recovery(1, "first_step", timeout_s=180)
    assert killed.cause == "task_exit" and killed.incarnation == 0

    # (b) a node-down drill in the next life, past its restore of step 10
    second = int(run.incarnations()[1]["slurm_job_id"])
    run.wait_steps(second, 4, 11)
    _, text = run.components(second)
    run.set_node(text[0], "DOWN", "omni-test-drill")
    down = run.wait_recovery(2, "first_step", timeout_s=180)[1]
    assert down.cause == "down" and text[0] in down.nodes
    _wait_done(run)

    log = (run.tmp / "logs" / f"{run.name}-{job_id}.out").read_text()    # every life of the first Slurm job
    assert "got SIGUSR1; forwarding it to the step" in log and f"requeueing job {job_id} (restart 1" in log
    history, reference = _history(run), load_history(own_reference)
    lives = _bitwise_per_life(history, reference)
    assert lives == {0, 1, 2, 3}, lives          # USR1's requeue, then two resubmissions
    # each life resumed right after the newest complete checkpoint (the ranks Slurm or the manager
    # stopped with SIGTERM may have saved one more step on their way out)
    restored = [i["layout"]["restore_step"] for i in run.incarnations()]
    first_of = {inc: min(r.step for r in history.incarnation_records(inc)) for inc in lives}
    assert first_of == {0: 1, 1: saved.pop() + 1, 2: restored[1] + 1, 3: restored[2] + 1}, (first_of, restored)
    assert restored[1] >= 10 and restored[2] >= 10
    eq = check_equivalence(history, reference)
    assert eq.ok and eq.loss.mode == "bitwise" and eq.data is not None and eq.data.paired, eq.summary()


def test_no_node_to_replace_a_lost_one_shrinks_to_dp1_keeping_the_global_batch_and_every_sample(
        run_of: Any, own_reference: Path) -> None:
    run = run_of(name="own-shrink", nodes=2, spare_policy="none")
    job_id = run.submit()
    run.start_manager()
    run.wait_watching(job_id)
    _wait_checkpointed(run, job_id, 4, 11, 10)
    _, text = run.components(job_id)
    run.set_node(text[1], "DOWN", "omni-test-drill")
    (rec,) = run.wait_recovery(1, "first_step", timeout_s=180)
    # a rank's fault record may come before the poll that shows the node DOWN; Slurm's requeue for the
    # lost node (JobRequeue) never does: a poll reads the jobs before the nodes (CliBackend.snapshot)
    assert rec.cause in ("down", "task_exit") and text[1] in rec.nodes, rec
    shrunk = run.incarnations()[1]
    assert shrunk["layout"]["data_parallel_size"] == 1
    _wait_done(run)

    history, reference = _history(run), load_history(own_reference)
    after = history.incarnation_records(1)
    assert {r.data_parallel_size for r in after} == {1}
    assert min(r.step for r in after) == shrunk["layout"]["restore_step"] + 1 >= 11
    # the global batch is kept: one replica reads all 16 samples of a step, 4 micro-batches of 4
    samples = [json.loads(line) for line in (run.tmp / "metrics" / "own-shrink" / "samples-text-0.jsonl").open()]
    per_step = {(s["incarnation"], s["dp_rank"]): len(s["ids"]) for s in samples}
    assert per_step[(0, 0)] == 8 and per_step[(1, 0)] == 16, per_step
    eq = check_equivalence(history, reference)
    assert eq.ok and eq.data is not None and eq.data.paired, eq.summary()
    assert eq.loss.mode == "tolerance"                        # another reduction order after the shrink
    assert not eq.data.skipped and not eq.data.repeated and not eq.data.misaligned
