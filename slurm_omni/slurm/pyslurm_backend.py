"""The pyslurm backend: reads through libslurm instead of parsing command output.

PyPI's pyslurm is built for one Slurm release (25.11 at the time of writing) and refuses any other;
on Slurm 22.05 it does not import and the command-line backend is used. Writes (submit, requeue,
node updates) still go through the command-line tools, which are the stable interface.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from slurm_omni.slurm.backend import ClusterSnapshot
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.gres import parse_gres
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.states import job_state, node_state
from slurm_omni.slurm.types import HetComponent, Job, Node

_IMPORT_ERROR: str | None = None
try:  # pragma: no cover - depends on the installed Slurm
    import pyslurm
except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
    pyslurm = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


def available() -> bool:
    return pyslurm is not None


def unavailable_reason() -> str:
    return _IMPORT_ERROR or "pyslurm imported"


class PyslurmBackend(CliBackend):  # pragma: no cover - needs a Slurm matching pyslurm's build
    name = "pyslurm"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        super().__init__(env)

    def nodes(self) -> list[Node]:
        topology = self.topology()
        out = []
        for name, raw in pyslurm.Nodes.load().items():
            flags = frozenset(s.upper() for s in str(raw.state).split("+")[1:])
            base = str(raw.state).split("+")[0]
            out.append(Node(
                name=name, state=node_state(base, flags), slurm_state=str(raw.state), flags=flags,
                reason=raw.reason or "", gres=parse_gres(",".join(_gres_items(raw.configured_gres))),
                partitions=tuple(raw.partitions or ()), cpus=int(raw.total_cpus or 0),
                switch_path=topology.switch_path(name),
            ))
        return out

    def jobs(self, *, user: str | None = None) -> list[Job]:
        groups: dict[int, list[Any]] = {}
        for raw in pyslurm.Jobs.load().values():
            leader = int(raw.het_job_id or 0) or int(raw.id)
            groups.setdefault(leader, []).append(raw)
        jobs = []
        for leader, parts in groups.items():
            parts.sort(key=lambda r: int(r.het_job_offset or 0))
            first = parts[0]
            if user is not None and first.user_name != user:
                continue
            comps = tuple(HetComponent(
                job_id=int(r.id), het_job_id=leader, het_offset=int(r.het_job_offset or 0),
                state=job_state(str(r.state)), nodes=tuple(expand(r.nodelist)) if r.nodelist else (),
                partition=r.partition or "", reason=r.state_reason or "") for r in parts)
            jobs.append(Job(
                job_id=leader, name=first.name or "", user=first.user_name or "",
                state=comps[0].state, slurm_state=str(first.state), components=comps,
                restart_count=int(first.requeue_count or 0),
                array_job_id=int(first.array_id) if first.array_id else None,
                array_task_id=int(first.array_task_id) if first.array_task_id is not None else None,
                reason=first.state_reason or "", comment=first.comment or "",
                batch_host=str(getattr(first, "batch_host", "") or "")))
        return jobs

    def snapshot(self, *, user: str | None = None) -> ClusterSnapshot:
        jobs = tuple(self.jobs(user=user))   # before the nodes, as CliBackend.snapshot says why
        return ClusterSnapshot(tuple(self.nodes()), jobs, self.topology(), time.time())


def _gres_items(gres: Any) -> list[str]:
    if isinstance(gres, dict):
        return [f"{k}:{v}" for k, v in gres.items()]
    return [str(gres)] if gres else []
