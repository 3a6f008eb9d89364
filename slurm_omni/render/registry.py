"""Registration of submitted jobs with the manager: one JSON file per job in the site's registry.

``<registry_dir>/<slurm job id>.json`` (directory 0700, file 0600, written to a temporary name,
fsynced and renamed, so the manager never reads half a record)::

    {"format": 1, "job_id": 1234, "kind": "het" | "array", "name": "omni-tiny",
     "cluster": "omni", "user": "alice", "submitted_at": "2026-11-30T00:40:00Z",
     "job_file": "/abs/job.toml", "job_sha256": "...", "script": "/abs/.omni/scripts/1234.sbatch",
     "ckpt_dir": "/shared/ckpt/omni-tiny", "data_parallel_size": 2, "max_requeues": 5,
     "stages": [{"het_group": 0, "name": "vision", "partition": "vision", "nodes": 1,
                 "tasks_per_node": 2, "gres": "gpu:h100:4", "switches": 1}, ...],
     "array_tasks": null | [{"task_id": 0, "job_file": ..., "name": ..., "ckpt_dir": ...,
                             "incarnation_base": 0}, ...],
     "incarnation_base": 0,
     "environment": {"PATH": "...", "VIRTUAL_ENV": "...", "OMP_NUM_THREADS": "8", ...}}

``incarnation_base`` is the OMNI_INCARNATION of the job's first life: 0, or one past the highest
incarnation that started on its checkpoint root (its FENCE) when the job is submitted onto it again.
The manager numbers the job's incarnations from it (an array task: from its own, in ``array_tasks``).

``environment`` is the environment ``omni submit`` ran sbatch with, which sbatch hands to the job's
ranks: the manager resubmits the job with it rather than with its own (SLURM_CONF excepted: the
manager's cluster). At most ``MAX_ENVIRONMENT_BYTES`` of it are kept; past that the largest values
are left out, named in ``environment_dropped`` and in a warning. It may hold secrets: the record is
0600 in a 0700 directory of its user, and the manager's journal never copies it.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slurm_omni.errors import ConfigError, OmniError
from slurm_omni.fsio import write_atomic
from slurm_omni.render.request import StagePlan

log = logging.getLogger(__name__)

REGISTRY_FORMAT = 1
MAX_ENVIRONMENT_BYTES = 128 * 1024
"""The submitter's environment kept in a record (the manager reads records of at most 256 KiB)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Registration:
    job_id: int
    kind: Literal["het", "array"]
    name: str
    cluster: str
    job_file: Path
    job_sha256: str
    script: Path | None
    ckpt_dir: Path
    data_parallel_size: int
    max_requeues: int
    stages: tuple[StagePlan, ...]
    array_tasks: tuple[dict[str, Any], ...] | None = None
    user: str = ""
    submitted_at: str = ""
    incarnation_base: int = 0
    """OMNI_INCARNATION of the job's first life (past the lives of earlier jobs on its checkpoint root)."""
    environment: Mapping[str, str] | None = None
    """What sbatch ran with at submission; None records none (the manager then resubmits with its own)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": REGISTRY_FORMAT, "job_id": self.job_id, "kind": self.kind, "name": self.name,
            "cluster": self.cluster, "user": self.user or getpass.getuser(),
            "submitted_at": self.submitted_at or _now(), "job_file": str(self.job_file),
            "job_sha256": self.job_sha256, "script": str(self.script) if self.script else None,
            "ckpt_dir": str(self.ckpt_dir), "data_parallel_size": self.data_parallel_size,
            "max_requeues": self.max_requeues,
            "stages": [{"het_group": s.het_group, "name": s.name, "partition": s.partition, "nodes": s.nodes,
                        "tasks_per_node": s.tasks_per_node, "gres": s.gres, "switches": s.switches}
                       for s in self.stages],
            "array_tasks": list(self.array_tasks) if self.array_tasks is not None else None,
            "incarnation_base": self.incarnation_base,
            **(bounded_environment(self.environment) if self.environment is not None else {}),
        }


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


def register(registry_dir: Path, registration: Registration) -> Path:
    """Write the record atomically; returns its path."""
    try:
        registry_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(registry_dir)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            registry_dir.chmod(0o700)   # the record holds the submitter's environment
        path = write_atomic(registry_dir / f"{registration.job_id}.json",
                            json.dumps(registration.to_json(), indent=1, sort_keys=True) + "\n")
    except OSError as e:
        raise OmniError(f"submit: couldn't register job {registration.job_id} in {registry_dir}: "
                        f"{e.strerror} (check manager.registry_dir in the site config)") from e
    return path


def read_registrations(registry_dir: Path) -> list[dict[str, Any]]:
    """Every complete record, oldest job id first (for the manager)."""
    records = []
    for path in sorted(registry_dir.glob("*.json"), key=lambda p: (len(p.stem), p.stem)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"registry: couldn't read {path}: {e}") from e
        if record.get("format") != REGISTRY_FORMAT:
            raise ConfigError(f"registry: {path}: format {record.get('format')!r} is not {REGISTRY_FORMAT}")
        records.append(record)
    return records
