"""One schema per file format, shared by the writer and the reader (msgspec Structs, strict types).

``decode`` is the only way a reader turns bytes into a record: any malformed input (bad JSON, a
wrong type, an unknown key where keys are closed, a duplicate key, NaN, nesting deep enough to
exhaust the decoder's recursion) becomes one ``RecordRejected`` naming the file and the fault, never
another exception. ``encode`` is the writer's side of the same Struct.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from slurm_omni.fsio import FileRejected, one_line

T = TypeVar("T")


class RecordRejected(FileRejected):
    """A file's bytes do not match its format."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise RecordRejected(f"duplicate key {key!r}")
        seen[key] = value
    return seen


_DUPLICATES = json.JSONDecoder(object_pairs_hook=_no_duplicates)
"""One decoder for the duplicate-key check (``json.loads`` with a hook builds a new one per call)."""


def decode(data: bytes | str, kind: type[T], what: str,
           dec_hook: Callable[[type, Any], Any] | None = None) -> T:
    """``data`` as one ``kind`` record; ``what`` names the file in the error."""
    try:
        record = msgspec.json.decode(data, type=kind, strict=True, dec_hook=dec_hook)
    except msgspec.ValidationError as e:
        raise RecordRejected(f"couldn't accept {one_line(what)}: {one_line(str(e))}") from None
    except msgspec.DecodeError as e:
        raise RecordRejected(f"couldn't parse {one_line(what)}: {one_line(str(e))}") from None
    except RecursionError:
        raise RecordRejected(f"couldn't parse {what}: nested too deep") from None
    # msgspec keeps the last of duplicate keys: two readers could then see two different records.
    # Bytes that are exactly what ``encode`` writes for the record have none (a Struct's fields and a
    # dict's keys are unique): the writers' own lines skip the slower check (a tenth of its CPU: the
    # supervisor decodes 1,500 heartbeat lines per poll at 2,048 ranks, issue 19)
    if dec_hook is None and _canonical(record, data):
        return record
    try:   # msgspec accepted it: UTF-8 JSON
        _DUPLICATES.decode(data.decode() if isinstance(data, bytes) else data)
    except RecordRejected as e:
        raise RecordRejected(f"couldn't accept {one_line(what)}: {one_line(str(e))}") from None
    except RecursionError:
        raise RecordRejected(f"couldn't parse {what}: nested too deep") from None
    return record


_ENCODER = msgspec.json.Encoder()


def _canonical(record: Any, data: bytes | str) -> bool:
    """``data`` is ``encode(record)``'s bytes (a trailing newline aside)."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        mine = _ENCODER.encode(record)
    except (TypeError, ValueError, msgspec.EncodeError):
        return False
    return raw == mine or raw[:-1] == mine and raw[-1:] == b"\n"


def encode(record: msgspec.Struct) -> bytes:
    """The record's bytes: one line of JSON."""
    return msgspec.json.encode(record) + b"\n"


def to_builtins(record: Any) -> Any:
    """Plain JSON-able values of a record (for the journal), under the file's own key names."""
    return msgspec.to_builtins(record)
