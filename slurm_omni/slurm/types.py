"""What slurm-omni knows of nodes, switches and jobs, independent of how it was read."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class NodeState(enum.Enum):
    """Our node states. Slurm's base states and flags map here through ``states.node_state``."""

    IDLE = "idle"
    ALLOCATED = "allocated"
    MIXED = "mixed"
    DOWN = "down"
    DRAINED = "drained"      # DRAIN flag and nothing running
    DRAINING = "draining"    # DRAIN flag while jobs still run
    FAIL = "fail"
    NOT_RESPONDING = "not_responding"
    FUTURE = "future"
    UNKNOWN = "unknown"

    @property
    def usable(self) -> bool:
        """Can the scheduler place new work here."""
        return self in (NodeState.IDLE, NodeState.MIXED, NodeState.ALLOCATED)

    @property
    def failed(self) -> bool:
        """Is this a level-1 infrastructure failure signal."""
        return self in (NodeState.DOWN, NodeState.FAIL, NodeState.NOT_RESPONDING,
                        NodeState.DRAINED, NodeState.DRAINING)


class JobState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPLETING = "completing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    NODE_FAIL = "node_fail"
    PREEMPTED = "preempted"
    REQUEUED = "requeued"
    OUT_OF_MEMORY = "out_of_memory"
    BOOT_FAIL = "boot_fail"
    DEADLINE = "deadline"
    UNKNOWN = "unknown"

    @property
    def finished(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING, JobState.SUSPENDED,
                            JobState.COMPLETING, JobState.REQUEUED, JobState.UNKNOWN)


@dataclass(frozen=True, slots=True)
class Gres:
    """One generic resource, e.g. ``gpu:h100:4``."""

    name: str
    type: str | None
    count: int

    def __str__(self) -> str:
        return f"{self.name}:{self.type}:{self.count}" if self.type else f"{self.name}:{self.count}"


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    state: NodeState
    slurm_state: str                       # Slurm's own words, e.g. "IDLE+DRAIN"
    flags: frozenset[str] = frozenset()    # e.g. {"DRAIN", "NOT_RESPONDING"}
    reason: str = ""
    gres: tuple[Gres, ...] = ()
    partitions: tuple[str, ...] = ()
    cpus: int = 0
    switch_path: tuple[str, ...] = ()      # root switch first, leaf switch last

    @property
    def leaf_switch(self) -> str | None:
        return self.switch_path[-1] if self.switch_path else None

    def gres_count(self, name: str, type: str | None = None) -> int:
        return sum(g.count for g in self.gres if g.name == name and (type is None or g.type == type))


@dataclass(frozen=True, slots=True)
class Switch:
    """A switch of ``topology/tree``: its own nodes (leaf) or child switches, and its level."""

    name: str
    level: int                              # 0 for a leaf switch
    nodes: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    link_speed: int = 1


@dataclass(frozen=True, slots=True)
class Topology:
    switches: dict[str, Switch] = field(default_factory=dict)
    _paths: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, compare=False, repr=False)

    def parent_of(self) -> dict[str, str]:
        """Child switch name -> parent switch name."""
        return {child: s.name for s in self.switches.values() for child in s.switches}

    def switch_path(self, node: str) -> tuple[str, ...]:
        """Switches from the root down to the node's leaf switch; () when the node is on none.
        Every node's path is worked out on the first call (one pass over the tree), so a parse of
        10,000 nodes does not scan the switches once per node."""
        if not self._paths and self.switches:
            parents = self.parent_of()
            for s in self.switches.values():
                path = [s.name]
                while path[-1] in parents and len(path) <= len(self.switches):
                    path.append(parents[path[-1]])
                for name in s.nodes:
                    self._paths.setdefault(name, tuple(reversed(path)))
        return self._paths.get(node, ())


@dataclass(frozen=True, slots=True)
class HetComponent:
    """One component of a heterogeneous job, or the whole of an ordinary one (offset 0)."""

    job_id: int                # this component's own id (leader + offset)
    het_job_id: int            # the leader's id; equals job_id for an ordinary job
    het_offset: int
    state: JobState
    nodes: tuple[str, ...]
    partition: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Job:
    """A job as one unit: a heterogeneous job's components, or one ordinary or array job."""

    job_id: int                              # the leader's id for a het job
    name: str
    user: str
    state: JobState
    slurm_state: str
    components: tuple[HetComponent, ...]
    restart_count: int = 0
    array_job_id: int | None = None
    array_task_id: int | None = None
    reason: str = ""
    comment: str = ""
    submit_time: float | None = None          # epoch seconds as slurmctld recorded the submission
    batch_host: str = ""                      # where the batch script runs (squeue --json batch_host)

    @property
    def array_ref(self) -> str | None:
        """``<array>_<task>`` as scontrol takes it, for an array task."""
        if self.array_job_id is None or self.array_task_id is None:
            return None
        return f"{self.array_job_id}_{self.array_task_id}"

    @property
    def is_het(self) -> bool:
        return len(self.components) > 1

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for c in self.components for n in c.nodes)
