"""The memory tier's replica ring (pure policy): a rotation, peers on another leaf where the layout
allows it."""

from __future__ import annotations

import pytest

from slurm_omni.errors import ConfigError
from slurm_omni.policy.replica_ring import decode_ring, encode_ring, holders, replica_ring


def _is_rotation(ring: dict[str, str], nodes: list[str]) -> None:
    assert set(ring) == set(nodes) and sorted(ring.values()) == sorted(nodes)
    assert all(node != peer for node, peer in ring.items())


def test_two_balanced_leaves_put_every_peer_on_the_other_leaf() -> None:
    leaf = {f"n{i}": ("s1" if i < 4 else "s2") for i in range(8)}
    nodes = list(leaf)
    ring = replica_ring(nodes, leaf)
    _is_rotation(ring, nodes)
    assert all(leaf[node] != leaf[peer] for node, peer in ring.items()), ring


def test_uneven_leaves_cross_whenever_the_largest_holds_at_most_half() -> None:
    leaf = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "c1": "C", "c2": "C"}
    ring = replica_ring(list(leaf), leaf)
    _is_rotation(ring, list(leaf))
    assert all(leaf[node] != leaf[peer] for node, peer in ring.items()), ring


def test_an_oversized_leaf_keeps_some_replicas_inside_but_crosses_where_it_can() -> None:
    leaf = {"a1": "A", "a2": "A", "a3": "A", "a4": "A", "b1": "B"}
    ring = replica_ring(list(leaf), leaf)
    _is_rotation(ring, list(leaf))
    assert leaf[ring["b1"]] == "A" and sum(leaf[p] == "B" for p in ring.values()) == 1


def test_one_leaf_rotates_by_one_and_one_node_has_no_peer() -> None:
    nodes = ["x", "y", "z"]
    assert replica_ring(nodes, {}) == {"x": "y", "y": "z", "z": "x"}
    assert replica_ring(["x"], {"x": "s"}) == {} and replica_ring([], {}) == {}
    assert replica_ring(["x", "x"], {}) == {}


def test_the_ring_is_the_same_whatever_the_order_of_the_leaf_map() -> None:
    leaf = {f"n{i}": f"s{i % 3}" for i in range(9)}
    nodes = list(leaf)
    assert replica_ring(nodes, leaf) == replica_ring(nodes, dict(reversed(list(leaf.items()))))


def test_encoding_round_trips_and_a_bad_entry_is_one_line() -> None:
    ring = replica_ring(["n1", "n2", "n3"], {"n1": "s1", "n2": "s2", "n3": "s1"})
    assert decode_ring(encode_ring(ring)) == ring
    assert holders(ring)[ring["n1"]] == "n1"
    with pytest.raises(ConfigError, match="OMNI_MEMTIER_RING"):
        decode_ring("n1>n2,n3")
