"""Capacity comes back: pool allocations of the nodes a shrunk job misses, and the grow-back. Pure:
no command, no clock (``now`` is passed in), no file.

Slurm cannot grow a running job. A job in allocation mode (docs/allocation-mode.md) whose spares
are used up runs with fewer data-parallel replicas (``policy.in_allocation.plan_relaunch``); the
supervisor then asks Slurm for a *pool allocation* of the nodes it misses, in the background while
training goes on (:func:`pool_ask`: how many nodes of each stage kind, the job's own partition,
gres, constraint and switch preference, no longer than the job's own allocation lives:
:func:`pool_minutes`). When the pool starts, the next launch spans the allocations: the ranks
checkpoint, and the job relaunches at its full data-parallel size on the survivors plus the pool's
nodes (:func:`grow_plan`), one srun per allocation and one rendezvous
(``slurm.steps.span_argvs``). The pool is released when the job ends.

The same mechanism serves the time limit: a *successor* allocation of the job's whole shape asked
:func:`successor_due` ahead of the limit, so its queue wait overlaps training
(:func:`successor_lead_s`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from slurm_omni.elastic.codes import EXIT_CHECKPOINTED, EXIT_DONE
from slurm_omni.policy.in_allocation import Relaunch, StageSpec, StepLayout, units_of
from slurm_omni.policy.placement import SpareScope

POOL_STATES = ("asking", "requested", "granted", "ended", "released")
"""A pool's life in the supervisor's journal: ``asking`` (the salloc is about to start: a supervisor
that dies before it learns the job id finds it by name), ``requested`` (Slurm's job id, pending),
``granted`` (running, its nodes), ``ended`` (Slurm ended it: refused, cancelled, time limit),
``released`` (the supervisor gave it back)."""

OPEN_STATES = frozenset({"asking", "requested", "granted"})
WAITING = frozenset({"asking", "requested"})
"""A pool not started yet: no other is asked for meanwhile (nor while a granted one's nodes wait for
the grow-back; once the job's launches took them in, a shrink after them asks again)."""

GROW = "grow"
"""The cause of a launch that grows the job back onto a pool allocation's nodes."""


@dataclass(frozen=True, slots=True)
class Pool:
    """One pool allocation as the journal knows it."""

    job_id: str
    state: str
    name: str = ""
    nodes: tuple[str, ...] = ()
    kind_of: Mapping[str, str] = field(default_factory=dict)
    """Node -> the stage kind it can serve (its stage's feature; "" when nodes are alike)."""

    @property
    def open(self) -> bool:
        return self.state in OPEN_STATES


@dataclass(frozen=True, slots=True)
class PoolAsk:
    """What to ask Slurm for: ``nodes`` in all; per stage kind (feature) how many, when the stages
    are told apart by features (``--constraint`` counts); ``switches``: the nodes under at most
    that many leaf switches (0: no preference); ``minutes``: its time limit; ``exclude``: the nodes
    the job lost, which the pool must not bring back (an admin may have resumed one: the job does
    not take it again, so a pool granted on it would be asked for once more)."""

    nodes: int
    per_kind: tuple[tuple[str, int], ...]
    switches: int
    minutes: int
    reason: str
    exclude: tuple[str, ...] = ()


def missing_nodes(stages: Sequence[StageSpec], layout: StepLayout) -> dict[str, int]:
    """Stage kind (feature) -> nodes the job lacks for its full data-parallel size, less the spares of
    that kind it still holds (a shrink can leave spares of another kind)."""
    need: dict[str, int] = {}
    for k, stage in enumerate(stages):
        lacking = max(0, stage.nodes - len(layout.components[k])) if k < len(layout.components) else stage.nodes
        need[stage.feature] = need.get(stage.feature, 0) + lacking
    for kind in list(need):
        held = sum(1 for n in layout.spares if layout.kind_of.get(n, "") == kind)
        need[kind] = max(0, need[kind] - held)
    return {k: v for k, v in need.items() if v > 0}


def pool_minutes(end_time: float | None, now: float, *, default_minutes: int) -> int:
    """The pool's time limit: no longer than the job's own allocation still lives (a pool that
    outlived it would hold nodes for nothing), at least one minute; ``default_minutes`` without an
    end time."""
    if end_time is None:
        return max(1, default_minutes)
    return max(1, math.ceil((end_time - now) / 60.0))


def pool_ask(stages: Sequence[StageSpec], layout: StepLayout, pools: Iterable[Pool], *, end_time: float | None,
             now: float, default_minutes: int, spare_scope: SpareScope = "any_switch", max_asks: int = 3,
             min_minutes: int = 2) -> PoolAsk | None:
    """Ask for a pool now? Only while the job runs shrunk (fewer units than its stages' full size)
    with no pool waiting (asking, pending, or granted with nodes the launches have not taken in yet:
    the grow-back onto them is coming), at most ``max_asks`` in the job's life (a pool
    Slurm ends before it starts is asked for again, not forever), and only when the allocation lives
    at least ``min_minutes`` more (a grow-back needs a relaunch and some training to pay for it).
    Switches: the placement policy's preference, the pool's nodes under one leaf switch unless the
    site's spare policy is ``none``; Slurm cannot be told *which* leaf (the survivors'), so the
    survivors' leaf first is only what the next plan prefers among the nodes it gets."""
    seen = list(pools)
    known = {*layout.nodes, *layout.spares, *layout.failed}
    pending = any(p.state in WAITING or (p.state == "granted" and not set(p.nodes) <= known) for p in seen)
    if layout.units >= units_of(stages) or pending or len(seen) >= max_asks:
        return None
    minutes = pool_minutes(end_time, now, default_minutes=default_minutes)
    if end_time is not None and minutes < min_minutes:
        return None
    need = missing_nodes(stages, layout)
    if not need:
        return None
    total = sum(need.values())
    featured = any(kind for kind in need)
    reason = (f"running with {layout.units} of {units_of(stages)} unit(s), no spare left: "
              + ", ".join(f"{n} node(s)" + (f" of {k}" if k else "") for k, n in sorted(need.items())))
    return PoolAsk(total, tuple(sorted(need.items())) if featured else (), 0 if spare_scope == "none" else 1,
                   minutes, reason, tuple(sorted(layout.failed)))


def pool_constraint(ask: PoolAsk) -> str:
    """``--constraint`` for the pool: Slurm's multiple counts (``[vis*1&txt*2]``) when the stages are
    told apart by features, else empty (the job's own constraint does not apply: its counts are the
    whole job's)."""
    counts = [(k, n) for k, n in ask.per_kind if k]
    return "[" + "&".join(f"{k}*{n}" for k, n in counts) + "]" if counts else ""


def pool_kinds(stages: Sequence[StageSpec], nodes: Sequence[str],
               features: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Node -> the stage kind a pool node can serve (the first stage whose feature it has; "" when
    the stages name none)."""
    out: dict[str, str] = {}
    for n in nodes:
        have = frozenset(features.get(n, ()))
        kinds = [s.feature for s in stages if s.feature and s.feature in have]
        out[n] = kinds[0] if kinds else ""
    return out


def grow_plan(stages: Sequence[StageSpec], layout: StepLayout, pools: Iterable[Pool], *,
              units_divide: int = 0) -> Relaunch | None:
    """The launch that grows the job back onto its granted pools' nodes (and any spare it still
    holds): as many whole placement units as the nodes allow, up to the stages' full size, each
    stage taking nodes of its kind; the spares it keeps first, then the pools' nodes in the order
    Slurm listed them. None when not one more unit fits (or ``units_divide`` allows no larger
    count). Nodes the job lost stay out."""
    full = units_of(stages)
    if layout.units >= full:
        return None
    per_unit = [s.nodes // full for s in stages]
    used = set(layout.nodes) | set(layout.failed)
    kind_of = dict(layout.kind_of)
    free = [n for n in layout.spares if n not in used]
    for pool in pools:
        if pool.state != "granted":
            continue
        for n in pool.nodes:
            if n not in used and n not in free:
                free.append(n)
                kind_of.setdefault(n, pool.kind_of.get(n, ""))
    units = full
    while units > layout.units:
        if units_divide and units_divide % units:
            units -= 1
            continue
        left = list(free)
        added: list[tuple[str, ...]] = []
        for k, stage in enumerate(stages):
            want = per_unit[k] * units - len(layout.components[k])
            fits = [n for n in left if kind_of.get(n, "") == stage.feature][:max(0, want)]
            if len(fits) < want:
                break
            added.append(tuple(fits))
            for n in fits:
                left.remove(n)
        else:
            components = tuple((*layout.components[k], *added[k]) for k in range(len(stages)))
            new = StepLayout(components, tuple(left), layout.failed, units, kind_of)
            gained = tuple(n for a in added for n in a)
            return Relaunch(new, (), gained, layout.units,
                            (f"pool allocation started: {len(gained)} node(s), units {layout.units} -> {units}",))
        units -= 1
    return None


def successor_lead_s(queue_wait_s: float, relaunch_s: float, *, margin: float = 1.5) -> float:
    """How long before the time limit to ask for a successor allocation: the expected queue wait
    (the site's figure, or the job's own last wait) with a margin, plus one relaunch."""
    return max(0.0, queue_wait_s) * margin + max(0.0, relaunch_s)


SUCCESSOR = "successor"
"""The cause of the launch that moves the job onto its successor allocation at a time limit."""

def successor_lead_for(queue_wait_s: float, launches: Iterable[tuple[float, float | None]], *,
                       limit_s: float | None) -> float:
    """:func:`successor_lead_s` with the relaunch the job measured: ``launches`` as (intent,
    first step) of each launch, oldest first; the newest that stepped counts. 0 (no successor) until
    one stepped (a job that has not trained has no relaunch to measure, and a successor asked that
    early would only run beside it), and when the lead is not shorter than the allocation's time
    limit ``limit_s``: it would be asked as the allocation starts, hold a second one for its whole
    life, and every successor would ask for the next at once (the time limit's stop and the
    manager's resubmission serve such a job). A lead longer than half the limit is cut to half: a
    successor is never asked in the first half of an allocation's life (else, on a busy machine
    where a relaunch is slow, each successor would ask for the next as soon as the job moved onto
    it, and the job would hold two allocations most of the time)."""
    measured = [first - start for start, first in launches if first is not None]
    if not measured or queue_wait_s <= 0 or limit_s is None:
        return 0.0
    lead = successor_lead_s(queue_wait_s, measured[-1])
    return min(lead, limit_s / 2.0) if lead < limit_s else 0.0


def successor_due(end_time: float | None, now: float, *, lead_s: float, stop_before_s: float,
                  asked: bool) -> bool:
    """Ask for the successor now? Once, when the time limit is ``lead_s`` away (or nearer), and
    only while the step still has time to train before it is stopped (``stop_before_s``): a
    successor asked at the stop itself overlaps nothing, and the manager's resubmission is the
    same trip through the queue."""
    if end_time is None or asked or lead_s <= 0:
        return False
    return end_time - lead_s <= now < end_time - stop_before_s


def grow_now(*, stepped: bool, stopping: bool, warm: Iterable[bool], plan: Relaunch | None) -> bool:
    """Ask the running launch to checkpoint for the grow-back now: a larger launch fits (``plan``),
    the running one has stepped (a launch still restoring has nothing new to save), it is not already
    stopping, and the granted pools' standbys are warm (:func:`pool_warm`)."""
    return plan is not None and stepped and not stopping and all(warm)


def pool_warm(*, standby: bool, warm_nodes: Iterable[str], nodes: Iterable[str], seen_at: float, now: float,
              bound_s: float) -> bool:
    """Are a granted pool's nodes ready for the grow-back: without standbys at once; with them when
    each node's standby said it is warm, or ``bound_s`` after the pool was seen granted."""
    if not standby or now - seen_at >= bound_s:
        return True
    return set(nodes) <= set(warm_nodes)


def span_end(codes: Sequence[int | None | bool]) -> tuple[bool, int | None, bool]:
    """A launch that spans allocations, one srun each: ``codes`` per srun, False while it runs, its
    exit code, None when it is gone with its code unknown (adopted). Returns (ended, the launch's
    code, kill the others): it ends when every srun has; one that failed (not done, not
    checkpointed) ends it at once, its code the launch's, and the others' tasks are to be killed
    (a peer is gone: they would wait in a collective); else a checkpointed code wins over done, and
    an unknown code stays unknown."""
    ended = [c for c in codes if c is not False]
    bad = [c for c in ended if isinstance(c, int) and not isinstance(c, bool) and c not in (EXIT_DONE, EXIT_CHECKPOINTED)]
    if bad:
        return True, bad[0], len(ended) < len(codes)
    if len(ended) < len(codes):
        return False, None, False
    if EXIT_CHECKPOINTED in ended:
        return True, EXIT_CHECKPOINTED, False
    first = codes[0] if codes else None
    return True, first if isinstance(first, int) and not isinstance(first, bool) else None, False
