"""Restore, critical module first.

The units (a module's weights, a module's optimizer state) this rank needs are queued in the order the
first step needs them: the critical modules' weights, the other modules' weights in load order, then
the optimizer states. A small pool of I/O threads reads each tensor straight into its destination with
``preadv`` (no GIL held) and checks its xxh3 against the manifest; a unit is ready once all its tensors
are. ``open_restore`` returns once the critical units are ready; ``Restore.module(name)`` waits for that
module alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import torch

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import rng
from slurm_omni.checkpoint.dtypes import from_name
from slurm_omni.checkpoint.format import CheckpointCorrupt
from slurm_omni.checkpoint.snapshot import MODEL, OPTIM, ShardLayout
from slurm_omni.checkpoint.tree import flatten, unflatten
from slurm_omni.errors import CheckpointError

log = logging.getLogger(__name__)


class Restore:
    """One checkpoint being loaded onto this rank."""

    def __init__(self, path: Path, manifest: fmt.Manifest, layout: ShardLayout, *,
                 units: list[fmt.Unit], into: Mapping[str, Mapping[str, Any]], device: torch.device,
                 threads: int) -> None:
        self.path = path
        self.manifest = manifest
        self.step = manifest.step
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
        self._fds: dict[tuple[str, int], int] = {}
        self._local = threading.local()
        self._closed = False
        self._handed_out = False   # set by open_restore once it hands the session out
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="omni-ckpt-restore")
        self.started = time.monotonic()
        self.loaded_s: dict[str, float] = {}
        for u in units:
            targets = into.get(u.name, into.get(u.module) if u.part == MODEL else None)
            self._schedule(u, targets or {}, device)

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

    def ready(self, name: str) -> bool:
        return self._ready[name].is_set() and self._error is None

    def wait(self, names: Iterable[str] | None = None) -> None:
        for name in self._units if names is None else names:
            self.unit(name)

    def close(self) -> None:
        """Stop loading (pending reads are dropped) and release the files."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for event in self._ready.values():
            event.set()   # whoever still waits gets an error, not a hang

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def units(self) -> list[str]:
        return list(self._units)

    # -- loading -------------------------------------------------------------------------------------

    def _fd(self, shard: str) -> int:
        """One descriptor per shard and thread: the kernel keeps read-ahead state per open file, and
        each thread reads its own ascending run of offsets."""
        key = (shard, threading.get_ident())
        with self._lock:
            if key not in self._fds:
                fd = os.open(self.path / str(self.manifest.shards[shard].file), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._fds[key] = fd
            return self._fds[key]

    def _schedule(self, unit: fmt.Unit, targets: Mapping[str, Any], device: torch.device) -> None:
        _, leaves = flatten(targets, where=unit.name)
        target_of = {leaf.path: leaf.tensor for leaf in leaves}
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

        def read(path: str, entry: fmt.TensorEntry, piece: fmt.Piece) -> None:
            try:
                if self._error is not None or self._closed:
                    return
                direct = target_of.get(path) if entry.split_dim is None or len(entry.pieces) == 1 else None
                loaded[path][piece.index] = self._read(unit, path, entry, piece, direct, device)
                with self._lock:
                    pending[0] -= 1
                    last = pending[0] == 0
                if last:
                    finish()
            except CheckpointError as e:
                self._fail(e)
            except Exception as e:  # noqa: BLE001 - a worker's error must reach the waiter
                self._fail(CheckpointError(f"checkpoint: couldn't load {unit.name}/{path} from "
                                           f"step-{self.step}: {e!r}"))

        def read_batch(batch: list[tuple[str, fmt.TensorEntry, fmt.Piece]]) -> None:
            self._prefetch([job[2] for job in batch])
            for path, entry, piece in batch:
                read(path, entry, piece)

        if pending[0] == 0:
            finish()
        # A few batches per unit, each a run of ascending offsets of about equal bytes: every I/O thread
        # busy, each reading sequentially (read-ahead works cold), and no task per small tensor.
        todo = sorted(((path, entry, piece) for path, entry, pieces in jobs for piece in pieces),
                      key=lambda j: (j[2].shard, j[2].offset))
        share = sum(j[2].nbytes + 4096 for j in todo) / self._threads
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

    def _prefetch(self, pieces: list[fmt.Piece]) -> None:
        """Ask the kernel for the batch's whole byte range at once: from a cold cache, reads of a few MB
        each wait on the disk one by one, while one WILLNEED range streams at the disk's pace."""
        spans: dict[str, tuple[int, int]] = {}
        for p in pieces:
            if p.nbytes:
                lo, hi = spans.get(p.shard, (p.offset, p.offset + p.nbytes))
                spans[p.shard] = (min(lo, p.offset), max(hi, p.offset + p.nbytes))
        for shard, (lo, hi) in spans.items():
            try:
                os.posix_fadvise(self._fd(shard), lo, hi - lo, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # advice only; the reads still happen

    def _pieces_for(self, entry: fmt.TensorEntry) -> list[fmt.Piece]:
        if entry.split_dim is None or self.layout_changed:
            return list(entry.pieces)
        return [entry.pieces[self.layout.data_parallel_rank]]

    def _read(self, unit: fmt.Unit, path: str, entry: fmt.TensorEntry, piece: fmt.Piece,
              target: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Read one piece into its destination: the target itself when it is plain host memory, else
        through this thread's page-locked staging buffer onto the device, else a new host tensor."""
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
        buf = out.reshape(-1).view(torch.uint8).numpy().data.cast("B") if piece.nbytes else b""
        if len(buf) != piece.nbytes:
            raise CheckpointCorrupt(f"checkpoint: step-{self.step}: {unit.name}/{path}: {piece.nbytes} bytes "
                                    f"recorded for shape {list(piece.shape)} {entry.dtype}")
        if piece.nbytes:
            fd, done = self._fd(piece.shard), 0
            while done < piece.nbytes:
                n = os.preadv(fd, [buf[done:]], piece.offset + done)
                if n <= 0:
                    raise CheckpointCorrupt(f"checkpoint: step-{self.step}: {piece.shard}.h5 is truncated "
                                            f"inside {unit.name}/{path}")
                done += n
        if fmt.checksum(buf) != piece.xxh3:
            raise CheckpointCorrupt(f"checkpoint: step-{self.step}: checksum mismatch in {unit.name}/{path} "
                                    f"({piece.shard}.h5)")
        if staged:
            dest = target if fits and target is not None else torch.empty(piece.shape, dtype=dtype, device=device)
            dest.copy_(out)   # synchronous: the staging buffer is reused by this thread's next read
            return dest
        return out

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
            full = torch.cat([pieces[i] for i in sorted(pieces)], dim=entry.split_dim)
            mine = torch.tensor_split(full, self.layout.data_parallel_size, dim=entry.split_dim)
            value = mine[self.layout.data_parallel_rank].contiguous()
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
        if first and isinstance(error, CheckpointCorrupt) and handed_out:
            # Training already runs on this checkpoint's critical units; the next restore must skip it.
            fmt.mark_corrupt(self.path, str(error))
            log.error("%s; marked it CORRUPT (restart to restore the previous checkpoint)", error)
        for event in self._ready.values():
            event.set()


def open_restore(root: Path, layout: ShardLayout, *, step: int | None = None,
                 critical: Iterable[str] | None = None, modules: Iterable[str] | None = None,
                 into: Mapping[str, Mapping[str, Any]] | None = None, device: torch.device | str = "cpu",
                 threads: int = 4, apply_rng: bool = True) -> Restore | None:
    """Load the newest complete checkpoint that verifies; None when there is none at all.

    A truncated file or a checksum mismatch in the manifest or a critical unit marks that checkpoint
    CORRUPT, logs one line, and the previous complete checkpoint is tried. A mismatch found later, while
    the rest streams in, surfaces as CheckpointCorrupt on first use of that unit (and the mark makes the
    next attempt skip the checkpoint).
    """
    candidates = fmt.complete(root)
    if step is not None:
        candidates = [e for e in candidates if e.step == step]
        if not candidates:
            raise CheckpointError(f"checkpoint: couldn't restore step {step}: no complete step-{step} in {root}")
    if not candidates:
        return None
    skipped = []
    for entry in candidates:
        session = None
        try:
            manifest = fmt.read_manifest(entry.path)
            _check_files(entry.path, manifest)
            units, wanted = _select(manifest, layout, critical, modules)
            session = Restore(entry.path, manifest, layout, units=units, into=into or {},
                              device=torch.device(device), threads=threads)
            session.wait(wanted)
            with session._lock:
                session._handed_out = True
                early = session._error
            if isinstance(early, CheckpointCorrupt):
                raise early   # found while the critical units loaded: still time to fall back
        except CheckpointCorrupt as e:
            if session is not None:
                session.close()
            fmt.mark_corrupt(entry.path, str(e))
            log.warning("%s; marked it CORRUPT and trying the previous checkpoint", e)
            skipped.append(f"step-{entry.step}")
            continue
        except BaseException:
            if session is not None:
                session.close()
            raise
        if apply_rng:
            session.apply_rng()
        log.info("checkpoint: restoring step-%d (%s ready in %.2f s; %d units streaming)%s", session.step,
                 ", ".join(wanted) or "nothing critical", time.monotonic() - session.started,
                 len(units) - len(wanted), f"; skipped {', '.join(skipped)}" if skipped else "")
        return session
    raise CheckpointError(f"checkpoint: couldn't restore from {root}: every complete checkpoint is corrupt "
                          f"({', '.join(skipped)}; see the CORRUPT file in each)")


def _check_files(path: Path, manifest: fmt.Manifest) -> None:
    for shard in manifest.shards.values():
        if shard.file is None:
            continue
        try:
            size = os.stat(path / shard.file).st_size
        except FileNotFoundError as e:
            raise CheckpointCorrupt(f"checkpoint: {path.name}: {shard.file} is missing") from e
        if size != shard.file_bytes:
            raise CheckpointCorrupt(f"checkpoint: {path.name}: {shard.file} is truncated or damaged "
                                    f"({size} bytes on disk, {shard.file_bytes} written)")


def _select(manifest: fmt.Manifest, layout: ShardLayout, critical: Iterable[str] | None,
            modules: Iterable[str] | None) -> tuple[list[fmt.Unit], list[str]]:
    """This rank's units in loading order, and the names of the critical ones."""
    if modules is None:
        mine = {u.module for u in manifest.units.values() if u.stage == layout.stage}
        if not mine and manifest.units:
            stages = sorted({u.stage for u in manifest.units.values()})
            raise CheckpointError(f"checkpoint: step-{manifest.step} has no modules for stage "
                                  f"{layout.stage!r} (saved stages: {', '.join(stages)}; pass modules=)")
    else:
        mine = set(modules)
        unknown = mine - {u.module for u in manifest.units.values()}
        if unknown:
            raise CheckpointError(f"checkpoint: step-{manifest.step} has no module {min(unknown)!r}")
    order = [m for m in manifest.load_order if m in mine] + sorted(mine - set(manifest.load_order))
    first = [m for m in (order if critical is None else critical)]
    unknown = set(first) - mine
    if unknown:
        raise CheckpointError(f"checkpoint: critical module {min(unknown)!r} is not among "
                              f"this rank's modules ({', '.join(order)})")
    names = [f"{m}/{MODEL}" for m in first]
    names += [f"{m}/{MODEL}" for m in order if m not in first]
    names += [f"{m}/{OPTIM}" for m in order]
    units = [manifest.units[n] for n in names if n in manifest.units]
    return units, [f"{m}/{MODEL}" for m in first if f"{m}/{MODEL}" in manifest.units]
