"""Readers of the files a run leaves behind: metrics JSON lines and heartbeat files.

Metrics (``slurm_omni.elastic.metrics``): ``metrics-<stage>-<dp_rank>.jsonl`` (``metrics-text-0.jsonl``,
``metrics-vision+text-0.jsonl`` when colocated; older runs: ``metrics-rank-<RANK>.jsonl``), one object per logged step
with ``time`` (unix), ``rank``, ``stage`` (the stage's index in the job's pipeline, -1 when one rank runs every
stage; its name is the file's), ``dp_rank``, ``incarnation``, ``step``, ``loss`` (the last stage only, else null), ``step_time_seconds``, ``samples_per_second``, ``tokens_per_second``,
``global_samples_per_second``, ``ckpt_blocking_seconds``, ``ckpt_persist_seconds``,
``data_parallel_size``, ... Each line is checked strictly against
:class:`slurm_omni.formats.metrics.MetricsLine` (``time``, ``rank`` and ``step`` required); keys it
does not know are ignored (the script's own values). A bad line, the last one too, is one error
naming the file, the line and the key. A diverged (NaN or infinite) loss is read as no loss.

Heartbeats (``slurm_omni.elastic.heartbeat``): ``rank-<RANK>.json``, the latest beat of a rank
(``rank``, ``time``, ``step``, ``phase``, ``incarnation``, ...). A ``*.jsonl`` file in the same folder
is read as a history of such beats, one per line (the manager may keep one).

A path given for metrics may be a file or a folder (then every ``metrics-*.jsonl`` in it); either way
the lines the node files of its folder carry for a file count as its own (``node-<NODE>.jsonl``, the
default under Slurm: ``formats.metrics.read_folder``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni.formats import RecordRejected
from slurm_omni.formats.heartbeat import NODE_PREFIX
from slurm_omni.formats.metrics import MetricsLine, parse_line, read_folder
from slurm_omni.fsio import FileRejected
from slurm_omni.report.timeline import ReportInputError, _why, read_text


@dataclass(frozen=True, slots=True)
class MetricRecord:
    time: float
    rank: int
    step: int
    stage: int = 0
    stage_name: str = ""
    """The stage's own name, from the file's (``metrics-<name>-<dp_rank>.jsonl``; empty for older files)."""
    incarnation: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    global_samples_per_s: float | None = None
    ckpt_blocking_s: float | None = None
    ckpt_persist_s: float | None = None
    data_parallel_size: int | None = None


@dataclass(frozen=True, slots=True)
class HeartbeatRecord:
    time: float
    rank: int
    step: int = -1
    phase: str = ""
    incarnation: int = 0


def _number(obj: dict[str, Any], key: str, where: str, *, required: bool = False) -> float | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ReportInputError(f"report: couldn't read {where}: missing {key!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ReportInputError(f"report: couldn't read {where}: {key} = {value!r} (expected a number)")
    return float(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:   # an int past the float range
        return False


def _int(obj: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportInputError(f"report: couldn't read {where}: {key} = {value!r} (expected an integer)")
    return value


def _lines(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ReportInputError(f"report: couldn't parse {where}: {_why(e)} (expected one JSON object "
                                   "per line)") from e
        if not isinstance(obj, dict):
            raise ReportInputError(f"report: couldn't read {where}: expected a JSON object")
        yield where, obj


def metric_files(path: Path) -> dict[str, list[tuple[str, str]]]:
    """The lines of every metrics file ``path`` names (a folder: all of them; a file: that one), by
    file name, each with where it was read: a file's own lines and those the node files of its
    folder carry for it (``formats.metrics.read_folder``)."""
    if path.is_dir():
        files = _read_folder(path)
        if not files:
            raise ReportInputError(f"report: couldn't find metrics in {path}: no metrics-*.jsonl or node-*.jsonl "
                                   "(give OMNI_METRICS_DIR or a file)")
        return files
    if not path.exists():
        raise ReportInputError(f"report: couldn't read {path}: no such file or folder")
    if path.name.startswith("metrics-") and path.name.endswith(".jsonl"):
        return {path.name: _read_folder(path.parent).get(path.name, [])}
    return {path.name: [(f"{path} line {n}", line) for n, line in enumerate(read_text(path).splitlines(), start=1)
                        if line.strip()]}


def _read_folder(folder: Path) -> dict[str, list[tuple[str, str]]]:
    try:
        return read_folder(folder)
    except FileRejected as e:
        raise ReportInputError(f"report: {e}") from None


def _metric_lines(lines: list[tuple[str, str]]) -> Iterable[MetricsLine]:
    for where, line in lines:
        try:
            yield parse_line(line, where)
        except RecordRejected as e:
            raise ReportInputError(f"report: {e}") from None


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and _finite(value) else None


_STAGE_FILE = re.compile(r"^metrics-(?!rank-[0-9]+$)(.+)-[0-9]+$")


def stage_name_of(file: Path) -> str:
    """``gpt`` of ``metrics-gpt-0.jsonl``; empty for a file named otherwise (older runs' ``metrics-rank-N``)."""
    m = _STAGE_FILE.match(file.name.removesuffix(".jsonl"))
    return m[1] if m else ""


def stage_names(records: Iterable[MetricRecord]) -> dict[int, str]:
    """Stage index -> the stage's own name, as the run's files say it (-1: every stage on one rank)."""
    return {r.stage: r.stage_name for r in records if r.stage_name}


def load_metrics(paths: Iterable[Path]) -> list[MetricRecord]:
    records: list[MetricRecord] = []
    for path in paths:
        for file, lines in metric_files(path).items():
            name = stage_name_of(Path(file))
            records.extend(MetricRecord(
                time=m.time, rank=m.rank, step=m.step, stage=m.stage, stage_name=name, incarnation=m.incarnation,
                loss=_finite_or_none(m.loss), step_time_s=m.step_time_seconds, tokens_per_s=m.tokens_per_second,
                global_samples_per_s=m.global_samples_per_second, ckpt_blocking_s=m.ckpt_blocking_seconds,
                ckpt_persist_s=m.ckpt_persist_seconds, data_parallel_size=m.data_parallel_size)
                for m in _metric_lines(lines))
    if not records:
        raise ReportInputError("report: couldn't find any metrics record in "
                               + ", ".join(str(p) for p in paths))
    return sorted(records, key=lambda r: (r.time, r.rank))


def _heartbeat(obj: dict[str, Any], where: str) -> HeartbeatRecord:
    return HeartbeatRecord(time=_number(obj, "time", where, required=True) or 0.0, rank=_int(obj, "rank", where),
                           step=_int(obj, "step", where, -1), phase=str(obj.get("phase", "")),
                           incarnation=_int(obj, "incarnation", where, 0))


def load_heartbeats(folder: Path) -> list[HeartbeatRecord]:
    if not folder.is_dir():
        raise ReportInputError(f"report: couldn't read heartbeats {folder}: no such folder")
    beats: list[HeartbeatRecord] = []
    for file in sorted(folder.glob("rank-*.json")):
        try:
            obj = json.loads(read_text(file, "heartbeat"))
        except (ValueError, RecursionError) as e:
            raise ReportInputError(f"report: couldn't parse heartbeat {file}: {_why(e)}") from e
        if not isinstance(obj, dict):
            raise ReportInputError(f"report: couldn't read heartbeat {file}: expected a JSON object")
        beats.append(_heartbeat(obj, str(file)))
    for file in sorted(folder.glob("*.jsonl")):
        lines = iter(_lines(file))
        if file.name.startswith(NODE_PREFIX):   # a node's beats (formats/heartbeat.py): its header first
            next(lines, None)
        beats.extend(_heartbeat(obj, where) for where, obj in lines)
    if not beats:
        raise ReportInputError(f"report: couldn't find heartbeats in {folder}: no rank-*.json, node-*.jsonl "
                               "or *.jsonl")
    return sorted(set(beats), key=lambda b: (b.time, b.rank))
