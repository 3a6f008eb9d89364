"""The recovery timeline the manager writes, one entry per recovery, and its reader.

File format (UTF-8 JSON; the manager replaces the file atomically as a recovery advances). Either
one object::

    {"recoveries": [
      {"job_id": "42", "incarnation": 0,
       "fault": 1764460000.10, "detected": 1764460001.90, "confirmed": 1764460003.20,
       "resubmitted": 1764460004.00, "running": 1764460009.50, "first_step_after_restore": 1764460012.30,
       "kind": "node_down", "action": "replace"}
    ]}

or JSON lines, one recovery object per line. Keys of a recovery:

==========================  ======================================================================
job_id                      Slurm job id of the job that failed (string; "leader+offset" allowed)
incarnation                 incarnation that was running when the fault hit (int >= 0): the
                            OMNI_INCARNATION of its first life; the resumed run's ranks carry a
                            higher one (incarnation + 1, or more after Slurm's own requeues)
fault                       unix time of the fault; known in drills, null for a natural failure
detected                    first signal seen (SUSPECT: level 1 or level 2), unix time
confirmed                   CONFIRMED by the two-level rule, unix time (required)
resubmitted                 requeue or resubmission done, unix time or null (not yet)
running                     the job's new incarnation is RUNNING in Slurm, unix time or null
first_step_after_restore    first global step completed after the restore, unix time or null
kind                        optional free text: node_down, task_crash, hang, ...
action                      optional free text: replace, shrink, wait, requeue, ...
path                        optional: the road the recovery took, in_allocation (relaunched
                            inside the same Slurm job), resubmitted (a new Slurm job), requeued
                            (Slurm ran the same job id again) or planned_migration
new_job_id                  optional: the Slurm job id the job trains in after the recovery
==========================  ======================================================================

Times that are present must not decrease in the order listed. Unknown keys are errors, so a typo
in the writer shows up at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni import fsio
from slurm_omni.errors import OmniError

MAX_INPUT_BYTES = 1 << 30
"""The largest metrics, heartbeat or timeline file a report reads (a long run's metrics: ~100 MiB)."""

TIME_KEYS = ("fault", "detected", "confirmed", "resubmitted", "running", "first_step_after_restore")
KEYS = frozenset({"job_id", "incarnation", "kind", "action", "path", "new_job_id", *TIME_KEYS})


class ReportInputError(OmniError):
    """A file ``omni report`` (or the goodput simulator) reads is missing or malformed."""

    exit_code = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovery:
    """One recovery of one job: unix times of its events (None when not (yet) known)."""

    job_id: str
    incarnation: int
    confirmed: float
    fault: float | None = None
    detected: float | None = None
    resubmitted: float | None = None
    running: float | None = None
    first_step_after_restore: float | None = None
    kind: str = ""
    action: str = ""
    path: str = ""
    new_job_id: str = ""

    def __post_init__(self) -> None:
        if self.incarnation < 0:
            raise ValueError(f"incarnation = {self.incarnation} must be >= 0")
        known = [(k, getattr(self, k)) for k in TIME_KEYS if getattr(self, k) is not None]
        for (k1, t1), (k2, t2) in itertools.pairwise(known):
            if t2 < t1:
                raise ValueError(f"{k2} = {t2} is before {k1} = {t1}")

    @staticmethod
    def _span(a: float | None, b: float | None) -> float | None:
        return b - a if a is not None and b is not None else None

    @property
    def detection_s(self) -> float | None:
        """Fault -> confirmed (the drills' detection time)."""
        return self._span(self.fault, self.confirmed)

    @property
    def resubmit_s(self) -> float | None:
        return self._span(self.confirmed, self.resubmitted)

    @property
    def start_s(self) -> float | None:
        return self._span(self.resubmitted, self.running)

    @property
    def restore_s(self) -> float | None:
        return self._span(self.running, self.first_step_after_restore)

    @property
    def recovery_s(self) -> float | None:
        """Confirmed -> first step after restore (the drills' recovery time)."""
        return self._span(self.confirmed, self.first_step_after_restore)


@dataclass(frozen=True, slots=True)
class Timeline:
    recoveries: tuple[Recovery, ...]


def timeline_json(recoveries: Sequence[Recovery]) -> str:
    """The file's text for ``recoveries`` (the manager writes it to a temporary name and renames)."""
    return json.dumps({"recoveries": [dataclasses.asdict(r) for r in recoveries]}, sort_keys=True,
                      indent=1) + "\n"


def parse_recovery(obj: Any, *, where: str) -> Recovery:
    if not isinstance(obj, dict):
        raise ReportInputError(f"report: couldn't read {where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - KEYS)
    if unknown:
        raise ReportInputError(f"report: couldn't read {where}: unknown key {unknown[0]!r} "
                               f"(allowed: {', '.join(sorted(KEYS))})")
    times: dict[str, float | None] = {}
    for key in TIME_KEYS:
        value = obj.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ReportInputError(f"report: couldn't read {where}: {key} = {value!r} (expected unix time)")
        times[key] = float(value) if value is not None else None
    job_id, incarnation = obj.get("job_id"), obj.get("incarnation")
    if not isinstance(job_id, (str, int)) or isinstance(job_id, bool):
        raise ReportInputError(f"report: couldn't read {where}: job_id = {job_id!r} (expected a string)")
    if not isinstance(incarnation, int) or isinstance(incarnation, bool):
        raise ReportInputError(f"report: couldn't read {where}: incarnation = {incarnation!r} (expected an int)")
    confirmed = times.pop("confirmed")
    if confirmed is None:
        raise ReportInputError(f"report: couldn't read {where}: confirmed is required")
    try:
        return Recovery(job_id=str(job_id), incarnation=incarnation, confirmed=confirmed,
                        kind=str(obj.get("kind", "")), action=str(obj.get("action", "")),
                        path=str(obj.get("path", "")), new_job_id=str(obj.get("new_job_id", "")), **times)
    except ValueError as e:
        raise ReportInputError(f"report: couldn't read {where}: {e}") from e


def _why(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return e.msg
    return "nested too deep" if isinstance(e, RecursionError) else str(e)[:100]


def read_text(path: Path, what: str = "") -> str:
    """The text of a file ``omni report`` reads; ``what`` names it in the error ("timeline")."""
    name = f"{what} {path}" if what else str(path)
    try:
        return fsio.read_text(path, MAX_INPUT_BYTES, what=name, follow=True)
    except fsio.FileRejected as e:
        raise ReportInputError(f"report: {e}") from None


def load_timeline(path: Path) -> Timeline:
    text = read_text(path, "timeline")
    try:
        whole = json.loads(text)
    except (ValueError, RecursionError):   # JSONDecodeError, an int of 5,000 digits, a deep nest
        whole = None
    if isinstance(whole, dict) and "recoveries" in whole:
        if set(whole) - {"recoveries"} or not isinstance(whole["recoveries"], list):
            raise ReportInputError(f"report: couldn't read timeline {path}: expected "
                                   '{"recoveries": [...]} and nothing else')
        items = [parse_recovery(o, where=f"timeline {path} recovery {i}")
                 for i, o in enumerate(whole["recoveries"])]
        return Timeline(tuple(items))
    recoveries = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ReportInputError(f"report: couldn't parse timeline {path} line {n}: {_why(e)} "
                                   "(expected one JSON object per line, or {\"recoveries\": [...]})") from e
        recoveries.append(parse_recovery(obj, where=f"timeline {path} line {n}"))
    return Timeline(tuple(recoveries))
