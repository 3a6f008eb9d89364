"""The job registry's record: ``<registry_dir>/<slurm job id>.json``, one per submitted job.

One type, ``RegistryRecord``: ``omni submit`` builds and writes it (render/registry.py), the
manager reads it back (manager/registry.py) and acts on it (manager/watch.py, actions.py)::

    {"format": 1, "job_id": 1234, "kind": "het" | "array", "name": "omni-tiny",
     "cluster": "omni", "user": "alice", "submitted_at": "2026-11-30T00:40:00Z",
     "job_file": "/abs/job.toml", "job_sha256": "...", "script": "/abs/.omni/scripts/1234.sbatch",
     "ckpt_dir": "/shared/ckpt/alice/omni-tiny", "data_parallel_size": 2, "max_requeues": 5,
     "stages": [{"het_group": 0, "name": "vision", "partition": "vision", "nodes": 1,
                 "tasks_per_node": 2, "gres": "gpu:h100:4", "switches": 1}, ...],
     "array_tasks": null | [{"task_id": 0, "job_file": ..., "name": ..., "job_sha256": ...,
                             "ckpt_dir": ..., "incarnation_base": 0}, ...],
     "incarnation_base": 0,
     "environment": {"PATH": "...", "VIRTUAL_ENV": "...", "OMP_NUM_THREADS": "8", ...}}

``incarnation_base`` is the OMNI_INCARNATION of the job's first life: 0, or one past the highest
incarnation that started on its checkpoint root (its FENCE) when the job is submitted onto it again.
The manager numbers the job's incarnations from it (an array task: from its own, in ``array_tasks``).

``environment`` is the environment ``omni submit`` ran sbatch with, which sbatch hands to the job's
ranks: the manager resubmits the job with it rather than with its own (SLURM_CONF excepted: the
manager's cluster). At most ``MAX_ENVIRONMENT_BYTES`` of it are kept; past that the largest values
are left out and named in ``environment_dropped``. It may hold secrets: the record is 0600 in a
0700 directory of its user, and the manager's journal never copies it (``spec``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from slurm_omni.formats import decode

REGISTRY_FORMAT = 1
MAX_RECORD_BYTES = 256 * 1024
MAX_ENVIRONMENT_BYTES = 128 * 1024
"""The submitter's environment kept in a record (the manager reads records of at most 256 KiB)."""
HEARTBEAT_SUBDIR = "heartbeat"
"""Heartbeats live in ``<ckpt_dir>/heartbeat``: shared storage every rank and the manager see."""

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


def _absolute(path: Path, key: str) -> None:
    if not path.is_absolute() or any(not c.isprintable() for c in str(path)):
        raise ValueError(f"{key} = {str(path)[:80]!r} is not an absolute path of printable characters")


class RegisteredStage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One heterogeneous component as submitted (render/request.StagePlan, as the manager needs it)."""

    het_group: _Count
    name: _Name
    partition: _Name
    nodes: _Positive
    tasks_per_node: _Positive
    gres: Annotated[str, msgspec.Meta(max_length=255)]
    switches: _Positive = 1


class RegisteredTask(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One task of a sweep (job array)."""

    task_id: _Count
    name: _Name
    ckpt_dir: Path
    job_file: Path | None = None
    job_sha256: str = ""
    incarnation_base: _Count = 0
    """OMNI_INCARNATION of the task's first life."""

    def __post_init__(self) -> None:
        _absolute(self.ckpt_dir, "array_tasks.ckpt_dir")


class RegistryRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One registry record: a heterogeneous job or a sweep (job array)."""

    format: Literal[1] = 1   # REGISTRY_FORMAT
    job_id: _Positive
    kind: Literal["het", "array"]
    name: _Name
    cluster: str = ""
    user: str = ""
    submitted_at: str = ""
    job_file: Path
    job_sha256: str
    script: Path | None = None
    ckpt_dir: Path
    data_parallel_size: _Positive
    max_requeues: _Count
    stages: Annotated[tuple[RegisteredStage, ...], msgspec.Meta(min_length=1)]
    array_tasks: tuple[RegisteredTask, ...] | None = None
    incarnation_base: _Count = 0
    """The incarnation (OMNI_INCARNATION) of the job's first life."""
    environment: dict[Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[^=\x00]+$")],
                      Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$")]] | None = None
    """The submitter's environment, for resubmissions (None in records from before it was kept)."""
    environment_dropped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _absolute(self.job_file, "job_file")
        _absolute(self.ckpt_dir, "ckpt_dir")
        for i, stage in enumerate(self.stages):
            if stage.het_group != i:
                raise ValueError(f"stages[{i}] has het_group {stage.het_group} (expected {i}: in order)")

    @property
    def key(self) -> str:
        """The job's name in the journal: unique per registration."""
        return f"{self.name}-{self.job_id}"

    @property
    def heartbeat_dir(self) -> Path:
        return self.ckpt_dir / HEARTBEAT_SUBDIR

    @property
    def tasks(self) -> tuple[RegisteredTask, ...]:
        return self.array_tasks or ()

    def to_spec(self) -> dict[str, Any]:
        """The record for the journal: everything but the environment (it may hold secrets)."""
        spec: dict[str, Any] = msgspec.to_builtins(self, enc_hook=str)
        spec.pop("environment", None)
        spec.pop("environment_dropped", None)
        return spec


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise TypeError(f"expected a path string, got {type(value).__name__}")   # msgspec: a ValidationError


def encode_record(record: RegistryRecord) -> bytes:
    return msgspec.json.format(msgspec.json.encode(record, enc_hook=str), indent=1) + b"\n"


def decode_record(data: bytes, what: str) -> RegistryRecord:
    """Raises RecordRejected (formats.decode) for anything that is not one record."""
    return decode(data, RegistryRecord, what, dec_hook=_dec_hook)
