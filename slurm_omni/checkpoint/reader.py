"""Reading one checkpoint onto this rank: the units in order, several I/O threads, every tensor checked.

Each unit's pieces are cut into a few runs of ascending offsets; an I/O thread reads a run in chunks of
a few MiB. What the page cache holds is read with buffered ``preadv`` calls straight into the tensors
(``RWF_NOWAIT``: the kernel stops at the first page it lacks); the rest is read with ``O_DIRECT`` into
an aligned buffer and copied into them (``fileio.py``: from a cold cache that costs less CPU than the
page cache does). Each step of 256 KiB is checksummed into its piece's running xxh3 right after it
lands, while it is still in the core's cache, so the bytes are read from memory once; a piece is handed on only once its whole xxh3 matches the manifest. A unit is ready
once all its pieces are; ``Restore.unit`` waits for that unit alone. A rank reads only the pieces it
needs: its own piece of a split tensor, or, when the data-parallel size changed, the old pieces that
overlap its new one (each read whole, so that its checksum can be checked).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from slurm_omni.checkpoint import fileio, held, rng
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.dtypes import from_name
from slurm_omni.checkpoint.format import CheckpointCorrupt
from slurm_omni.checkpoint.snapshot import MODEL, OPTIM, ShardLayout
from slurm_omni.checkpoint.tree import tensors_of, unflatten
from slurm_omni.errors import CheckpointError

log = logging.getLogger(__name__)

_MEMORY_BATCH = 32 << 20
"""Bytes per task of an I/O thread at most when they are in memory already (a few ms of copying)."""
_PUBLISH_EVERY = 32
"""Pieces planned between two hand-overs to the threads reading a plan from the keeper's memory (and
at each unit's end): the first read starts after a few tensors, each hand-over is one futex wake."""


def memory_threads(threads: int) -> int:
    """I/O threads for a restore whose every byte is in memory already (the memory tier): no more than
    the CPUs this process may run on. Each thread only copies and hashes, never waits on a disk, so a
    thread beyond the cores just takes turns with the others (4 threads on 2 CPUs: more context
    switches and more interpreter time per byte, no more bytes a second)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(threads, cpus))


class Restore:
    """One checkpoint being loaded onto this rank."""

    def __init__(self, path: Path, manifest: fmt.Manifest, layout: ShardLayout, *,
                 units: list[fmt.Unit], into: Mapping[str, Mapping[str, Any]], device: torch.device,
                 threads: int, direct_io: bool = True,
                 sources: Mapping[str, Path | fileio.HeldCopy | fileio.Stream] | None = None) -> None:
        self.path = path
        self.sources = dict(sources or {})
        """Shards read from the memory tier instead of ``path`` (their bytes checked the same way): a
        copy on this node's tmpfs, or a stream from a peer's keeper (read by one thread, in order)."""
        self.source = "file system"
        """Where this rank's bytes came from: "memory", "file system", or "memory and file system"."""
        self.manifest = manifest
        self.step = manifest.step
        self.fallbacks: tuple[str, ...] = ()
        """Why newer checkpoints were passed over on the way to this one (open_restore's CORRUPT marks)."""
        self.layout = layout
        olds = sorted((s for s in manifest.shards.values() if s.stage == layout.stage),
                      key=lambda s: s.data_parallel_rank)
        self.states: list[Any] = [s.state for s in olds]
        """The runtime state of each data-parallel rank of this stage at save time, by rank."""
        self.layout_changed = len(olds) != layout.data_parallel_size
        """This stage's data-parallel size differs from the checkpoint's: split tensors were re-cut."""
        self._own = olds[layout.data_parallel_rank] if olds and not self.layout_changed else None
        self._units = {u.name: u for u in units}
        self._ready = {u.name: threading.Event() for u in units}
        self._values: dict[str, Any] = {}
        self._error: CheckpointError | None = None
        self._lock = threading.Lock()
        self._files = fileio.ShardFiles(path, manifest, direct_io=direct_io, sources=self.sources)
        self._local = threading.local()
        self._closed = False
        self._handed_out = False   # set by open_restore once it hands the session out
        in_memory = set(self._files.sources) | set(self._files.held) | set(self._files.streams)
        self._inherited = any(c.pid == held.HERE for c in self._files.held.values()) and held.start_reading()
        """Reading copies inherited from the standby that forked this process (``held.hold_here``):
        dropped once this session ends."""
        from_files = any(p.shard not in in_memory for u in units for e in u.tensors.values()
                         for p in self._pieces_for(e) if p.nbytes)
        self._threads = max(1, threads if from_files else memory_threads(threads))
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="omni-ckpt-restore")
        self.started = time.monotonic()
        self.loaded_s: dict[str, float] = {}
        self._streamed: dict[str, list[_Streamed]] = {shard: [] for shard in self._files.streams}
        try:
            if not self._load_held(units, into, device):
                for u in units:
                    targets = into.get(u.name, into.get(u.module) if u.part == MODEL else None)
                    self._schedule(u, targets or {}, device)
        except BaseException:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self.release_inherited()
            raise
        self._stream_threads = [threading.Thread(target=self._read_stream, args=(shard, items, device), daemon=True,
                                                 name=f"omni-ckpt-peer-{shard}")
                                for shard, items in self._streamed.items()]
        for thread in self._stream_threads:
            thread.start()
        self._prefetcher: threading.Thread | None = None
        if from_files:
            # (none when every byte is in memory already: the thread would only hold the GIL a while)
            self._prefetcher = threading.Thread(target=self._prefetch, args=(units,), daemon=True,
                                                name="omni-ckpt-prefetch")
            self._prefetcher.start()

    # -- what the runtime uses ----------------------------------------------------------------------

    @property
    def state(self) -> Any:
        """This rank's own runtime state when its stage kept its data-parallel size, else None
        (then re-cut ``states`` yourself: only the runtime knows how its data positions divide)."""
        return self._own.state if self._own else None

    def apply_rng(self) -> bool:
        """Set the process-wide random streams to this rank's saved ones; False when the layout changed."""
        if self._own is None:
            return False
        rng.restore(self._own.rng)
        return True

    def module(self, name: str) -> dict[str, torch.Tensor]:
        """The module's weights (its state_dict); waits for this module only."""
        value: dict[str, torch.Tensor] = self.unit(f"{name}/{MODEL}")
        return value

    def optimizer(self, name: str, default: Any = None) -> Any:
        """The module's optimizer state, or ``default`` when none was saved."""
        if f"{name}/{OPTIM}" not in self._units:
            return default
        return self.unit(f"{name}/{OPTIM}")

    def unit(self, name: str) -> Any:
        if name not in self._units:
            raise CheckpointError(f"checkpoint: step-{self.step} holds no {name} for stage "
                                  f"{self.layout.stage!r} (have: {', '.join(self._units) or 'nothing'})")
        self._ready[name].wait()
        if name in self._values:
            return self._values[name]
        raise self._error or CheckpointError(f"checkpoint: {name} of step-{self.step} was not loaded")

    def hand_out(self) -> CheckpointError | None:
        """Training starts on this session now: corruption found from here on marks the checkpoint
        CORRUPT (the next restore skips it). Returns an error already found, if any."""
        with self._lock:
            self._handed_out = True
            return self._error

    def ready(self, name: str) -> bool:
        return self._ready[name].is_set() and self._error is None

    def wait(self, names: Iterable[str] | None = None) -> None:
        for name in self._units if names is None else names:
            self.unit(name)

    def close(self) -> None:
        """Stop loading (pending reads are dropped) and release the files."""
        with self._lock:
            self._closed = True
        for stream in self._files.streams.values():
            stream.abort()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._prefetcher is not None:
            self._prefetcher.join()
        for thread in self._stream_threads:
            thread.join()
        self._files.close()
        self.release_inherited()
        for event in self._ready.values():
            event.set()   # whoever still waits gets an error, not a hang

    @property
    def inherited(self) -> int:
        """How many of this session's shards are copies inherited from the standby that forked this
        process (read in its own memory: docs/checkpoint.md "Restore from inherited memory")."""
        return sum(1 for c in self._files.held.values() if c.pid == held.HERE)

    def release_inherited(self) -> None:
        """This session reads no copy inherited from the standby any more (every unit loaded, or it
        ends): they are dropped once no other session reads them (``held.release_inherited``)."""
        with self._lock:
            reading, self._inherited = self._inherited, False
        held.release_inherited(reading=reading)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def units(self) -> list[str]:
        return list(self._units)

    @property
    def read_bytes(self) -> dict[str, int]:
        """Bytes read so far through the page cache ("buffered") and with O_DIRECT ("direct")."""
        return self._files.read_bytes

    # -- loading -------------------------------------------------------------------------------------

    def _schedule(self, unit: fmt.Unit, targets: Mapping[str, Any], device: torch.device) -> None:
        target_of = tensors_of(targets, where=unit.name)
        jobs: list[tuple[str, fmt.TensorEntry, list[fmt.Piece]]] = []
        for path, entry in unit.tensors.items():
            jobs.append((path, entry, self._pieces_for(entry)))
        pending = [sum(len(p) for _, _, p in jobs)]
        loaded: dict[str, dict[int, torch.Tensor]] = {path: {} for path, _, _ in jobs}

        def finish() -> None:
            tensors = {path: self._assemble(unit, path, entry, loaded[path], target_of.get(path), device)
                       for path, entry, _ in jobs}
            self._values[unit.name] = unflatten(unit.skeleton, tensors.__getitem__)
            self.loaded_s[unit.name] = time.monotonic() - self.started
            self._ready[unit.name].set()

        def done(path: str, piece: fmt.Piece, value: torch.Tensor) -> None:
            loaded[path][piece.index] = value
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                finish()

        def read_batch(batch: list[tuple[str, fmt.TensorEntry, fmt.Piece]]) -> None:
            run: list[fileio.Job] = []
            try:
                for path, entry, piece in batch:
                    if self._error is not None or self._closed:
                        return
                    direct = target_of.get(path) if entry.split_dim is None or len(entry.pieces) == 1 else None
                    job = self._job(unit, path, entry, piece, direct, device)
                    if run and run[-1].adjoins(job):
                        job.count, job.nbytes = run[-1].count + 1, run[-1].nbytes + piece.nbytes
                    else:
                        self._read_run(run, done)
                        run = []
                    run.append(job)
                self._read_run(run, done)
            except CheckpointError as e:
                self._fail(e)
            except Exception as e:  # noqa: BLE001 - a worker's error must reach the waiter
                self._fail(CheckpointError(f"checkpoint: couldn't load {unit.name} from step-{self.step}: {e!r}"))

        if pending[0] == 0:
            finish()
        # A few batches per unit, each a run of ascending offsets of about equal bytes: every I/O thread
        # busy, each reading sequentially (read-ahead works cold), and no task per small tensor. The
        # pieces of a streamed shard go to its stream's thread instead, which takes them in file order.
        todo = sorted(((path, entry, piece) for path, entry, pieces in jobs for piece in pieces
                       if piece.shard not in self._streamed),
                      key=lambda j: (j[2].shard, j[2].offset))
        for path, entry, pieces in jobs:
            for piece in pieces:
                if piece.shard in self._streamed:
                    direct = target_of.get(path) if entry.split_dim is None or len(entry.pieces) == 1 else None
                    self._streamed[piece.shard].append(_Streamed(unit, path, entry, piece, direct, done))
        share = sum(j[2].nbytes + 4096 for j in todo) / self._threads
        if all(j[2].shard in self._files.held or j[2].shard in self._files.sources for j in todo):
            # In memory: no read-ahead to keep going, so smaller batches, and a thread that a busy core
            # slows does not leave the others idle at the end with its share still to read.
            share = min(share, _MEMORY_BATCH)
        batch: list[tuple[str, fmt.TensorEntry, fmt.Piece]] = []
        filled = 0
        for job in todo:
            batch.append(job)
            filled += job[2].nbytes + 4096
            if filled >= share:
                self._pool.submit(read_batch, batch)
                batch, filled = [], 0
        if batch:
            self._pool.submit(read_batch, batch)

    def _load_held(self, units: list[fmt.Unit], into: Mapping[str, Mapping[str, Any]], device: torch.device) -> bool:
        """Every unit at once, when each of its bytes is in the node keeper's memory and goes to host
        memory, and the C loop is built: one plan of every piece (the keeper's address, the tensor's
        own memory, the manifest's xxh3) that the I/O threads read and check in the C loop while this
        thread still plans (``held.Plan``: they start with the first pieces published and take no GIL
        between two pieces), then each unit handed on. False (nothing done) where that does not hold:
        ``_schedule`` reads them then."""
        if device.type != "cpu" or not self._files.held or self._files.sources or self._files.streams \
                or not held.batch_loop():
            return False
        copies = self._files.held
        todo: list[tuple[fmt.Unit, Mapping[str, torch.Tensor], list[tuple[str, fmt.TensorEntry, list[fmt.Piece]]]]] = []
        capacity = 0
        for unit in units:
            targets = into.get(unit.name, into.get(unit.module) if unit.part == MODEL else None) or {}
            target_of: Mapping[str, torch.Tensor] = tensors_of(targets, where=unit.name)
            if any(t.device.type != "cpu" for t in target_of.values()):
                return False
            entries = [(path, entry, self._pieces_for(entry)) for path, entry in unit.tensors.items()]
            for _, _, pieces in entries:
                if any(p.nbytes and p.shard not in copies for p in pieces):
                    return False
                capacity += len(pieces)
            todo.append((unit, target_of, entries))
        pid = next(iter(copies.values())).pid   # (a piece of no bytes reads nothing)
        where: list[tuple[fmt.Unit, str, fmt.Piece, int]] = []
        finishing: list[tuple[fmt.Unit, Mapping[str, torch.Tensor], list[tuple[str, fmt.TensorEntry]],
                              dict[str, dict[int, torch.Tensor]]]] = []
        try:
            read = self._plan_and_read(todo, capacity, where, finishing, pid)
        except CheckpointError as e:
            self._fail(e)
            return True
        except Exception as e:  # noqa: BLE001 - as a worker's error in _schedule: it must reach the waiter
            self._fail(CheckpointError(f"checkpoint: couldn't load step-{self.step} from the keeper's memory: {e!r}"))
            return True
        if read is None:
            return True
        status, early = read
        if any(status):   # (each piece's status is 0 when all were read and matched)
            for code, (unit, path, piece, keeper) in zip(status, where, strict=True):
                if code == held.NOT_READ or code == 0:
                    continue
                if code == held.MISMATCH:
                    error = CheckpointCorrupt(f"checkpoint: step-{self.step}: checksum mismatch in {unit.name}/{path} "
                                              f"({piece.shard}.h5)")
                else:
                    how = "in this process's memory" if keeper == held.HERE else \
                        f"in the keeper's memory: process_vm_readv from the keeper (pid {keeper})"
                    error = CheckpointCorrupt(f"checkpoint: step-{self.step}: {piece.shard}.h5's copy {how}: "
                                              f"{os.strerror(code)}, inside {unit.name}/{path}")
                self._fail(error)
                return True
        self._files.read_bytes["memory"] = self._files.read_bytes.get("memory", 0) + sum(p.nbytes for _, _, p, _ in where)
        try:
            for (unit, target_of, pairs, loaded), built in zip(finishing, early, strict=True):
                if built is None:
                    tensors = {path: self._assemble(unit, path, entry, loaded[path], target_of.get(path), device)
                               for path, entry in pairs}
                    value = unflatten(unit.skeleton, tensors.__getitem__)
                else:
                    (value,) = built
                self._values[unit.name] = value
                self.loaded_s[unit.name] = time.monotonic() - self.started
                self._ready[unit.name].set()
        except CheckpointError as e:
            self._fail(e)
        return True

    def _plan_and_read(self, todo: list[tuple[fmt.Unit, Mapping[str, torch.Tensor],
                                              list[tuple[str, fmt.TensorEntry, list[fmt.Piece]]]]],
                       capacity: int, where: list[tuple[fmt.Unit, str, fmt.Piece, int]],
                       finishing: list[tuple[fmt.Unit, Mapping[str, torch.Tensor], list[tuple[str, fmt.TensorEntry]],
                                             dict[str, dict[int, torch.Tensor]]]],
                       pid: int) -> tuple[list[int], list[tuple[Any] | None]] | None:
        """``_load_held``'s plan, read while it is built: each piece's status, and per unit of
        ``finishing`` its value built while the other threads still read (``_in_place``), as a 1-tuple,
        else None; or None when a piece was found unreadable while planning (the session has its error
        then)."""
        copies = self._files.held
        with held.Plan(capacity, threads=self._threads, helpers=self._pool) as plan:
            for unit, target_of, entries in todo:
                loaded: dict[str, dict[int, torch.Tensor]] = {}
                for path, entry, pieces in entries:
                    dtype = from_name(entry.dtype)
                    target = target_of.get(path) if entry.split_dim is None or len(entry.pieces) == 1 else None
                    mine = loaded[path] = {}
                    for piece in pieces:
                        if target is not None and target.dtype == dtype and tuple(target.shape) == piece.shape \
                                and target.is_contiguous():
                            out = target
                        else:
                            out = torch.empty(piece.shape, dtype=dtype)
                        mine[piece.index] = out
                        copy = copies.get(piece.shard)
                        want = _want(piece.xxh3)
                        if copy is None or want < 0 or out.nbytes != piece.nbytes \
                                or piece.offset + piece.nbytes > copy.size:
                            error = self._unreadable(unit, path, entry, piece, out, copy)
                            if error is not None:
                                self._fail(error)
                                return None
                        keeper = copy.pid if copy is not None else pid
                        plan.add(copy.addr + piece.offset if copy is not None else 0,
                                 out.data_ptr() if piece.nbytes else 0, piece.nbytes, want, keeper)
                        where.append((unit, path, piece, keeper))
                        if plan.count % _PUBLISH_EVERY == 0:
                            plan.publish()
                plan.publish()
                finishing.append((unit, target_of, [(path, entry) for path, entry, _ in entries], loaded))
            # Every piece is published: what the units hand on needs none of their bytes, so it is built
            # now, while the other threads read, not after the last byte lands.
            early = [self._in_place(unit, target_of, pairs, loaded) for unit, target_of, pairs, loaded in finishing]
            return plan.run(), early

    def _in_place(self, unit: fmt.Unit, target_of: Mapping[str, torch.Tensor],
                  pairs: list[tuple[str, fmt.TensorEntry]], loaded: dict[str, dict[int, torch.Tensor]]) -> tuple[Any] | None:
        """``unit``'s value (a 1-tuple) when each of its tensors is the very one its piece is read into
        (``_assemble`` would hand it on as it is: no cut of re-split pieces, no copy into a target of
        another shape), else None (built from the bytes once they are read)."""
        tensors: dict[str, torch.Tensor] = {}
        for path, entry in pairs:
            if entry.split_dim is not None and self.layout_changed:
                return None
            (value,) = loaded[path].values()
            target = target_of.get(path)
            if target is not None and target is not value:
                return None
            tensors[path] = value
        return (unflatten(unit.skeleton, tensors.__getitem__),)

    def _unreadable(self, unit: fmt.Unit, path: str, entry: fmt.TensorEntry, piece: fmt.Piece, out: torch.Tensor,
                    copy: held.HeldCopy | None) -> CheckpointCorrupt | None:
        """Why ``piece`` cannot be read into ``out`` from ``copy`` (a size the manifest contradicts, a
        range outside the copy, a checksum that is no XXH3-64), or None."""
        if out.numel() * out.element_size() != piece.nbytes:
            return CheckpointCorrupt(f"checkpoint: step-{self.step}: {unit.name}/{path}: {piece.nbytes} bytes "
                                     f"recorded for shape {list(piece.shape)} {entry.dtype}")
        if copy is not None and piece.offset + piece.nbytes > copy.size:
            return CheckpointCorrupt(f"checkpoint: step-{self.step}: {piece.shard}.h5's copy in the keeper's memory: "
                                     f"{piece.offset}+{piece.nbytes} is outside the copy's {copy.size} bytes, "
                                     f"inside {unit.name}/{path}")
        if _want(piece.xxh3) < 0:   # no read matches it, as no read matches it as a string
            return CheckpointCorrupt(f"checkpoint: step-{self.step}: checksum mismatch in {unit.name}/{path} "
                                     f"({piece.shard}.h5)")
        return None

    def _read_stream(self, shard: str, items: list[_Streamed], device: torch.device) -> None:
        """Every piece this rank needs of a streamed shard, in file order, as its bytes arrive."""
        try:
            for item in sorted(items, key=lambda i: i.piece.offset):
                if self._error is not None or self._closed:
                    return
                job = self._job(item.unit, item.path, item.entry, item.piece, item.target, device)
                self._files.read_stream(shard, job)
                if job.dest is not None:
                    job.dest.copy_(job.out)   # synchronous: the staging buffer is reused by the next piece
                item.done(item.path, item.piece, job.dest if job.dest is not None else job.out)
        except CheckpointError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - a worker's error must reach the waiter
            self._fail(CheckpointCorrupt(f"checkpoint: couldn't load step-{self.step}'s {shard} from a peer: {e!r}"))
        finally:
            self._files.streams[shard].close()   # the rest of the stream is not needed

    def _prefetch(self, units: list[fmt.Unit]) -> None:
        """Ask the kernel for each unit's byte ranges, one unit after the other in loading order: from a
        cold cache, reads of a few MB each wait on the disk one by one, while one stream of WILLNEED
        ranges keeps the disk busy ahead of the readers."""
        for unit in units:
            spans: dict[str, tuple[int, int]] = {}
            for entry in unit.tensors.values():
                for p in self._pieces_for(entry):
                    if p.nbytes:
                        lo, hi = spans.get(p.shard, (p.offset, p.offset + p.nbytes))
                        spans[p.shard] = (min(lo, p.offset), max(hi, p.offset + p.nbytes))
            for shard, (lo, hi) in spans.items():
                if shard in self._files.sources or shard in self._files.held or shard in self._files.streams \
                        or self._files.direct(shard):
                    continue   # in memory already; or WILLNEED would fill the page cache behind the direct reads' back
                if self._closed or self._error is not None:
                    return
                try:
                    os.posix_fadvise(self._files.fd(shard), lo, hi - lo, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass  # advice only; the reads still happen

    def _pieces_for(self, entry: fmt.TensorEntry) -> list[fmt.Piece]:
        """The pieces this rank reads: all of a whole tensor, its own of a split one, or, when the
        data-parallel size changed, those that overlap its new piece."""
        if entry.split_dim is None:
            return list(entry.pieces)
        if not self.layout_changed:
            return [entry.pieces[self.layout.data_parallel_rank]]
        lo, hi = self._new_rows(entry)
        return [p for p, at in _piece_rows(entry) if at < hi and at + p.shape[entry.split_dim] > lo]

    def _new_rows(self, entry: fmt.TensorEntry) -> tuple[int, int]:
        """This rank's rows along the split dimension under the new layout (torch.tensor_split's cut)."""
        if entry.split_dim is None:
            raise CheckpointError(f"checkpoint: step-{self.step}: not a split tensor")
        length = entry.shape[entry.split_dim]
        size, rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        small, extra = divmod(length, size)
        lo = rank * small + min(rank, extra)
        return lo, lo + small + (1 if rank < extra else 0)

    def _job(self, unit: fmt.Unit, path: str, entry: fmt.TensorEntry, piece: fmt.Piece,
             target: torch.Tensor | None, device: torch.device) -> fileio.Job:
        """Where one piece's bytes go: the target itself when it is plain host memory, else this
        thread's page-locked staging buffer (then onto the device), else a new host tensor."""
        dtype = from_name(entry.dtype)
        fits = target is not None and target.dtype == dtype and tuple(target.shape) == piece.shape
        staged = (target.device.type != "cpu" if target is not None else device.type != "cpu") \
            and piece.nbytes > 0
        if fits and target is not None and target.device.type == "cpu" and target.is_contiguous():
            out = target
        elif staged:
            out = self._staging(piece.nbytes)[:piece.nbytes].view(dtype).view(piece.shape)
        else:
            out = torch.empty(piece.shape, dtype=dtype)
        if out.numel() * out.element_size() != piece.nbytes:
            raise CheckpointCorrupt(f"checkpoint: step-{self.step}: {unit.name}/{path}: {piece.nbytes} bytes "
                                    f"recorded for shape {list(piece.shape)} {entry.dtype}")
        buf = fileio.host_bytes(out)
        dest = None
        if staged:
            dest = target if fits and target is not None else torch.empty(piece.shape, dtype=dtype, device=device)
        return fileio.Job(f"{unit.name}/{path}", path, piece, out, buf, dest, nbytes=piece.nbytes)

    def _read_run(self, run: list[fileio.Job], done: Callable[[str, fmt.Piece, torch.Tensor], None]) -> None:
        """Read and check adjoining pieces, then hand each on (onto the device when staged)."""
        if not self._files.read_run(run, stop=lambda: self._closed or self._error is not None):
            return
        for job in run:
            if job.dest is not None:
                job.dest.copy_(job.out)   # synchronous: the staging buffer is reused by the next read
            done(job.path, job.piece, job.dest if job.dest is not None else job.out)

    def _staging(self, nbytes: int) -> torch.Tensor:
        buf: torch.Tensor | None = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 64 << 20)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._local.staging = buf
        return buf

    def _assemble(self, unit: fmt.Unit, path: str, entry: fmt.TensorEntry, pieces: dict[int, torch.Tensor],
                  target: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if entry.split_dim is not None and self.layout_changed:
            dim = entry.split_dim
            lo, hi = self._new_rows(entry)
            starts = {p.index: at for p, at in _piece_rows(entry)}
            if pieces:
                first = min(pieces)
                read = torch.cat([pieces[i] for i in sorted(pieces)], dim=dim)
                value = read.narrow(dim, lo - starts[first], hi - lo).contiguous()
            else:   # an empty piece: more ranks than rows
                shape = list(entry.shape)
                shape[dim] = 0
                value = torch.empty(shape, dtype=from_name(entry.dtype),
                                    device=device if target is None else target.device)
        else:
            (value,) = pieces.values()
        if target is not None:
            if target is value:
                return target
            if tuple(target.shape) != tuple(value.shape) or target.dtype != value.dtype:
                raise CheckpointError(
                    f"checkpoint: couldn't restore {unit.name}/{path}: the checkpoint holds "
                    f"{list(value.shape)} {value.dtype}, the model {list(target.shape)} {target.dtype}")
            target.copy_(value)
            return target
        return value if device.type == "cpu" else value.to(device)

    def _fail(self, error: CheckpointError) -> None:
        with self._lock:
            first, self._error = self._error is None, self._error or error
            handed_out = self._handed_out
        if first and isinstance(error, CheckpointCorrupt) and handed_out and not self.sources:
            # Training already runs on this checkpoint's critical units; the next restore must skip it.
            fmt.mark_corrupt(self.path, str(error))
            log.error("%s; marked it CORRUPT (restart to restore the previous checkpoint)", error)
        for event in self._ready.values():
            event.set()


@dataclass(frozen=True, slots=True)
class _Streamed:
    """A piece of a streamed shard, where it goes, and whom to tell once it is in and checked."""

    unit: fmt.Unit
    path: str
    entry: fmt.TensorEntry
    piece: fmt.Piece
    target: torch.Tensor | None
    done: Callable[[str, fmt.Piece, torch.Tensor], None]


_HEX = frozenset("0123456789abcdef")


def _want(xxh3: str) -> int:
    """The manifest's hex XXH3-64 as the C loop compares it; -1 where it is none (16 lowercase hex
    digits, as ``hexdigest()`` writes it: ``_unreadable`` refuses it before it is planned)."""
    if len(xxh3) != 16 or not _HEX.issuperset(xxh3):
        return -1
    return int(xxh3, 16)


def _piece_rows(entry: fmt.TensorEntry) -> list[tuple[fmt.Piece, int]]:
    """Each piece of a split tensor with the first row it holds along the split dimension."""
    if entry.split_dim is None:
        raise CheckpointError("checkpoint: not a split tensor")
    rows, at = [], 0
    for piece in sorted(entry.pieces, key=lambda p: p.index):
        rows.append((piece, at))
        at += piece.shape[entry.split_dim]
    return rows
