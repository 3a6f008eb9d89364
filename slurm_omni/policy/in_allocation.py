"""In-allocation recovery: which nodes each launch of the step runs on. Pure: no command, no clock.

An in-allocation job holds one homogeneous ``--no-kill`` allocation: every stage's nodes plus its
spares. The step supervisor launches the stages as one heterogeneous (MPMD) step over the *active*
nodes of each component; the allocation's other nodes are the spare pool. After a confirmed failure
(``policy.confirm``, the one rule) the next launch is planned by the one placement policy
(``policy.placement.plan_recovery``) over an index of the allocation's own nodes, in which the spare
pool is what is "free": the survivors plus a spare of the same kind, the survivors' leaf switch
first; with too few spares fewer placement units (fewer data-parallel replicas, same global batch),
down to the minimum; below it a ``Fallback`` to the manager's resubmission. A node that failed is
never used again by the job: it leaves the pool for good.

A placement unit is as in ``manager/shape.py``: ``g = gcd(stage nodes)`` units, each holding
``nodes / g`` nodes of every stage and ``dp / g`` replicas, so a shrink keeps tasks per node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from slurm_omni.errors import ConfigError
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.confirm import Decision
from slurm_omni.policy.placement import (
    Action,
    ComponentLayout,
    JobLayout,
    PlacementConfig,
    SpareScope,
    nodes_to_replace,
    plan_recovery,
)
from slurm_omni.slurm.types import Node, NodeState, Topology

REQUEUE_INCARNATION_STRIDE = 100
"""An in-allocation job numbers its lives ``base + REQUEUE_INCARNATION_STRIDE x SLURM_RESTART_COUNT + launch``
(the supervisor's relaunches inside one allocation are its launches, fewer than this): the batch
script (``inalloc.sbatch.j2``), the supervisor's step names and the manager's judged life agree on it."""

KIND_PREFIX = "omni-kind:"
"""The pseudo partition that says which stage kind a node of the allocation can serve."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage as the supervisor gets it: ``NAME:NODES:TASKS_PER_NODE:SPARES[:FEATURE]``."""

    name: str
    nodes: int
    tasks_per_node: int
    spares: int
    feature: str = ""

    @property
    def kind(self) -> str:
        return KIND_PREFIX + self.feature


def parse_stages(text: str) -> tuple[StageSpec, ...]:
    """``vision:1:2:1,text:1:2:1`` -> stages; ConfigError naming the form otherwise."""
    stages = []
    for part in text.split(","):
        fields = part.split(":")
        try:
            if len(fields) not in (4, 5) or not fields[0]:
                raise ValueError(part)
            nodes, tpn, spares = (int(f) for f in fields[1:4])
        except ValueError as e:
            raise ConfigError(f"supervisor: --stages {text!r} is not allowed (expected "
                              f"NAME:NODES:TASKS_PER_NODE:SPARES[:FEATURE] per stage, comma-separated)") from e
        if nodes < 1 or tpn < 1 or spares < 0:
            raise ConfigError(f"supervisor: --stages {part!r} is not allowed (nodes and tasks_per_node >= 1, "
                              f"spares >= 0)")
        stages.append(StageSpec(fields[0], nodes, tpn, spares, fields[4] if len(fields) == 5 else ""))
    return tuple(stages)


def units_of(stages: Sequence[StageSpec]) -> int:
    return math.gcd(*(s.nodes for s in stages))


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where one launch runs: the active nodes per component, the spare pool, the nodes lost."""

    components: tuple[tuple[str, ...], ...]
    spares: tuple[str, ...]
    failed: tuple[str, ...] = ()
    units: int = 1
    kind_of: Mapping[str, str] = field(default_factory=dict)
    """Node -> the kind of stage it can serve (its stage's feature; "" when all nodes are alike)."""

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for c in self.components for n in c)

    def spares_for(self, stage: StageSpec) -> tuple[str, ...]:
        return tuple(n for n in self.spares if self.kind_of.get(n, "") == stage.feature)


def first_layout(stages: Sequence[StageSpec], allocation: Sequence[str], *,
                 features: Mapping[str, Iterable[str]] | None = None,
                 leaf_of: Mapping[str, str] | None = None) -> StepLayout:
    """The first launch's layout over the allocation's nodes (Slurm's order, which follows the
    topology): each stage takes its nodes in order (a stage with a feature only nodes with it), and
    the rest are spares. Without features every node can serve any stage."""
    feats = {n: frozenset(f) for n, f in (features or {}).items()}
    leaf = leaf_of or {}
    left = list(allocation)
    components: list[tuple[str, ...]] = []
    kind_of: dict[str, str] = {}
    for stage in stages:
        fits = [n for n in left if not stage.feature or stage.feature in feats.get(n, frozenset())]
        if len(fits) < stage.nodes:
            raise ConfigError(f"supervisor: couldn't place stage {stage.name!r}: it needs {stage.nodes} node(s)"
                              + (f" with feature {stage.feature!r}" if stage.feature else "")
                              + f", the allocation has {len(fits)} left of {list(allocation)}")
        # a stage's nodes together: the first leaf switch (in Slurm's order) that holds all of them
        by_leaf: dict[str, int] = {}
        rank: dict[str, int] = {}
        for n in fits:
            by_leaf[leaf.get(n, "")] = by_leaf.get(leaf.get(n, ""), 0) + 1
            rank.setdefault(leaf.get(n, ""), len(rank))
        fits.sort(key=lambda n: (by_leaf[leaf.get(n, "")] < stage.nodes, rank[leaf.get(n, "")]))
        chosen = tuple(sorted(fits[:stage.nodes], key=list(allocation).index))
        components.append(chosen)
        for n in chosen:
            left.remove(n)
            kind_of[n] = stage.feature
    for n in left:
        kinds = [s.feature for s in stages if s.feature and s.feature in feats.get(n, frozenset())]
        kind_of[n] = kinds[0] if kinds else ""
    return StepLayout(tuple(components), tuple(left), (), units_of(stages), kind_of)


@dataclass(frozen=True, slots=True)
class Relaunch:
    """Launch the step again inside the allocation."""

    layout: StepLayout
    removed: tuple[str, ...]
    added: tuple[str, ...]
    units_before: int
    reasons: tuple[str, ...]

    @property
    def shrunk(self) -> bool:
        return self.layout.units < self.units_before


@dataclass(frozen=True, slots=True)
class Fallback:
    """No launch fits the allocation any more: the manager resubmits, excluding ``failed``."""

    failed: tuple[str, ...]
    reasons: tuple[str, ...]


def _index(layout: StepLayout, nodes: Mapping[str, Node], topology: Topology,
           failed: set[str]) -> ClusterIndex:
    """The allocation as the placement policy sees it: spares free, active nodes busy, lost nodes
    down; every node in the pseudo partition of the stage kind it can serve."""
    members: list[Node] = []
    for name in (*layout.nodes, *layout.spares, *layout.failed):
        real = nodes.get(name)
        kind = layout.kind_of.get(name, "")
        parts = (KIND_PREFIX + kind,)
        if name in failed or name in layout.failed or (real is not None and real.state.failed):
            state, flags = NodeState.DOWN, frozenset({"FAIL"})
        elif name in layout.spares:
            state, flags = NodeState.IDLE, frozenset()
        else:
            state, flags = NodeState.ALLOCATED, frozenset()
        if real is not None and real.flags & {"NOT_RESPONDING", "DRAIN", "FAIL"}:
            state, flags = NodeState.DOWN, real.flags
        members.append(Node(name, state, state.name, flags, partitions=parts,
                            switch_path=real.switch_path if real is not None else ()))
    return ClusterIndex.build(topology, members)


def _marked_down(index: ClusterIndex, failed: set[str]) -> ClusterIndex:
    """``index`` with ``failed`` down, as :func:`_index` marks them: the same nodes on the same switches,
    so the switch maps are kept (rebuilt, they were a third of decide's CPU at 512 nodes; issue 19)."""
    down = {name: replace(node, state=NodeState.DOWN, slurm_state=NodeState.DOWN.name,
                          flags=node.flags if node.flags & {"NOT_RESPONDING", "DRAIN", "FAIL"} else frozenset({"FAIL"}))
            for name in failed if (node := index.nodes.get(name)) is not None and node.state is not NodeState.DOWN}
    return replace(index, nodes={**index.nodes, **down}) if down else index


def plan_relaunch(stages: Sequence[StageSpec], layout: StepLayout, decision: Decision, *,
                  nodes: Mapping[str, Node], topology: Topology, now: float, min_units: int = 1,
                  units_divide: int = 0, spare_scope: SpareScope = "any_switch") -> Relaunch | Fallback:
    """The next launch after the CONFIRMED ``decision`` on the launch running on ``layout``.

    ``nodes``: the cluster's view of the allocation's nodes (sinfo), for their health and switch.
    Nodes a node-state signal named, or that Slurm no longer shows healthy, are replaced; a rank
    that crashed on a healthy node is relaunched where it was."""
    per_unit = [s.nodes // units_of(stages) for s in stages]
    job = JobLayout(tuple(ComponentLayout(k, layout.components[k], per_unit[k], stages[k].kind)
                          for k in range(len(stages))), units=layout.units, target_units=units_of(stages))
    index = _index(layout, nodes, topology, set())
    failed = set(nodes_to_replace(decision, index, job))
    index = _marked_down(index, failed)
    config = PlacementConfig(min_units=min_units, spare_wait_s=0.0, quarantine_s=float("inf"),
                             units_divide=units_divide, spare_scope=spare_scope, spare_nodes=layout.spares)
    plan = plan_recovery(index, job, failed, now=now, fault_at=now, config=config)
    all_failed = tuple(sorted(set(layout.failed) | failed))
    if plan.action is Action.WAIT:
        return Fallback(all_failed, plan.reasons)
    components = tuple(c.nodes for c in sorted(plan.components, key=lambda c: c.het_offset))
    used = {n for c in components for n in c}
    added = tuple(n for c in plan.components for n in c.added)
    removed = tuple(n for c in plan.components for n in c.removed)
    # nodes a shrink let go of go back to the pool, unless they failed
    spares = tuple(n for n in (*layout.spares, *removed) if n not in used and n not in failed)
    new = StepLayout(components, spares, all_failed, plan.units, layout.kind_of)
    return Relaunch(new, removed, added, layout.units, plan.reasons)
