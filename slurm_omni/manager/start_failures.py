"""The manager's side of launches that failed before their first heartbeat (``policy/start_failure.py``).

Each ``failed-<job>-<incarnation>.json`` in a job's heartbeat folder (``formats/start_failure.py``:
the batch script's ``omni launch-failure`` on the resubmission path, the step supervisor in the
allocation) is journaled once as a ``start_failure`` decision (``omni status`` shows the newest) and
its line goes to the manager's log. When a life ends, :meth:`StartFailures.repeated` says whether the
job failed the same way twice: the supervisor said so (its record's ``stopped``), or the judged life's
failure and the one of the life before it, with no life between them that beat, are the same.
"""

from __future__ import annotations

import logging
from typing import Any

from slurm_omni.formats import to_builtins
from slurm_omni.manager.journal import Journal
from slurm_omni.manager.sources import read_start_failures
from slurm_omni.manager.status import START_FAILURE_VERDICT
from slurm_omni.manager.watch import Watch
from slurm_omni.policy.bad_input import BadInput
from slurm_omni.policy.start_failure import StartFailure, first_line, repeated_failure, stop_line

log = logging.getLogger(__name__)


class StartFailures:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._seen: set[str] = set()

    def observe(self, w: Watch, label: str) -> None:
        """Journal each new record of the job's Slurm job."""
        if w.slurm_id is None:
            return
        for rec in read_start_failures(w.heartbeat_dir, w.slurm_id):
            seen = f"{w.key}:{rec.job_id}:{rec.incarnation}"
            if seen in self._seen:
                continue
            self._seen.add(seen)
            if any(d["incarnation"] == rec.incarnation and (d["payload"] or {}).get("job_id") == rec.job_id
                   for d in self.journal.decisions(w.key, START_FAILURE_VERDICT)):
                continue   # journaled by this manager before it restarted
            self.journal.record_decision(w.key, rec.incarnation, rec.time, START_FAILURE_VERDICT,
                                         "before_first_heartbeat", to_builtins(rec))
            log.warning("manager: %s", first_line(label, as_failure(to_builtins(rec))))

    def of_judged(self, w: Watch) -> dict[str, Any] | None:
        """The judged life's start failure as journaled (its record), or None."""
        return next((d["payload"] for d in self.journal.decisions(w.key, START_FAILURE_VERDICT)
                     if d["incarnation"] == w.judged_incarnation
                     and (d["payload"] or {}).get("job_id") == str(w.slurm_id)), None)

    def stopped(self, w: Watch, label: str) -> BadInput | None:
        """The step supervisor stopped the Slurm job for a repeated start failure (its record's
        ``stopped``): its line. The supervisor judged with the launch's nodes in view."""
        self.observe(w, label)
        stopped = [d["payload"] for d in self.journal.decisions(w.key, START_FAILURE_VERDICT)
                   if (d["payload"] or {}).get("stopped") and d["payload"].get("job_id") == str(w.slurm_id)]
        return BadInput(cause="repeated_failure", line=str(stopped[-1]["stopped"])) if stopped else None

    def repeated(self, w: Watch, label: str) -> BadInput | None:
        """The job failed the same way twice before its first heartbeat: the line to stop it with."""
        stopped = self.stopped(w, label)
        if stopped is not None:
            return stopped
        decisions = self.journal.decisions(w.key, START_FAILURE_VERDICT)
        current = self.of_judged(w)
        before = [d for d in decisions if d["incarnation"] is not None and d["incarnation"] < w.judged_incarnation]
        if current is None or not before:
            return None
        previous = max(before, key=lambda d: d["incarnation"])
        beat = self.journal.observed_incarnations(w.key, "heartbeat_phase")
        if any(previous["incarnation"] <= i <= w.judged_incarnation for i in beat):
            return None   # a life in between trained: this failure is a fresh one
        same = repeated_failure([as_failure(previous["payload"]), as_failure(current)])
        return None if same is None else BadInput(cause="repeated_failure", line=stop_line(label, same))


def as_failure(payload: Any) -> StartFailure:
    """A journaled record (formats/start_failure.py) as the policy's failure."""
    p = payload if isinstance(payload, dict) else {}
    return StartFailure(launch=int(p.get("launch", 0)), exit_code=int(p.get("exit_code", 0)),
                        line=str(p.get("line", "")), log=str(p.get("log", "")))
