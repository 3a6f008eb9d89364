"""A small fat-tree generator for placement tests."""

from __future__ import annotations

from slurm_omni.slurm.types import Gres, Node, NodeState, Switch, Topology


def make_tree(aggs: int, leaves: int, per_leaf: int, *, gpus: int = 4, partition: str = "gpu",
              state: NodeState = NodeState.IDLE) -> tuple[Topology, list[Node]]:
    """core -> agg{a} -> leaf{a}{l} -> n{a}{l}{k}: three levels, ``aggs x leaves x per_leaf`` nodes."""
    switches: dict[str, Switch] = {}
    nodes: list[Node] = []
    for a in range(aggs):
        leaf_names = []
        for lf in range(leaves):
            leaf = f"leaf{a}{lf}"
            names = tuple(f"n{a}{lf}{k}" for k in range(per_leaf))
            switches[leaf] = Switch(leaf, 0, nodes=names)
            leaf_names.append(leaf)
            for name in names:
                nodes.append(Node(name, state, state.value.upper(), gres=(Gres("gpu", "h100", gpus),),
                                  partitions=(partition,), switch_path=("core", f"agg{a}", leaf)))
        switches[f"agg{a}"] = Switch(f"agg{a}", 1, switches=tuple(leaf_names))
    switches["core"] = Switch("core", 2, switches=tuple(f"agg{a}" for a in range(aggs)))
    return Topology(switches), nodes
