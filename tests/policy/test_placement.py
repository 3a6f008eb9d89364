"""Placement: replacements by switch, gres and partition, quarantine, shrink, wait and grow."""

from __future__ import annotations

import dataclasses

import pytest
from policy_trees import make_tree

from slurm_omni.errors import ConfigError
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.placement import (
    Action,
    ComponentLayout,
    JobLayout,
    PlacementConfig,
    Quarantine,
    leaf_switches,
    nodes_to_replace,
    plan_grow,
    plan_recovery,
)
from slurm_omni.slurm.types import Gres, Node, NodeState, Topology

GPU4 = (Gres("gpu", "h100", 4),)


def cluster(states: dict[str, NodeState] | None = None, *, aggs: int = 2, leaves: int = 2,
            per_leaf: int = 4, changes: dict[str, dict[str, object]] | None = None) -> ClusterIndex:
    topo, nodes = make_tree(aggs, leaves, per_leaf)
    out = []
    for n in nodes:
        if states and n.name in states:
            n = dataclasses.replace(n, state=states[n.name], slurm_state=states[n.name].value.upper())
        if changes and n.name in changes:
            n = dataclasses.replace(n, **changes[n.name])  # type: ignore[arg-type]
        out.append(n)
    return ClusterIndex.build(topo, out)


def layout(vision: tuple[str, ...] = ("n000", "n001"), text: tuple[str, ...] = ("n010", "n011"),
           dp: int = 2, target: int = 0) -> JobLayout:
    return JobLayout((ComponentLayout(0, vision, len(vision) // dp, "gpu", GPU4),
                      ComponentLayout(1, text, len(text) // dp, "gpu", GPU4)), dp, target)


def busy(*names: str) -> dict[str, NodeState]:
    return dict.fromkeys(names, NodeState.ALLOCATED)


JOB = busy("n000", "n001", "n010", "n011")


@pytest.mark.parametrize("states,failed,expect_on,via,leaves", [
    # a spare on the survivor's own leaf switch
    ({**JOB, "n011": NodeState.DOWN}, ("n011",), {"n012", "n013"}, "leaf switch", 1),
    # no spare on leaf01: the sibling leaf under agg0 (the lowest common switch)
    ({**JOB, **busy("n012", "n013"), "n011": NodeState.DOWN}, ("n011",), {"n002", "n003"}, "agg0", 2),
    # agg0 full: across the core
    ({**JOB, **busy("n012", "n013", "n002", "n003"), "n011": NodeState.DOWN}, ("n011",),
     {f"n1{a}{b}" for a in range(2) for b in range(4)}, "core", 2),
    # the whole text stage lost: where it was
    ({**JOB, "n010": NodeState.DOWN, "n011": NodeState.DOWN}, ("n010", "n011"), {"n012", "n013"},
     "leaf switch", 1),
])
def test_replacement_nearest_the_survivors(states: dict[str, NodeState], failed: tuple[str, ...],
                                           expect_on: set[str], via: str, leaves: int) -> None:
    idx = cluster(states)
    plan = plan_recovery(idx, layout(), failed, now=100.0, fault_at=99.0)
    assert plan.action is Action.RESUBMIT and plan.units == 2
    text = plan.components[1]
    # the --switches the pinned resubmission needs: the leaves its nodes span (vision kept leaf00)
    assert (plan.components[0].leaf_switches, text.leaf_switches) == (1, leaves)
    assert set(text.added) <= expect_on and len(text.added) == len(failed)
    assert set(text.removed) == set(failed)
    assert plan.nodelist(0) == ("n000", "n001")
    assert set(failed) <= set(plan.exclude)
    assert any(via in r for r in plan.reasons)


def test_gres_and_partition_must_match() -> None:
    idx = cluster({**JOB, "n011": NodeState.DOWN},
                  changes={"n012": {"gres": (Gres("gpu", "a100", 4),)}, "n013": {"partitions": ("cpu",)},
                           "n002": {"gres": (Gres("gpu", "h100", 2),)}})
    plan = plan_recovery(idx, layout(), ("n011",), now=1.0, fault_at=1.0)
    assert plan.components[1].added == ("n003",)


def test_quarantine_excludes_until_expiry() -> None:
    idx = cluster({**JOB, "n011": NodeState.DOWN})
    q = Quarantine({"n012": 50.0, "n013": 500.0})
    plan = plan_recovery(idx, layout(), ("n011",), now=100.0, fault_at=100.0, quarantine=q)
    assert plan.components[1].added == ("n012",)         # n012's quarantine ended at 50
    assert "n013" in plan.exclude and "n012" not in plan.exclude
    assert plan.quarantine.until["n011"] == pytest.approx(100.0 + PlacementConfig().quarantine_s)
    assert "n012" not in plan.quarantine.until           # expired entries are dropped
    later = plan_recovery(idx, layout(), ("n011",), now=600.0, fault_at=600.0, quarantine=q)
    assert "n013" not in later.exclude


@pytest.mark.parametrize("drain_failed,expect", [(False, ()), (True, (("n011", "omni: job 7 inc 2: down"),))])
def test_drain_when_asked(drain_failed: bool, expect: tuple[tuple[str, str], ...]) -> None:
    idx = cluster({**JOB, "n011": NodeState.DOWN, "n001": NodeState.DRAINED})
    plan = plan_recovery(idx, layout(), ("n011",), now=1.0, fault_at=1.0,
                         config=PlacementConfig(drain_failed=drain_failed), drain_reason="job 7 inc 2: down")
    assert plan.drain == expect      # n001 is drained already (and replaced as unhealthy)
    assert "n001" in plan.components[0].removed
    assert all(reason.startswith("omni:") for _, reason in plan.drain)


ALL_BUSY = {f"n{a}{b}{k}": NodeState.ALLOCATED for a in range(2) for b in range(2) for k in range(4)}


@pytest.mark.parametrize("dp,min_dp,divides,expect_action,expect_dp", [
    (2, 1, 0, Action.SHRINK, 1),
    (2, 2, 0, Action.WAIT, 2),
    (4, 1, 0, Action.SHRINK, 3),
    (4, 1, 8, Action.SHRINK, 2),
    (4, 3, 0, Action.SHRINK, 3),
    (4, 4, 0, Action.WAIT, 4),
])
def test_shrink_down_to_min_dp(dp: int, min_dp: int, divides: int, expect_action: Action,
                               expect_dp: int) -> None:
    vision = tuple(f"n00{k}" for k in range(dp))
    text = tuple(f"n01{k}" for k in range(dp))
    idx = cluster({**ALL_BUSY, "n013" if dp == 4 else "n011": NodeState.DOWN})
    failed = ("n013",) if dp == 4 else ("n011",)
    cfg = PlacementConfig(min_units=min_dp, units_divide=divides)
    plan = plan_recovery(idx, layout(vision, text, dp), failed, now=10.0, fault_at=10.0, config=cfg)
    assert plan.action is expect_action and plan.units == expect_dp
    if expect_action is Action.SHRINK:
        assert plan.units >= min_dp
        assert [len(c.nodes) for c in plan.components] == [expect_dp, expect_dp]   # dp shared by stages
        assert not set(failed) & set(plan.nodelist(1))
        assert not any(c.added for c in plan.components)
    else:
        assert plan.components == () and plan.wait_until is None


def test_wait_for_spares_then_shrink() -> None:
    idx = cluster({**ALL_BUSY, "n011": NodeState.DOWN})
    cfg = PlacementConfig(spare_wait_s=60.0)
    early = plan_recovery(idx, layout(), ("n011",), now=30.0, fault_at=10.0, config=cfg)
    assert early.action is Action.WAIT and early.wait_until == 70.0
    late = plan_recovery(idx, layout(), ("n011",), now=71.0, fault_at=10.0, config=cfg)
    assert late.action is Action.SHRINK and late.units == 1


def test_grow_back_when_nodes_return() -> None:
    shrunk = layout(("n000",), ("n010",), dp=1, target=2)
    idx = cluster({**ALL_BUSY, "n011": NodeState.IDLE, "n001": NodeState.IDLE})
    plan = plan_grow(idx, shrunk, now=5.0)
    assert plan is not None and plan.action is Action.GROW and plan.units == 2
    assert plan.nodelist(0) == ("n000", "n001") and plan.nodelist(1) == ("n010", "n011")
    # still quarantined, or no node for one stage: no growth
    assert plan_grow(idx, shrunk, now=5.0, quarantine=Quarantine({"n011": 9.0})) is None
    assert plan_grow(cluster(ALL_BUSY), shrunk, now=5.0) is None
    assert plan_grow(idx, layout(), now=5.0) is None          # at the target already


@pytest.mark.parametrize("cause,expect", [("down", ("n011",)), ("task_exit", ()), ("hang", ())])
def test_nodes_to_replace(cause: str, expect: tuple[str, ...]) -> None:
    idx = cluster(JOB)
    d = Decision(Verdict.CONFIRMED, 1.0, cause=cause, nodes=("n011",))
    assert nodes_to_replace(d, idx, layout()) == expect


def test_task_exit_on_healthy_node_resubmits_in_place() -> None:
    plan = plan_recovery(cluster(JOB), layout(), (), now=1.0, fault_at=1.0)
    assert plan.action is Action.RESUBMIT and plan.nodelist(1) == ("n010", "n011")
    assert plan.exclude == ()


@pytest.mark.parametrize("kwargs", [{"min_units": 0}, {"spare_wait_s": -1.0},
                                    {"units_divide": 6, "min_units": 4}])
def test_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PlacementConfig(**kwargs)  # type: ignore[arg-type]


def test_layout_must_match_dp() -> None:
    with pytest.raises(ConfigError):
        JobLayout((ComponentLayout(0, ("a", "b", "c"), 2),), 2)


def test_leaf_switches_spanned_by_shrink_and_grow_plans() -> None:
    # a vision node lost with no spare on its leaf: the shrink keeps one leaf per component
    idx = cluster({**ALL_BUSY, "n001": NodeState.DOWN})
    plan = plan_recovery(idx, layout(), ("n001",), now=1.0, fault_at=1.0)
    assert plan.action is Action.SHRINK and [c.leaf_switches for c in plan.components] == [1, 1]
    # growing back with the spares on the text stage's leaf: vision spans two leaves
    shrunk = layout(("n000",), ("n010",), dp=1, target=2)
    grow = plan_grow(cluster({**ALL_BUSY, "n012": NodeState.IDLE, "n013": NodeState.IDLE}), shrunk, now=5.0)
    assert grow is not None and grow.nodelist(0) == ("n000", "n012") and grow.nodelist(1) == ("n010", "n013")
    assert [c.leaf_switches for c in grow.components] == [2, 1]


def test_leaf_switches_without_a_topology_is_zero() -> None:
    _, nodes = make_tree(1, 2, 2)
    flat = ClusterIndex.build(Topology(), [dataclasses.replace(n, switch_path=()) for n in nodes])
    assert leaf_switches(flat, ("n000", "n010")) == 0
    tree = cluster()
    assert leaf_switches(tree, ()) == 0 and leaf_switches(tree, ("n000", "n001", "n010", "n100")) == 3
    assert leaf_switches(tree, ("n000", "unknown")) == 1


def test_nodes_outside_the_tree_come_last() -> None:
    topo, nodes = make_tree(1, 1, 2)
    stray = Node("stray", NodeState.IDLE, "IDLE", gres=GPU4, partitions=("gpu",))
    idx = ClusterIndex.build(topo, [*nodes, stray])
    one = JobLayout((ComponentLayout(0, ("n000",), 1, "gpu", GPU4),), 1)
    assert plan_recovery(idx, one, ("n000",), now=1.0, fault_at=1.0).nodelist(0) == ("n001",)
    idx2 = ClusterIndex.build(topo, [dataclasses.replace(nodes[1], state=NodeState.ALLOCATED), nodes[0], stray])
    plan = plan_recovery(idx2, one, ("n000",), now=1.0, fault_at=1.0)
    assert plan.nodelist(0) == ("stray",) and any("elsewhere" in r for r in plan.reasons)


@pytest.mark.parametrize("scope,spares,expect_action,expect_added", [
    ("any_switch", (), Action.RESUBMIT, {"n002", "n003"}),
    ("same_switch", (), Action.SHRINK, set()),
    ("none", (), Action.SHRINK, set()),
    ("any_switch", ("n103",), Action.RESUBMIT, {"n103"}),
])
def test_spare_scope_and_held_back_spares(scope: str, spares: tuple[str, ...], expect_action: Action,
                                          expect_added: set[str]) -> None:
    idx = cluster({**JOB, **busy("n012", "n013"), "n011": NodeState.DOWN})
    cfg = PlacementConfig(spare_scope=scope, spare_nodes=spares)  # type: ignore[arg-type]
    plan = plan_recovery(idx, layout(), ("n011",), now=1.0, fault_at=1.0, config=cfg)
    assert plan.action is expect_action
    added = set(plan.components[1].added) if plan.components else set()
    assert (added <= expect_added and len(added) == 1) if expect_added else not added


def test_config_loads_from_toml_table() -> None:
    from slurm_omni.config.schema import load_dataclass
    cfg = load_dataclass(PlacementConfig, {"min_units": 2, "spare_scope": "same_switch",
                                           "spare_nodes": ["n1", "n2"], "spare_wait_s": 30}, source="site.toml")
    assert cfg.spare_nodes == ("n1", "n2") and cfg.spare_wait_s == 30.0
    with pytest.raises(ConfigError, match="spare_scope"):
        load_dataclass(PlacementConfig, {"spare_scope": "rack"}, source="site.toml")
