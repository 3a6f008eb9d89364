"""One rank of a training job: layout, process groups, heartbeat, metrics, stop signals, exit codes.

``init()`` is the one call a script makes first; the returned :class:`Run` is a context manager
whose end says how the rank ended (done, checkpointed for requeue, failed, bad input) in its exit
code and its last heartbeat.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Self

import torch
import torch.distributed as dist

from slurm_omni.elastic.checkpointer import Checkpointer, Recut, Resume, Stateful, end_quiet_workers
from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
from slurm_omni.elastic.draws import Draws
from slurm_omni.elastic.heartbeat import Heartbeat
from slurm_omni.elastic.layout import Layout
from slurm_omni.elastic.metrics import MetricsLog
from slurm_omni.elastic.stop import StopSignals
from slurm_omni.elastic.timing import StepTimer
from slurm_omni.errors import CheckpointError, OmniError, RuntimeLayoutError
from slurm_omni.formats.metrics import per_node_setting
from slurm_omni.policy.snapshot_cadence import BUDGET, Cadence, blocked_share, plan_cadence, snapshot_every

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Groups:
    """The process groups of one rank (every rank creates every group, in the same order)."""

    world: dist.ProcessGroup
    pipeline: dist.ProcessGroup
    """This replica's ranks across the stages (one rank when colocated): activations travel here."""
    data_parallel: dist.ProcessGroup
    """This stage's replicas: gradients are averaged here."""


def device_for(layout: Layout, choice: str | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` (modulo the visible devices) when CUDA is asked for or present, else CPU.
    ``OMNI_DEVICE`` (cpu, cuda) overrides the default."""
    choice = choice or os.environ.get("OMNI_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeLayoutError("layout: couldn't use OMNI_DEVICE=cuda: torch sees no CUDA device")
        index = layout.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_process_groups(layout: Layout, backend: str, device: torch.device) -> Groups:
    """Join the job's rendezvous (MASTER_ADDR:MASTER_PORT) and build the pipeline and data-parallel groups."""
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get("OMNI_COLLECTIVE_TIMEOUT", "300")))
        device_id = device if device.type == "cuda" else None
        store = _agent_store(layout, timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=layout.rank, world_size=layout.world_size,
                                    timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://{layout.master_addr}:{layout.master_port}", rank=layout.rank,
                world_size=layout.world_size, timeout=timeout, device_id=device_id)
    dp, stages = layout.data_parallel_size, range(layout.num_stages)
    pipeline = [dist.new_group(sorted({layout.global_rank_of(s, r) for s in stages})) for r in range(dp)]
    data_parallel = [dist.new_group([layout.global_rank_of(s, r) for r in range(dp)])
                     for s in (stages if not layout.colocated else [0])]
    world = dist.group.WORLD
    if world is None:
        raise RuntimeLayoutError("layout: couldn't join the process group")
    return Groups(world=world, pipeline=pipeline[layout.data_parallel_rank],
                  data_parallel=data_parallel[0 if layout.colocated else layout.stage])


def _agent_store(layout: Layout, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's shared store (``TORCHELASTIC_USE_AGENT_STORE=True``, its default): a client of
    the agent's store with this restart's own key prefix; None elsewhere (rank 0 hosts the store).

    torchrun's agent keeps one store server for all its restarts and torch's own ``tcp://`` and
    ``env://`` set-up write every restart's keys under the same names, so the ranks of a restart read
    the gloo addresses of the ranks that died and hang or fail in ``connectFullMesh``. Keys under
    ``slurm_omni/<run id>/restart-<TORCHELASTIC_RESTART_COUNT>/`` are fresh for every restart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    client = dist.TCPStore(layout.master_addr, layout.master_port, layout.world_size, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"slurm_omni/{run_id}/restart-{restart}", client)


class Run:
    """This rank's part of the job; make it with :func:`init`."""

    def __init__(self, layout: Layout, *, device: torch.device, groups: Groups | None,
                 stop: StopSignals, max_steps: int | None = None, trace: bool = False,
                 metric_help: Mapping[str, str] | None = None, groups_ready_at: float | None = None) -> None:
        self.layout = layout
        self.device = device
        self._groups = groups
        self.stop = stop
        self.max_steps = max_steps
        self.timer = StepTimer()
        self.draws = Draws()
        """The draws of each step (``with run.timer.data():``), for checkpoints taken as of the
        step's own draw (``elastic/draws.py``)."""
        self.timer.on_draw = self.draws
        self._life_steps = 0
        self._pending: list[tuple[dict[str, Any], dict[str, Any] | None, Any]] = []
        """Metrics lines whose tensors are still on their way from the device (step, values, event)."""
        self.heartbeat = Heartbeat(layout.heartbeat_dir, rank=layout.rank, stage=layout.stage,
                                   dp_rank=layout.data_parallel_rank, incarnation=layout.incarnation,
                                   job_id=layout.job_id, interval_s=layout.heartbeat_interval_s)
        # a rank that runs every stage of a pipeline is stage -1 in its metrics lines (formats/metrics.py)
        metrics_stage = -1 if layout.colocated and layout.num_stages > 1 else layout.stage
        self.metrics = MetricsLog(layout.metrics_dir, stage_name=layout.stage_name, stage=metrics_stage,
                                  rank=layout.rank, dp_rank=layout.data_parallel_rank,
                                  dp_size=layout.data_parallel_size, incarnation=layout.incarnation,
                                  job_id=layout.job_id, trace=trace, help_text=metric_help,
                                  relay=self.heartbeat.relay if per_node_setting() else None,
                                  direct=layout.reports_loss)
        self.checkpoints: Checkpointer | None = None
        self.resume: Resume | None = None
        """What :meth:`restore` resumed from (None: a fresh start)."""
        self.step = 0
        """The last completed global step (set by a restore and by every :meth:`step_done`)."""
        self.last_step_time_s: float | None = None
        self._last_async_save: int | None = None
        self._said_cadence = False
        """Wall time of the last step :meth:`step_done` reported (from the end of the step before, or
        from the restore): what the heartbeat's ``step_time_s`` averages."""
        self.cadence: Cadence | None = None
        """With the memory tier: how often this life snapshots into memory and to the file system,
        decided at its second file system checkpoint from what every rank measured (None until then:
        every checkpoint goes to the file system)."""
        self._cadence_asked = _cadence_env()
        self._memory_busy = 0
        """From the last :meth:`should_stop` (the same on every rank): 1 + the highest rank whose
        previous memory-only save was still being written, or 0."""
        self._memory_skipped = 0
        """Memory-only steps skipped this life, on every rank alike, because of ``_memory_busy``."""
        self._last_files_save: int | None = None
        self._last_times: tuple[float, float] = (0.0, 0.0)
        self._startup: dict[str, float | str | None] = {
            "task_started_at": _env_time("OMNI_TASK_STARTED_AT"), "groups_ready_at": groups_ready_at}
        """The life's startup times, written once into its first metrics line (:meth:`log_metrics`)."""
        self.step_delay_s = float(os.environ.get("OMNI_STEP_DELAY_S") or 0.0)
        """Pacing for drills and demos (OMNI_STEP_DELAY_S): a sleep after every step, so that a fault
        lands mid-run; not part of the step's time."""
        self._step_started = time.monotonic()
        self._closed = False
        self.heartbeat.start()

    @property
    def groups(self) -> Groups:
        if self._groups is None:
            raise RuntimeLayoutError("layout: no process groups: init(distributed=False) was asked")
        return self._groups

    # -- checkpoints ------------------------------------------------------------------------------

    def checkpointer(self, *, modules: Mapping[str, Stateful], critical: Iterable[str] = (),
                     optimizers: Mapping[str, Stateful] | None = None, state: Mapping[str, Stateful] | None = None,
                     recut: Mapping[str, Recut] | None = None, keep_last: int = 3, script: str | None = None,
                     **kwargs: Any) -> Checkpointer:
        """A :class:`Checkpointer` on this job's checkpoint folder (one per run)."""
        ckpt = Checkpointer(self.layout, modules=modules, critical=critical, optimizers=optimizers,
                            state=state, recut=recut, keep_last=keep_last, script=script, **kwargs)
        ckpt.draws = self.draws
        self.draws.data_objects = lambda: ckpt.data_objects
        self.checkpoints = ckpt
        return ckpt

    def restore(self) -> int:
        """Restore the newest checkpoint (if any); the step to train on from (0 for a fresh start)."""
        started = time.monotonic()
        resume = self._ckpt().restore(self._min_over_ranks if self._groups is not None else None)
        self.step = resume.step if resume else 0
        self.resume = resume
        if resume is not None:
            self.draws.resumed(resume.draws_ahead)
            if self.layout.rank == 0:
                print(f"elastic: job {self.layout.job_name}: resumed from step {resume.step} ({resume.folder}, "
                      f"read from {resume.source}, data-parallel size {resume.previous_data_parallel_size} -> {resume.data_parallel_size}) "
                      f"in {time.monotonic() - started:.2f} s, incarnation {self.layout.incarnation}",
                      file=sys.stderr, flush=True)
        # ready to train: the first beat in "training" says the step it resumes from (the step
        # supervisor times the first new step of a relaunch from it)
        self.heartbeat.update(step=self.step, phase="training",
                              last_checkpoint_step=self._ckpt().last_persisted_step)
        self._step_started = time.monotonic()
        self._startup["restored_at"] = time.time()
        if resume is not None:
            self._startup["restore_source"] = resume.source
            if resume.inherited:
                self._startup["restore_inherited"] = resume.inherited
        return self.step

    def _min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.groups.world)
        return int(t.item())

    def save(self, step: int, *, sync: bool = False, files: bool = True) -> None:
        """Checkpoint as of ``step``; the heartbeat says ``checkpointing`` while the save blocks.
        ``files=False``: into the memory tier only (every rank alike: :meth:`checkpoint_due` says which)."""
        ckpt = self._ckpt()
        previous = self.heartbeat.phase
        self.heartbeat.update(phase="checkpointing")
        started = time.monotonic()
        result = ckpt.save(step, sync=sync, files=files or sync)
        # the save's blocking time is the checkpoint's (ckpt_blocking_seconds), not the next step's
        self._step_started += time.monotonic() - started
        if not sync and files:
            if self._cadence_asked is not None:   # the job's environment: alike on every rank
                self._plan_cadence(step, result.blocking_s - result.waited_s)
            else:
                self._say_cadence(step, ckpt.last_blocking_s)
        self.heartbeat.update(phase=previous if previous != "starting" else "training",
                              last_checkpoint_step=ckpt.last_persisted_step)

    def checkpoint_due(self, step: int, every: int) -> str | None:
        """What completed step ``step`` saves: ``"files"`` (a file system checkpoint, with its copy in the
        memory tier where it is on), ``"memory"`` (a memory-only step) or None. ``every``: the job's
        file system cadence in steps (0: none). The same answer on every rank: from the step, and from
        whether any rank's previous memory-only save was still being written at this step's
        :meth:`should_stop` (then a memory-only step is skipped, one counted line: call it after that)."""
        kind = self._due(step, every)
        if kind == "memory" and self._memory_busy:
            # every rank skips it (the flag came from one all-reduce): a step some rank did not save is
            # never committed, and the tier keeps only the two newest steps per rank
            self._memory_skipped += 1
            if self.layout.rank == 0:
                log.warning("checkpoint: job %s: step %d not snapshotted into memory: rank %d's previous memory "
                            "snapshot is still being written (%d skipped this life)", self.layout.job_name, step,
                            self._memory_busy - 1, self._memory_skipped)
            return None
        return kind

    def _due(self, step: int, every: int) -> str | None:
        if self.cadence is not None:
            return self.cadence.kind(step)
        return "files" if every and step % every == 0 else None

    def _plan_cadence(self, step: int, snapshot_s: float) -> None:
        """Memory tier (rank-wide, once a life, at its second asynchronous file system checkpoint: the
        first pays one-time costs): every rank's snapshot, step and file system write times, their
        maxima agreed by one all-reduce, give the cadence (``policy/snapshot_cadence.py``); rank 0 prints it."""
        previous, self._last_files_save = self._last_files_save, step
        if self.cadence is not None or previous is None or self._cadence_asked is None:
            return
        ckpt = self._ckpt()
        every = step - previous
        values = [max(0.0, snapshot_s), self.last_step_time_s or 0.0, ckpt.last_persist_s or 0.0,
                  0.0 if ckpt.engine.memory is not None else 1.0]
        if self._groups is not None and self.layout.world_size > 1:
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._groups.world)
            values = [float(v) for v in t.tolist()]
        snap, step_s, persist_s, lacking = values
        head = f"elastic: job {self.layout.job_name}: memory tier:"
        if lacking or not step_s > 0:
            self._said_cadence = True
            if self.layout.rank == 0:
                print(f"{head} off on some rank (its line says why): every checkpoint goes to the file system, "
                      f"every {every} steps", file=sys.stderr, flush=True)
            self._cadence_asked = None
            return
        memory_every, files_every, files_every_s = self._cadence_asked
        try:
            cadence = plan_cadence(snapshot_s=snap, step_s=step_s, files_persist_s=persist_s, every_steps=every,
                                   memory_every=memory_every, files_every=files_every, files_every_s=files_every_s)
        except ValueError as e:   # the job file's checks make this unreachable; say it, keep today's cadence
            self._cadence_asked = None
            print(f"{head} {e}: every checkpoint goes to the file system", file=sys.stderr, flush=True)
            return
        self.cadence, self._said_cadence = cadence, True
        if self.layout.rank == 0:
            k = cadence.memory_every
            files = (f"the file system every {cadence.files_every_steps} steps (every {cadence.files_every}"
                     f"{_nth(cadence.files_every)} snapshot: {cadence.why}; its write {persist_s:.2f} s)"
                     if cadence.files_every else "the file system only on a stop signal and at the end")
            share = blocked_share(snap, step_s, k)
            why = "" if memory_every else f", under {BUDGET:.0%}" if share <= BUDGET else \
                f"; {BUDGET:.0%} would take every {snapshot_every(snap, step_s)}: no fewer than every_steps"
            print(f"{head} a snapshot blocks {snap:.4f} s of a {step_s:.3f} s step: into memory every {k} "
                  f"step{'s' if k > 1 else ''} ({share:.2%} of training{why}), {files}; from step {step}",
                  file=sys.stderr, flush=True)

    def _say_cadence(self, step: int, blocking_s: float | None) -> None:
        """Once a life (rank 0, from its second asynchronous save: the first pays one-time costs): how
        often a snapshot could be taken with its blocking under 1 % of training (policy.snapshot_cadence)."""
        previous, self._last_async_save = self._last_async_save, step
        if self._said_cadence or previous is None or self.layout.rank != 0 or blocking_s is None \
                or not self.last_step_time_s:
            return
        self._said_cadence = True
        every = snapshot_every(blocking_s, self.last_step_time_s)
        print(f"elastic: job {self.layout.job_name}: a snapshot blocks {blocking_s:.4f} s of a "
              f"{self.last_step_time_s:.3f} s step: every {every} step{'s' if every > 1 else ''} keeps that under "
              f"{BUDGET:.0%} of training; this run snapshots every {step - previous} "
              f"({blocked_share(blocking_s, self.last_step_time_s, max(1, step - previous)):.2%})",
              file=sys.stderr, flush=True)

    def _ckpt(self) -> Checkpointer:
        if self.checkpoints is None:
            raise RuntimeLayoutError("elastic: no checkpointer: call run.checkpointer(modules=...) first")
        return self.checkpoints

    # -- steps ------------------------------------------------------------------------------------

    def step_done(self, step: int, *, log_metrics: bool = True, **metrics: Any) -> None:
        """Global step ``step`` is complete: heartbeat (step, step time, compute and data time, the
        metrics) and, unless ``log_metrics=False``, one metrics line (:meth:`log_metrics`).
        ``metrics``: numbers such as ``loss``, ``samples``, ``tokens``."""
        now = time.monotonic()
        step_s, self._step_started = now - self._step_started, now
        compute_s, data_s, cpu_wait = self.timer.take_times()
        self.last_step_time_s, self._last_times = step_s, (compute_s, data_s)
        self._life_steps += 1
        self._judge_draws()
        values, event = _lazy_numbers(metrics)
        if self.checkpoints is not None:   # a failed save is raised by should_stop, on every rank at once
            self.checkpoints.poll(raise_error=False)
        self.step = step
        self.heartbeat.update(step=step, step_time_s=step_s, compute_s=compute_s, data_s=data_s,
                              cpu_wait_s=cpu_wait, phase="training", metrics=values if event is None else None,
                              last_checkpoint_step=self.checkpoints.last_persisted_step if self.checkpoints else None)
        if event is not None or self._pending:   # device tensors: read once their copy is done (no sync)
            self._pending.append((values, self._standard(step) if log_metrics else None, event))
        elif log_metrics:
            self.log_metrics(step, **values)
        self._flush_pending()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
            self._step_started = time.monotonic()

    def _judge_draws(self) -> None:
        """The life's first steps: say once (rank 0) when the script draws ahead, or when nothing saves
        its data position."""
        ahead = self.draws.step_done()
        if self.layout.rank != 0:
            return
        if ahead:
            log.warning("elastic: job %s draws %d batch(es) ahead of its steps (before end_step, or before its "
                        "loop): checkpoints take the random streams and the data position as of the step's own "
                        "draw (docs/own-script.md, pitfalls)", self.layout.job_name, ahead)
        ckpt = self.checkpoints
        if self._life_steps == 1 and ckpt is not None and not ckpt.data_objects and not self.draws.rng_moved:
            print(f"elastic: job {self.layout.job_name}: nothing handed to the checkpointer saves the data position "
                  "(no loader or sampler in state=, no draw in run.timer.data() that uses the saved random "
                  "streams): a resume starts the data over (docs/own-script.md, pitfalls)", file=sys.stderr, flush=True)

    def _standard(self, step: int) -> dict[str, Any]:
        ckpt = self.checkpoints
        compute_s, data_s = self._last_times
        return {"step": step, "step_time_seconds": self.last_step_time_s, "compute_seconds": compute_s,
                "data_seconds": data_s, "data_parallel_size": self.layout.data_parallel_size,
                "ckpt_blocking_seconds": ckpt.last_blocking_s if ckpt else None,
                "ckpt_persist_seconds": ckpt.last_persist_s if ckpt else None}

    def _flush_pending(self, wait: bool = False) -> None:
        """Write the waiting metrics lines whose device copies are done (all of them: ``wait``)."""
        while self._pending:
            values, standard, event = self._pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self._pending.pop(0)
            numbers = _numbers(values)
            self.heartbeat.update(metrics=numbers)
            if standard is not None:
                self.metrics.log_step({**standard, **numbers}, line_only=self._startup)
                self._startup = {}

    def log_metrics(self, step: int, **values: Any) -> None:
        """One metrics line for ``step``: ``values`` (numbers or None; the keys of
        :class:`slurm_omni.formats.metrics.MetricsLine` must have its types) and, unless ``values``
        gives them, the last :meth:`step_done`'s ``step_time_seconds``, ``compute_seconds`` and
        ``data_seconds``, the ``data_parallel_size`` and the checkpointer's ``ckpt_blocking_seconds`` and
        ``ckpt_persist_seconds``. :meth:`step_done` calls it for every step; a loop that logs every
        N steps passes ``log_metrics=False`` there and calls this itself.

        The life's first line also carries its startup times (``task_started_at``: the standby
        client's start, ``OMNI_TASK_STARTED_AT``; ``groups_ready_at``: the rendezvous done;
        ``restored_at``: the checkpoint restored), as Unix times, not as gauges."""
        ckpt = self.checkpoints
        compute_s, data_s = self._last_times
        self.metrics.log_step({
            "step": step, "step_time_seconds": self.last_step_time_s, "compute_seconds": compute_s,
            "data_seconds": data_s, "data_parallel_size": self.layout.data_parallel_size,
            "ckpt_blocking_seconds": ckpt.last_blocking_s if ckpt else None,
            "ckpt_persist_seconds": ckpt.last_persist_s if ckpt else None, **_numbers(values)},
            line_only=self._startup)
        self._startup = {}

    def trace(self, step: int, sample_ids: Iterable[int]) -> None:
        """Record which sample ids this rank trained on at ``step`` (with OMNI_TRACE_SAMPLES=1)."""
        self.metrics.trace(step, [int(i) for i in sample_ids])

    def should_stop(self, *, settle: bool = False) -> bool:
        """True on every rank once any rank got SIGUSR1 or SIGTERM (a collective: call it on every rank
        at the same point of each step; signals reach the ranks at different times).

        A background save that failed on any rank (a full checkpoint file system) is agreed on here
        too: every rank raises, the one whose save failed its own error, the others one naming it, with
        its exit code, so no rank is left in a collective with a peer that has gone. ``settle``: wait
        for this rank's save in flight first (a checkpoint is due: the next save would wait anyway).

        Whether any rank's previous memory-only save is still being written rides along, so that every
        rank skips the next memory-only step alike (:meth:`checkpoint_due`) instead of waiting for it."""
        failure = self._save_failure(wait=settle)
        busy = self.layout.rank + 1 if self._memory_lane_busy() else 0
        if self._groups is None or self.layout.world_size == 1:
            self._memory_busy = busy
            if failure is not None:
                raise failure
            return self.stop.requested
        code = (failure.exit_code or EXIT_FAILED) if failure is not None else 0
        flag = torch.tensor([1 if self.stop.requested else 0, code, busy], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._groups.world)
        self._memory_busy = int(flag[2].item())
        if int(flag[1].item()):
            if failure is not None:
                raise failure
            raise PeerSaveFailed(f"checkpoint: job {self.layout.job_name}: rank {self.layout.rank} stops: another "
                                 "rank's checkpoint save failed (its line says why)", int(flag[1].item()))
        return bool(flag[0].item())

    def _memory_lane_busy(self) -> bool:
        return self.checkpoints is not None and self.checkpoints.engine.memory_persist_in_flight

    def _save_failure(self, *, wait: bool) -> OmniError | None:
        """This rank's background save that ended in an error (raised once by the checkpointer), or None."""
        if self.checkpoints is None:
            return None
        try:
            if wait:
                self.checkpoints.wait()
            else:
                self.checkpoints.poll()
        except CheckpointError as e:
            return e
        return None

    def end_step(self, step: int, *, checkpoint_every: int = 0, **metrics: Any) -> None:
        """:meth:`step_done`, then checkpoint every ``checkpoint_every`` steps and at ``max_steps``; on
        a stop signal save synchronously and exit 75 (checkpointed, requeue me)."""
        self.step_done(step, **metrics)
        last = self.max_steps is not None and step >= self.max_steps
        stop = self.should_stop(settle=last or self._due(step, checkpoint_every) == "files")
        kind = "files" if last else self.checkpoint_due(step, checkpoint_every)
        if stop or kind:
            self.save(step, sync=stop or last, files=kind != "memory")
        if stop:
            self.exit(EXIT_CHECKPOINTED)

    # -- the end ----------------------------------------------------------------------------------

    def exit(self, code: int, *, fast: bool = False) -> NoReturn:
        """Close the run (final heartbeat) and exit the process with ``code``.

        ``fast``: once closed, leave with ``os._exit`` (logs and stdio flushed) instead of
        ``SystemExit``, skipping the interpreter's teardown of torch and gloo, which takes seconds on
        a loaded machine: longer than Slurm's KillWait, after which a cancelled rank that has saved
        is SIGKILLed, and its batch shell with it. Only where nothing after the loop must run (no
        ``finally`` or ``with`` of the script's own is left to end). The data-loader workers the
        checkpointer quieted are ended first either way (they would outlive ``os._exit``)."""
        code = self.close(code)
        if fast:
            _leave(code)
        raise SystemExit(code)

    def close(self, code: int = EXIT_DONE, error: str | None = None) -> int:
        """Wait for the save in flight, write the final heartbeat, leave the process group; the exit
        code the process must end with (``code``, unless the save in flight failed: then its one line
        is printed and the code is 78 for a full checkpoint file system, else 1).

        A failing run (``code`` neither 0 nor 75) does not wait for the other ranks' shards of the
        checkpoint in flight: its writes end, nothing is committed, the newest complete checkpoint
        stays. A flat script (no ``with``) may call it at its end, or leave it to the exit hook."""
        if self._closed:
            return code
        self._closed = True
        ok = code in (EXIT_DONE, EXIT_CHECKPOINTED)
        if ok:
            self.stop.ignore_while_exiting()   # a TERM during teardown would otherwise kill a saved rank
        try:
            if self.checkpoints is not None:
                self.checkpoints.close(abandon=not ok)
        except OmniError as e:
            if ok:
                code = EXIT_BAD_INPUT if e.exit_code == EXIT_BAD_INPUT else EXIT_FAILED
                error = _say(str(e))
            else:
                log.debug("elastic: while failing: %s", e)
        self._flush_pending(wait=True)
        phase = {EXIT_DONE: "done", EXIT_CHECKPOINTED: "stopping"}.get(code, "failed")
        self.heartbeat.update(last_checkpoint_step=self.checkpoints.last_persisted_step if self.checkpoints else None)
        self.heartbeat.stop(phase, error=error, exit_code=code if 0 <= code <= 255 else None)
        self.metrics.close()
        if self._groups is not None and dist.is_initialized() and code in (EXIT_DONE, EXIT_CHECKPOINTED):
            dist.destroy_process_group()
        return code

    def __enter__(self) -> Self:
        return self

    # -- a flat script (no ``with``) ----------------------------------------------------------------

    def _hook_exit(self) -> None:
        """End the run as leaving ``with run:`` would, for a script that never enters it: at the
        interpreter's exit (the loop's end: 78 when short of ``max_steps``) and on an uncaught
        exception (its traceback, then the exit code ``with`` would give: 78 for bad input, else 1).
        A flat script that leaves with a code of its own says so with ``run.exit(code)``: a bare
        ``sys.exit(n)`` is judged like the loop's end."""
        atexit.register(self._at_exit)
        previous = sys.excepthook

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            if self._closed or not isinstance(exc, Exception):   # KeyboardInterrupt: failed, not bad input
                self.close(EXIT_FAILED, error=f"{kind.__name__}: {exc}")
                previous(kind, exc, tb)
                return
            try:
                self.__exit__(kind, exc, tb)   # closes the run; an OmniError says its one line and exits
            except SystemExit as end:
                _leave(end.code if isinstance(end.code, int) else EXIT_FAILED)
            previous(kind, exc, tb)
            _leave(EXIT_FAILED)

        sys.excepthook = hook

    def _at_exit(self) -> None:
        if self._closed:
            return
        try:
            self.__exit__(None, None, None)
        except SystemExit as end:
            _leave(end.code if isinstance(end.code, int) else EXIT_FAILED)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 _tb: TracebackType | None) -> None:
        if isinstance(exc, SystemExit) and exc.code in (None, EXIT_DONE):
            exc = None   # sys.exit(0) in the loop: the same checks as falling off its end
        if exc is None:
            if self.max_steps is not None and self.step < self.max_steps:
                message = (f"elastic: job {self.layout.job_name}: rank {self.layout.rank} finished at step "
                           f"{self.step} before max_steps={self.max_steps} (the loop must run to max_steps, "
                           "or [training] max_steps must say where it ends)")
                self._fail(message, EXIT_BAD_INPUT)
            self.close(EXIT_DONE)
            return
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_FAILED)
            self.close(code)
            return
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, OmniError):
            cause = cause.__cause__
        if isinstance(cause, OmniError):
            code = EXIT_BAD_INPUT if cause.exit_code == EXIT_BAD_INPUT else cause.exit_code or EXIT_FAILED
            self._fail(str(cause), code)
        self.close(EXIT_FAILED, error=f"{type(exc).__name__}: {exc}")

    def _fail(self, message: str, code: int) -> NoReturn:
        self.close(code, error=_say(message))
        raise SystemExit(code)



class PeerSaveFailed(CheckpointError):
    """Another rank's background checkpoint save failed; this rank stops with that rank's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _say(message: str) -> str:
    """The one line a rank that stops on purpose prints (stderr: the job's output), once."""
    line = " ".join(message.split())
    print(line, file=sys.stderr, flush=True)
    return line


def _leave(code: int) -> NoReturn:
    """``os._exit(code)``, logs and stdio flushed, quieted data-loader workers ended first."""
    end_quiet_workers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _env_time(name: str) -> float | None:
    """A Unix time a launcher put in the environment, None if absent or not a positive number."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _numbers(values: Mapping[str, Any]) -> dict[str, Any]:
    """One-element tensors and numpy numbers as Python numbers."""
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in values.items()}


def _lazy_numbers(values: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Python numbers now, but device tensors: copied to host without waiting (their values are read
    once the copy's event is done: no device sync in the step); (values, that event or None)."""
    device = [k for k, v in values.items() if isinstance(v, torch.Tensor) and v.device.type == "cuda"]
    if not device:
        return _numbers(values), None
    out = {k: (v.item() if hasattr(v, "item") and k not in device else v) for k, v in values.items()}
    for k in device:
        out[k] = values[k].detach().reshape(()).to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return out, event


def init(stages: Sequence[str] | None = None, *, max_steps: int | None = None, backend: str = "auto",
         distributed: bool = True, device: str | None = None, run_dir: Path | str | None = None,
         stop: StopSignals | None = None, metric_help: Mapping[str, str] | None = None) -> Run:
    """This rank's :class:`Run`: layout from the environment, stop signals installed, heartbeat started,
    process groups joined (``distributed``; gloo on CPU, nccl on CUDA unless ``backend`` says).

    ``stages`` names the script's pipeline stages in order (default one stage, ``main``);
    ``max_steps`` (the script's default; ``OMNI_MAX_STEPS``, the job file's ``[training] max_steps``,
    wins when set: read it back as ``run.max_steps``) lets the run check that the loop reached the end
    and checkpoint the last step; ``run_dir`` is where checkpoints, heartbeats and
    metrics go when no ``OMNI_*`` folder is set (``torchrun`` on a laptop)."""
    stop = (stop or StopSignals()).install()
    layout = Layout.from_env(stages, run_dir=run_dir)
    if os.environ.get("OMNI_MAX_STEPS", "").isdigit():   # the job file's, over the script's default
        max_steps = int(os.environ["OMNI_MAX_STEPS"])
    dev = device_for(layout, device)
    groups = None
    if distributed:
        chosen = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
        groups = init_process_groups(layout, chosen, dev)
    groups_ready_at = time.time() if distributed else None
    log.info("elastic: rank %d stage %s replica %d/%d incarnation %d (%s)", layout.rank, layout.stage_name,
             layout.data_parallel_rank, layout.data_parallel_size, layout.incarnation, layout.launcher)
    run = Run(layout, device=dev, groups=groups, stop=stop, max_steps=max_steps,
              trace=os.environ.get("OMNI_TRACE_SAMPLES", "") == "1", metric_help=metric_help,
              groups_ready_at=groups_ready_at)
    run._hook_exit()
    return run


def _nth(n: int) -> str:
    return "st" if n % 10 == 1 and n % 100 != 11 else "nd" if n % 10 == 2 and n % 100 != 12 else \
        "rd" if n % 10 == 3 and n % 100 != 13 else "th"


def _cadence_env(env: Mapping[str, str] | None = None) -> tuple[int, int, float] | None:
    """The memory tier's cadence the job file set (``[training.checkpoint] memory_every_steps``,
    ``files_every``, ``files_every_s``, rendered as OMNI_MEMORY_EVERY_STEPS, OMNI_FILES_EVERY,
    OMNI_FILES_EVERY_S; 0: chosen by the run), or None where the job does not turn the tier on."""
    env = os.environ if env is None else env
    if env.get("OMNI_MEMORY_TIER", "") not in ("1", "true", "yes"):
        return None
    try:
        memory_every = int(env.get("OMNI_MEMORY_EVERY_STEPS") or 0)
        files_every = int(env.get("OMNI_FILES_EVERY") or 0)
        files_every_s = float(env.get("OMNI_FILES_EVERY_S") or 0)
    except ValueError as e:
        raise CheckpointError(f"checkpoint: couldn't read the memory tier's cadence: {e} (OMNI_MEMORY_EVERY_STEPS, "
                              f"OMNI_FILES_EVERY: whole numbers; OMNI_FILES_EVERY_S: seconds)") from e
    if memory_every < 0 or files_every < 0 or not files_every_s >= 0 or (files_every and files_every_s):
        raise CheckpointError(f"checkpoint: couldn't use the memory tier's cadence: memory every {memory_every}, "
                              f"files every {files_every} or {files_every_s:g} s (0 or more; one of the last two)")
    return memory_every, files_every, files_every_s
