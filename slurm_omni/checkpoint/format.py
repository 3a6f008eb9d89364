"""The on-disk format: names, the manifest, the completion marker, and what counts as complete.

A checkpoint root holds one directory per step::

    step-120.tmp.i4/      being written by incarnation 4 (never read); each incarnation stages
                          apart (``.i<number>``, or ``.r<run>`` unfenced; ``step-120.tmp`` from older
                          writers), so a late one cannot touch what a newer one writes
    step-120/             renamed once every shard is durable
        rank-00000.h5     one HDF5 file per rank that holds tensors: /<module>/<part>/<tensor path>
        rank-00000.json   that rank's shard record (written before the rename)
        manifest.json     step, layout, units, load order, per-rank data and RNG state
        COMPLETE          written last; names the manifest's size and checksum
        CORRUPT           written by a reader that found a bad checksum; the directory no longer counts
        FENCED            committed by an older incarnation after a newer one started (``fence.py``)
    FENCE                 the highest incarnation that started on this root, and its raises

Only a directory with a valid ``COMPLETE``, no ``CORRUPT`` or ``FENCED``, that the fence lets count, counts. This module needs neither torch nor
h5py, so ``omni ckpt ls`` and the requeue manager stay cheap.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from slurm_omni.checkpoint import manifest_schema
from slurm_omni.checkpoint.manifest_schema import Piece, TensorEntry
from slurm_omni.errors import CheckpointError
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic

log = logging.getLogger(__name__)

FORMAT_NAME = "slurm-omni-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMPLETE"
CORRUPT = "CORRUPT"
FENCED = "FENCED"
MEMORY_ONLY = "MEMORY_ONLY"
"""In a step directory some of whose shards are only in the memory tier (retention counts it apart)."""
CHECKSUM = "xxh3_64"
MARKER_LIMIT = 1 << 16
MANIFEST_LIMIT = 1 << 30
"""Bytes read at most from a marker (and CORRUPT, FENCED) and from a manifest."""
MAX_DEPTH = 64
"""A manifest nests no deeper (skeletons of optimizer states nest a few levels): deeper is corrupt,
not a recursion that ends the reader."""
LAST_CREATED = 253402300799.0
"""A manifest's ``created`` lies in [0, this] (9999-12-31 UTC): a time every reader can print."""


class CheckpointCorrupt(CheckpointError):
    """The bytes on disk are not what was written: a truncated file, a bad checksum, a broken manifest.

    Unlike other CheckpointErrors (a caller's mistake, a layout that does not fit), this one makes a
    restore fall back to the previous complete checkpoint.
    """


_STEP_RE = re.compile(r"^step-([0-9]+)(\.tmp(?:\.([A-Za-z0-9_.-]+))?|\.old-[0-9]+)?$")


def checksum(data: Any) -> str:
    """xxh3-64 of a buffer (bytes, memoryview, numpy array), as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def is_step_dir(name: str) -> bool:
    """Does ``name`` look like a step directory (complete or not)?"""
    return _STEP_RE.match(name) is not None


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def tmp_dir(root: Path, step: int) -> Path:
    """The staging folder writers before per-incarnation staging shared (still read as WRITING)."""
    return root / f"step-{step}.tmp"


def staging_dir(root: Path, step: int, incarnation: str, number: int | None) -> Path:
    """Where ``incarnation`` (its fence number ``number``, None: unfenced) writes ``step`` before the
    commit renames it to ``step-N``: a folder of its own, named so that a sweep can tell its age."""
    tag = f"i{number}" if number is not None else f"r{safe_name(incarnation)}"
    return root / f"step-{step}.tmp.{tag}"


def staging_step(name: str) -> int | None:
    """The step of a staging folder's name (any incarnation's, or the shared one), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m and m.group(2) and m.group(2).startswith(".tmp") else None


def _staging_number(tag: str | None) -> int | None:
    return int(tag[1:]) if tag and tag[0] == "i" and tag[1:].isdigit() else None


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}"


class Status(enum.Enum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"    # step-N/ without a valid marker: a crash between rename and marker
    WRITING = "writing"          # step-N.tmp[.TAG]/: a persist in flight or abandoned
    RETIRED = "retired"          # step-N.old-T/: an older copy of the same step being replaced
    CORRUPT = "corrupt"
    FENCED = "fenced"            # a late commit of an older incarnation (fence.py)


@dataclass(frozen=True, slots=True)
class Entry:
    """One directory under a checkpoint root."""

    step: int
    path: Path
    status: Status
    reason: str = ""
    incarnation: int | None = None
    """The writing incarnation's number: from the marker of a complete checkpoint, from the name of a
    staging folder (None: an unfenced or older writer)."""


def scan(root: Path) -> list[Entry]:
    """Every step directory under ``root``, oldest first; a missing root is an empty list."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"checkpoint: couldn't list {root}: {e.strerror}") from e
    entries = []
    for name in names:
        m = _STEP_RE.match(name)
        if not m:
            continue
        path = root / name
        step = int(m.group(1))
        if m.group(2) and m.group(2).startswith(".tmp"):
            entries.append(Entry(step, path, Status.WRITING, incarnation=_staging_number(m.group(3))))
        elif m.group(2):
            entries.append(Entry(step, path, Status.RETIRED))
        else:
            status, reason, incarnation = _status_of(path)
            entries.append(Entry(step, path, status, reason, incarnation))
    return sorted(entries, key=lambda e: (e.step, e.status is Status.COMPLETE))


def memory_only(path: Path) -> bool:
    """Whether the step directory ``path`` holds shards in memory only (``MEMORY_ONLY``)."""
    return os.path.lexists(path / MEMORY_ONLY)


def complete(root: Path) -> list[Entry]:
    """Complete checkpoints that count, newest first: not a late commit the fence shuts out."""
    from slurm_omni.checkpoint.fence import read_fence  # fence.py builds on this module

    fence = read_fence(root)
    return [e for e in reversed(scan(root)) if e.status is Status.COMPLETE
            and (fence is None or fence.counts(e.step, e.incarnation))]


def find_latest_complete(root: Path, *, memo: ManifestMemo | None = None) -> Entry | None:
    """The newest checkpoint whose marker and manifest check out (no tensor checksums read), or None;
    one that does not is passed over with one line. ``memo``: see ``read_manifest``."""
    for entry in complete(root):
        try:
            read_manifest(entry.path, memo=memo)
        except CheckpointError as e:
            log.warning("%s (falling back to the previous complete checkpoint)", e)
            continue
        return entry
    return None


def latest_step(root: Path) -> int | None:
    """The newest complete step under ``root`` (no checksums read), or None."""
    done = complete(root)
    return done[0].step if done else None


def _status_of(path: Path) -> tuple[Status, str, int | None]:
    """From the markers alone (cheap); ``read_manifest`` checks that the manifest matches it."""
    for name, status in ((CORRUPT, Status.CORRUPT), (FENCED, Status.FENCED)):
        if os.path.lexists(path / name):
            return status, _read_text(path / name), None
    try:
        raw = _read(path / MARKER, MARKER_LIMIT)
        if raw is None:
            return Status.INCOMPLETE, f"no {MARKER} marker", None
        marker = json.loads(raw)
    except (FileRejected, ValueError, RecursionError) as e:
        return Status.INCOMPLETE, f"unreadable {MARKER} ({e})", None
    if not isinstance(marker, dict) or "manifest_xxh3_64" not in marker:
        return Status.INCOMPLETE, f"malformed {MARKER}", None
    incarnation = marker.get("incarnation")
    return Status.COMPLETE, "", incarnation if isinstance(incarnation, int) else None


def _read(path: Path, limit: int) -> bytes | None:
    """``path``'s bytes, None when it is missing; a FileRejected for anything but a regular file of at
    most ``limit`` bytes (a symlink, a fifo: opened without blocking, refused, never read)."""
    try:
        return read_bounded(path, limit, what=f"{path.parent.name}/{path.name}")
    except FileRejected as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return None
        raise


def _read_text(path: Path) -> str:
    try:
        return (_read(path, MARKER_LIMIT) or b"").decode(errors="replace").strip()
    except FileRejected as e:
        return str(e)


def read_marker(path: Path) -> tuple[dict[str, Any], bytes]:
    """The completion marker of ``path`` and the manifest's bytes, checked against each other."""
    try:
        raw_marker = _read(path / MARKER, MARKER_LIMIT)
        if raw_marker is None:
            raise CheckpointError(f"checkpoint: {path.name} is incomplete: no {MARKER} marker")
        marker = json.loads(raw_marker)
    except (FileRejected, ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint: {path.name} is incomplete: unreadable {MARKER} ({e})") from e
    try:
        raw = _read(path / MANIFEST, MANIFEST_LIMIT)
    except FileRejected as e:
        raise CheckpointError(f"checkpoint: {path.name}: {e}") from e
    if raw is None:
        raise CheckpointError(f"checkpoint: {path.name}: couldn't read {MANIFEST}: no such file")
    if not isinstance(marker, dict) or marker.get("manifest_bytes") != len(raw) \
            or marker.get("manifest_xxh3_64") != checksum(raw):
        raise CheckpointCorrupt(f"checkpoint: {path.name}: {MANIFEST} does not match its {MARKER} marker")
    return marker, raw


ManifestMemo = dict[tuple[str, str], "Manifest"]
"""Manifests one restore already parsed, by folder and their bytes' xxh3 (the marker's, checked):
the runtime's restore reads the newest manifest three times (is it sound, is it this script's, the
restore itself), 2.5-4 ms of parsing each for 400 tensors. Kept by the caller for one restore only:
a manifest's state and RNG dicts go to the runtime, which must not see another restore's."""


def read_manifest(path: Path, *, memo: ManifestMemo | None = None) -> Manifest:
    """The manifest of a complete checkpoint directory; anything off is a CheckpointError. ``memo``:
    a manifest of the same bytes parsed before in the same restore is not parsed again (the marker and
    the manifest's bytes are still read and checked against each other)."""
    marker, raw = read_marker(path)
    key = (str(path), str(marker["manifest_xxh3_64"]))
    if memo is not None and key in memo:
        return memo[key]
    manifest = Manifest.from_bytes(raw, where=path.name)
    if memo is not None:
        memo[key] = manifest
    return manifest


def _decode(raw: bytes) -> Any:
    """``json.loads(raw)``: msgspec's decoder where it takes the bytes (0.8 against 1.2-1.5 ms for the
    manifest of 400 tensors: a restore from memory waits for it), json's where it refuses them (NaN or
    Infinity in a runtime's state, a number out of range, a byte-order mark: json reads those; msgspec
    takes no JSON that json refuses)."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def _nested_deeper(data: Any, limit: int) -> bool:
    """Does ``data`` (decoded JSON) nest lists and objects deeper than ``limit``? Without recursion."""
    level: list[Any] = [data]
    for _ in range(limit + 1):
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            return False
    return True


def _free_form(data: Any) -> Any:
    """The manifest without its tensor tables, whose every field ``_tensor_from_json`` turns into a
    number, a string or a tuple of numbers (anything nested there is refused by that), so only the rest
    (skeletons, states, RNG streams) is kept as it nests: a tenth of the nodes to walk for 400 tensors."""
    units = data.get("units") if isinstance(data, dict) else None
    if not isinstance(units, dict):
        return data
    return {**data, "units": {k: {**u, "tensors": None} if isinstance(u, dict) else u for k, u in units.items()}}


def mark_corrupt(path: Path, reason: str) -> None:
    """Take a checkpoint out of use, keeping its files for inspection. Safe while others read it."""
    try:
        write_atomic(path / CORRUPT, (reason.strip() + "\n").encode())
    except OSError:
        pass  # a read-only store: the reader still falls back, it just cannot tell the next one


# -- the manifest --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unit:
    """What loads as one piece: one module's weights ("model") or its optimizer state ("optim")."""

    module: str
    part: str
    stage: str
    skeleton: Any                       # the nested structure with tensor placeholders (see tree.py)
    tensors: dict[str, TensorEntry]

    @property
    def name(self) -> str:
        return f"{self.module}/{self.part}"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One rank at save time: where it sat in the layout, its file, and its own small state."""

    name: str
    rank: int
    stage: str
    data_parallel_rank: int
    data_parallel_size: int
    file: str | None
    file_bytes: int
    state: Any                     # the runtime's JSON state: data pipeline positions and so on
    rng: Any                       # rng.capture() output
    memory_only: bool = False
    """The shard file is only in the memory tier (its own node's, a peer's), not in the step directory:
    a step saved between two file system checkpoints (docs/checkpoint.md, "Memory-only steps")."""


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    world_size: int
    incarnation: str
    created: float
    writer_version: str
    load_order: tuple[str, ...]     # module names, in the order the first step needs them
    units: dict[str, Unit]          # "module/part" -> unit
    shards: dict[str, ShardInfo]    # shard name -> info

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units.values())

    def stages(self) -> dict[str, int]:
        """Stage name -> its data-parallel size."""
        return {s.stage: s.data_parallel_size for s in self.shards.values()}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "incarnation": self.incarnation,
            "created": self.created,
            "writer_version": self.writer_version,
            "load_order": list(self.load_order),
            "layout": [
                {"rank": s.rank, "stage": s.stage, "data_parallel_rank": s.data_parallel_rank,
                 "data_parallel_size": s.data_parallel_size, "shard": s.name}
                for s in sorted(self.shards.values(), key=lambda s: s.rank)
            ],
            "shards": {
                s.name: {"rank": s.rank, "file": s.file, "file_bytes": s.file_bytes, "state": s.state,
                         "rng": s.rng, **({"memory_only": True} if s.memory_only else {})}
                for s in self.shards.values()
            },
            "units": {
                u.name: {
                    "module": u.module, "part": u.part, "stage": u.stage, "skeleton": u.skeleton,
                    "tensors": {k: _tensor_json(t) for k, t in u.tensors.items()},
                }
                for u in self.units.values()
            },
        }

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str) -> Manifest:
        """The manifest whose JSON is ``raw``: in the writer's schema (``manifest_schema``, the types
        checked by msgspec) where it is exactly that, else as ``json.loads`` and ``from_json`` read it
        (the same value where both take it; that way's error where it does not)."""
        wire = manifest_schema.decode(raw)
        if wire is not None:
            manifest = cls._from_wire(wire, where=where)
            if manifest is not None:
                return manifest
        try:
            data = _decode(raw)
        except (ValueError, RecursionError) as e:
            raise CheckpointCorrupt(f"checkpoint: {where}: couldn't parse {MANIFEST}: {e}") from e
        return cls.from_json(data, where=where)

    @classmethod
    def _from_wire(cls, wire: manifest_schema.ManifestWire, *, where: str) -> Manifest | None:
        """``from_json``'s manifest from the decoded schema, its same checks; None where one of them
        fails before the bounds (``from_json`` then says it, as it would have)."""
        limit = MAX_DEPTH - manifest_schema.FREE_DEPTH
        if wire.format != FORMAT_NAME or wire.format_version > FORMAT_VERSION \
                or any(_nested_deeper(s.state, limit) or _nested_deeper(s.rng, limit) for s in wire.shards.values()) \
                or any(_nested_deeper(u.skeleton, limit) for u in wire.units.values()):
            return None
        layout = {row.shard: row for row in wire.layout}
        if not layout.keys() >= wire.shards.keys():
            return None
        shards = {name: ShardInfo(name=name, rank=s.rank, stage=layout[name].stage,
                                  data_parallel_rank=layout[name].data_parallel_rank,
                                  data_parallel_size=layout[name].data_parallel_size, file=s.file,
                                  file_bytes=s.file_bytes, state=s.state, rng=s.rng, memory_only=s.memory_only)
                  for name, s in wire.shards.items()}
        units = {name: Unit(module=u.module, part=u.part, stage=u.stage, skeleton=u.skeleton,
                            tensors=u.tensors)
                 for name, u in wire.units.items()}
        manifest = cls(step=wire.step, world_size=wire.world_size, incarnation=wire.incarnation,
                       created=wire.created, writer_version=wire.writer_version, load_order=wire.load_order,
                       units=units, shards=shards)
        if not (math.isfinite(manifest.created) and 0 <= manifest.created <= LAST_CREATED):
            return None
        _check_bounds(manifest, where)
        return manifest

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> Manifest:
        try:
            if _nested_deeper(_free_form(data), MAX_DEPTH):
                raise CheckpointCorrupt(f"checkpoint: {where}: {MANIFEST} nests deeper than {MAX_DEPTH} levels")
            if data.get("format") != FORMAT_NAME:
                raise CheckpointError(f"checkpoint: {where}: not a {FORMAT_NAME} manifest")
            if data["format_version"] > FORMAT_VERSION:
                raise CheckpointError(
                    f"checkpoint: {where}: format version {data['format_version']} is newer than this "
                    f"slurm-omni reads ({FORMAT_VERSION}; upgrade slurm-omni)")
            layout = {row["shard"]: row for row in data["layout"]}
            shards = {
                name: ShardInfo(name=name, rank=int(s["rank"]), stage=layout[name]["stage"],
                                data_parallel_rank=int(layout[name]["data_parallel_rank"]),
                                data_parallel_size=int(layout[name]["data_parallel_size"]),
                                file=s["file"], file_bytes=int(s["file_bytes"]), state=s["state"],
                                rng=s["rng"], memory_only=s.get("memory_only") is True)
                for name, s in data["shards"].items()
            }
            units = {
                name: Unit(module=u["module"], part=u["part"], stage=u["stage"], skeleton=u["skeleton"],
                           tensors={k: _tensor_from_json(t) for k, t in u["tensors"].items()})
                for name, u in data["units"].items()
            }
            manifest = cls(step=int(data["step"]), world_size=int(data["world_size"]),
                           incarnation=str(data["incarnation"]), created=float(data["created"]),
                           writer_version=str(data["writer_version"]),
                           load_order=tuple(data["load_order"]), units=units, shards=shards)
            if not (math.isfinite(manifest.created) and 0 <= manifest.created <= LAST_CREATED):
                raise CheckpointCorrupt(f"checkpoint: {where}: created {manifest.created!r} is no time "
                                        f"(0 to {LAST_CREATED:.0f}, seconds since 1970)")
            _check_bounds(manifest, where)
            return manifest
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            raise CheckpointCorrupt(f"checkpoint: {where}: malformed {MANIFEST}: {e!r}") from e


_SHARD_FILE_RE = re.compile(r"rank-[0-9]{5,}\.h5")


def _check_bounds(m: Manifest, where: str) -> None:
    """A manifest names only its own shard files (bare ``rank-NNNNN.h5``, opened inside the step
    directory) and byte ranges inside them: a reader never follows a name or an offset elsewhere."""
    for name, shard in m.shards.items():
        if name != shard_name(shard.rank):
            raise CheckpointCorrupt(f"checkpoint: {where}: shard {name!r:.80} of rank {shard.rank} "
                                    f"(expected {shard_name(shard.rank)!r})")
        if shard.file is not None and (shard.file != f"{name}.h5" or not _SHARD_FILE_RE.fullmatch(shard.file)):
            raise CheckpointCorrupt(f"checkpoint: {where}: shard {name} names file {shard.file!r:.80} "
                                    f"(only {name}.h5 in the step directory is allowed)")
        if shard.file_bytes < 0:
            raise CheckpointCorrupt(f"checkpoint: {where}: shard {name} has file_bytes {shard.file_bytes} (0 or more)")
    for unit in m.units.values():
        for tpath, tensor in unit.tensors.items():
            for p in tensor.pieces:
                holder = m.shards.get(p.shard)
                size = holder.file_bytes if holder is not None and holder.file is not None else 0
                empty = p.nbytes == 0 and p.offset >= -1
                if holder is None or not empty and not (0 <= p.offset and 0 < p.nbytes and p.offset + p.nbytes <= size):
                    raise CheckpointCorrupt(
                        f"checkpoint: {where}: {unit.name}/{tpath:.80}: piece at offset {p.offset} of "
                        f"{p.nbytes} bytes in shard {p.shard!r:.40} lies outside its file "
                        f"({size} bytes; allowed: 0 <= offset, offset + bytes <= file size)")


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    return {
        "dtype": t.dtype, "shape": list(t.shape), "split_dim": t.split_dim,
        "pieces": [{"shard": p.shard, "dataset": p.dataset, "offset": p.offset, "nbytes": p.nbytes,
                    CHECKSUM: p.xxh3, "shape": list(p.shape), "index": p.index} for p in t.pieces],
    }


def _tensor_from_json(t: dict[str, Any]) -> TensorEntry:
    split_dim = t["split_dim"]
    if split_dim is not None and type(split_dim) is not int:
        raise TypeError(f"split_dim is a {type(split_dim).__name__} (an int or null)")
    return TensorEntry(
        dtype=str(t["dtype"]), shape=tuple(map(int, t["shape"])), split_dim=split_dim,
        pieces=tuple([Piece(shard=_text(p["shard"], "a piece's shard"), dataset=_text(p["dataset"], "a dataset"),
                            offset=int(p["offset"]), nbytes=int(p["nbytes"]), xxh3=str(p[CHECKSUM]),
                            shape=tuple(map(int, p["shape"])), index=int(p["index"]))
                      for p in t["pieces"]]))


def _text(value: Any, what: str) -> str:
    """A string of a tensor table (kept as it is: ``_free_form`` left it out of the depth check)."""
    if type(value) is not str:
        raise TypeError(f"{what} is a {type(value).__name__}, not a string")
    return value


# -- durable files -------------------------------------------------------------------------------------


def safe_name(text: str) -> str:
    """``text`` as a piece of a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


def write_marker(path: Path, step: int, raw: bytes, incarnation: int | None = None, *,
                 dir_fd: int | None = None) -> None:
    """The completion marker for ``path``, whose manifest is ``raw``; ``incarnation``: the committing
    incarnation's number, for the fence. ``dir_fd``: ``path`` opened before it was renamed there, so the
    marker goes into that folder even if another took the name since."""
    marker: dict[str, Any] = {"step": step, "manifest_bytes": len(raw), "manifest_xxh3_64": checksum(raw),
                              "time": time.time()}
    if incarnation is not None:
        marker["incarnation"] = incarnation
    write_atomic(path / MARKER, json.dumps(marker).encode(), dir_fd=dir_fd)
