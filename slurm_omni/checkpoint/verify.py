"""Full verification of one checkpoint directory: marker, manifest, files, HDF5 structure, every checksum.

Restore checks the same things as it loads; this reads everything once, in bounded memory, for
``omni ckpt verify`` and for scripts that want to know before they rely on a checkpoint.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import xxhash

from slurm_omni.checkpoint import format as fmt
from slurm_omni.errors import CheckpointError

_CHUNK = 16 << 20


@dataclass(slots=True)
class VerifyReport:
    path: Path
    step: int | None
    problems: list[str] = field(default_factory=list)
    datasets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    in_memory: list[str] = field(default_factory=list)
    """Shards of a memory-only step that are only in the memory tier (not checked here: a restore
    checks them as it reads them, and passes over the step where no memory holds them)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "ok": self.ok, "problems": self.problems,
                "datasets": self.datasets, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "in_memory": self.in_memory}


def resolve(path: Path) -> Path:
    """A step directory as given, or the newest complete one when ``path`` is a checkpoint root."""
    if (path / fmt.MANIFEST).exists() or (path / fmt.MARKER).exists() or fmt.is_step_dir(path.name):
        return path
    done = fmt.complete(path)
    if not done:
        raise CheckpointError(f"checkpoint: couldn't find a complete checkpoint under {path} (omni ckpt ls {path})")
    return done[0].path


def total_bytes(manifest: fmt.Manifest) -> int:
    return sum(p.nbytes for u in manifest.units.values() for t in u.tensors.values() for p in t.pieces)


def verify(path: Path, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check ``path``; ``progress(n)`` is called with each n bytes checksummed."""
    started = time.monotonic()
    report = VerifyReport(path=path, step=None)
    if (path / fmt.CORRUPT).exists():
        report.problems.append(f"marked CORRUPT: {(path / fmt.CORRUPT).read_text(errors='replace').strip()}")
    try:
        manifest = fmt.read_manifest(path)
    except CheckpointError as e:
        report.problems.append(str(e))
        report.seconds = time.monotonic() - started
        return report
    report.step = manifest.step
    pieces: dict[str, list[tuple[str, fmt.Piece]]] = {}
    for unit in manifest.units.values():
        for tpath, tensor in unit.tensors.items():
            for piece in tensor.pieces:
                pieces.setdefault(piece.shard, []).append((f"{unit.name}/{tpath}", piece))
    buf = np.empty(_CHUNK, dtype=np.uint8)
    for name, shard in sorted(manifest.shards.items()):
        mine = sorted(pieces.get(name, []), key=lambda p: p[1].offset)
        if shard.file is None:
            if mine:
                report.problems.append(f"{name}: holds {len(mine)} datasets but names no file")
            continue
        file = path / shard.file
        try:   # the manifest names only rank-NNNNN.h5 (format._check_bounds); never through a link
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if shard.memory_only:
                report.in_memory.append(name)
            else:
                report.problems.append(f"{shard.file}: missing")
            continue
        except OSError as e:
            report.problems.append(f"{shard.file}: couldn't open: {e.strerror}")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                report.problems.append(f"{shard.file}: not a regular file")
                continue
            if st.st_size != shard.file_bytes:
                report.problems.append(f"{shard.file}: {st.st_size} bytes on disk, {shard.file_bytes} written "
                                       f"(truncated?)")
            report.problems += _check_structure(file, mine)
            for where, piece in mine:
                report.datasets += 1
                problem = _check_piece(fd, piece, buf, progress)
                report.bytes += piece.nbytes
                if problem:
                    report.problems.append(f"{where} ({shard.file}): {problem}")
        finally:
            os.close(fd)
    report.seconds = time.monotonic() - started
    return report


def _check_structure(file: Path, pieces: list[tuple[str, fmt.Piece]]) -> list[str]:
    """The HDF5 file agrees with the manifest: each dataset where it says, with its shape and checksum."""
    problems = []
    try:
        with h5py.File(file, "r") as f:
            for where, piece in pieces:
                dset = f.get(piece.dataset)
                if not isinstance(dset, h5py.Dataset):
                    problems.append(f"{where}: no dataset {piece.dataset} in {file.name}")
                    continue
                offset = dset.id.get_offset()
                if tuple(dset.shape) != piece.shape or (offset if offset is not None else -1) != piece.offset \
                        or dset.attrs.get(fmt.CHECKSUM) != piece.xxh3:
                    problems.append(f"{where}: {file.name} disagrees with the manifest (shape, offset or checksum)")
    except OSError as e:
        problems.append(f"{file.name}: not a readable HDF5 file ({e})")
    return problems


def _check_piece(fd: int, piece: fmt.Piece, buf: np.ndarray, progress: Callable[[int], None] | None) -> str:
    h = xxhash.xxh3_64()
    view = buf.data.cast("B")
    done = 0
    while done < piece.nbytes:
        want = min(_CHUNK, piece.nbytes - done)
        n = os.preadv(fd, [view[:want]], piece.offset + done)
        if n <= 0:
            return f"file ends {piece.nbytes - done} bytes early"
        h.update(view[:n])
        done += n
        if progress:
            progress(n)
    return "" if h.hexdigest() == piece.xxh3 else "checksum mismatch"
