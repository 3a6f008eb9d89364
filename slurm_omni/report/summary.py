"""Job-level series and the summary figures of a report (pure: records in, numbers out).

Per (incarnation, step) the ranks' records fold into one job-level point: the slowest rank's step
time and global samples/s, the loss of the text stage, the sum of tokens/s per stage, the largest
checkpoint blocking and persist times. A step recomputed after a restore appears once per
incarnation; the loss curve of the run takes the newest incarnation's value.

Per recovery (from the timeline, or from an incarnation change in the metrics when no timeline is
given): detection = fault -> confirmed, recovery = confirmed -> first step after restore, steps lost
= last step logged by the failed incarnation - the step the next one resumed from (first step it
logged - the logging interval; exact when every step is logged), throughput = median global
samples/s over the last ``WINDOW`` points before and the first ``WINDOW`` after (its very first point
left out: it carries the restore's warm-up).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_omni.report.inputs import MetricRecord
from slurm_omni.report.timeline import Recovery

WINDOW = 10


@dataclass(frozen=True, slots=True)
class StepPoint:
    incarnation: int
    step: int
    time: float
    loss: float | None
    step_time_s: float | None
    global_samples_per_s: float | None
    tokens_per_s_by_stage: dict[int, float]
    ckpt_blocking_s: float | None
    ckpt_persist_s: float | None


@dataclass(frozen=True, slots=True)
class RecoverySummary:
    job_id: str
    incarnation: int
    kind: str
    detection_s: float | None
    recovery_s: float | None
    steps_lost: int | None
    throughput_before: float | None
    throughput_after: float | None
    path: str = ""
    """in_allocation, resubmitted, requeued or planned_migration ("" when the timeline does not say)."""

    @property
    def throughput_ratio(self) -> float | None:
        if self.throughput_before and self.throughput_after is not None:
            return self.throughput_after / self.throughput_before
        return None


@dataclass(frozen=True, slots=True)
class ReportSummary:
    job_id: str
    first_step: int
    last_step: int
    incarnations: tuple[int, ...]
    wall_s: float
    recoveries: tuple[RecoverySummary, ...]
    loss_compared_steps: int
    max_loss_deviation: float | None
    max_loss_deviation_step: int | None
    stages: tuple[str, ...] = ()
    """The job's stages by their own names, in pipeline order (from the metrics files' names)."""


def _max(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _min(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def step_points(records: Sequence[MetricRecord]) -> list[StepPoint]:
    groups: dict[tuple[int, int], list[MetricRecord]] = defaultdict(list)
    for r in records:
        groups[(r.incarnation, r.step)].append(r)
    points = []
    for (inc, step), rs in groups.items():
        tokens: dict[int, float] = defaultdict(float)
        for r in rs:
            if r.tokens_per_s is not None:
                tokens[r.stage] += r.tokens_per_s
        losses = [r.loss for r in rs if r.loss is not None]
        points.append(StepPoint(
            inc, step, max(r.time for r in rs), losses[0] if losses else None,
            _max([r.step_time_s for r in rs]), _min([r.global_samples_per_s for r in rs]), dict(tokens),
            _max([r.ckpt_blocking_s for r in rs]), _max([r.ckpt_persist_s for r in rs])))
    return sorted(points, key=lambda p: (p.time, p.incarnation, p.step))


def loss_by_step(points: Sequence[StepPoint]) -> dict[int, float]:
    """The run's loss per step, newest incarnation winning for recomputed steps."""
    out: dict[int, tuple[int, float]] = {}
    for p in points:
        if p.loss is not None and (p.step not in out or p.incarnation >= out[p.step][0]):
            out[p.step] = (p.incarnation, p.loss)
    return {step: loss for step, (_inc, loss) in sorted(out.items())}


def log_interval(points: Sequence[StepPoint]) -> int:
    by_inc: dict[int, list[int]] = defaultdict(list)
    for p in points:
        by_inc[p.incarnation].append(p.step)
    gaps = [b - a for steps in by_inc.values() for a, b in itertools.pairwise(sorted(steps)) if b > a]
    return max(1, int(statistics.median(gaps))) if gaps else 1


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize_recovery(points: Sequence[StepPoint], rec: Recovery, every: int) -> RecoverySummary:
    # The failed life is the recovery's incarnation, or a later life of the same submission (Slurm
    # requeued it: OMNI_INCARNATION + 1) that began before the confirmation; the resumed life is the
    # next number the metrics show (a resubmission numbers its lives past every earlier one).
    began: dict[int, float] = {}
    for p in points:
        began[p.incarnation] = min(p.time, began.get(p.incarnation, p.time))
    failed = max((i for i, t in began.items() if i >= rec.incarnation and t <= rec.confirmed),
                 default=rec.incarnation)
    resumed = min((i for i in began if i > failed), default=None)
    before = [p for p in points if p.incarnation == failed and (rec.fault is None or p.time <= rec.fault)]
    after = [p for p in points if p.incarnation == resumed]
    steps_lost = None
    if before and after:
        resumed_from = min(p.step for p in after) - every
        steps_lost = max(0, max(p.step for p in before) - resumed_from)
    settled = after[1:] if len(after) > 1 else after
    return RecoverySummary(
        rec.job_id, rec.incarnation, rec.kind, rec.detection_s, rec.recovery_s, steps_lost,
        _median([p.global_samples_per_s for p in before[-WINDOW:]]),
        _median([p.global_samples_per_s for p in settled[:WINDOW]]), rec.path)


def inferred_recoveries(points: Sequence[StepPoint], job_id: str) -> list[Recovery]:
    """Without a timeline: one recovery per incarnation change seen in the metrics (no times)."""
    incs = sorted({p.incarnation for p in points})
    out = []
    for inc in incs[:-1]:
        last = max(p.time for p in points if p.incarnation == inc)
        out.append(Recovery(job_id=job_id, incarnation=inc, confirmed=last))
    return out


def summarize(records: Sequence[MetricRecord], *, reference: Sequence[MetricRecord] | None = None,
              recoveries: Sequence[Recovery] | None = None, job_id: str = "") -> ReportSummary:
    return summarize_points(step_points(records), reference=step_points(reference) if reference else None,
                            recoveries=recoveries, job_id=job_id)


def summarize_points(points: Sequence[StepPoint], *, reference: Sequence[StepPoint] | None = None,
                     recoveries: Sequence[Recovery] | None = None, job_id: str = "",
                     stages: dict[int, str] | None = None) -> ReportSummary:
    """``summarize`` of records already folded by ``step_points`` (the report plots them too)."""
    every = log_interval(points)
    timeline = list(recoveries) if recoveries is not None else inferred_recoveries(points, job_id)
    recs = tuple(summarize_recovery(points, r, every) for r in timeline)
    compared, deviation, at_step = 0, None, None
    if reference:
        run_loss, ref_loss = loss_by_step(points), loss_by_step(reference)
        common = sorted(set(run_loss) & set(ref_loss))
        compared = len(common)
        if common:
            at_step = max(common, key=lambda s: abs(run_loss[s] - ref_loss[s]))
            deviation = abs(run_loss[at_step] - ref_loss[at_step])
    steps = [p.step for p in points]
    return ReportSummary(
        job_id or (timeline[0].job_id if timeline else ""), min(steps), max(steps),
        tuple(sorted({p.incarnation for p in points})), points[-1].time - points[0].time, recs,
        compared, deviation, at_step, _pipeline(stages or {}))


def _pipeline(names: dict[int, str]) -> tuple[str, ...]:
    """Stage names in pipeline order; a colocated run's ``a+b`` (stage -1) is split into its stages."""
    ordered = [names[i] for i in sorted(i for i in names if i >= 0)]
    if not ordered and -1 in names:
        ordered = names[-1].split("+")
    return tuple(ordered)
