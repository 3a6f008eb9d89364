"""Capacity comes back, on the embedded cluster with the real trainer (docs/allocation-mode.md, "Pool
allocations"): a job in allocation mode with no spare (vision and text on two nodes each, two
replicas) loses a text node while every other node runs a filler job. The supervisor relaunches it
shrunk in the same Slurm job (one replica) and asks Slurm for a pool allocation of the node it
misses, which waits behind the filler while training goes on. The filler ends, the pool starts, the
ranks checkpoint, and the next launch grows the job back to two replicas across the two allocations
(one srun each, one rendezvous). Training runs to its last step; the pool and the allocation are
released. The supervisor SIGKILLed while the grown launch trains and started again adopts both
sruns from its journal (no relaunch) and releases the pool at the end. The loss is bitwise the
reference's before the shrink and within tolerance after (another reduction order), and every sample
id is consumed exactly once. About 2 minutes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import REPO, allocation_site, make_shards, manager_run
from support import wait_until

from slurm_omni.drill.equivalence import check_equivalence, compare_losses
from slurm_omni.drill.history import load_history
from slurm_omni.drill.reference import JOB_ENV as REFERENCE_ENV
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.formats.metrics import read_tree
from slurm_omni.formats.supervisor import SupervisorStatus
from slurm_omni.policy.pools import GROW
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path, read_status, status_path
from slurm_omni.supervisor.outside import process_alive, read_process

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(480)]

MAX_STEPS = 100
NAME = "pool-grow"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("pool-grow-data"))


def _site(tmp: Path, spool: Path) -> str:
    return allocation_site(tmp, spool)


def _dp_steps(metrics: Path, dp: int) -> list[int]:
    steps = []
    for lines in read_tree(metrics).values():   # own files and node files
        for _, line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("data_parallel_size") == dp and "step" in rec:
                steps.append(int(rec["step"]))
    return sorted(steps)


def test_a_shrunk_job_grows_back_when_its_pool_allocation_starts_behind_a_filler(slurm_cluster, shards: Path,
                                                                                 tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name=NAME, dp=2,
                     max_steps=MAX_STEPS) as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool))
        run.env.update(REFERENCE_ENV)
        job_id = run.submit()
        ckpt = run.heartbeat_dir.parent
        sup_log = tmp_path / "logs" / f"{NAME}-{job_id}.supervisor.log"
        pool_name = f"omni-{job_id}-pool-0"
        runner = run.runner()

        def say() -> str:
            return sup_log.read_text(errors="replace")[-4000:] if sup_log.exists() else "(no supervisor log)"

        def status() -> SupervisorStatus:
            return read_status(status_path(ckpt, str(job_id))) or SupervisorStatus(
                slurm_job_id=str(job_id), phase="waiting", updated_at=0.0)

        restarted: list[subprocess.Popen[bytes]] = []
        try:
            reference = start_reference(tmp_path / "job.toml", tmp_path / "reference")
            run.wait_steps(job_id, 4, 8, timeout_s=180)                       # past the checkpoint at step 5
            # every other node busy: the pool must wait in the queue
            ours = status().nodes
            idle = runner.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).stdout.split()
            free = sorted({n for n in idle if n not in ours})
            filler = run.sbatch(f"--nodes={len(free)}", f"--nodelist={','.join(free)}", "--exclusive",
                                "--job-name=pool-filler", "--time=10", "--wrap=sleep 600")
            wait_until(lambda: runner.run(["squeue", "-h", "-j", str(filler), "-o", "%T"], check=False)
                       .stdout.strip() == "RUNNING", 60, "the filler to run")
            lost = status().components[1][-1]
            run.set_node(lost, "DOWN")
            # shrunk in the same Slurm job, and a pool asked for while it trains
            wait_until(lambda: status().data_parallel_size == 1 and status().phase == "running", 120,
                       f"the shrink\n{say()}", interval_s=0.5)
            pool = wait_until(lambda: next((p for p in status().pools if p.state == "requested"), None), 60,
                              f"a pool request\n{say()}", interval_s=0.5)
            pool_job = pool.slurm_job_id
            run.extra_jobs.add(int(pool_job))
            assert runner.run(["squeue", "-h", "-j", pool_job, "-o", "%T"]).stdout.strip() == "PENDING"
            shown = runner.run(["scontrol", "show", "job", "-o", pool_job]).stdout
            assert re.search(r"NumNodes=1(-1)? ", shown) and "Partition=debug" in shown and f"JobName={pool_name}" in shown, shown
            shrunk_at = status().launch
            wait_until(lambda: len([s for s in _dp_steps(tmp_path / "metrics", 1)]) >= 3, 120,
                       f"three steps shrunk\n{say()}", interval_s=0.5)
            # the filler ends: the pool starts, the next launch spans both allocations at full size
            runner.run(["scancel", str(filler)])
            wait_until(lambda: status().data_parallel_size == 2 and status().launch != shrunk_at, 120,
                       f"the grow-back\n{say()}", interval_s=0.5)
            # the supervisor SIGKILLed while the grown launch trains, and started again (as the manager
            # would): it adopts both sruns from its journal (no relaunch) and knows its pool
            def grown_steps() -> int | None:
                cur = SupervisorJournal(journal_path(ckpt, str(job_id))).state.current
                return cur.number if cur is not None and cur.cause == GROW and cur.first_step_at is not None else None
            grown_number = wait_until(grown_steps, 120, f"the grown launch's first step\n{say()}", interval_s=0.5)
            old = read_process(ckpt, str(job_id))
            assert old is not None and process_alive(old)
            argv = [a.decode() for a in Path(f"/proc/{old.pid}/cmdline").read_bytes().split(b"\0")[:-1]]
            environ = dict(kv.decode().split("=", 1) for kv in Path(f"/proc/{old.pid}/environ").read_bytes()
                           .split(b"\0") if b"=" in kv)
            os.kill(old.pid, signal.SIGKILL)
            wait_until(lambda: not process_alive(old), 30, "the supervisor to die")
            with open(sup_log, "ab") as log:
                restarted.append(subprocess.Popen(argv, env=environ, stdout=log, stderr=log, start_new_session=True))
            wait_until(lambda: status().phase == "done", 240, f"training to finish\n{say()}", interval_s=1.0)
            wait_until(lambda: not runner.run(["squeue", "-h", "-j", f"{job_id},{pool_job}"], check=False)
                       .stdout.strip(), 60, "the allocation and its pool to be released")
            ref_metrics = finish_reference(reference, tmp_path / "reference", 300)
            assert restarted[0].wait(timeout=60) == 0, say()
        finally:
            for proc in restarted:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            runner.run(["scontrol", "update", f"nodename={lost if 'lost' in locals() else 'node1'}",
                        "state=resume"], check=False)
            for jid in runner.run(["squeue", "-h", f"--name={pool_name}", "-o", "%i"], check=False).stdout.split():
                runner.run(["scancel", jid], check=False)

        journal = SupervisorJournal(journal_path(ckpt, str(job_id))).state
        assert journal.outcome == "done", say()
        assert journal.current is not None and journal.current.number == grown_number, say()   # adopted
        assert "adopted" in say()
        causes = [(la.cause, la.data_parallel_size) for la in journal.launches]
        grow = next(la for la in journal.launches if la.cause == GROW)
        assert causes[0][1] == 2 and 1 in [dp for _, dp in causes] and grow.data_parallel_size == 2, causes
        assert len(grow.extra) == 1 and grow.extra[0][0] == pool_job      # one srun per allocation
        (granted,) = journal.pools.values()
        assert granted.job_id == pool_job and granted.state == "released"
        assert len(granted.nodes) == 1 and set(granted.nodes) <= set(grow.layout.nodes)
        # every rank of the grown launch resumed at the step the shrunk one checkpointed
        text = (ckpt / "supervisor" / f"omni-{job_id}-launch-{grow.number}.log").read_text(errors="replace")
        resumed = {line.split("resumed at step ")[1].split()[0] for line in text.splitlines()
                   if "resumed at step" in line}
        assert len(resumed) == 1, text[-2000:]
        hist, ref = load_history(tmp_path / "metrics" / NAME), load_history(ref_metrics)
        shrink_step = min(_dp_steps(tmp_path / "metrics", 1))
        exact = compare_losses({k: v for k, v in hist.losses().items() if k < shrink_step},
                               {k: v for k, v in ref.losses().items() if k < shrink_step}, bitwise=True, rtol=0.0)
        assert exact.ok and exact.steps_compared >= 3, exact
        eq = check_equivalence(hist, ref)
        assert eq.ok, eq.summary()
        assert eq.loss.steps_compared == MAX_STEPS
        assert eq.data is not None and eq.data.ok, eq.summary()          # every sample id exactly once
