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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni.errors import OmniError
from slurm_omni.formats import RecordRejected
from slurm_omni.formats.metrics import LineUnparsable, MetricsLine, parse_line, read_folder
from slurm_omni.fsio import FileRejected, read_text

MAX_HISTORY_BYTES = 1 << 30



def loss_stages(stages: Sequence[str]) -> tuple[str, ...]:
    """The names under which replica 0 logs the job's loss (already averaged over replicas), for a
    job of ``stages`` in pipeline order: the last stage, or every stage joined by ``+`` when one rank
    runs them all (``metrics-<name>-0.jsonl``, slurm_omni.elastic.metrics). One stage: its name."""
    if not stages:
        return ()
    return tuple(dict.fromkeys((stages[-1], "+".join(stages))))


def loss_file(folder: Path, stages: Sequence[str] = ()) -> Path | None:
    """The loss-reporting rank's metrics file in ``folder``: by the job's stage names when given, else
    found from the files themselves (the colocated one, else the one of the highest stage index)."""
    files = _folder(folder)
    for name in loss_stages(stages):
        path = folder / f"metrics-{name}-0.jsonl"
        if path.name in files:
            return path
    if stages:
        return None
    best: tuple[int, Path] | None = None
    for path in sorted(folder / n for n in files if n.endswith("-0.jsonl")):
        index = _first_stage_index(path)
        if index is None:
            continue
        rank = 1 << 30 if index < 0 else index      # stage -1: one rank runs every stage
        if best is None or rank > best[0]:
            best = (rank, path)
    return best[1] if best else None


def _first_stage_index(path: Path) -> int | None:
    """``stage`` of the first line of a metrics file (None: unreadable or empty)."""
    try:
        lines = _folder(path.parent).get(path.name, [])
    except HistoryError:
        return None
    for where, line in lines:
        try:
            return parse_line(line, where).stage
        except RecordRejected:
            return None
    return None


def _folder(folder: Path) -> dict[str, list[tuple[str, str]]]:
    """Every metrics file's lines in ``folder``, its own and those the node files carry for it
    (``formats.metrics.read_folder``)."""
    try:
        return read_folder(folder)
    except FileRejected as e:
        raise HistoryError(f"drill: {e}") from None


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
    pipeline: tuple[str, ...] = ()
    """The job's stage names in pipeline order, when the reader was told them."""

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

    @property
    def main_stage(self) -> str | None:
        """The traced stage whose ids stand for the run's: the loss-reporting one (the last stage of
        the pipeline, or the colocated ``a+b``) when known, else the first traced name."""
        for name in loss_stages(self.pipeline):
            if name in self.samples:
                return name
        return self.stages[0] if self.stages else None

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
    lines = _folder(path.parent).get(path.name, [])
    out = []
    for n, (where, line) in enumerate(lines, start=1):
        try:
            out.append(parse_line(line, where))
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


def load_history(folder: Path, stages: Sequence[str] = ()) -> RunHistory:
    """The history in ``folder`` (a run's OMNI_METRICS_DIR); ``stages``: the job's stage names in
    pipeline order (empty: the loss file is found from the files)."""
    if not folder.is_dir():
        raise HistoryError(f"drill: couldn't read metrics folder {folder}: no such folder")
    path = loss_file(folder, stages)
    if path is None:
        names = " or ".join(f"metrics-{n}-0.jsonl" for n in loss_stages(stages)) or "metrics-<stage>-0.jsonl"
        raise HistoryError(f"drill: couldn't find the loss in {folder}: no {names} "
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
    return RunHistory(folder, tuple(records), samples, tuple(stages))
