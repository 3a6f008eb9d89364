"""The time limit's successor allocation in the supervisor's lifecycle table
(policy/supervisor_lifecycle.py, ``SuccessorPolled``), alone, on a fake clock: asked once ahead of the
limit, the planned save and the move when it starts in time, the fallback to the time limit's stop
and the manager's resubmission when it does not (or Slurm ends it before the move), and a supervisor
restarted in between, which learns the successor from its journal."""

from __future__ import annotations

import signal

from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE
from slurm_omni.policy.in_allocation import Relaunch, StepLayout
from slurm_omni.policy.pools import successor_lead_s
from slurm_omni.policy.recovery_events import MigrationRequested
from slurm_omni.policy.supervision import LaunchEnd, SupervisionLimits, as_plan
from slurm_omni.policy.supervisor_lifecycle import (
    AskSuccessor,
    DropSuccessor,
    Effect,
    Event,
    Exit,
    ForwardStop,
    IntendLaunch,
    JournalDone,
    LaunchEnded,
    LaunchJournaled,
    LaunchRunning,
    LifecycleConfig,
    MoveToSuccessor,
    Phase,
    Plan,
    Planned,
    Replayed,
    SignalStep,
    SuccessorPolled,
    SupervisorState,
    Watched,
    initial,
    step,
)


class FakeClock:
    def __init__(self, t: float = 10_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def to(self, t: float) -> float:
        self.t = t
        return t


STOP_BEFORE = 60.0
CONFIG = LifecycleConfig(limits=SupervisionLimits(max_fruitless=3, max_relaunches=5), stop_before_s=STOP_BEFORE,
                         stop_signal=signal.SIGUSR1, outside=True)
END = 20_000.0
LEAD = successor_lead_s(600.0, 60.0)          # 960 s: ask at END - 960
OLD = StepLayout((("node1",), ("node2",)), (), (), 1, {})
NEW = StepLayout((("node5",), ("node6",)), (), (), 1, {})
MOVE = Relaunch(NEW, ("node1", "node2"), ("node5", "node6"), 1, ("successor allocation 43 started",))


def running() -> SupervisorState:
    return SupervisorState(phase=Phase.RUNNING, launch=0, end_time=END)


def polled(t: float, state: str = "") -> SuccessorPolled:
    return SuccessorPolled(at=t, state=state, lead_s=LEAD, job_id="43" if state not in ("", "asking") else "")


def run(state: SupervisorState, events: list[Event]) -> tuple[SupervisorState, list[Effect]]:
    out: list[Effect] = []
    for e in events:
        state, effects = step(state, e, CONFIG)
        out.extend(effects)
    return state, out


def test_not_due_before_the_lead_and_asked_once_when_due() -> None:
    clock = FakeClock()
    state, effects = step(running(), polled(clock.to(END - LEAD - 1)), CONFIG)
    assert effects == () and state.successor == ""
    state, effects = step(state, polled(clock.to(END - LEAD)), CONFIG)
    assert len(effects) == 1 and isinstance(effects[0], AskSuccessor) and state.successor == "asking"
    assert "ends in 960 s" in effects[0].reason
    # the journal now says asking, then requested: never asked again
    state, effects = run(state, [polled(clock.to(END - LEAD + 3), "asking"), polled(clock.to(END - 500), "requested")])
    assert effects == [] and state.phase is Phase.RUNNING and state.successor == "requested"


def test_not_asked_without_a_time_limit_or_once_the_stop_is_due_or_while_stopping() -> None:
    assert step(SupervisorState(phase=Phase.RUNNING, launch=0), polled(END - 100), CONFIG)[1] == ()
    assert step(running(), polled(END - STOP_BEFORE), CONFIG)[1] == ()      # a successor now overlaps nothing
    stopping = SupervisorState(phase=Phase.STOPPING, launch=0, end_time=END, stopping=True)
    assert step(stopping, polled(END - 500), CONFIG)[1] == ()
    signalled = SupervisorState(phase=Phase.STOPPING, launch=0, end_time=END, asked_to_stop=True)
    assert step(signalled, polled(END - 500), CONFIG)[1] == ()


def test_started_in_time_the_step_saves_and_the_next_launch_moves_to_it() -> None:
    clock = FakeClock()
    state, effects = run(running(), [polled(clock.to(END - LEAD)), polled(clock.to(END - 800), "requested"),
                                     polled(clock.to(END - 300), "granted")])
    assert effects[1:] == [MoveToSuccessor("43"), SignalStep(signal.SIGUSR1)]
    assert state.phase is Phase.STOPPING and state.stopping and state.moving and not state.asked_to_stop
    # the stop deadline passes while the ranks save: no forwarded stop, it is a planned launch
    state, effects = run(state, [polled(clock.to(END - 290), "granted"),
                                 Watched(at=clock(), check_time_limit=True)])
    assert effects == []
    # the save outlasts the stop deadline, and the old allocation ends under it: still the move
    state, effects = run(state, [Watched(at=clock.to(END - STOP_BEFORE + 1), check_time_limit=True)])
    assert effects == [] and not state.asked_to_stop
    end = LaunchEnd(number=0, rc=EXIT_CHECKPOINTED, asked_to_stop=False, job_state="TIMEOUT", fruitless=0)
    state, effects = step(state, LaunchEnded(clock.to(END - 50), end), CONFIG)
    assert state.phase is Phase.ENDED and effects == (Plan(),)
    first = MigrationRequested(at=clock(), plan=as_plan(MOVE, OLD), nodes=MOVE.removed, cause="successor")
    state, effects = step(state, Planned(at=clock(), first=first, plan=MOVE, before=OLD, incarnation=3,
                                         slurm_job_id=42), CONFIG)
    assert state.phase is Phase.RELAUNCHING
    assert len(effects) == 1 and isinstance(effects[0], IntendLaunch) and effects[0].relaunch is MOVE
    # the launch on the successor: its time limit is the allocation's now, and its own successor comes
    state, effects = run(state, [LaunchJournaled(clock.to(END - 49), 1, end_time=END + 7200), LaunchRunning(clock())])
    assert state.phase is Phase.RUNNING and state.end_time == END + 7200 and state.successor == "" and not state.moving
    state, effects = step(state, polled(END + 7200 - LEAD), CONFIG)
    assert len(effects) == 1 and isinstance(effects[0], AskSuccessor)


def test_a_bad_input_or_training_done_during_the_planned_save_is_not_moved() -> None:
    moving = SupervisorState(phase=Phase.STOPPING, launch=0, end_time=END, stopping=True, moving=True)
    bad = LaunchEnd(number=0, rc=1, asked_to_stop=False, job_state="RUNNING", fruitless=0, refused="bad shard")
    state, effects = step(moving, LaunchEnded(END - 100, bad), CONFIG)
    assert state.phase is Phase.STOPPED and effects == (Exit(EXIT_BAD_INPUT, "bad shard"),)
    done = LaunchEnd(number=0, rc=EXIT_DONE, asked_to_stop=False, job_state="RUNNING", fruitless=0)
    state, effects = step(moving, LaunchEnded(END - 100, done), CONFIG)
    assert state.phase is Phase.DONE and effects == (JournalDone(release=True), Exit(EXIT_DONE))


def test_not_started_before_the_stop_it_is_dropped_and_the_time_limit_stops_the_step() -> None:
    clock = FakeClock()
    state, effects = run(running(), [polled(clock.to(END - LEAD)), polled(clock.to(END - 100), "requested"),
                                     polled(clock.to(END - STOP_BEFORE), "requested")])
    assert effects[1:] == [DropSuccessor("43", "it did not start before the time limit's stop")]
    state, effects = run(state, [Watched(at=clock(), check_time_limit=True)])
    assert effects == [ForwardStop(signal.SIGUSR1)] and state.asked_to_stop
    # journaled released: nothing more; the supervisor stops as today (75: the manager resubmits)
    state, effects = run(state, [polled(clock.to(END - 50), "released"), polled(clock.to(END - 40), "released")])
    assert effects == []
    end = LaunchEnd(number=0, rc=EXIT_CHECKPOINTED, asked_to_stop=True, job_state="RUNNING", fruitless=0)
    state, effects = step(state, LaunchEnded(clock.to(END - 30), end), CONFIG)
    assert state.phase is Phase.STOPPED and effects == (Exit(EXIT_CHECKPOINTED, "the supervisor was signalled to stop"),)


def test_lost_before_the_launch_it_is_dropped_once_and_the_job_stays_in_this_allocation() -> None:
    clock = FakeClock()
    # Slurm ended it while it was pending
    state, effects = run(running(), [polled(clock.to(END - LEAD)), polled(clock.to(END - 800), "requested"),
                                     polled(clock.to(END - 700), "ended"), polled(clock.to(END - 600), "ended")])
    assert effects[1:] == [DropSuccessor("43", "Slurm ended it before it was used")]
    assert state.phase is Phase.RUNNING and not state.moving
    # ended between the planned save and the launch on it
    state, effects = run(running(), [polled(clock.to(END - 800), "granted"), polled(clock.to(END - 790), "ended")])
    assert effects[-1] == DropSuccessor("43", "it ended before the launch on it") and not state.moving
    assert state.stopping   # the step still checkpoints: its end is planned, the next launch stays here


def test_a_supervisor_restarted_in_between_learns_the_successor_from_its_journal() -> None:
    clock = FakeClock()
    # asked for by the supervisor that died; the new one replays its journal and adopts the launch
    fresh, effects = run(initial(outside=False), [Replayed(clock.to(END - 700), "", 0), LaunchRunning(clock())])
    fresh = SupervisorState(phase=fresh.phase, launch=fresh.launch, end_time=END)
    state, effects = run(fresh, [polled(clock.to(END - 690), "requested")])
    assert effects == [] and state.successor == "requested"            # not asked a second time
    state, effects = step(state, polled(clock.to(END - 600), "granted"), CONFIG)
    assert effects == (MoveToSuccessor("43"), SignalStep(signal.SIGUSR1))
    # it died after the planned save: the new one finds the launch ended and plans the move again
    again, effects = run(initial(outside=False), [Replayed(clock.to(END - 500), "", 0), LaunchRunning(clock())])
    again = SupervisorState(phase=again.phase, launch=0, end_time=END, stopping=False)
    state, effects = run(again, [polled(clock(), "granted")])
    assert effects == [MoveToSuccessor("43"), SignalStep(signal.SIGUSR1)] and state.moving
