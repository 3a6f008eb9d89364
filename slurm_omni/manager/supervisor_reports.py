"""What the step supervisor tells the manager (issue 13): its report files, read strictly.

The supervisor (``slurm_omni/supervisor``) decides recoveries inside the allocation; the manager
only observes them, and takes over when the supervisor gives up (docs/recovery.md). In the job's
checkpoint folder, ``supervisor/``:

``<slurm job id>.status.json``: its status file; while it exists the job is *supervised*: a failure
the manager confirms is the supervisor's to handle first.

``relaunched-<life after>.json`` / ``gave_up-<life after>.json``: one file per event, written
atomically (the layout the manager reads is the one in /work/notes/recovery-fsm.md)::

    {"version": 1, "kind": "relaunched", "slurm_job_id": "42", "life_before": 0, "life_after": 1,
     "cause": "down", "nodes": ["node3"], "removed": {"1": ["node3"]}, "added": {"1": ["node4"]},
     "spares_left": {"0": 1, "1": 0}, "data_parallel_size": 2, "fault_at": t, "detected_at": t,
     "confirmed_at": t, "relaunched_at": t, "reason": "...", "failed_nodes": ["node3"]}

Every key but version, kind, slurm_job_id and life_after may be missing or null. A file that does
not match is logged once and skipped (the manager never stops for one bad file).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni.fsio import FileRejected, one_line, read_bounded, write_atomic
from slurm_omni.manager.events import EventRejected
from slurm_omni.policy.recovery_events import SupervisorReport

log = logging.getLogger(__name__)

SUBDIR = "supervisor"
MAX_REPORT_BYTES = 64 * 1024
KINDS = ("relaunched", "gave_up")
_KEYS = {"version", "kind", "slurm_job_id", "life_before", "life_after", "cause", "nodes", "removed", "added",
         "spares_left", "data_parallel_size", "fault_at", "detected_at", "confirmed_at", "relaunched_at", "reason",
         "failed_nodes"}


@dataclass(frozen=True, slots=True)
class Report:
    slurm_job_id: str
    failed_nodes: tuple[str, ...]
    observation: SupervisorReport


def supervised(ckpt_dir: Path, slurm_job_id: int) -> bool:
    """Does a step supervisor run in this Slurm job (its status file is there)?"""
    return (ckpt_dir / SUBDIR / f"{slurm_job_id}.status.json").is_file()


def read_reports(ckpt_dir: Path, slurm_job_id: int) -> list[Report]:
    """The supervisor's reports of this Slurm job, oldest life first."""
    folder = ckpt_dir / SUBDIR
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        if not path.name.startswith(tuple(f"{k}-" for k in KINDS)):
            continue
        try:
            report = parse_report(read_bounded(path, MAX_REPORT_BYTES), path.name)
        except FileRejected as e:   # too big, a link, not ours to read, malformed
            _log_once(str(e))
            continue
        if report.slurm_job_id == str(slurm_job_id):
            out.append(report)
    return sorted(out, key=lambda r: (r.observation.life_after or 0, r.observation.kind))


def parse_report(data: bytes, what: str) -> Report:
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=lambda c: _refuse(what, f"{c} is not a number"))
    except (ValueError, RecursionError) as e:   # not UTF-8, not JSON, an int of 5,000 digits, too deep
        raise EventRejected(f"manager: couldn't parse supervisor report {one_line(what)}: "
                            f"{one_line(str(e)) or 'nested too deep'}") from None
    if not isinstance(obj, dict):
        _refuse(what, "expected a JSON object")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        _refuse(what, f"unknown key {unknown[0]!r}")
    if obj.get("version") != 1 or obj.get("kind") not in KINDS:
        _refuse(what, f"version = {obj.get('version')!r}, kind = {obj.get('kind')!r} (expected 1 and one of "
                      f"{', '.join(KINDS)})")
    slurm_job_id, life_after = obj.get("slurm_job_id"), obj.get("life_after")
    if not isinstance(slurm_job_id, (str, int)) or isinstance(slurm_job_id, bool) or not str(slurm_job_id).isdigit():
        _refuse(what, f"slurm_job_id = {slurm_job_id!r:.40} (expected a job id)")
    if not _count(life_after):
        _refuse(what, f"life_after = {life_after!r:.40} (expected an int >= 0)")
    times = {k: _time(obj, k, what) for k in ("fault_at", "detected_at", "confirmed_at", "relaunched_at")}
    dp = obj.get("data_parallel_size")
    if dp is not None and not (_count(dp) and dp > 0):
        _refuse(what, f"data_parallel_size = {dp!r:.40}")
    life_before = obj.get("life_before")
    if life_before is not None and not _count(life_before):
        _refuse(what, f"life_before = {life_before!r:.40}")
    spares = obj.get("spares_left") or {}
    if not isinstance(spares, dict) or not all(isinstance(k, str) and _count(v) for k, v in spares.items()):
        _refuse(what, "spares_left must map het offsets to counts")
    at = times["relaunched_at"] or times["confirmed_at"] or times["detected_at"]
    if at is None:
        raise EventRejected(f"manager: couldn't accept supervisor report {what}: no time (relaunched_at, "
                            "confirmed_at or detected_at)")
    observation = SupervisorReport(
        at=at, kind=obj["kind"], cause=_text(obj, "cause", what), nodes=_names(obj.get("nodes"), "nodes", what),
        life_before=life_before or 0, life_after=life_after, fault_at=times["fault_at"],
        detected_at=times["detected_at"], confirmed_at=times["confirmed_at"],
        removed=_by_offset(obj.get("removed"), "removed", what), added=_by_offset(obj.get("added"), "added", what),
        spares_left=dict(spares), data_parallel_size=dp, reason=_text(obj, "reason", what))
    return Report(str(slurm_job_id), _names(obj.get("failed_nodes"), "failed_nodes", what), observation)


def _refuse(what: str, why: str) -> Any:
    raise EventRejected(f"manager: couldn't accept supervisor report {what}: {why}")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(obj: Mapping[str, Any], key: str, what: str) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        _refuse(what, f"{key} = {v!r:.40} (expected unix time)")
    return float(v)


def _text(obj: Mapping[str, Any], key: str, what: str) -> str:
    v = obj.get(key)
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > 2000:
        _refuse(what, f"{key} must be text")
    return v


def _names(v: Any, key: str, what: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(n, str) and 0 < len(n) < 256 and n.isprintable() for n in v):
        _refuse(what, f"{key} must be a list of node names")
    return tuple(v)


def _by_offset(v: Any, key: str, what: str) -> dict[str, tuple[str, ...]]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        _refuse(what, f"{key} must map het offsets to node names")
    return {str(k): _names(nodes, key, what) for k, nodes in v.items()}


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.error("%s", message)


# -- planned replacements (fail-slow): the request file and its outcome ---------------------------
MAX_JOURNAL_BYTES = 4 << 20
REQUEST_OUTCOMES = ("accepted", "no_spare", "below_minimum", "unknown_node", "carried_out")


@dataclass(frozen=True, slots=True)
class SupervisorView:
    """What the manager needs of a supervisor's status file to ask it for a replacement."""

    updated_at: float
    phase: str
    spares_left: int
    nodes: frozenset[str]


def read_status_view(ckpt_dir: Path, slurm_job_id: int) -> SupervisorView | None:
    """The supervisor's status file of this Slurm job, or None (missing, malformed: logged once)."""
    path = ckpt_dir / SUBDIR / f"{slurm_job_id}.status.json"
    try:
        obj = json.loads(read_bounded(path, MAX_REPORT_BYTES * 16).decode("utf-8"))
    except FileRejected:
        return None
    except (ValueError, RecursionError):
        _log_once(f"manager: couldn't parse supervisor status {path.name}")
        return None
    try:
        comps = obj["components"]
        nodes = frozenset(str(n) for c in comps for n in c)
        view = SupervisorView(float(obj["updated_at"]), str(obj["phase"]), int(obj["spares_left"]), nodes)
    except (KeyError, TypeError, ValueError):
        _log_once(f"manager: supervisor status {path.name} lacks updated_at, phase, spares_left or components")
        return None
    return view


def write_request(ckpt_dir: Path, slurm_job_id: int, request_id: str, nodes: list[str], *,
                  shrink: bool = False) -> Path:
    """Ask the job's supervisor to replace ``nodes`` at the next checkpoint (``shrink``: or to
    launch with fewer data-parallel replicas without them when no spare is left; atomic rename; the
    supervisor journals its answer once per id)."""
    path = ckpt_dir / SUBDIR / f"{slurm_job_id}.request.json"
    doc = {"id": request_id, "replace": nodes, "at": "checkpoint", "shrink": shrink}
    write_atomic(path, (json.dumps(doc) + "\n").encode(), durable=True)
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
        for line in data.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:   # a torn last line
                continue
            if (isinstance(rec, dict) and rec.get("kind") == "request" and rec.get("id") == request_id
                    and rec.get("outcome") in REQUEST_OUTCOMES):
                outcome = str(rec["outcome"])
    return outcome
