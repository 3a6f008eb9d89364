"""Property check of plan_recovery over random trees, node states, gres and failures."""

from __future__ import annotations

import dataclasses
import random

import pytest
from policy_trees import make_tree

from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.placement import (
    Action,
    ComponentLayout,
    JobLayout,
    PlacementConfig,
    Quarantine,
    plan_recovery,
)
from slurm_omni.slurm.types import Gres, NodeState


def hops(index: ClusterIndex, a: str, b: str) -> int:
    """Steps up from a's leaf to the lowest switch above both a and b (large if none)."""
    def path(n: str) -> list[str]:
        p = [index.leaf_of[n]]
        while p[-1] in index.parent:
            p.append(index.parent[p[-1]])
        return p
    pb = set(path(b))
    return next((i for i, s in enumerate(path(a)) if s in pb), 99)


@pytest.mark.parametrize("seed", range(60))
def test_random_plans_hold_their_invariants(seed: int) -> None:
    rng = random.Random(seed)
    topo, nodes = make_tree(rng.randint(1, 3), rng.randint(1, 4), rng.randint(2, 6))
    states = [NodeState.IDLE] * 5 + [NodeState.ALLOCATED] * 3 + [NodeState.DOWN, NodeState.DRAINED]
    nodes = [dataclasses.replace(n, state=rng.choice(states),
                                 gres=(Gres("gpu", rng.choice(["h100", "a100"]), rng.choice([2, 4, 8])),))
             for n in nodes]
    names = [n.name for n in nodes]
    npr = rng.randint(1, 2)
    dp = rng.randint(1, max(1, min(3, len(names) // (2 * npr))))
    if 2 * npr * dp > len(names):
        npr = 1
    job = rng.sample(names, 2 * npr * dp)
    by_name = {n.name: dataclasses.replace(n, state=NodeState.ALLOCATED) if n.name in job else n for n in nodes}
    failed = rng.sample(job, rng.randint(1, len(job)))
    for f in failed:
        by_name[f] = dataclasses.replace(by_name[f], state=NodeState.DOWN)
    index = ClusterIndex.build(topo, by_name.values())
    gres = (Gres("gpu", "h100", 4),)
    lay = JobLayout((ComponentLayout(0, tuple(job[:npr * dp]), npr, "gpu", gres),
                     ComponentLayout(1, tuple(job[npr * dp:]), npr, "gpu", gres)), dp)
    quarantined = {n: 1e9 for n in rng.sample(names, rng.randint(0, 3))}
    cfg = PlacementConfig(min_units=rng.randint(1, dp))
    plan = plan_recovery(index, lay, failed, now=0.0, fault_at=0.0, quarantine=Quarantine(quarantined),
                         config=cfg)

    def eligible(n: str) -> bool:
        node = index.nodes[n]
        return (index.is_free(n) and n not in quarantined and n not in job
                and node.gres_count("gpu", "h100") >= 4)

    spares = [n for n in names if eligible(n)]
    lost = [n for n in job if n in failed or n in quarantined]
    assert set(failed) <= set(plan.exclude) and set(quarantined) <= set(plan.exclude)
    if plan.action is Action.WAIT:
        assert len(spares) < len(lost)
        return
    assert plan.action in (Action.RESUBMIT, Action.SHRINK)
    assert plan.units >= cfg.min_units
    used = [n for c in plan.components for n in c.nodes]
    assert len(used) == len(set(used))                                   # no node twice
    assert not set(used) & set(plan.exclude)
    for comp, lc in zip(plan.components, lay.components, strict=True):
        assert len(comp.nodes) == plan.units * lc.nodes_per_unit
        assert all(eligible(n) for n in comp.added)
        assert all(n in lc.nodes for n in comp.nodes if n not in comp.added)
    if plan.action is Action.SHRINK:
        assert len(spares) < len(lost)
        return
    assert len(spares) >= len(lost)
    # RESUBMIT: each component's first replacement is as near its survivors as any unused spare
    for comp, lc in zip(plan.components, lay.components, strict=True):
        if not comp.added:
            continue
        anchors = [n for n in lc.nodes if n not in lost] or list(lc.nodes)
        def dist(n: str, anchors: list[str] = anchors) -> int:
            return min(hops(index, n, a) for a in anchors)
        picked_best = dist(comp.added[0])
        unused = [n for n in spares if n not in used]
        assert all(dist(n) >= picked_best for n in unused)
