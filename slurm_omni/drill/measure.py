"""What a drill measured, as numbers, a JSON document and a table (pure).

Times are unix seconds. Detection is fault -> confirmed, recovery is confirmed -> first step
completed after the restore (``slurm_omni.report.timeline`` uses the same names). The JSON
document is the goodput simulator's ``--drill-json`` format (bench/goodput/inputs.py): medians over
the drills, detection per fault class, and every drill's raw record under ``runs``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slurm_omni.drill.history import RunHistory, StepRecord

TIME_KEYS = ("fault", "detected", "confirmed", "resubmitted", "running", "first_step")
GOODPUT_CLASS = {"node-down": "node_down", "slurmd-crash": "node_down", "kill-rank": "task_crash",
                 "ckpt-crash": "task_crash", "stall-rank": "hang"}
"""Drill kind -> the simulator's fault class (detection_by_kind keys)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillTimes:
    fault: float
    detected: float | None = None
    confirmed: float | None = None
    resubmitted: float | None = None
    running: float | None = None
    first_step: float | None = None
    source: str = "observed"
    """"journal" (the manager's recovery timeline) or "observed" (Slurm and the run's files)."""

    def span(self, a: str, b: str) -> float | None:
        ta, tb = getattr(self, a), getattr(self, b)
        return None if ta is None or tb is None else max(0.0, tb - ta)


@dataclass(frozen=True, slots=True)
class Progress:
    """The run around one fault, from its metrics."""

    failed_incarnation: int | None
    resumed_incarnation: int | None
    last_step_before: int | None
    """Last step the failed incarnation completed."""
    resumed_from: int | None
    """Step the new incarnation restored (its first step minus one)."""
    first_step_at: float | None
    throughput_before: float | None
    throughput_after: float | None
    """Median samples per second of the job before the fault and after the recovery."""

    @property
    def steps_lost(self) -> int | None:
        if self.last_step_before is None or self.resumed_from is None:
            return None
        return max(0, self.last_step_before - self.resumed_from)


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def progress(history: RunHistory, fault: float, *, window: int = 10) -> Progress:
    """Steps and throughput around ``fault``: the life running then, and the next one (the records
    of a higher incarnation: every life of a job, resubmitted or requeued, logs a higher one)."""
    before = [r for r in history.records if r.time <= fault]
    failed = before[-1].incarnation if before else None

    def is_new(r: StepRecord) -> bool:
        return r.time > fault and failed is not None and r.incarnation > failed

    new = [r for r in history.records if is_new(r)]
    old = [r for r in history.records if not is_new(r) and (failed is None or r.incarnation == failed)]
    resumed = new[0].incarnation if new else None
    # The first steps after a restore pay for warm-up (allocator, caches): leave one out when we can.
    steady = new[1:window + 1] if len(new) > 2 else new[:window]
    return Progress(
        failed_incarnation=failed, resumed_incarnation=resumed,
        last_step_before=max(r.step for r in old) if old else None,
        resumed_from=new[0].step - 1 if new else None,
        first_step_at=new[0].time if new else None,
        throughput_before=_median([r.samples_per_s for r in before[-window:] if r.incarnation == failed]),
        throughput_after=_median([r.samples_per_s for r in steady]),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillResult:
    kind: str
    job: str
    job_id: str
    node: str = ""
    rank: int | None = None
    pids: tuple[int, ...] = ()
    times: DrillTimes
    progress: Progress | None = None
    expect_recovery: bool = True
    """False for a stall shorter than the hang rule: the right outcome is no recovery at all."""
    equivalence: dict[str, Any] | None = None
    restored: bool = False
    """The drilled node (or daemon) is back in service."""
    error: str = ""
    notes: tuple[str, ...] = field(default=())

    def with_equivalence(self, equivalence: dict[str, Any]) -> DrillResult:
        return dataclasses.replace(self, equivalence=equivalence)

    @property
    def detection_s(self) -> float | None:
        return self.times.span("fault", "confirmed")

    @property
    def recovery_s(self) -> float | None:
        return self.times.span("confirmed", "first_step")

    @property
    def ok(self) -> bool:
        if self.error or not self.restored:
            return False
        if self.equivalence is not None and not self.equivalence.get("ok", False):
            return False
        recovered = self.recovery_s is not None
        return recovered if self.expect_recovery else self.times.confirmed is None

    def to_json(self) -> dict[str, Any]:
        p = self.progress
        return {
            "kind": self.kind, "job": self.job, "job_id": self.job_id, "node": self.node, "rank": self.rank,
            "pids": list(self.pids), "ok": self.ok, "error": self.error, "restored": self.restored,
            "expect_recovery": self.expect_recovery, "timeline_source": self.times.source,
            "times": {k: getattr(self.times, k) for k in TIME_KEYS},
            "detection_s": self.detection_s, "recovery_s": self.recovery_s,
            "resubmit_s": self.times.span("confirmed", "resubmitted"),
            "start_s": self.times.span("resubmitted", "running"),
            "restore_s": self.times.span("running", "first_step"),
            "failed_incarnation": p.failed_incarnation if p else None,
            "resumed_incarnation": p.resumed_incarnation if p else None,
            "last_step_before": p.last_step_before if p else None,
            "resumed_from_step": p.resumed_from if p else None,
            "steps_lost": p.steps_lost if p else None,
            "throughput_before": p.throughput_before if p else None,
            "throughput_after": p.throughput_after if p else None,
            "equivalence": self.equivalence, "notes": list(self.notes),
        }


def goodput_document(results: Sequence[DrillResult], *, source: str, nodes: int = 0) -> dict[str, Any]:
    """The ``--drill-json`` document of bench/goodput: medians of the drills that recovered."""
    recovered = [r for r in results if r.expect_recovery and r.recovery_s is not None]
    by_class: dict[str, list[float | None]] = {}
    for r in recovered:
        by_class.setdefault(GOODPUT_CLASS.get(r.kind, "task_crash"), []).append(r.detection_s)
    doc: dict[str, Any] = {
        "detection_s": _median([r.detection_s for r in recovered]),
        "detection_by_kind": {k: m for k, v in sorted(by_class.items()) if (m := _median(v)) is not None},
        "resubmit_s": _median([r.times.span("confirmed", "resubmitted") for r in recovered]),
        "start_s": _median([r.times.span("resubmitted", "running") for r in recovered]),
        "restore_s": _median([r.times.span("running", "first_step") for r in recovered]),
        "recovery_s": _median([r.recovery_s for r in recovered]),
        "nodes": nodes, "gpus": 0, "source": source, "runs": [r.to_json() for r in results],
    }
    return {k: v for k, v in doc.items() if v is not None and v != {}}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_table(results: Sequence[DrillResult]) -> str:
    """One line per drill, then the medians."""
    head = (f"{'DRILL':<13} {'TARGET':<14} {'DETECT s':>8} {'RECOVER s':>9} {'LOST':>5} "
            f"{'SAMPLES/s BEFORE->AFTER':>24}  RESULT")
    lines = [head]
    for r in results:
        p = r.progress
        target = r.node + (f" rank {r.rank}" if r.rank is not None else "")
        tput = "-" if p is None else f"{_s(p.throughput_before)} -> {_s(p.throughput_after)}"
        lost = "-" if p is None or p.steps_lost is None else str(p.steps_lost)
        if r.error:
            verdict = f"FAILED: {r.error}"
        elif not r.expect_recovery:
            verdict = ("ok: no false alarm" if r.times.confirmed is None else "FALSE ALARM: confirmed a stall")
        else:
            verdict = "ok" if r.ok else "FAILED"
            if r.equivalence is not None:
                verdict += ", equivalent" if r.equivalence.get("ok") else ", NOT equivalent: " + "; ".join(
                    r.equivalence.get("problems", []))[:120]
            if not r.restored:
                verdict += ", node NOT restored"
        lines.append(f"{r.kind:<13} {target:<14} {_s(r.detection_s):>8} {_s(r.recovery_s):>9} {lost:>5} "
                     f"{tput:>24}  {verdict}")
    recovered = [r for r in results if r.recovery_s is not None]
    if len(recovered) > 1:
        lines.append(f"{'median':<13} {'':<14} {_s(_median([r.detection_s for r in recovered])):>8} "
                     f"{_s(_median([r.recovery_s for r in recovered])):>9}")
    return "\n".join(lines)
