"""bench/recovery_bench.py's verdicts: a peer whose faults were never injected is n/a with the
reason, never PASS; one that was hit and did not recover is a PASS for the path that did."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    if REPO not in sys.path:   # bench/ is a folder of the repository, not an installed package
        sys.path.insert(0, REPO)
    return importlib.import_module("bench.recovery_bench")


def _goal_c(bench: ModuleType, torchrun: list[object]) -> str:
    trials = [bench.Trial("in_allocation", "rank", False, 1.5), *torchrun]
    lines = bench.summarize(trials, ["in_allocation", "torchrun"], ["rank"], [False])
    (line,) = [x for x in lines if "(c) idle rank" in x]
    return line


def test_a_peer_never_hit_is_not_a_pass(bench: ModuleType) -> None:
    why = "no training rank's heartbeat names node2: no trainer to kill"
    line = _goal_c(bench, [bench.Trial("torchrun", "rank", False, None, why, injected=False)] * 2)
    assert line.split()[0] == "n/a" and why in line, line


def test_a_peer_hit_that_did_not_recover_is_behind(bench: ModuleType) -> None:
    line = _goal_c(bench, [bench.Trial("torchrun", "rank", False, None, "no step after the fault within 400 s")])
    assert line.split()[0] == "PASS" and "torchrun did not recover" in line, line


def test_a_peer_that_recovered_is_compared(bench: ModuleType) -> None:
    line = _goal_c(bench, [bench.Trial("torchrun", "rank", False, 3.0),
                           bench.Trial("torchrun", "rank", False, None, "trial failed: x", injected=False)])
    assert line.split()[0] == "PASS" and "vs torchrun 3.00 s (0.500x)" in line, line


def _goal(bench: ModuleType, trials: list[object], paths: list[str], faults: list[str], marker: str) -> str:
    lines = bench.summarize(trials, paths, faults, [False])
    (line,) = [x for x in lines if marker in x]
    return line


def test_the_first_nodes_loss_is_a_fault_of_its_own_with_its_goal(bench: ModuleType) -> None:
    trials = [bench.Trial("allocation", "first", False, 2.5, "node1 DOWN; replacement node5 on leaf2 "
                                                             "(node1 on leaf1: another leaf)"),
              bench.Trial("allocation", "node", False, 2.0, "node4 DOWN")]
    line = _goal(bench, trials, ["allocation"], ["node", "first"], "loss of the allocation's first node")
    assert line.split()[0] == "PASS" and "2.50 s" in line, line
    slow = _goal(bench, [bench.Trial("allocation", "first", False, 3.5)], ["allocation"], ["first"],
                 "loss of the allocation's first node")
    assert slow.split()[0] == "MISS", slow
    why = "trial failed: no training progress"
    none = _goal(bench, [bench.Trial("allocation", "first", False, None, why, injected=False)], ["allocation"],
                 ["first"], "loss of the allocation's first node")
    assert none.split()[0] == "n/a" and why in none, none


@pytest.mark.parametrize(("trials", "verdict", "says"), [
    ([("resubmit", 20.0, "node4 DOWN; replacement node5 on leaf2 (node4 on leaf1: another leaf)", True)] * 2,
     "PASS", "2 of 2 trials, every replacement on the other leaf"),
    ([("resubmit", 20.0, "node4 DOWN; replacement node3 on leaf1 (node4 on leaf1: the same leaf)", True)],
     "n/a", "1 of 1 trials replaced the node on its own leaf"),
    ([("resubmit", 20.0, "node4 DOWN; replacement node5 on leaf2 (node4 on leaf1: another leaf)", True),
      ("resubmit", None, "no step after the fault within 150 s (node4 DOWN)", True)],
     "MISS", "1 of 2 recovered"),
    ([("resubmit", None, "trial failed: x", False)], "n/a", "trial failed: x"),
])
def test_a_node_loss_replaced_on_another_leaf_passes_only_when_every_trial_did(
        bench: ModuleType, trials: list[tuple[str, float | None, str, bool]], verdict: str, says: str) -> None:
    made = [bench.Trial(p, "node", False, secs, note, injected=injected) for p, secs, note, injected in trials]
    line = _goal(bench, made, ["resubmit"], ["node"], "(d) idle node loss, resubmit")
    assert line.split()[0] == verdict and says in line, line
