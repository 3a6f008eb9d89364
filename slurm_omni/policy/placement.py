"""Replacement placement, shrink and grow: pure planning over a ``ClusterIndex``.

Layout model: a job runs ``units`` placement units; each unit needs ``nodes_per_unit`` nodes of
*every* component (one vision rank-set and one text rank-set), so the stages shrink and grow
together. A unit holds one or more data-parallel replicas (``manager/shape.py``: ``dp / units``);
the planner counts units only, never replicas.

Replacements for a component come from, in order: the leaf switches of its surviving nodes (the
leaf holding most survivors first), then the leaves under the lowest common switch above them, and
so on up the tree; when the whole component is lost, the leaves where its failed nodes were. A
candidate is free (idle, no drain/maint flag), in the component's partition, has the gres the
component needs per node, is not quarantined and is not used by the job already.

Not enough candidates: WAIT until ``fault_at + spare_wait_s``, then SHRINK to the most units
every component can fill (at least ``min_units``, dividing ``units_divide`` when set); below the
minimum it keeps WAITing. ``plan_grow`` proposes GROW when
spares return.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from slurm_omni.errors import ConfigError
from slurm_omni.policy.cluster_index import NO_SWITCH, ClusterIndex
from slurm_omni.policy.confirm import Decision
from slurm_omni.slurm.types import Gres, NodeState

DRAIN_PREFIX = "omni:"

SpareScope = Literal["same_switch", "any_switch", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementConfig:
    min_units: int = 1
    """Never shrink below this many placement units."""
    spare_wait_s: float = 0.0
    """Wait this long after the fault for spares before shrinking (0: shrink at once)."""
    quarantine_s: float = 3600.0
    """A failed node is not chosen again for this long."""
    drain_failed: bool = False
    """Ask Slurm to drain failed nodes (reason starting with 'omni:')."""
    allow_mixed: bool = False
    """Nodes partly used by other jobs count as free."""
    units_divide: int = 0
    """When set, a unit count must divide this (the global batch in units' micro-batches)."""
    spare_scope: SpareScope = "any_switch"
    """Where replacements may come from: the survivors' leaf switches only, anywhere (nearest
    first), or nowhere (shrink or wait only). The site's ``elasticity.spare_policy``."""
    spare_nodes: tuple[str, ...] = ()
    """When not empty, replacements come only from these nodes (the site's held-back spares)."""

    def __post_init__(self) -> None:
        if self.min_units < 1:
            raise ConfigError(f"min_units = {self.min_units} must be at least 1")
        if self.spare_wait_s < 0 or self.quarantine_s < 0:
            raise ConfigError("spare_wait_s and quarantine_s must not be negative")
        if self.units_divide < 0:
            raise ConfigError(f"units_divide = {self.units_divide} must not be negative")
        if self.units_divide and self.units_divide % self.min_units:
            raise ConfigError(f"min_units = {self.min_units} does not divide "
                              f"units_divide = {self.units_divide}")


@dataclass(frozen=True, slots=True)
class ComponentLayout:
    """One het component as submitted: its nodes, what each node needs, where it may run."""

    het_offset: int
    nodes: tuple[str, ...]
    nodes_per_unit: int
    partition: str = ""
    gres: tuple[Gres, ...] = ()     # needed on every node, e.g. (Gres("gpu", "h100", 4),)


@dataclass(frozen=True, slots=True)
class JobLayout:
    components: tuple[ComponentLayout, ...]
    units: int
    target_units: int = 0    # the units the job was registered with (0: the current)

    def __post_init__(self) -> None:
        for c in self.components:
            if c.nodes_per_unit < 1 or len(c.nodes) != c.nodes_per_unit * self.units:
                raise ConfigError(f"component {c.het_offset}: {len(c.nodes)} nodes is not "
                                  f"{c.nodes_per_unit} per unit x {self.units} unit(s)")

    @property
    def target(self) -> int:
        return self.target_units or self.units

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for c in self.components for n in c.nodes)


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Nodes that failed recently -> until when they are not chosen."""

    until: Mapping[str, float] = field(default_factory=dict)

    def active(self, now: float) -> frozenset[str]:
        return frozenset(n for n, t in self.until.items() if t > now)

    def add(self, nodes: Iterable[str], now: float, seconds: float) -> Quarantine:
        merged = {n: t for n, t in self.until.items() if t > now}
        for n in nodes:
            merged[n] = max(merged.get(n, 0.0), now + seconds)
        return Quarantine(merged)


class Action(enum.Enum):
    RESUBMIT = "resubmit"   # same data-parallel size, failed nodes replaced
    SHRINK = "shrink"       # fewer replicas on the nodes there are
    WAIT = "wait"           # nothing to submit yet
    GROW = "grow"           # more replicas: spares came back


@dataclass(frozen=True, slots=True)
class ComponentPlan:
    het_offset: int
    nodes: tuple[str, ...]
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    leaf_switches: int = 0
    """The leaf switches ``nodes`` span in the topology (0: none known): the ``--switches`` count a
    submission pinned to these nodes needs, or Slurm holds it up to the wait the count came with."""


@dataclass(frozen=True, slots=True)
class Plan:
    action: Action
    units: int
    components: tuple[ComponentPlan, ...] = ()
    exclude: tuple[str, ...] = ()                     # for --exclude
    drain: tuple[tuple[str, str], ...] = ()           # (node, reason) pairs; reasons start 'omni:'
    quarantine: Quarantine = field(default_factory=Quarantine)   # the updated quarantine to keep
    wait_until: float | None = None
    reasons: tuple[str, ...] = ()

    def nodelist(self, het_offset: int) -> tuple[str, ...]:
        return next(c.nodes for c in self.components if c.het_offset == het_offset)


def leaf_switches(index: ClusterIndex, nodes: Iterable[str]) -> int:
    """How many leaf switches ``nodes`` span (nodes no switch lists do not count)."""
    return len({index.leaf_of.get(n, NO_SWITCH) for n in nodes} - {NO_SWITCH})


def nodes_to_replace(decision: Decision, index: ClusterIndex, layout: JobLayout) -> tuple[str, ...]:
    """Which nodes a confirmed failure takes out: those a node-state signal named, plus any node of
    the job that is no longer healthy. A task that died on a healthy node (or a hang) keeps it."""
    named = set(decision.nodes) if decision.cause in ("down", "fail", "not_responding", "drain") else set()
    return tuple(n for n in layout.nodes if n in named or not index.is_healthy(n))


def _drained(index: ClusterIndex, name: str) -> bool:
    node = index.nodes[name]
    return "DRAIN" in node.flags or node.state in (NodeState.DRAINED, NodeState.DRAINING)


def _fits(index: ClusterIndex, name: str, comp: ComponentLayout) -> bool:
    node = index.nodes[name]
    if comp.partition and comp.partition not in node.partitions:
        return False
    return all(node.gres_count(g.name, g.type) >= g.count for g in comp.gres)


def _pick(index: ClusterIndex, comp: ComponentLayout, anchors: Sequence[str], want: int,
          blocked: set[str], config: PlacementConfig) -> tuple[list[str], list[str]]:
    """Up to ``want`` candidates nearest the anchor nodes, and one reason per ring used."""
    if config.spare_scope == "none" or want <= 0:
        return [], []
    only = frozenset(config.spare_nodes)
    weights: dict[str, int] = {}
    for n in anchors:
        leaf = index.leaf_of.get(n)
        if leaf is not None:
            weights[leaf] = weights.get(leaf, 0) + 1
    chosen: list[str] = []
    reasons: list[str] = []
    for ring in index.rings(weights):
        before = len(chosen)
        for leaf in ring.leaves:
            for name in index.by_leaf[leaf]:
                if name in blocked or not index.is_free(name, allow_mixed=config.allow_mixed):
                    continue
                if only and name not in only:
                    continue
                if _fits(index, name, comp):
                    chosen.append(name)
                    if len(chosen) == want:
                        break
            if len(chosen) == want:
                break
        if len(chosen) > before:
            where = ("the survivors' leaf switch" if ring.hops == 0 else
                     f"lowest common switch {ring.via}" if ring.via else "elsewhere in the cluster")
            reasons.append(f"component {comp.het_offset}: {len(chosen) - before} node(s) on {where}")
        if len(chosen) == want or config.spare_scope == "same_switch":
            break
    return chosen, reasons


def _fit_units(dp: int, config: PlacementConfig) -> int:
    """The most units allowed <= dp (0 when none)."""
    while dp >= 1 and config.units_divide and config.units_divide % dp:
        dp -= 1
    return max(dp, 0)


def plan_recovery(index: ClusterIndex, layout: JobLayout, failed: Iterable[str], *, now: float,
                  fault_at: float, quarantine: Quarantine = Quarantine(),
                  config: PlacementConfig = PlacementConfig(), drain_reason: str = "") -> Plan:
    """Plan the next incarnation after the confirmed loss of ``failed`` nodes."""
    failed_set = set(failed) | {n for n in layout.nodes if not index.is_healthy(n)}
    new_quarantine = quarantine.add(sorted(failed_set), now, config.quarantine_s)
    blocked = set(layout.nodes) | set(new_quarantine.active(now))
    exclude = tuple(sorted(failed_set | new_quarantine.active(now)))
    drain: tuple[tuple[str, str], ...] = ()
    if config.drain_failed:
        reason = f"{DRAIN_PREFIX} {drain_reason}".strip() if drain_reason else f"{DRAIN_PREFIX} failed"
        drain = tuple((n, reason) for n in sorted(failed_set)
                      if n in index.nodes and not _drained(index, n))
    held = set(quarantine.active(now))   # a node of the job quarantined earlier is not kept either
    survivors = {c.het_offset: [n for n in c.nodes if n not in failed_set and n not in held]
                 for c in layout.components}
    found: dict[int, list[str]] = {}
    reasons: list[str] = []
    # the component that lost most goes first: it has the least room to be picky
    for comp in sorted(layout.components, key=lambda c: (len(survivors[c.het_offset]) - len(c.nodes),
                                                         c.het_offset)):
        want = len(comp.nodes) - len(survivors[comp.het_offset])
        if want == 0:
            found[comp.het_offset] = []
            continue
        anchors = survivors[comp.het_offset] or list(comp.nodes)   # all lost: where it was
        picked, why = _pick(index, comp, anchors, want, blocked, config)
        blocked.update(picked)
        found[comp.het_offset] = picked
        reasons.extend(why)
        if len(picked) < want:
            reasons.append(f"component {comp.het_offset}: {len(picked)} of {want} replacement(s) found")
    short = [c for c in layout.components
             if len(survivors[c.het_offset]) + len(found[c.het_offset]) < len(c.nodes)]
    base = Plan(Action.WAIT, layout.units, exclude=exclude, drain=drain,
                quarantine=new_quarantine)
    if not short:
        return replace(base, action=Action.RESUBMIT,
                       components=_components(index, layout, survivors, found, layout.units),
                       reasons=tuple(reasons or ["no node lost: resubmit on the same nodes"]))
    deadline = fault_at + config.spare_wait_s
    if now < deadline:
        return replace(base, wait_until=deadline,
                       reasons=(*reasons, f"waiting for spares until {deadline:.0f}"))
    dp = _fit_units(min((len(survivors[c.het_offset]) + len(found[c.het_offset])) // c.nodes_per_unit
                     for c in layout.components), config)
    if dp < config.min_units:
        short_why = f"only {dp} placement unit(s) possible, below the minimum {config.min_units}: waiting for nodes"
        return replace(base, reasons=(*reasons, short_why))
    return replace(base, action=Action.SHRINK, units=dp,
                   components=_components(index, layout, survivors, found, dp),
                   reasons=(*reasons, f"shrink {layout.units} -> {dp} placement unit(s)"))


def _components(index: ClusterIndex, layout: JobLayout, keep: Mapping[int, list[str]],
                found: Mapping[int, list[str]], dp: int) -> tuple[ComponentPlan, ...]:
    out = []
    for c in layout.components:
        nodes = (keep[c.het_offset] + found[c.het_offset])[:dp * c.nodes_per_unit]
        old = set(c.nodes)
        out.append(ComponentPlan(c.het_offset, tuple(nodes), tuple(n for n in nodes if n not in old),
                                 tuple(n for n in c.nodes if n not in set(nodes)), leaf_switches(index, nodes)))
    return tuple(out)


def plan_grow(index: ClusterIndex, layout: JobLayout, *, now: float, quarantine: Quarantine = Quarantine(),
              config: PlacementConfig = PlacementConfig()) -> Plan | None:
    """A GROW plan when free nodes allow more replicas (up to the target size), else None."""
    if layout.units >= layout.target:
        return None
    blocked = set(layout.nodes) | set(quarantine.active(now))
    found: dict[int, list[str]] = {}
    reasons: list[str] = []
    extra = layout.target - layout.units
    for comp in layout.components:
        picked, why = _pick(index, comp, comp.nodes, extra * comp.nodes_per_unit, blocked, config)
        blocked.update(picked)
        found[comp.het_offset] = picked
        reasons.extend(why)
    more = min(len(found[c.het_offset]) // c.nodes_per_unit for c in layout.components)
    dp = _fit_units(layout.units + more, config)
    if dp <= layout.units:
        return None
    keep = {c.het_offset: list(c.nodes) for c in layout.components}
    return Plan(Action.GROW, dp, _components(index, layout, keep, found, dp),
                exclude=tuple(sorted(quarantine.active(now))), quarantine=quarantine,
                reasons=(*reasons, f"grow {layout.units} -> {dp} placement unit(s)"))
