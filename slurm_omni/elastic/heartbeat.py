"""Per-rank heartbeat file, rewritten atomically from a side thread; the requeue manager reads it.

``<OMNI_HEARTBEAT_DIR>/rank-<RANK>.json`` holds one JSON object::

    {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42",
     "step": 17, "phase": "training", "time": 1764460000.12, "step_time_s": 0.031,
     "compute_s": 0.021, "data_s": 0.002, "node": "node3", "last_checkpoint_step": 10, "beats": 9,
     "metrics": {"loss": 2.31, "samples": 8}}

``time`` is wall-clock (epoch seconds) of the write; ``step`` the last completed global step;
``step_time_s`` the mean of the last few steps' wall time; ``compute_s`` this rank's own compute per
step (its modules' forward and backward and the optimizer step, without the time spent waiting for a
peer in a receive or an all-reduce) and ``data_s`` its data loading per step, both means over the
same last steps as ``step_time_s`` (null until a step reports them; the fail-slow detector compares ``compute_s`` across the ranks of a stage);
``cpu_wait_s`` (same window) the part of ``compute_s + data_s`` the rank's thread was runnable but
waited for a CPU (run-queue delay: another process held the cores; elastic/timing.py);
``node`` the node the rank runs on (``SLURMD_NODENAME``; absent outside Slurm);
``last_checkpoint_step`` the newest step whose shard this rank made durable (or restored from);
``phase`` one of :data:`PHASES`; ``metrics`` (optional) at most :data:`MAX_METRICS` numbers the script
passed with its last step; ``error`` (optional, phase ``failed``) one line saying what went wrong;
``exit_code`` (optional, the last beat) the code the rank exits with (78: bad input, do not restart). The
file is written to a temporary name and renamed, so a reader never sees a partial file. The thread
keeps beating while the main thread is inside a long collective, which is what lets the manager tell
a slow step (beats, no progress) from a dead process (no beats).

Per node instead of per rank, the default under Slurm (``OMNI_HEARTBEAT_NODE_DIR``, a node-local
folder, ``/dev/shm`` when unset; ``off`` or empty: a file per rank; formats/heartbeat.py): the beat goes to ``<dir>/omni-beats-<uid>-<job>-<node>/rank-<RANK>.json``
(0700, ours, checked by its descriptor) and the rank holding that folder's ``lock`` (``flock``; the
next rank takes it over when its holder exits or dies) copies the node's beats of the newest life
into ``<OMNI_HEARTBEAT_DIR>/node-<NODE>.jsonl`` twice per interval: the shared file system sees one
write per node, not per rank. A rank writes its own ``rank-<RANK>.json`` as before when the node's
node folder is unusable (its own file written only then: never because the node's copy is late,
which under load would multiply the shared folder's writes exactly when it is slow, issue 19) and
removes it once the node's copy carries a newer beat. A leader that stops (SIGSTOP) keeps its
``flock``: when the node's copy is 1.5 intervals late and the leader named in ``leader``
(``<generation> <pid>``) is stopped or gone, one rank takes the lead over with the next generation's
lock (``lock-<g+1>``; the first one is ``lock``), and a leader that sees a newer generation there
steps down; a leader alive but slow (D state on the shared folder) keeps the lead. The stopped
rank's own beat stays in the node folder, copied with its old time, so its hang still shows; its last beat (``stop``) always goes to
its own file as well, so that its exit code does not wait on a leader that is exiting too. The node's
last rank removes the folder; what killed ranks leave, the SPANK plugin's job epilog removes at the
job's end, by this name (spank/shm.c).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from slurm_omni.elastic.node_metrics import COPIED, NodeLines, no_lines_left
from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import (
    MAX_ERROR_CHARS,
    MAX_HEARTBEAT_BYTES,
    MAX_METRICS,
    MAX_RANKS_PER_NODE,
    PHASES,
    RANK_PREFIX,
    HeartbeatRecord,
    NodeHeader,
    node_dir_setting,
    node_file_name,
)
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.ownership import NotOwnedError, OwnDir, ensure_dir, ensure_own_dir

log = logging.getLogger(__name__)

__all__ = ["MAX_ERROR_CHARS", "MAX_METRICS", "PHASES", "Heartbeat", "clean_metrics"]


class Heartbeat:
    """One rank's heartbeat file. ``update`` from the training loop; a thread rewrites the file."""

    def __init__(self, heartbeat_dir: Path, *, rank: int, stage: int, dp_rank: int, incarnation: int,
                 job_id: str, interval_s: float = 2.0, window: int = 5, node: str | None = None,
                 node_dir: Path | None = None) -> None:
        """``node_dir``: the node-local folder under which the node's ranks aggregate their beats
        (``NodeRelay``; None: ``OMNI_HEARTBEAT_NODE_DIR``, ``/dev/shm`` when unset,
        ``formats.heartbeat.node_dir_setting``); without a node name (outside Slurm) every rank
        writes its own file."""
        self.path = heartbeat_dir / f"rank-{rank}.json"
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._step_times: collections.deque[float] = collections.deque(maxlen=window)
        self._own_times: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=window) for k in ("compute_s", "data_s", "cpu_wait_s")}
        self._state: dict[str, Any] = {
            "rank": rank, "stage": max(0, stage), "dp_rank": dp_rank, "pid": os.getpid(),
            "incarnation": incarnation, "job_id": job_id, "step": -1, "phase": "starting",
            "step_time_s": None, "compute_s": None, "data_s": None, "cpu_wait_s": None, "last_checkpoint_step": None,
            "beats": 0,
        }
        node = os.environ.get("SLURMD_NODENAME", "") if node is None else node
        if node:
            self._state["node"] = node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-heartbeat", daemon=True)
        # the manager trusts only its own user's beats, in a folder only they can use
        ensure_own_dir(heartbeat_dir, what="heartbeat", private=True)
        if node_dir is None:
            node_dir = node_dir_setting()
        self.relay: NodeRelay | None = None
        if node_dir is not None and node:
            try:
                self.relay = NodeRelay(node_dir, shared_dir=heartbeat_dir, job_id=job_id, node=node, rank=rank,
                                       interval_s=interval_s)
            except (NotOwnedError, OSError) as e:   # the node folder is not usable: per-rank files
                log.warning("heartbeat: couldn't aggregate on the node (%s); writing %s", e, self.path)
        self._direct_at: float | None = None
        self._node_failed = False
        """When this rank last wrote its own file, until the node's copy is newer (then it is removed)."""

    def start(self) -> None:
        self._write()
        self._thread.start()

    @property
    def phase(self) -> str:
        return str(self._state["phase"])

    def update(self, *, step: int | None = None, step_time_s: float | None = None,
               compute_s: float | None = None, data_s: float | None = None, cpu_wait_s: float | None = None,
               phase: str | None = None,
               last_checkpoint_step: int | None = None, metrics: dict[str, float | int] | None = None,
               error: str | None = None) -> None:
        if phase is not None and phase not in PHASES:
            raise ValueError(f"heartbeat: phase {phase!r} is not one of {', '.join(PHASES)}")
        with self._lock:
            s = self._state
            if step is not None:
                s["step"] = step
            if step_time_s is not None:
                self._step_times.append(step_time_s)
                s["step_time_s"] = sum(self._step_times) / len(self._step_times)
            for key, value in (("compute_s", compute_s), ("data_s", data_s), ("cpu_wait_s", cpu_wait_s)):
                if value is not None:
                    # the mean over the same last steps as step_time_s: with a beat per interval,
                    # the last step alone is one sample in several and too noisy to compare nodes
                    times = self._own_times[key]
                    times.append(max(0.0, float(value)))
                    s[key] = round(sum(times) / len(times), 6)
            if phase is not None:
                s["phase"] = phase
            if last_checkpoint_step is not None:
                s["last_checkpoint_step"] = last_checkpoint_step
            if metrics is not None:
                s["metrics"] = clean_metrics(metrics)
            if error is not None:
                s["error"] = " ".join(error.split())[:MAX_ERROR_CHARS]

    def stop(self, phase: str, *, error: str | None = None, exit_code: int | None = None) -> None:
        """Final beat with ``phase`` (done, stopping, failed) and the exit code the rank is about to
        exit with; the thread ends."""
        self.update(phase=phase, error=error)
        if exit_code is not None:
            with self._lock:
                self._state["exit_code"] = exit_code
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
        self._write(last=True)

    def _run(self) -> None:
        if self.relay is None:
            while not self._stop.wait(self.interval_s):
                self._write()
            return
        # with a node folder: wake twice per interval (the leader publishes each time), beat once
        next_beat = time.monotonic() + self.interval_s
        while not self._stop.wait(self.interval_s / 2):
            if time.monotonic() >= next_beat - self.interval_s / 4:
                next_beat += self.interval_s
                self._write()
            else:
                try:
                    self.relay.lead(time.time())
                except OSError as e:   # the folder removed under it: the next beat says what to do
                    log.debug("heartbeat: couldn't lead the node's folder: %s", e)

    def _write(self, *, last: bool = False) -> None:
        with self._lock:
            self._state["beats"] += 1
            self._state["time"] = now = time.time()
            data = encode(HeartbeatRecord(**self._state))   # the schema the manager reads it with
        direct = self.relay is None or last
        if self.relay is not None:
            try:
                published = self.relay.beat(data, now, last=last)
            except OSError as e:
                if not self._node_failed:   # once, not every interval
                    log.warning("heartbeat: couldn't write on the node (%s); writing %s", e, self.path)
                self._node_failed = True
                published = 0.0
                direct = True   # no rank of the node can relay this beat: its own file
            if self._direct_at is not None and published > self._direct_at and not last:
                self._direct_at = None
                try:
                    self.path.unlink(missing_ok=True)   # the node's copy carries this beat or a newer one
                except OSError as e:
                    log.warning("heartbeat: couldn't remove %s: %s", self.path, e)
        if not direct:
            return
        try:
            write_atomic(self.path, data, durable=False)
            self._direct_at = now
        except OSError as e:
            # A full or flaky shared disk must not kill training; the manager sees stale beats.
            log.warning("heartbeat: couldn't write %s: %s", self.path, e)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process has that number now: not our rank's
        return False
    return True


def _lock_name(gen: int) -> str:
    return "lock" if gen <= 0 else f"lock-{gen}"


# The leader check (_read_leader, _running) has two more copies, on purpose: bench/light_relay.py
# (the light rank runs as ``python -S`` on C modules of the standard library only, without this
# package: at 2,048 ranks per host its start-up is the lane's cost; importing slurm_omni would need
# site-packages and the package's own imports) and bench/light_relay.c. tests/elastic/
# test_node_heartbeats.py and tests/supervisor/test_light_rank.py hold the three to the same takeover.
def _read_leader(dir_fd: int) -> tuple[int, int]:
    """The node's lead (``leader``: generation and pid of its holder); (0, 0) when none wrote it."""
    try:
        raw = read_bounded(Path(NodeRelay.LEADER), 64, dir_fd=dir_fd)
    except (OSError, FileRejected):
        return 0, 0
    parts = raw.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return 0, 0
    return int(parts[0]), int(parts[1])


def _running(pid: int) -> bool:
    """``pid`` is a process that runs (or waits, D state included): not stopped, not gone, not a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:][:1]
    return state not in (b"T", b"t", b"Z", b"X", b"")


def sweep_left_behind(node_dir: Path, *, keep: str, node: str, interval_s: float, now: float) -> list[str]:
    """This user's node folders of earlier jobs on ``node`` that nothing beats in any more, removed
    (their names). A node Slurm took out of a job (``--no-kill``: DOWN, NOT_RESPONDING) runs none of
    that job's epilog, which removes the folder elsewhere; a rank killed there later (SIGKILL: no last
    beat) leaves it (CI, 2026-12-03: ``omni-beats-0-43-node3`` of
    ``test_allocation_mode_hands_a_lost_allocation_...``, node3 set DOWN and removed from job 43).
    The user's next rank on the node sweeps them: a folder is left behind when every file in it is
    older than 10 intervals (at least 60 s) and no rank or leader named in it runs (a suspended job's
    ranks run: kept). Only folders of this uid, found as real folders of ours, not writable by others."""
    prefix, suffix = f"omni-beats-{os.geteuid()}-", f"-{_safe(node)}"
    old = max(10 * interval_s, 60.0)
    removed: list[str] = []
    try:
        base = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        for entry in os.scandir(base):
            name = entry.name
            if name == keep or not (name.startswith(prefix) and name.endswith(suffix)):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not _left_behind(fd, now - old):
                    continue
                for e in os.scandir(fd):
                    if not e.is_dir(follow_symlinks=False):
                        os.unlink(e.name, dir_fd=fd)
                os.rmdir(name, dir_fd=base)
                removed.append(name)
                log.info("heartbeat: removed %s, left on this node by an earlier job (nothing beats in it)", name)
            except OSError:   # another rank swept it first, or something of it is not ours to remove
                continue
            finally:
                os.close(fd)
    finally:
        os.close(base)
    return removed


def _left_behind(fd: int, before: float) -> bool:
    """Every file in the folder ``fd`` older than ``before`` and no rank or leader named in it running."""
    pids = [_read_leader(fd)[1]]
    for e in os.scandir(fd):
        st = e.stat(follow_symlinks=False)
        if st.st_mtime >= before:
            return False
        if e.name.startswith(RANK_PREFIX) and e.name.endswith(".json"):
            try:
                pids.append(msgspec.json.decode(read_bounded(Path(e.name), MAX_HEARTBEAT_BYTES, dir_fd=fd),
                                                type=HeartbeatRecord).pid)
            except (OSError, FileRejected, msgspec.DecodeError, ValueError):
                continue
    return not any(pid > 0 and _alive(pid) for pid in pids)


def _safe(text: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in text)[:64]


class NodeRelay:
    """One rank's side of the node's aggregation (module doc): its beat in the node-local folder,
    and, while it holds the folder's lock, the copy of every beat there into the shared folder."""

    LOCK = "lock"
    LEADER = "leader"
    PUBLISHED = "published"

    def __init__(self, node_dir: Path, *, shared_dir: Path, job_id: str, node: str, rank: int,
                 interval_s: float) -> None:
        self.folder_path = node_dir / f"omni-beats-{os.geteuid()}-{_safe(job_id)}-{_safe(node)}"
        self.folder: OwnDir = ensure_dir(self.folder_path, what="heartbeat node folder", private=True)
        sweep_left_behind(node_dir, keep=self.folder_path.name, node=node, interval_s=interval_s, now=time.time())
        self.node = node
        self.shared_dir = shared_dir
        self.name = f"{RANK_PREFIX}{rank}.json"
        self.interval_s = interval_s
        self.leader = False
        self.publishes = 0
        self.lines: NodeLines | None = None
        """The node's metrics lines, copied in every other pass of the beats: once per interval
        (``elastic/node_metrics.py``; set by ``MetricsLog``)."""
        self._lines_due = 0.0
        self._lock_fd = -1
        self._lock_gen = 0
        """The generation of the lock ``_lock_fd`` is open on (held while ``leader``)."""
        self.takeovers = 0
        self._published_at = 0.0
        self._beat_here = False
        """This rank's beat is in the folder: a folder removed after it was not the last rank's doing."""
        self._clear_stale(time.time())

    def _clear_stale(self, now: float) -> None:
        """Beats left in the node folder by processes that are gone and that nobody rewrote for 10
        intervals: ranks killed with their node in an earlier job of the same id on this node (a
        cluster whose job ids start over, /dev/shm kept). Left there, the leader would copy them as
        this job's. A rank stopped (SIGSTOP) is alive: its beat stays."""
        fd = self.folder.fd
        for entry in os.scandir(fd):
            if not (entry.name.startswith(RANK_PREFIX) and entry.name.endswith(".json")) or entry.name == self.name:
                continue
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < 10 * self.interval_s:
                    continue
                raw = read_bounded(Path(entry.name), MAX_HEARTBEAT_BYTES, dir_fd=fd)
                pid = msgspec.json.decode(raw, type=HeartbeatRecord).pid
            except (OSError, FileRejected, msgspec.DecodeError, ValueError):
                continue
            if not _alive(pid):
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass

    def _reopen_if_removed(self) -> None:
        """The node's last rank of a launch that ends removes the folder (``_remove_if_last``); a rank
        of the next launch on the same node may have opened it just before. A removed folder takes no
        new file (ENOENT), so open the folder at its path again (and leave the lead of the old one).
        Not once this rank's beat was in it: the last rank never removes a folder that holds a beat,
        so the job's end did (the plugin's epilog; on the embedded cluster's one /dev/shm, the other
        nodes' epilog removes the folder of a node whose slurmd died while its ranks still run), and a
        folder made again stays behind the rank when slurmd kills it (measured: omni-beats-0-J-node3
        with rank-1.json, leader, lock, published). FileNotFoundError: the rank writes its own file."""
        if os.fstat(self.folder.fd).st_nlink > 0:
            return
        if self._beat_here:
            raise FileNotFoundError(errno.ENOENT, "removed after this rank beat there (the job's end)",
                                    str(self.folder_path))
        self.close()
        self.folder.close()
        self.folder = ensure_dir(self.folder_path, what="heartbeat node folder", private=True)

    def beat(self, data: bytes, now: float, *, last: bool = False) -> float:
        """Write this rank's beat on the node (its last one: remove it, and hand the lead over); lead
        when possible. When a leader last published the node's beats (0: never; a leader: now)."""
        if not last:
            self._reopen_if_removed()
        fd = self.folder.fd
        if last:
            try:
                os.unlink(self.name, dir_fd=fd)
            except FileNotFoundError:
                pass
            if self.leader:
                self._lines_due = 0.0   # the last pass copies every line there is
                self.lead(now)
            self.close()
            self.remove_if_last()
            return 0.0
        write_atomic(Path(self.name), data, durable=False, dir_fd=fd)
        self._beat_here = True
        self.lead(now)
        if self.leader and self._published_at >= now:
            return self._published_at
        try:
            return os.stat(self.PUBLISHED, dir_fd=fd, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return 0.0

    def lead(self, now: float) -> None:
        """Take the node's lead when it is free, or over from a stopped or gone leader when the node's
        copy is late (module doc); as the leader, publish the node's beats."""
        fd = self.folder.fd
        gen, pid = _read_leader(fd)
        if self.leader and gen > self._lock_gen:   # taken over while this rank was stopped: step down
            self.close()
        if not self.leader:
            if not self._take(gen):
                try:
                    late = now - os.stat(self.PUBLISHED, dir_fd=fd, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    late = math.inf
                # no leader named yet (pid 0): the lock's holder is between its lock and its name
                if late <= 1.5 * self.interval_s or pid <= 0 or _running(pid) or not self._take(gen + 1):
                    return
                self.takeovers += 1
                log.info("heartbeat: node %s's leader (pid %d) is stopped or gone and its copy %.1f s late: "
                         "this rank leads", self.node, pid, late)
            if _read_leader(fd)[0] > self._lock_gen:   # taken over meanwhile: do not hide the newer lead
                self.close()
                return
            write_atomic(Path(self.LEADER), b"%d %d" % (self._lock_gen, os.getpid()), durable=False, dir_fd=fd)
        try:
            self.publish(now)
        except OSError as e:   # a flaky shared disk: the node's copy is late, the manager sees it
            log.warning("heartbeat: couldn't publish the node's beats in %s: %s", self.shared_dir, e)

    def _take(self, gen: int) -> bool:
        """This rank holds generation ``gen``'s lock now (``leader``), or it is held."""
        if self._lock_fd >= 0 and self._lock_gen != gen:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._lock_fd < 0:
            self._lock_fd = os.open(_lock_name(gen), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                    dir_fd=self.folder.fd)
            self._lock_gen = gen
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.leader = True
        return True

    def publish(self, now: float) -> int:
        """Copy the node's beats of the newest life into ``node-<NODE>.jsonl``; the number copied."""
        fd = self.folder.fd
        found: list[tuple[int, bytes]] = []
        for entry in os.scandir(fd):
            if not (entry.name.startswith(RANK_PREFIX) and entry.name.endswith(".json")):
                continue
            try:
                raw = read_bounded(Path(entry.name), MAX_HEARTBEAT_BYTES, dir_fd=fd)
                found.append((msgspec.json.decode(raw, type=HeartbeatRecord).incarnation, raw))
            except (FileRejected, msgspec.DecodeError, ValueError):
                continue   # replaced or removed meanwhile, or not a beat: the readers would refuse it
        newest = max((life for life, _ in found), default=0)
        beats = [raw.strip() for life, raw in found if life == newest][:MAX_RANKS_PER_NODE]
        if beats:
            data = b"".join([encode(NodeHeader(node=self.node, time=now)), *(raw + b"\n" for raw in beats)])
            write_atomic(self.shared_dir / node_file_name(self.node), data, durable=False)
        write_atomic(Path(self.PUBLISHED), b"%.3f" % now, durable=False, dir_fd=fd)
        self._published_at = time.time()
        self.publishes += 1
        if self.lines is not None and now >= self._lines_due:
            # once per interval (every other pass): a pass of the lines costs the shared file
            # system a write, whatever the ranks on the node
            self._lines_due = now + 0.75 * self.interval_s
            try:
                self.lines.copy()
            except (OSError, NotOwnedError) as e:   # the beats are published; the lines wait for the next pass
                log.warning("heartbeat: couldn't copy the node's metrics lines: %s", e)
        return len(beats)

    def remove_if_last(self) -> None:
        """The node's last rank of the job leaves no folder behind (``/dev/shm`` is memory); a rank's
        metrics lines not copied yet keep it."""
        fd = self.folder.fd
        if fd < 0 or any(e.name.startswith(RANK_PREFIX) for e in os.scandir(fd)) or not no_lines_left(fd):
            return
        try:
            names = [self.PUBLISHED, self.LEADER, COPIED,
                     *(e.name for e in os.scandir(fd) if e.name == self.LOCK or e.name.startswith("lock-"))]
            for name in names:
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
            os.rmdir(self.folder.path)
        except OSError:
            pass   # another rank came meanwhile, or left first: it is theirs to remove

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)   # releases the lead
            self._lock_fd = -1
        self.leader = False


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The script's metrics as the heartbeat carries them: finite numbers, short names, a few."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if len(out) == MAX_METRICS:
            break
        if isinstance(value, bool) or not isinstance(key, str) or not 0 < len(key) <= 32:
            continue
        if hasattr(value, "item"):   # a one-element tensor or numpy number
            value = value.item()
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
            out[key] = value
    return out
