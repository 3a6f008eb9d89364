"""Folders a user's job and manager trust: their own, and writable by nobody else. The one check.

Every folder a job or its manager writes or trusts (checkpoints, heartbeats, metrics, the registry,
the spool, the warm standbys' sockets) goes through this module (docs/deployment.md, the threat
model). Whoever can create, replace or write a folder there first could read the weights, plant a
``FENCE``, fake heartbeats, point a metrics file at ``job.toml`` or answer for a standby, so:

- a folder is opened, never trusted by path: ``open(O_DIRECTORY | O_NOFOLLOW)`` relative to its
  parent's descriptor, then ``fstat`` on the descriptor: a directory, owned by the effective uid,
  no group or other write (``private``: no group or other access at all). A caller that writes into
  it keeps the descriptor (``OwnDir``) and opens its files relative to it, so a path swapped after
  the check leads nowhere;
- the folder it sits in must be ours or root's, and nobody else may write to it unless it is
  sticky (``/tmp``, a 1777 site root), else whoever can write it could swap our folder for theirs;
- folders made here are made with ``mkdirat`` (0700, or the mode asked) and checked the same way;
- files in them are opened ``O_NOFOLLOW`` and, when appended to, checked by ``fstat`` (``open_append``).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path
from typing import Self

from slurm_omni.errors import OmniError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class NotOwnedError(OmniError):
    """A folder the job or manager would use belongs to someone else or others can write to it: no
    restart can fix that (a rank exits 78, EX_CONFIG, as for other bad input)."""

    exit_code = 78


def current_user() -> str:
    """The effective user's name (the uid as text when it has no passwd entry)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _kind(st: os.stat_result) -> str:
    return "a directory" if stat.S_ISDIR(st.st_mode) else "a link" if stat.S_ISLNK(st.st_mode) else "not a directory"


def _refuse(what: str, path: Path | str, st: os.stat_result, expected: str, fix: str) -> NotOwnedError:
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    return NotOwnedError(f"{what}: couldn't use {path}: {_kind(st)} of uid {st.st_uid} with mode {mode:04o} "
                         f"(expected {expected.format(uid=uid)}; {fix})")


def check_fd(fd: int, path: Path | str, what: str, *, private: bool = False) -> os.stat_result:
    """The folder open on ``fd`` is ours and nobody else can write it (``private``: nor read it)."""
    st = os.fstat(fd)
    mask = 0o077 if private else 0o022
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & mask:
        expected = ("a directory of uid {uid} that only it can use" if private
                    else "a directory of uid {uid} that only it can write")
        raise _refuse(what, path, st, expected,
                      "someone else made it first: remove it or ask the admin to" if st.st_uid != os.geteuid()
                      else f"chmod {'700' if private else 'go-w'} it")
    return st


def _check_parent(fd: int, path: Path, what: str) -> None:
    """Nobody but us or root could have swapped a folder in ``path`` (sticky folders: only its owner)."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (0, os.geteuid()) or (mode & 0o022 and not mode & stat.S_ISVTX):
        raise _refuse(what, path, st, "a folder of root or uid {uid} that nobody else can write, or a sticky one",
                      "chmod go-w or +t it, or use another folder" if st.st_uid == os.geteuid()
                      else "someone else made it: ask the admin to remove it, or use another folder")


def _open_at(parent: int, name: str, path: Path, what: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as e:
        try:   # a link, a file, or a folder we may not open: say whose it is
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            raise NotOwnedError(f"{what}: couldn't use {path}: {e.strerror}") from e
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            raise NotOwnedError(f"{what}: couldn't use {path}: {e.strerror}") from e
        raise _refuse(what, path, st, "a directory of uid {uid}",
                      "someone else made it first: remove it or ask the admin to") from e


def _open_anchor(path: Path, what: str, *, create: bool) -> int:
    """``path`` (the site's folder, links followed), made when missing and ``create``."""
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NotOwnedError(f"{what}: couldn't create {path}: {e.strerror}") from e
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as e:
        raise NotOwnedError(f"{what}: couldn't use {path}: {e.strerror}") from e


class OwnDir:
    """A checked folder held open: create and open its files relative to ``fd``. Close it (or use
    ``with``) when done."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def proc_path(self, name: str = "") -> str:
        """A path that reaches ``name`` through the checked descriptor (for APIs that take only a
        path, such as ``bind``/``connect`` of a Unix socket): ``/proc/self/fd/N/name``."""
        return f"/proc/self/fd/{self.fd}" + (f"/{name}" if name else "")

    def open_append(self, name: str, mode: int = 0o644, *, read: bool = False) -> int:
        """``name`` in this folder for appending (``read``: and reading): created when missing, never
        through a link, and only a regular file of ours with one name (a hard link to another file of
        ours is refused)."""
        try:
            fd = os.open(name, (os.O_RDWR if read else os.O_WRONLY) | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         mode, dir_fd=self.fd)
        except OSError as e:
            raise NotOwnedError(f"couldn't open {self.path / name}: {e.strerror}"
                                + (" (a symlink is not followed)" if e.errno == errno.ELOOP else "")) from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise NotOwnedError(f"couldn't use {self.path / name}: expected a regular file of uid {os.geteuid()} "
                                f"with one name, found uid {st.st_uid} with {st.st_nlink} names")
        os.set_blocking(fd, True)
        return fd


def open_own_dir(path: Path, what: str = "folder", *, private: bool = False) -> OwnDir:
    """``path``, an existing folder of ours that nobody else can write (``private``: nor read),
    opened and checked by its descriptor; its parent must be one nobody else could swap it in."""
    parent = _open_anchor(path.parent, what, create=False)
    try:
        _check_parent(parent, path.parent, what)
        fd = _open_at(parent, path.name, path, what)
    finally:
        os.close(parent)
    try:
        check_fd(fd, path, what, private=private)
    except BaseException:
        os.close(fd)
        raise
    return OwnDir(fd, path)


def check_own_dir(path: Path, what: str = "folder", *, private: bool = False) -> Path:
    """``path`` is a directory (not a link) of ours that nobody else can write; else one line why."""
    open_own_dir(path, what, private=private).close()
    return path


def _tighten(fd: int) -> None:
    """A folder of ours that others may read but not write (an older release made it 0755): 0700.
    Nobody else could have put anything in it; what they could read is past."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022 and st.st_mode & 0o077:
        os.fchmod(fd, 0o700)


def ensure_dir(path: Path, *, below: Path | None = None, what: str = "folder", mode: int = 0o700,
               private: bool = False) -> OwnDir:
    """Make ``path`` and the folders between ``below`` and it (``mode`` each, 0700 by default),
    checking every one of them, found or made, by its descriptor; the last one held open.

    ``below`` is the site's (a checkpoint root, the registry's root): made when missing, not required
    to be ours, but one nobody else could swap a folder in. Without it: the nearest folder above
    ``path`` that exists."""
    if below is None:
        below = path.parent
        while not os.path.lexists(below) and below != below.parent:
            below = below.parent
    try:
        rel = path.relative_to(below)
    except ValueError as e:
        raise NotOwnedError(f"{what}: couldn't use {path}: not under {below}") from e
    fd = _open_anchor(below, what, create=True)
    current = below
    try:
        _check_parent(fd, below, what)
        for i, part in enumerate(rel.parts):
            current = current / part
            try:
                os.mkdir(part, mode, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise NotOwnedError(f"{what}: couldn't create {current}: {e.strerror}") from e
            child = _open_at(fd, part, current, what)
            os.close(fd)
            fd = child
            last = i == len(rel.parts) - 1
            if last and private:
                _tighten(fd)
            check_fd(fd, current, what, private=private and last)
        if not rel.parts:
            check_fd(fd, path, what, private=private)
    except BaseException:
        os.close(fd)
        raise
    return OwnDir(fd, path)


def ensure_own_dir(path: Path, *, below: Path | None = None, what: str = "folder", mode: int = 0o700,
                   private: bool = False) -> Path:
    """``ensure_dir`` for a caller that only needs the folder to be right now (``omni submit``)."""
    ensure_dir(path, below=below, what=what, mode=mode, private=private).close()
    return path


def user_folder(template: Path, user: str) -> tuple[Path, Path]:
    """A site path that may hold ``{user}`` (``manager.registry_dir``, ``metrics_dir``): (the site's
    folder above the user's part, the path filled in). Without ``{user}``: (its parent, itself)."""
    parts = template.parts
    at = next((i for i, p in enumerate(parts) if "{user}" in p), None)
    filled = Path(str(template).replace("{user}", user))
    if at is None:
        return template.parent, filled
    return Path(*parts[:at]), filled
