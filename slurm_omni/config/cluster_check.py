"""Does a config fit the running cluster? Pure: the caller polls the nodes (``omni config check
--cluster`` through the Slurm backend) and passes them in."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from slurm_omni.slurm.types import Gres, Node


def cluster_problems(nodes: Sequence[Node], stages: Iterable[tuple[str, str, Gres | None]],
                     node_lists: Iterable[tuple[str, Sequence[str]]]) -> list[str]:
    """One line per mismatch. ``stages``: (key, partition, gres per node or None); ``node_lists``:
    (key, node names) of hostlists the config names."""
    problems = []
    partitions = sorted({p for n in nodes for p in n.partitions})
    for key, partition, gres in stages:
        members = [n for n in nodes if partition in n.partitions]
        if not members:
            problems.append(f"{key}: partition {partition!r} is not in the cluster (it has: "
                            f"{', '.join(partitions) or 'none'})")
            continue
        if gres is not None and not any(_has(n, gres) for n in members):
            offered = sorted({str(g) for n in members for g in n.gres}) or ["no gres"]
            problems.append(f"{key}: no node of partition {partition!r} has gres {gres} per node "
                            f"(its nodes have: {', '.join(offered)})")
    known = {n.name for n in nodes}
    for key, names in node_lists:
        missing = [name for name in names if name not in known]
        if missing:
            problems.append(f"{key}: node {missing[0]!r} is not in the cluster"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return problems


def _has(node: Node, want: Gres) -> bool:
    return any(g.name == want.name and (want.type is None or g.type == want.type) and g.count >= want.count
               for g in node.gres)
