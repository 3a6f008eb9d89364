"""Event files in the manager's spool: formats, bounded reads, strict validation, rejection.

Three kinds of file arrive, each one JSON object written to a temporary name and renamed:

The spool (the site's ``manager.spool_dir``, the plugin's ``spool=``) is root's and 0755; each user
has ``<spool>/<user>/`` (0700, theirs: the SPANK plugin makes it on the first record and hands it
over), read and emptied by that user's manager; node events, which every user may see (as in
``sinfo``), go into ``<spool>/nodes/`` (SlurmUser's, 0755), which every manager reads and none removes.

``node-<kind>-<ns>-<pid>.json`` in ``<spool>/nodes/``, written by the strigger program (``trigger_main``
below; strigger appends the hostlist to the program's arguments)::

    {"version": 1, "kind": "down", "nodes": "node[1-2]", "time": 1764460000.12}

``kind`` is one of down, fail, drained, up; ``nodes`` a Slurm hostlist; ``time`` epoch seconds.

``fault-<job>.<step>-<node>-<task>-<ns>.json`` in ``<spool>/<user>/``, written by the SPANK plugin for a task
that exited abnormally (spank/fault.c, ``omni_fault_format``, version 1)::

    {"version": 1, "kind": "task_exit", "job_id": 43, "het_job_id": 42, "het_offset": 1,
     "step_id": 0, "node": "n3", "stage": "text", "stage_index": 1, "stage_rank": 2, "task_id": 5, "local_task_id": 1,
     "pid": 77, "exit_code": null, "signal": 9, "core_dumped": false, "time": "2026-11-30T00:00:00.120Z",
     "time_unix": 1764460800.120000000}

``rank-<RANK>.json`` in a job's heartbeat directory, rewritten by every rank (elastic/heartbeat.py).

Every file is read with a size bound (no symlinks, regular files only) and validated strictly:
exactly the known keys, the right types, no duplicate keys, no NaN. A file that fails is logged
and moved into ``rejected/`` next to it; a valid one becomes observations for the confirmer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_omni.errors import OmniError, SlurmError
from slurm_omni.policy.confirm import Heartbeat, NodeObservation, TaskExit
from slurm_omni.slurm import hostlist
from slurm_omni.slurm.types import NodeState

log = logging.getLogger(__name__)

VERSION = 1
MAX_NODE_EVENT_BYTES = 64 * 1024    # a hostlist of thousands of unrelated names still fits
MAX_FAULT_BYTES = 4096              # spank/fault.c formats into 2048 bytes at most
MAX_HEARTBEAT_BYTES = 4096
REJECTED = "rejected"
NODES_SUBDIR = "nodes"
"""``<spool>/nodes/``: node events for every user (the strigger program's)."""
NODE_EVENT_TTL_S = 3600.0
"""The strigger program removes node events older than this (no manager may remove them)."""
NODE_EVENT_KINDS = ("down", "fail", "drained", "up")
HEARTBEAT_PHASES = ("starting", "training", "checkpointing", "stopping", "done", "failed")

_KIND_STATE = {"down": NodeState.DOWN, "fail": NodeState.FAIL, "drained": NodeState.DRAINED,
               "up": NodeState.IDLE}


class EventRejected(OmniError):
    """An event file is too big, not a regular file, or does not match its format."""


@dataclass(frozen=True, slots=True)
class NodeEvent:
    kind: str
    nodes: tuple[str, ...]
    time: float

    def observations(self) -> list[NodeObservation]:
        state = _KIND_STATE[self.kind]
        return [NodeObservation(self.time, n, state, f"strigger {self.kind}") for n in self.nodes]


@dataclass(frozen=True, slots=True)
class FaultRecord:
    job_id: int
    het_job_id: int | None
    het_offset: int | None
    step_id: int
    node: str
    stage: str
    stage_rank: int | None
    task_id: int
    local_task_id: int
    pid: int
    exit_code: int | None
    signal: int | None
    core_dumped: bool
    time: float

    def observation(self) -> TaskExit:
        return TaskExit(self.time, self.node, self.het_offset, self.task_id, self.exit_code, self.signal)


@dataclass(frozen=True, slots=True)
class HeartbeatRecord:
    rank: int
    stage: int
    dp_rank: int
    pid: int
    incarnation: int
    job_id: str
    step: int
    phase: str
    time: float
    step_time_s: float | None
    last_checkpoint_step: int | None
    beats: int
    node: str = ""
    compute_s: float | None = None   # this rank's own time of the last step (no waits for peers)
    data_s: float | None = None      # its data-loading time of that step
    metrics: dict[str, float | int] = field(default_factory=dict)
    """Numbers the training script passed with its last step (loss, samples, tokens, ...)."""
    error: str = ""
    """With phase ``failed``: the script's one line saying what went wrong (slurm_omni.elastic)."""
    exit_code: int | None = None
    """The exit code the rank chose in its last beat (78: bad input, restarting cannot help)."""

    def observation(self, *, het_job: bool = True) -> Heartbeat:
        """Stage n runs in het component n (runtime/layout.py); an ordinary job has only offset 0."""
        return Heartbeat(self.time, self.rank, self.step, self.node, self.stage if het_job else None, self.phase)


SpoolEvent = NodeEvent | FaultRecord


# -- reading ----------------------------------------------------------------------------------------

def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; symlinks and others are refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise EventRejected(f"events: couldn't open {path.name}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EventRejected(f"events: couldn't read {path.name}: not a regular file")
        if st.st_size > limit:
            raise EventRejected(f"events: couldn't read {path.name}: {st.st_size} bytes (limit {limit})")
        data = os.read(fd, limit + 1)
        if len(data) > limit:   # it grew after fstat
            raise EventRejected(f"events: couldn't read {path.name}: more than {limit} bytes")
        return data
    finally:
        os.close(fd)


def _strict_json(data: bytes, what: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise EventRejected(f"events: couldn't parse {what}: duplicate key {k!r}")
            out[k] = v
        return out

    def no_constant(name: str) -> Any:
        raise EventRejected(f"events: couldn't parse {what}: {name} is not a number")

    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EventRejected(f"events: couldn't parse {what}: {e}") from e
    if not isinstance(obj, dict):
        raise EventRejected(f"events: couldn't parse {what}: expected a JSON object")
    return obj


_Check = Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _is_duration(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) < 256 and v.isprintable()


def _opt(check: _Check) -> _Check:
    return lambda v: v is None or check(v)


def _validate(obj: dict[str, Any], schema: dict[str, _Check], what: str,
              optional: Iterable[str] = ()) -> None:
    opt = set(optional)
    unknown = sorted(set(obj) - set(schema))
    if unknown:
        raise EventRejected(f"events: couldn't accept {what}: unknown key {unknown[0]!r}")
    missing = sorted(set(schema) - set(obj) - opt)
    if missing:
        raise EventRejected(f"events: couldn't accept {what}: missing key {missing[0]!r}")
    for key, check in schema.items():
        if key in obj and not check(obj[key]):
            raise EventRejected(f"events: couldn't accept {what}: {key} = {obj[key]!r:.80} is not allowed")


# -- formats ----------------------------------------------------------------------------------------

_NODE_EVENT: dict[str, _Check] = {
    "version": lambda v: v == VERSION, "kind": lambda v: v in NODE_EVENT_KINDS,
    "nodes": lambda v: isinstance(v, str) and 0 < len(v) <= MAX_NODE_EVENT_BYTES,
    "time": _is_time,
}


def parse_node_event(data: bytes, what: str = "node event") -> NodeEvent:
    obj = _strict_json(data, what)
    _validate(obj, _NODE_EVENT, what)
    try:
        nodes = hostlist.expand(obj["nodes"])
    except SlurmError as e:
        raise EventRejected(f"events: couldn't accept {what}: {e}") from e
    if not nodes or not all(_is_name(n) for n in nodes):
        raise EventRejected(f"events: couldn't accept {what}: nodes = {obj['nodes']!r:.80} names no node")
    return NodeEvent(obj["kind"], tuple(nodes), float(obj["time"]))


def format_node_event(kind: str, nodes: str, when: float) -> bytes:
    """The node event file's bytes; validated by parsing them back."""
    data = (json.dumps({"version": VERSION, "kind": kind, "nodes": nodes, "time": when}) + "\n").encode()
    parse_node_event(data)
    return data


_FAULT: dict[str, _Check] = {
    "version": lambda v: v == VERSION, "kind": lambda v: v == "task_exit",
    "job_id": lambda v: _is_int(v) and v > 0, "het_job_id": lambda v: _is_int(v) and v >= -1,
    "het_offset": lambda v: _is_int(v) and v >= -1, "step_id": lambda v: _is_int(v) and v >= 0,
    "node": _is_name, "stage": lambda v: isinstance(v, str) and len(v) < 256 and v.isprintable(),
    "stage_index": lambda v: _is_int(v) and v >= -1, "stage_rank": lambda v: _is_int(v) and v >= -1,
    "task_id": lambda v: _is_int(v) and v >= 0, "local_task_id": lambda v: _is_int(v) and v >= 0,
    "pid": lambda v: _is_int(v) and v >= 0,
    "exit_code": _opt(lambda v: _is_int(v) and 0 <= v <= 255),
    "signal": _opt(lambda v: _is_int(v) and 0 < v < 128),
    "core_dumped": lambda v: isinstance(v, bool), "time": lambda v: isinstance(v, str) and len(v) < 64,
    "time_unix": _is_time,
}


def parse_fault_record(data: bytes, what: str = "fault record") -> FaultRecord:
    obj = _strict_json(data, what)
    _validate(obj, _FAULT, what, optional=("stage_index",))   # spank/fault.c writes it since ec131cd
    if (obj["exit_code"] is None) == (obj["signal"] is None):
        raise EventRejected(f"events: couldn't accept {what}: expected exactly one of exit_code and signal")
    het_job_id, het_offset, stage_rank = (None if obj[k] < 0 else obj[k]
                                          for k in ("het_job_id", "het_offset", "stage_rank"))
    return FaultRecord(obj["job_id"], het_job_id, het_offset, obj["step_id"], obj["node"], obj["stage"],
                       stage_rank, obj["task_id"], obj["local_task_id"], obj["pid"], obj["exit_code"],
                       obj["signal"], obj["core_dumped"], float(obj["time_unix"]))


_HEARTBEAT: dict[str, _Check] = {
    "rank": lambda v: _is_int(v) and v >= 0, "stage": lambda v: _is_int(v) and v >= 0,
    "dp_rank": lambda v: _is_int(v) and v >= 0, "pid": lambda v: _is_int(v) and v >= 0,
    "incarnation": lambda v: _is_int(v) and v >= 0, "job_id": lambda v: isinstance(v, str) and len(v) < 64,
    "step": lambda v: _is_int(v) and v >= -1, "phase": lambda v: v in HEARTBEAT_PHASES, "time": _is_time,
    "step_time_s": _opt(lambda v: _is_time(v) or (_is_int(v) and v == 0)), "last_checkpoint_step": _opt(_is_int),
    "beats": lambda v: _is_int(v) and v >= 0, "node": _is_name,
    "compute_s": _opt(_is_duration), "data_s": _opt(_is_duration),
    "metrics": lambda v: isinstance(v, dict) and len(v) <= 16 and all(
        isinstance(k, str) and 0 < len(k) <= 32 and isinstance(x, (int, float)) and not isinstance(x, bool)
        and math.isfinite(x) for k, x in v.items()),
    "error": lambda v: isinstance(v, str) and len(v) <= 400,
    "exit_code": _opt(lambda v: _is_int(v) and 0 <= v <= 255),
}
_HEARTBEAT_OPTIONAL = ("node", "compute_s", "data_s", "metrics", "error", "exit_code")   # older writers omit them
_HEARTBEAT_DEFAULTS: dict[str, Any] = {"node": "", "metrics": {}, "error": ""}


def parse_heartbeat(data: bytes, what: str = "heartbeat") -> HeartbeatRecord:
    obj = _strict_json(data, what)
    _validate(obj, _HEARTBEAT, what, optional=_HEARTBEAT_OPTIONAL)
    values: dict[str, Any] = {k: obj[k] if k in obj else _HEARTBEAT_DEFAULTS.get(k) for k in _HEARTBEAT}
    return HeartbeatRecord(**values)


# -- spool ------------------------------------------------------------------------------------------

def check_private_dir(path: Path, *, create: bool = False) -> Path:
    """A spool directory must be ours and 0700: anything else could inject events."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise EventRejected(f"events: couldn't use spool {path}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise EventRejected(f"events: couldn't use spool {path}: expected a directory of uid {os.geteuid()} "
                            f"with mode 0700, found uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):04o} "
                            f"(chmod 700 it)")
    return path


def reject(path: Path, reason: str) -> Path:
    """Log ``reason`` and move ``path`` into ``rejected/`` beside it (the newest copy of a name wins)."""
    target_dir = path.parent / REJECTED
    target_dir.mkdir(mode=0o700, exist_ok=True)
    target = target_dir / path.name
    log.warning("events: rejected %s: %s (moved to %s)", path, reason, target)
    try:
        os.replace(path, target)
    except OSError as e:
        log.warning("events: couldn't move %s aside: %s; deleting it", path, e.strerror)
        path.unlink(missing_ok=True)
    return target


_SPOOL_PARSERS: dict[str, tuple[int, Callable[[bytes, str], SpoolEvent]]] = {
    "node-": (MAX_NODE_EVENT_BYTES, parse_node_event),
    "fault-": (MAX_FAULT_BYTES, parse_fault_record),
}


def scan_spool(spool: Path, *, shared: bool = False) -> list[tuple[Path, SpoolEvent]]:
    """Valid node events and fault records in ``spool``, oldest first; bad ones are set aside.
    The caller journals each and then calls ``consume``; temporary (dot) files are left alone.
    ``shared``: ``<spool>/nodes``, which is not ours: node events only, and a bad file is skipped
    with one log line (never moved)."""
    out: list[tuple[Path, SpoolEvent]] = []
    parsers = {"node-": _SPOOL_PARSERS["node-"]} if shared else _SPOOL_PARSERS
    for entry in sorted(os.scandir(spool), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == REJECTED or (not shared and entry.name == NODES_SUBDIR):
            continue
        path = Path(entry.path)
        kind = next((k for k in parsers if entry.name.startswith(k)), None)
        try:
            if kind is None or not entry.name.endswith(".json"):
                raise EventRejected(f"unknown file name (expected {' or '.join(k + '*.json' for k in parsers)})")
            limit, parse = parsers[kind]
            out.append((path, parse(read_bounded(path, limit), entry.name)))
        except EventRejected as e:
            if shared:
                _skip_once(path, str(e))
            else:
                reject(path, str(e))
    out.sort(key=lambda pe: pe[1].time)
    return out


_skipped: set[str] = set()


def _skip_once(path: Path, reason: str) -> None:
    if str(path) not in _skipped:
        _skipped.add(str(path))
        log.warning("events: skipped %s: %s", path, reason)


def consume(path: Path) -> None:
    """The event is journaled: remove its file."""
    path.unlink(missing_ok=True)


def read_heartbeats(heartbeat_dir: Path) -> list[HeartbeatRecord]:
    """Every rank's current heartbeat; a malformed file is set aside (the rank rewrites it)."""
    out = []
    try:
        entries = sorted(os.scandir(heartbeat_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for entry in entries:
        if not (entry.name.startswith("rank-") and entry.name.endswith(".json")):
            continue
        path = Path(entry.path)
        try:
            out.append(parse_heartbeat(read_bounded(path, MAX_HEARTBEAT_BYTES), entry.name))
        except EventRejected as e:
            if not path.exists():   # replaced between scandir and open: the next scan sees it
                continue
            reject(path, str(e))
    return out


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a temporary dot file renamed over it), mode 0600,
    never through a symlink."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_event_file(spool: Path, name: str, data: bytes, *, mode: int = 0o600) -> Path:
    """Write ``data`` as ``spool/name`` atomically (temporary dot file, fsync, rename)."""
    tmp = spool / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, spool / name)
    return spool / name


def prune_node_events(nodes_dir: Path, now: float) -> None:
    """Remove node events older than ``NODE_EVENT_TTL_S`` (by the time in their name)."""
    for entry in os.scandir(nodes_dir):
        parts = entry.name.split("-")
        if entry.name.startswith("node-") and len(parts) >= 3 and parts[2].isdigit() and \
                int(parts[2]) / 1e9 < now - NODE_EVENT_TTL_S:
            Path(entry.path).unlink(missing_ok=True)


def trigger_main(argv: list[str]) -> int:
    """The strigger program: ``python -m slurm_omni.manager.events SPOOL KIND HOSTLIST``
    (strigger appends HOSTLIST; a two-line wrapper script per kind supplies SPOOL and KIND). The
    event goes into ``SPOOL/nodes/`` (made 0755), readable by every user's manager."""
    if len(argv) != 3 or argv[1] not in NODE_EVENT_KINDS:
        print(f"usage: events SPOOL {{{','.join(NODE_EVENT_KINDS)}}} HOSTLIST", file=sys.stderr)
        return 2
    spool, kind, nodes = Path(argv[0]), argv[1], argv[2]
    try:
        data = format_node_event(kind, nodes, time.time())
        nodes_dir = spool / NODES_SUBDIR
        nodes_dir.mkdir(mode=0o755, exist_ok=True)
        write_event_file(nodes_dir, f"node-{kind}-{time.time_ns()}-{os.getpid()}.json", data, mode=0o644)
        prune_node_events(nodes_dir, time.time())
    except (EventRejected, OSError) as e:
        print(f"omni trigger: couldn't record {kind} {nodes[:200]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(trigger_main(sys.argv[1:]))
