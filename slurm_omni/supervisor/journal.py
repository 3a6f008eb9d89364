"""The step supervisor's journal and status file (their schemas: ``slurm_omni/formats/supervisor.py``).

``<ckpt>/supervisor/<slurm job id>.jsonl``: one record per line, appended and fsynced before
the supervisor acts on it. Replaying it gives where the job stands, so a supervisor killed anywhere
and started again carries on: a ``launch`` (the intent, with its layout) is written before its srun
starts; ``launched`` after (the srun's pid and start time); ``ended`` when the srun returned; ``confirmed`` with the
confirmation's cause; the next ``launch`` carries what changed (removed, added, units). ``fallback``
and ``done`` end the journal. A line that does not match its schema (a torn last line after a crash)
is skipped with one line of log.

``<ckpt>/supervisor/<slurm job id>.status.json``: the state for ``omni status`` and the manager,
replaced atomically on every change (``path: in_allocation``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_omni.formats import RecordRejected
from slurm_omni.formats.supervisor import (
    MAX_JOURNAL_BYTES,
    MAX_REQUEST_BYTES,
    MAX_STATUS_BYTES,
    SUBDIR,
    AllocationRecord,
    ConfirmedRecord,
    DoneRecord,
    EndedRecord,
    FallbackRecord,
    FirstStepRecord,
    JournalRecord,
    LaunchedRecord,
    LaunchFailedRecord,
    LaunchRecord,
    LayoutRecord,
    PoolRecord,
    ReportKind,
    RequestRecord,
    StatusPool,
    StatusRecovery,
    SuccessorRecord,
    SupervisorPhase,
    SupervisorReport,
    SupervisorRequest,
    SupervisorStatus,
    decode_journal_line,
    decode_request,
    decode_status,
    encode_journal_line,
    encode_report,
    encode_status,
    journal_path,
    journal_record,
    report_path,
    request_path,
    status_path,
)
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.policy.in_allocation import StepLayout
from slurm_omni.policy.pools import Pool

log = logging.getLogger(__name__)

__all__ = ["SUBDIR", "journal_path", "report_path", "request_path", "status_path"]


def layout_to_json(layout: StepLayout) -> dict[str, Any]:
    return {"components": [list(c) for c in layout.components], "spares": list(layout.spares),
            "failed": list(layout.failed), "units": layout.units, "kind_of": dict(layout.kind_of)}


def layout_from_record(rec: LayoutRecord) -> StepLayout:
    return StepLayout(tuple(tuple(c) for c in rec.components), tuple(rec.spares), tuple(rec.failed), rec.units,
                      dict(rec.kind_of))


@dataclass(slots=True)
class Launch:
    number: int
    layout: StepLayout
    data_parallel_size: int
    port: int
    incarnation: int
    started_at: float
    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    cause: str = ""
    pid: int | None = None
    pid_start: int = 0
    """The srun's start time (clock ticks after boot; 0: not journaled): with ``pid``, that process."""
    ended: int | None = None
    """The srun's exit code (None: running, or unknown)."""
    confirmed: ConfirmedRecord | None = None
    first_step_at: float | None = None
    start_failure: LaunchFailedRecord | None = None
    """It failed before its first heartbeat: its exit code, line and log (policy/start_failure.py)."""
    extra: tuple[tuple[str, int, int], ...] = ()
    """A launch that spans allocations: its other sruns, (allocation's job id, pid, start time)."""
    allocation: str = ""
    """The successor allocation it runs in (empty: the one the job ran in before it)."""


@dataclass(frozen=True, slots=True)
class Successor:
    """The time limit's successor allocation as the journal knows it (``SuccessorRecord``)."""

    name: str
    after: str
    state: str
    job_id: str = ""
    nodes: tuple[str, ...] = ()
    end_time: float | None = None


@dataclass(slots=True)
class SupervisorState:
    """What the journal says, replayed."""

    allocation: list[str] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)
    """Request id -> outcome (planned replacements, each carried out at most once)."""
    outcome: str = ""
    """``done``, ``fallback`` or empty while the job goes on."""
    fallback: FallbackRecord | None = None
    pools: dict[str, Pool] = field(default_factory=dict)
    """Pool allocations by name (``policy/pools.py``), in the order they were asked for."""
    successors: dict[str, Successor] = field(default_factory=dict)
    """The time limit's successor allocations by name, in the order they were asked for."""
    allocation_job: str = ""
    """The successor allocation the job moved to last (empty: the job's first allocation)."""
    allocation_end: float | None = None
    """Its time limit."""

    def successor_of(self, job_id: str) -> Successor | None:
        """The last successor asked for while allocation ``job_id`` ran."""
        found = [s for s in self.successors.values() if s.after == job_id]
        return found[-1] if found else None

    @property
    def current(self) -> Launch | None:
        return self.launches[-1] if self.launches else None

    def apply(self, rec: JournalRecord) -> None:
        if isinstance(rec, AllocationRecord):
            self.allocation = list(rec.nodes)
        elif isinstance(rec, LaunchRecord):
            self.launches.append(Launch(
                rec.launch, layout_from_record(rec.layout), rec.data_parallel_size, rec.port, rec.incarnation,
                rec.time, tuple(rec.removed), tuple(rec.added), rec.cause, allocation=rec.allocation))
            if rec.allocation:
                self.allocation_job = rec.allocation
                if rec.end_time is not None:
                    self.allocation_end = rec.end_time
        elif isinstance(rec, RequestRecord):
            self.requests[rec.id] = rec.outcome
        elif isinstance(rec, PoolRecord):
            old = self.pools.get(rec.name) or Pool(job_id="", state=rec.event, name=rec.name)
            self.pools[rec.name] = Pool(job_id=rec.job or old.job_id, state=rec.event, name=rec.name,
                                        nodes=tuple(rec.nodes) or old.nodes,
                                        kind_of=dict(rec.kind_of) or dict(old.kind_of))
        elif isinstance(rec, SuccessorRecord):
            was = self.successors.get(rec.name) or Successor(rec.name, rec.after, rec.event)
            self.successors[rec.name] = Successor(rec.name, rec.after, rec.event, rec.job or was.job_id,
                                                  tuple(rec.nodes) or was.nodes,
                                                  rec.end_time if rec.end_time is not None else was.end_time)
        elif isinstance(rec, (FallbackRecord, DoneRecord)):
            self.outcome = "fallback" if isinstance(rec, FallbackRecord) else "done"
            if isinstance(rec, FallbackRecord):
                self.fallback = rec
        else:
            launch = self._launch(rec.launch)
            if launch is None:
                return
            if isinstance(rec, LaunchedRecord):
                launch.pid, launch.pid_start = rec.pid, rec.pid_start
                launch.extra = tuple((e.job, e.pid, e.pid_start) for e in rec.extra)
            elif isinstance(rec, EndedRecord):
                launch.ended = rec.rc
            elif isinstance(rec, ConfirmedRecord):
                launch.confirmed = rec
            elif isinstance(rec, LaunchFailedRecord):
                launch.start_failure = rec
            elif isinstance(rec, FirstStepRecord):
                launch.first_step_at = rec.at

    def _launch(self, number: int) -> Launch | None:
        return next((la for la in self.launches if la.number == number), None)


def read_journal(path: Path) -> list[JournalRecord]:
    """The journal's records, oldest first; a line that does not match (a torn last line) is
    skipped with one line of log. A journal that cannot be read (too big, a symlink) is an error."""
    if not os.path.lexists(path):
        return []
    data = read_bounded(path, MAX_JOURNAL_BYTES, what=f"supervisor journal {path}")
    out = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(decode_journal_line(line, f"{path.name} line {number}"))
        except RecordRejected as e:
            log.warning("supervisor: journal: %s (skipped)", e)
    return out


class SupervisorJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.state = SupervisorState()
        for rec in read_journal(path):
            self.state.apply(rec)

    def append(self, kind: str, **fields: Any) -> JournalRecord:
        """Journal one record (checked against its schema first: a record that does not match is an
        error, nothing is written), fsynced, then applied to the state."""
        at = fields.pop("time", None) or time.time()
        rec = journal_record(kind, at, fields, str(self.path))
        line = encode_journal_line(rec)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.state.apply(rec)
        return rec


def status_document(state: SupervisorState, *, job_id: str, phase: SupervisorPhase, now: float) -> SupervisorStatus:
    """The status file's content: the current launch and every in-allocation recovery so far."""
    cur = state.current
    pools = [StatusPool(name=p.name, slurm_job_id=p.job_id, state=p.state,  # type: ignore[arg-type]
                        nodes=list(p.nodes)) for p in state.pools.values()]
    recoveries = []
    for prev, nxt in zip(state.launches, state.launches[1:], strict=False):
        conf = prev.confirmed
        recoveries.append(StatusRecovery(
            slurm_job_id=prev.allocation or job_id, slurm_job_id_after=nxt.allocation or job_id, launch=nxt.number,
            cause=nxt.cause or (conf.cause if conf else ""), removed=list(nxt.removed), added=list(nxt.added),
            data_parallel_size_before=prev.data_parallel_size, data_parallel_size_after=nxt.data_parallel_size,
            spares_left=len(nxt.layout.spares), fault_at=conf.fault_at if conf else None,
            confirmed_at=conf.confirmed_at if conf else None, relaunched_at=nxt.started_at,
            first_step_at=nxt.first_step_at))
    succ = state.successor_of(state.allocation_job or job_id)
    moved = {"allocation": state.allocation_job,
             "successor": None if succ is None else StatusPool(name=succ.name, slurm_job_id=succ.job_id,
                                                               state=succ.state,  # type: ignore[arg-type]
                                                               nodes=list(succ.nodes))}
    if cur is None:
        return SupervisorStatus(slurm_job_id=job_id, phase=phase, updated_at=now, recoveries=recoveries,
                                fallback=state.fallback, pools=pools, **moved)  # type: ignore[arg-type]
    return SupervisorStatus(
        slurm_job_id=job_id, phase=phase, updated_at=now, launch=cur.number, data_parallel_size=cur.data_parallel_size,
        components=[list(c) for c in cur.layout.components], spares=list(cur.layout.spares),
        spares_left=len(cur.layout.spares), failed_nodes=list(cur.layout.failed), recoveries=recoveries,
        fallback=state.fallback, pools=pools, **moved)  # type: ignore[arg-type]


def write_status(path: Path, status: SupervisorStatus) -> None:
    write_atomic(path, encode_status(status), durable=False)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning("%s", message)


def read_status(path: Path) -> SupervisorStatus | None:
    """The status file, or None when missing; a file that does not match its schema is one line of
    log (once) and None (the manager, ``omni status``, the demo)."""
    if not os.path.lexists(path):
        return None
    try:
        return decode_status(read_bounded(path, MAX_STATUS_BYTES), f"supervisor status {path}")
    except FileRejected as e:
        _log_once(f"supervisor: {e} (skipped)")
        return None


def read_request(path: Path) -> SupervisorRequest | None:
    """A planned request (``formats.supervisor.SupervisorRequest``), or None: missing, or malformed
    (one line of log, once; never fatal)."""
    if not os.path.lexists(path):
        return None
    try:
        return decode_request(read_bounded(path, MAX_REQUEST_BYTES), f"supervisor request {path}")
    except FileRejected as e:
        _log_once(f"supervisor: {e} (ignored)")
        return None


def report_document(kind: ReportKind, *, job_id: str, incarnation_before: int, incarnation_after: int, cause: str,
                    nodes: list[str], removed: dict[str, list[str]], added: dict[str, list[str]],
                    spares_left: dict[str, int], data_parallel_size: int, fault_at: float | None,
                    detected_at: float | None, confirmed_at: float | None, relaunched_at: float | None,
                    reason: str, failed_nodes: list[str]) -> SupervisorReport:
    return SupervisorReport(
        kind=kind, slurm_job_id=job_id, incarnation_before=incarnation_before, incarnation_after=incarnation_after,
        cause=cause, nodes=nodes, removed=removed, added=added, spares_left=spares_left,
        data_parallel_size=data_parallel_size, fault_at=fault_at, detected_at=detected_at,
        confirmed_at=confirmed_at, relaunched_at=relaunched_at, reason=reason, failed_nodes=failed_nodes)


def write_report(path: Path, report: SupervisorReport) -> None:
    write_atomic(path, encode_report(report))
