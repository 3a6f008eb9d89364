"""Registration of submitted jobs with the manager: one record per job in the site's registry.

The record's format is ``slurm_omni.formats.registry.RegistryRecord`` (one type, shared with the
manager's reader); ``<registry_dir>/<slurm job id>.json`` is 0600 in a 0700 directory, written to a
temporary name, fsynced and renamed, so the manager never reads half a record.
"""

from __future__ import annotations

import datetime as dt
import getpass
import logging
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
from slurm_omni.ownership import NotOwnedError, OwnDir, ensure_dir
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


def register(registry_dir: Path, record: RegistryRecord, *, below: Path | None = None) -> Path:
    """Write ``record`` atomically (its user and submission time filled in when empty, its
    environment bounded) into ``registry_dir``, made or found ours and 0700 (``below``: the site's
    folder above it, ``slurm_omni.ownership.ensure_dir``) and written through its checked
    descriptor; returns its path."""
    bounded = bounded_environment(record.environment) if record.environment is not None else {}
    record = msgspec.structs.replace(record, user=record.user or getpass.getuser(),
                                     submitted_at=record.submitted_at or _now(),
                                     environment=bounded.get("environment"),
                                     environment_dropped=tuple(bounded.get("environment_dropped", ())))
    try:   # the record holds the submitter's environment: a private folder of ours
        with open_registry(registry_dir, below=below) as folder:
            path = write_atomic(registry_dir / f"{record.job_id}.json", encode_record(record), dir_fd=folder.fd)
    except OSError as e:
        raise OmniError(f"submit: couldn't register job {record.job_id} in {registry_dir}: "
                        f"{e.strerror} (check manager.registry_dir in the site config)") from e
    return path


def open_registry(registry_dir: Path, *, below: Path | None = None) -> OwnDir:
    """The user's registry folder, made or found ours and 0700; else one line naming it and the fix."""
    try:
        return ensure_dir(registry_dir, below=below, what="submit: registry folder", private=True)
    except NotOwnedError as e:
        raise NotOwnedError(f"{e} (manager.registry_dir in the site config; the manager would not read it)") from None


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
