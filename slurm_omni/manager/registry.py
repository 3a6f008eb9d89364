"""The manager's side of the job registry that ``omni submit`` writes (slurm_omni/render/registry.py).

The manager acts only on what its own user registered: the registry directory must be ours and
0700, every record a regular file of ours (no symlink), at most ``MAX_RECORD_BYTES``, in the
registry format. A record that fails any of this is logged and set aside in ``rejected/`` (the
same as a malformed event file), never acted on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slurm_omni.fsio import FileRejected, one_line, read_bounded
from slurm_omni.manager.events import EventRejected, check_private_dir, reject
from slurm_omni.render.registry import REGISTRY_FORMAT

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 256 * 1024
HEARTBEAT_SUBDIR = "heartbeat"
"""Heartbeats live in ``<ckpt_dir>/heartbeat``: shared storage every rank and the manager see."""


@dataclass(frozen=True, slots=True)
class StageShape:
    het_group: int
    name: str
    partition: str
    nodes: int
    tasks_per_node: int
    gres: str


@dataclass(frozen=True, slots=True)
class ArrayTask:
    task_id: int
    name: str
    ckpt_dir: Path
    incarnation_base: int = 0   # OMNI_INCARNATION of the task's first life


@dataclass(frozen=True, slots=True)
class RegisteredJob:
    """One registry record: a heterogeneous job or a sweep (job array)."""

    job_id: int
    kind: Literal["het", "array"]
    name: str
    user: str
    job_file: Path
    job_sha256: str
    ckpt_dir: Path
    data_parallel_size: int
    max_requeues: int
    stages: tuple[StageShape, ...]
    array_tasks: tuple[ArrayTask, ...] = ()
    path: Path | None = None
    incarnation_base: int = 0
    """The incarnation (OMNI_INCARNATION) of the job's first life."""
    environment: dict[str, str] | None = field(default=None, repr=False, compare=False)
    """The submitter's environment, for resubmissions (None in records from before it was kept)."""

    @property
    def key(self) -> str:
        """The job's name in the journal: unique per registration."""
        return f"{self.name}-{self.job_id}"

    @property
    def heartbeat_dir(self) -> Path:
        return self.ckpt_dir / HEARTBEAT_SUBDIR

    def to_spec(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "kind": self.kind, "name": self.name, "user": self.user,
                "job_file": str(self.job_file), "job_sha256": self.job_sha256, "ckpt_dir": str(self.ckpt_dir),
                "data_parallel_size": self.data_parallel_size, "max_requeues": self.max_requeues,
                "stages": [vars_of(s) for s in self.stages],
                "array_tasks": [{"task_id": t.task_id, "name": t.name, "ckpt_dir": str(t.ckpt_dir)}
                                for t in self.array_tasks]}


def vars_of(stage: StageShape) -> dict[str, Any]:
    return {"het_group": stage.het_group, "name": stage.name, "partition": stage.partition,
            "nodes": stage.nodes, "tasks_per_node": stage.tasks_per_node, "gres": stage.gres}


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise EventRejected(f"registry: couldn't accept {what}: {key} = {value!r:.80} is not allowed")
    return value


def _absolute(obj: dict[str, Any], key: str, what: str) -> Path:
    path = Path(_need(obj, key, str, what))
    if not path.is_absolute() or "\0" in str(path):
        raise EventRejected(f"registry: couldn't accept {what}: {key} = {str(path)!r:.80} is not an absolute path")
    return path


def _base(obj: dict[str, Any], what: str) -> int:
    base = obj.get("incarnation_base", 0)   # absent in records from before it was kept
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        raise EventRejected(f"registry: couldn't accept {what}: incarnation_base = {base!r:.40} (0 or more)")
    return base


def parse_record(data: bytes, what: str) -> RegisteredJob:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:   # not UTF-8, not JSON, an int of 5,000 digits, too deep
        raise EventRejected(f"registry: couldn't parse {what}: {one_line(str(e)) or 'nested too deep'}") from None
    if not isinstance(obj, dict) or obj.get("format") != REGISTRY_FORMAT:
        raise EventRejected(f"registry: couldn't accept {what}: expected an object of format {REGISTRY_FORMAT}")
    kind = obj.get("kind")
    if kind not in ("het", "array"):
        raise EventRejected(f"registry: couldn't accept {what}: kind = {kind!r:.40} (allowed: het, array)")
    stages = []
    for i, raw in enumerate(_need(obj, "stages", list, what)):
        if not isinstance(raw, dict):
            raise EventRejected(f"registry: couldn't accept {what}: stages[{i}] is not an object")
        stage = StageShape(_need(raw, "het_group", int, what), _need(raw, "name", str, what),
                           _need(raw, "partition", str, what), _need(raw, "nodes", int, what),
                           _need(raw, "tasks_per_node", int, what), _need(raw, "gres", str, what))
        if stage.het_group != i or stage.nodes < 1 or stage.tasks_per_node < 1:
            raise EventRejected(f"registry: couldn't accept {what}: stages[{i}] = {raw!r:.120}")
        stages.append(stage)
    if not stages:
        raise EventRejected(f"registry: couldn't accept {what}: no stages")
    tasks = []
    for raw in obj.get("array_tasks") or ():
        if not isinstance(raw, dict):
            raise EventRejected(f"registry: couldn't accept {what}: array_tasks holds {raw!r:.40}")
        tasks.append(ArrayTask(_need(raw, "task_id", int, what), _need(raw, "name", str, what),
                               _absolute(raw, "ckpt_dir", what), _base(raw, what)))
    environment = obj.get("environment")
    if environment is not None and not (isinstance(environment, dict) and all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in environment.items())):
        raise EventRejected(f"registry: couldn't accept {what}: environment is not an object of strings")
    base = _base(obj, what)
    job_id = _need(obj, "job_id", int, what)
    dp = _need(obj, "data_parallel_size", int, what)
    if job_id < 1 or dp < 1:
        raise EventRejected(f"registry: couldn't accept {what}: job_id = {job_id}, data_parallel_size = {dp}")
    return RegisteredJob(job_id, kind, _need(obj, "name", str, what), _need(obj, "user", str, what),
                         _absolute(obj, "job_file", what), _need(obj, "job_sha256", str, what),
                         _absolute(obj, "ckpt_dir", what), dp, _need(obj, "max_requeues", int, what),
                         tuple(stages), tuple(tasks), incarnation_base=base, environment=environment)


def read_registry(registry_dir: Path, *, uid: int | None = None) -> list[RegisteredJob]:
    """Every valid record of ``uid`` (default: ours), oldest job id first; others are set aside."""
    uid = os.geteuid() if uid is None else uid
    if not registry_dir.exists():
        return []
    check_private_dir(registry_dir)
    out = []
    for entry in sorted(os.scandir(registry_dir), key=lambda e: (len(e.name), e.name)):
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue
        path = Path(entry.path)
        try:
            st = os.lstat(path)
            if st.st_uid != uid:
                raise EventRejected(f"registry: couldn't accept {entry.name}: owned by uid {st.st_uid}, "
                                    f"not the manager's {uid}")
            job = parse_record(read_bounded(path, MAX_RECORD_BYTES), entry.name)
            if entry.name != f"{job.job_id}.json":
                raise EventRejected(f"registry: couldn't accept {entry.name}: it names job {job.job_id}")
        except FileRejected as e:
            reject(path, str(e) if str(e).startswith("registry:") else f"registry: {e}")
            continue
        out.append(dataclasses.replace(job, path=path))
    return out
