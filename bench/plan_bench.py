"""Planning on a simulated 10,000-node three-level fat tree: time against the 50 ms limit, memory.

    .venv/bin/python bench/plan_bench.py [--nodes-per-leaf 25] [--repeat 30]

Tree: core -> 25 aggregation switches -> 16 leaf switches each -> 25 nodes each (10,000 nodes),
70 % of nodes allocated to others, 1 % down. The job: a vision and a text component of 64 nodes
each (dp 16, 4 nodes per replica) packed on neighbouring leaves. Cases: spares on the survivors'
leaf, spares only across the core, no spare at all (shrink: every node looked at), and grow.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.confirm import ConfirmConfig, Confirmer, Heartbeat
from slurm_omni.policy.placement import ComponentLayout, JobLayout, plan_grow, plan_recovery
from slurm_omni.slurm.types import Gres, Node, NodeState, Switch, Topology

LIMIT_S = 0.050
GRES = (Gres("gpu", "h100", 8),)


def fat_tree(aggs: int, leaves: int, per_leaf: int, seed: int = 0) -> tuple[Topology, list[Node]]:
    rng = random.Random(seed)
    switches: dict[str, Switch] = {}
    nodes: list[Node] = []
    for a in range(aggs):
        leaf_names = []
        for lf in range(leaves):
            leaf = f"leaf{a:02d}-{lf:02d}"
            names = tuple(f"n{a:02d}{lf:02d}{k:02d}" for k in range(per_leaf))
            switches[leaf] = Switch(leaf, 0, nodes=names)
            leaf_names.append(leaf)
            for name in names:
                r = rng.random()
                state = NodeState.DOWN if r < 0.01 else NodeState.ALLOCATED if r < 0.71 else NodeState.IDLE
                nodes.append(Node(name, state, state.value.upper(), gres=GRES, partitions=("gpu",),
                                  switch_path=("core", f"agg{a:02d}", leaf)))
        switches[f"agg{a:02d}"] = Switch(f"agg{a:02d}", 1, switches=tuple(leaf_names))
    switches["core"] = Switch("core", 2, switches=tuple(f"agg{a:02d}" for a in range(aggs)))
    return Topology(switches), nodes


def timed(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aggs", type=int, default=25)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--nodes-per-leaf", type=int, default=25)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()

    tracemalloc.start()
    topo, nodes = fat_tree(args.aggs, args.leaves, args.nodes_per_leaf)
    snapshot_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    by_name = {n.name: n for n in nodes}
    job = [n.name for n in nodes[:128]]
    for name in job:
        by_name[name] = dataclasses.replace(by_name[name], state=NodeState.ALLOCATED)
    vision, text = tuple(job[:64]), tuple(job[64:])
    layout = JobLayout((ComponentLayout(0, vision, 4, "gpu", GRES), ComponentLayout(1, text, 4, "gpu", GRES)),
                       16, 16)
    failed = list(text[-4:])
    for name in failed:
        by_name[name] = dataclasses.replace(by_name[name], state=NodeState.DOWN)
    text_leaf = by_name[text[-1]].switch_path[-1]
    text_agg = by_name[text[-1]].switch_path[1]

    def with_states(rule: Callable[[Node], NodeState | None]) -> list[Node]:
        out = []
        for n in by_name.values():
            s = rule(n)
            out.append(n if s is None else dataclasses.replace(n, state=s))
        return out

    spare_on_leaf = with_states(lambda n: NodeState.IDLE if n.switch_path[-1] == text_leaf
                                and n.name not in job else None)
    across_core = with_states(lambda n: NodeState.ALLOCATED if n.switch_path[1] == text_agg
                              and n.name not in job else None)
    no_spare = with_states(lambda n: NodeState.ALLOCATED if n.name not in job else None)

    print(f"fat tree: {len(nodes)} nodes, {len(topo.switches)} switches "
          f"({args.aggs} aggregation x {args.leaves} leaf x {args.nodes_per_leaf} nodes)")
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = ClusterIndex.build(topo, spare_on_leaf)
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    build_s = timed(lambda: ClusterIndex.build(topo, spare_on_leaf), max(5, args.repeat // 3))
    print(f"index build            median {build_s * 1e3:7.2f} ms  ratio to 50 ms limit {build_s / LIMIT_S:5.3f}"
          f"  memory {index_bytes / 2**20:.1f} MiB (tracemalloc, index only)")
    print(f"node snapshot (10k Node + Topology) memory {snapshot_bytes / 2**20:.1f} MiB (tracemalloc)")

    cases = [("spare on the same leaf", spare_on_leaf, "resubmit"),
             ("spare only across core", across_core, "resubmit"),
             ("no spare: shrink", no_spare, "shrink")]
    for label, node_list, expect in cases:
        idx = ClusterIndex.build(topo, node_list)
        plan = plan_recovery(idx, layout, failed, now=100.0, fault_at=100.0)
        if plan.action.value != expect:
            raise SystemExit(f"plan_bench: {label}: expected {expect}, got {plan.action.value}: {plan.reasons}")
        t = timed(lambda idx=idx: plan_recovery(idx, layout, failed, now=100.0, fault_at=100.0), args.repeat)
        both = timed(lambda nl=node_list: plan_recovery(ClusterIndex.build(topo, nl), layout, failed,
                                                        now=100.0, fault_at=100.0), max(5, args.repeat // 3))
        print(f"plan: {label:23s} median {t * 1e3:7.2f} ms  ratio {t / LIMIT_S:5.3f}   "
              f"with index build {both * 1e3:7.2f} ms  ratio {both / LIMIT_S:5.3f}   -> {plan.action.value} "
              f"units {plan.units}")

    shrunk = JobLayout(tuple(dataclasses.replace(c, nodes=c.nodes[:60]) for c in layout.components), 15, 16)
    grow_idx = ClusterIndex.build(topo, spare_on_leaf)
    g = plan_grow(grow_idx, shrunk, now=0.0)
    t = timed(lambda: plan_grow(grow_idx, shrunk, now=0.0), args.repeat)
    print(f"plan: grow 15 -> 16          median {t * 1e3:7.2f} ms  ratio {t / LIMIT_S:5.3f}   -> "
          f"{g.action.value if g else 'none'}")

    ranks = 1024
    conf = Confirmer(ConfirmConfig(), {0: vision, 1: text})
    for step in range(10):
        for r in range(ranks):
            conf.observe(Heartbeat(step * 0.5 + r * 1e-4, r, step, job[r % 128]))
    t = timed(lambda: conf.evaluate(5.0), args.repeat)
    print(f"confirm: evaluate, {ranks} ranks median {t * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
