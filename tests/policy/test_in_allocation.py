"""In-allocation relaunch planning (policy/in_allocation.py): pure, on a generated fat tree."""

from __future__ import annotations

import pytest
from policy_trees import make_tree

from slurm_omni.errors import ConfigError
from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.in_allocation import (
    Fallback,
    Relaunch,
    StageSpec,
    first_layout,
    parse_stages,
    plan_relaunch,
)
from slurm_omni.slurm.types import Node, NodeState

# two aggregation switches x two leaves x 4 nodes: n000..n003 on leaf00, n010.. on leaf01, n100.. on leaf10
TOPOLOGY, NODES = make_tree(2, 2, 4)
STAGES = parse_stages("vision:2:1:1,text:2:1:1")


def states(**down: NodeState) -> dict[str, Node]:
    from dataclasses import replace
    return {n.name: replace(n, state=down.get(n.name, NodeState.ALLOCATED)) for n in NODES}


def confirmed(cause: str, *nodes: str) -> Decision:
    return Decision(Verdict.CONFIRMED, 0.0, cause=cause, nodes=nodes)


def test_parse_stages_and_its_errors() -> None:
    assert STAGES == (StageSpec("vision", 2, 1, 1), StageSpec("text", 2, 1, 1))
    assert parse_stages("v:1:2:0:gpuA")[0].feature == "gpuA"
    for bad in ("vision:2:1", "vision:x:1:1", ":1:1:1", "vision:0:1:1", "vision:1:1:-1"):
        with pytest.raises(ConfigError, match="--stages"):
            parse_stages(bad)


def test_first_layout_keeps_each_stage_on_one_leaf_and_the_rest_spare() -> None:
    leaf_of = {n.name: n.switch_path[-1] for n in NODES}
    alloc = ("n000", "n001", "n010", "n011", "n012", "n100")
    layout = first_layout(STAGES, alloc, leaf_of=leaf_of)
    assert layout.components == (("n000", "n001"), ("n010", "n011"))
    assert layout.spares == ("n012", "n100")
    assert layout.units == 2


def test_first_layout_by_node_features() -> None:
    stages = parse_stages("vision:1:2:1:vis,text:1:2:1:txt")
    feats = {"a": {"txt"}, "b": {"vis"}, "c": {"vis"}, "d": {"txt"}}
    layout = first_layout(stages, ("a", "b", "c", "d"), features=feats)
    assert layout.components == (("b",), ("a",))
    assert layout.spares == ("c", "d")
    assert layout.spares_for(stages[0]) == ("c",) and layout.spares_for(stages[1]) == ("d",)
    with pytest.raises(ConfigError, match="feature 'vis'"):
        first_layout(stages, ("a", "d"), features=feats)


def test_lost_node_is_replaced_by_a_spare_on_the_survivors_leaf_first() -> None:
    layout = first_layout(STAGES, ("n000", "n001", "n010", "n011", "n100", "n012"))
    plan = plan_relaunch(STAGES, layout, confirmed("down", "n011"), nodes=states(n011=NodeState.DOWN),
                         topology=TOPOLOGY, now=10.0)
    assert isinstance(plan, Relaunch)
    assert plan.layout.components == (("n000", "n001"), ("n010", "n012"))   # n012 shares leaf01 with n010
    assert plan.removed == ("n011",) and plan.added == ("n012",)
    assert plan.layout.spares == ("n100",) and plan.layout.failed == ("n011",)
    assert not plan.shrunk


def test_a_crashed_rank_on_a_healthy_node_relaunches_in_place() -> None:
    layout = first_layout(STAGES, ("n000", "n001", "n010", "n011", "n012", "n013"))
    plan = plan_relaunch(STAGES, layout, confirmed("task_exit", "n001"), nodes=states(), topology=TOPOLOGY, now=1.0)
    assert isinstance(plan, Relaunch)
    assert plan.layout.components == layout.components and plan.removed == () and plan.added == ()
    assert plan.layout.spares == layout.spares


def test_no_spare_left_shrinks_then_falls_back_below_the_minimum() -> None:
    layout = first_layout(STAGES, ("n000", "n001", "n010", "n011"))   # no spares at all
    plan = plan_relaunch(STAGES, layout, confirmed("down", "n000"), nodes=states(n000=NodeState.DOWN),
                         topology=TOPOLOGY, now=1.0)
    assert isinstance(plan, Relaunch) and plan.shrunk
    assert plan.layout.units == 1
    assert plan.layout.components == (("n001",), ("n010",))
    assert plan.layout.spares == ("n011",)        # the text node the shrink let go is a spare again
    again = plan_relaunch(STAGES, plan.layout, confirmed("down", "n001"),
                          nodes=states(n000=NodeState.DOWN, n001=NodeState.DOWN), topology=TOPOLOGY, now=2.0)
    assert isinstance(again, Relaunch)             # a same-kind spare (n011) takes the vision rank
    assert again.layout.components == (("n011",), ("n010",)) and again.layout.units == 1
    last = plan_relaunch(STAGES, again.layout, confirmed("down", "n010"),
                         nodes=states(n000=NodeState.DOWN, n001=NodeState.DOWN, n010=NodeState.DOWN),
                         topology=TOPOLOGY, now=3.0)
    assert isinstance(last, Fallback)
    assert last.failed == ("n000", "n001", "n010")


def test_min_units_stops_a_shrink() -> None:
    layout = first_layout(STAGES, ("n000", "n001", "n010", "n011"))
    plan = plan_relaunch(STAGES, layout, confirmed("down", "n000"), nodes=states(n000=NodeState.DOWN),
                         topology=TOPOLOGY, now=1.0, min_units=2)
    assert isinstance(plan, Fallback) and plan.failed == ("n000",)


def test_a_failed_node_is_never_used_again() -> None:
    layout = first_layout(STAGES, ("n000", "n001", "n010", "n011", "n012"))
    plan = plan_relaunch(STAGES, layout, confirmed("down", "n010"), nodes=states(n010=NodeState.DOWN),
                         topology=TOPOLOGY, now=1.0)
    assert isinstance(plan, Relaunch)
    # the node came back in Slurm's view: still not a candidate
    again = plan_relaunch(STAGES, plan.layout, confirmed("down", "n011"), nodes=states(n011=NodeState.DOWN),
                          topology=TOPOLOGY, now=2.0)
    assert isinstance(again, Relaunch)
    assert "n010" not in again.layout.nodes and "n010" not in again.layout.spares
    assert set(again.layout.failed) == {"n010", "n011"}


def test_features_keep_replacements_of_the_same_kind() -> None:
    stages = parse_stages("vision:1:2:1:vis,text:1:2:1:txt")
    feats = {"n000": {"vis"}, "n001": {"txt"}, "n002": {"txt"}, "n003": {"vis"}}
    layout = first_layout(stages, ("n000", "n001", "n002", "n003"), features=feats)
    plan = plan_relaunch(stages, layout, confirmed("down", "n001"), nodes=states(n001=NodeState.DOWN),
                         topology=TOPOLOGY, now=1.0)
    assert isinstance(plan, Relaunch)
    assert plan.layout.components == (("n000",), ("n002",)) and plan.layout.spares == ("n003",)
    # the only spare left is a vision node: a text loss cannot use it, and one unit cannot shrink
    last = plan_relaunch(stages, plan.layout, confirmed("down", "n002"),
                         nodes=states(n001=NodeState.DOWN, n002=NodeState.DOWN), topology=TOPOLOGY, now=2.0)
    assert isinstance(last, Fallback)


@pytest.mark.parametrize("flags", [frozenset(), frozenset({"DRAIN"})])
def test_marking_the_replaced_nodes_down_keeps_the_index_as_built_with_them_down(flags: frozenset[str]) -> None:
    """plan_relaunch marks the nodes it replaces down in the index it built instead of building it
    again (a third of decide's CPU at 512 nodes): the same index either way."""
    from dataclasses import replace

    from slurm_omni.policy.in_allocation import _index, _marked_down
    layout = first_layout(STAGES, ("n000", "n001", "n010", "n011", "n012", "n100"),
                          leaf_of={n.name: n.switch_path[-1] for n in NODES})
    nodes = states(n100=NodeState.DOWN)
    nodes["n011"] = replace(nodes["n011"], flags=flags)
    failed = {"n001", "n011", "n100"}
    assert _marked_down(_index(layout, nodes, TOPOLOGY, set()), failed) == _index(layout, nodes, TOPOLOGY, failed)
    assert _marked_down(_index(layout, nodes, TOPOLOGY, set()), set()) == _index(layout, nodes, TOPOLOGY, set())
