"""One line of a metrics file: ``<OMNI_METRICS_DIR>/metrics-<stage>-<dp_rank>.jsonl``, one JSON object
per logged step::

    {"time": 1764460000.12, "rank": 3, "stage": 1, "dp_rank": 1, "incarnation": 0, "step": 17,
     "loss": 2.31, "step_time_seconds": 0.031, "data_parallel_size": 2, ...}

Per node (the default under Slurm, ``slurm_omni.elastic.node_metrics``; ``OMNI_METRICS_PER_NODE=0``
turns it off): the node's heartbeat leader appends its ranks' lines to
``<OMNI_METRICS_DIR>/node-<NODE>.jsonl``, each line naming the file it belongs to (``"file":
"metrics-text-0.jsonl"``), and a rank that ends appends what was not copied yet to its own file; the
rank that reports the job's loss (replica 0 of the last stage) writes every line to its own file.
:func:`read_folder` gives every file's lines from both: a line that is not JSON in a node file (torn
by a leader killed mid-write) is skipped, a line found twice (the same bytes: copied again after a
leader died before recording how far it got) counts once, and the
lines are put in order of (``incarnation``, ``time``).

The writer is ``slurm_omni.elastic.metrics.MetricsLog`` (every training script's, the built-in
trainer's too); it checks each line against :class:`MetricsLine` before writing it. The readers are
``omni report`` (slurm_omni.report.inputs) and ``omni drill`` (slurm_omni.drill.history).

``time``, ``rank`` and ``step`` are required; the other known keys may be absent (older runtimes) or
null. A diverged loss is written as JSON's ``NaN``/``Infinity`` (Python's ``json`` does), which
msgspec's own JSON decoder refuses: a line is parsed with ``json.loads`` (bounded in length by the
reader's file limit, its nesting caught as ``RecursionError``, duplicate keys refused) and then
converted strictly. Keys this schema does not know are the script's own values and are ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from slurm_omni.errors import RuntimeLayoutError
from slurm_omni.formats import RecordRejected, _no_duplicates
from slurm_omni.fsio import decode_utf8, one_line, read_bounded

MAX_LINE_CHARS = 1 << 20
"""A longer line is refused before parsing (the runtime's lines are a few hundred characters)."""

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
_Rate = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]


class MetricsLine(msgspec.Struct, frozen=True, kw_only=True):
    time: Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
    """Unix time the step was logged."""
    rank: _Count
    step: _Count
    """The global step just completed."""
    stage: Annotated[int, msgspec.Meta(ge=-1)] = 0
    """Stage index; -1 when all stages are colocated on the rank."""
    dp_rank: _Count = 0
    incarnation: _Count = 0
    loss: float | None = None
    """The job's loss (loss-reporting stage only, else null); NaN or infinite once diverged."""
    step_time_seconds: _Seconds | None = None
    compute_seconds: _Seconds | None = None
    data_seconds: _Seconds | None = None
    samples_per_second: _Rate | None = None
    tokens_per_second: _Rate | None = None
    global_samples_per_second: _Rate | None = None
    ckpt_blocking_seconds: _Seconds | None = None
    ckpt_persist_seconds: _Seconds | None = None
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    task_started_at: _Seconds | None = None
    """First line of a life only (written by ``slurm_omni.elastic.Run``): Unix time its task started (the standby
    client's start, ``OMNI_TASK_STARTED_AT``; absent on a cold start)..."""
    groups_ready_at: _Seconds | None = None
    """...its process groups were initialised (the rendezvous done)..."""
    restored_at: _Seconds | None = None
    """...and its checkpoint restored (all ranks agreed on the step). Recovery benchmarks split a
    relaunch's time with them."""
    restore_source: Literal["memory", "file system", "memory and file system", "peer memory",
                            "peer memory and file system"] | None = None
    """First line of a life that restored: where this rank's checkpoint bytes came from (its node's
    memory tier, docs/checkpoint.md, or the file system)."""
    restore_inherited: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """...and how many of its shards it read from copies inherited from its node's standby (in its own
    memory: docs/checkpoint.md "Restore from inherited memory"); absent: none."""
    file: Annotated[str, msgspec.Meta(pattern=r"^metrics-[^/]+\.jsonl$")] | None = None
    """Lines copied per node (``node-<NODE>.jsonl``): the file the line belongs to."""


_AT = re.compile(r"^(?P<what>.*?) - at `\$\.(?P<key>[^`]*)`$")


def _rejected(where: str, e: msgspec.ValidationError, action: str) -> RecordRejected:
    """msgspec's "Expected `int` >= 0, got `str` - at `$.step`" as "step: expected `int` >= 0, got `str`"."""
    text = one_line(str(e))
    m = _AT.match(text)
    if m:
        what = m["what"]
        text = f"{m['key']}: {what[:1].lower()}{what[1:]}"
    elif text.startswith("Object missing required field"):
        text = text.replace("Object missing required field", "missing required key")
    return RecordRejected(f"couldn't {action} {where}: {text} (see slurm_omni.formats.metrics)")


def check_line(obj: Mapping[str, Any], where: str, action: str = "read") -> MetricsLine:
    """``obj`` (one parsed line) as a :class:`MetricsLine`; the error says "couldn't <action> <where>"."""
    try:
        return msgspec.convert(obj, MetricsLine, strict=True)
    except msgspec.ValidationError as e:
        raise _rejected(where, e, action) from None


def parse_line(line: str, where: str) -> MetricsLine:
    """One line of a metrics file. A line that is not JSON raises ``json.JSONDecodeError``'s
    one-line message as :class:`LineUnparsable` (the drill's reader skips it when it is the torn
    last line); any other fault raises :class:`RecordRejected`."""
    if len(line) > MAX_LINE_CHARS:
        raise RecordRejected(f"couldn't read {where}: {len(line)} characters (at most {MAX_LINE_CHARS})")
    try:
        obj = json.loads(line, object_pairs_hook=_no_duplicates)
    except RecordRejected as e:
        raise RecordRejected(f"couldn't read {where}: {e}") from None
    except json.JSONDecodeError as e:
        raise LineUnparsable(f"couldn't parse {where}: {e.msg} (expected one JSON object per line)") from None
    except (ValueError, RecursionError) as e:   # nesting too deep; an int of too many digits
        why = "nested too deep" if isinstance(e, RecursionError) else one_line(str(e), 100)
        raise RecordRejected(f"couldn't parse {where}: {why}") from None
    if not isinstance(obj, dict):
        raise RecordRejected(f"couldn't read {where}: expected a JSON object, not {type(obj).__name__}")
    return check_line(obj, where)


class LineUnparsable(RecordRejected):
    """The line is not JSON at all (e.g. torn by a rank killed while writing it)."""


def dumps(record: Mapping[str, Any]) -> str:
    """The line the writer appends (``NaN`` for a diverged loss, keys sorted), newline included."""
    return json.dumps(record, sort_keys=True) + "\n"


MAX_FILE_BYTES = 1 << 30
"""A metrics or node file read back is refused past this size."""
FILE_NAME = re.compile(r"^metrics-[^/]+\.jsonl$")
PER_NODE_ENV = "OMNI_METRICS_PER_NODE"
PER_NODE_ON = ("", "1", "on", "true", "yes")
PER_NODE_OFF = ("0", "off", "false", "no")


def per_node_setting(env: Mapping[str, str] | None = None) -> bool:
    """Whether a rank's lines go through its node (``OMNI_METRICS_PER_NODE``, on by default; ``0``
    turns it off): the shared file system sees one append per node per heartbeat interval and one per
    step of the loss-reporting rank, which writes its own file (``elastic/node_metrics.py``), instead
    of one per rank per step. A lost node loses with its memory the other ranks' lines its leader had
    not copied yet: at most one interval's, never a step of the loss the drills' proof reads."""
    raw = (os.environ if env is None else env).get(PER_NODE_ENV, "").strip().lower()
    if raw in PER_NODE_ON:
        return True
    if raw in PER_NODE_OFF:
        return False
    raise RuntimeLayoutError(f"{PER_NODE_ENV}={raw[:40]!r}: allowed are {', '.join(v for v in PER_NODE_ON if v)} or "
                             f"unset (per node, the default) or {', '.join(PER_NODE_OFF)} (each rank's own file)")


NODE_FILE_GLOB = "node-*.jsonl"


def read_folder(folder: Path) -> dict[str, list[tuple[str, str]]]:
    """Every metrics file's lines in ``folder``, by file name (``metrics-text-0.jsonl``): its own
    file's and those the node files carry for it (module doc), each with where it was read
    (``<path> line <n>``). A file that no node file adds to keeps its lines as they are."""
    out: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(folder.glob("metrics-*.jsonl")):
        out[path.name] = _numbered(path, follow=True)
    merged: set[str] = set()
    keys: dict[str, tuple[float, float]] = {}
    for path in sorted(folder.glob(NODE_FILE_GLOB)):
        for where, text in _numbered(path, follow=False):
            obj = _parsed(text)
            name = obj.get("file") if obj is not None else None
            if isinstance(name, str) and FILE_NAME.match(name):
                out.setdefault(name, []).append((where, text))
                merged.add(name)
                keys[text.strip()] = _order(obj)
    for name in merged:
        out[name] = _merge(out[name], keys)
    return out


def _numbered(path: Path, *, follow: bool) -> list[tuple[str, str]]:
    text = decode_utf8(read_bounded(path, MAX_FILE_BYTES, what=str(path), follow=follow), str(path))
    return [(f"{path} line {n}", line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _parsed(text: str) -> dict[str, Any] | None:
    """A line as a JSON object; None for a torn line or anything else."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _order(obj: dict[str, Any] | None) -> tuple[float, float]:
    try:
        return (float(obj.get("incarnation", 0)), float(obj["time"])) if obj is not None else (math.inf, math.inf)
    except (KeyError, TypeError, ValueError):
        return (math.inf, math.inf)


def _merge(lines: list[tuple[str, str]], keys: dict[str, tuple[float, float]]) -> list[tuple[str, str]]:
    """One file's lines from its own file and the node files: each once, in (incarnation, time)
    order; a line of its own file that is not JSON keeps its place after the others."""
    seen: set[str] = set()
    keyed: list[tuple[tuple[float, float], int, tuple[str, str]]] = []
    for i, (where, text) in enumerate(lines):
        line = text.strip()
        if line in seen:
            continue
        seen.add(line)
        key = keys.get(line)
        keyed.append((_order(_parsed(line)) if key is None else key, i, (where, text)))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [entry for _, _, entry in keyed]


def read_tree(root: Path) -> dict[Path, list[tuple[str, str]]]:
    """:func:`read_folder` of ``root`` and of every folder below it, by each metrics file's path
    (``<folder>/metrics-text-0.jsonl``, whether that file exists or only node files carry it)."""
    folders = {p.parent for pattern in ("metrics-*.jsonl", NODE_FILE_GLOB) for p in root.rglob(pattern)}
    return {folder / name: lines for folder in sorted(folders) for name, lines in read_folder(folder).items()}
