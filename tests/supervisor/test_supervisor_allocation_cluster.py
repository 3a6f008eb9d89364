"""On the embedded cluster, the step supervisor outside its allocation (allocation mode) with bash
ranks, not the trainer (the trainer's run is tests/manager/test_manager_allocation_mode.py): a
second supervisor of the same job leaves at once (the lock), and with no batch shell to get Slurm's
``--signal`` the supervisor itself signals the ranks its lead before the time limit: they
checkpoint (exit 75), it stops without a relaunch, and the allocation is left to its limit (the
manager resubmits from there). Its host restarted (the supervisor and its sruns killed at once: a
step dies with its srun): a new supervisor relaunches from the journal exactly once, in the same
allocation, and gives the allocation back when training is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.ownership import current_user
from slurm_omni.render import HetJobRequest
from slurm_omni.render.allocation import AllocationRequest
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.salloc import request_allocation
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path, read_status, status_path

pytestmark = pytest.mark.cluster

DATA = Path(__file__).resolve().parents[1] / "templates" / "data"

# A rank: says where it runs; checkpoints on USR1 (exit 75); ends 0 once told "done".
RANK = ('trap "exit 75" USR1; echo "$OMNI_LAUNCH $RANK $SLURMD_NODENAME" >> "$0/ranks"; '
        'while [[ ! -e "$0/done" ]]; do sleep 0.2 & wait $!; done')


def _allocation(slurm_cluster, tmp_path: Path, *, time_limit: str) -> tuple[AllocationRequest, Path]:
    site = load_site(DATA / "site.toml")
    site = replace(site, stages={n: replace(s, partition="debug") for n, s in site.stages.items()},
                   use_spank_plugin=False, checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"),
                   elasticity=replace(site.elasticity, recovery="allocation", allow_allocation=True, default_spares=0),
                   manager=replace(site.manager, spool_dir=slurm_cluster.spool, registry_dir=tmp_path / "registry"))
    job = load_job(DATA / "job.toml")
    (tmp_path / "logs").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    job = replace(job, job=replace(job.job, log_dir=tmp_path / "logs", time_limit=time_limit, signal_before_s=60,
                                                  data_parallel_size=1),
                  stages=[replace(s, nodes=1, tasks_per_node=1) for s in job.stages])
    return AllocationRequest(HetJobRequest(job=job, site=site, job_file=tmp_path / "job.toml", job_sha256="0" * 64,
                                           command=("bash", "-c", RANK, str(work)))), work


def _env(slurm_cluster, alloc: AllocationRequest, job_id: int) -> dict[str, str]:
    return {**os.environ, **slurm_cluster.env, **alloc.supervisor_env(job_id), "OMNI_STANDBY": "0",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def _lines(work: Path) -> list[list[str]]:
    path = work / "ranks"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_one_supervisor_per_allocation_and_it_stops_the_step_before_the_time_limit(slurm_cluster,
                                                                                    tmp_path: Path) -> None:
    alloc, work = _allocation(slurm_cluster, tmp_path, time_limit="00:02:00")
    site, job = alloc.request.site, alloc.request.job
    runner = CommandRunner(slurm_cluster.env)
    job_id = request_allocation(runner, alloc.salloc_argv(), tmp_path / "logs" / "salloc.out")
    ckpt = site.checkpoint.job_dir(current_user(), job.job.name)
    # the lead: the step is stopped as soon as the allocation runs (its limit is 120 s away: about 20 s in)
    argv = [a if not a.startswith("--stop-before=") else "--stop-before=100" for a in alloc.supervisor_argv(job_id)]
    env = _env(slurm_cluster, alloc, job_id)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(tmp_path / "logs" / "supervisor.log", "ab") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
            wait_until(lambda: (work / "ranks").exists() and len((work / "ranks").read_text().splitlines()) == 2, 90,
                       "launch 0's two ranks")
            second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 0 and "already has a supervisor" in second.stderr, second.stderr
        assert procs[0].wait(timeout=60) == 75                         # checkpointed, stopped
    finally:
        (work / "done").touch()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        state = runner.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False).stdout.strip()
        runner.run(["scancel", str(job_id)], check=False)
    assert state == "RUNNING"                                          # left to its time limit, not released
    journal = SupervisorJournal(journal_path(ckpt, str(job_id))).state
    assert [la.number for la in journal.launches] == [0] and journal.outcome == ""
    status = read_status(status_path(ckpt, str(job_id)))
    assert status is not None and status.phase == "stopped"
    text = (tmp_path / "logs" / "supervisor.log").read_text()
    assert "SIGUSR1 to the step" in text and "SIGSIG" not in text, text


def test_a_restarted_host_costs_one_relaunch_from_the_journal_in_the_same_allocation(slurm_cluster,
                                                                                   tmp_path: Path) -> None:
    alloc, work = _allocation(slurm_cluster, tmp_path, time_limit="00:10:00")
    runner = CommandRunner(slurm_cluster.env)
    job_id = request_allocation(runner, alloc.salloc_argv(), tmp_path / "logs" / "salloc.out")
    ckpt = alloc.request.site.checkpoint.job_dir(current_user(), alloc.request.job.job.name)
    env = _env(slurm_cluster, alloc, job_id)
    argv = alloc.supervisor_argv(job_id)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(tmp_path / "logs" / "supervisor.log", "ab") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True))
            wait_until(lambda: len(_lines(work)) == 2, 90, "launch 0's two ranks")
            # the host restarted: the supervisor and every srun it started die at once
            os.killpg(procs[0].pid, signal.SIGKILL)
            procs[0].wait(timeout=30)
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True))
            relaunched = wait_until(lambda: [ln for ln in _lines(work) if ln[0] == "1"] or None, 90, "launch 1")
            wait_until(lambda: len([ln for ln in _lines(work) if ln[0] == "1"]) == 2, 30, "launch 1's two ranks")
            (work / "done").touch()
            assert procs[1].wait(timeout=90) == 0
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 60,
                   "the allocation to be given back")
    finally:
        (work / "done").touch()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        runner.run(["scancel", str(job_id)], check=False)
    assert relaunched
    journal = SupervisorJournal(journal_path(ckpt, str(job_id))).state
    assert [la.number for la in journal.launches] == [0, 1] and journal.outcome == "done"
    assert journal.launches[1].removed == () and journal.launches[1].layout.components == \
        journal.launches[0].layout.components                         # in place: no node was lost
