"""Metrics lines per node, not per rank (issue 19): the node's ranks append to the node-local folder
their heartbeats share (``elastic/heartbeat.py`` ``NodeRelay``), and the rank holding that folder's
lock appends the new lines to one file per node on the shared file system in the pass it already
makes for the beats, every other pass: once per heartbeat interval.

In the node folder (``<node dir>/omni-beats-<uid>-<job>-<node>/``, 0700, ours, checked by its
descriptor):

- ``lines-<RANK>-<PID>-<N>.jsonl``: one rank's lines (N: 0, or more once a leader removed one), append only; each line names its file in the metrics
  folder (``"file": "metrics-<stage>-<dp_rank>.jsonl"``, formats/metrics.py), so that the copy needs
  no other record of whose it is;
- ``lines-copied``: ``<name> <inode> <offset>`` a line, how far the leaders copied each,
  replaced atomically after every copy that moved one.

In the metrics folder: ``node-<NODE>.jsonl``, the lines of every rank that ran on the node, appended
whole lines at a time. A leader killed after its append and before it recorded the offsets leaves
lines the next leader appends again; one killed inside its write may leave a torn line, which the
next append starts a new line after. The readers (``formats.metrics.read_folder``) skip a line that
is not JSON in a node file and count a line that appears twice (the same bytes) once: no line is
lost or counted twice across leader changes, crashes and relaunches.

The rank that reports the job's loss (replica 0 of the last stage, ``Layout.reports_loss``; the
drills and ``omni report`` read its line of every step, ``drill.history.loss_file``) keeps appending
to its own ``metrics-<stage>-<dp_rank>.jsonl`` and has no file on the node (``NodeLines(own=False)``):
a lost node takes with it only other ranks' lines, never a step of the loss. As the node's leader it
copies the others' lines like any rank.

A rank that ends (``close``) appends what the leader had not copied yet of its own lines to its own
``metrics-<stage>-<dp_rank>.jsonl``, as every rank did before, so that its last lines do not wait on
a leader that may be ending too; the leader may copy them as well (counted once). Lines of a rank
killed (its process gone) stay in the node folder for the next leader of the job on the node, which
removes a dead rank's file once it copied all of it and nobody wrote it for a minute. A node lost
loses with its memory the lines of its other ranks that its leader had not copied yet: at most one
heartbeat interval's (docs/in-allocation.md, "Scale").
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.ownership import NotOwnedError, OwnDir

log = logging.getLogger(__name__)

SOURCE_PREFIX = "lines-"
SOURCE_SUFFIX = ".jsonl"
COPIED = "lines-copied"
MAX_COPY_BYTES = 4 << 20
"""At most this much of one rank's lines per pass (the rest the next pass)."""
MAX_COPIED_BYTES = 1 << 20
DEAD_AFTER_S = 60.0
"""A rank's file is removed once all of it is copied, its process is gone and it was not written for
this long (a process in another pid namespace looks gone; its rank also opens a new file when its
own was removed, ``append``)."""


def source_name(rank: int, pid: int, generation: int = 0) -> str:
    return f"{SOURCE_PREFIX}{rank}-{pid}-{generation}{SOURCE_SUFFIX}"


def _pid_of(name: str) -> int | None:
    """The process of a rank's lines (``lines-<RANK>-<PID>-<N>.jsonl``); None for any other name."""
    if not (name.startswith(SOURCE_PREFIX) and name.endswith(SOURCE_SUFFIX)):
        return None
    parts = name[len(SOURCE_PREFIX):-len(SOURCE_SUFFIX)].split("-")
    return int(parts[1]) if len(parts) == 3 and all(p.isdigit() for p in parts) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):   # gone, or another user's process has the number now
        return False
    return True


def read_copied(folder_fd: int) -> dict[str, tuple[int, int]]:
    """How far the node's leaders copied each rank's file: name -> (its inode, the offset), from
    ``<name> <inode> <offset>`` lines (empty when none or unreadable: copy from 0 again, the readers
    count a repeated line once). A file of the same name but another inode starts at 0."""
    try:
        raw = read_bounded(Path(COPIED), MAX_COPIED_BYTES, dir_fd=folder_fd)
    except (OSError, FileRejected):
        return {}
    out: dict[str, tuple[int, int]] = {}
    for line in raw.decode("ascii", "replace").splitlines():
        name, ino, offset = (line.split(" ") + ["", ""])[:3]
        if _pid_of(name) is not None and ino.isdigit() and offset.isdigit():
            out[name] = (int(ino), int(offset))
    return out


def _copied_text(copied: dict[str, tuple[int, int]]) -> bytes:
    return "".join(f"{name} {ino} {offset}\n" for name, (ino, offset) in sorted(copied.items())).encode()


def _start(copied: dict[str, tuple[int, int]], name: str, st: os.stat_result) -> int:
    ino, offset = copied.get(name, (-1, 0))
    return offset if ino == st.st_ino and offset <= st.st_size else 0


def _open_source(folder_fd: int, name: str, flags: int) -> int:
    """A rank's lines in the node folder: never through a link, a regular file of ours."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=folder_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise NotOwnedError(f"couldn't use {name} in the node folder: not a regular file of uid {os.geteuid()}")
    os.set_blocking(fd, True)
    return fd


def _whole_lines(fd: int, start: int, size: int) -> bytes:
    """``[start, size)`` of ``fd`` up to its last newline (a line being written is left for later)."""
    data = os.pread(fd, min(size - start, MAX_COPY_BYTES), start)
    return data[:data.rfind(b"\n") + 1]


class NodeLines:
    """The node folder's metrics lines: a rank's own file (``append``, ``close``) and the leader's copy
    (``copy``) into ``node-<NODE>.jsonl`` of the metrics folder (module doc)."""

    def __init__(self, folder: OwnDir, *, metrics: OwnDir, node_file: str, rank: int, own: bool = True) -> None:
        """``folder`` and ``metrics``: held open by the caller (the node folder's descriptor outlives a
        reopen of it by the heartbeat: this rank's file keeps it from being removed). ``own``: this
        rank's lines go through the node (False: the loss-reporting rank's go straight to its own file;
        it only copies the others' when it leads, module doc)."""
        self.folder = folder
        self.metrics = metrics
        self.node_file = node_file
        self.rank = rank
        self.generation = 0
        self.name = source_name(rank, os.getpid())
        self.own = own
        self._fd = _open_source(folder.fd, self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if own else -1
        self._out = -1
        self.copies = 0

    def append(self, line: bytes) -> None:
        """One line (newline included) in this rank's file on the node (a new file when a leader took
        this one for a dead rank's: everything in it was copied)."""
        if not self.own:
            raise ValueError(f"rank {self.rank} writes its lines to its own file, not on the node")
        if os.fstat(self._fd).st_nlink == 0:
            os.close(self._fd)
            self.generation += 1   # a new name: the leaders' record of the old one is not about it
            self.name = source_name(self.rank, os.getpid(), self.generation)
            self._fd = _open_source(self.folder.fd, self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        _write_all(self._fd, line)

    def copy(self) -> int:
        """As the node's leader: append every rank's new lines to the node's file in the metrics
        folder; the bytes appended."""
        fd = self.folder.fd
        copied = read_copied(fd)
        done: dict[str, tuple[int, int]] = {}
        chunks: list[bytes] = []
        finished: list[str] = []
        for entry in os.scandir(fd):
            pid = _pid_of(entry.name)
            if pid is None:
                continue
            try:
                src = _open_source(fd, entry.name, os.O_RDONLY)
            except (OSError, NotOwnedError):
                continue   # removed meanwhile (its rank ended), or not ours: never copied
            try:
                st = os.fstat(src)
                size = st.st_size
                start = _start(copied, entry.name, st)
                chunk = _whole_lines(src, start, size) if size > start else b""
            finally:
                os.close(src)
            done[entry.name] = (st.st_ino, start + len(chunk))
            if chunk:
                chunks.append(chunk)
            if start + len(chunk) == size and pid != os.getpid() and time.time() - st.st_mtime > DEAD_AFTER_S \
                    and not _alive(pid):
                finished.append(entry.name)
        if chunks:
            self._append_out(b"".join(chunks))
        if chunks or done != copied:
            write_atomic(Path(COPIED), _copied_text(done), durable=False, dir_fd=fd)
        for name in finished:   # a dead rank's lines, all copied: nothing left to keep
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
        self.copies += 1
        return sum(map(len, chunks))

    def _append_out(self, data: bytes) -> None:
        if self._out < 0:
            self._out = self.metrics.open_append(self.node_file, read=True)
        size = os.fstat(self._out).st_size
        if size and os.pread(self._out, 1, size - 1) != b"\n":
            data = b"\n" + data   # a leader killed inside its write left a torn line: start a new one
        _write_all(self._out, data)

    def close(self, out: int) -> None:
        """This rank ends: what no leader copied yet of its lines goes to ``out`` (its own
        ``metrics-<stage>-<dp_rank>.jsonl``, open for appending) (a leader may copy it too: the readers count it once), then its file on the node is
        removed. A rank that leads copies first (``copy``), so usually nothing is left."""
        if not self.own:
            self.detach()
            return
        try:
            st = os.fstat(self._fd)
            start, size = _start(read_copied(self.folder.fd), self.name, st), st.st_size
            src = _open_source(self.folder.fd, self.name, os.O_RDONLY)
            try:
                rest = b""
                while start + len(rest) < size:
                    chunk = os.pread(src, size - start - len(rest), start + len(rest))
                    if not chunk:
                        break
                    rest += chunk
            finally:
                os.close(src)
            rest = rest[:rest.rfind(b"\n") + 1]
            if rest:
                _write_all(out, rest)
            os.unlink(self.name, dir_fd=self.folder.fd)
        finally:
            os.close(self._fd)
            self._fd = -1
            self.detach()

    def detach(self) -> None:
        if self._out >= 0:
            os.close(self._out)
            self._out = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def no_lines_left(folder_fd: int) -> bool:
    """No rank's lines in the node folder (then its last rank may remove it, ``lines-copied`` too)."""
    return not any(_pid_of(e.name) is not None for e in os.scandir(folder_fd))
