"""Where the manager's observations come from, fastest first: the spool (strigger node events and
SPANK fault records), heartbeat files, and one throttled poll of ``sinfo --json`` + ``squeue
--json`` that serves every registered job (never a query per job)."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.errors import SlurmError
from slurm_omni.formats.refusal import MAX_REFUSAL_BYTES, decode_refusal, refusal_name
from slurm_omni.formats.start_failure import MAX_START_FAILURE_BYTES, StartFailureRecord, decode_start_failure
from slurm_omni.fsio import FileRejected, read_bounded
from slurm_omni.manager.events import (
    NODES_SUBDIR,
    EventRejected,
    FaultRecord,
    HeartbeatRecord,
    HeartbeatScanner,
    SpoolEvent,
    read_heartbeats,
    scan_spool,
)
from slurm_omni.ownership import NotOwnedError, open_own_dir
from slurm_omni.slurm.backend import ClusterSnapshot, SlurmBackend

log = logging.getLogger(__name__)


class Poller:
    """At most one snapshot per ``interval_s``; after a failed poll, back off up to ``max_backoff_s``."""

    def __init__(self, backend: SlurmBackend, interval_s: float, *, max_backoff_s: float = 30.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self._monotonic = monotonic
        self._next = 0.0
        self._failures = 0
        self.polls = 0
        self.last: ClusterSnapshot | None = None

    def due(self) -> bool:
        return self._monotonic() >= self._next

    def poll(self, *, force: bool = False) -> ClusterSnapshot | None:
        """A new snapshot when one is due (or ``force``), else None."""
        if not force and not self.due():
            return None
        try:
            snap = self.backend.snapshot()
        except SlurmError as e:
            self._failures += 1
            delay = min(self.interval_s * 2 ** self._failures, self.max_backoff_s)
            log.warning("manager: couldn't poll Slurm (%s); next try in %.1fs", e, delay)
            self._next = self._monotonic() + delay
            return None
        self._failures = 0
        self.polls += 1
        self._next = self._monotonic() + self.interval_s
        self.last = snap
        return snap


@dataclass(frozen=True, slots=True)
class SpoolItem:
    path: Path
    event: SpoolEvent
    shared: bool = False
    """From ``<spool>/nodes``: every manager reads it, none removes it."""

    @property
    def key(self) -> str:
        return self.path.name

    def concerns(self, slurm_job_id: int | None, nodes: frozenset[str]) -> bool:
        """A fault record of this incarnation's Slurm job, or a node event naming one of its nodes."""
        if isinstance(self.event, FaultRecord):
            return slurm_job_id is not None and slurm_job_id in (self.event.het_job_id, self.event.job_id)
        return bool(nodes.intersection(self.event.node_names))


def read_spool(spool: Path, user: str) -> list[SpoolItem]:
    """Valid events, oldest first: fault records from ``<spool>/<user>`` (malformed files are set
    aside by ``scan_spool``; the SPANK plugin makes the folder on the first record) and node events
    from ``<spool>/nodes``. A folder of the user's that is not theirs and 0700, or a node folder
    others can write, is refused: anyone who can write it can inject failures."""
    items: list[SpoolItem] = []
    own = spool / user
    if os.path.lexists(own):
        try:
            with open_own_dir(own, "events: spool", private=True) as folder:
                items += [SpoolItem(path, event) for path, event in scan_spool(own, dir_fd=folder.fd)]
        except (EventRejected, NotOwnedError, OSError) as e:
            _log_once(str(e))
    nodes = spool / NODES_SUBDIR
    if os.path.lexists(nodes):
        try:
            check_shared_dir(nodes)
            items += [SpoolItem(path, event, shared=True) for path, event in scan_spool(nodes, shared=True)]
        except (EventRejected, OSError) as e:
            _log_once(str(e))
    items.sort(key=lambda item: item.event.time)
    return items


def check_shared_dir(path: Path) -> None:
    """A folder others write for us (node events): root's or ours, and nobody else may write to it."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or stat.S_IMODE(st.st_mode) & 0o022:
        raise EventRejected(f"events: couldn't use node events in {path}: expected a directory of root's "
                            f"that only its owner can write, found uid {st.st_uid} mode "
                            f"{stat.S_IMODE(st.st_mode):04o}")


_logged: set[str] = set()


def _log_once(message: str) -> None:
    """A refused folder stays refused tick after tick: say so once per distinct reason."""
    if message not in _logged:
        _logged.add(message)
        log.error("%s", message)


def read_job_heartbeats(heartbeat_dir: Path, slurm_job_id: int,
                        scanner: HeartbeatScanner | None = None) -> list[HeartbeatRecord]:
    """Heartbeats of one Slurm job: ranks of earlier incarnations (a larger world before a
    shrink) stay in the folder and are ignored. They feed failure confirmation and the fail-slow
    detector, so they are trusted only in a folder of the job's user (ours: each user runs their own
    manager) that nobody else can use, read through its checked descriptor (slurm_omni.ownership).
    ``scanner``: the watch's own, which reads only the files that changed since its last poll."""
    if not heartbeat_dir.is_dir():
        return []
    try:
        with open_own_dir(heartbeat_dir, "manager: heartbeats", private=True) as folder:
            wanted = str(slurm_job_id)
            beats = (scanner.scan(heartbeat_dir, dir_fd=folder.fd) if scanner is not None
                     else read_heartbeats(heartbeat_dir, dir_fd=folder.fd))
            return [hb for hb in beats if hb.job_id == wanted]
    except (NotOwnedError, OSError) as e:
        _log_once(str(e) if isinstance(e, NotOwnedError) else f"manager: couldn't read heartbeats in "
                  f"{heartbeat_dir}: {e.strerror}")
        return []


def read_refusal(heartbeat_dir: Path, slurm_job_id: int, incarnation: int) -> str | None:
    """The batch script's one line when it could not start the step (formats/refusal.py), or None.
    Read like a heartbeat: in our own 0700 folder, bounded, no symlink."""
    path = heartbeat_dir / refusal_name(slurm_job_id, incarnation)
    if not os.path.lexists(path):
        return None
    try:
        with open_own_dir(heartbeat_dir, "manager: heartbeats", private=True) as folder:
            return decode_refusal(read_bounded(path, MAX_REFUSAL_BYTES, dir_fd=folder.fd), path.name)
    except (FileRejected, NotOwnedError) as e:
        _log_once(str(e) if isinstance(e, NotOwnedError) else f"manager: couldn't read {path}: {e}")
        return None


def read_start_failures(heartbeat_dir: Path, slurm_job_id: int) -> list[StartFailureRecord]:
    """The launches of one Slurm job that failed before their first heartbeat
    (``failed-<job>-<incarnation>.json``, formats/start_failure.py), oldest life first. Read like a
    heartbeat: in our own 0700 folder, bounded, no symlink; a bad file is logged once and skipped."""
    prefix = f"failed-{slurm_job_id}-"
    if not os.path.lexists(heartbeat_dir):
        return []
    out = []
    try:
        with open_own_dir(heartbeat_dir, "manager: heartbeats", private=True) as folder:
            names = sorted(e.name for e in os.scandir(folder.fd) if e.name.startswith(prefix) and e.name.endswith(".json"))
            for name in names:
                path = heartbeat_dir / name
                try:
                    out.append(decode_start_failure(read_bounded(path, MAX_START_FAILURE_BYTES, dir_fd=folder.fd),
                                                    name))
                except FileRejected as e:
                    _log_once(f"manager: couldn't read {path}: {e}")
    except (NotOwnedError, OSError) as e:
        _log_once(str(e) if isinstance(e, NotOwnedError) else f"manager: couldn't read {heartbeat_dir}: {e.strerror}")
        return []
    return sorted(out, key=lambda r: r.incarnation)
