"""The step supervisor's lifecycle table (policy/supervisor_lifecycle.py), alone, on a fake clock:
one test per transition, then whole stories from start to exit."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
from slurm_omni.formats.supervisor import SUPERVISOR_PHASES
from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.in_allocation import Fallback, Relaunch, StepLayout
from slurm_omni.policy.recovery_events import FailureConfirmed, MigrationRequested
from slurm_omni.policy.supervision import LIVE_PHASES, PLANNED, LaunchEnd, SupervisionLimits, as_plan
from slurm_omni.policy.supervisor_lifecycle import (
    KILLED_RC,
    TERMINAL,
    AllocationPolled,
    Event,
    Exit,
    FirstLaunch,
    ForwardStop,
    GiveUp,
    IllegalTransition,
    IntendLaunch,
    JournalDone,
    KillStep,
    LaunchEnded,
    LaunchJournaled,
    LaunchRunning,
    LeaveStep,
    LifecycleConfig,
    Phase,
    Plan,
    Planned,
    ReleaseAllocation,
    Replayed,
    SignalStep,
    StartStandbys,
    SupervisorState,
    TakeAllocation,
    Watched,
    initial,
    step,
)
from slurm_omni.policy.supervisor_lifecycle import LIVE_PHASES as LIFECYCLE_LIVE


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> float:
        self.t += s
        return self.t


CONFIG = LifecycleConfig(limits=SupervisionLimits(max_fruitless=3, max_relaunches=2), kill_grace_s=2.0,
                         stop_before_s=300.0, stop_signal=signal.SIGUSR1)
OUTSIDE = replace(CONFIG, outside=True)
UID = 1000
OK = Decision(Verdict.NONE, 0.0)
BEFORE = StepLayout((("node1", "node2"), ("node3", "node4")), ("node5", "node6"), (), 2, {})


def confirmed(at: float) -> Decision:
    return Decision(Verdict.CONFIRMED, at, cause="down", nodes=("node3",), first_signal_at=at - 0.5, confirmed_at=at)


def at(phase: Phase, **kw: object) -> SupervisorState:
    return SupervisorState(phase=phase, **kw)  # type: ignore[arg-type]


def end(rc: int, *, stop: bool = False, state: str = "RUNNING", fruitless: int = 0, host: str = "",
        refused: str = "") -> LaunchEnd:
    return LaunchEnd(number=0, rc=rc, asked_to_stop=stop, job_state=state, fruitless=fruitless, batch_host_lost=host,
                     refused=refused)


def replaced() -> Relaunch:
    layout = StepLayout((("node1", "node2"), ("node5", "node4")), ("node6",), ("node3",), 2, {})
    return Relaunch(layout, ("node3",), ("node5",), 2, ("component 1: 1 node(s) on the same leaf",))


def planned(now: float, plan: Relaunch | Fallback, *, asked: bool = False) -> Planned:
    first: FailureConfirmed | MigrationRequested
    if asked and isinstance(plan, Relaunch):
        first = MigrationRequested(at=now, plan=as_plan(plan, BEFORE), nodes=plan.removed, cause=PLANNED)
    else:
        first = FailureConfirmed(decision=confirmed(now), lost={"node3": "down"})
    return Planned(at=now, first=first, plan=plan, before=BEFORE, incarnation=7, slurm_job_id=42)


# -- WAITING (allocation mode) ----------------------------------------------------------------------
def test_it_starts_waiting_outside_its_allocation_and_launching_inside() -> None:
    assert initial(outside=True).phase is Phase.WAITING and initial(outside=False).phase is Phase.LAUNCHING


@pytest.mark.parametrize("state", ["PENDING", "CONFIGURING"])
def test_waiting_a_queued_allocation_keeps_waiting(state: str) -> None:
    clock = FakeClock()
    assert step(at(Phase.WAITING), AllocationPolled(clock(), state, user_id=UID, my_uid=UID), OUTSIDE) == (
        at(Phase.WAITING), ())


def test_waiting_a_running_allocation_is_taken_with_its_time_limit() -> None:
    clock = FakeClock()
    state, effects = step(at(Phase.WAITING), AllocationPolled(clock(), "RUNNING", user_id=UID, my_uid=UID,
                                                              end_time=clock() + 3600), OUTSIDE)
    assert state == at(Phase.LAUNCHING, end_time=4600.0) and effects == (TakeAllocation(),)


def test_waiting_a_running_allocation_whose_nodes_are_not_listed_yet_is_polled_again() -> None:
    assert step(at(Phase.WAITING), AllocationPolled(1.0, "RUNNING", user_id=UID, my_uid=UID, has_nodes=False),
                OUTSIDE) == (at(Phase.WAITING), ())


def test_waiting_another_users_allocation_stops_the_supervisor() -> None:
    state, effects = step(at(Phase.WAITING), AllocationPolled(1.0, "RUNNING", user_id=UID + 1, my_uid=UID), OUTSIDE)
    assert state.phase is Phase.STOPPED and effects == (Exit(EXIT_FAILED, f"it belongs to uid {UID + 1}, not {UID}"),)


@pytest.mark.parametrize("slurm_state", ["CANCELLED", "COMPLETED", ""])
def test_waiting_an_ended_allocation_stops_the_supervisor(slurm_state: str) -> None:
    state, effects = step(at(Phase.WAITING), AllocationPolled(1.0, slurm_state, user_id=UID, my_uid=UID), OUTSIDE)
    assert state.phase is Phase.STOPPED and effects == (
        Exit(EXIT_FAILED, f"it is {slurm_state or 'gone'}: nothing to supervise"),)


def test_waiting_a_signal_stops_the_supervisor() -> None:
    state, effects = step(at(Phase.WAITING), AllocationPolled(1.0, "PENDING", user_id=UID, my_uid=UID,
                                                              signalled=True), OUTSIDE)
    assert state.phase is Phase.STOPPED and state.asked_to_stop and effects[0].code == EXIT_FAILED  # type: ignore[union-attr]


# -- LAUNCHING: the journal replayed, the launch journaled and started -----------------------------
def test_a_done_journal_exits_done_and_outside_releases_the_allocation_first() -> None:
    assert step(at(Phase.LAUNCHING), Replayed(1.0, "done", 2), CONFIG) == (at(Phase.DONE), (Exit(EXIT_DONE),))
    assert step(at(Phase.LAUNCHING), Replayed(1.0, "done", 2), OUTSIDE) == (
        at(Phase.DONE), (ReleaseAllocation(), Exit(EXIT_DONE)))


def test_a_handed_over_journal_exits_failed() -> None:
    assert step(at(Phase.LAUNCHING), Replayed(1.0, "fallback", 1), CONFIG) == (
        at(Phase.FALLBACK), (Exit(EXIT_FAILED),))


def test_an_empty_journal_starts_the_standbys_then_the_first_launch() -> None:
    assert step(at(Phase.LAUNCHING), Replayed(1.0, "", None), CONFIG) == (
        at(Phase.LAUNCHING), (StartStandbys(), FirstLaunch()))


def test_a_journal_with_a_launch_carries_on_with_it() -> None:
    assert step(at(Phase.LAUNCHING), Replayed(1.0, "", 3), CONFIG) == (
        at(Phase.LAUNCHING, launch=3), (StartStandbys(),))


@pytest.mark.parametrize("phase", [Phase.LAUNCHING, Phase.RELAUNCHING, Phase.SHRINKING])
def test_a_journaled_launch_is_the_current_one_and_clears_the_last_ones_flags(phase: Phase) -> None:
    before = at(phase, launch=1, stopping=True, killed_at=5.0, asked_to_stop=True)
    state, effects = step(before, LaunchJournaled(6.0, 2), CONFIG)
    assert state == at(Phase.LAUNCHING, launch=2, asked_to_stop=True) and effects == ()


def test_a_started_or_adopted_launch_runs() -> None:
    assert step(at(Phase.LAUNCHING, launch=0), LaunchRunning(1.0), CONFIG) == (at(Phase.RUNNING, launch=0), ())


# -- RUNNING, STOPPING, CONFIRMING: the ticks --------------------------------------------------------
def test_a_quiet_tick_changes_nothing() -> None:
    s = at(Phase.RUNNING, launch=0)
    assert step(s, Watched(at=1.0, decision=OK, check_time_limit=True), CONFIG) == (s, ())


def test_a_confirmed_failure_kills_the_step_and_the_grace_runs_on_the_clock() -> None:
    clock = FakeClock()
    state, effects = step(at(Phase.RUNNING, launch=0), Watched(at=clock(), decision=confirmed(clock())), CONFIG)
    assert state == at(Phase.CONFIRMING, launch=0, killed_at=1000.0) and effects == (KillStep(),)
    state, effects = step(state, Watched(at=clock.advance(1.9)), CONFIG)
    assert state.phase is Phase.CONFIRMING and effects == ()
    state, effects = step(state, Watched(at=clock.advance(0.1)), CONFIG)
    assert state.phase is Phase.CONFIRMING and effects == (LeaveStep(KILLED_RC),)   # its LaunchEnded follows


def test_with_no_grace_a_killed_step_is_left_on_the_same_tick() -> None:
    config = replace(CONFIG, kill_grace_s=0.0)
    state, _ = step(at(Phase.RUNNING), Watched(at=5.0, decision=confirmed(5.0)), config)
    assert step(state, Watched(at=5.0), config) == (state, (LeaveStep(KILLED_RC),))


def test_an_accepted_request_asks_the_step_to_checkpoint_and_then_a_confirmation_kills_nothing() -> None:
    state, effects = step(at(Phase.RUNNING), Watched(at=1.0, decision=OK, request_accepted=True), CONFIG)
    assert state == at(Phase.STOPPING, stopping=True) and effects == (SignalStep(signal.SIGUSR1),)
    state, effects = step(state, Watched(at=2.0, decision=confirmed(2.0), request_accepted=True), CONFIG)
    assert state == at(Phase.STOPPING, stopping=True) and effects == ()   # asked once; its end is no failure


def test_the_time_limits_lead_forwards_the_stop_signal_once_on_a_node_poll() -> None:
    clock = FakeClock()
    s = at(Phase.RUNNING, end_time=clock() + 400)
    assert step(s, Watched(at=clock(), decision=OK, check_time_limit=True), CONFIG) == (s, ())
    clock.advance(100)
    assert step(s, Watched(at=clock(), decision=OK), CONFIG) == (s, ())        # not a node poll: not checked
    state, effects = step(s, Watched(at=clock(), decision=OK, check_time_limit=True), CONFIG)
    assert state == replace(s, phase=Phase.STOPPING, asked_to_stop=True) and effects == (ForwardStop(signal.SIGUSR1),)
    assert step(state, Watched(at=clock.advance(3), decision=confirmed(clock()), check_time_limit=True), CONFIG) == (
        state, ())


def test_a_signal_moves_a_running_step_to_stopping_and_its_failure_is_not_killed() -> None:
    state, effects = step(at(Phase.RUNNING), Watched(at=1.0, decision=confirmed(1.0), signalled=True), CONFIG)
    assert state == at(Phase.STOPPING, asked_to_stop=True) and effects == ()


# -- a launch's end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", [Phase.LAUNCHING, Phase.RUNNING, Phase.STOPPING, Phase.CONFIRMING])
def test_done_journals_done_and_exits_done(phase: Phase) -> None:
    assert step(at(phase, launch=2), LaunchEnded(9.0, end(EXIT_DONE)), CONFIG) == (
        at(Phase.DONE, launch=2), (JournalDone(release=False), Exit(EXIT_DONE)))
    assert step(at(phase), LaunchEnded(9.0, end(EXIT_DONE)), OUTSIDE)[1][0] == JournalDone(release=True)


@pytest.mark.parametrize(("launch_end", "effect"), [
    (end(143, stop=True), Exit(EXIT_CHECKPOINTED, "the supervisor was signalled to stop")),
    (end(137, state="COMPLETING"), Exit(EXIT_FAILED, "Slurm shows the job COMPLETING")),
    (end(137, refused="job 7: rank 1 refused its input"), Exit(EXIT_BAD_INPUT, "job 7: rank 1 refused its input")),
])
def test_an_end_with_no_relaunch_stops_with_its_code_and_line(launch_end: LaunchEnd, effect: Exit) -> None:
    assert step(at(Phase.STOPPING), LaunchEnded(9.0, launch_end), CONFIG) == (at(Phase.STOPPED), (effect,))


def test_a_lost_batch_host_hands_over_with_the_launchs_lost_nodes() -> None:
    state, effects = step(at(Phase.RUNNING), LaunchEnded(9.0, end(137, host="node1")), CONFIG)
    assert state.phase is Phase.FALLBACK
    assert effects == (GiveUp(("the batch host node1 is lost (this supervisor runs there)",), lost_batch_host=True),
                       Exit(EXIT_FAILED))


def test_too_many_fruitless_launches_hand_over() -> None:
    state, effects = step(at(Phase.RUNNING), LaunchEnded(9.0, end(1, fruitless=4)), CONFIG)
    assert state.phase is Phase.FALLBACK and effects[0] == GiveUp(("4 launches in a row ended before their first step",))


def test_a_failure_is_planned() -> None:
    assert step(at(Phase.CONFIRMING, launch=0, killed_at=1.0), LaunchEnded(9.0, end(KILLED_RC)), CONFIG) == (
        at(Phase.ENDED, launch=0, killed_at=1.0), (Plan(),))


# -- ENDED: the plan -------------------------------------------------------------------------------
def test_a_plan_that_fits_goes_through_the_recovery_table_to_the_next_launch() -> None:
    state, effects = step(at(Phase.ENDED, launch=0), planned(10.0, replaced()), CONFIG)
    assert state.phase is Phase.RELAUNCHING
    assert effects == (IntendLaunch(1, replaced(), "down", "planning -> stopping -> launching"),)


def test_a_plan_with_fewer_units_is_a_shrink() -> None:
    shrunk = Relaunch(StepLayout((("node1",), ("node4",)), ("node2",), ("node3",), 1, {}), ("node3", "node2"), (), 2,
                      ("component 1: 0 of 1 replacement(s) found", "shrink 2 -> 1 placement unit(s)"))
    state, effects = step(at(Phase.ENDED, launch=0), planned(10.0, shrunk), CONFIG)
    assert state.phase is Phase.SHRINKING
    assert effects == (IntendLaunch(1, shrunk, "down", "planning -> stopping -> launching"),)
    assert step(state, LaunchJournaled(10.1, 1), CONFIG)[0].phase is Phase.LAUNCHING


def test_a_requested_replacement_is_a_planned_launch() -> None:
    _, effects = step(at(Phase.ENDED, launch=1), planned(10.0, replaced(), asked=True), CONFIG)
    assert effects == (IntendLaunch(2, replaced(), PLANNED, "stopping -> stopping -> launching"),)


def test_no_launch_that_fits_hands_over_with_the_plans_failed_nodes() -> None:
    state, effects = step(at(Phase.ENDED, launch=0), planned(10.0, Fallback(("node3",), ("below the minimum",))),
                          CONFIG)
    assert state.phase is Phase.FALLBACK
    assert effects == (GiveUp(("below the minimum",), ("node3",)), Exit(EXIT_FAILED))


def test_the_relaunch_limit_hands_over() -> None:
    state, effects = step(at(Phase.ENDED, launch=2), planned(10.0, replaced()), CONFIG)
    assert state.phase is Phase.FALLBACK and effects == (GiveUp(("2 relaunches reached",), ("node3",)),
                                                         Exit(EXIT_FAILED))


# -- no other row -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("phase", "event"), [
    (Phase.RUNNING, Replayed(1.0, "", 0)), (Phase.WAITING, LaunchRunning(1.0)),
    (Phase.LAUNCHING, Watched(at=1.0)), (Phase.RUNNING, planned(1.0, replaced())),
    (Phase.ENDED, LaunchEnded(1.0, end(0))), (Phase.RUNNING, AllocationPolled(1.0, "RUNNING")),
    *[(p, e) for p in TERMINAL for e in (LaunchRunning(1.0), Watched(at=1.0), LaunchEnded(1.0, end(0)))],
])
def test_an_event_with_no_row_is_an_error(phase: Phase, event: Event) -> None:
    with pytest.raises(IllegalTransition, match=f"no transition from {phase.value} on {type(event).__name__}"):
        step(at(phase), event, CONFIG)


def test_the_status_file_and_the_manager_know_every_phase() -> None:
    assert [p.value for p in Phase] == list(SUPERVISOR_PHASES)
    assert LIVE_PHASES == LIFECYCLE_LIVE == {p.value for p in Phase} - {"done", "stopped", "fallback"}


# -- whole stories ----------------------------------------------------------------------------------
def _run(state: SupervisorState, events: list[Event], config: LifecycleConfig) -> tuple[list[Phase], list[object]]:
    phases, effects = [], []
    for event in events:
        state, out = step(state, event, config)
        phases.append(state.phase)
        effects.extend(out)
    return phases, effects


def test_allocation_mode_a_node_loss_then_training_done() -> None:
    clock = FakeClock()
    t = clock.advance
    phases, effects = _run(initial(outside=True), [
        AllocationPolled(clock(), "PENDING", user_id=UID, my_uid=UID),
        AllocationPolled(t(20), "RUNNING", user_id=UID, my_uid=UID, end_time=clock() + 7200),
        Replayed(t(0.1), "", None), LaunchJournaled(t(0.1), 0), LaunchRunning(t(0.2)),
        Watched(at=t(1), decision=OK, check_time_limit=True),
        Watched(at=t(1), decision=confirmed(clock())), Watched(at=t(3)),
        LaunchEnded(t(0.1), end(KILLED_RC)), planned(t(0.1), replaced()), LaunchJournaled(t(0.1), 1),
        LaunchRunning(t(0.2)), LaunchEnded(t(50), end(EXIT_DONE)),
    ], OUTSIDE)
    assert phases == [Phase.WAITING, Phase.LAUNCHING, Phase.LAUNCHING, Phase.LAUNCHING, Phase.RUNNING, Phase.RUNNING,
                      Phase.CONFIRMING, Phase.CONFIRMING, Phase.ENDED, Phase.RELAUNCHING, Phase.LAUNCHING, Phase.RUNNING,
                      Phase.DONE]
    assert [type(e).__name__ for e in effects] == ["TakeAllocation", "StartStandbys", "FirstLaunch", "KillStep",
                                                   "LeaveStep", "Plan", "IntendLaunch", "JournalDone", "Exit"]


def test_a_planned_replacement_stops_the_step_then_relaunches_without_a_kill() -> None:
    phases, effects = _run(at(Phase.LAUNCHING, launch=0), [
        LaunchRunning(1.0), Watched(at=2.0, decision=OK, request_accepted=True),
        Watched(at=3.0, decision=confirmed(3.0)), LaunchEnded(4.0, end(EXIT_CHECKPOINTED)),
        planned(4.0, replaced(), asked=True), LaunchJournaled(4.1, 1), LaunchRunning(4.2),
    ], CONFIG)
    assert phases[-1] is Phase.RUNNING and KillStep() not in effects
    assert effects == [SignalStep(signal.SIGUSR1), Plan(),
                       IntendLaunch(1, replaced(), PLANNED, "stopping -> stopping -> launching")]
