"""An index of the cluster for placement: nodes by leaf switch, switches by parent, leaves below
each switch. Built once per sinfo/topology snapshot in O(nodes + switches x depth)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from slurm_omni.slurm.types import Node, NodeState, Topology

NO_SWITCH = ""   # the pseudo leaf of nodes that no switch lists

# Flags that keep a node from taking new work even when its base state is idle.
_UNAVAILABLE_FLAGS = frozenset({"DRAIN", "MAINT", "RESERVED", "NOT_RESPONDING", "POWERED_DOWN",
                                "POWERING_DOWN", "POWER_DOWN", "REBOOT_REQUESTED", "FAIL"})


@dataclass(frozen=True, slots=True)
class Ring:
    """Leaves first reached at one step up from the anchors: ``via`` is the lowest common switch
    (the anchors' own leaves at ``hops`` 0; ``None`` for nodes outside the anchors' tree)."""

    hops: int
    via: str | None
    leaves: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClusterIndex:
    nodes: Mapping[str, Node]
    leaf_of: Mapping[str, str]                    # node -> its leaf switch (NO_SWITCH if none)
    by_leaf: Mapping[str, tuple[str, ...]]        # leaf switch -> its nodes, in topology order
    parent: Mapping[str, str]                     # switch -> parent switch
    leaves_under: Mapping[str, tuple[str, ...]]   # any switch -> the leaf switches below it

    @classmethod
    def build(cls, topology: Topology, nodes: Iterable[Node]) -> ClusterIndex:
        by_name = {n.name: n for n in nodes}
        parent: dict[str, str] = {}
        for sw in topology.switches.values():
            for child in sw.switches:
                parent[child] = sw.name
        leaf_of: dict[str, str] = {}
        by_leaf: dict[str, list[str]] = {}
        for sw in topology.switches.values():
            if sw.nodes:
                members = [name for name in sw.nodes if name in by_name]
                by_leaf[sw.name] = members
                for name in members:
                    leaf_of[name] = sw.name
        for node in by_name.values():   # nodes the tree does not list: their own switch_path, else none
            if node.name not in leaf_of:
                leaf = node.leaf_switch if node.leaf_switch in by_leaf else NO_SWITCH
                leaf_of[node.name] = leaf or NO_SWITCH
                by_leaf.setdefault(leaf or NO_SWITCH, []).append(node.name)
        leaves_under: dict[str, list[str]] = {}
        for leaf in by_leaf:
            if leaf == NO_SWITCH:
                continue
            name, hops = leaf, 0
            while True:
                leaves_under.setdefault(name, []).append(leaf)
                if name not in parent or hops > len(topology.switches):   # a cycle is a broken tree
                    break
                name, hops = parent[name], hops + 1
        return cls(by_name, leaf_of, {k: tuple(v) for k, v in by_leaf.items()}, parent,
                   {k: tuple(v) for k, v in leaves_under.items()})

    def is_free(self, name: str, *, allow_mixed: bool = False) -> bool:
        """Can a new job start here now: idle (or mixed when shared nodes are allowed), no flag
        that keeps work off it."""
        node = self.nodes.get(name)
        if node is None:
            return False
        ok = node.state is NodeState.IDLE or (allow_mixed and node.state is NodeState.MIXED)
        return ok and not (node.flags & _UNAVAILABLE_FLAGS)

    def is_healthy(self, name: str) -> bool:
        """Is a node the job already holds fit to keep."""
        node = self.nodes.get(name)
        return node is not None and not node.state.failed and not (node.flags & _UNAVAILABLE_FLAGS)

    def rings(self, anchors: Mapping[str, int]) -> Iterator[Ring]:
        """Leaves in order of distance from the anchor leaves (leaf -> weight): the anchors' own
        leaves, then those below each anchor's parent, grandparent... then every other leaf.
        Within a ring, leaves with more anchor weight, then more nodes, come first."""
        seen: set[str] = set()
        own = sorted((leaf for leaf in anchors if leaf in self.by_leaf and leaf != NO_SWITCH),
                     key=lambda leaf: (-anchors[leaf], leaf))
        seen.update(own)
        yield Ring(0, None, tuple(own))
        current = set(own)
        hops = 0
        while current:
            hops += 1
            up = {self.parent[s] for s in current if s in self.parent}
            weight = {sw: sum(anchors.get(leaf, 0) for leaf in self.leaves_under.get(sw, ())) for sw in up}
            for sw in sorted(up, key=lambda s: (-weight[s], s)):
                new = [leaf for leaf in self.leaves_under.get(sw, ()) if leaf not in seen]
                seen.update(new)
                if new:
                    new.sort(key=lambda leaf: (-len(self.by_leaf[leaf]), leaf))
                    yield Ring(hops, sw, tuple(new))
            current = up
        rest = sorted(leaf for leaf in self.by_leaf if leaf not in seen)
        if rest:
            yield Ring(hops + 1, None, tuple(rest))
