"""A run's history as its ranks wrote it: losses, throughput and consumed sample ids per step.

Reads the runtime's files in one metrics folder (``slurm_omni.elastic.metrics``):
``metrics-<stage>-<dp_rank>.jsonl`` (one object per logged step) and, when the run traced them
(OMNI_TRACE_SAMPLES=1), ``samples-<stage>-<dp_rank>.jsonl`` (``{"step", "ids", "dp_rank",
"incarnation"}``). A killed and resumed run logs the steps after its last checkpoint twice; the
*effective* history keeps, for every step, what the latest incarnation that ran it logged: that is
what the model was trained on. Pure file reading: no Slurm, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni.errors import OmniError
from slurm_omni.formats import RecordRejected
from slurm_omni.formats.metrics import LineUnparsable, MetricsLine, parse_line
from slurm_omni.fsio import FileRejected, read_text

MAX_HISTORY_BYTES = 1 << 30

LOSS_STAGES = ("text", "vision+text")
"""Stages whose replica 0 logs the job's loss (already averaged over replicas)."""


class HistoryError(OmniError):
    """A run's metrics or sample traces are missing or malformed."""

    exit_code = 2


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One logged step of the loss-reporting rank."""

    step: int
    incarnation: int
    time: float
    loss: float | None
    samples_per_s: float | None
    data_parallel_size: int | None


@dataclass(frozen=True, slots=True)
class RunHistory:
    folder: Path
    records: tuple[StepRecord, ...]
    """Every logged step of the loss-reporting rank, in the order written."""
    samples: dict[str, dict[int, dict[int, dict[int, list[int]]]]]
    """stage -> step -> incarnation -> dp_rank -> sample ids, as traced."""

    def effective(self) -> dict[int, StepRecord]:
        """Step -> the record of the latest incarnation that ran it."""
        out: dict[int, StepRecord] = {}
        for r in self.records:
            kept = out.get(r.step)
            if kept is None or r.incarnation >= kept.incarnation:
                out[r.step] = r
        return dict(sorted(out.items()))

    def losses(self) -> dict[int, float]:
        return {s: r.loss for s, r in self.effective().items() if r.loss is not None}

    def ids(self, stage: str) -> dict[int, list[int]]:
        """Step -> ids of the global batch as ``stage`` read them (latest incarnation, replicas in order)."""
        out = {}
        for step, by_incarnation in sorted(self.samples.get(stage, {}).items()):
            replicas = by_incarnation[max(by_incarnation)]
            out[step] = [i for r in sorted(replicas) for i in replicas[r]]
        return out

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(sorted(self.samples))

    def incarnation_records(self, incarnation: int) -> list[StepRecord]:
        return [r for r in self.records if r.incarnation == incarnation]


def _lines(path: Path) -> list[str]:
    try:
        return read_text(path, MAX_HISTORY_BYTES, what=str(path), follow=True).splitlines()
    except FileRejected as e:
        raise HistoryError(f"drill: {e}") from None


def _metric_lines(path: Path) -> list[MetricsLine]:
    """Every line of a metrics file as the schema says (slurm_omni.formats.metrics), but a last line
    that is not JSON at all: a rank killed mid-write leaves it torn."""
    lines = _lines(path)
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(parse_line(line, f"{path} line {n}"))
        except LineUnparsable as e:
            if n == len(lines):
                continue
            raise HistoryError(f"drill: {e}") from None
        except RecordRejected as e:
            raise HistoryError(f"drill: {e}") from None
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    lines = _lines(path)
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            if n == len(lines):
                continue  # a rank killed mid-write leaves a torn last line
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep" if isinstance(
                e, RecursionError) else str(e)[:100]
            raise HistoryError(f"drill: couldn't parse {path} line {n}: {why}") from e
        if not isinstance(obj, dict):
            raise HistoryError(f"drill: couldn't read {path} line {n}: expected a JSON object")
        out.append(obj)
    return out


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HistoryError(f"drill: couldn't read {where}: {key} = {value!r} (expected an integer)")
    return value


def _finite(value: float | None) -> float | None:
    return value if value is not None and -1e308 < value < 1e308 else None   # a diverged loss: none


def _loss_file(folder: Path) -> Path | None:
    for stage in LOSS_STAGES:
        path = folder / f"metrics-{stage}-0.jsonl"
        if path.exists():
            return path
    return None


def load_history(folder: Path) -> RunHistory:
    """The history in ``folder`` (a run's OMNI_METRICS_DIR)."""
    if not folder.is_dir():
        raise HistoryError(f"drill: couldn't read metrics folder {folder}: no such folder")
    path = _loss_file(folder)
    if path is None:
        raise HistoryError(f"drill: couldn't find the loss in {folder}: no metrics-text-0.jsonl "
                           "(did the run start? OMNI_METRICS_DIR)")
    records = [StepRecord(step=m.step, incarnation=m.incarnation, time=m.time, loss=_finite(m.loss),
                          samples_per_s=m.global_samples_per_second, data_parallel_size=m.data_parallel_size)
               for m in _metric_lines(path)]
    samples: dict[str, dict[int, dict[int, dict[int, list[int]]]]] = {}
    for trace in sorted(folder.glob("samples-*-*.jsonl")):
        stage = trace.stem.removeprefix("samples-").rsplit("-", 1)[0]
        for i, obj in enumerate(_jsonl(trace), start=1):
            where = f"{trace} record {i}"
            ids = obj.get("ids")
            if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
                raise HistoryError(f"drill: couldn't read {where}: ids = {ids!r} (expected integers)")
            step, inc, dp_rank = (_int(obj, k, where) for k in ("step", "incarnation", "dp_rank"))
            samples.setdefault(stage, {}).setdefault(step, {}).setdefault(inc, {})[dp_rank] = ids
    return RunHistory(folder, tuple(records), samples)
