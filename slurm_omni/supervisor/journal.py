"""The step supervisor's journal and status file.

``<ckpt>/supervisor/<slurm job id>.jsonl``: one JSON object per line, appended and fsynced before
the supervisor acts on it. Replaying it gives where the job stands, so a supervisor killed anywhere
and started again carries on: a ``launch`` (the intent, with its layout) is written before its srun
starts; ``launched`` after (the srun's pid and start time); ``ended`` when the srun returned; ``confirmed`` with the
confirmation's cause; the next ``launch`` carries what changed (removed, added, units). ``fallback``
and ``done`` end the journal. A torn last line (a crash mid-write) is ignored.

``<ckpt>/supervisor/<slurm job id>.status.json``: the state for ``omni status`` and the manager,
replaced atomically on every change (``path: in_allocation``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_omni.checkpoint.format import write_atomic
from slurm_omni.policy.in_allocation import StepLayout

log = logging.getLogger(__name__)

SUBDIR = "supervisor"
MAX_JOURNAL_BYTES = 4 << 20
KINDS = frozenset({"allocation", "launch", "launched", "ended", "confirmed", "request", "fallback", "done",
                   "first_step", "start_failure"})


def journal_path(ckpt_dir: Path, job_id: str) -> Path:
    return ckpt_dir / SUBDIR / f"{job_id}.jsonl"


def status_path(ckpt_dir: Path, job_id: str) -> Path:
    return ckpt_dir / SUBDIR / f"{job_id}.status.json"


def request_path(ckpt_dir: Path, job_id: str) -> Path:
    return ckpt_dir / SUBDIR / f"{job_id}.request.json"


def layout_to_json(layout: StepLayout) -> dict[str, Any]:
    return {"components": [list(c) for c in layout.components], "spares": list(layout.spares),
            "failed": list(layout.failed), "units": layout.units, "kind_of": dict(layout.kind_of)}


def layout_from_json(obj: dict[str, Any]) -> StepLayout:
    return StepLayout(tuple(tuple(str(n) for n in c) for c in obj["components"]),
                      tuple(str(n) for n in obj["spares"]), tuple(str(n) for n in obj["failed"]),
                      int(obj["units"]), {str(k): str(v) for k, v in (obj.get("kind_of") or {}).items()})


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
    confirmed: dict[str, Any] | None = None
    first_step_at: float | None = None
    start_failure: dict[str, Any] | None = None
    """It failed before its first heartbeat: ``exit_code``, ``line``, ``log`` (policy/start_failure.py)."""


@dataclass(slots=True)
class SupervisorState:
    """What the journal says, replayed."""

    allocation: list[str] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)
    """Request id -> outcome (planned replacements, each carried out at most once)."""
    outcome: str = ""
    """``done``, ``fallback`` or empty while the job goes on."""
    fallback: dict[str, Any] = field(default_factory=dict)

    @property
    def current(self) -> Launch | None:
        return self.launches[-1] if self.launches else None

    def apply(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "allocation":
            self.allocation = [str(n) for n in rec["nodes"]]
        elif kind == "launch":
            self.launches.append(Launch(
                int(rec["launch"]), layout_from_json(rec["layout"]), int(rec["data_parallel_size"]),
                int(rec["port"]), int(rec["incarnation"]), float(rec["time"]),
                tuple(rec.get("removed") or ()), tuple(rec.get("added") or ()), str(rec.get("cause") or "")))
        elif kind in ("launched", "ended", "confirmed", "first_step", "start_failure"):
            launch = self._launch(int(rec["launch"]))
            if launch is None:
                return
            if kind == "launched":
                launch.pid = int(rec["pid"])
                launch.pid_start = int(rec.get("pid_start") or 0)
            elif kind == "ended":
                launch.ended = int(rec["rc"])
            elif kind == "confirmed":
                launch.confirmed = dict(rec)
            elif kind == "start_failure":
                launch.start_failure = dict(rec)
            else:
                launch.first_step_at = float(rec["at"])
        elif kind == "request":
            self.requests[str(rec["id"])] = str(rec["outcome"])
        elif kind in ("fallback", "done"):
            self.outcome = kind
            if kind == "fallback":
                self.fallback = dict(rec)

    def _launch(self, number: int) -> Launch | None:
        return next((la for la in self.launches if la.number == number), None)


class SupervisorJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.state = SupervisorState()
        for rec in self._read():
            self.state.apply(rec)

    def _read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_JOURNAL_BYTES)
        except FileNotFoundError:
            return []
        out = []
        for line in data.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                log.warning("supervisor: journal %s: a torn line ignored", self.path)
                continue
            if isinstance(rec, dict) and rec.get("kind") in KINDS:
                out.append(rec)
        return out

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = {"kind": kind, "time": fields.pop("time", None) or time.time(), **fields}
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.state.apply(rec)
        return rec


def status_document(state: SupervisorState, *, job_id: str, phase: str, now: float) -> dict[str, Any]:
    """The status file's content: the current launch and every in-allocation recovery so far."""
    cur = state.current
    recoveries = []
    for prev, nxt in zip(state.launches, state.launches[1:], strict=False):
        conf = prev.confirmed or {}
        recoveries.append({
            "path": "in_allocation", "slurm_job_id": job_id, "slurm_job_id_after": job_id,
            "launch": nxt.number, "cause": nxt.cause or conf.get("cause", ""),
            "removed": list(nxt.removed), "added": list(nxt.added),
            "data_parallel_size_before": prev.data_parallel_size, "data_parallel_size_after": nxt.data_parallel_size,
            "spares_left": len(nxt.layout.spares), "fault_at": conf.get("fault_at"),
            "confirmed_at": conf.get("confirmed_at"), "relaunched_at": nxt.started_at,
            "first_step_at": nxt.first_step_at})
    return {
        "path": "in_allocation", "slurm_job_id": job_id, "phase": phase, "updated_at": now,
        "launch": cur.number if cur else None,
        "data_parallel_size": cur.data_parallel_size if cur else None,
        "components": [list(c) for c in cur.layout.components] if cur else [],
        "spares": list(cur.layout.spares) if cur else [],
        "spares_left": len(cur.layout.spares) if cur else 0,
        "failed_nodes": list(cur.layout.failed) if cur else [],
        "recoveries": recoveries, "fallback": state.fallback or None,
    }


def write_status(path: Path, doc: dict[str, Any]) -> None:
    write_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(), durable=False)


def read_status(path: Path) -> dict[str, Any] | None:
    """The status file, or None when missing or unreadable (the manager and ``omni status``)."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("path") == "in_allocation" else None


def read_request(path: Path) -> dict[str, Any] | None:
    """A planned request ``{"id": str, "replace": [node, ...], "shrink": bool}`` (``shrink``
    optional, false: a launch with fewer data-parallel replicas is allowed when no spare is left), or
    None (missing or malformed: logged, never fatal)."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return None
    if (not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not obj["id"]
            or not isinstance(obj.get("replace"), list) or not all(isinstance(n, str) for n in obj["replace"])
            or not isinstance(obj.get("shrink", False), bool)):
        log.warning("supervisor: request %s is not {\"id\": str, \"replace\": [node, ...], \"shrink\": bool "
                    "(optional)}: ignored", path)
        return None
    return obj


REPORT_VERSION = 1


def report_path(ckpt_dir: Path, kind: str, life_after: int) -> Path:
    """One file per in-allocation event for the manager (notes/recovery-fsm.md): ``relaunched`` or
    ``gave_up``, named by the life that follows."""
    return ckpt_dir / SUBDIR / f"{kind}-{life_after}.json"


def report_document(kind: str, *, job_id: str, life_before: int, life_after: int, cause: str,
                    nodes: list[str], removed: dict[str, list[str]], added: dict[str, list[str]],
                    spares_left: dict[str, int], data_parallel_size: int, fault_at: float | None,
                    detected_at: float | None, confirmed_at: float | None, relaunched_at: float | None,
                    reason: str, failed_nodes: list[str]) -> dict[str, Any]:
    return {"version": REPORT_VERSION, "kind": kind, "slurm_job_id": job_id, "life_before": life_before,
            "life_after": life_after, "cause": cause, "nodes": nodes, "removed": removed, "added": added,
            "spares_left": spares_left, "data_parallel_size": data_parallel_size, "fault_at": fault_at,
            "detected_at": detected_at, "confirmed_at": confirmed_at, "relaunched_at": relaunched_at,
            "reason": reason, "failed_nodes": failed_nodes}


def write_report(path: Path, doc: dict[str, Any]) -> None:
    write_atomic(path, (json.dumps(doc, sort_keys=True) + "\n").encode())
