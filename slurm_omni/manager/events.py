"""The manager's spool and heartbeat folders: bounded reads, strict formats, rejection.

The spool (the site's ``manager.spool_dir``, the plugin's ``spool=``) is root's and 0755; each user
has ``<spool>/<user>/`` (0700, theirs: the SPANK plugin makes it on the first record and hands it
over), read and emptied by that user's manager; node events, which every user may see (as in
``sinfo``), go into ``<spool>/nodes/`` (SlurmUser's, 0755), which every manager reads and none removes.

The formats are ``slurm_omni.formats.spool`` (strigger node events, SPANK fault records) and
``slurm_omni.formats.heartbeat`` (``rank-<RANK>.json`` in a job's heartbeat folder, rewritten by
every rank, or ``node-<NODE>.json``, one per node, rewritten by the node's leader rank). Every file is read with a size bound (no symlinks, regular files only) and decoded
strictly. A file that fails is logged in one line naming it and moved into ``rejected/`` next to
it; a valid one becomes observations for the confirmer.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from slurm_omni.formats import decode, encode
from slurm_omni.formats.heartbeat import (
    MAX_HEARTBEAT_BYTES,
    MAX_NODE_BEATS_BYTES,
    MAX_RANKS_PER_NODE,
    NODE_PREFIX,
    NODE_SUFFIX,
    PHASES,
    RANK_PREFIX,
    HeartbeatRecord,
    NodeHeader,
    newer,
)
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
    """Every rank's current heartbeat (per rank the newest of its ``rank-*.json`` and the
    ``node-*.json`` beats, formats/heartbeat.py); a malformed file is set aside (the rank rewrites
    it). ``dir_fd``: the folder held open and checked by the caller: its files are read through it.
    Reads every file: a poller that runs again keeps a ``HeartbeatScanner``."""
    return HeartbeatScanner().scan(heartbeat_dir, dir_fd=dir_fd)


class _Cached:
    __slots__ = ("key", "lines", "records", "seen")

    def __init__(self, key: tuple[int, int, int, int], records: list[HeartbeatRecord], seen: int,
                 lines: dict[bytes, HeartbeatRecord] | None = None) -> None:
        self.key = key
        self.records = records
        self.seen = seen
        self.lines = lines or {}
        """A node file's beat lines as last decoded: an unchanged line is not decoded again."""


class HeartbeatScanner:
    """``read_heartbeats`` for a poller: a file whose inode, size, mtime and ctime are those of the
    last poll is not opened again (its records are reused); only what changed is read and decoded.
    Every beat is written by a rename (a new inode) at least a clock tick after the last, so an
    unchanged key is an unchanged file; ``refresh_polls`` re-reads a file all the same after that
    many polls without a change (a file system whose times are coarse). ``stats`` counts the file
    system calls of the last scan (``listdir``, ``stat``, ``open``), for the scale bench."""

    def __init__(self, *, refresh_polls: int = 120) -> None:
        self.refresh_polls = refresh_polls
        self._files: dict[str, _Cached] = {}
        self._polls = 0
        self.stats: dict[str, int] = {"listdir": 0, "stat": 0, "open": 0}

    def scan(self, heartbeat_dir: Path, *, dir_fd: int | None = None) -> list[HeartbeatRecord]:
        """Every rank's newest beat in the folder (read where it changed)."""
        self.scan_fresh(heartbeat_dir, dir_fd=dir_fd)
        return self.newest()

    def newest(self) -> list[HeartbeatRecord]:
        """Every rank's newest beat as of the last scan."""
        return merge_beats(r for cached in self._files.values() for r in cached.records)

    def scan_fresh(self, heartbeat_dir: Path, *, dir_fd: int | None = None) -> list[HeartbeatRecord]:
        """Scan the folder; only the beats decoded in this scan (the files and lines that changed):
        a poller that fed the earlier ones to its rule already need not go over every rank again."""
        self._polls += 1
        self.stats = {"listdir": 1, "stat": 0, "open": 0}
        fresh: list[HeartbeatRecord] = []
        try:
            entries = list(os.scandir(heartbeat_dir if dir_fd is None else dir_fd))
        except FileNotFoundError:
            self._files.clear()
            return fresh
        files: dict[str, _Cached] = {}
        for entry in entries:
            name = entry.name
            if not (name.startswith(RANK_PREFIX) and name.endswith(".json")
                    or name.startswith(NODE_PREFIX) and name.endswith(NODE_SUFFIX)):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:   # replaced or removed since the listing: the next scan sees it
                continue
            self.stats["stat"] += 1
            key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            old = self._files.get(name)
            if old is not None and old.key == key and self._polls - old.seen < self.refresh_polls:
                files[name] = old
                continue
            path = heartbeat_dir / name
            self.stats["open"] += 1
            lines: dict[bytes, HeartbeatRecord] = {}
            try:
                if name.startswith(RANK_PREFIX):
                    records = [_read_one(path, MAX_HEARTBEAT_BYTES, parse_heartbeat, dir_fd)]
                    fresh.extend(records)
                else:
                    known = old.lines if old is not None else {}
                    records = _read_one(path, MAX_NODE_BEATS_BYTES,
                                        functools.partial(parse_node_beats, known=known, decoded=lines, fresh=fresh),
                                        dir_fd)
            except EventRejected as e:
                if os.path.lexists(path) if dir_fd is None else _exists_at(name, dir_fd):
                    reject(path, str(e))
                continue
            files[name] = _Cached(key, records, self._polls, lines)
        self._files = files
        return fresh


def _exists_at(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def merge_beats(records: Iterable[HeartbeatRecord]) -> list[HeartbeatRecord]:
    """Per rank the newest beat (``formats.heartbeat.newer``), ordered by rank: beats that arrive
    late, out of order, or twice (a rank's own file and its node's) never hide a newer one."""
    newest: dict[int, HeartbeatRecord] = {}
    for hb in records:
        old = newest.get(hb.rank)
        if old is None or newer(hb, old):
            newest[hb.rank] = hb
    return [newest[r] for r in sorted(newest)]


def parse_node_beats(data: bytes, what: str = "node heartbeats", known: dict[bytes, HeartbeatRecord] | None = None,
                     decoded: dict[bytes, HeartbeatRecord] | None = None,
                     fresh: list[HeartbeatRecord] | None = None) -> list[HeartbeatRecord]:
    """The beats of a ``node-*.jsonl`` file (formats/heartbeat.py): its header checked, each beat line
    decoded on its own (one that does not decode is skipped, logged once per file and reason).
    ``known``: lines decoded before, reused as they are; ``decoded``: filled with this file's lines;
    ``fresh``: the beats of the lines that were not ``known`` appended."""
    lines = data.split(b"\n")
    _decode(lines[0], NodeHeader, f"{what} line 1")
    out = []
    for i, line in enumerate(lines[1:MAX_RANKS_PER_NODE + 1], 2):
        if not line:
            continue
        hb = known.get(line) if known else None
        if hb is None:
            try:
                hb = _decode(line, HeartbeatRecord, f"{what} line {i}")
            except EventRejected as e:
                _warn_once(str(e))
                continue
            if fresh is not None:
                fresh.append(hb)
        if decoded is not None:
            decoded[line] = hb
        out.append(hb)
    return out


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned and len(_warned) < 1000:
        _warned.add(message)
        log.warning("%s", message)


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
