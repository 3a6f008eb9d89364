"""Confirmation rule at the decision level: simulated heartbeats, node events and task exits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from slurm_omni.errors import ConfigError
from slurm_omni.policy.confirm import (
    NODE_STATE_KIND,
    SILENT_CAUSES,
    ConfirmConfig,
    Confirmer,
    Decision,
    Heartbeat,
    NodeObservation,
    Observation,
    StepEnded,
    TaskExit,
    Verdict,
)
from slurm_omni.slurm.parse_text import nodes_from_sinfo, parse_nodes
from slurm_omni.slurm.types import NodeState

SLURM_22_05 = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05"
LAYOUT = {0: ("v1", "v2"), 1: ("t1", "t2")}
RANK_NODE = {0: "v1", 1: "v2", 2: "t1", 3: "t2"}
RANK_OFFSET = {0: 0, 1: 0, 2: 1, 3: 1}


@dataclass(frozen=True)
class Fault:
    """What happens at ``at``: ``stop`` ranks (for ``length`` s, or for good), a node
    ``down``, a ``slow`` step of ``length`` s with heartbeats still moving, a task ``exit``."""

    kind: str
    at: float
    ranks: tuple[int, ...] = ()
    length: float | None = None
    node: str = ""
    level1_delay: float = 1.0
    node_state: NodeState = NodeState.DOWN


def simulate(step_s: float, hb_s: float, faults: tuple[Fault, ...], until: float,
             config: ConfirmConfig | None = None, tick: float = 0.05) -> list[Decision]:
    """Run a 4-rank job for ``until`` seconds and evaluate the confirmer every ``tick``."""
    obs: list[Observation] = []
    stopped: list[tuple[float, float, set[int]]] = []   # (from, to, ranks) without heartbeats
    stalled: list[tuple[float, float]] = []             # (from, to) without a new step
    for f in faults:
        end = f.at + f.length if f.length is not None else float("inf")
        if f.kind == "stop":
            stopped.append((f.at, end, set(f.ranks)))
            stalled.append((f.at, end))
        elif f.kind == "slow":
            stalled.append((f.at, end))
        elif f.kind == "down":
            ranks = {r for r, n in RANK_NODE.items() if n == f.node}
            stopped.append((f.at, end, ranks))
            stalled.append((f.at, end))
            obs.append(NodeObservation(f.at + f.level1_delay, f.node, f.node_state, "test"))
        elif f.kind == "kill":
            stopped.append((f.at, end, set(f.ranks)))
            stalled.append((f.at, end))
            for r in f.ranks:
                obs.append(TaskExit(f.at + f.level1_delay, RANK_NODE[r], RANK_OFFSET[r], r, None, 9))
        elif f.kind == "node_event":
            obs.append(NodeObservation(f.at, f.node, f.node_state, "test"))
    # global step over time: advances every step_s of time that is not stalled
    t, step, steps = 0.0, 0, []
    clock = 0.0
    while t < until:
        t += tick / 5
        if any(a <= t < b for a, b in stalled):
            continue
        clock += tick / 5
        if clock >= step_s:
            clock -= step_s
            step += 1
            steps.append((t, step))

    def step_at(time: float) -> int:
        s = 0
        for when, n in steps:
            if when > time:
                break
            s = n
        return s

    for rank, node in RANK_NODE.items():
        t = 0.01 * rank
        while t < until:
            if not any(a <= t < b and rank in rs for a, b, rs in stopped):
                obs.append(Heartbeat(t, rank, step_at(t), node, RANK_OFFSET[rank]))
            t += hb_s
    obs.sort(key=lambda o: o.time)
    c = Confirmer(config or ConfirmConfig(), LAYOUT)
    out, i, now = [], 0, 0.0
    while now < until:
        now += tick
        while i < len(obs) and obs[i].time <= now:
            c.observe(obs[i])
            i += 1
        out.append(c.evaluate(now))
    return out


def first(decisions: list[Decision], verdict: Verdict) -> Decision | None:
    return next((d for d in decisions if d.verdict is verdict), None)


@pytest.mark.parametrize("step_s", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("hb_s", [0.5, 1.0])
@pytest.mark.parametrize("node,offset,l1_delay", [("t1", 1, 0.5), ("v2", 0, 2.0), ("t2", 1, 0.1)])
def test_node_down_confirmed_within_5s_of_first_signal(step_s: float, hb_s: float, node: str, offset: int,
                                                       l1_delay: float) -> None:
    decisions = simulate(step_s, hb_s, (Fault("down", 20.0, node=node, level1_delay=l1_delay),), 40.0)
    d = first(decisions, Verdict.CONFIRMED)
    assert d is not None and d.cause == "down"
    assert d.first_signal_at is not None and d.confirmed_at is not None
    assert d.first_signal_at >= 20.0
    assert d.confirmed_at - d.first_signal_at <= 5.0
    assert d.confirmed_at - 20.0 <= 5.0
    assert d.het_offsets == (offset,) and node in d.nodes
    assert d.fault_at is not None and 20.0 - hb_s <= d.fault_at <= 20.0


@pytest.mark.parametrize("step_s", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("hb_s", [0.5, 1.0])
def test_whole_text_stage_down(step_s: float, hb_s: float) -> None:
    faults = (Fault("down", 15.0, node="t1"), Fault("down", 15.0, node="t2", level1_delay=1.2))
    d = first(simulate(step_s, hb_s, faults, 30.0), Verdict.CONFIRMED)
    assert d is not None and d.het_offsets == (1,)
    assert d.confirmed_at is not None and d.confirmed_at - 15.0 <= 5.0


@pytest.mark.parametrize("step_s", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("hb_s", [0.5, 1.0])
@pytest.mark.parametrize("kind,factor", [("stop", 5.0), ("slow", 5.0), ("stop", 3.0), ("slow", 8.0)])
def test_slow_or_stopped_rank_for_5x_median_not_confirmed(step_s: float, hb_s: float, kind: str,
                                                          factor: float) -> None:
    faults = (Fault(kind, 20.0, ranks=(2,), length=factor * step_s),)
    decisions = simulate(step_s, hb_s, faults, 40.0)
    assert first(decisions, Verdict.CONFIRMED) is None
    assert decisions[-1].verdict is Verdict.NONE   # it continued: back to healthy


@pytest.mark.parametrize("step_s", [0.2, 1.0])
@pytest.mark.parametrize("hb_s", [0.5, 1.0])
def test_sigkill_on_live_node_confirmed_by_level2_and_task_exit(step_s: float, hb_s: float) -> None:
    decisions = simulate(step_s, hb_s, (Fault("kill", 20.0, ranks=(3,), level1_delay=0.2),), 40.0)
    d = first(decisions, Verdict.CONFIRMED)
    assert d is not None and d.cause == "task_exit" and d.het_offsets == (1,) and d.nodes == ("t2",)
    assert d.confirmed_at is not None and d.confirmed_at - 20.0 <= 5.0
    assert 3 in d.ranks


def test_hang_confirmed_by_hard_timeout_only() -> None:
    cfg = ConfirmConfig()
    decisions = simulate(0.5, 0.5, (Fault("stop", 10.0, ranks=(0, 1, 2, 3)),), 60.0, cfg)
    suspect = first(decisions, Verdict.SUSPECT)
    d = first(decisions, Verdict.CONFIRMED)
    assert suspect is not None and d is not None and d.cause == "hang"
    assert d.confirmed_at is not None and suspect.first_signal_at is not None
    assert d.confirmed_at - suspect.first_signal_at >= cfg.hang_floor_s - 0.1
    assert d.confirmed_at - 10.0 <= cfg.hang_floor_s + 5.0
    assert d.het_offsets == (0, 1)
    # a cause of the ranks' silence alone: the supervisor reads no rank's last words after it (no rank exited)
    assert d.cause in SILENT_CAUSES and not d.signals


@pytest.mark.parametrize("state", [NodeState.DRAINING, NodeState.DRAINED, NodeState.NOT_RESPONDING,
                                   NodeState.DOWN])
def test_level1_alone_with_healthy_progress_is_only_suspect(state: NodeState) -> None:
    decisions = simulate(0.5, 0.5, (Fault("node_event", 10.0, node="t1", node_state=state),), 60.0)
    assert first(decisions, Verdict.CONFIRMED) is None
    assert decisions[-1].verdict is Verdict.SUSPECT and decisions[-1].nodes == ("t1",)


def test_level1_alone_confirms_when_site_says_so() -> None:
    cfg = ConfirmConfig(level1_alone=("drain",))
    decisions = simulate(0.5, 0.5, (Fault("node_event", 10.0, node="t1", node_state=NodeState.DRAINED),),
                         20.0, cfg)
    d = first(decisions, Verdict.CONFIRMED)
    assert d is not None and d.cause == "drain" and d.confirmed_at is not None and d.confirmed_at <= 10.1


def test_level1_on_other_node_than_stale_rank_does_not_agree() -> None:
    # t1 is drained for maintenance while rank 0 on v1 stops for a few steps: no recovery
    faults = (Fault("node_event", 5.0, node="t1", node_state=NodeState.DRAINING),
              Fault("stop", 10.0, ranks=(0,), length=3.0))
    assert first(simulate(0.5, 0.5, faults, 30.0), Verdict.CONFIRMED) is None


def test_node_back_up_clears_its_signal() -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    c.observe(NodeObservation(1.0, "t1", NodeState.NOT_RESPONDING))
    assert c.evaluate(1.5).verdict is Verdict.SUSPECT
    c.observe(NodeObservation(2.0, "t1", NodeState.ALLOCATED))
    assert c.evaluate(2.5).verdict is Verdict.NONE


@pytest.mark.parametrize("exit_code,signal,faulty", [(0, None, False), (1, None, True), (None, 9, True),
                                                     (None, None, False), (0, 15, True)])
def test_task_exit_faulty(exit_code: int | None, signal: int | None, faulty: bool) -> None:
    assert TaskExit(0.0, "t1", 1, 0, exit_code, signal).faulty is faulty


def test_observations_of_other_nodes_are_ignored_and_confirmed_latches() -> None:
    c = Confirmer(ConfirmConfig(level1_alone=("down",)), LAYOUT)
    c.observe(NodeObservation(1.0, "elsewhere", NodeState.DOWN))
    assert c.evaluate(2.0).verdict is Verdict.NONE
    c.observe(NodeObservation(3.0, "t2", NodeState.DOWN))
    d = c.evaluate(3.0)
    assert d.verdict is Verdict.CONFIRMED
    c.observe(NodeObservation(4.0, "t2", NodeState.IDLE))
    assert c.evaluate(5.0) is d
    c.reset({0: ("v1",), 1: ("t3",)})
    assert c.evaluate(6.0).verdict is Verdict.NONE


def test_windows_follow_measured_step_times() -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    assert c.progress_window() == 3.0   # initial_step_s 1.0 x 3 before samples
    for i in range(20):
        c.observe(Heartbeat(i * 2.0, 0, i, "v1"))
    assert c.median_step_s() == pytest.approx(2.0)
    assert c.progress_window() == pytest.approx(6.0)
    assert c.stale_after() == pytest.approx(5.0)   # 2.5 x the 2 s heartbeat interval
    assert c.hang_timeout() == pytest.approx(60.0)


@pytest.mark.parametrize("kwargs", [{"stale_factor": 0.5}, {"hang_floor_s": 0}, {"min_samples": 0},
                                    {"level1_alone": ("reboot",)}, {"history": 2, "min_samples": 3}])
def test_bad_config_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ConfirmConfig(**kwargs)  # type: ignore[arg-type]


def test_heartbeats_without_node_agree_by_component() -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    for t in range(10):   # rank 0 is stage 0 (vision), rank 2 stage 1 (text); no node in the beats
        c.observe(Heartbeat(float(t), 0, min(t, 4), het_offset=0))   # blocked once rank 2 is gone
        if t < 5:
            c.observe(Heartbeat(float(t), 2, t, het_offset=1))
    c.observe(NodeObservation(9.5, "v1", NodeState.DRAINING))   # a vision node drained: no agreement
    assert c.evaluate(9.6).verdict is not Verdict.CONFIRMED
    c.observe(NodeObservation(9.7, "t1", NodeState.DOWN))
    d = c.evaluate(9.8)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.het_offsets == (1,)


def test_done_rank_is_not_stale() -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    for t in range(5):
        c.observe(Heartbeat(float(t), 3, t, "t2", 1, phase="training" if t < 4 else "done"))
    c.observe(NodeObservation(5.0, "t2", NodeState.DRAINED))
    assert c.evaluate(20.0).verdict is Verdict.SUSPECT
    assert c.evaluate(200.0).verdict is Verdict.SUSPECT    # never a hang either


@pytest.mark.parametrize("step_s", [0.2, 1.0])
def test_node_down_with_2s_heartbeats_within_5s(step_s: float) -> None:
    d = first(simulate(step_s, 2.0, (Fault("down", 20.0, node="t1", level1_delay=1.0),), 40.0),
              Verdict.CONFIRMED)
    assert d is not None and d.confirmed_at is not None and d.first_signal_at is not None
    assert d.confirmed_at - d.first_signal_at <= 5.0 and d.confirmed_at - 20.0 <= 5.0


def test_config_loads_from_toml_table() -> None:
    from slurm_omni.config.schema import load_dataclass
    cfg = load_dataclass(ConfirmConfig, {"hang_floor_s": 60, "level1_alone": ["down"]}, source="site.toml")
    assert cfg.hang_floor_s == 60.0 and cfg.level1_alone == ("down",)
    assert cfg.corroborate and not load_dataclass(ConfirmConfig, {"corroborate": False}, source="site.toml").corroborate
    with pytest.raises(ConfigError, match="level1_alone"):
        load_dataclass(ConfirmConfig, {"level1_alone": ["oops"]}, source="site.toml")


def test_rank_reporting_failed_confirms_without_a_fault_record() -> None:
    # no SPANK plugin: rank 2 is killed; rank 3's collective breaks, it beats "failed" once and exits
    c = Confirmer(ConfirmConfig(), LAYOUT)
    for i in range(20):
        t = i * 0.5
        for rank in (0, 1):
            c.observe(Heartbeat(t, rank, min(i, 10), het_offset=RANK_OFFSET[rank]))
        if t < 5.0:
            c.observe(Heartbeat(t, 2, i, het_offset=1))
        if t <= 6.0:
            c.observe(Heartbeat(t, 3, min(i, 10), het_offset=1, phase="failed" if t == 6.0 else "training"))
    d = c.evaluate(9.0)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "task_exit" and d.het_offsets == (1,)
    assert 2 in d.ranks


def test_fault_record_of_an_ordinary_job_agrees_by_node() -> None:
    c = Confirmer(ConfirmConfig(), {0: ("a1", "a2")})
    for t in range(6):
        c.observe(Heartbeat(float(t), 0, min(t, 2), "a1"))
        if t <= 2:
            c.observe(Heartbeat(float(t), 1, t, "a2"))
    c.observe(TaskExit(2.5, "a2", None, 1, None, 9))
    d = c.evaluate(6.0)
    assert d.verdict is Verdict.CONFIRMED and d.het_offsets == (0,) and d.nodes == ("a2",)


def beat_all(c: Confirmer, t: float, step: int, phase: str = "training") -> None:
    for rank, node in RANK_NODE.items():
        c.observe(Heartbeat(t, rank, step, node, RANK_OFFSET[rank], phase))


@pytest.mark.parametrize("phase,confirmed", [("training", True), ("checkpointing", False)])
def test_stuck_with_live_heartbeats(phase: str, confirmed: bool) -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    t = 0.0
    for step in range(10):            # 0.5 s steps
        beat_all(c, t, step)
        t += 0.5
    stuck_from = t - 0.5
    while t < stuck_from + 130.0:     # beats go on, the step does not
        beat_all(c, t, 9, phase)
        t += 0.5
        d = c.evaluate(t)
        if d.verdict is Verdict.CONFIRMED:
            break
    assert (d.verdict is Verdict.CONFIRMED) is confirmed
    if confirmed:
        assert d.cause == "stuck" and d.het_offsets == (0, 1) and d.ranks == ()
        assert d.confirmed_at is not None and d.confirmed_at - stuck_from >= ConfirmConfig().stuck_floor_s


def test_restore_that_never_reaches_a_step_is_stuck() -> None:
    c = Confirmer(ConfirmConfig(startup_timeout_s=60.0), LAYOUT)
    for i in range(200):
        beat_all(c, i * 0.5, -1, "starting")
        if c.evaluate(i * 0.5).verdict is Verdict.CONFIRMED:
            break
    d = c.evaluate(100.0)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "stuck" and d.confirmed_at == pytest.approx(60.0)


def test_ranks_starved_while_the_launch_starts_are_no_hang() -> None:
    """Recorded from the 512-node allocation run at load ~2,000 (issue 19; supervisor at a 10 s hang
    window and factor 10): launch 1's tasks started over 50 s, the first ones beat ``starting`` at step
    -1 while they waited for the rest, and starved of CPU they went 14 s without a beat; the rule
    confirmed a hang 42 s in (level 2 alone for 12.8 s) on a launch nobody had faulted. Before any
    rank reported a step only level 1 agreeing, or the startup timeout, confirms; the same silence
    after the ranks step is a hang."""
    cfg = ConfirmConfig(hang_floor_s=10.0, hang_factor=10.0)
    c = Confirmer(cfg, LAYOUT)
    started = {0: 0.0, 1: 8.0, 2: 30.0, 3: 50.0}      # the launch's tasks start over 50 s
    starved = {0: (12.0, 26.0), 1: (20.0, 34.0)}      # no beat in these windows (14 s)
    t = 0.0
    while t <= 60.0:
        for rank, node in RANK_NODE.items():
            gap = starved.get(rank)
            if t >= started[rank] and not (gap and gap[0] <= t < gap[1]):
                c.observe(Heartbeat(t, rank, -1, node, RANK_OFFSET[rank], "starting"))
        assert c.evaluate(t).verdict is not Verdict.CONFIRMED, t
        t += 1.0
    for step in range(15, 19):                        # the rendezvous, the restored step, three steps
        beat_all(c, t, step)
        t += 1.0
    last = t - 1.0
    while t <= last + 30.0:                           # rank 0 stops beating, the job stops stepping
        for rank, node in RANK_NODE.items():
            if rank != 0:
                c.observe(Heartbeat(t, rank, 18, node, RANK_OFFSET[rank], "training"))
        d = c.evaluate(t)
        if d.verdict is Verdict.CONFIRMED:
            break
        t += 0.5
    assert d.verdict is Verdict.CONFIRMED and d.cause == "hang" and d.nodes == ("v1",)
    assert d.confirmed_at is not None and d.confirmed_at - last <= cfg.hang_floor_s + cfg.stale_floor_s + 3.5


def test_node_lost_during_restore_confirms() -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    for i in range(10):
        t = i * 0.5
        for rank, node in RANK_NODE.items():
            if node != "t1" or t < 2.0:
                c.observe(Heartbeat(t, rank, -1, node, RANK_OFFSET[rank], "starting"))
    c.observe(NodeObservation(2.2, "t1", NodeState.DOWN))
    d = c.evaluate(4.5)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.het_offsets == (1,)


# -- a step that ended (the in-allocation supervisor's srun returned) ----------------------------------

def _beating(c: Confirmer, until: float, ranks: int = 4) -> None:
    t = 0.0
    while t <= until:
        for r in range(ranks):
            c.observe(Heartbeat(t, r, int(t), f"node{r + 1}", r // 2))
        t += 0.5


def test_a_failed_step_confirms_at_once_and_a_node_state_names_the_cause() -> None:
    from slurm_omni.policy.confirm import StepEnded
    c = Confirmer(ConfirmConfig(), {0: ["node1", "node2"], 1: ["node3", "node4"]})
    _beating(c, 10.0)
    c.observe(NodeObservation(10.1, "node4", NodeState.DOWN))
    assert c.evaluate(10.2).verdict is Verdict.SUSPECT     # the node alone is level 1 only
    c.observe(StepEnded(10.3, 143))
    d = c.evaluate(10.3)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.nodes == ("node4",)
    assert d.confirmed_at == 10.3 and d.het_offsets == (1,)


def test_a_step_that_ended_by_a_task_exit_keeps_its_healthy_nodes() -> None:
    from slurm_omni.policy.confirm import StepEnded
    c = Confirmer(ConfirmConfig(), {0: ["node1"], 1: ["node2"]})
    _beating(c, 5.0, ranks=2)
    c.observe(StepEnded(5.2, 137))
    d = c.evaluate(5.2)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "task_exit" and d.nodes == ()


def test_a_step_that_ended_well_or_a_slow_step_confirms_nothing() -> None:
    from slurm_omni.policy.confirm import StepEnded
    c = Confirmer(ConfirmConfig(), {0: ["node1"], 1: ["node2"]})
    _beating(c, 5.0, ranks=2)
    c.observe(StepEnded(5.2, 0))
    assert c.evaluate(5.3).verdict is Verdict.NONE
    # a slow step: heartbeats go on, the step does not advance, nothing ended
    for t in (6.0, 7.0, 8.0, 9.0, 10.0):
        for r in range(2):
            c.observe(Heartbeat(t, r, 5, f"node{r + 1}", r))
    assert c.evaluate(10.0).verdict is not Verdict.CONFIRMED


def _progressing(c: Confirmer, until: float, *, step_s: float = 0.5) -> None:
    """Every rank beats and steps every ``step_s`` until ``until`` (the light ranks of the scale lane:
    no collective stops the others when one node goes)."""
    t, step = 0.0, 0
    while t <= until:
        for rank, node in RANK_NODE.items():
            c.observe(Heartbeat(t, rank, step, node=node, het_offset=RANK_OFFSET[rank]))
        t += step_s
        step += 1


@pytest.mark.parametrize("state", [NodeState.DOWN, NodeState.FAIL])
def test_srun_node_failure_and_the_node_state_confirm_at_once_without_the_teardown(state: NodeState) -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    assert c.evaluate(10.1).verdict is Verdict.SUSPECT   # one source: the step still runs, heartbeats move
    c.observe(NodeObservation(10.3, "t1", state, "scale-bench"))   # the supervisor's poll right after
    assert c.evaluate(10.25).verdict is Verdict.SUSPECT   # not before the second signal's time
    d = c.evaluate(10.3)
    assert d.verdict is Verdict.CONFIRMED and d.cause == NODE_STATE_KIND[state] and d.nodes == ("t1",)
    assert d.confirmed_at == 10.3 and d.first_signal_at == 10.1 and d.het_offsets == (1,) and d.ranks == ()
    assert "two sources" in d.reasons[0]


def test_a_confirmation_names_its_signals_with_their_sources_and_times_in_order() -> None:
    """What the supervisor journals (``confirmed.signals``): which signal came when, from whom (issue 19:
    which one arrives late at 512 nodes)."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(TaskExit(10.4, "t1", None, 3, signal=9))
    c.observe(StepEnded(10.5, 143))
    d = c.evaluate(10.6)
    assert d.verdict is Verdict.CONFIRMED and "the step ended" in d.reasons[0]
    assert [(x.kind, x.node, x.source, x.time) for x in d.signals] == [
        ("down", "t1", "srun", 10.1), ("task_exit", "t1", "task", 10.4), ("task_exit", "", "step", 10.5)]


def test_a_rank_goes_stale_between_beats_of_the_others_and_a_done_rank_never_does() -> None:
    """The rule looks at every rank only once one can be stale; a beat of another rank, or the stale
    rank's phase going done, changes what is oldest."""
    c = Confirmer(ConfirmConfig(stale_floor_s=1.5, initial_heartbeat_s=0.5), {0: ["n1"]})
    for rank in (0, 1):
        c.observe(Heartbeat(10.0, rank, 1, node="n1"))
    assert c.evaluate(10.5).verdict is Verdict.NONE
    c.observe(Heartbeat(11.0, 1, 2, node="n1"))   # rank 1 beats on, rank 0 is silent
    assert c._stale_since(11.4) == {} and c._stale_since(11.6) == {0: 11.5}
    c.observe(Heartbeat(11.7, 0, 2, node="n1", phase="done"))
    assert c._stale_since(12.4) == {} and c._stale_since(12.6) == {1: 12.5}


@pytest.mark.parametrize("second", [
    NodeObservation(10.3, "t1", NodeState.DRAINED, "maintenance"),           # not a node that ended the step
    NodeObservation(10.3, "t1", NodeState.NOT_RESPONDING, ""),
    NodeObservation(10.3, "t2", NodeState.DOWN, ""),                          # another node
    NodeObservation(10.3, "t1", NodeState.DOWN, "srun: node failure", source="srun"),   # srun twice is one source
])
def test_one_source_or_a_soft_state_or_another_node_does_not_corroborate(second: NodeObservation) -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(second)
    assert c.evaluate(10.4).verdict is Verdict.SUSPECT


def test_corroboration_off_waits_for_the_other_rules() -> None:
    c = Confirmer(ConfirmConfig(corroborate=False), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(NodeObservation(10.3, "t1", NodeState.DOWN))
    assert c.evaluate(10.4).verdict is Verdict.SUSPECT


def test_a_node_back_ends_slurms_down_seen_before_the_read() -> None:
    """Slurm's DOWN of a node, then a read asked after it that shows the node usable (resumed): the
    DOWN ends, and srun's later report alone does not confirm."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "drill"))
    c.observe(NodeObservation(10.3, "t1", NodeState.IDLE, asked_at=10.2))
    assert c.evaluate(10.35).verdict is Verdict.NONE
    c.observe(NodeObservation(10.4, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    assert c.evaluate(10.45).verdict is Verdict.SUSPECT


def test_a_read_asked_before_sruns_report_does_not_end_it() -> None:
    """Issue 19 at 512 nodes: the full poll's read, in flight for seconds, answered after srun's report
    with the node still allocated; it was asked before the failure and says nothing of the node since."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(NodeObservation(10.3, "t1", NodeState.ALLOCATED, asked_at=9.0))   # stale: srun's report stays
    assert c.evaluate(10.35).verdict is Verdict.SUSPECT
    c.observe(NodeObservation(10.4, "t1", NodeState.DOWN, asked_at=10.15))
    d = c.evaluate(10.45)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down"
    assert sorted(x.source for x in d.signals) == ["slurm", "srun"]


@pytest.mark.parametrize("asked_at", [9.0, 10.1, 10.2, None])   # before, with, after srun's report; unknown
def test_a_usable_read_never_ends_sruns_report(asked_at: float | None) -> None:
    """srun's "Node failure" says the step lost the node's tasks (slurmctld takes the node out of the
    job as it tells srun), whatever a read shows of the node later: a usable answer asked before,
    with or after the report ends nothing of it, and Slurm's DOWN read next confirms at once."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(NodeObservation(10.3, "t1", NodeState.MIXED, "drill", asked_at=asked_at))
    assert c.evaluate(10.35).verdict is Verdict.SUSPECT
    assert [(s.kind, s.source) for s in c._level1.values() if s.node == "t1"] == [("down", "srun")]
    c.observe(NodeObservation(10.5, "t1", NodeState.DOWN, "drill", asked_at=10.4))
    d = c.evaluate(10.55)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.nodes == ("t1",)
    assert sorted(x.source for x in d.signals) == ["slurm", "srun"]


def test_a_usable_read_after_slurms_down_keeps_sruns_report_of_the_node() -> None:
    """Slurm's DOWN first (its level-1 sighting of the node), srun's report, then a usable answer asked
    after both: Slurm's DOWN ends, srun's report stays the node's level-1 signal."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _progressing(c, 10.0)
    c.observe(NodeObservation(10.1, "t1", NodeState.DOWN, "drill"))
    c.observe(NodeObservation(10.2, "t1", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(NodeObservation(10.4, "t1", NodeState.IDLE, asked_at=10.3))
    assert [(s.kind, s.source) for s in c._level1.values() if s.node == "t1"] == [("down", "srun")]
    assert c.evaluate(10.45).verdict is Verdict.SUSPECT
    c.observe(NodeObservation(10.6, "t1", NodeState.DOWN, "drill", asked_at=10.5))
    assert c.evaluate(10.65).verdict is Verdict.CONFIRMED


def test_the_recorded_node_loss_window_confirms_on_scontrols_answer() -> None:
    """Slurm 22.05, recorded on the embedded cluster (a node set DOWN under a step, read 15 ms after
    srun's report): the one-node ``sinfo`` lines say ``mixed`` with the DOWN's reason, ``scontrol show
    node`` of the same moment says DOWN. The sinfo answer keeps srun's report; scontrol's confirms."""
    sinfo = nodes_from_sinfo((SLURM_22_05 / "sinfo_one_node_down_under_job.txt").read_text())
    scontrol = parse_nodes((SLURM_22_05 / "node_down_under_job.txt").read_text())
    assert [(n.name, n.state, n.reason) for n in sinfo] == [("node2", NodeState.MIXED, "omni-drill")]
    assert [(n.name, n.state, n.reason) for n in scontrol] == [("node2", NodeState.DOWN, "omni-drill")]
    c = Confirmer(ConfirmConfig(), {0: ["node1"], 1: ["node2"]})
    for t in (9.0, 9.5, 10.0):
        for rank, node in ((0, "node1"), (1, "node2")):
            c.observe(Heartbeat(t, rank, int(t * 2), node=node))
    c.observe(NodeObservation(10.100, "node2", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe_all(NodeObservation(10.135, n.name, n.state, n.reason, asked_at=10.115) for n in sinfo)
    assert c.evaluate(10.14).verdict is Verdict.SUSPECT
    c.observe_all(NodeObservation(10.136, n.name, n.state, n.reason, asked_at=10.115) for n in scontrol)
    d = c.evaluate(10.14)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.nodes == ("node2",)


def test_srun_node_failure_and_the_nodes_ranks_silent_confirm_while_the_others_step() -> None:
    """Issue 19 at 512 nodes: slurmctld answered 12.8 s late and the rest of the job kept stepping;
    srun's report and the ranks of that node gone silent are two sources."""
    c = Confirmer(ConfirmConfig(stale_floor_s=1.5, initial_heartbeat_s=0.5), {0: ["n1", "n2"]})
    t, step = 0.0, 0
    while t <= 10.0:
        for rank, node in ((0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")):
            if node == "n2" or t <= 9.0:   # n2's ranks step on; n1's stop beating after 9.0
                c.observe(Heartbeat(t, rank, step, node=node))
        t, step = t + 0.5, step + 1
    c.observe(NodeObservation(9.2, "n1", NodeState.DOWN, "srun: node failure", source="srun"))
    assert c.evaluate(10.4).verdict is Verdict.SUSPECT   # stale after 1.5 s: not yet
    for k in range(4):
        c.observe(Heartbeat(10.5 + k * 0.5, 2, 22 + k, node="n2"))
        c.observe(Heartbeat(10.5 + k * 0.5, 3, 22 + k, node="n2"))
    d = c.evaluate(10.5)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.nodes == ("n1",) and d.ranks == (0, 1)
    assert "stopped beating" in d.reasons[0] and [(x.source, x.node) for x in d.signals] == [("srun", "n1")]


@pytest.mark.parametrize("case", ["one rank beats", "no srun report", "slurm only", "done", "off"])
# n1's other rank still beats; no srun report; Slurm's state alone (one source); n1's ranks said done;
# corroboration off
def test_the_nodes_silence_needs_srun_and_every_rank_of_the_node(case: str) -> None:
    c = Confirmer(ConfirmConfig(stale_floor_s=1.5, initial_heartbeat_s=0.5, corroborate=case != "off"),
                  {0: ["n1", "n2"]})
    for t in (0.0, 0.5, 1.0):
        for rank, node in ((0, "n1"), (1, "n1"), (2, "n2")):
            c.observe(Heartbeat(t, rank, int(t * 2), node=node, phase="done" if case == "done" and rank < 2 and t == 1.0
                                else "training"))
    if case == "one rank beats":
        c.observe(Heartbeat(2.8, 1, 5, node="n1"))
    for t in (1.5, 2.0, 2.5, 3.0):
        c.observe(Heartbeat(t, 2, int(t * 2), node="n2"))
    if case != "no srun report":
        c.observe(NodeObservation(1.1, "n1", NodeState.DOWN, "", source="slurm" if case == "slurm only" else "srun"))
    assert c.evaluate(3.0).verdict is not Verdict.CONFIRMED


def test_the_nodes_silence_counts_the_ranks_whose_newest_beat_names_it() -> None:
    """The ranks of a node srun reported are found by node (an index kept as the beats come, not a
    walk of every rank per tick): a rank whose newest beat names another node is not the node's."""
    c = Confirmer(ConfirmConfig(stale_floor_s=1.5, initial_heartbeat_s=0.5), {0: ["n1", "n2"]})
    for t in (0.0, 0.5, 1.0):
        for rank, node in ((0, "n1"), (1, "n1"), (2, "n2")):
            c.observe(Heartbeat(t, rank, int(t * 2), node=node))
    for t in (1.5, 2.0, 2.5, 3.0):   # rank 1 beats from n2 now (its newest beat names n2), as does rank 2
        c.observe(Heartbeat(t, 1, int(t * 2), node="n2"))
        c.observe(Heartbeat(t, 2, int(t * 2), node="n2"))
    c.observe(NodeObservation(1.1, "n1", NodeState.DOWN, "", source="srun"))
    d = c.evaluate(3.0)
    assert d.verdict is Verdict.CONFIRMED and d.nodes == ("n1",) and d.ranks == (0,)


def _starting_then_t1_starved(c: Confirmer, until: float) -> None:
    """Every rank beats ``starting`` (step -1: its task started, it waits for the rendezvous); the
    ranks of node t1 beat until 2 s, then starve."""
    t = 0.0
    while t <= until:
        for rank, node in RANK_NODE.items():
            if node != "t1" or t < 2.0:
                c.observe(Heartbeat(t, rank, -1, node, RANK_OFFSET[rank], "starting"))
        t += 0.5


def test_a_node_not_responding_while_its_ranks_start_is_one_cause_not_two() -> None:
    """Recorded from the 512-node lane (08:08, issue 19): a relaunch's tasks starting on one host
    starved slurmd and the ranks it had just forked together; 48 nodes NOT_RESPONDING and their
    starting ranks stale were confirmed ``not_responding`` 80 s in, and the relaunch after it shrank.
    Slurm's word and that silence are one cause while the ranks start: suspect, not confirmed."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _starting_then_t1_starved(c, 20.0)
    c.observe(NodeObservation(10.0, "t1", NodeState.NOT_RESPONDING))
    d = c.evaluate(20.0)
    assert d.verdict is Verdict.SUSPECT and d.nodes == ("t1",) and d.ranks == (2,)


@pytest.mark.parametrize("state", [NodeState.DOWN, NodeState.FAIL])
def test_a_node_gone_while_its_ranks_start_still_confirms(state: NodeState) -> None:
    c = Confirmer(ConfirmConfig(), LAYOUT)
    _starting_then_t1_starved(c, 20.0)
    c.observe(NodeObservation(10.0, "t1", NodeState.NOT_RESPONDING))
    c.observe(NodeObservation(12.0, "t1", state))
    d = c.evaluate(20.0)
    assert d.verdict is Verdict.CONFIRMED and d.cause == state.name.lower() and d.nodes == ("t1",)


def test_a_node_not_responding_whose_ranks_had_stepped_confirms_with_their_silence() -> None:
    """Two sources still: the ranks stepped in this launch, then the node's slurmd and its ranks went
    silent together while the others stopped stepping (a node hung)."""
    c = Confirmer(ConfirmConfig(), LAYOUT)
    t = 0.0
    while t <= 20.0:
        for rank, node in RANK_NODE.items():
            if node != "t1" or t < 10.0:
                c.observe(Heartbeat(t, rank, min(int(t * 2), 20), node, RANK_OFFSET[rank]))
        t += 0.5
    c.observe(NodeObservation(11.0, "t1", NodeState.NOT_RESPONDING))
    d = c.evaluate(20.0)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "not_responding" and d.nodes == ("t1",)
    assert d.ranks == (2,)


# -- the beats read beside the poller's loop (``beats_seen``): a stuck scan is no silence --------------

def test_a_scan_stuck_for_seconds_makes_no_rank_stale_and_srun_with_slurm_still_confirm() -> None:
    c = Confirmer(ConfirmConfig(hang_floor_s=10.0), {0: ["node1", "node2"], 1: ["node3", "node4"]})
    _beating(c, 10.0)
    c.beats_seen(10.0)
    # the next scan sticks for 17 s (512 emulated nodes: 17.41 s with no CPU): no beat read meanwhile
    for t in (12.0, 16.0, 21.0, 27.0, 45.0):
        assert c.evaluate(t).verdict is Verdict.NONE, t
    # judged at the clock, as a poller that never says beats_seen is, the same silence is level 2,
    # then a hang (30 median steps)
    at_clock = Confirmer(ConfirmConfig(hang_floor_s=10.0), {0: ["node1", "node2"], 1: ["node3", "node4"]})
    _beating(at_clock, 10.0)
    assert at_clock.evaluate(27.0).verdict is Verdict.SUSPECT
    assert at_clock.evaluate(45.0).verdict is Verdict.CONFIRMED
    # srun's report and Slurm's answer came meanwhile (beside the loop): level 1 is judged at the clock
    c.observe(NodeObservation(12.1, "node4", NodeState.DOWN, "srun: node failure", source="srun"))
    c.observe(NodeObservation(12.3, "node4", NodeState.DOWN, "Not responding"))
    d = c.evaluate(12.4)
    assert d.verdict is Verdict.CONFIRMED and d.cause == "down" and d.nodes == ("node4",)


def test_the_node_srun_reported_is_silent_only_once_a_scan_after_its_beats_went_stale_ended() -> None:
    c = Confirmer(ConfirmConfig(), {0: ["node1", "node2"], 1: ["node3", "node4"]})
    _beating(c, 10.0)
    c.beats_seen(10.0)
    c.observe(NodeObservation(10.2, "node4", NodeState.DOWN, "srun: node failure", source="srun"))
    assert c.evaluate(20.0).verdict is Verdict.SUSPECT   # no scan since 10.0: node4's ranks not known silent
    for r in range(3):   # a scan that started at 20.0 ended: every rank but node4's beat on
        c.observe(Heartbeat(19.9, r, 19, f"node{r + 1}", r // 2))
    c.beats_seen(20.0)
    d = c.evaluate(20.0)
    assert d.verdict is Verdict.CONFIRMED and d.nodes == ("node4",) and "stopped beating" in d.reasons[0]
