"""The manager's spool and heartbeat folders: bounded reads, strict formats, rejection.

The spool (the site's ``manager.spool_dir``, the plugin's ``spool=``) is root's and 0755; each user
has ``<spool>/<user>/`` (0700, theirs: the SPANK plugin makes it on the first record and hands it
over), read and emptied by that user's manager; node events, which every user may see (as in
``sinfo``), go into ``<spool>/nodes/`` (SlurmUser's, 0755), which every manager reads and none removes.

The formats are ``slurm_omni.formats.spool`` (strigger node events, SPANK fault records) and
``slurm_omni.formats.heartbeat`` (``rank-<RANK>.json`` in a job's heartbeat folder, rewritten by
every rank). Every file is read with a size bound (no symlinks, regular files only) and decoded
strictly. A file that fails is logged in one line naming it and moved into ``rejected/`` next to
it; a valid one becomes observations for the confirmer.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from slurm_omni.formats import decode, encode
from slurm_omni.formats.heartbeat import MAX_HEARTBEAT_BYTES, PHASES, HeartbeatRecord
from slurm_omni.formats.spool import (
    MAX_FAULT_BYTES,
    MAX_NODE_EVENT_BYTES,
    NODE_EVENT_KINDS,
    VERSION,
    FaultRecord,
    NodeEvent,
    SpoolEvent,
)
from slurm_omni.fsio import FileRejected, one_line, read_bounded, write_atomic
from slurm_omni.ownership import NotOwnedError, ensure_dir

log = logging.getLogger(__name__)
T = TypeVar("T")

REJECTED = "rejected"
NODES_SUBDIR = "nodes"
"""``<spool>/nodes/``: node events for every user (the strigger program's)."""
NODE_EVENT_TTL_S = 3600.0
"""The strigger program removes node events older than this (no manager may remove them)."""
HEARTBEAT_PHASES = PHASES

__all__ = [
    "MAX_FAULT_BYTES",
    "MAX_HEARTBEAT_BYTES",
    "MAX_NODE_EVENT_BYTES",
    "NODES_SUBDIR",
    "NODE_EVENT_KINDS",
    "NODE_EVENT_TTL_S",
    "REJECTED",
    "EventRejected",
    "FaultRecord",
    "HeartbeatRecord",
    "NodeEvent",
    "SpoolEvent",
    "consume",
    "format_node_event",
    "parse_fault_record",
    "parse_heartbeat",
    "parse_node_event",
    "prune_node_events",
    "read_bounded",
    "read_heartbeats",
    "reject",
    "scan_spool",
    "trigger_main",
    "write_event_file",
]


class EventRejected(FileRejected):
    """An event file is too big, not a regular file, or does not match its format."""


def _decode(data: bytes, kind: type[T], what: str) -> T:
    try:
        return decode(data, kind, what)
    except FileRejected as e:
        raise EventRejected(f"events: {e}") from None


def parse_node_event(data: bytes, what: str = "node event") -> NodeEvent:
    return _decode(data, NodeEvent, what)


def format_node_event(kind: str, nodes: str, when: float) -> bytes:
    """The node event file's bytes; validated by parsing them back."""
    try:
        data = encode(NodeEvent(VERSION, kind, nodes, when))  # type: ignore[arg-type]
    except ValueError as e:   # the Struct checks the hostlist when it is made
        raise EventRejected(f"events: couldn't format node event: {e}") from None
    parse_node_event(data)
    return data


def parse_fault_record(data: bytes, what: str = "fault record") -> FaultRecord:
    return _decode(data, FaultRecord, what)


def parse_heartbeat(data: bytes, what: str = "heartbeat") -> HeartbeatRecord:
    return _decode(data, HeartbeatRecord, what)


# -- spool ------------------------------------------------------------------------------------------

def reject(path: Path, reason: str) -> Path:
    """Log ``reason`` in one line and move ``path`` into ``rejected/`` beside it (the newest copy of
    a name wins); where it cannot be moved (``rejected`` is not our folder, say), delete it, so that
    the same file never stops a scan again."""
    target_dir = path.parent / REJECTED
    target = target_dir / path.name
    try:
        with ensure_dir(target_dir, below=path.parent, what="events: rejected", private=True) as rejected:
            os.replace(path, path.name, dst_dir_fd=rejected.fd)
    except (NotOwnedError, OSError) as e:
        why = str(e) if isinstance(e, NotOwnedError) else e.strerror
        log.warning("events: rejected %s: %s (couldn't move it aside: %s; deleted)", one_line(str(path)),
                    one_line(reason), one_line(str(why)))
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        return path
    log.warning("events: rejected %s: %s (moved to %s)", one_line(str(path)), one_line(reason),
                one_line(str(target)))
    return target


def _read_one(path: Path, limit: int, parse: Callable[[bytes, str], T], dir_fd: int | None = None) -> T:
    """``parse`` of the file at ``path`` (its name in ``dir_fd``, when given); every failure, foreseen
    or not, is one EventRejected."""
    try:
        return parse(read_bounded(path, limit, dir_fd=dir_fd), path.name)
    except FileRejected as e:
        raise EventRejected(str(e) if str(e).startswith("events:") else f"events: {e}") from None
    except Exception as e:   # a bug in a check must not let one file stop the daemon tick after tick
        log.exception("events: unexpected error reading %s", path)
        raise EventRejected(f"events: couldn't read {path.name}: {type(e).__name__}: {e}") from None


_SPOOL_PARSERS: dict[str, tuple[int, Callable[[bytes, str], SpoolEvent]]] = {
    "node-": (MAX_NODE_EVENT_BYTES, parse_node_event),
    "fault-": (MAX_FAULT_BYTES, parse_fault_record),
}


def scan_spool(spool: Path, *, shared: bool = False, dir_fd: int | None = None) -> list[tuple[Path, SpoolEvent]]:
    """Valid node events and fault records in ``spool``, oldest first; bad ones are set aside.
    The caller journals each and then calls ``consume``; temporary (dot) files are left alone.
    ``shared``: ``<spool>/nodes``, which is not ours: node events only, and a bad file is skipped
    with one log line (never moved). ``dir_fd``: ``spool`` held open and checked by the caller
    (``slurm_omni.ownership``): its files are read through it."""
    out: list[tuple[Path, SpoolEvent]] = []
    parsers = {"node-": _SPOOL_PARSERS["node-"]} if shared else _SPOOL_PARSERS
    for entry in sorted(os.scandir(spool if dir_fd is None else dir_fd), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == REJECTED or (not shared and entry.name == NODES_SUBDIR):
            continue
        path = spool / entry.name
        kind = next((k for k in parsers if entry.name.startswith(k)), None)
        try:
            if kind is None or not entry.name.endswith(".json"):
                raise EventRejected(f"unknown file name (expected {' or '.join(k + '*.json' for k in parsers)})")
            limit, parse = parsers[kind]
            out.append((path, _read_one(path, limit, parse, dir_fd)))
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
        log.warning("events: skipped %s: %s", one_line(str(path)), one_line(reason))


def consume(path: Path) -> None:
    """The event is journaled: remove its file."""
    path.unlink(missing_ok=True)


def read_heartbeats(heartbeat_dir: Path, *, dir_fd: int | None = None) -> list[HeartbeatRecord]:
    """Every rank's current heartbeat; a malformed file is set aside (the rank rewrites it).
    ``dir_fd``: the folder held open and checked by the caller: its files are read through it."""
    out = []
    try:
        entries = sorted(os.scandir(heartbeat_dir if dir_fd is None else dir_fd), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for entry in entries:
        if not (entry.name.startswith("rank-") and entry.name.endswith(".json")):
            continue
        path = heartbeat_dir / entry.name
        try:
            out.append(_read_one(path, MAX_HEARTBEAT_BYTES, parse_heartbeat, dir_fd))
        except EventRejected as e:
            if not path.exists():   # replaced between scandir and open: the next scan sees it
                continue
            reject(path, str(e))
    return out


def write_event_file(spool: Path, name: str, data: bytes, *, mode: int = 0o600) -> Path:
    """Write ``data`` as ``spool/name`` atomically and durably."""
    return write_atomic(spool / name, data, mode=mode)


def prune_node_events(nodes_dir: Path, now: float) -> None:
    """Remove node events older than ``NODE_EVENT_TTL_S`` (by the time in their name)."""
    for entry in os.scandir(nodes_dir):
        parts = entry.name.split("-")
        if entry.name.startswith("node-") and len(parts) >= 3 and parts[2].isascii() and parts[2].isdigit() \
                and int(parts[2]) / 1e9 < now - NODE_EVENT_TTL_S:
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
