"""Registration of submitted jobs with the manager: one record per job in the site's registry.

The record's format is ``slurm_omni.formats.registry.RegistryRecord`` (one type, shared with the
manager's reader); ``<registry_dir>/<slurm job id>.json`` is 0600 in a 0700 directory, written to a
temporary name, fsynced and renamed, so the manager never reads half a record.
"""

from __future__ import annotations

import datetime as dt
import getpass
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from slurm_omni.errors import ConfigError, OmniError
from slurm_omni.formats.registry import (
    MAX_ENVIRONMENT_BYTES,
    MAX_RECORD_BYTES,
    RegisteredStage,
    RegistryRecord,
    decode_record,
    encode_record,
)
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.render.request import StagePlan

log = logging.getLogger(__name__)

__all__ = ["MAX_ENVIRONMENT_BYTES", "RegistryRecord", "bounded_environment", "read_registrations", "register",
           "registered_stages"]


def registered_stages(plans: Sequence[StagePlan]) -> tuple[RegisteredStage, ...]:
    """What the registry keeps of each planned stage (what the manager needs to resize and resubmit)."""
    return tuple(RegisteredStage(p.het_group, p.name, p.partition, p.nodes, p.tasks_per_node, p.gres, p.switches)
                 for p in plans)


def bounded_environment(env: Mapping[str, str]) -> dict[str, Any]:
    """``environment`` (and ``environment_dropped``) of a record: at most MAX_ENVIRONMENT_BYTES, the
    largest values left out first."""
    kept = dict(sorted(env.items()))
    size = sum(len(k) + len(v) for k, v in kept.items())
    dropped = []
    for key in sorted(kept, key=lambda k: len(kept[k]), reverse=True):
        if size <= MAX_ENVIRONMENT_BYTES:
            break
        size -= len(key) + len(kept.pop(key))
        dropped.append(key)
    if dropped:
        log.warning("submit: the environment is over %d bytes; the manager resubmits without %s",
                    MAX_ENVIRONMENT_BYTES, ", ".join(sorted(dropped)))
    return {"environment": kept, **({"environment_dropped": sorted(dropped)} if dropped else {})}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def register(registry_dir: Path, record: RegistryRecord) -> Path:
    """Write ``record`` atomically (its user and submission time filled in when empty, its
    environment bounded); returns its path."""
    bounded = bounded_environment(record.environment) if record.environment is not None else {}
    record = msgspec.structs.replace(record, user=record.user or getpass.getuser(),
                                     submitted_at=record.submitted_at or _now(),
                                     environment=bounded.get("environment"),
                                     environment_dropped=tuple(bounded.get("environment_dropped", ())))
    try:
        registry_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(registry_dir)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            registry_dir.chmod(0o700)   # the record holds the submitter's environment
        path = write_atomic(registry_dir / f"{record.job_id}.json", encode_record(record))
    except OSError as e:
        raise OmniError(f"submit: couldn't register job {record.job_id} in {registry_dir}: "
                        f"{e.strerror} (check manager.registry_dir in the site config)") from e
    return path


def read_registrations(registry_dir: Path) -> list[dict[str, Any]]:
    """Every record as plain values, oldest job id first (for the drills)."""
    records = []
    for path in sorted(registry_dir.glob("*.json"), key=lambda p: (len(p.stem), p.stem)):
        try:
            record = decode_record(read_bounded(path, MAX_RECORD_BYTES, what=str(path)), str(path))
        except FileRejected as e:
            raise ConfigError(f"registry: {e}") from None
        records.append(msgspec.to_builtins(record, enc_hook=str))
    return records
