"""The manager's recovery timeline with the drills' fault times filled in.

The manager cannot know when a fault began: it has no fault time, or an estimate from the first
symptom (a fault record, the last beat). A drill knows it: its injection time replaces the
manager's. Matching is by the confirmation time, which the drill read from the same timeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from slurm_omni.drill.measure import DrillResult
from slurm_omni.fsio import write_atomic
from slurm_omni.report.timeline import load_timeline, timeline_json


def fill_faults(manager_timeline: Path, results: Sequence[DrillResult], out: Path) -> Path | None:
    """Write ``out`` (the format ``omni report --timeline`` reads); None without a manager timeline."""
    if not manager_timeline.exists():
        return None
    recoveries = []
    for r in load_timeline(manager_timeline).recoveries:
        for t in (d.times for d in results if d.times.source == "journal"):
            first_seen = r.detected if r.detected is not None else r.confirmed
            if t.confirmed is not None and abs(r.confirmed - t.confirmed) < 1e-3 \
                    and t.fault <= first_seen:
                r = dataclasses.replace(r, fault=t.fault)
        recoveries.append(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, timeline_json(recoveries), mode=0o644)
    return out
