"""Pure parsers of ``sinfo --json`` and ``squeue --json`` (Slurm 22.05, openapi v0.0.38)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.gres import parse_gres
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.states import job_state, node_state
from slurm_omni.slurm.types import HetComponent, Job, JobState, Node, Topology


def _load(text: str, command: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SlurmError(f"{command}: couldn't parse --json output: {e}") from e
    if not isinstance(data, dict):
        raise SlurmError(f"{command}: couldn't parse --json output: top level is not an object")
    errors = data.get("errors") or []
    if errors:
        first = errors[0]
        detail = first.get("error", first) if isinstance(first, Mapping) else first
        raise SlurmError(f"{command}: slurm reported an error: {detail}")
    return data


def parse_sinfo_json(text: str, topology: Topology | None = None) -> list[Node]:
    data = _load(text, "sinfo")
    nodes: dict[str, Node] = {}
    for raw in data.get("nodes", []):
        try:
            name = raw["name"]
            flags = frozenset(str(f).upper() for f in raw.get("state_flags") or ())
            base = str(raw.get("state", "unknown")).upper()
        except (KeyError, TypeError) as e:
            raise SlurmError(f"sinfo: couldn't parse node record: missing {e}") from e
        nodes[name] = Node(
            name=name,
            state=node_state(base, flags),
            slurm_state="+".join([base, *sorted(flags)]),
            flags=flags,
            reason=raw.get("reason") or "",
            gres=parse_gres(raw.get("gres") or ""),
            partitions=tuple(raw.get("partitions") or ()),
            cpus=int(raw.get("cpus") or 0),
            switch_path=topology.switch_path(name) if topology else (),
        )
    return list(nodes.values())


def parse_squeue_json(text: str) -> list[Job]:
    """Jobs as units: a heterogeneous job's components are gathered under their leader."""
    data = _load(text, "squeue")
    components: dict[int, list[tuple[dict[str, Any], HetComponent]]] = {}
    for raw in data.get("jobs", []):
        try:
            job_id = int(raw["job_id"])
            het_id = int(raw.get("het_job_id") or 0) or job_id
            comp = HetComponent(
                job_id=job_id,
                het_job_id=het_id,
                het_offset=int(raw.get("het_job_offset") or 0),
                state=job_state(raw.get("job_state", "")),
                nodes=tuple(expand(raw["nodes"])) if raw.get("nodes") else (),
                partition=raw.get("partition") or "",
                reason=raw.get("state_reason") or "",
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SlurmError(f"squeue: couldn't parse job record: {e}") from e
        components.setdefault(het_id, []).append((raw, comp))
    jobs = []
    for leader_id, parts in components.items():
        parts.sort(key=lambda p: p[1].het_offset)
        raw = parts[0][0]
        states = [c.state for _, c in parts]
        array_job = int(raw.get("array_job_id") or 0)
        task = raw.get("array_task_id")
        jobs.append(Job(
            job_id=leader_id,
            name=raw.get("name") or "",
            user=raw.get("user_name") or "",
            state=_combined_state(states),
            slurm_state=raw.get("job_state", ""),
            components=tuple(c for _, c in parts),
            restart_count=int(raw.get("restart_cnt") or 0),
            array_job_id=array_job or None,
            array_task_id=int(task) if array_job and task is not None else None,
            reason=raw.get("state_reason") or "",
            comment=raw.get("comment") or "",
        ))
    return jobs


def _combined_state(states: list[JobState]) -> JobState:
    """A heterogeneous job is as healthy as its worst component."""
    for bad in (JobState.NODE_FAIL, JobState.FAILED, JobState.BOOT_FAIL, JobState.OUT_OF_MEMORY,
                JobState.TIMEOUT, JobState.CANCELLED, JobState.PREEMPTED, JobState.REQUEUED,
                JobState.PENDING, JobState.SUSPENDED, JobState.COMPLETING, JobState.RUNNING):
        if bad in states:
            return bad
    return states[0] if states else JobState.UNKNOWN
