"""Folders a user's job and manager trust: their own, and writable by nobody else.

Checkpoints and heartbeats live on shared storage under ``<checkpoint root>/<user>/<job name>``
(docs/deployment.md). Whoever can create or write a folder there first could read the weights,
plant a ``FENCE`` or fake heartbeats, so every folder is made 0700 and, found or made, checked by
``lstat``: not a link, owned by the effective uid, no group or other write.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from slurm_omni.errors import OmniError


class NotOwnedError(OmniError):
    """A folder the job or manager would use belongs to someone else or others can write to it."""


def current_user() -> str:
    """The effective user's name (the uid as text when it has no passwd entry)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_own_dir(path: Path, what: str = "folder") -> Path:
    """``path`` is a directory (not a link) of ours that nobody else can write; else one line why."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise NotOwnedError(f"{what}: couldn't use {path}: {e.strerror}") from e
    uid = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or mode & 0o022:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise NotOwnedError(f"{what}: couldn't use {path}: {kind} of uid {st.st_uid} with mode {mode:04o} "
                            f"(expected a directory of uid {uid} that only it can write; someone else made it "
                            f"first, or chmod go-w it)")
    return path


def ensure_own_dir(path: Path, *, below: Path, what: str = "folder") -> Path:
    """Make ``path`` and the folders between ``below`` and it (0700 each), checking every one of them,
    found or made. ``below`` itself is the site's (e.g. the checkpoint root): made when missing, not checked."""
    try:
        rel = path.relative_to(below)
    except ValueError as e:
        raise NotOwnedError(f"{what}: couldn't use {path}: not under {below}") from e
    try:   # a site makes the root (shared, 1777 or with a folder per user); a sandbox may not have yet
        below.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NotOwnedError(f"{what}: couldn't create {below}: {e.strerror}") from e
    current = below
    for part in rel.parts:
        current = current / part
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise NotOwnedError(f"{what}: couldn't create {current}: {e.strerror}") from e
        check_own_dir(current, what)
    return path
