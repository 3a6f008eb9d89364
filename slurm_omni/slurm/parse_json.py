"""Pure parsers of ``sinfo --json``, ``squeue --json`` and ``scontrol show nodes --json``.

Every version the embedded cluster runs, recorded in tests/fixtures/slurm-<version>/:
- 22.05 (openapi v0.0.38): ``{"nodes": [...]}`` with ``state`` a string and ``state_flags`` a list;
  job numbers are plain integers and ``job_state`` a string.
- 24.11 (data_parser v0.0.42) and 26.05 (v0.0.44): ``sinfo --json`` prints ``{"sinfo": [...]}``, one
  row per partition and state with its nodes listed (``scontrol show nodes --json`` keeps one record
  per node, ``state`` a list of the base state and its flags); ``job_state`` is a list of the base
  state and its flags; numbers come as ``{"set": ..., "infinite": ..., "number": ...}``.
A shape none of them has is one ``SlurmError`` naming the command, the field and what was found.

One record (a job, a node, a row) that cannot be read is skipped, not the whole output: every user's
jobs share one ``squeue``, and one job must not blind every manager on the cluster. ``read_squeue_json``
and ``read_sinfo_json`` say which records they skipped and why (``Skipped``); the callers log them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.gres import parse_gres
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.states import job_state_of, split_state_list
from slurm_omni.slurm.states import node_state as node_state_of
from slurm_omni.slurm.types import HetComponent, Job, JobState, Node, Topology


@dataclass(frozen=True, slots=True)
class Skipped:
    """A record left out of a parse: what it was (``job 123``, ``node node3``, ``a job record``), the
    Slurm job ids it carried (a heterogeneous job's leader and components), and why."""

    what: str
    error: str
    job_ids: frozenset[int] = frozenset()

    def line(self, command: str) -> str:
        return f"{command}: skipped {self.what}: {self.error}"


@dataclass(frozen=True, slots=True)
class JobsRead:
    jobs: list[Job]
    skipped: list[Skipped]


@dataclass(frozen=True, slots=True)
class NodesRead:
    nodes: list[Node]
    skipped: list[Skipped]


def _load(text: str, command: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise SlurmError(f"{command}: couldn't parse --json output: {e}") from e
    except RecursionError:   # json nests past Python's recursion limit
        raise SlurmError(f"{command}: couldn't parse --json output: nested too deep") from None
    if not isinstance(data, dict):
        raise SlurmError(f"{command}: couldn't parse --json output: top level is not an object")
    errors = data.get("errors") or []
    if errors:
        first = errors[0] if isinstance(errors, list) else errors
        detail = first.get("error", first) if isinstance(first, Mapping) else first
        detail = detail or (first.get("description") if isinstance(first, Mapping) else "") or first
        raise SlurmError(f"{command}: slurm reported an error: {detail}")
    return data


def number(value: Any, field: str = "value") -> int | None:
    """An integer as any version prints it: ``5``, ``"5"``, or ``{"set": true, "infinite": false,
    "number": 5}`` (v0.0.39+); None for an unset or infinite one."""
    if isinstance(value, Mapping):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise SlurmError(f"slurm: couldn't read {field}: {value!r} (expected a number or "
                         "{set, infinite, number})")
    try:
        return int(value)
    except ValueError as e:
        raise SlurmError(f"slurm: couldn't read {field}: {value!r} (expected a number)") from e


def _text(value: Any, field: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("description", None), str):
        return str(value["description"])   # v0.0.40+ sinfo rows: "reason": {"description": ...}
    raise SlurmError(f"slurm: couldn't read {field}: {value!r} (expected a string)")


def _strings(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v for v in value.split(",") if v)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SlurmError(f"slurm: couldn't read {field}: {value!r} (expected a list of strings)")


def _state(raw: Mapping[str, Any], what: str) -> tuple[str, frozenset[str]]:
    """A node's base state and flags: ``"state": "idle"`` + ``"state_flags"`` (22.05) or
    ``"state": ["IDLE", "DRAIN"]`` (v0.0.40+)."""
    if not isinstance(raw, Mapping):
        raise SlurmError(f"slurm: couldn't read {what}: {str(raw)[:80]!r} (expected an object with a \"state\")")
    state = raw.get("state", "unknown")
    if isinstance(state, str):
        return state.upper(), frozenset(f.upper() for f in _strings(raw.get("state_flags"), f"{what} state_flags"))
    if isinstance(state, list) and all(isinstance(s, str) for s in state):
        return split_state_list(state, node=True)
    raise SlurmError(f"slurm: couldn't read {what} state: {state!r} (expected a string or a list of strings)")


def _node(name: str, base: str, flags: frozenset[str], *, reason: str, gres: str,
          partitions: tuple[str, ...], cpus: int, topology: Topology | None) -> Node:
    return Node(
        name=name,
        state=node_state_of(base, flags),
        slurm_state="+".join([base, *sorted(flags)]),
        flags=flags,
        reason=reason,
        gres=parse_gres(gres),
        partitions=partitions,
        cpus=cpus,
        switch_path=topology.switch_path(name) if topology else (),
    )


def parse_sinfo_json(text: str, topology: Topology | None = None, command: str = "sinfo") -> list[Node]:
    """Nodes from ``sinfo --json`` (any version) or ``scontrol show nodes --json`` (v0.0.40+); a
    record that cannot be read is left out (``read_sinfo_json`` says which)."""
    return read_sinfo_json(text, topology, command).nodes


def read_sinfo_json(text: str, topology: Topology | None = None, command: str = "sinfo") -> NodesRead:
    """Nodes and the records skipped; an output of no known shape is one ``SlurmError``."""
    data = _load(text, command)
    if isinstance(data.get("nodes"), list):
        return _parse_node_records(data["nodes"], topology, command)
    if isinstance(data.get("sinfo"), list):
        return _parse_sinfo_rows(data["sinfo"], topology, command)
    raise SlurmError(f"{command}: couldn't parse --json output: neither \"nodes\" nor \"sinfo\" is a list "
                     f"(keys: {', '.join(sorted(data))[:200]}; data_parser {_parser(data)})")


def _parse_node_records(records: list[Any], topology: Topology | None, command: str) -> NodesRead:
    nodes: dict[str, Node] = {}
    skipped: list[Skipped] = []
    for raw in records:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
            skipped.append(Skipped("a node record", f"{str(raw)[:120]!r} (expected an object with a \"name\")"))
            continue
        name = raw["name"]
        try:
            base, flags = _state(raw, f"node {name}")
            nodes[name] = _node(name, base, flags, reason=_text(raw.get("reason"), f"node {name} reason"),
                                gres=_text(raw.get("gres"), f"node {name} gres"),
                                partitions=_strings(raw.get("partitions"), f"node {name} partitions"),
                                cpus=number(raw.get("cpus"), f"node {name} cpus") or 0, topology=topology)
        except (SlurmError, ValueError) as e:
            skipped.append(Skipped(f"node {name[:80]}", str(e).removeprefix("slurm: ")))
    return NodesRead(list(nodes.values()), skipped)


def _parse_sinfo_rows(rows: list[Any], topology: Topology | None, command: str) -> NodesRead:
    """v0.0.40+ ``sinfo --json``: one row per (partition, state, ...) group, each listing its nodes."""
    seen: dict[str, dict[str, Any]] = {}
    skipped: list[Skipped] = []
    for row in rows:
        try:
            if not isinstance(row, Mapping):
                raise SlurmError(f"slurm: couldn't read a row: {str(row)[:80]!r} (expected an object)")
            names = row.get("nodes", {}).get("nodes") if isinstance(row.get("nodes"), Mapping) else None
            if names is None:
                raise SlurmError(f"slurm: couldn't read a row's nodes.nodes: {str(row.get('nodes'))[:80]!r}")
            names = _strings(names, "nodes.nodes")
            base, flags = _state(row.get("node") or {}, "row")
            partition = row.get("partition") or {}
            part = _text(partition.get("name") if isinstance(partition, Mapping) else partition, "partition")
            gres = row.get("gres") or {}
            gres_total = _text(gres.get("total") if isinstance(gres, Mapping) else gres, "gres.total")
            cpus = row.get("cpus") or {}
            cpu = number(cpus.get("maximum") if isinstance(cpus, Mapping) else cpus, "cpus.maximum") or 0
            reason = _text(row.get("reason"), "reason")
            expanded = [n for spec in names for n in expand(spec)]
        except (SlurmError, ValueError) as e:
            skipped.append(Skipped("a row", str(e).removeprefix("slurm: ")))
            continue
        for name in expanded:
            entry = seen.setdefault(name, {"base": base, "flags": flags, "reason": reason, "gres": gres_total,
                                           "cpus": cpu, "partitions": []})
            if part and part not in entry["partitions"]:
                entry["partitions"].append(part)
    return NodesRead([_node(name, e["base"], e["flags"], reason=e["reason"], gres=e["gres"],
                            partitions=tuple(e["partitions"]), cpus=e["cpus"], topology=topology)
                      for name, e in seen.items()], skipped)


def _parser(data: Mapping[str, Any]) -> str:
    meta = data.get("meta")
    if isinstance(meta, Mapping):
        plugin = meta.get("plugin")
        if isinstance(plugin, Mapping) and plugin.get("data_parser"):
            return str(plugin["data_parser"])
        slurm = meta.get("Slurm") or meta.get("slurm")
        if isinstance(slurm, Mapping):
            return f"of Slurm {slurm.get('release', '?')}"
    return "unknown"


def _job_state(value: Any, what: str) -> tuple[JobState, str]:
    if isinstance(value, str):
        return job_state_of([value]), value
    if isinstance(value, list) and value and all(isinstance(s, str) for s in value):
        return job_state_of(value), "+".join(value)
    raise SlurmError(f"slurm: couldn't read {what} job_state: {value!r} (expected a string or a list of strings)")


def parse_squeue_json(text: str) -> list[Job]:
    """Jobs as units: a heterogeneous job's components are gathered under their leader. A record that
    cannot be read is left out (``read_squeue_json`` says which)."""
    return read_squeue_json(text).jobs


def read_squeue_json(text: str) -> JobsRead:
    """Jobs and the records skipped: a job with one component that cannot be read is skipped whole
    (never half a heterogeneous job). An output of no known shape is one ``SlurmError``."""
    data = _load(text, "squeue")
    records = data.get("jobs", [])
    if not isinstance(records, list):
        raise SlurmError(f"squeue: couldn't parse --json output: \"jobs\" is {type(records).__name__}, "
                         f"not a list (data_parser {_parser(data)})")
    components: dict[int, list[tuple[Mapping[str, Any], HetComponent, str]]] = {}
    bad: dict[int, Skipped] = {}
    skipped: list[Skipped] = []
    for raw in records:
        job_id: int | None = None
        het_id: int | None = None
        try:
            if not isinstance(raw, Mapping):
                raise SlurmError(f"slurm: couldn't read a job record: {str(raw)[:80]!r} (expected an object)")
            job_id = number(raw.get("job_id"), "job_id")
            if job_id is None:
                raise SlurmError(f"slurm: couldn't read job_id: {raw.get('job_id')!r} (expected a number)")
            what = f"job {job_id}"
            het_id = number(raw.get("het_job_id"), f"{what} het_job_id") or job_id
            state, slurm_state = _job_state(raw.get("job_state", ""), what)
            nodes = _text(raw.get("nodes"), f"{what} nodes")
            comp = HetComponent(
                job_id=job_id,
                het_job_id=het_id,
                het_offset=number(raw.get("het_job_offset"), f"{what} het_job_offset") or 0,
                state=state,
                nodes=tuple(expand(nodes)) if nodes else (),
                partition=_text(raw.get("partition"), f"{what} partition"),
                reason=_text(raw.get("state_reason"), f"{what} state_reason"),
            )
        except (SlurmError, ValueError) as e:
            error = str(e).removeprefix("slurm: ")
            if job_id is None:
                skipped.append(Skipped("a job record", error))
                continue
            key = het_id if het_id is not None else job_id
            ids = {job_id, key} | (bad[key].job_ids if key in bad else frozenset())
            bad[key] = Skipped(f"job {key}", error, frozenset(ids))
            continue
        components.setdefault(het_id, []).append((raw, comp, slurm_state))
    jobs = []
    for leader_id, parts in components.items():
        if leader_id in bad:
            bad[leader_id] = Skipped(bad[leader_id].what, bad[leader_id].error,
                                     bad[leader_id].job_ids | {c.job_id for _, c, _ in parts})
            continue
        parts.sort(key=lambda p: p[1].het_offset)
        raw, _, slurm_state = parts[0]
        what = f"job {leader_id}"
        try:
            array_job = number(raw.get("array_job_id"), f"{what} array_job_id") or 0
            task = number(raw.get("array_task_id"), f"{what} array_task_id")
            jobs.append(Job(
                job_id=leader_id,
                name=_text(raw.get("name"), f"{what} name"),
                user=_text(raw.get("user_name"), f"{what} user_name"),
                state=_combined_state([c.state for _, c, _ in parts]),
                slurm_state=slurm_state,
                components=tuple(c for _, c, _ in parts),
                restart_count=number(raw.get("restart_cnt"), f"{what} restart_cnt") or 0,
                array_job_id=array_job or None,
                array_task_id=task if array_job and task is not None else None,
                reason=_text(raw.get("state_reason"), f"{what} state_reason"),
                comment=_text(raw.get("comment"), f"{what} comment"),
                submit_time=_epoch(number(raw.get("submit_time"), f"{what} submit_time")),
                batch_host=_text(raw.get("batch_host"), f"{what} batch_host"),
            ))
        except (SlurmError, ValueError) as e:
            bad[leader_id] = Skipped(what, str(e).removeprefix("slurm: "),
                                     frozenset({leader_id, *(c.job_id for _, c, _ in parts)}))
    return JobsRead(jobs, skipped + list(bad.values()))


def _epoch(value: int | None) -> float | None:
    return float(value) if value is not None and value > 0 else None


def _combined_state(states: list[JobState]) -> JobState:
    """A heterogeneous job is as healthy as its worst component."""
    for bad in (JobState.NODE_FAIL, JobState.FAILED, JobState.BOOT_FAIL, JobState.OUT_OF_MEMORY,
                JobState.TIMEOUT, JobState.CANCELLED, JobState.PREEMPTED, JobState.REQUEUED,
                JobState.PENDING, JobState.SUSPENDED, JobState.COMPLETING, JobState.RUNNING):
        if bad in states:
            return bad
    return states[0] if states else JobState.UNKNOWN
