"""One drill against a running job: wait for progress, inject, follow the recovery, put things back.

Times come from the manager's recovery timeline (``timeline.json`` in its state directory, the
format of ``slurm_omni.report.timeline``) when it holds a recovery confirmed after the fault;
otherwise from what the drill saw itself: the job leaving RUNNING in Slurm (Slurm's own requeue
confirms and acts at once) and running again, and the first step the next incarnation logged. The
fault time is always the drill's own clock at injection. Steps lost and throughput come from the
run's metrics either way.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from slurm_omni.checkpoint import format as ckpt_format
from slurm_omni.drill.history import HistoryError, RunHistory, load_history
from slurm_omni.drill.inject import DrillError, Injector
from slurm_omni.drill.job import JobHandle, latest_incarnation_step, pick_node, pick_task
from slurm_omni.drill.measure import DrillResult, DrillTimes, progress
from slurm_omni.errors import OmniError
from slurm_omni.report.timeline import Recovery, ReportInputError, load_timeline
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.types import HetComponent, Job, JobState

log = logging.getLogger(__name__)

DrillKind = Literal["node-down", "kill-rank", "stall-rank", "ckpt-crash", "slurmd-crash"]
KINDS: tuple[str, ...] = get_args(DrillKind)
RANK_KINDS = frozenset({"kill-rank", "stall-rank", "ckpt-crash"})
GONE_GRACE_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillSpec:
    kind: DrillKind
    node: str = ""
    """Node to drill; empty: the job's last node inside drills.allowed_nodes that runs ranks (not a spare)."""
    rank: int | None = None
    """Global rank for the rank drills; None: the lowest rank on the node."""
    stall_s: float = 10.0
    """stall-rank: seconds between SIGSTOP and SIGCONT."""
    after_steps: int = 3
    """Inject once the running incarnation has completed this many steps."""
    timeout_s: float = 240.0
    """Give up on the recovery after this long."""
    settle_steps: int = 2
    """A stall that nobody confirmed counts as ridden out once training went this many steps further."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DrillError(f"drill: couldn't run {self.kind!r} (kinds: {', '.join(KINDS)})")
        if self.stall_s <= 0 or self.timeout_s <= 0 or self.after_steps < 0:
            raise DrillError("drill: stall_s and timeout_s must be > 0, after_steps >= 0")


class DrillRunner:
    def __init__(self, injector: Injector, backend: CliBackend, handle: JobHandle, *,
                 timeline: Path | None = None, poll_s: float = 0.5, slurm_poll_s: float = 1.0,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.injector = injector
        self.backend = backend
        self.handle = handle
        self.timeline = timeline
        self.poll_s = poll_s
        self.slurm_poll_s = slurm_poll_s
        self.say = on_event or (lambda line: log.info("%s", line))

    # -- before the fault ---------------------------------------------------------------------------
    def wait_for_progress(self, after_steps: int, timeout_s: float) -> tuple[Job, int, int]:
        """(job, incarnation, step) once the job is RUNNING and has logged ``after_steps`` steps more
        than when this was called (a matrix waits for the previous drill's recovery to train on)."""
        deadline = time.monotonic() + timeout_s
        start = latest_incarnation_step(self.handle.metrics_dir, self.handle.stages)
        base = start[1] if start is not None else 0
        announced: int | None = None
        while time.monotonic() < deadline:
            job = self.handle.current(self.backend.jobs())
            seen = latest_incarnation_step(self.handle.metrics_dir, self.handle.stages)
            if job is not None and job.state is JobState.RUNNING and announced != job.job_id:
                announced = job.job_id
                where = "; ".join(f"component {c.het_offset} on {','.join(c.nodes)}" for c in job.components)
                self.say(f"job {job.job_id} running ({where}); waiting for {after_steps} steps")
            if seen is not None and job is not None and job.state is JobState.RUNNING and \
                    seen[1] >= base + after_steps and (start is None or seen != start):
                return job, seen[0], seen[1]
            time.sleep(self.slurm_poll_s)
        raise DrillError(f"drill: couldn't see job {self.handle.name} make {after_steps} steps within "
                         f"{timeout_s:.0f}s (squeue; metrics in {self.handle.metrics_dir})")

    def wait_for_persist(self, after_step: int, timeout_s: float) -> int:
        """Step of a checkpoint being written (``step-N.tmp.TAG``, checkpoint/format.py) newer than
        ``after_step``. Only the folder's names are listed: this loop spins while training runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                names = os.listdir(self.handle.ckpt_dir)
            except OSError:
                names = []
            writing = [s for n in names if (s := ckpt_format.staging_step(n)) is not None and s > after_step]
            if writing:
                return max(writing)
            time.sleep(0.003)   # a tiny model persists in tens of milliseconds
        raise DrillError(f"drill: couldn't catch a checkpoint persist in {self.handle.ckpt_dir} within "
                         f"{timeout_s:.0f}s (training.checkpoint.every_steps too large?)")

    # -- one drill ----------------------------------------------------------------------------------
    def run(self, spec: DrillSpec) -> DrillResult:
        if spec.node:
            self.injector.check(spec.node)
        job, incarnation, step = self.wait_for_progress(spec.after_steps, spec.timeout_s)
        wanted = spec.node or self._committer_node(spec, job)
        component, node = pick_node(job, self.injector.allowed, wanted, self.injector.site,
                                    ranked=() if wanted else self.handle.rank_nodes(job))
        rank: int | None = None
        pids: tuple[int, ...] = ()
        if spec.kind in RANK_KINDS:
            tasks = self.injector.task_pids(component, node, het=job.is_het)
            rank, task = pick_task(tasks, component, self.handle, spec.rank)
            pids = (task.pid,)
        notes: list[str] = []
        fault = 0.0
        stalled = False
        try:
            if spec.kind == "node-down":
                fault = self.injector.node_down(node)
            elif spec.kind == "slurmd-crash":
                fault = self.injector.slurmd_crash(node)
            elif spec.kind == "kill-rank":
                fault = self.injector.send(component, node, list(pids), signal.SIGKILL, het=job.is_het)
            elif spec.kind == "stall-rank":
                fault = self.injector.send(component, node, list(pids), signal.SIGSTOP, het=job.is_het)
                stalled = True
            else:
                ckpt_step = self.wait_for_persist(self.latest_complete(), spec.timeout_s)
                fault = self.injector.send(component, node, list(pids), signal.SIGKILL, het=job.is_het)
                shard = f"step-{ckpt_step}.tmp*/{ckpt_format.shard_name(rank or 0)}.json"
                durable = any(self.handle.ckpt_dir.glob(shard))
                notes.append(f"killed rank {rank} while step-{ckpt_step} was being written "
                             f"({'its shard already durable' if durable else 'before its shard was durable'})")
            self.say(f"{spec.kind}: fault injected on {node}" + (f" rank {rank} (pid {pids[0]})" if pids else "")
                     + f" at step {step} of incarnation {incarnation}")
            times, error = self._follow(spec, job, component, incarnation, fault, node, pids, stalled)
            if spec.kind == "ckpt-crash":
                notes.append(f"newest complete checkpoint afterwards: step {self.latest_complete()}")
        finally:
            if stalled:
                self._cont(job, component, node, pids)
            restored, restore_error = self._restore(spec, node)
        history = self._history()
        return DrillResult(kind=spec.kind, job=self.handle.name, job_id=str(job.job_id), node=node, rank=rank,
                           pids=pids, times=times, progress=progress(history, fault) if history else None,
                           expect_recovery=spec.kind != "stall-rank" or times.confirmed is not None,
                           restored=restored, error=error or restore_error, notes=tuple(notes))

    def _committer_node(self, spec: DrillSpec, job: Job) -> str:
        """ckpt-crash without --node: rank 0's node, if drills may touch it. Rank 0 commits a
        checkpoint once every shard is durable, so killing it mid-persist abandons the commit."""
        if spec.kind != "ckpt-crash" or spec.rank not in (None, 0):
            return ""
        ranked = self.handle.rank_nodes(job)     # rank order: rank 0's node first (never a spare)
        first = next((c for c in job.components if c.het_offset == 0), None)
        node = ranked[0] if ranked else (first.nodes[0] if first is not None and first.nodes else "")
        return node if node in self.injector.allowed else ""

    def latest_complete(self) -> int:
        step = ckpt_format.latest_step(self.handle.ckpt_dir)
        return -1 if step is None else step

    def _cont(self, job: Job, component: HetComponent, node: str, pids: tuple[int, ...]) -> None:
        try:
            self.injector.send(component, node, list(pids), signal.SIGCONT, het=job.is_het)
        except OmniError as e:
            log.info("drill: SIGCONT after the stall: %s", e)   # the rank is gone: a recovery replaced it

    def _restore(self, spec: DrillSpec, node: str) -> tuple[bool, str]:
        try:
            if spec.kind == "slurmd-crash":
                self.injector.restart_slurmd(node)
            else:
                self.injector.resume(node)
        except OmniError as e:
            return False, str(e)
        self.say(f"{spec.kind}: {node} back in service")
        return True, ""

    def _history(self) -> RunHistory | None:
        try:
            return load_history(self.handle.metrics_dir, self.handle.stages)
        except HistoryError as e:
            log.info("drill: no history yet: %s", e)
            return None

    # -- after the fault ----------------------------------------------------------------------------
    def _follow(self, spec: DrillSpec, job: Job, component: HetComponent, incarnation: int, fault: float,
                node: str, pids: tuple[int, ...], stalled: bool) -> tuple[DrillTimes, str]:
        """Poll until the next incarnation logs a step (or a stall is ridden out); the timeline's times."""
        deadline = time.monotonic() + spec.timeout_s
        left_at: float | None = None
        gone_at: float | None = None
        running_at: float | None = None
        first_step: float | None = None
        step_at_fault = (latest_incarnation_step(self.handle.metrics_dir, self.handle.stages) or (incarnation, -1))[1]
        next_slurm = 0.0
        error = ""
        recovery: Recovery | None = None
        while time.monotonic() < deadline:
            now = time.time()
            if stalled and now >= fault + spec.stall_s:
                self._cont(job, component, node, pids)
                stalled = False
                self.say(f"stall-rank: SIGCONT after {now - fault:.1f}s")
            if time.monotonic() >= next_slurm:
                next_slurm = time.monotonic() + self.slurm_poll_s
                jobs = self.backend.jobs()
                current = self.handle.current(jobs)
                same = next((j for j in jobs if j.job_id == job.job_id), None)
                if left_at is None and (same is None or same.state is not JobState.RUNNING
                                        or same.restart_count > job.restart_count):
                    left_at = now
                    self.say(f"{spec.kind}: job {job.job_id} left RUNNING after {now - fault:.1f}s")
                if left_at is not None and running_at is None and current is not None and \
                        current.state is JobState.RUNNING and (current.job_id != job.job_id or
                                                               current.restart_count > job.restart_count):
                    running_at = now
                gone_at = (gone_at or now) if current is None and first_step is None else None
                # A manager cancels the failed job before it submits the next one: allow for the gap.
                if gone_at is not None and now - gone_at > GONE_GRACE_S and left_at is not None:
                    error = f"job {self.handle.name} ended without a recovery (is the manager running?)"
                    break
            recovery = self._timeline_recovery(fault) or recovery
            seen = latest_incarnation_step(self.handle.metrics_dir, self.handle.stages)
            if first_step is None and seen is not None:
                first_step = self._first_step_time(incarnation, fault)
                if first_step is not None:
                    self.say(f"{spec.kind}: the next incarnation completed a step "
                             f"{first_step - fault:.1f}s after the fault")
            if first_step is None and recovery is not None and recovery.first_step_after_restore is not None:
                first_step = recovery.first_step_after_restore
            timeline_done = recovery is None or recovery.first_step_after_restore is not None
            if first_step is not None and (timeline_done or self.timeline is None):
                break
            if not stalled and spec.kind == "stall-rank" and left_at is None and recovery is None and \
                    seen is not None and seen[0] == incarnation and seen[1] >= step_at_fault + spec.settle_steps:
                self.say(f"stall-rank: training went on to step {seen[1]}; nothing confirmed a failure")
                break
            time.sleep(self.poll_s)
        else:
            error = f"no recovery within {spec.timeout_s:.0f}s"
        if recovery is not None:
            return DrillTimes(fault=fault, detected=recovery.detected, confirmed=recovery.confirmed,
                              resubmitted=recovery.resubmitted, running=recovery.running,
                              first_step=recovery.first_step_after_restore or first_step, source="journal"), error
        return DrillTimes(fault=fault, detected=left_at, confirmed=left_at, running=running_at,
                          first_step=first_step, source="observed"), error

    def _first_step_time(self, incarnation: int, fault: float) -> float | None:
        """First step logged by a later incarnation (resubmitted or requeued, a life logs a higher one)."""
        history = self._history()
        if history is None:
            return None
        new = [r for r in history.records if r.time > fault and r.incarnation > incarnation]
        return new[0].time if new else None

    def _timeline_recovery(self, fault: float) -> Recovery | None:
        """The manager's recovery confirmed after ``fault``, if its timeline file holds one."""
        if self.timeline is None or not self.timeline.exists():
            return None
        try:
            recoveries = load_timeline(self.timeline).recoveries
        except ReportInputError as e:
            log.info("drill: timeline not readable yet: %s", e)
            return None
        after = [r for r in recoveries if r.confirmed >= fault and r.kind != "grow"]
        return min(after, key=lambda r: r.confirmed) if after else None
