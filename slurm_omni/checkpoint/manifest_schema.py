"""The manifest as its writer writes it (``format.Manifest.to_json``), as msgspec Structs: the reader's
fast path, and the tensor table's own types (``Piece``, ``TensorEntry``: decoded as they are, no
object built twice). ``format.read_manifest`` decodes the bytes with this schema first (the types
checked in C, no walk over the tensor tables in Python: 0.59 against 1.55 ms for 400 tensors, marker
and checksum included) and takes the old way (``json.loads`` semantics, ``Manifest.from_json``) for any manifest the schema does not
take exactly: a key more or less, another type (a float where an int is written), NaN in a runtime's
state. The schema is stricter than that way, never looser, so both give the same ``Manifest`` for a
manifest this schema takes, and the old way's error for any other.

Only ``state``, ``rng`` (a rank's) and ``skeleton`` (a unit's) are free-form JSON here, at depth 3
of the document: ``FREE_DEPTH``.
"""

from __future__ import annotations

from typing import Any

import msgspec

FREE_DEPTH = 3
"""How deep in the manifest's JSON the free-form values lie (root, "shards"/"units", a shard or unit)."""


class Piece(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """Where one dataset's bytes lie: a whole tensor, or one data-parallel piece of a split one."""

    shard: str
    dataset: str           # HDF5 path inside the shard's file
    offset: int            # byte offset of the contiguous data in the file; -1 for zero bytes
    nbytes: int
    xxh3: str = msgspec.field(name="xxh3_64")
    shape: tuple[int, ...]
    index: int             # position along the split dimension (0 for a whole tensor)


class TensorEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    dtype: str                     # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]         # the full tensor's shape
    split_dim: int | None          # set when the tensor was cut across data-parallel ranks
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


class UnitWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    module: str
    part: str
    stage: str
    skeleton: Any
    tensors: dict[str, TensorEntry]


class LayoutWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    rank: int
    stage: str
    data_parallel_rank: int
    data_parallel_size: int
    shard: str


class ShardWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int
    file: str | None
    file_bytes: int
    state: Any
    rng: Any
    memory_only: bool = False


class ManifestWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    format_version: int
    step: int
    world_size: int
    incarnation: str
    created: float
    writer_version: str
    load_order: tuple[str, ...]
    layout: list[LayoutWire]
    shards: dict[str, ShardWire]
    units: dict[str, UnitWire]
    incarnation_number: int | None = None
    """The committing incarnation's number, where it has one (``persist.py`` adds it; the fence's)."""


_DECODER = msgspec.json.Decoder(ManifestWire)


def decode(raw: bytes) -> ManifestWire | None:
    """``raw`` in this schema, or None where it is not exactly this schema (a missing or extra key, a
    type the writer does not write, bytes msgspec refuses)."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
