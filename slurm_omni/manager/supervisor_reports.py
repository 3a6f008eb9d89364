"""What the step supervisor tells the manager (issue 13): its report files, read strictly.

The supervisor (``slurm_omni/supervisor``) decides recoveries inside the allocation; the manager
only observes them, and takes over when the supervisor gives up (docs/recovery.md). In the job's
checkpoint folder, ``supervisor/`` (every file's schema, shared with the supervisor:
``slurm_omni/formats/supervisor.py``):

``<slurm job id>.status.json``: its status file; while it exists the job is *supervised*: a failure
the manager confirms is the supervisor's to handle first.

``relaunched-<incarnation after>.json`` / ``gave_up-<incarnation after>.json``: one file per event,
written atomically::

    {"version": 1, "kind": "relaunched", "slurm_job_id": "42", "life_before": 0, "life_after": 1,
     "cause": "down", "nodes": ["node3"], "removed": {"1": ["node3"]}, "added": {"1": ["node4"]},
     "spares_left": {"0": 1, "1": 0}, "data_parallel_size": 2, "fault_at": t, "detected_at": t,
     "confirmed_at": t, "relaunched_at": t, "reason": "...", "failed_nodes": ["node3"]}

``life_before``/``life_after`` are the incarnations (OMNI_INCARNATION) before and after. Every key
but version, kind, slurm_job_id and life_after may be missing or null. A file that does not match is
logged once and skipped (the manager never stops for one bad file).

``<slurm job id>.request.json``: the manager's request for a replacement at the next checkpoint;
the supervisor's answer is its journal's ``request`` record.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.formats import RecordRejected
from slurm_omni.formats.supervisor import (
    MAX_JOURNAL_BYTES,
    MAX_REPORT_BYTES,
    MAX_STATUS_BYTES,
    REPORT_KINDS,
    REQUEST_OUTCOMES,
    SUBDIR,
    RequestRecord,
    SupervisorRequest,
    SupervisorStatus,
    decode_journal_line,
    decode_report,
    decode_status,
    encode_request,
    request_path,
    status_path,
)
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.manager.events import EventRejected
from slurm_omni.policy.recovery_events import SupervisorReport

log = logging.getLogger(__name__)

__all__ = [
    "MAX_JOURNAL_BYTES",
    "MAX_REPORT_BYTES",
    "REQUEST_OUTCOMES",
    "Report",
    "SupervisorView",
    "allocations_now",
    "parse_report",
    "read_reports",
    "read_status",
    "read_status_view",
    "request_outcome",
    "supervised",
    "write_request",
]


@dataclass(frozen=True, slots=True)
class Report:
    slurm_job_id: str
    failed_nodes: tuple[str, ...]
    observation: SupervisorReport


def supervised(ckpt_dir: Path, slurm_job_id: int) -> bool:
    """Does a step supervisor run in this Slurm job (its status file is there)?"""
    return status_path(ckpt_dir, str(slurm_job_id)).is_file()


def read_reports(ckpt_dir: Path, slurm_job_id: int) -> list[Report]:
    """The supervisor's reports of this Slurm job, oldest incarnation first."""
    folder = ckpt_dir / SUBDIR
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        if not path.name.startswith(tuple(f"{k}-" for k in REPORT_KINDS)):
            continue
        try:
            report = parse_report(read_bounded(path, MAX_REPORT_BYTES), path.name)
        except FileRejected as e:   # too big, a link, not ours to read, malformed
            _log_once(str(e))
            continue
        if report.slurm_job_id == str(slurm_job_id):
            out.append(report)
    return sorted(out, key=lambda r: (r.observation.incarnation_after or 0, r.observation.kind))


def parse_report(data: bytes, what: str) -> Report:
    """One report file as the recovery table's observation; a file that does not match the schema
    is one ``EventRejected`` line."""
    try:
        rec = decode_report(data, f"supervisor report {what}")
    except RecordRejected as e:
        raise EventRejected(f"manager: {e}") from None
    at = rec.at
    if at is None:   # the schema refuses it: for mypy
        raise EventRejected(f"manager: couldn't accept supervisor report {what}: no time")
    observation = SupervisorReport(
        at=at, kind=rec.kind, cause=rec.cause or "", nodes=tuple(rec.nodes or ()),
        incarnation_before=rec.incarnation_before or 0, incarnation_after=rec.incarnation_after, fault_at=rec.fault_at,
        detected_at=rec.detected_at, confirmed_at=rec.confirmed_at,
        removed={k: tuple(v) for k, v in (rec.removed or {}).items()},
        added={k: tuple(v) for k, v in (rec.added or {}).items()}, spares_left=dict(rec.spares_left or {}),
        data_parallel_size=rec.data_parallel_size, reason=rec.reason or "")
    return Report(rec.slurm_job_id, tuple(rec.failed_nodes or ()), observation)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.error("%s", message)


# -- planned replacements (fail-slow): the request file and its outcome ---------------------------
@dataclass(frozen=True, slots=True)
class SupervisorView:
    """What the manager needs of a supervisor's status file to ask it for a replacement."""

    updated_at: float
    phase: str
    spares_left: int
    nodes: frozenset[str]


def read_status(ckpt_dir: Path, slurm_job_id: int) -> SupervisorStatus | None:
    """The supervisor's status file of this Slurm job, or None (missing, malformed: logged once)."""
    path = status_path(ckpt_dir, str(slurm_job_id))
    if not os.path.lexists(path):
        return None
    try:
        return decode_status(read_bounded(path, MAX_STATUS_BYTES), f"supervisor status {path.name}")
    except FileRejected as e:
        _log_once(f"manager: {e}")
        return None


def allocations_now(ckpt_dir: Path, slurm_job_id: int) -> tuple[int, ...]:
    """The Slurm jobs a job in allocation mode holds now, the allocation it runs in first (its
    supervisor's status file: a successor it moved to at a time limit, its granted pools, an open
    successor); ``(slurm_job_id,)`` without a status file. The manager watches the first and
    cancels them all."""
    status = read_status(ckpt_dir, slurm_job_id)
    ids = [int(j) for j in (status.allocations if status is not None else ()) if j.isdigit()]
    return tuple(ids) or (slurm_job_id,)


def read_status_view(ckpt_dir: Path, slurm_job_id: int) -> SupervisorView | None:
    """What a fail-slow request needs of the supervisor's status file, or None (see :func:`read_status`)."""
    status = read_status(ckpt_dir, slurm_job_id)
    if status is None:
        return None
    return SupervisorView(status.updated_at, status.phase, status.spares_left, status.nodes)


def write_request(ckpt_dir: Path, slurm_job_id: int, request_id: str, nodes: list[str], *,
                  shrink: bool = False) -> Path:
    """Ask the job's supervisor to replace ``nodes`` at the next checkpoint (``shrink``: or to
    launch with fewer data-parallel replicas without them when no spare is left; atomic rename; the
    supervisor journals its answer once per id)."""
    path = request_path(ckpt_dir, str(slurm_job_id))
    write_atomic(path, encode_request(SupervisorRequest(id=request_id, replace=list(nodes), shrink=shrink)),
                 durable=True)
    return path


def request_outcome(ckpt_dir: Path, slurm_job_id: int, request_id: str) -> str | None:
    """The supervisor's last journaled answer to request ``request_id`` (accepted, no_spare,
    unknown_node, carried_out), or None while it has not answered."""
    folder = ckpt_dir / SUBDIR
    outcome = None
    for path in sorted(folder.glob(f"{slurm_job_id}*.jsonl")) if folder.is_dir() else ():
        if not path.name.startswith(f"{slurm_job_id}."):   # <job>.jsonl, <job>.<restart>.jsonl
            continue
        try:
            data = read_bounded(path, MAX_JOURNAL_BYTES)
        except FileRejected as e:
            _log_once(str(e))
            continue
        for number, line in enumerate(data.splitlines(), 1):
            if b'"request"' not in line:   # the other records: not decoded
                continue
            try:
                rec = decode_journal_line(line, f"{path.name} line {number}")
            except RecordRejected:   # a torn last line
                continue
            if isinstance(rec, RequestRecord) and rec.id == request_id:
                outcome = rec.outcome
    return outcome
