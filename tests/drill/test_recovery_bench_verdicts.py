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
