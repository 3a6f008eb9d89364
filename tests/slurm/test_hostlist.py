from __future__ import annotations

import pytest

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.hostlist import compress, expand


@pytest.mark.parametrize("expr, names", [
    ("node1", ["node1"]),
    ("n[1-3,5],m7", ["n1", "n2", "n3", "n5", "m7"]),
    ("node[1-4]", ["node1", "node2", "node3", "node4"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("rack[1-2]-n", ["rack1-n", "rack2-n"]),
    ("a,b , c", ["a", "b", "c"]),
    ("", []),
    ("x[7]", ["x7"]),
])
def test_expand(expr: str, names: list[str]) -> None:
    assert expand(expr) == names


@pytest.mark.parametrize("bad", ["n[1-", "n1-3]", "n[a-b]", "n[3-1]", "n[1-2][3]", "n[[1]]"])
def test_expand_rejects(bad: str) -> None:
    with pytest.raises(SlurmError, match="hostlist"):
        expand(bad)


@pytest.mark.parametrize("names, expr", [
    (["node1", "node2", "node3", "node5", "m7"], "m7,node[1-3,5]"),
    (["n01", "n02", "n04"], "n[01-02,04]"),
    (["login"], "login"),
    (["node3", "node1", "node2", "node2"], "node[1-3]"),
])
def test_compress(names: list[str], expr: str) -> None:
    assert compress(names) == expr


def test_roundtrip_large() -> None:
    names = [f"gpu{i:05d}" for i in range(0, 10000, 3)]
    assert expand(compress(names)) == names
