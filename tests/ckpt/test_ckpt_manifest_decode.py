"""The manifest's JSON decoders: the writer's schema (``manifest_schema``) where it takes the bytes,
else ``format._decode`` (msgspec's where it takes the bytes, json's where it refuses them) and
``Manifest.from_json``, so that a manifest reads exactly as ``json.loads`` and ``from_json`` read it."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import manifest_schema
from slurm_omni.errors import CheckpointError
from tests.ckpt.states import engine, shard_state


@pytest.mark.parametrize("text", [
    b'{"step": 1, "state": {"loss": NaN, "best": [Infinity, -Infinity]}}',   # a runtime's state (allow_nan)
    b'\xef\xbb\xbf{"a": 1}',                                                # a byte-order mark
    b'{"a": 1e400}',                                                        # out of a float's range
    b'{"a": 123456789012345678901234567890, "b": [1.5, -0.0, "\\u00e9", true, null]}',
    b'{"a": 1, "a": 2}',                                                    # the last key wins, as in json
    b'["\\ud800"]',                                                         # a lone surrogate
])
def test_a_manifest_decodes_as_json_loads_reads_it(text: bytes) -> None:
    got, want = fmt._decode(text), json.loads(text)
    assert repr(got) == repr(want)
    if isinstance(want, dict) and "state" in want:
        assert math.isnan(got["state"]["loss"])


@pytest.mark.parametrize("text", [b'{"a": 1,}', b"[1] x", b'"a\x01b"', b"01", b"[.5]", b""])
def test_what_json_refuses_is_refused(text: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        fmt._decode(text)


# -- the writer's schema (``manifest_schema``): the fast path, never looser than the old way ---------------

def _old_way(raw: bytes, where: str) -> fmt.Manifest:
    """How a manifest was read before the schema: ``json.loads``' values, ``from_json``'s checks."""
    try:
        data = fmt._decode(raw)
    except (ValueError, RecursionError) as e:
        raise fmt.CheckpointCorrupt(f"checkpoint: {where}: couldn't parse {fmt.MANIFEST}: {e}") from e
    return fmt.Manifest.from_json(data, where=where)


def _outcome(read: Callable[[bytes, str], fmt.Manifest], raw: bytes) -> tuple[str, object]:
    try:
        return "ok", read(raw, "step-5")
    except CheckpointError as e:
        return type(e).__name__, str(e)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A manifest as the engine writes it (three modules, an optimizer, a split-free layout, the
    committing incarnation's number), as JSON."""
    root = tmp_path_factory.mktemp("manifest")
    with engine(root, incarnation_number=3) as e:
        e.save(5, shard_state(5)).persisted.result()
    raw = (fmt.step_dir(root, 5) / fmt.MANIFEST).read_bytes()
    assert b'"incarnation_number": 3' in raw
    data: dict[str, Any] = json.loads(raw)
    return data


def test_the_writers_manifest_takes_the_schema_and_reads_as_before(written: dict[str, Any]) -> None:
    raw = json.dumps(written).encode()
    assert manifest_schema.decode(raw) is not None   # the fast path is taken, not silently the old way
    got = fmt.Manifest.from_bytes(raw, where="step-5")
    assert got == _old_way(raw, "step-5")
    piece = next(iter(got.units["text_decoder/optim"].tensors.values())).pieces[0]
    assert isinstance(piece, fmt.Piece) and isinstance(piece.shape, tuple) and len(piece.xxh3) == 16


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def _tensor(data: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = next(iter(data["units"]["text_decoder/optim"]["tensors"].values()))
    return table


def _piece(data: dict[str, Any]) -> dict[str, Any]:
    piece: dict[str, Any] = _tensor(data)["pieces"][0]
    return piece


def _shard(data: dict[str, Any]) -> dict[str, Any]:
    shard: dict[str, Any] = data["shards"]["rank-00000"]
    return shard


# Each changes the writer's manifest: what the old way accepts with other values than the schema would
# give, or refuses with its own error; the manifest reads exactly as the old way reads it.
CHANGES: dict[str, Callable[[dict[str, Any]], object]] = {
    "an offset written as a float": lambda d: _piece(d).update(offset=float(_piece(d)["offset"])),
    "an offset written as a string": lambda d: _piece(d).update(offset=str(_piece(d)["offset"])),
    "a piece without its index": lambda d: _piece(d).pop("index"),
    "a piece with a key more": lambda d: _piece(d).update(note={"a": _deep(80)}),
    "a tensor without split_dim": lambda d: _tensor(d).pop("split_dim"),
    "split_dim true": lambda d: _tensor(d).update(split_dim=True),
    "a dtype that is a number": lambda d: _tensor(d).update(dtype=5),
    "a shape of floats": lambda d: _tensor(d).update(shape=[float(x) for x in _tensor(d)["shape"]]),
    "a layout row with a key more, nested too deep": lambda d: d["layout"][0].update(x=_deep(70)),
    "a key more at the top": lambda d: d.update(comment="hand-edited"),
    "an incarnation number that is a string": lambda d: d.update(incarnation_number="3"),
    "no incarnation number": lambda d: d.pop("incarnation_number"),
    "a step written as true": lambda d: d.update(step=True),
    "a created time that is an int": lambda d: d.update(created=1),
    "a created time before 1970": lambda d: d.update(created=-1.0),
    "an incarnation that is a number": lambda d: d.update(incarnation=7),
    "a load order with a number": lambda d: d.update(load_order=[*d["load_order"], 3]),
    "another format": lambda d: d.update(format="other"),
    "a newer format version": lambda d: d.update(format_version=fmt.FORMAT_VERSION + 1),
    "a memory-only shard": lambda d: _shard(d).update(memory_only=True),
    "memory_only written as a string": lambda d: _shard(d).update(memory_only="yes"),
    "a shard missing from the layout": lambda d: d.update(layout=[]),
    "a stage that is a list": lambda d: d["layout"][0].update(stage=["main"]),
    "a piece outside its file": lambda d: _piece(d).update(offset=_shard(d)["file_bytes"]),
    "a state as deep as allowed": lambda d: _shard(d).update(state=_deep(fmt.MAX_DEPTH - 3)),
    "a state one level too deep": lambda d: _shard(d).update(state=_deep(fmt.MAX_DEPTH - 2)),
    "a skeleton one level too deep": lambda d: d["units"]["projector/model"].update(skeleton=_deep(fmt.MAX_DEPTH - 2)),
    "an rng as deep as allowed": lambda d: _shard(d).update(rng=_deep(fmt.MAX_DEPTH - 3)),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_manifest_reads_as_the_old_way_reads_it(written: dict[str, Any], change: str) -> None:
    data = copy.deepcopy(written)
    CHANGES[change](data)
    raw = json.dumps(data).encode()
    got, want = _outcome(lambda r, w: fmt.Manifest.from_bytes(r, where=w), raw), _outcome(_old_way, raw)
    assert got == want


@pytest.mark.parametrize("raw", [
    b'{"format": "slurm-omni-checkpoint", "step": NaN}',   # NaN: msgspec refuses, json reads it
    b'{"format": "slurm-omni-checkpoint", "format": "x"}',  # a duplicate key: the last one counts
    b"[]",
    b"{",
])
def test_bytes_the_schema_refuses_read_as_the_old_way_reads_them(raw: bytes) -> None:
    assert _outcome(lambda r, w: fmt.Manifest.from_bytes(r, where=w), raw) == _outcome(_old_way, raw)


def test_a_duplicate_key_in_a_piece_keeps_the_last_as_json_does(written: dict[str, Any]) -> None:
    raw = json.dumps(written).encode()
    first = json.dumps(_piece(written)["nbytes"]).encode()
    doubled = raw.replace(b'"nbytes": ' + first, b'"nbytes": 1, "nbytes": ' + first, 1)
    assert doubled != raw and fmt.Manifest.from_bytes(doubled, where="step-5") == _old_way(raw, "step-5")
