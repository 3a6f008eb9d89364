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
        self.lock_gen = 0
        self.takeovers = 0
        self.leader = False
        self.next_publish = 0.0
        self.published_at = 0.0
        self.lines_fd = -1
        """This rank's metrics lines on the node (``lines-<RANK>-<PID>-0.jsonl``, append only), copied by
        the leader into ``<metrics>/node-<NODE>.jsonl`` (``slurm_omni.elastic.node_metrics``)."""
        self.lines_name = ""
        self.metrics_fd = -1
        self.out_fd = -1
        self.lines_due = 0.0
        self.beat_here = False
        """This rank's beat is in the folder: a folder removed after it was the job's end's doing."""

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

    def reopen_if_removed(self) -> None:
        """The node's last rank of a life that ends removes the folder (``remove_if_last``); a rank of
        the next life on the same node may have opened it just before (between its open and its first
        beat: seconds at load 1,000+, issue 19). A removed folder takes no new file (ENOENT), so open
        the folder at its path again and leave the lead of the old one, as
        ``slurm_omni.elastic.heartbeat.NodeRelay._reopen_if_removed`` does."""
        if os.fstat(self.fd).st_nlink > 0:
            return
        if self.beat_here:   # the job's end removed it (NodeRelay._reopen_if_removed): its own file
            raise FileNotFoundError(f"{self.path} was removed after this rank beat there (the job's end)")
        if self.lock_fd >= 0:
            os.close(self.lock_fd)   # releases the lead of the removed folder
            self.lock_fd = -1
        self.leader = False
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise OSError(f"{self.path} is not ours and 0700 (uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
        os.close(self.fd)
        self.fd = fd
        print(f"light rank: the node folder {self.path} was removed under this rank (the life before's last rank "
              "left): opened again", file=sys.stderr, flush=True)

    def beat(self, data: bytes, now: float, *, last: bool = False) -> float:
        """This rank's beat on the node (the last one: removed, the lead handed over); when a leader
        last published (0: never)."""
        if not last:
            self.reopen_if_removed()
        if last:
            try:
                os.unlink(self.name, dir_fd=self.fd)
            except FileNotFoundError:
                pass
            if self.leader:
                self.next_publish = self.lines_due = 0.0   # the last pass copies every line there is
                self.lead(now)
                os.close(self.lock_fd)
                self.lock_fd = -1
                self.leader = False
            self.remove_if_last()
            return 0.0
        _write_atomic(self.name, data, dir_fd=self.fd)
        self.beat_here = True
        self.next_publish = 0.0
        self.lead(now)
        if self.leader and self.published_at >= now:
            return self.published_at
        try:
            return os.stat("published", dir_fd=self.fd, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return 0.0

    # -- the node's probe of rank 0's store (the rendezvous, light_rank.Rank.agree) -----------------
    def probe_open(self, incarnation: int) -> tuple[int, str]:
        """The node's probe lock of this life: while rank 0's store is not listening, one rank of the
        node at a time tries it (the lock's holder), the others wait for it to get through and then
        try all at once."""
        name = f"rendezvous-{incarnation}.lock"
        return os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd), name

    def probe_take(self, fd: int) -> bool:
        """This rank tries for the node when the lock is free."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def probe_free(self, fd: int) -> bool:
        """The node's prober got through or is gone (the C rank waits in flock; this reference asks
        every 20 ms)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def probe_done(self, fd: int, name: str, *, holding: bool) -> None:
        """Through: the ranks waiting go now; the prober leaves no file."""
        if holding:
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                pass
        os.close(fd)

    def lead(self, now: float) -> None:
        """Lead when the lock is free, or over from a stopped or gone leader (``leader``: its generation
        and pid) when the node's copy is 1.5 intervals late, with the next generation's lock; a leader
        that sees a newer generation steps down (``slurm_omni.elastic.heartbeat.NodeRelay.lead``)."""
        gen, pid = _read_leader(self.fd)
        if self.leader and gen > self.lock_gen:   # taken over while this rank was stopped
            os.close(self.lock_fd)
            self.lock_fd = -1
            self.leader = False
        if not self.leader:
            if not self.take(gen):
                try:
                    late = now - os.stat("published", dir_fd=self.fd, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    late = float("inf")
                # no leader named yet (pid 0): the lock's holder is between its lock and its name
                if late <= 1.5 * self.interval or pid <= 0 or _running(pid) or not self.take(gen + 1):
                    return
                self.takeovers += 1
                print(f"light rank: the node's leader (pid {pid}) is stopped or gone and its copy {late:.1f} s late: "
                      "this rank leads", file=sys.stderr, flush=True)
            if _read_leader(self.fd)[0] > self.lock_gen:   # taken over meanwhile: do not hide the newer lead
                os.close(self.lock_fd)
                self.lock_fd = -1
                self.leader = False
                return
            _write_atomic("leader", b"%d %d" % (self.lock_gen, os.getpid()), dir_fd=self.fd)
            self.next_publish = 0.0
        if now < self.next_publish:
            return
        self.next_publish = now + self.interval / 2
        try:
            self.publish(now)
        except OSError as e:
            print(f"light rank: couldn't publish the node's beats: {e}", file=sys.stderr, flush=True)

    def take(self, gen: int) -> bool:
        """This rank holds generation ``gen``'s lock now (the leader), or it is held."""
        if self.lock_fd >= 0 and self.lock_gen != gen:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.lock_fd < 0:
            self.lock_fd = os.open("lock" if gen <= 0 else f"lock-{gen}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                                   | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
            self.lock_gen = gen
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.leader = True
        return True

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
        if self.metrics_fd >= 0 and now >= self.lines_due:   # once per interval: every other pass
            self.lines_due = now + 0.75 * self.interval
            try:
                self.copy_lines()
            except OSError as e:   # the beats are published; the lines wait for the next pass
                print(f"light rank: couldn't copy the node's metrics lines: {e}", file=sys.stderr, flush=True)

    def remove_if_last(self) -> None:
        """The node's last rank leaves no folder (a rank's lines not copied yet keep it)."""
        if any(e.name.startswith(("rank-", "lines-")) and e.name != "lines-copied" for e in os.scandir(self.fd)):
            return
        try:
            for name in ["published", "leader", "lines-copied",
                         *(e.name for e in os.scandir(self.fd) if e.name == "lock" or e.name.startswith("lock-"))]:
                try:
                    os.unlink(name, dir_fd=self.fd)
                except FileNotFoundError:
                    pass
            os.rmdir(self.path)
        except OSError:
            pass

    # -- metrics lines per node, as slurm_omni.elastic.node_metrics ---------------------------------
    def open_lines(self, metrics_dir: str, rank: int, *, own: bool = True) -> bool:
        """The node's lines copied by this rank when it leads, and with ``own`` this rank's lines go to
        the node (False: the folder is not usable, the caller appends them)."""
        try:
            self.metrics_fd = os.open(metrics_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if own:
                self.lines_name = f"lines-{rank}-{os.getpid()}-0.jsonl"
                self.lines_fd = _open_file(self.lines_name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.fd)
        except OSError as e:
            print(f"light rank: couldn't write metrics on the node ({e}); appending its own file", file=sys.stderr,
                  flush=True)
            return False
        return True

    def append_line(self, data: bytes) -> None:
        _write_all(self.lines_fd, data)

    def copy_lines(self) -> None:
        """As the leader: every rank's new lines appended to the node's file, then the offsets."""
        copied = _read_copied(self.fd)
        done, chunks, finished = {}, [], []
        for entry in os.scandir(self.fd):
            pid = _pid_of(entry.name)
            if pid is None:
                continue
            try:
                src = _open_file(entry.name, os.O_RDONLY, self.fd)
            except OSError:
                continue
            try:
                st = os.fstat(src)
                size = st.st_size
                ino, start = copied.get(entry.name, (-1, 0))
                start = start if ino == st.st_ino and start <= size else 0
                data = os.pread(src, min(size - start, 4 << 20), start) if size > start else b""
            finally:
                os.close(src)
            chunk = data[:data.rfind(b"\n") + 1]
            done[entry.name] = (st.st_ino, start + len(chunk))
            if chunk:
                chunks.append(chunk)
            if start + len(chunk) == size and pid != os.getpid() and time.time() - st.st_mtime > 60 and not _alive(pid):
                finished.append(entry.name)
        if chunks:
            if self.out_fd < 0:
                self.out_fd = _open_file(f"node-{_safe(self.node, 200)}.jsonl",
                                         os.O_RDWR | os.O_APPEND | os.O_CREAT, self.metrics_fd, 0o644)
            out = b"".join(chunks)
            size = os.fstat(self.out_fd).st_size
            if size and os.pread(self.out_fd, 1, size - 1) != b"\n":
                out = b"\n" + out   # a leader killed inside its write left a torn line
            _write_all(self.out_fd, out)
        if chunks or done != copied:
            _write_atomic("lines-copied", "".join(f"{k} {i} {v}\n" for k, (i, v) in sorted(done.items())).encode(),
                          dir_fd=self.fd)
        for name in finished:
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                pass

    def close_lines(self, own_fd: int) -> None:
        """This rank ends: what no leader copied of its lines to its own file (open for appending),
        its file on the node removed (the loss rank has none: it only copied the others')."""
        try:
            if self.lines_fd >= 0:
                self._rest_to(own_fd)
        except OSError as e:   # its lines stay on the node for the next leader
            print(f"light rank: couldn't finish its metrics lines on the node: {e}", file=sys.stderr, flush=True)
        finally:
            for fd in (self.lines_fd, self.out_fd, self.metrics_fd):
                if fd >= 0:
                    os.close(fd)
            self.lines_fd = self.out_fd = self.metrics_fd = -1
        self.remove_if_last()

    def _rest_to(self, own_fd: int) -> None:
        st = os.fstat(self.lines_fd)
        ino, start = _read_copied(self.fd).get(self.lines_name, (-1, 0))
        size = st.st_size
        start = start if ino == st.st_ino and start <= size else 0
        src = _open_file(self.lines_name, os.O_RDONLY, self.fd)
        try:
            rest = os.pread(src, max(0, size - start), start) if size > start else b""
        finally:
            os.close(src)
        rest = rest[:rest.rfind(b"\n") + 1]
        if rest:
            _write_all(own_fd, rest)
        os.unlink(self.lines_name, dir_fd=self.fd)


def _pid_of(name: str) -> int | None:
    if not (name.startswith("lines-") and name.endswith(".jsonl")):
        return None
    parts = name[6:-6].split("-")
    return int(parts[1]) if len(parts) == 3 and all(p.isdigit() for p in parts) else None


# _read_leader and _running copy slurm_omni/elastic/heartbeat.py's on purpose: this module runs under
# ``python -S`` on C modules only (no site-packages, no slurm_omni; the rank's start-up at 2,048 ranks
# per host), and bench/light_relay.c has the third copy; the light-rank and node-heartbeat tests hold
# the three to one takeover rule.
def _read_leader(dir_fd: int) -> tuple[int, int]:
    """The node's lead (``leader``: generation and pid); (0, 0) when none wrote it."""
    try:
        fd = os.open("leader", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return 0, 0
    try:
        parts = os.read(fd, 64).split()
    finally:
        os.close(fd)
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return 0, 0
    return int(parts[0]), int(parts[1])


def _running(pid: int) -> bool:
    """Runs or waits (D state too): not stopped, gone or a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"T", b"t", b"Z", b"X", b"")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _read_copied(dir_fd: int) -> dict[str, int]:
    try:
        fd = os.open("lines-copied", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return {}
    try:
        raw = os.read(fd, 1 << 20)
    finally:
        os.close(fd)
    out = {}
    for line in raw.decode("ascii", "replace").splitlines():
        name, ino, offset = (line.split(" ") + ["", ""])[:3]
        if _pid_of(name) is not None and ino.isdigit() and offset.isdigit():
            out[name] = (int(ino), int(offset))
    return out


def _open_file(name: str, flags: int, dir_fd: int, mode: int = 0o600) -> int:
    """A regular file of ours in an open folder, never through a link."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or (st.st_mode & 0o170000) != 0o100000:
        os.close(fd)
        raise OSError(f"{name} is not a regular file of uid {os.geteuid()}")
    os.set_blocking(fd, True)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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
