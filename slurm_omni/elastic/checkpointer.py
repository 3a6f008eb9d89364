"""A training script's checkpoints: named modules, optimizers, and any ``state_dict()`` object.

Built on the checkpoint engine (:mod:`slurm_omni.checkpoint`): a save copies the tensors into reused
host buffers (the only part that blocks), a background thread persists them to ``step-N.tmp/`` and
renames it when every rank's shard is durable; a restore takes the newest complete checkpoint that
verifies, the critical modules first; a fence keeps an older incarnation that still runs from
committing after a newer one started.

What goes where:

- ``modules`` (``nn.Module`` or anything with tensor ``state_dict()``): HDF5 datasets with checksums,
  a replicated tensor written once (spread over the replicas);
- ``optimizers``: the same, one unit per optimizer, named ``<stage>.<name>`` on disk (every stage may
  call its optimizer "adamw");
- ``state`` (schedulers, ``StatefulDataLoader``, samplers, RNG holders, any small
  ``state_dict()``/``load_state_dict()`` object): per rank, as JSON in the shard's state. When the
  data-parallel size changed since the save, replica ``r`` gets the state old replica
  ``r % old_size`` saved, or what ``recut[name](old_states, layout)`` returns.

The process-wide random streams (python, numpy, torch) are saved with every shard and put back when
the layout is unchanged.

A data loader in ``state`` with worker processes (``num_workers > 0``, not yet iterated) gets a
``worker_init_fn`` that makes its workers ignore SIGTERM and SIGUSR1: torch's workers die of SIGTERM,
which Slurm sends every process of the step, and the main process would then fail in the middle of
the checkpoint the signal asked for. Those workers then ignore multiprocessing's own SIGTERM at exit
too, so every way out of the process ends them first (:func:`end_quiet_workers`, at exit and before
``Run.exit(fast=True)``): joined forever otherwise.

Everything handed over must have ``state_dict()`` (and, but modules, ``load_state_dict()``): anything
else is refused at once with one line (:class:`NotStateful`, exit 78), not at the first save.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import memtier
from slurm_omni.checkpoint.agree import Loaded, restore_agreed
from slurm_omni.checkpoint.engine import CheckpointConfig, CheckpointEngine, SaveResult
from slurm_omni.checkpoint.persist import PersistStats
from slurm_omni.checkpoint.snapshot import ShardLayout, ShardState
from slurm_omni.elastic import statecodec
from slurm_omni.elastic.codes import EXIT_BAD_INPUT
from slurm_omni.elastic.draws import Draws
from slurm_omni.elastic.layout import Layout, accumulation_for
from slurm_omni.errors import CheckpointError

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any, /) -> Any: ...


Recut = Callable[[list[Any], Layout], Any]
"""``(states of the old replicas, in replica order, new layout) -> this replica's state``."""


class NotStateful(CheckpointError):
    """An object handed to the checkpointer has no ``state_dict()``/``load_state_dict()``: its state
    cannot be saved. Restarting would fail the same way."""

    exit_code = EXIT_BAD_INPUT


class CheckpointMismatch(CheckpointError):
    """The checkpoint cannot be loaded into this script: written by another script or model, or a
    ``load_state_dict`` refused it. Restarting would fail the same way."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True, slots=True)
class Resume:
    """What :meth:`Checkpointer.restore` found and loaded."""

    step: int
    """The global step the checkpoint was taken after: train on from here."""
    previous_data_parallel_size: int
    data_parallel_size: int
    layout_changed: bool
    """The data-parallel size differs from the checkpoint's: per-replica state was re-cut."""
    load_s: float
    extra: Any
    """What the script's ``extra()`` returned at save time (None when it gave none)."""
    draws_ahead: int | None = None
    """How many draws the saving script was ahead of its steps (``elastic/draws.py``; None: unknown)."""
    folder: str = ""
    """The checkpoint folder it came from."""
    source: str = "file system"
    """Where this rank's bytes came from: "memory" (its node's memory tier), "file system", or both."""
    inherited: int = 0
    """How many of its shards were copies inherited from the node's standby (read in its own memory)."""

    def accumulation(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches per replica per step now, keeping the global batch."""
        return accumulation_for(global_batch_size, micro_batch_size, self.data_parallel_size)

    def previous_accumulation(self, global_batch_size: int, micro_batch_size: int) -> int:
        return accumulation_for(global_batch_size, micro_batch_size, self.previous_data_parallel_size)


class QuietWorkers:
    """A data loader's ``worker_init_fn`` that first makes the worker ignore the stop signals (the main
    process handles them; the worker goes when the main process does).

    Ignored until the main process is exiting: then (:func:`end_quiet_workers` sets the shared flag)
    a SIGTERM ends the worker at once, as multiprocessing's exit hook expects; it would otherwise
    join the worker forever."""

    def __init__(self, inner: Callable[[int], Any] | None) -> None:
        self.inner = inner
        self.exiting = _exiting_flag()

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        if self.inner is not None:
            self.inner(worker_id)

    def _on_term(self, _signum: int, _frame: FrameType | None) -> None:
        if self.exiting.value:
            os._exit(0)   # nothing to flush; exit code 0 keeps torch's SIGCHLD check quiet


_EXITING: list[Any] = []


def _exiting_flag() -> Any:
    """One shared byte, created in the main process before the workers start (they inherit it)."""
    if not _EXITING:
        _EXITING.append(multiprocessing.RawValue("b", 0))
        atexit.register(end_quiet_workers)   # after multiprocessing's own hook: so it runs before it
    return _EXITING[0]


def end_quiet_workers(timeout_s: float = 5.0) -> None:
    """End this process's daemonic children (data-loader workers) within ``timeout_s``: the flag that
    lets :class:`QuietWorkers` honour SIGTERM, then SIGTERM, a bounded join, SIGKILL for any left.
    The main process runs it at exit (before multiprocessing's hook, which would join them without
    a bound) and before ``os._exit``. Nothing is lost: a worker only prefetches batches the
    loader's state has not counted yet."""
    if _EXITING:
        _EXITING[0].value = 1
    children = [p for p in multiprocessing.active_children() if p.daemon]
    for p in children:
        p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in children:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def shard_layout(layout: Layout) -> ShardLayout:
    return ShardLayout(rank=layout.rank, world_size=layout.world_size, stage=layout.stage_name,
                       data_parallel_rank=layout.data_parallel_rank, data_parallel_size=layout.data_parallel_size)


def script_name() -> str:
    """The default script identity saved with a checkpoint: the program's file name."""
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"


class Checkpointer:
    """Saves and restores one rank's share of the job. Call it from the training loop only."""

    def __init__(self, layout: Layout, *, modules: Mapping[str, Stateful], critical: Iterable[str] = (),
                 optimizers: Mapping[str, Stateful] | None = None, state: Mapping[str, Stateful] | None = None,
                 recut: Mapping[str, Recut] | None = None, extra: Callable[[], Any] | None = None,
                 keep_last: int = 3, script: str | None = None, root: Path | None = None,
                 data: Iterable[str] = ()) -> None:
        self.layout = layout
        self.modules = dict(modules)
        self.optimizers = dict(optimizers or {})
        self.objects = dict(state or {})
        self.recut = dict(recut or {})
        self.extra = extra
        self.script = script if script is not None else script_name()
        self.critical = tuple(critical) or tuple(self.modules)[:1]
        _check_stateful(layout, self.modules, self.optimizers, self.objects)
        self.data_objects = {name: obj for name, obj in self.objects.items() if name in set(data) or _iterable(obj)}
        """The ``state`` objects that hold the data position: the iterables (loaders, samplers) and
        those ``data`` names."""
        self.draws: Draws | None = None
        """The run's draw counter: a save takes the data objects and random streams as of the step's
        own draw (``elastic/draws.py``)."""
        for obj in self.objects.values():
            workers = int(getattr(obj, "num_workers", 0) or 0)
            if workers > 0 and not isinstance(getattr(obj, "worker_init_fn", QuietWorkers(None)), QuietWorkers):
                obj.worker_init_fn = QuietWorkers(obj.worker_init_fn)  # type: ignore[attr-defined]
        names = [*self.modules, *self.optimizers]
        for problem, bad in (("is not a module", [c for c in self.critical if c not in self.modules]),
                             ("has a '/' or is empty", [n for n in names if not n or "/" in n]),
                             ("has no recut object", [n for n in self.recut if n not in self.objects])):
            if bad:
                raise CheckpointError(f"checkpoint: couldn't set up: {bad[0]!r} {problem}")
        if unknown := [n for n in data if n not in self.objects]:
            raise CheckpointError(f"checkpoint: couldn't set up: data names {unknown[0]!r}, not a state object")
        self.engine = CheckpointEngine(
            CheckpointConfig(root=root or layout.ckpt_dir, keep_last=keep_last, load_order=tuple(self.modules),
                             critical=self.critical, incarnation=f"{layout.job_id}.{layout.incarnation}",
                             incarnation_number=layout.incarnation, **memtier.from_env()),
            shard_layout(layout))
        self.last_step: int | None = None
        """Newest step saved or being saved."""
        self.last_persisted_step: int | None = None
        """Newest step whose shard of this rank is durable (restored counts too)."""
        self.last_blocking_s: float | None = None
        self.last_persist_s: float | None = None
        self._pending: list[SaveResult] = []
        """Saves not picked up yet, oldest first (one per lane of the engine at most)."""

    # -- saving -----------------------------------------------------------------------------------

    def _state(self, step: int) -> ShardState:
        rng, drawn = self.draws.for_save() if self.draws is not None else (None, {})
        objects = {name: drawn[name] if name in drawn else statecodec.encode(obj.state_dict(), name)
                   for name, obj in self.objects.items()}
        return ShardState(
            rng=rng,
            modules={name: m.state_dict() for name, m in self.modules.items()},
            optimizer={self._unit(name): o.state_dict() for name, o in self.optimizers.items()},
            state={"global_step": step, "script": self.script, "modules": sorted(self.modules),
                   "optimizers": sorted(self.optimizers), "objects": objects,
                   "extra": self.extra() if self.extra is not None else None,
                   "draws_ahead": self.draws.lookahead if self.draws is not None else None,
                   "layout": {"data_parallel_size": self.layout.data_parallel_size,
                              "stage": self.layout.stage_name, "incarnation": self.layout.incarnation}})

    def prepare(self) -> None:
        """Allocate the host buffers now, so that the first save blocks no longer than later ones."""
        self.engine.prepare(self._state(-1))

    def save(self, step: int, *, sync: bool = False, files: bool = True) -> SaveResult:
        """Checkpoint as of ``step`` (completed global steps). Async: returns once the state is copied;
        ``sync`` (the stop signal, the last step) returns once it is durable (committed, on rank 0).
        ``files=False``: a memory-only step (``CheckpointEngine.save``)."""
        self.poll()
        result = self.engine.save(step, self._state(step), sync=sync, files=files)
        for previous in [p for p in self._pending if p.persisted.done() and p.persisted.exception() is None]:
            self._took(previous.persisted.result())   # the save waited for it: its figures count now
            self._pending.remove(previous)
        self.last_blocking_s = result.blocking_s
        self.last_step = step
        self._pending.append(result)
        # a save that already ended is picked up now; its error waits for the next poll, which the
        # ranks reach together (Run.should_stop agrees on it), not here, where only this rank is
        self.poll(raise_error=False)
        log.info("checkpoint: step %d %s (blocked %.3fs)", step, "saved" if sync else "started", result.blocking_s)
        return result

    def poll(self, *, raise_error: bool = True) -> None:
        """Pick up the outcome of a finished background save (its error is raised here, once;
        ``raise_error=False`` leaves a failed one for the next poll)."""
        for result in [p for p in self._pending if p.persisted.done()]:
            error = result.persisted.exception()
            if error is not None:
                if not raise_error:
                    return
                self._pending = []
                self.engine.wait()   # takes the failed persist off the engine and raises its error
                raise error
            self._took(result.persisted.result())
            self._pending.remove(result)

    def _took(self, stats: PersistStats) -> None:
        if not stats.fenced and not stats.memory_only:   # fenced: a newer incarnation started on the root
            self.last_persist_s = stats.persist_s
        if not stats.fenced:
            self.last_persisted_step = max(stats.step, self.last_persisted_step or stats.step)

    def wait(self) -> None:
        """Wait for the save in flight."""
        self.engine.wait()
        self.poll()

    # -- restoring --------------------------------------------------------------------------------

    def restore(self, reduce_min: Callable[[int], int] | None = None) -> Resume | None:
        """Load the newest complete checkpoint; None when there is none (a fresh start).

        Critical modules are loaded first, then the other modules, the optimizers and the small
        states. ``reduce_min`` (the ranks' collective minimum; ``Run.restore`` passes one) makes every
        rank resume from the same step: the newest one every rank's shards verify
        (``checkpoint/agree.py``). A checkpoint of another script (other module names, another
        ``script``) or a ``load_state_dict`` that refuses its state raises :class:`CheckpointMismatch`."""
        t0 = time.monotonic()
        memo: fmt.ManifestMemo = {}   # the newest manifest is read three times: parsed once
        self._check_compatible(memo)
        resume = restore_agreed(lambda bound: self._restore(bound, t0, memo), reduce_min or (lambda step: step),
                                rank=self.layout.rank)
        if resume is not None:
            self.last_step = self.last_persisted_step = resume.step
            log.info("checkpoint: rank %d restored step-%d from %s (%s; data-parallel size %d, was %d) in %.2fs",
                     self.layout.rank, resume.step, resume.folder, resume.source, resume.data_parallel_size,
                     resume.previous_data_parallel_size, resume.load_s)
        return resume

    def _restore(self, bound: int | None, t0: float, memo: fmt.ManifestMemo) -> Loaded[Resume] | None:
        try:
            session = self.engine.restore(max_step=bound, memo=memo)
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            if "no modules for stage" in str(e) or "not among" in str(e):
                raise self._mismatch(f"{e}") from e
            raise
        if session is None:
            return None
        try:
            states = [s for s in session.states if isinstance(s, dict)]
            own = session.state if isinstance(session.state, dict) else None
            saved = own or (states[0] if states else None)
            if saved is None or int(saved.get("global_step", -1)) != session.step:
                raise self._mismatch(f"step-{session.step} holds no slurm_omni.elastic state for stage "
                                     f"{self.layout.stage_name!r}", session.step)
            self._check_same_script(saved, session.step)
            for name in [*self.critical, *(m for m in self.modules if m not in self.critical)]:
                self._load(name, self.modules[name], session.module(name), session.step)
            for name, opt in self.optimizers.items():
                value = session.optimizer(self._unit(name))
                if value is None:
                    raise self._mismatch(f"step-{session.step} has no optimizer {name!r}", session.step)
                self._load(name, opt, value, session.step)
            for name, obj in self.objects.items():
                self._load(name, obj, self._object_state(name, own, states, session.step), session.step)
            session.wait()
            changed = session.layout_changed
            previous = len(states) if states else self.layout.data_parallel_size
        finally:
            session.close()
        return Loaded(session.step, Resume(step=session.step, previous_data_parallel_size=previous,
                                           data_parallel_size=self.layout.data_parallel_size, layout_changed=changed,
                                           load_s=time.monotonic() - t0, extra=saved.get("extra"),
                                           draws_ahead=saved.get("draws_ahead"),
                                           folder=str(fmt.step_dir(self.engine.config.root, session.step)),
                                           source=session.source, inherited=session.inherited),
                      session.fallbacks)

    def _object_state(self, name: str, own: dict[str, Any] | None, states: list[dict[str, Any]], step: int) -> Any:
        if own is not None:
            encoded = own.get("objects", {})
            if name not in encoded:
                raise self._mismatch(f"step-{step} has no state {name!r}", step)
            return statecodec.decode(encoded[name])
        old = []
        for s in states:
            if name not in s.get("objects", {}):
                raise self._mismatch(f"step-{step} has no state {name!r}", step)
            old.append(statecodec.decode(s["objects"][name]))
        if name in self.recut:
            return self.recut[name](old, self.layout)
        return old[self.layout.data_parallel_rank % len(old)]

    def _load(self, name: str, obj: Stateful, value: Any, step: int) -> None:
        if isinstance(value, dict) and not value and name in self.objects:
            # saved empty: a disabled GradScaler (torch's refuses {} once enabled), a stateless object
            log.info("checkpoint: state %r was saved empty at step-%d (a disabled GradScaler saves {}): "
                     "nothing to restore, left as it is", name, step)
            return
        try:
            obj.load_state_dict(value)
        except CheckpointError:
            raise
        except Exception as e:   # any refusal of the user's object is the same verdict
            first = " ".join(str(e).split())[:240]
            raise self._mismatch(f"{name}.load_state_dict refused step-{step}: {type(e).__name__}: {first}",
                                 step) from e

    def _check_compatible(self, memo: fmt.ManifestMemo | None = None) -> None:
        """Refuse, before reading any tensor, the newest checkpoint when another script wrote it."""
        entry = fmt.find_latest_complete(self.engine.config.root, memo=memo)
        if entry is None:
            return
        try:
            manifest = fmt.read_manifest(entry.path, memo=memo)
        except CheckpointError:
            return   # the engine's restore marks it corrupt and falls back
        stage = self.layout.stage_name
        saved = {u.module for u in manifest.units.values() if u.stage == stage}
        mine = set(self.modules) | {self._unit(n) for n in self.optimizers}
        if saved and saved != mine:
            raise self._mismatch(f"step-{entry.step} holds {', '.join(sorted(saved))} for stage {stage!r}, "
                                 f"this script has {', '.join(sorted(mine))}", entry.step)

    def _unit(self, optimizer: str) -> str:
        return f"{self.layout.stage_name}.{optimizer}"

    def _check_same_script(self, saved: dict[str, Any], step: int) -> None:
        other = saved.get("script")
        if other != self.script:
            raise self._mismatch(f"step-{step} was written by {other!r}, this is {self.script!r}", step)

    def _mismatch(self, what: str, _step: int | None = None) -> CheckpointMismatch:
        root = self.engine.config.root
        return CheckpointMismatch(
            f"checkpoint: job {self.layout.job_name}: couldn't resume from {root}: {what} (another script's "
            "or model's checkpoint: give this job its own checkpoint folder, or move the old one away)")

    def close(self, *, abandon: bool = False) -> None:
        """Wait for the save in flight and stop the writer; ``abandon`` (the run is failing): rank 0
        stops waiting for the other ranks' shards of the checkpoint in flight."""
        self.engine.close(abandon=abandon)
        self.poll()


_WHAT_IS_STATEFUL = ("an object with state_dict() and load_state_dict(), such as torchdata's StatefulDataLoader "
                     "(torchdata.stateful_dataloader) for a data loader")


def _iterable(obj: Any) -> bool:
    return callable(getattr(obj, "__iter__", None)) or callable(getattr(obj, "__next__", None))


def _check_stateful(layout: Layout, modules: Mapping[str, Any], optimizers: Mapping[str, Any],
                    objects: Mapping[str, Any]) -> None:
    """Refuse, when it is handed over, anything whose state cannot be saved and put back."""
    for kind, named in (("modules", modules), ("optimizers", optimizers), ("state", objects)):
        for name, obj in named.items():
            missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
            if missing:
                raise NotStateful(
                    f"checkpoint: job {layout.job_name}: couldn't take {kind}[{name!r}]: "
                    f"{type(obj).__module__}.{type(obj).__qualname__} has no {' or '.join(m + '()' for m in missing)} "
                    f"(give {_WHAT_IS_STATEFUL}, or leave it out and save its position another way)")
