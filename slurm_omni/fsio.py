"""Atomic writes and bounded reads: the one place files are replaced and untrusted files are read.

``write_atomic`` writes a temporary dot file beside the target (created ``O_EXCL | O_NOFOLLOW`` with
the given mode, so neither a planted file nor a symlink is written through), optionally fsyncs it,
renames it over the target and fsyncs the directory: a reader sees the old file or the whole new
one, never half of it. ``read_bounded`` reads a file another process wrote: no symlinks, regular
files only, at most ``limit`` bytes, so a fifo, a device or a 10 GiB file cannot stall or exhaust the
reader. ``read_text`` adds one clear error for bytes that are not UTF-8.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from pathlib import Path

from slurm_omni.errors import OmniError

PARTIAL = ".partial"
"""Suffix of the temporary files ``write_atomic`` leaves only if killed mid-write."""


class FileRejected(OmniError):
    """A file is missing, too big, not a regular file, a symlink, or not text."""


def one_line(text: str, limit: int = 300) -> str:
    """``text`` as one printable line of at most ``limit`` characters (for messages that quote
    untrusted names and values: a newline in a file name must not forge a second log line)."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return out if len(out) <= limit else out[:limit] + "..."


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o600, durable: bool = True,
                 owner: str = "", dir_fd: int | None = None) -> Path:
    """Replace ``path`` with ``data`` at once. ``durable`` fsyncs the file and its directory before
    returning; ``mode`` is set exactly (not through the umask). ``owner`` (an incarnation, a host)
    goes into the temporary name, for whoever finds a partial file after a crash. ``dir_fd``: an open
    directory that ``path.name`` is written in, wherever that directory is now (a folder renamed since
    it was opened gets the file, never a folder that took its old name)."""
    raw = data.encode() if isinstance(data, str) else data
    tag = f".{_name_piece(owner)}" if owner else ""
    # pids repeat across nodes sharing a folder and threads share a pid: a random part as well
    tmp = path.with_name(f".{path.name}{tag}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{PARTIAL}")
    src, dst = (tmp.name, path.name) if dir_fd is not None else (str(tmp), str(path))
    fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o777,
                 dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode & 0o777)
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(src, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    if durable:
        if dir_fd is not None:
            os.fsync(dir_fd)
        else:
            fsync_dir(path.parent)
    return path


def _name_piece(text: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in text)[:64]


def read_bounded(path: Path, limit: int, *, what: str = "", follow: bool = False, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; a symlink (unless
    ``follow``: a path a user named on the command line), a fifo, a folder or a larger file is a
    ``FileRejected`` naming ``what`` (default: the file's name). ``dir_fd``: ``path``'s name is read
    in that (checked) folder."""
    try:
        fd = os.open(path.name if dir_fd is not None else path,
                     os.O_RDONLY | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError as e:
        raise FileRejected(f"couldn't read {one_line(what or path.name)}: no such file") from e
    except OSError as e:
        hint = " (a symlink is not followed)" if e.errno == errno.ELOOP else ""
        raise FileRejected(f"couldn't open {one_line(what or path.name)}: {e.strerror}{hint}") from e
    what = what or path.name   # made one line when it is said (every read passes here: no cost then)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRejected(f"couldn't read {one_line(what)}: not a regular file")
        if st.st_size > limit:
            raise FileRejected(f"couldn't read {one_line(what)}: {st.st_size} bytes (limit {limit})")
        chunks, size = [], 0
        want = min(limit, st.st_size) + 1   # its size, not the limit: a buffer of the limit costs a 1 MiB read
        while size <= limit:
            chunk = os.read(fd, want)
            chunks.append(chunk)
            size += len(chunk)
            if len(chunk) < want:   # a regular file's short read is its end: no second read for it
                break
            want = limit + 1 - size   # it grew after fstat: read on up to the limit
        if size > limit:   # it grew after fstat
            raise FileRejected(f"couldn't read {one_line(what)}: more than {limit} bytes (limit {limit})")
        return b"".join(chunks)
    except OSError as e:
        raise FileRejected(f"couldn't read {one_line(what)}: {e.strerror}") from e
    finally:
        os.close(fd)


def read_tail(path: Path, limit: int, *, start: int = 0, what: str = "") -> str:
    """The last ``limit`` bytes of the regular file ``path`` from offset ``start`` on (a log that
    grows: a launch's output), decoded with undecodable bytes replaced; a symlink, fifo or folder is
    a ``FileRejected``."""
    what = one_line(what or path.name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise FileRejected(f"couldn't read {what}: no such file") from e
    except OSError as e:
        raise FileRejected(f"couldn't open {what}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRejected(f"couldn't read {what}: not a regular file")
        begin = max(start, st.st_size - limit, 0)
        return os.pread(fd, max(0, st.st_size - begin), begin).decode("utf-8", errors="replace")
    except OSError as e:
        raise FileRejected(f"couldn't read {what}: {e.strerror}") from e
    finally:
        os.close(fd)


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileRejected(f"couldn't read {what}: byte {e.start} is not UTF-8 (expected UTF-8 text)") from e


def read_text(path: Path, limit: int, *, what: str = "", follow: bool = False) -> str:
    """``read_bounded`` decoded as UTF-8, with one clear error for anything else."""
    what = what or path.name
    return decode_utf8(read_bounded(path, limit, what=what, follow=follow), what)
