"""Which node keeps a copy of which node's memory-tier checkpoint (``checkpoint/peer.py``): a ring.

Pure: the nodes running the step (in layout order) and each one's leaf switch in, node -> peer out.
Every node holds exactly one other node's replica (a rotation, so the memory each node gives the tier
stays twice its own shards), and the peer sits on another leaf switch wherever the layout allows it: a
switch that fails takes its nodes' own copies with it, not their replicas.

The nodes are ordered leaf by leaf, the leaf with most nodes first, and each node's peer is the node
``m`` places further on, ``m`` the largest leaf's count: when no leaf holds more than half the nodes,
every peer is on another leaf; otherwise the nodes of that oversized leaf that cannot all find one
(there are too few others) keep replicas within it. One leaf only: the next node (another node, at
least). One node: no peer (its copies live in its own memory and on the file system).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from slurm_omni.errors import ConfigError


def replica_ring(nodes: Sequence[str], leaf_of: Mapping[str, str]) -> dict[str, str]:
    """node -> the node that keeps its replica; empty for fewer than two nodes."""
    order: list[str] = []
    seen: set[str] = set()
    for node in nodes:
        if node not in seen:
            seen.add(node)
            order.append(node)
    if len(order) < 2:
        return {}
    groups: dict[str, list[str]] = {}
    for node in order:
        groups.setdefault(leaf_of.get(node, "") or "", []).append(node)
    # the largest leaf first (ties: first seen), each leaf's nodes in layout order
    ranked = sorted(groups.values(), key=lambda g: -len(g))
    flat = [node for group in ranked for node in group]
    n, largest = len(flat), len(ranked[0])
    shift = largest if largest < n else 1
    return {flat[i]: flat[(i + shift) % n] for i in range(n)}


def holders(ring: Mapping[str, str]) -> dict[str, str]:
    """peer -> the node whose replica it keeps (the inverse of a ring)."""
    return {peer: node for node, peer in ring.items()}


def encode_ring(ring: Mapping[str, str]) -> str:
    """The ring as the step's environment carries it (``OMNI_MEMTIER_RING``): ``a>b,b>a``."""
    return ",".join(f"{node}>{peer}" for node, peer in ring.items())


def decode_ring(text: str) -> dict[str, str]:
    """``encode_ring``'s inverse; one line naming the bad entry."""
    ring: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        node, sep, peer = item.partition(">")
        if not sep or not node or not peer or ">" in peer:
            raise ConfigError(f"checkpoint: couldn't read OMNI_MEMTIER_RING: entry {item[:80]!r} (node>peer)")
        ring[node] = peer
    return ring
