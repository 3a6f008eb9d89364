"""The recovery state machine alone, with a fake clock: every transition of its table, every pair
outside it (no change), whole roads from a fault to the relaunch, and the state a restarted
manager resumes from."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import pytest

from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.placement import Action, ComponentPlan, Plan, Quarantine
from slurm_omni.policy.recovery import (
    TRANSITIONS,
    Phase,
    RecoveryConfig,
    RecoveryState,
    Replayed,
    Stop,
    initial,
    resume,
    root_cause,
    step,
)
from slurm_omni.policy.recovery_events import (
    Cancel,
    Close,
    Drain,
    FailAll,
    FailureConfirmed,
    FirstStep,
    GrowPossible,
    HandOver,
    InputRefused,
    Launch,
    Launched,
    LaunchRefused,
    LifeEnded,
    LifeNumbered,
    LifeRequeued,
    LifeRunning,
    MarkPhase,
    MigrationRequested,
    NewLife,
    Note,
    Observation,
    OpenRecovery,
    Planned,
    RecordDecision,
    RecoveryPath,
    RequestPlan,
    SetJobState,
    SignalCheckpoint,
    SupervisorReport,
    Tick,
    WatchNext,
    first_step_seen,
)

T = 1000.0   # the fake clock's "now"
MGR = RecoveryConfig(end_wait_s=30.0, stop_timeout_s=60.0, takeover_s=20.0, max_requeues=3)
ARRAY = replace(MGR, same_job=True)
SUPERVISED = replace(MGR, supervised=True)
SUPERVISOR = replace(MGR, role="supervisor")
RESUBMIT = Plan(Action.RESUBMIT, 1, (ComponentPlan(0, ("n1",)), ComponentPlan(1, ("n4",), ("n4",), ("n3",))),
                exclude=("n3",), drain=(("n3", "omni: down in job"),), quarantine=Quarantine({"n3": T + 3600}))
WAIT = Plan(Action.WAIT, 1, wait_until=T + 60, reasons=("component 1: no free node",))
GROW = Plan(Action.GROW, 2, (ComponentPlan(0, ("n1", "n2")), ComponentPlan(1, ("n4", "n5"), ("n5",))))


def confirmed(cause: str = "down", nodes: tuple[str, ...] = ("n3",), lost: dict[str, str] | None = None,
              verdict: Verdict = Verdict.CONFIRMED) -> FailureConfirmed:
    return FailureConfirmed(decision=Decision(verdict, T, cause=cause, nodes=nodes, first_signal_at=T - 2,
                                              confirmed_at=T - 1, fault_at=T - 3), lost=lost or {})


def relaunched(incarnation_after: int = 1) -> SupervisorReport:
    return SupervisorReport(at=T, kind="relaunched", cause="down", nodes=("n3",), incarnation_before=incarnation_after - 1,
                            incarnation_after=incarnation_after, fault_at=T - 4, detected_at=T - 3, confirmed_at=T - 2,
                            removed={"1": ("n3",)}, added={"1": ("n4",)}, spares_left={"0": 1, "1": 0},
                            data_parallel_size=2)


def state(phase: Phase, **kw: Any) -> RecoveryState:
    base: dict[str, Any] = {"incarnation": 0, "slurm_job_id": 41, "path": RecoveryPath.RESUBMITTED, "cause": "down",
                            "nodes": ("n3",)}
    return RecoveryState(phase=phase, **{**base, **kw})


WATCHING = initial(0, 41)
DELEGATED = state(Phase.DELEGATED, path=RecoveryPath.IN_ALLOCATION, since=T - 5)
PLANNING = state(Phase.PLANNING)
WAITING = state(Phase.WAITING)
STOPPING = state(Phase.STOPPING, stop=Stop.CANCEL, since=T - 5, plan=RESUBMIT)
CKPT_STOP = state(Phase.STOPPING, stop=Stop.CHECKPOINT, since=T - 5, plan=GROW, cause="grow", nodes=())
LAUNCHING = state(Phase.LAUNCHING, plan=RESUBMIT)
STARTING = state(Phase.STARTING, plan=RESUBMIT, next_incarnation=1, next_slurm_job_id=50, restarted=True)
ARRAY_STARTING = state(Phase.STARTING, path=RecoveryPath.REQUEUED, next_incarnation=1, next_slurm_job_id=41)
RESTORING = replace(STARTING, phase=Phase.RESTORING)


@dataclass(frozen=True)
class Case:
    name: str
    start: RecoveryState
    obs: Observation
    phase: Phase
    effects: tuple[type, ...]
    config: RecoveryConfig = MGR
    check: Any = None     # (state, effects) -> None, for what the types alone do not say


def _path(path: RecoveryPath) -> Any:
    def check(s: RecoveryState, effects: tuple[Any, ...]) -> None:
        assert s.path is path
        opened = [e for e in effects if isinstance(e, OpenRecovery)]
        assert all(e.path is path for e in opened)
    return check


def _taken_over(reason: str) -> Any:
    def check(s: RecoveryState, effects: tuple[Any, ...]) -> None:
        assert s.path is RecoveryPath.RESUBMITTED
        (decision,) = [e for e in effects if isinstance(e, RecordDecision)]
        assert decision.verdict == "takeover" and reason in decision.payload["reason"]
    return check


def _incarnation(inc: int, slurm_job_id: int | None = 41) -> Any:
    def check(s: RecoveryState, effects: tuple[Any, ...]) -> None:
        assert (s.incarnation, s.slurm_job_id) == (inc, slurm_job_id)
    return check


def _outcome(outcome: str) -> Any:
    def check(s: RecoveryState, effects: tuple[Any, ...]) -> None:
        (note,) = [e for e in effects if isinstance(e, Note)]
        assert note.kind == "old_incarnation_end" and note.payload["outcome"] == outcome
        (launch,) = [e for e in effects if isinstance(e, Launch)]
        assert launch.plan == RESUBMIT and launch.path is RecoveryPath.RESUBMITTED
    return check


def _close(state_: str) -> Any:
    def check(s: RecoveryState, effects: tuple[Any, ...]) -> None:
        (close,) = [e for e in effects if isinstance(e, Close)]
        assert close.state == state_
    return check


def _refused(judged: int, cancel: int | None) -> Any:
    def check(s: RecoveryState, effects: tuple[Any, ...]) -> None:
        decision, *rest = effects
        assert isinstance(decision, RecordDecision) and decision.incarnation == judged
        assert decision.verdict == "refused" and decision.payload == {"line": "job 41 (j): bad"}
        cancels = [e for e in rest if isinstance(e, Cancel)]
        assert [(c.incarnation, c.slurm_job_id) for c in cancels] == ([(judged, cancel)] if cancel else [])
        (close,) = [e for e in effects if isinstance(e, Close)]
        assert close.state == "failed" and close.reason == "job 41 (j): bad" and s.life_ended
    return check


REFUSED = InputRefused(at=T, cause="exited_early", line="job 41 (j): bad")
OPENED = (OpenRecovery, MarkPhase)
CASES = [
    # bad input: the job ends with its line, never restarted
    Case("bad input: closed", WATCHING, REFUSED, Phase.CLOSED, (RecordDecision, Close), check=_refused(0, None)),
    Case("bad input still running: cancelled, closed", WATCHING, replace(REFUSED, cancel=41), Phase.CLOSED,
         (RecordDecision, Cancel, Close), check=_refused(0, 41)),
    Case("bad input in the next life: closed", STARTING, replace(REFUSED, cancel=50), Phase.CLOSED,
         (RecordDecision, Cancel, Close), check=_refused(1, 50)),
    Case("bad input after the restore: closed", RESTORING, REFUSED, Phase.CLOSED, (RecordDecision, Close),
         check=_refused(1, None)),
    # watching: the judged life fails, or Slurm says so
    Case("confirmed: plan a resubmission", WATCHING, confirmed(), Phase.PLANNING, (*OPENED, RequestPlan),
         check=_path(RecoveryPath.RESUBMITTED)),
    Case("not confirmed: nothing", WATCHING, confirmed(verdict=Verdict.SUSPECT), Phase.WATCHING, ()),
    Case("confirmed array task: requeue at once", WATCHING, confirmed("task_exit"), Phase.LAUNCHING, (*OPENED, Launch),
         config=ARRAY, check=_path(RecoveryPath.REQUEUED)),
    Case("confirmed supervised: the supervisor decides", WATCHING, confirmed(), Phase.DELEGATED, OPENED,
         config=SUPERVISED, check=_path(RecoveryPath.IN_ALLOCATION)),
    Case("confirmed in the supervisor: plan in the allocation", WATCHING, confirmed(), Phase.PLANNING,
         (*OPENED, RequestPlan), config=SUPERVISOR, check=_path(RecoveryPath.IN_ALLOCATION)),
    Case("requeued for a lost node: Slurm's word confirms", WATCHING,
         LifeRequeued(at=T, restart_count=1, quiet=True, lost={"n3": "down"}), Phase.PLANNING,
         (RecordDecision, *OPENED, RequestPlan)),
    Case("requeued after a checkpoint: a new life", WATCHING, LifeRequeued(at=T, restart_count=1, quiet=True),
         Phase.WATCHING, (NewLife,)),
    Case("requeued unasked: every node a level-1 signal", WATCHING, LifeRequeued(at=T, restart_count=1, quiet=False),
         Phase.WATCHING, (FailAll,), check=lambda s, e: s.requeued_at == T),
    Case("ended completed: done", WATCHING, LifeEnded(at=T, completed=True), Phase.CLOSED, (Close,),
         check=_close("done")),
    Case("ended cancelled by its user", WATCHING, LifeEnded(at=T, slurm_state="CANCELLED", cancelled=True, quiet=True),
         Phase.CLOSED, (Close,), check=_close("cancelled")),
    Case("ended checkpointed, not requeued: resubmit", WATCHING, LifeEnded(at=T, quiet=True, restart_count=1),
         Phase.PLANNING, (RecordDecision, *OPENED, RequestPlan),
         check=lambda s, e: s.cause == "checkpointed"),
    Case("ended checkpointed past max_requeues", WATCHING, LifeEnded(at=T, quiet=True, restart_count=3),
         Phase.CLOSED, (Close,), check=_close("failed")),
    Case("ended before training", WATCHING, LifeEnded(at=T, slurm_state="FAILED", trained=False), Phase.CLOSED,
         (Close,), check=_close("failed")),
    Case("ended badly while training", WATCHING, LifeEnded(at=T, slurm_state="FAILED"), Phase.WATCHING, (FailAll,)),
    Case("ended again after it was acted on", replace(WATCHING, life_ended=True), LifeEnded(at=T, completed=True),
         Phase.WATCHING, ()),
    Case("tick: requeued unasked and every rank quiet", replace(WATCHING, requeued_at=T - 1), Tick(quiet=True),
         Phase.PLANNING, (RecordDecision, *OPENED, RequestPlan), check=lambda s, e: s.cause == "requeued"),
    Case("tick: requeued unasked, quiet, a node lost meanwhile", replace(WATCHING, requeued_at=T - 1),
         Tick(quiet=True, lost={"n3": "down"}), Phase.PLANNING, (RecordDecision, *OPENED, RequestPlan),
         check=lambda s, e: (s.cause, s.nodes) == ("down", ("n3",))),
    Case("tick: nothing to do", WATCHING, Tick(), Phase.WATCHING, ()),
    Case("numbered by Slurm", WATCHING, LifeNumbered(incarnation=2), Phase.WATCHING, (), check=_incarnation(2)),
    Case("grow: checkpoint first", WATCHING, GrowPossible(at=T, plan=GROW), Phase.STOPPING,
         (RecordDecision, *OPENED, SignalCheckpoint), check=lambda s, e: s.stop is Stop.CHECKPOINT),
    Case("grow of an array task: never", WATCHING, GrowPossible(at=T, plan=GROW), Phase.WATCHING, (), config=ARRAY),
    Case("planned migration (fail-slow)", WATCHING, MigrationRequested(at=T, plan=RESUBMIT, nodes=("n3",)),
         Phase.STOPPING, (RecordDecision, *OPENED, SignalCheckpoint), check=_path(RecoveryPath.PLANNED_MIGRATION)),
    Case("supervisor relaunched before the manager confirmed", WATCHING, relaunched(), Phase.RESTORING,
         (*OPENED, Note, MarkPhase, MarkPhase, WatchNext), config=SUPERVISED, check=_path(RecoveryPath.IN_ALLOCATION)),
    Case("supervisor gave up while all is well: nothing", WATCHING,
         SupervisorReport(at=T, kind="gave_up", reason="x"), Phase.WATCHING, (), config=SUPERVISED),
    Case("supervisor report already acted on", replace(WATCHING, incarnation=1), relaunched(1), Phase.WATCHING, (),
         config=SUPERVISED),
    # delegated: the supervisor decides, the manager takes over when it cannot
    Case("delegated: relaunched in the allocation", DELEGATED, relaunched(), Phase.RESTORING,
         (Note, MarkPhase, MarkPhase, WatchNext),
         config=SUPERVISED, check=lambda s, e: (s.next_incarnation, s.next_slurm_job_id) == (1, 41)),
    Case("delegated: the supervisor gave up", DELEGATED, SupervisorReport(at=T, kind="gave_up", reason="below min dp"),
         Phase.PLANNING, (RecordDecision, MarkPhase, RequestPlan), config=SUPERVISED,
         check=_path(RecoveryPath.RESUBMITTED)),
    Case("delegated: still waiting", DELEGATED, Tick(), Phase.DELEGATED, (), config=SUPERVISED),
    Case("delegated: silent past takeover_s", replace(DELEGATED, since=T - 20), Tick(), Phase.PLANNING,
         (RecordDecision, MarkPhase, RequestPlan), config=SUPERVISED),
    Case("delegated: its batch host lost (26.05 keeps such a job RUNNING): take over at once", DELEGATED,
         Tick(lost={"n1": "down"}, batch_host_lost="n1"), Phase.PLANNING, (RecordDecision, MarkPhase, RequestPlan),
         config=SUPERVISED, check=_taken_over("the batch host n1 is lost")),
    Case("delegated: another node lost, the supervisor's to handle", DELEGATED, Tick(lost={"n3": "down"}),
         Phase.DELEGATED, (), config=SUPERVISED),
    Case("delegated: the allocation is gone (tick)", DELEGATED, Tick(ended=True, running=False), Phase.PLANNING,
         (RecordDecision, MarkPhase, RequestPlan), config=SUPERVISED),
    Case("delegated: the allocation ended", DELEGATED, LifeEnded(at=T, slurm_state="NODE_FAIL"), Phase.PLANNING,
         (RecordDecision, MarkPhase, RequestPlan), config=SUPERVISED, check=_path(RecoveryPath.RESUBMITTED)),
    Case("delegated: Slurm requeued the allocation", DELEGATED, LifeRequeued(at=T, restart_count=1, quiet=True),
         Phase.PLANNING, (RecordDecision, MarkPhase, RequestPlan), config=SUPERVISED,
         check=_path(RecoveryPath.RESUBMITTED)),
    Case("supervised, Slurm ended it for a lost node: not the supervisor's", WATCHING,
         LifeRequeued(at=T, restart_count=1, quiet=True, lost={"n3": "down"}), Phase.PLANNING,
         (RecordDecision, *OPENED, RequestPlan), config=SUPERVISED, check=_path(RecoveryPath.RESUBMITTED)),
    # planning and waiting
    Case("planned: cancel and wait for the old life", PLANNING, Planned(plan=RESUBMIT), Phase.STOPPING,
         (RecordDecision, MarkPhase, Cancel, Note), check=lambda s, e: (s.since, s.stop) == (T, Stop.CANCEL)),
    Case("planned, never ran: launch at once", replace(PLANNING, slurm_job_id=None), Planned(plan=RESUBMIT),
         Phase.LAUNCHING, (RecordDecision, MarkPhase, Drain, Launch)),
    Case("planned WAIT: cancel, wait for nodes", PLANNING, Planned(plan=WAIT), Phase.WAITING,
         (RecordDecision, Cancel, SetJobState)),
    Case("planned WAIT in the supervisor: hand over", replace(PLANNING, path=RecoveryPath.IN_ALLOCATION),
         Planned(plan=WAIT), Phase.CLOSED, (HandOver,), config=SUPERVISOR),
    Case("planning tick: ask again", PLANNING, Tick(), Phase.PLANNING, (RequestPlan,),
         check=lambda s, e: e[0].fresh),
    Case("planning tick with a journaled plan", replace(PLANNING, plan=RESUBMIT), Tick(), Phase.STOPPING,
         (Cancel, Note)),
    Case("waiting: still no nodes", WAITING, Planned(plan=WAIT), Phase.WAITING, ()),
    Case("waiting: nodes came", WAITING, Planned(plan=RESUBMIT), Phase.STOPPING,
         (RecordDecision, MarkPhase, Cancel, Note)),
    Case("waiting tick: plan from the next poll", WAITING, Tick(), Phase.WAITING, (RequestPlan,),
         check=lambda s, e: not e[0].fresh),
    # stopping: the old life ends, bounded
    Case("stopping: Slurm shows it stopped", STOPPING, Tick(stopped=True, state="CANCELLED"), Phase.LAUNCHING,
         (Note, Drain, Launch), check=_outcome("stopped")),
    Case("stopping: still busy", STOPPING, Tick(stopped=False, state="COMPLETING"), Phase.STOPPING, ()),
    Case("stopping: busy past end_wait_s", replace(STOPPING, since=T - 30), Tick(stopped=False), Phase.LAUNCHING,
         (Note, Drain, Launch), check=_outcome("timed_out")),
    Case("stopping in the supervisor: no drain", replace(STOPPING, path=RecoveryPath.IN_ALLOCATION),
         Tick(stopped=True), Phase.LAUNCHING, (Note, Launch), config=SUPERVISOR,
         check=lambda s, e: e[-1].path is RecoveryPath.IN_ALLOCATION),
    Case("checkpoint stop: every rank quiet", CKPT_STOP, Tick(quiet=True), Phase.STOPPING, (Cancel, Note),
         check=lambda s, e: s.stop is Stop.CANCEL and s.since == T),
    Case("checkpoint stop: ranks still training", CKPT_STOP, Tick(), Phase.STOPPING, ()),
    Case("checkpoint stop: past stop_timeout_s", replace(CKPT_STOP, since=T - 60), Tick(), Phase.STOPPING,
         (Cancel, Note)),
    Case("checkpoint stop: the script requeued it", CKPT_STOP, LifeRequeued(at=T, restart_count=1, quiet=True),
         Phase.STOPPING, (NewLife,)),
    Case("cancel stop: a requeue changes nothing", STOPPING, LifeRequeued(at=T, restart_count=1, quiet=True),
         Phase.STOPPING, ()),
    Case("checkpoint stop: training finished meanwhile", CKPT_STOP, LifeEnded(at=T, completed=True), Phase.CLOSED,
         (Close,), check=_close("done")),
    Case("cancel stop: its end is expected", STOPPING, LifeEnded(at=T, cancelled=True), Phase.STOPPING, ()),
    Case("checkpoint stop: its user cancelled it", CKPT_STOP, LifeEnded(at=T, cancelled=True), Phase.CLOSED, (Close,),
         check=_close("cancelled")),
    Case("checkpoint stop: ended otherwise, the move goes on", CKPT_STOP, LifeEnded(at=T, slurm_state="FAILED"),
         Phase.STOPPING, ()),
    # launching
    Case("launching tick: launch again (keyed)", LAUNCHING, Tick(), Phase.LAUNCHING, (Drain, Launch)),
    Case("launched: watch the next incarnation", LAUNCHING,
         Launched(at=T, incarnation=1, slurm_job_id=50, restore_step=20), Phase.STARTING,
         (MarkPhase, SetJobState, WatchNext),
         check=lambda s, e: (s.next_incarnation, s.next_slurm_job_id, e[-1].same_job) == (1, 50, False)),
    Case("launched array task: the same job id", replace(LAUNCHING, path=RecoveryPath.REQUEUED, plan=None),
         Launched(at=T, incarnation=1, slurm_job_id=41), Phase.STARTING, (MarkPhase, WatchNext), config=ARRAY,
         check=lambda s, e: s.expect_restart and e[-1].same_job),
    Case("launch refused: the job file changed", LAUNCHING, LaunchRefused(at=T, cause="job_file_changed", error="x"),
         Phase.CLOSED, (RecordDecision, SetJobState)),
    # starting and restoring
    Case("starting: running", STARTING, LifeRunning(at=T), Phase.RESTORING, (MarkPhase,)),
    Case("starting array: running is the old life's", ARRAY_STARTING, LifeRunning(at=T), Phase.STARTING, (),
         config=ARRAY),
    Case("starting: first step before the poll saw it run", STARTING, FirstStep(at=T, step=21), Phase.WATCHING,
         (MarkPhase,), check=_incarnation(1, 50)),
    Case("starting array: first step is not the next life's yet", ARRAY_STARTING, FirstStep(at=T, step=21),
         Phase.STARTING, (), config=ARRAY),
    Case("starting: the next life fails", STARTING, confirmed(), Phase.PLANNING, (*OPENED, RequestPlan),
         check=_incarnation(1, 50)),
    Case("starting array: a confirmation of the old life", ARRAY_STARTING, confirmed(), Phase.STARTING, (),
         config=ARRAY),
    Case("starting array: Slurm shows the restart", ARRAY_STARTING, LifeRequeued(at=T, restart_count=1, quiet=False),
         Phase.STARTING, (NewLife,), config=ARRAY, check=lambda s, e: s.restarted and e[0].incarnation == 1),
    Case("starting: the next life requeued for a lost node", STARTING,
         LifeRequeued(at=T, restart_count=1, quiet=True, lost={"n4": "down"}), Phase.PLANNING,
         (RecordDecision, *OPENED, RequestPlan), check=_incarnation(1, 50)),
    Case("starting: the next life requeued itself", STARTING, LifeRequeued(at=T, restart_count=1, quiet=True),
         Phase.STARTING, (NewLife,)),
    Case("starting: the next life ended badly", STARTING, LifeEnded(at=T, slurm_state="FAILED"), Phase.STARTING,
         (FailAll,)),
    Case("starting: the next life finished", STARTING, LifeEnded(at=T, completed=True), Phase.CLOSED, (Close,)),
    Case("starting array: the old life's end state", ARRAY_STARTING, LifeEnded(at=T, slurm_state="FAILED"),
         Phase.STARTING, (), config=ARRAY),
    Case("starting tick: requeued unasked, quiet", replace(STARTING, requeued_at=T - 1), Tick(quiet=True),
         Phase.PLANNING, (RecordDecision, *OPENED, RequestPlan), check=_incarnation(1, 50)),
    Case("starting tick: nothing", STARTING, Tick(), Phase.STARTING, ()),
    Case("starting: relaunched in the allocation again",
         replace(STARTING, path=RecoveryPath.IN_ALLOCATION, next_slurm_job_id=41), relaunched(2), Phase.RESTORING,
         (*OPENED, Note, MarkPhase, MarkPhase, WatchNext), config=SUPERVISED,
         check=lambda s, e: (s.incarnation, s.next_incarnation) == (1, 2)),
    Case("starting array: no report", ARRAY_STARTING, relaunched(2), Phase.STARTING, (), config=ARRAY),
    Case("restoring: first step", RESTORING, FirstStep(at=T, step=21), Phase.WATCHING, (MarkPhase,),
         check=_incarnation(1, 50)),
    Case("restoring: the next life fails", RESTORING, confirmed("task_exit"), Phase.PLANNING, (*OPENED, RequestPlan)),
    Case("restoring: requeued unasked", RESTORING, LifeRequeued(at=T, restart_count=1, quiet=False), Phase.RESTORING,
         (FailAll,), check=lambda s, e: s.requeued_at == T),
    Case("restoring: cancelled by its user", RESTORING, LifeEnded(at=T, cancelled=True), Phase.CLOSED, (Close,),
         check=_close("cancelled")),
    Case("restoring tick: requeued unasked, quiet", replace(RESTORING, requeued_at=T - 1), Tick(quiet=True),
         Phase.PLANNING, (RecordDecision, *OPENED, RequestPlan)),
    Case("restoring: relaunched in the allocation", replace(RESTORING, next_slurm_job_id=41), relaunched(2),
         Phase.RESTORING, (*OPENED, Note, MarkPhase, MarkPhase, WatchNext), config=SUPERVISED),
    Case("restoring: an old report", replace(RESTORING, next_slurm_job_id=41), relaunched(1), Phase.RESTORING, (),
         config=SUPERVISED),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_transition(case: Case) -> None:
    after, effects = step(case.start, case.obs, T, case.config)
    assert after.phase is case.phase
    assert tuple(type(e) for e in effects) == case.effects
    if case.check is not None:
        case.check(after, effects)


def test_every_transition_of_the_table_is_a_case() -> None:
    covered = {(c.start.phase, type(c.obs)) for c in CASES}
    assert set(TRANSITIONS) <= covered, sorted((p.value, t.__name__) for p, t in set(TRANSITIONS) - covered)


SAMPLES: list[Observation] = [Tick(), confirmed(), LifeRequeued(at=T, restart_count=1, quiet=True),
                              LifeEnded(at=T, completed=True), LifeNumbered(incarnation=3), Planned(plan=RESUBMIT),
                              Launched(at=T, incarnation=1, slurm_job_id=50), LaunchRefused(at=T, cause="c", error="e"),
                              LifeRunning(at=T), FirstStep(at=T, step=1), GrowPossible(at=T, plan=GROW),
                              MigrationRequested(at=T, plan=RESUBMIT, nodes=("n3",)), relaunched(), REFUSED]
STARTS = [WATCHING, DELEGATED, PLANNING, WAITING, STOPPING, LAUNCHING, STARTING, RESTORING,
          state(Phase.CLOSED)]
OUTSIDE = [(s, o) for s, o in itertools.product(STARTS, SAMPLES) if (s.phase, type(o)) not in set(TRANSITIONS)]


def test_the_samples_span_every_observation_type_and_phase() -> None:
    assert {type(o) for o in SAMPLES} == {t for _, t in TRANSITIONS}
    assert {s.phase for s in STARTS} == set(Phase)


@pytest.mark.parametrize(("start", "obs"), OUTSIDE, ids=[f"{s.phase.value}-{type(o).__name__}" for s, o in OUTSIDE])
def test_a_pair_outside_the_table_changes_nothing(start: RecoveryState, obs: Observation) -> None:
    assert step(start, obs, T, MGR) == (start, ())


@pytest.mark.parametrize(("cause", "lost", "expected"), [
    ("task_exit", {"n3": "down"}, ("down", ("n3",))),
    ("hang", {"n4": "not_responding", "n3": "fail"}, ("fail", ("n3", "n4"))),
    ("task_exit", {}, ("task_exit", ("n3",))),
    ("drain", {"n4": "down"}, ("drain", ("n3",))),       # a node-state cause names itself
])
def test_root_cause_names_a_lost_node(cause: str, lost: dict[str, str], expected: tuple[str, tuple[str, ...]]) -> None:
    assert root_cause(confirmed(cause).decision, lost) == expected


def test_the_timeline_starts_at_the_earliest_sign() -> None:
    _, effects = step(WATCHING, confirmed(), T, MGR)
    opened = effects[0]
    assert isinstance(opened, OpenRecovery)
    assert (opened.fault_at, opened.detected_at, opened.confirmed_at) == (T - 3, T - 2, T - 1)


class Road:
    """A fake executor: answers RequestPlan and Launch as the manager would, with a fake clock."""

    def __init__(self, config: RecoveryConfig, plans: list[Plan], start: RecoveryState = WATCHING) -> None:
        self.config, self.plans, self.state = config, list(plans), start
        self.now = T
        self.done: list[Any] = []
        self.phases: list[Phase] = [start.phase]

    def feed(self, obs: Observation) -> None:
        queue = [obs]
        while queue:
            self.state, effects = step(self.state, queue.pop(0), self.now, self.config)
            self.phases.append(self.state.phase)
            for e in effects:
                self.done.append(e)
                if isinstance(e, RequestPlan) and self.plans:
                    queue.append(Planned(plan=self.plans.pop(0)))
                elif isinstance(e, Launch):
                    same = e.path in (RecoveryPath.REQUEUED, RecoveryPath.IN_ALLOCATION)
                    queue.append(Launched(at=self.now, incarnation=e.incarnation + 1,
                                          slurm_job_id=41 if same else 50, restore_step=20))

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.done]


def test_a_node_loss_from_its_confirmation_to_the_first_step_of_the_resubmission() -> None:
    road = Road(MGR, [WAIT, RESUBMIT])
    road.feed(confirmed())
    road.now += 1
    road.feed(Tick())                       # waiting: plan again from the next poll
    road.now += 1
    road.feed(Tick(stopped=False))
    road.now += 1
    road.feed(Tick(stopped=True, state="CANCELLED"))
    road.now += 5
    road.feed(LifeRunning(at=road.now))
    road.feed(FirstStep(at=road.now + 1, step=21))
    assert road.kinds() == ["OpenRecovery", "MarkPhase", "RequestPlan", "RecordDecision", "Cancel", "SetJobState",
                            "RequestPlan", "RecordDecision", "MarkPhase", "Cancel", "Note", "Note", "Drain",
                            "Launch", "MarkPhase", "SetJobState", "WatchNext", "MarkPhase", "MarkPhase"]
    marks = [(e.phase, e.incarnation) for e in road.done if isinstance(e, MarkPhase)]
    assert marks == [("confirmed", 0), ("confirmed", 0), ("resubmitted", 0), ("running", 0), ("first_step", 0)]
    assert road.state == initial(1, 50)
    assert [p for p, q in itertools.pairwise(road.phases) if p is not q] == [
        Phase.WATCHING, Phase.PLANNING, Phase.WAITING, Phase.STOPPING, Phase.LAUNCHING, Phase.STARTING,
        Phase.RESTORING]


def test_a_grow_checkpoints_then_cancels_then_resubmits() -> None:
    road = Road(MGR, [])
    road.feed(GrowPossible(at=T, plan=GROW))
    road.now += 2
    road.feed(LifeRequeued(at=road.now, restart_count=1, quiet=True))   # the batch script requeues it
    road.feed(Tick(quiet=False, running=False))
    road.now += 1
    road.feed(Tick(stopped=True))
    launch = next(e for e in road.done if isinstance(e, Launch))
    assert launch.plan == GROW and launch.path is RecoveryPath.RESUBMITTED
    assert road.kinds()[:7] == ["RecordDecision", "OpenRecovery", "MarkPhase", "SignalCheckpoint", "NewLife",
                                "Cancel", "Note"]
    assert road.state.phase is Phase.STARTING


def test_a_supervised_job_the_supervisor_cannot_save_is_resubmitted_by_the_manager() -> None:
    road = Road(SUPERVISED, [RESUBMIT])
    road.feed(confirmed())
    assert road.state.phase is Phase.DELEGATED
    road.now += 21                          # no report within takeover_s
    road.feed(Tick())
    road.feed(Tick(stopped=True))
    assert road.state.phase is Phase.STARTING and road.state.path is RecoveryPath.RESUBMITTED
    (takeover,) = [e for e in road.done if isinstance(e, RecordDecision) and e.verdict == "takeover"]
    assert "no report" in takeover.payload["reason"]
    assert any(isinstance(e, Launch) and e.path is RecoveryPath.RESUBMITTED for e in road.done)


def test_the_supervisor_relaunches_in_its_allocation_then_hands_over() -> None:
    road = Road(SUPERVISOR, [RESUBMIT, WAIT])
    road.feed(confirmed())
    road.feed(Tick(stopped=True))           # the failed step ended
    assert road.state.phase is Phase.STARTING
    (launch,) = [e for e in road.done if isinstance(e, Launch)]
    assert launch.path is RecoveryPath.IN_ALLOCATION and not any(isinstance(e, Drain) for e in road.done)
    assert (road.state.next_incarnation, road.state.next_slurm_job_id) == (1, 41)
    road.feed(LifeRunning(at=T + 1))
    road.feed(FirstStep(at=T + 2, step=21))
    assert road.state == initial(1, 41)
    road.feed(confirmed())                  # a second loss: no spare, below the minimum
    assert road.state.phase is Phase.CLOSED and isinstance(road.done[-1], HandOver)


def test_an_array_task_is_requeued_and_judged_again_once_slurm_shows_it() -> None:
    road = Road(ARRAY, [])
    road.feed(confirmed("task_exit"))
    assert road.state.expect_restart
    road.feed(LifeRunning(at=T))            # still the old life in Slurm's eyes
    road.feed(LifeRequeued(at=T + 1, restart_count=1, quiet=False))
    road.feed(LifeRunning(at=T + 2))
    road.feed(FirstStep(at=T + 3, step=6))
    assert road.kinds() == ["OpenRecovery", "MarkPhase", "Launch", "MarkPhase", "WatchNext", "NewLife", "MarkPhase",
                            "MarkPhase"]
    assert road.state == initial(1, 41)


def test_a_failed_effect_is_asked_again_with_the_same_key() -> None:
    """The executor keeps the state a step started from when an effect fails; the phase's tick then
    emits the same keyed actions again (perform_once does each at most once)."""
    first = step(LAUNCHING, Tick(), T, MGR)[1]
    again = step(LAUNCHING, Tick(), T + 5, MGR)[1]
    assert first == again and isinstance(first[-1], Launch) and first[-1].incarnation == 0


def _rec(**kw: Any) -> Replayed:
    base: dict[str, Any] = {"incarnation": 0, "path": RecoveryPath.RESUBMITTED, "cause": "down", "nodes": ("n3",),
                            "confirmed_at": T - 10, "resubmitted_at": None, "running_at": None,
                            "first_step_at": None, "new_incarnation": None, "plan": None}
    return Replayed(**{**base, **kw})


@pytest.mark.parametrize(("inc", "recs", "config", "phase", "extra"), [
    (0, [], MGR, Phase.WATCHING, {}),
    (0, [_rec()], MGR, Phase.PLANNING, {"plan": None}),
    (0, [_rec(plan=RESUBMIT)], MGR, Phase.PLANNING, {"plan": RESUBMIT}),
    (0, [_rec(plan=WAIT)], MGR, Phase.PLANNING, {"plan": None}),
    (0, [_rec(cause="grow", plan=GROW)], MGR, Phase.STOPPING, {"stop": Stop.CHECKPOINT, "since": T - 10}),
    (0, [_rec(path=RecoveryPath.PLANNED_MIGRATION, cause="fail_slow", plan=RESUBMIT)], MGR, Phase.STOPPING,
     {"stop": Stop.CHECKPOINT}),
    (0, [_rec(path=RecoveryPath.IN_ALLOCATION)], SUPERVISED, Phase.DELEGATED, {"since": T}),
    (1, [_rec(resubmitted_at=T - 5, new_incarnation=1)], MGR, Phase.STARTING, {"next_incarnation": 1}),
    (1, [_rec(resubmitted_at=T - 5, running_at=T - 4, new_incarnation=1)], MGR, Phase.RESTORING, {}),
    (1, [_rec(resubmitted_at=T - 5, running_at=T - 4, first_step_at=T - 3, new_incarnation=1)], MGR, Phase.WATCHING,
     {"incarnation": 1}),
    (0, [_rec(path=RecoveryPath.REQUEUED)], ARRAY, Phase.LAUNCHING, {"incarnation": 0}),
    (0, [_rec(path=RecoveryPath.REQUEUED, resubmitted_at=T - 5, new_incarnation=1)], ARRAY, Phase.STARTING,
     {"incarnation": 0, "restarted": False}),
])
def test_a_restarted_manager_resumes_from_the_journal(inc: int, recs: list[Replayed], config: RecoveryConfig,
                                                       phase: Phase, extra: dict[str, Any]) -> None:
    s = resume(inc, 41, recs, T, config)
    assert s.phase is phase
    for key, value in extra.items():
        assert getattr(s, key) == value, key


def test_resumed_launching_emits_the_launch_it_may_have_done_already() -> None:
    s = resume(0, 41, [_rec(plan=RESUBMIT)], T, MGR)
    s, effects = step(s, Tick(), T, MGR)
    assert [type(e) for e in effects] == [Cancel, Note]       # cancel:<job>:0 again: found done in the journal
    s, effects = step(s, Tick(stopped=True), T + 1, MGR)
    assert [type(e) for e in effects] == [Note, Drain, Launch]
    assert isinstance(effects[-1], Launch) and effects[-1].plan == RESUBMIT


def test_effects_carry_what_the_journal_needs() -> None:
    _, effects = step(LAUNCHING, Launched(at=T, incarnation=1, slurm_job_id=50, restore_step=20), T, MGR)
    watch = effects[-1]
    assert isinstance(watch, WatchNext)
    assert (watch.units, watch.restore_step, watch.quarantine) == (1, 20, RESUBMIT.quarantine)
    _, effects = step(DELEGATED, relaunched(), T, SUPERVISED)
    (note,) = [e for e in effects if isinstance(e, Note)]
    assert note.payload["spares_left"] == {"0": 1, "1": 0} and note.payload["removed"] == {"1": ("n3",)}


# -- the next life's first step, from its ranks' newest beats ----------------------------------------
@dataclass(frozen=True)
class _Beat:
    phase: str
    step: int
    time: float


@pytest.mark.parametrize(("beats", "restore", "seen"), [
    ([], 10, None),
    ([_Beat("starting", -1, 1.0), _Beat("training", 10, 2.0)], 10, None),     # restored, no new step yet
    ([_Beat("training", 11, 3.0), _Beat("training", 12, 2.5)], 10, FirstStep(at=2.5, step=12)),
    # a life of four steps that trained and finished between two polls: its "done" beats still count
    ([_Beat("done", 14, 5.0), _Beat("done", 14, 4.8)], 10, FirstStep(at=4.8, step=14)),
    ([_Beat("stopping", 11, 6.0)], 10, FirstStep(at=6.0, step=11)),
    ([_Beat("failed", 10, 6.0)], 10, None),                                    # failed before a new step
    ([_Beat("starting", 3, 1.0)], None, None),
    ([_Beat("training", 1, 1.5)], None, FirstStep(at=1.5, step=1)),          # a fresh start: past step 0
])
def test_first_step_seen_in_any_phase_after_starting_past_the_restore(
        beats: list[_Beat], restore: int | None, seen: FirstStep | None) -> None:
    assert first_step_seen(beats, restore) == seen
