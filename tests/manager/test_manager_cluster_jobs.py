"""The manager against the embedded cluster, the cases beside a failure: the runtime's own exits
(75 after a requeue signal, 0 when done) are no failures, a failed array task is requeued alone,
and what is not the manager's (another uid's job or record, a spool others can write) is refused.
Real jobs throughout: the tiny training job where heartbeats matter, ``sbatch --wrap`` otherwise."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from manager_cluster_support import ManagerRun, job_file_text, make_shards, manager_run
from multiuser.multiuser_support import User, lookup
from support import wait_until

from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.elastic.codes import EXIT_CHECKPOINTED
from slurm_omni.ownership import current_user
from slurm_omni.render.registry import RegistryRecord, register, registered_stages
from slurm_omni.render.request import plan_stages
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.types import JobState

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

NOBODY = 65534


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(Path(__file__).resolve().parents[2] / "spank")], check=True,
                   capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("manager-jobs-data"))


@pytest.fixture
def bob() -> User:
    """The unprivileged user whose job the manager must refuse (scripts/setup.sh creates him)."""
    if os.geteuid() != 0:
        pytest.skip("submitting as bob needs root")
    try:
        return lookup("bob")
    except KeyError:
        pytest.skip("user bob is missing: run scripts/setup.sh as root")


def _start_now(runner: CommandRunner, job_ids: list[int]) -> None:
    """Slurm 22.05 holds a requeued job back (BeginTime) for a while; skip the wait, not the requeue.
    Not at once: started again within the second of the requeue, the job was refused on the cluster
    ("Killing non-startable batch JobId=...: Job credential revoked")."""
    time.sleep(2)
    for job_id in job_ids:
        runner.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)


def _observations(run: ManagerRun, key: str, kind: str) -> list[dict[str, object]]:
    return [json.loads(p) for (p,) in run.rows("SELECT payload FROM observations WHERE job = ? AND kind = ? "
                                                "ORDER BY id", key, kind)]


def _register(run: ManagerRun, job_id: int, name: str) -> Path:
    """A registry record as ``omni submit`` writes it, for a job submitted some other way."""
    job_file = run.tmp / "job.toml"
    job, site = load_job(job_file), load_site(run.site)
    return register(site.manager.registry_dir, RegistryRecord(
        job_id=job_id, kind="het", name=name, cluster=site.cluster, job_file=job_file,
        job_sha256=hashlib.sha256(job_file.read_bytes()).hexdigest(), script=None,
        ckpt_dir=site.checkpoint.job_dir(current_user(), name), data_parallel_size=1, max_requeues=3,
        stages=registered_stages(plan_stages(job, site))))


def test_checkpointed_exit_75_and_done_exit_0_are_not_failures(slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-exits",
                     max_steps=30) as run:
        job_id = run.submit()
        run.start_manager()
        run.wait_steps(job_id, 2, 7)                       # a checkpoint every 5 steps
        runner = run.runner()
        # The requeue signal as Slurm sends it before the time limit (--signal=B:USR1@T): the batch
        # shell forwards it, the ranks checkpoint and exit 75, the script requeues the job.
        runner.run(["scancel", "--batch", "--signal=USR1", str(job_id)])

        def requeued() -> bool:
            job = next((j for j in slurm_cluster.backend().jobs() if j.job_id == job_id), None)
            # every component: Slurm 22.05 requeues a het job's components one after the other
            return job is not None and job.restart_count == 1 and \
                all(c.state is JobState.PENDING for c in job.components)
        wait_until(requeued, 90, f"job {job_id} to requeue itself\n{run.job_log(job_id)}", interval_s=0.5)
        _start_now(runner, [job_id, job_id + 1])

        def done() -> bool:
            return bool(run.rows("SELECT 1 FROM jobs WHERE name = ? AND state = 'done'", run.key))
        wait_until(done, 180, f"{run.key} to finish\n{run.job_log(job_id)}\n{run.manager_log()}", interval_s=1.0)

        log = (tmp_path / "logs" / f"mgr-exits-{job_id}.out").read_text()
        assert "got SIGUSR1; forwarding it to the step" in log and f"requeueing job {job_id} (restart 1" in log
        assert log.rstrip().endswith("omni: step finished: training done")
        assert run.recoveries() == []
        assert {i["slurm_job_id"] for i in run.incarnations()} == {str(job_id)}   # never resubmitted
        exits = [o for o in _observations(run, run.key, "task_exit") if o.get("exit_code") == EXIT_CHECKPOINTED]
        assert exits, "the ranks' exit 75 reached the manager (SPANK records) and was journaled"
        (requeue,) = _observations(run, run.key, "requeued")
        assert requeue["checkpointed"] is True and requeue["lost_nodes"] == []
        assert not run.rows("SELECT verdict FROM decisions WHERE job = ? AND verdict = 'confirmed'", run.key)


def test_failed_array_task_is_requeued_alone(slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-arr") as run:
        files = []
        for task in (0, 1):
            path = tmp_path / f"task{task}.toml"
            path.write_text(job_file_text(f"mgr-arr{task}", tmp_path, shards))
            files.append(path)
        array_id = run.submit(*files)
        run.start_manager()
        backend = slurm_cluster.backend()

        def tasks() -> dict[int, object] | None:
            found = {j.array_task_id: j for j in backend.jobs() if j.array_job_id == array_id
                     and j.array_task_id is not None and j.slurm_state == "RUNNING"}
            return found if len(found) == 2 else None
        by_task = wait_until(tasks, 120, f"both tasks of array {array_id} to run", interval_s=1.0)
        ids = {t: j.job_id for t, j in by_task.items()}            # type: ignore[attr-defined]
        hb = {t: tmp_path / "ckpt" / current_user() / f"mgr-arr{t}" / "heartbeat" for t in (0, 1)}
        for t in (0, 1):
            run.wait_steps(ids[t], 2, 6, heartbeat_dir=hb[t])
        os.kill(run.beats(ids[1], hb[1])[1]["pid"], signal.SIGKILL)

        key = f"mgr-arr0-{array_id}_1"                             # the record's name: the first job file's

        def requeue_done() -> bool:
            return bool(run.rows("SELECT 1 FROM actions WHERE key = ? AND state = 'done'", f"requeue:{key}:0"))
        wait_until(requeue_done, 90, f"the manager to requeue {array_id}_1\n{run.manager_log()}", interval_s=0.5)

        def pending_again() -> bool:   # 26.05 carried the requeue out a second after scontrol returned
            job = next((j for j in backend.jobs() if j.job_id == ids[1]), None)
            return job is not None and job.restart_count == 1 and job.state is JobState.PENDING
        wait_until(pending_again, 60, f"Slurm to show {array_id}_1 requeued", interval_s=0.5)
        _start_now(run.runner(), [ids[1]])
        (rec,) = run.wait_recovery(1, "first_step", timeout_s=150, key=key)
        assert rec.cause == "task_exit" and rec.new_incarnation == 1 and rec.path == "requeued"
        # the first step is the next life's (heartbeats of restart count 1), seen after it ran again
        assert rec.times["running"] is not None and rec.times["first_step"] >= rec.times["running"], rec.times
        assert {b["incarnation"] for b in run.beats(ids[1], hb[1]).values()} == {1}
        assert run.rows("SELECT count(*) FROM decisions WHERE job = ? AND verdict = 'confirmed'", key) == [(1,)]

        jobs = {j.job_id: j for j in backend.jobs()}
        assert jobs[ids[1]].restart_count == 1 and jobs[ids[1]].array_task_id == 1   # the same task, again
        assert jobs[ids[0]].restart_count == 0 and jobs[ids[0]].slurm_state == "RUNNING"   # untouched
        assert run.recoveries(f"mgr-arr0-{array_id}_0") == []
        actions = [k for (k,) in run.rows("SELECT key FROM actions")]
        assert actions == [f"requeue:{key}:0"]                      # no cancel, no sbatch
        run.wait_steps(ids[1], 2, (rec.plan or {}).get("restore_step") or 1, heartbeat_dir=hb[1])


def test_foreign_jobs_and_records_and_an_open_spool_are_refused(slurm_cluster, shards: Path, tmp_path: Path,
                                                                 bob: User) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    own = spool / "root"                                            # this manager's folder of the spool
    own.mkdir(mode=0o700)
    with manager_run(tmp_path, slurm_cluster.env, spool, shards, name="mgr-refuse") as run:
        # Another user's job, registered in our registry: Slurm says whose it is. Submitted by bob
        # himself (sbatch --uid is refused on 24.11+: "Invalid --uid specification").
        submitted = bob.run("sbatch", "--parsable", "--hold", "--job-name=mgr-foreign", "--output=/dev/null",
                            "--wrap=sleep 300", env={**os.environ, **slurm_cluster.env}, cwd=Path("/"))
        assert submitted.returncode == 0, submitted.stderr
        foreign = int(submitted.stdout.strip().split(";")[0])
        run.extra_jobs.add(foreign)
        _register(run, foreign, "mgr-foreign")
        # Another user's record and a malformed one: set aside unread.
        other_record = _register(run, 999_999, "mgr-other")
        os.chown(other_record, NOBODY, NOBODY)
        (other_record.parent / "77.json").write_text('{"format": 1, "job_id": "77"}')
        # A job of ours whose task fails: the SPANK plugin writes a real fault record to the
        # cluster's spool (<spool>/root); it is moved into this manager's folder, which others can write.
        ckpt = tmp_path / "ckpt" / "mgr-refuse"
        failing = run.sbatch("--partition=debug", "--time=5",
                             f"--wrap=srun --omni-stage=vision:1 --omni-ckpt={ckpt} bash -c 'exit 3'; sleep 300")
        _register(run, failing, "mgr-refuse")
        record = wait_until(lambda: next(iter((slurm_cluster.spool / "root").glob(f"fault-{failing}.*.json")), None), 60,
                            f"the SPANK fault record of job {failing}", interval_s=0.5)
        assert json.loads(record.read_text())["exit_code"] == 3
        moved = own / record.name
        shutil.move(record, moved)
        own.chmod(0o755)

        run.start_manager()
        foreign_key, failing_key = f"mgr-foreign-{foreign}", f"mgr-refuse-{failing}"

        def refused() -> bool:
            return bool(run.rows("SELECT 1 FROM decisions WHERE job = ? AND verdict = 'refused' "
                                 "AND cause = 'foreign_job'", foreign_key))
        wait_until(refused, 60, f"the manager to refuse {foreign_key}\n{run.manager_log()}", interval_s=0.5)
        rejected = other_record.parent / "rejected"
        assert sorted(p.name for p in rejected.iterdir()) == ["77.json", other_record.name]
        time.sleep(3)                                               # a dozen ticks with the spool open
        assert moved.exists() and _observations(run, failing_key, "task_exit") == []
        assert f"events: spool: couldn't use {own}: a directory of uid {os.geteuid()} with mode 0755" in run.manager_log()

        own.chmod(0o700)                                            # private again: read and consumed
        wait_until(lambda: not moved.exists(), 30, f"{moved.name} to be consumed", interval_s=0.5)
        (exit_record,) = _observations(run, failing_key, "task_exit")
        assert exit_record["exit_code"] == 3 and exit_record["job_id"] == failing

        (held,) = [j for j in slurm_cluster.backend().jobs() if j.job_id == foreign]
        assert held.slurm_state == "PENDING" and held.user == bob.name          # not cancelled
        assert not run.rows("SELECT key FROM actions")
        assert [n for (n,) in run.rows("SELECT name FROM jobs ORDER BY name")] == [foreign_key, failing_key]


def test_a_job_cancelled_by_its_user_stays_cancelled(slurm_cluster, shards: Path, tmp_path: Path) -> None:
    """scancel's SIGTERM makes the ranks checkpoint and exit 75, as the requeue signal does; neither
    the batch script nor the manager may bring the job back."""
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-cancel") as run:
        job_id = run.submit()
        run.start_manager()
        run.wait_steps(job_id, 2, 3)
        run.runner().run(["scancel", str(job_id)])

        def cancelled() -> bool:
            return bool(run.rows("SELECT 1 FROM jobs WHERE name = ? AND state = 'cancelled'", run.key))
        wait_until(cancelled, 60, f"{run.key} to be cancelled\n{run.manager_log()}", interval_s=0.5)
        # The job is CANCELLED as soon as one component is (24.11+ list the leader as
        # ["CANCELLED", "COMPLETING"] while its batch shell stops): wait for all of it to end.
        backend = slurm_cluster.backend()

        def ended() -> object:
            job = next((j for j in backend.jobs() if j.job_id == job_id), None)
            return job if job is not None and all(c.state.finished for c in job.components) else None
        job = wait_until(ended, 60, f"job {job_id} to end in Slurm", interval_s=0.5)
        time.sleep(3)                                               # a dozen ticks and a few polls later
        log = (tmp_path / "logs" / f"mgr-cancel-{job_id}.out").read_text()
        assert "got SIGTERM; forwarding it to the step" in log and "not requeueing" in log, log[-2000:]
        assert "requeueing job" not in log
        assert job.slurm_state == "CANCELLED" and job.restart_count == 0
        assert run.recoveries() == [] and not run.rows("SELECT key FROM actions")
        (incarnation,) = run.incarnations()
        assert incarnation["end_reason"] == "cancelled in Slurm"
