"""The manager's side of the job registry that ``omni submit`` writes (slurm_omni/render/registry.py).

One record type for both sides: ``slurm_omni.formats.registry.RegistryRecord``. The manager acts
only on what its own user registered: the registry directory must be ours and 0700 (the one check,
``slurm_omni.ownership``: a ``NotOwnedError`` naming it otherwise; the records are read through its
checked descriptor), every record a regular file of ours (no symlink), at most ``MAX_RECORD_BYTES``,
in the registry format. A record that fails any of this is logged and set aside in ``rejected/``
(the same as a malformed event file), never acted on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from slurm_omni.formats import RecordRejected
from slurm_omni.formats.registry import HEARTBEAT_SUBDIR, MAX_RECORD_BYTES, RegistryRecord, decode_record
from slurm_omni.fsio import FileRejected, read_bounded
from slurm_omni.manager.events import EventRejected, reject
from slurm_omni.ownership import open_own_dir

log = logging.getLogger(__name__)

__all__ = ["HEARTBEAT_SUBDIR", "MAX_RECORD_BYTES", "RegistryRecord", "parse_record", "read_registry"]


def parse_record(data: bytes, what: str) -> RegistryRecord:
    try:
        return decode_record(data, what)
    except RecordRejected as e:
        raise EventRejected(f"registry: {e}") from None


def read_registry(registry_dir: Path, *, uid: int | None = None) -> list[RegistryRecord]:
    """Every valid record of ``uid`` (default: ours), oldest job id first; others are set aside. A
    registry folder that is not ours and private is a ``NotOwnedError`` naming it."""
    uid = os.geteuid() if uid is None else uid
    if not os.path.lexists(registry_dir):
        return []
    with open_own_dir(registry_dir, "manager: registry", private=True) as folder:
        return _read_records(registry_dir, folder.fd, uid)


def _read_records(registry_dir: Path, dir_fd: int, uid: int) -> list[RegistryRecord]:
    out = []
    for entry in sorted(os.scandir(dir_fd), key=lambda e: (len(e.name), e.name)):
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        path = registry_dir / entry.name
        try:
            st = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
            if st.st_uid != uid:
                raise EventRejected(f"registry: couldn't accept {entry.name}: owned by uid {st.st_uid}, "
                                    f"not the manager's {uid}")
            job = parse_record(read_bounded(path, MAX_RECORD_BYTES, dir_fd=dir_fd), entry.name)
            if entry.name != f"{job.job_id}.json":
                raise EventRejected(f"registry: couldn't accept {entry.name}: it names job {job.job_id}")
        except FileRejected as e:
            reject(path, str(e) if str(e).startswith("registry:") else f"registry: {e}")
            continue
        except FileNotFoundError:   # removed since the scan
            continue
        out.append(job)
    return out
