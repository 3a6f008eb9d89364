"""The checkpoint engine the training runtime calls: save (async or sync), restore, close.

Policy while a persist is in flight: a new save first waits for it (the wait counts as blocking time
and is reported in ``SaveResult.waited_s``), so every rank saves every step it is asked to and no rank's
shard goes missing from a commit. A runtime that would rather skip a save than wait must decide that
collectively (``memory_persist_in_flight`` on every rank, then an all-reduce: ``elastic.Run`` does it
in ``should_stop``), never per rank.

With the memory tier there are two lanes, each one persist at a time from its own host buffer: the
file system's (a step with files) and the memory tier's (a memory-only step). A memory-only save waits
only for the previous memory-only persist (a tmpfs write, the ring peer's copy, the record and on rank
0 the commit), never for a file system write, which may last many memory snapshots on a slow shared
file system. Two buffers, not more: the file system write in flight holds one; memory snapshots need
only the newest one, so a second memory buffer would only let a snapshot start before the previous one
is in the tier, which a cadence within the blocking budget does not ask for (the runtime skips such a
step on every rank instead). Host memory: twice this rank's shard while the tier is on.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import memtier, peer
from slurm_omni.checkpoint.fence import await_raise, raise_fence
from slurm_omni.checkpoint.persist import PersistStats, finish_orphaned, persist
from slurm_omni.checkpoint.restore import Restore, open_restore
from slurm_omni.checkpoint.snapshot import HostArena, ShardLayout, ShardState, take
from slurm_omni.errors import CheckpointError, StorageFull
from slurm_omni.ownership import NotOwnedError, ensure_own_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    root: Path
    """Checkpoint root on storage every node sees; one directory per step below it."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are removed after each commit. 0 keeps all."""
    pin_memory: bool = True
    """Page-lock the host buffers when CUDA is there (faster device-to-host copies)."""
    load_order: tuple[str, ...] = ()
    """Module names in the order the first step needs them; unnamed modules follow in save order."""
    critical: tuple[str, ...] | None = None
    """Modules whose weights must be in memory before training resumes; None means all weights."""
    restore_threads: int = 4
    """I/O threads reading tensors during a restore (no more than the CPUs the process may use when
    every byte is in the memory tier: ``reader.memory_threads``)."""
    direct_io: bool = True
    """Read the chunks the page cache does not hold with O_DIRECT (less CPU than a buffered read from a
    cold cache); False reads everything through the page cache. File systems that refuse O_DIRECT are
    read through the page cache either way."""
    commit_timeout_s: float = 600.0
    """How long rank 0 waits for the other ranks' shards before giving a checkpoint up."""
    incarnation: str | None = None
    """One value shared by every rank of this run; None reads OMNI_INCARNATION, TORCHELASTIC_RUN_ID,
    or SLURM_JOB_ID with SLURM_RESTART_COUNT (ordinary jobs only)."""
    incarnation_number: int | None = None
    """This life's number for the fence (``fence.py``): every later life of the job a higher one
    (OMNI_INCARNATION). None reads OMNI_INCARNATION when it is an integer; without one the root is
    not fenced."""
    fence_wait_s: float = 120.0
    """How long ranks other than 0 wait, before a restore, for rank 0 to raise the fence."""
    memory_tier: bool = False
    """Also keep each rank's shard of the newest steps in node-local shared memory, and restore from
    there where this node holds it (``memtier.py``); the file system is written as without it."""
    memory_dir: Path = field(default=memtier.DEFAULT_DIR)
    """The node-local tmpfs of the memory tier."""
    memory_cap_bytes: int | None = None
    """The most the job keeps in the memory tier per node (None: what the tmpfs holds)."""
    memory_job: str | None = None
    """The job the memory tier's folder belongs to (freed at its end); None reads SLURM_JOB_ID."""

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise CheckpointError(f"checkpoint: keep_last = {self.keep_last} (0 keeps all, or a positive count)")
        if self.restore_threads < 1:
            raise CheckpointError(f"checkpoint: restore_threads = {self.restore_threads} (at least 1)")
        if not self.commit_timeout_s > 0:
            raise CheckpointError("checkpoint: commit_timeout_s must be positive")
        if self.incarnation_number is not None and self.incarnation_number < 0:
            raise CheckpointError(f"checkpoint: incarnation_number = {self.incarnation_number} (0 or more)")


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    blocking_s: float          # what training waited for: a previous persist plus the snapshot
    waited_s: float            # the part spent waiting for the previous persist
    bytes: int                 # tensor bytes this rank snapshotted
    persisted: Future[PersistStats] = field(repr=False)
    skipped: bool = False      # the step was already saved by this engine

    @property
    def fenced(self) -> bool:
        """The persist is over and was refused: a newer incarnation started on the root."""
        return self.persisted.done() and self.persisted.exception() is None and self.persisted.result().fenced


class CheckpointEngine:
    """One per training process. Not thread-safe: call it from the training loop only."""

    def __init__(self, config: CheckpointConfig, layout: ShardLayout | None = None) -> None:
        self.config = config
        self.layout = layout or ShardLayout()
        self.incarnation = _incarnation(config.incarnation, self.layout.world_size)
        self.number = config.incarnation_number if config.incarnation_number is not None else _number()
        self._fence_raised = False
        self._fence_lock = threading.Lock()
        self._files = _Lane("persist", pin=config.pin_memory)
        """Every step without the memory tier; with it, the steps with files."""
        self._memory_lane: _Lane | None = None
        """With the memory tier: the memory-only steps, which never wait for a file system write."""
        self._tier_lock = threading.Lock()
        """This rank's copies enter the tier (and its ring peer's) one at a time: the tier keeps the
        newest two and drops newer ones first, so a copy must not land after a newer one."""
        self._memory_newest = -1
        """The newest memory-only step handed to the memory lane."""
        self._last_step: int | None = None
        self._closed = False
        self._warned_wait = False
        self._abort = threading.Event()
        """Set by ``close(abandon=True)``: a commit waiting for the other ranks' shards gives up."""
        self.memory: memtier.MemoryTier | None = None
        if config.memory_tier:
            job = config.memory_job or os.environ.get("SLURM_JOB_ID", "")
            try:
                self.memory = memtier.MemoryTier(job, base=config.memory_dir, cap_bytes=config.memory_cap_bytes)
            except CheckpointError as e:   # the tier is a speed-up: the file system still holds everything
                log.warning("%s; checkpoints go to the file system only", e)
        self.peers: peer.Replicas | None = None
        """This rank's peers (``peer.py``): where its node's copies are replicated, and fetched from."""
        try:
            # someone else's folder could hold a planted FENCE
            ensure_own_dir(config.root, what="checkpoint")
        except NotOwnedError as e:
            raise CheckpointError(str(e)) from e
        except OSError as e:
            raise CheckpointError(f"checkpoint: couldn't create root {config.root}: {e.strerror}") from e
        if self.memory is not None:
            self.peers = peer.Replicas.from_env(config.root, self.memory)
            self._memory_lane = _Lane("memory", pin=config.pin_memory)

    # -- saving -------------------------------------------------------------------------------------

    def prepare(self, state: ShardState) -> None:
        """Allocate and fault in the host buffers now, so the first save blocks no longer than later ones."""
        self._check_open()
        self._wait_inflight()
        for lane in self._lanes():
            take(lane.arena, -1, state, self.layout, self.config.load_order, copy=False)

    def save(self, step: int, state: ShardState, *, sync: bool = False,
             commit_timeout_s: float | None = None, files: bool = True) -> SaveResult:
        """Snapshot ``state`` as of ``step``; persist it in the background, or before returning if ``sync``.

        ``sync`` is for the signal Slurm sends before a time limit or preemption: on rank 0 it returns
        once the checkpoint is complete (all ranks' shards committed), on other ranks once their shard
        is durable.

        ``files=False`` (with the memory tier on): a memory-only step, the shard file written into the
        memory tier (and its ring peer's) instead of the file system; the record, the manifest and the
        marker are still committed on the file system, so the fence and the agreement are unchanged.
        Every rank must pass the same ``files`` for a step (the runtime decides it from the step alone).
        A memory-only save waits for the previous memory-only persist only (the module says why).
        """
        self._check_open()
        if step == self._last_step:
            waited = self._wait_inflight() if sync else 0.0
            done: Future[PersistStats] = Future()
            done.set_result(PersistStats(step, 0, 0.0, False))
            return SaveResult(step, waited, waited, 0, done, skipped=True)
        memory_only = not files and self.memory is not None
        lane = self._memory_lane if memory_only and self._memory_lane is not None else self._files
        waited = self._wait_inflight() if sync else self._wait_lane(lane)
        if waited > 0.1:
            log.log(logging.INFO if self._warned_wait else logging.WARNING,
                    "checkpoint: step %d waited %.2f s for the previous persist (checkpoint less often, or use "
                    "faster storage)", step, waited)
            self._warned_wait = True
        snap = take(lane.arena, step, state, self.layout, self.config.load_order)
        timeout = commit_timeout_s or self.config.commit_timeout_s
        self._last_step = step   # taken back if the persist fails, so the step can be saved again
        # the other lane's step in flight: this persist's retention sweeps nothing at or above it
        other = next((x.step for x in self._lanes() if x is not lane and x.busy), None)
        if memory_only:
            with self._tier_lock:
                self._memory_newest = max(self._memory_newest, step)
        if sync:
            future: Future[PersistStats] = Future()
            try:
                future.set_result(self._persist(snap, timeout, memory_only, other))
            except BaseException:
                self._last_step = None
                raise
            blocking = waited + snap.blocking_s + future.result().persist_s
        else:
            future = lane.writer.submit(self._persist, snap, timeout, memory_only, other)
            lane.inflight, lane.step = future, step
            blocking = waited + snap.blocking_s
        return SaveResult(step, blocking, waited, snap.nbytes, future)

    def _persist(self, snap: Any, timeout: float, memory_only: bool = False,
                 in_flight: int | None = None) -> PersistStats:
        try:
            if self.layout.rank == 0:
                self._raise_fence()   # a run that saves before (or without) a restore
            stats = persist(self.config.root, snap, self.layout, incarnation=self.incarnation,
                            keep_last=self.config.keep_last, commit_timeout_s=timeout, number=self.number,
                            abort=self._abort, on_shard=self._keeper(snap.step),
                            memory=self.memory if memory_only else None,
                            replicate=self._replicator(snap.step) if memory_only else None,
                            tier_lock=self._tier_lock, in_flight=in_flight)
        except CheckpointError as e:
            log.debug("%s", e)    # raised to the training loop, which says it once
            raise
        except OSError as e:
            error = self._persist_error(snap.step, e)
            log.debug("%s", error)   # raised to the training loop, which says it once
            raise error from e
        if not stats.fenced:
            log.info("checkpoint: step %d persisted: %.1f MiB in %.2f s%s", stats.step, stats.bytes / 2**20,
                     stats.persist_s, " (committed)" if stats.committed else "")
        return stats

    def _persist_error(self, step: int, e: OSError) -> CheckpointError:
        """One line for a failed write; a full file system (or quota) is :class:`StorageFull`."""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            newest = fmt.latest_step(self.config.root)
            kept = f"step-{newest}, the newest complete checkpoint, is intact" if newest is not None else \
                "no complete checkpoint yet"
            return StorageFull(f"checkpoint: couldn't persist step {step} in {self.config.root}: "
                               f"{os.strerror(e.errno)} (free space there or keep fewer checkpoints, then "
                               f"submit again; {kept})")
        detail = " ".join(str(e).split())[:300]   # h5py's messages span lines
        return CheckpointError(f"checkpoint: couldn't persist step {step} in {self.config.root}: {detail}")

    def _keeper(self, step: int) -> Callable[[Path], object] | None:
        memory = self.memory
        if memory is None:
            return None
        peers = self.peers

        def keep(path: Path) -> Path | None:
            with self._tier_lock:
                if self._memory_newest > step:
                    # a newer memory-only step is in the tier or on its way there (a slow file system
                    # write): a restore reads that one, and this copy would push it out
                    log.info("checkpoint: step %d not copied into memory: memory-only step %d is newer", step,
                             self._memory_newest)
                    return None
                copy = memory.publish(path, step=step, rank=self.layout.rank, incarnation=self.incarnation,
                                      root=self.config.root, number=self.number)
                if copy is not None and peers is not None:   # and a replica on the ring peer (peer.py)
                    peers.send(copy, step=step, rank=self.layout.rank, incarnation=self.incarnation,
                               number=self.number)
                return copy

        return keep

    def _replicator(self, step: int) -> Callable[[Path], object] | None:
        """A memory-only step's tmpfs copy: to the ring peer (``peer.py``), then into the node keeper's
        memory (``held.py``), where a restart on this node reads it fastest."""
        memory, peers = self.memory, self.peers
        if memory is None:
            return None

        def send(copy: Path) -> None:
            if peers is not None:
                peers.send(copy, step=step, rank=self.layout.rank, incarnation=self.incarnation, number=self.number)
            memory.hand_over(copy, step=step, number=self.number)

        return send

    def _raise_fence(self) -> None:
        """Rank 0, once: shut older incarnations out of the root before reading or writing it."""
        with self._fence_lock:   # the two lanes' first persists may both get here
            if self.number is None or self._fence_raised:
                return
            # and commit the step an older incarnation's ranks all wrote but its rank 0 (lost) did not
            raise_fence(self.config.root, self.number, self.incarnation, finish=finish_orphaned)
            self._fence_raised = True

    @property
    def persist_in_flight(self) -> bool:
        return any(lane.busy for lane in self._lanes())

    @property
    def memory_persist_in_flight(self) -> bool:
        """A memory-only save now would wait (the previous one is still being written)."""
        return self._memory_lane is not None and self._memory_lane.busy

    def wait(self) -> PersistStats | None:
        """Wait for the persists in flight; the newest step's figures, or the first error raised here."""
        futures = [lane.inflight for lane in self._lanes() if lane.inflight is not None]
        self._wait_inflight()
        done = [f.result() for f in futures]
        return max(done, key=lambda stats: stats.step) if done else None

    def _lanes(self) -> list[_Lane]:
        return [self._files] if self._memory_lane is None else [self._files, self._memory_lane]

    def _wait_inflight(self) -> float:
        """Wait for every lane; the first error is raised once all are waited for."""
        waited, error = 0.0, None
        for lane in self._lanes():
            try:
                waited += self._wait_lane(lane)
            except BaseException as e:  # noqa: BLE001 - raised below, after the other lane
                error = error or e
        if error is not None:
            raise error
        return waited

    def _wait_lane(self, lane: _Lane) -> float:
        future, lane.inflight = lane.inflight, None
        if future is None:
            return 0.0
        started = time.monotonic()
        try:
            future.result()
        except BaseException:
            self._last_step = None
            raise
        return time.monotonic() - started

    # -- restoring ----------------------------------------------------------------------------------

    def restore(self, *, step: int | None = None, max_step: int | None = None, critical: Iterable[str] | None = None,
                modules: Iterable[str] | None = None, into: Mapping[str, Mapping[str, Any]] | None = None,
                device: torch.device | str = "cpu", apply_rng: bool = True,
                memo: fmt.ManifestMemo | None = None) -> Restore | None:
        """Load the newest complete checkpoint that verifies (see ``restore.open_restore``).

        Returns once the critical modules' weights are in memory (``critical`` or the config's; None
        means all weights). ``into`` maps a module to its ``state_dict()``, and ``"module/optim"`` to its
        optimizer's ``state_dict()``, so tensors load in place (host tensors are read into directly;
        device tensors through a page-locked staging buffer). ``memo``: manifests the caller parsed
        for this restore already (``format.read_manifest``), not parsed again.
        """
        self._check_open()
        # The fence before the read: a late commit of an older incarnation must not be what we restore.
        if self.layout.rank == 0:
            self._raise_fence()
        elif self.number is not None:
            await_raise(self.config.root, self.number, self.config.fence_wait_s)
        session = open_restore(self.config.root, self.layout, step=step, max_step=max_step,
                               critical=critical if critical is not None else self.config.critical,
                               modules=modules, into=into, device=device,
                               threads=self.config.restore_threads, direct_io=self.config.direct_io,
                               apply_rng=apply_rng, memory=self.memory, peers=self.peers, memo=memo)
        if session is not None:
            self._last_step = session.step
        return session

    def latest_step(self) -> int | None:
        return fmt.latest_step(self.config.root)

    def close(self, *, abandon: bool = False) -> None:
        """Wait for the persist in flight, then stop the writer. Its error, if any, is raised here.

        ``abandon`` (a run that is failing): rank 0's commit stops waiting for the other ranks' shards,
        so the wait is only for the writes under way (the checkpoint in flight is not committed)."""
        if abandon:
            self._abort.set()
        if self._closed:
            return
        self._closed = True
        try:
            self._wait_inflight()
        finally:
            for lane in self._lanes():
                lane.writer.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("checkpoint: the engine is closed")


class _Lane:
    """One persist at a time, from its own host buffer."""

    def __init__(self, name: str, *, pin: bool) -> None:
        self.arena = HostArena(pin=pin)
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"omni-ckpt-{name}")
        self.inflight: Future[PersistStats] | None = None
        self.step: int | None = None
        """The step of ``inflight``."""

    @property
    def busy(self) -> bool:
        return self.inflight is not None and not self.inflight.done()


def _number() -> int | None:
    value = os.environ.get("OMNI_INCARNATION", "")
    return int(value) if value.isascii() and value.isdigit() else None


def _incarnation(given: str | None, world_size: int) -> str:
    env = os.environ
    if given:
        return given
    for name in ("OMNI_INCARNATION", "TORCHELASTIC_RUN_ID"):
        if env.get(name):
            return env[name]
    # In a heterogeneous job each component has its own SLURM_JOB_ID, so ranks would disagree.
    if env.get("SLURM_JOB_ID") and not env.get("SLURM_HET_SIZE"):
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}"
    if world_size == 1:
        return uuid.uuid4().hex
    raise CheckpointError(
        f"checkpoint: couldn't tell this run from earlier ones: world_size={world_size} and no "
        f"incarnation (set OMNI_INCARNATION to one value on every rank, e.g. "
        f"$SLURM_JOB_ID.$SLURM_RESTART_COUNT of the leader, or pass incarnation=)")

