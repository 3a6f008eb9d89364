"""On the embedded cluster: an in-allocation job whose step supervisor relaunches the step inside the
same Slurm job: a lost node replaced by a spare (with the supervisor SIGKILLed in the middle of that
relaunch and started again by the batch script: exactly one relaunch), a crashed rank relaunched in
place, and training "done" ending the job. The ranks are a small bash loop: what is under test is the
supervisor and Slurm, not the trainer (tests/drill has the training run)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.cli.submit import parse_sbatch_id
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.ownership import current_user
from slurm_omni.render import HetJobRequest
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path, read_status, status_path

pytestmark = pytest.mark.cluster

DATA = Path(__file__).resolve().parents[1] / "templates" / "data"

# A rank: says where it runs, keeps its pid where the test can kill it, ends 0 once told "done".
RANK = ('echo "$OMNI_LAUNCH $RANK $OMNI_STAGE $SLURMD_NODENAME" >> "$0/ranks"; echo $$ > "$0/pid-$RANK"; '
        'while [[ ! -e "$0/done" ]]; do sleep 0.2; done')


def _request(tmp_path: Path, spool: Path) -> tuple[HetJobRequest, Path]:
    site = load_site(DATA / "site.toml")
    stages = {n: replace(s, partition="debug") for n, s in site.stages.items()}
    site = replace(site, stages=stages, use_spank_plugin=False,
                   checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"),
                   elasticity=replace(site.elasticity, recovery="in_allocation", default_spares=1),
                   manager=replace(site.manager, spool_dir=spool, registry_dir=tmp_path / "registry"))
    job = load_job(DATA / "job.toml")
    (tmp_path / "logs").mkdir()
    job = replace(job, job=replace(job.job, log_dir=tmp_path / "logs"),
                  stages=[replace(s, nodes=2, tasks_per_node=1) for s in job.stages])
    work = tmp_path / "work"
    work.mkdir()
    return HetJobRequest(job=job, site=site, job_file=tmp_path / "job.toml", job_sha256="0" * 64,
                         command=("bash", "-c", RANK, str(work))), work


def _launches(work: Path) -> dict[int, list[tuple[int, int, str]]]:
    out: dict[int, list[tuple[int, int, str]]] = {}
    for line in (work / "ranks").read_text().splitlines() if (work / "ranks").exists() else ():
        launch, rank, stage, node = line.split()
        out.setdefault(int(launch), []).append((int(rank), int(stage), node))
    return out


def test_node_loss_and_rank_crash_relaunch_inside_the_same_job(slurm_cluster, tmp_path: Path) -> None:
    runner = CommandRunner(slurm_cluster.env)
    request, work = _request(tmp_path, slurm_cluster.spool)
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMNI_SUPERVISOR_CRASH_AT": "relaunch:after_start"}
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize(), env=env).stdout)
    ckpt = request.site.checkpoint.job_dir(current_user(), request.job.job.name)
    lost = ""
    try:
        first = wait_until(lambda: len(_launches(work).get(0, [])) == 4 and _launches(work)[0], 120,
                           "launch 0 to run its 4 ranks")
        status = read_status(status_path(ckpt, str(job_id)))
        assert status is not None and status.phase == "running" and len(status.spares) == 2
        lost = next(node for rank, stage, node in first if stage == 1)      # a text node
        runner.run(["scontrol", "update", f"nodename={lost}", "state=DOWN", "reason=omni-test"])
        second = wait_until(lambda: len(_launches(work).get(1, [])) == 4 and _launches(work)[1], 120,
                            "launch 1 on the survivors and a spare")
        assert lost not in {node for _, _, node in second}
        assert sorted(r for r, _, _ in second) == [0, 1, 2, 3]
        out = runner.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        assert "JobState=RUNNING" in out and lost not in expand(out.split(" NodeList=")[1].split()[0])
        # the supervisor was SIGKILLed right after starting launch 1; its successor adopts that step
        wait_until(lambda: "adopted" in next((tmp_path / "logs").glob("*.out")).read_text(), 60,
                   "the restarted supervisor to adopt launch 1")
        # a rank killed on a healthy node: relaunched where it ran (launch 2), the same job still
        os.kill(int((work / "pid-0").read_text()), 9)
        third = wait_until(lambda: len(_launches(work).get(2, [])) == 4 and _launches(work)[2], 120,
                           "launch 2 after the crashed rank")
        assert sorted(n for _, _, n in third) == sorted(n for _, _, n in second)
        (work / "done").touch()
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 90,
                   "the job to finish")
    finally:
        (work / "done").touch()
        if lost:
            runner.run(["scontrol", "update", f"nodename={lost}", "state=RESUME"], check=False)
        runner.run(["scancel", str(job_id)], check=False)
    state = SupervisorJournal(journal_path(ckpt, str(job_id))).state
    assert [la.number for la in state.launches] == [0, 1, 2] and state.outcome == "done"
    assert state.launches[1].removed == (lost,) and len(state.launches[1].added) == 1
    assert state.launches[2].removed == () and state.launches[2].cause == "task_exit"
    log = next((tmp_path / "logs").glob("*.out")).read_text()
    assert "supervisor killed" in log                        # the crash drill happened...
    assert sum(1 for line in log.splitlines() if "adopted" in line) == 1     # ...and launch 1 was adopted
    doc = json.loads(status_path(ckpt, str(job_id)).read_text())
    assert doc["phase"] == "done" and [r["removed"] for r in doc["recoveries"]] == [[lost], []]
    assert all(r["slurm_job_id_after"] == str(job_id) for r in doc["recoveries"])


def test_no_spare_shrinks_inside_the_job_and_a_lost_batch_host_ends_the_allocation(slurm_cluster, tmp_path: Path) -> None:
    """No spare: the relaunch runs one replica instead of two, same job. The batch host lost: the
    supervisor goes with it and Slurm ends the job (22.05: FAILED, JobLaunchFailure; no requeue),
    which is the manager's to resubmit (its takeover is tested in tests/manager). 26.05 keeps the
    --no-kill job RUNNING without its batch host (docs/slurm-versions.md); the supervisor, alive
    there on this one-machine cluster, sees its own node lost and hands over: the job ends as well."""
    runner = CommandRunner(slurm_cluster.env)
    request, work = _request(tmp_path, slurm_cluster.spool)
    site = replace(request.site, elasticity=replace(request.site.elasticity, default_spares=0))
    request = replace(request, site=site, command=("bash", "-c", RANK.replace(
        '"$OMNI_LAUNCH $RANK', '"${SLURM_RESTART_COUNT:-0}.$OMNI_LAUNCH $OMNI_DP_SIZE $RANK'), str(work)))
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize(), env=env).stdout)
    ckpt = request.site.checkpoint.job_dir(current_user(), request.job.job.name)
    down: list[str] = []

    def lines(life: str) -> list[list[str]]:
        path = work / "ranks"
        return [line.split()[1:] for line in (path.read_text().splitlines() if path.exists() else ())
                if line.split()[0] == life]

    try:
        first = wait_until(lambda: len(lines("0.0")) == 4 and lines("0.0"), 120, "launch 0 on 4 nodes")
        text_node = next(node for _, _, stage, node in first if stage == "1")
        runner.run(["scontrol", "update", f"nodename={text_node}", "state=DOWN", "reason=omni-test"])
        down.append(text_node)
        shrunk = wait_until(lambda: len(lines("0.1")) == 2 and lines("0.1"), 120, "launch 1, shrunk to dp 1")
        assert {dp for dp, _, _, _ in shrunk} == {"1"} and text_node not in {n for *_, n in shrunk}
        status = read_status(status_path(ckpt, str(job_id)))
        assert status is not None and status.data_parallel_size == 1 and status.path == "in_allocation"
        assert status.recoveries[0].data_parallel_size_before == 2
        report = json.loads((ckpt / "supervisor" / "relaunched-1.json").read_text())
        assert report["slurm_job_id"] == str(job_id) and report["data_parallel_size"] == 1
        batch_host = runner.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout.split(" BatchHost=")[1].split()[0]
        runner.run(["scontrol", "update", f"nodename={batch_host}", "state=DOWN", "reason=omni-test"])
        down.append(batch_host)
        wait_until(lambda: "RUNNING" not in runner.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                                                       check=False).stdout, 90, "the allocation to end")
    finally:
        (work / "done").touch()
        for node in down:
            runner.run(["scontrol", "update", f"nodename={node}", "state=RESUME"], check=False)
        runner.run(["scancel", str(job_id)], check=False)
    state = SupervisorJournal(journal_path(ckpt, str(job_id))).state
    # no relaunch after it: the supervisor died with the job, or it handed over
    assert [la.number for la in state.launches] == [0, 1] and state.outcome in ("", "fallback"), state.outcome


@pytest.mark.parametrize("spares", [1, 0], ids=["a-spare", "no-spare-shrink"])
def test_a_planned_request_moves_a_node_to_a_spare_or_drops_its_replica_at_a_checkpoint(
        slurm_cluster, tmp_path: Path, spares: int) -> None:
    """The fail-slow hook: a request file names a node; the ranks are told to checkpoint and stop
    (SIGUSR1, exit 75 here), and the next launch runs on a spare instead, in the same job. With no
    spare left, a request that allows a shrink (the manager's estimate: one healthy replica beats
    two with a slow one) launches one replica without the node; one that does not is refused."""
    runner = CommandRunner(slurm_cluster.env)
    request, work = _request(tmp_path, slurm_cluster.spool)
    rank = ('trap "exit 75" USR1; ' + RANK.replace("do sleep 0.2; done", "do sleep 0.2 & wait $!; done")
            .replace('"$OMNI_LAUNCH $RANK', '"$OMNI_LAUNCH $OMNI_DP_SIZE $RANK'))
    site = replace(request.site, elasticity=replace(request.site.elasticity, default_spares=spares))
    request = replace(request, site=site, command=("bash", "-c", rank, str(work)))
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize(), env=env).stdout)
    ckpt = request.site.checkpoint.job_dir(current_user(), request.job.job.name)
    folder = ckpt / "supervisor"

    def launch(n: int) -> list[tuple[str, str, str, str]] | None:
        path = work / "ranks"
        rows = [tuple(line.split()[1:]) for line in (path.read_text().splitlines() if path.exists() else ())
                if line.split()[0] == str(n)]
        return rows if len(rows) == (4 if n == 0 or spares else 2) else None   # (dp size, rank, stage, node)

    try:
        first = wait_until(lambda: launch(0), 120, "launch 0")
        slow = next(node for _, _, stage, node in first if stage == "1")
        if not spares:   # no spare, no shrink allowed: refused, the launch goes on
            (folder / f"{job_id}.request.json").write_text(json.dumps({"id": "slow-0", "replace": [slow]}))
            wait_until(lambda: "slow-0" in SupervisorJournal(journal_path(ckpt, str(job_id))).state.requests, 60,
                       "the answer to the request without a shrink")
        doc = {"id": "slow-1", "replace": [slow], **({} if spares else {"shrink": True})}
        (folder / f"{job_id}.request.json").write_text(json.dumps(doc))
        second = wait_until(lambda: launch(1), 120, "launch 1 without the slow node")
        assert slow not in {node for *_, node in second}
        assert {dp for dp, *_ in second} == {"2" if spares else "1"}
        (work / "done").touch()
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 90,
                   "the job to finish")
    finally:
        (work / "done").touch()
        runner.run(["scancel", str(job_id)], check=False)
    state = SupervisorJournal(journal_path(ckpt, str(job_id))).state
    assert state.requests == {"slow-1": "carried_out", **({} if spares else {"slow-0": "no_spare"})}
    assert state.outcome == "done"
    # a shrink drops the slow node's whole replica (its vision peer goes back to the spares)
    assert state.launches[1].cause == "planned" and slow in state.launches[1].removed
    assert len(state.launches[1].removed) == (1 if spares else 2)


# A rank of the built-in contract that refuses its input after its first step (a plain DataLoader
# handed to the checkpointer, say): its last beat says failed, exit code 78 and why; the others train
# on until srun kills them for it (srun itself then returns 137, not 78).
REFUSING_RANK = """
import os, sys, time
from pathlib import Path
from slurm_omni.elastic.heartbeat import Heartbeat
rank = int(os.environ["RANK"])
hb = Heartbeat(Path(os.environ["OMNI_HEARTBEAT_DIR"]), rank=rank, stage=0, dp_rank=0,
               incarnation=int(os.environ["OMNI_INCARNATION"]),
               job_id=os.environ.get("OMNI_JOB_ID") or os.environ["SLURM_JOB_ID"], interval_s=0.5)
hb.start()
hb.update(step=1, phase="training")
if rank == 0:
    time.sleep(1.0)
    hb.stop("failed", error="checkpoint: couldn't take 'data': a DataLoader has no state_dict()", exit_code=78)
    sys.exit(78)
while True:
    hb.update(step=1, phase="training")
    time.sleep(0.5)
"""


def test_a_rank_that_refuses_its_input_stops_the_job_with_no_relaunch(slurm_cluster, tmp_path: Path) -> None:
    """Exit 78 after the first heartbeat (bad input no relaunch can fix): the supervisor ends with 78 and
    the rank's line, after launch 0 only (before, srun's 137 read as a failure and it relaunched)."""
    runner = CommandRunner(slurm_cluster.env)
    request, _ = _request(tmp_path, slurm_cluster.spool)
    request = replace(request, command=(sys.executable, "-c", REFUSING_RANK))
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize(), env=env).stdout)
    ckpt = request.site.checkpoint.job_dir(current_user(), request.job.job.name)
    try:
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 150,
                   "the job to end")
    finally:
        runner.run(["scancel", str(job_id)], check=False)
    state = SupervisorJournal(journal_path(ckpt, str(job_id))).state
    assert [la.number for la in state.launches] == [0]
    log = next((tmp_path / "logs").glob("*.out")).read_text()
    assert "rank 0 refused its input: checkpoint: couldn't take 'data'" in log
    out = runner.run(["sacct", "-n", "-X", "-P", "-o", "ExitCode", "-j", str(job_id)], check=False).stdout
    assert not out.strip() or out.split()[0].startswith("78:")
