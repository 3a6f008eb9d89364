"""Checkpoint folders whose files another writer shaped (issue 18, the Low findings), on real files:
a manifest nested past any recursion limit or with a ``created`` no clock can print is passed over
for the previous complete checkpoint with one line, never raised out of ``find_latest_complete``;
a fifo where ``COMPLETE``, ``CORRUPT``, ``manifest.json`` or the root's ``FENCE`` should be is
refused at once: ``omni ckpt ls`` does not wait on it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_omni.checkpoint import format as fmt


def _complete(root: Path, step: int, **changes: object) -> Path:
    """A complete checkpoint of ``step`` (no shard: the manifest and its marker), the manifest's
    top-level keys replaced by ``changes`` (raw JSON text for a value given as bytes)."""
    manifest = fmt.Manifest(step=step, world_size=1, incarnation="0", created=1.7e9, writer_version="test",
                            load_order=(), units={}, shards={}).to_json()
    raw = json.dumps({k: v for k, v in manifest.items() if k not in changes}).encode()
    for key, value in changes.items():
        text = value if isinstance(value, bytes) else json.dumps(value).encode()
        raw = raw[:-1] + b', "' + key.encode() + b'": ' + text + b"}"
    path = fmt.step_dir(root, step)
    path.mkdir(parents=True)
    (path / fmt.MANIFEST).write_bytes(raw)
    fmt.write_marker(path, step, raw)
    return path


DEEP = b"[" * 500 + b"]" * 500


def _units(skeleton: bytes = b"{}", dataset: bytes = b'"/m/model/w"', split_dim: bytes = b"null") -> bytes:
    """A ``units`` table of one tensor, a part of it given as raw JSON."""
    piece = (b'{"shard": "rank-00000", "dataset": ' + dataset + b', "offset": 0, "nbytes": 4, "xxh3_64": "0", '
             b'"shape": [1], "index": 0}')
    tensor = b'{"dtype": "float32", "shape": [1], "split_dim": ' + split_dim + b', "pieces": [' + piece + b"]}"
    return (b'{"m/model": {"module": "m", "part": "model", "stage": "s", "skeleton": ' + skeleton
            + b', "tensors": {"w": ' + tensor + b"}}}")


@pytest.mark.parametrize("shape", [
    {"load_order": b"[" * 200_000 + b"]" * 200_000},        # past the JSON decoder's recursion
    {"load_order": DEEP},                                   # decodes, but deeper than any manifest
    {"units": _units(skeleton=DEEP)},                       # the depth check walks the skeletons
    {"units": _units(dataset=DEEP)},                        # a tensor table's fields are typed instead
    {"units": _units(split_dim=DEEP)},
    {"created": b"1" + b"0" * 400},                         # an int no float holds
    {"created": b"1e400"},                                  # infinity
    {"created": 1e300},                                     # no clock prints it
    {"created": -1.0},
], ids=["nested-200000", "nested-500", "skeleton-nested-500", "dataset-nested-500", "split-dim-nested-500",
        "created-10^400", "created-inf", "created-1e300", "created-negative"])
def test_a_hostile_manifest_falls_back_to_the_previous_complete_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, shape: dict[str, object]) -> None:
    _complete(tmp_path, 10)
    bad = _complete(tmp_path, 20, **shape)
    with caplog.at_level(logging.WARNING, logger="slurm_omni.checkpoint.format"):
        entry = fmt.find_latest_complete(tmp_path)
    assert entry is not None and entry.step == 10
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"checkpoint: {bad.name}: ") and line.endswith("(falling back to the previous complete "
                                                                          "checkpoint)"), line
    with pytest.raises(fmt.CheckpointCorrupt):
        fmt.read_manifest(bad)
    # and omni ckpt ls shows it, one row, corrupt
    out = subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "ckpt", "ls", "--json", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = {r["step"]: r["status"] for r in json.loads(out)["checkpoints"]}
    assert rows == {10: "complete", 20: "corrupt"}


@pytest.mark.parametrize("fifo", [fmt.MARKER, fmt.CORRUPT, fmt.MANIFEST, "FENCE"])
def test_a_fifo_in_a_checkpoint_folder_does_not_hang_ckpt_ls(tmp_path: Path, fifo: str) -> None:
    _complete(tmp_path, 10)
    step = _complete(tmp_path, 20)
    where = tmp_path if fifo == "FENCE" else step
    (where / fifo).unlink(missing_ok=True)
    os.mkfifo(where / fifo)
    r = subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "ckpt", "ls", "--json", str(tmp_path)],
                       check=False, capture_output=True, text=True, timeout=60)
    if fifo == "FENCE":   # the fence decides what counts: unreadable, it is one clear error
        assert r.returncode != 0 and "FENCE" in r.stderr and "not a regular file" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    rows = {row["step"]: (row["status"], row["note"]) for row in json.loads(r.stdout)["checkpoints"]}
    assert rows[10] == ("complete", "")
    status, note = rows[20]
    assert status in ("incomplete", "corrupt") and "not a regular file" in note, rows
    latest = fmt.find_latest_complete(tmp_path)
    assert latest is not None and latest.step == 10


def test_a_memo_never_stands_for_other_bytes(tmp_path: Path) -> None:
    """``read_manifest``'s memo is keyed by the manifest's checked xxh3: a manifest replaced under the
    same folder (other bytes, a marker that matches them) is parsed again, never taken from the memo."""
    path = _complete(tmp_path, 10, writer_version="first")
    memo: fmt.ManifestMemo = {}
    first = fmt.read_manifest(path, memo=memo)
    assert fmt.read_manifest(path, memo=memo) is first
    raw = (path / fmt.MANIFEST).read_bytes().replace(b'"first"', b'"second"')
    (path / fmt.MANIFEST).write_bytes(raw)
    with pytest.raises(fmt.CheckpointCorrupt):   # the marker no longer matches: no memo hides it
        fmt.read_manifest(path, memo=memo)
    fmt.write_marker(path, 10, raw)
    again = fmt.read_manifest(path, memo=memo)
    assert again is not first and again.writer_version == "second"
