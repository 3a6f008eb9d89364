"""The light rank's node aggregation (``bench/light_rank.py`` with OMNI_HEARTBEAT_NODE_DIR), as
``slurm_omni.elastic.heartbeat.NodeRelay`` does it: C modules of the standard library only, imported
by the light rank when the job asks for it."""

from __future__ import annotations

import _json
import fcntl
import os
import sys
import time


class Relay:
    """The node's aggregation, as ``slurm_omni.elastic.heartbeat.NodeRelay`` does it: this rank's beat
    in ``<node dir>/omni-beats-<uid>-<job>-<node>/`` (0700 and ours, checked by its descriptor), and,
    while it holds that folder's lock, the copy of the node's beats of the newest life into the
    shared ``node-<NODE>.jsonl``."""

    def __init__(self, fd: int, path: str, node: str, name: str, shared: str, interval: float) -> None:
        self.fd, self.path, self.node, self.name, self.shared, self.interval = fd, path, node, name, shared, interval
        self.lock_fd = -1
        self.leader = False
        self.next_publish = 0.0
        self.published_at = 0.0

    @classmethod
    def open(cls, base: str, job_id: str, node: str, rank: int, shared: str, interval: float) -> Relay | None:
        if not base or not node:
            return None
        path = os.path.join(base, f"omni-beats-{os.geteuid()}-{_safe(job_id)}-{_safe(node)}")
        try:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                os.close(fd)
                raise OSError(f"{path} is not ours and 0700 (uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
        except OSError as e:
            print(f"light rank: couldn't aggregate on the node ({e}); writing its own file", file=sys.stderr, flush=True)
            return None
        return cls(fd, path, node, f"rank-{rank}.json", shared, interval)

    def beat(self, data: bytes, now: float, *, last: bool = False) -> float:
        """This rank's beat on the node (the last one: removed, the lead handed over); when a leader
        last published (0: never)."""
        if last:
            try:
                os.unlink(self.name, dir_fd=self.fd)
            except FileNotFoundError:
                pass
            if self.leader:
                self.next_publish = 0.0
                self.lead(now)
                os.close(self.lock_fd)
                self.leader = False
            if not any(e.name.startswith("rank-") for e in os.scandir(self.fd)):   # the node's last: no folder left
                try:
                    for name in ("published", "lock"):
                        os.unlink(name, dir_fd=self.fd)
                    os.rmdir(self.path)
                except OSError:
                    pass
            return 0.0
        _write_atomic(self.name, data, dir_fd=self.fd)
        self.next_publish = 0.0
        self.lead(now)
        if self.leader and self.published_at >= now:
            return self.published_at
        try:
            return os.stat("published", dir_fd=self.fd, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return 0.0

    def lead(self, now: float) -> None:
        if not self.leader:
            if self.lock_fd < 0:
                self.lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                       dir_fd=self.fd)
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            self.leader = True
        if now < self.next_publish:
            return
        self.next_publish = now + self.interval / 2
        try:
            self.publish(now)
        except OSError as e:
            print(f"light rank: couldn't publish the node's beats: {e}", file=sys.stderr, flush=True)

    def publish(self, now: float) -> None:
        found = []
        for entry in os.scandir(self.fd):
            if not (entry.name.startswith("rank-") and entry.name.endswith(".json")):
                continue
            try:
                fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
            except OSError:
                continue   # replaced or removed meanwhile
            try:
                raw = os.read(fd, 4097).strip()
            finally:
                os.close(fd)
            at = raw.find(b'"incarnation":')
            digits = raw[at + 14:at + 34].split(b",")[0] if at >= 0 else b""
            if len(raw) <= 4096 and raw.startswith(b"{") and raw.endswith(b"}") and b"\n" not in raw \
                    and digits.isdigit():
                found.append((int(digits), raw))
        newest = max((life for life, _ in found), default=0)
        beats = [raw for life, raw in found if life == newest][:256]
        if beats:
            header = b'{"node":%s,"time":%s}\n' % (_json.encode_basestring_ascii(self.node).encode(), repr(now).encode())
            data = header + b"".join(raw + b"\n" for raw in beats)
            _write_atomic(os.path.join(self.shared, f"node-{_safe(self.node, 200)}.jsonl"), data)
        _write_atomic("published", repr(now).encode(), dir_fd=self.fd)
        self.published_at = time.time()


def _safe(text: str, limit: int = 64) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in text)[:limit]


def _write_atomic(path: str, data: bytes, *, dir_fd: int | None = None) -> None:
    """As the light rank's: a temporary name in the same folder (``dir_fd``: an open one), then a rename."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
