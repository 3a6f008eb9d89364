"""A Slurm backend in memory (the embedded cluster's shape: node1-8 under leaf1/leaf2 under root), a
fake clock, and writers of registry records and heartbeat files as the real producers write them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slurm_omni.config.site import load_site
from slurm_omni.manager.daemon import Manager, ManagerConfig
from slurm_omni.render.registry import Registration, register
from slurm_omni.render.request import StagePlan
from slurm_omni.slurm.backend import ClusterSnapshot
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.types import Gres, HetComponent, Job, JobState, Node, NodeState, Switch, Topology

NODES = [f"node{i}" for i in range(1, 9)]
TOPOLOGY = Topology({"leaf1": Switch("leaf1", 0, nodes=tuple(NODES[:4])),
                     "leaf2": Switch("leaf2", 0, nodes=tuple(NODES[4:])),
                     "root": Switch("root", 1, switches=("leaf1", "leaf2"))})

SITE = """
cluster = "omni"
[stages.vision]
partition = "vision"
gres = "gpu:h100:4"
[stages.text]
partition = "text"
gres = "gpu:h100:4"
[checkpoint]
root = "{root}/ckpt"
[elasticity]
drain_failed = {drain}
[manager]
spool_dir = "{root}/spool"
registry_dir = "{root}/registry"
metrics_dir = "{root}/metrics"
"""

JOB = """
[job]
name = "tiny"
data_parallel_size = {dp}
[[stages]]
name = "vision"
nodes = {dp}
[[stages]]
name = "text"
nodes = {dp}
[training]
max_steps = 100
[training.parallel]
global_batch_size = 8
micro_batch_size = 2
[training.data]
shard_dir = "shards"
"""


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeSlurm:
    clock: Clock
    user: str = "root"
    name: str = "fake"
    states: dict[str, NodeState] = field(default_factory=lambda: dict.fromkeys(NODES, NodeState.IDLE))
    reasons: dict[str, str] = field(default_factory=dict)
    job_table: dict[int, Job] = field(default_factory=dict)
    next_id: int = 100
    submitted: list[tuple[int, str, list[str]]] = field(default_factory=list)
    cancelled: list[tuple[str, str | None]] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    drained: list[tuple[str, str, str]] = field(default_factory=list)
    snapshots: int = 0

    # -- the backend protocol --------------------------------------------------------------------
    def topology(self, *, refresh: bool = False) -> Topology:
        return TOPOLOGY

    def nodes(self) -> list[Node]:
        busy = {n for j in self.job_table.values() if j.state is JobState.RUNNING for n in j.nodes}
        out = []
        for name in NODES:
            state = self.states[name]
            if state is NodeState.IDLE and name in busy:
                state = NodeState.ALLOCATED
            flags = frozenset({"DRAIN"}) if state in (NodeState.DRAINED, NodeState.DRAINING) else frozenset()
            out.append(Node(name, state, state.value.upper(), flags, self.reasons.get(name, ""),
                            (Gres("gpu", "h100", 4),), ("debug", "vision", "text"), 4, TOPOLOGY.switch_path(name)))
        return out

    def jobs(self, *, user: str | None = None) -> list[Job]:
        return [j for j in self.job_table.values() if user is None or j.user == user]

    def snapshot(self, *, user: str | None = None) -> ClusterSnapshot:
        self.snapshots += 1
        return ClusterSnapshot(tuple(self.nodes()), tuple(self.jobs(user=user)), TOPOLOGY, self.clock())

    def submit(self, script_path: str, args: Sequence[str] = ()) -> int:
        job_id = self.next_id
        self.next_id += 10
        parts: list[list[str]] = [[]]
        for a in args:
            if a == ":":
                parts.append([])
            else:
                parts[-1].append(a)
        comment = next((a.split("=", 1)[1] for a in parts[0] if a.startswith("--comment=")), "")
        comps = []
        for offset, opts in enumerate(parts):
            nodelist = next((a.split("=", 1)[1] for a in opts if a.startswith("--nodelist=")), "")
            comps.append(HetComponent(job_id + offset, job_id, offset, JobState.PENDING, tuple(expand(nodelist))
                                      if nodelist else ()))
        self.job_table[job_id] = Job(job_id, "tiny", self.user, JobState.PENDING, "PENDING", tuple(comps),
                                     comment=comment)
        self.submitted.append((job_id, Path(script_path).read_text(), list(args)))
        return job_id

    def cancel(self, job_id: str, *, signal: str | None = None, batch_only: bool = False) -> None:
        self.cancelled.append((job_id, signal))
        if signal is None and int(job_id) in self.job_table:
            self.set_job(int(job_id), JobState.CANCELLED)

    def requeue(self, job_ref: str, *, hold: bool = False) -> None:
        self.requeued.append(job_ref)
        for job_id, job in self.job_table.items():
            if job.array_ref == job_ref:
                self.job_table[job_id] = dataclasses.replace(job, state=JobState.PENDING, slurm_state="PENDING",
                                                             restart_count=job.restart_count + 1)

    def set_node_state(self, node: str, state: str, reason: str = "") -> None:
        self.drained.append((node, state, reason))
        self.states[node] = NodeState.DRAINED if state == "DRAIN" else NodeState.IDLE
        self.reasons[node] = reason

    # -- test controls ---------------------------------------------------------------------------
    def add_job(self, job_id: int, nodes: Sequence[Sequence[str]], *, state: JobState = JobState.RUNNING,
                user: str | None = None, array: tuple[int, int] | None = None) -> None:
        comps = tuple(HetComponent(job_id + i, job_id, i, state, tuple(n)) for i, n in enumerate(nodes))
        self.job_table[job_id] = Job(job_id, "tiny", user or self.user, state, state.value.upper(), comps,
                                     array_job_id=array[0] if array else None,
                                     array_task_id=array[1] if array else None)

    def set_job(self, job_id: int, state: JobState, nodes: Sequence[Sequence[str]] | None = None) -> None:
        job = self.job_table[job_id]
        comps = tuple(dataclasses.replace(c, state=state, nodes=tuple(nodes[i]) if nodes else c.nodes)
                      for i, c in enumerate(job.components))
        self.job_table[job_id] = dataclasses.replace(job, state=state, slurm_state=state.value.upper(),
                                                     components=comps)

    def tagged(self, tag: str) -> list[int]:
        return [j.job_id for j in self.job_table.values() if j.comment == tag]


@dataclass
class Setup:
    root: Path
    clock: Clock
    slurm: FakeSlurm
    config: ManagerConfig
    job_file: Path

    @property
    def heartbeat_dir(self) -> Path:
        return self.root / "ckpt" / "tiny" / "heartbeat"

    def manager(self) -> Manager:
        return Manager(self.config, self.slurm, clock=self.clock)

    def register(self, job_id: int, dp: int = 1, *, kind: str = "het", tasks: int = 0) -> Path:
        digest = hashlib.sha256(self.job_file.read_bytes()).hexdigest()
        stages = tuple(StagePlan(i, name, name, dp, 1, "gpu:h100:4", 1, "10:00", 0)
                       for i, name in enumerate(("vision", "text")))
        array = tuple({"task_id": t, "job_file": str(self.job_file), "name": f"tiny{t}", "job_sha256": digest,
                       "ckpt_dir": str(self.root / "ckpt" / f"tiny{t}")} for t in range(tasks)) if tasks else None
        return register(self.root / "registry", Registration(
            job_id=job_id, kind=kind, name="tiny", cluster="omni", job_file=self.job_file,  # type: ignore[arg-type]
            job_sha256=digest, script=None, ckpt_dir=self.root / "ckpt" / "tiny", data_parallel_size=dp,
            max_requeues=3, stages=stages, array_tasks=array))


def make_setup(root: Path, *, dp: int = 1, drain: bool = False, **config: object) -> Setup:
    for sub in ("spool", "registry", "ckpt/tiny/heartbeat"):
        (root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / "site.toml").write_text(SITE.format(root=root, drain="true" if drain else "false"))
    job_file = root / "job.toml"
    job_file.write_text(JOB.format(dp=dp))
    clock = Clock()
    site = load_site(root / "site.toml")
    cfg = ManagerConfig(site=site, state_dir=root / "state", poll_interval_s=0.0, **config)  # type: ignore[arg-type]
    return Setup(root, clock, FakeSlurm(clock), cfg, job_file)


def beat(directory: Path, rank: int, *, stage: int, job_id: int, step: int, at: float, phase: str = "training",
         incarnation: int = 0, dp_rank: int = 0, last_checkpoint_step: int | None = None) -> None:
    """A heartbeat file as runtime/heartbeat.py writes it (temporary name, then rename)."""
    record = {"rank": rank, "stage": stage, "dp_rank": dp_rank, "pid": 1000 + rank, "incarnation": incarnation,
              "job_id": str(job_id), "step": step, "phase": phase, "time": at, "step_time_s": 0.5,
              "last_checkpoint_step": last_checkpoint_step, "beats": int(at * 10) % 100000}
    tmp = directory / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / f"rank-{rank}.json")


def fault(spool: Path, *, job_id: int, het_offset: int, node: str, task_id: int, at: float,
          signal: int | None = 9, exit_code: int | None = None) -> Path:
    """A fault record as spank/fault.c writes it."""
    record = {"version": 1, "kind": "task_exit", "job_id": job_id + het_offset, "het_job_id": job_id,
              "het_offset": het_offset, "step_id": 0, "node": node, "stage": ["vision", "text"][het_offset],
              "stage_rank": 0, "task_id": task_id, "local_task_id": 0, "pid": 4242, "exit_code": exit_code,
              "signal": signal, "core_dumped": False, "time": "2026-11-30T00:00:00Z", "time_unix": at}
    path = spool / f"fault-{job_id}.0-{node}-{task_id}-{int(at * 1e9)}.json"
    path.write_text(json.dumps(record))
    return path
