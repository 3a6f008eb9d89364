"""The manager's watch of a Slurm job as one table (policy/watch_lifecycle.py), alone and with a fake
clock: every (phase, event) pair of the table, what each changes and returns, a whole road from
submission through a requeue, a relaunch and the next submission, and the restored life."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from slurm_omni.policy.confirm import Verdict
from slurm_omni.policy.in_allocation import REQUEUE_INCARNATION_STRIDE
from slurm_omni.policy.placement import Quarantine
from slurm_omni.policy.watch_lifecycle import (
    SLURM_SPECIAL_STEPS,
    TRANSITIONS,
    CountRecord,
    Effects,
    Ended,
    Event,
    Gone,
    JobStateSet,
    Judged,
    Moved,
    NodesLost,
    NumberLife,
    Phase,
    PlanPolled,
    Polled,
    RecordVerdict,
    Relaunched,
    Requeued,
    Restarted,
    RestartSeen,
    Shown,
    StaleRecord,
    Started,
    StartOver,
    StateChanged,
    Switched,
    TaskRecord,
    TaskRequeued,
    WatchLife,
    initial,
    restored,
    step,
)

NODES = {0: ("node1",), 1: ("node2", "node3")}
QUEUED = initial(3, 41, 2)
RUNNING = replace(QUEUED, phase=Phase.RUNNING, seen=True, nodes=NODES, batch_host="node1", running_since=10.0,
                  slurm_state="RUNNING", step_id_max=6, verdict=Verdict.SUSPECT)
SETTLING = replace(RUNNING, phase=Phase.SETTLING, running_since=None, slurm_state="FAILED", step_id_max=-1,
                   verdict=Verdict.NONE, restart_count=1, slurm_restart_count=1)
AT = {Phase.QUEUED: QUEUED, Phase.RUNNING: RUNNING, Phase.SETTLING: SETTLING}
NOW = 1000.0


@dataclass(frozen=True)
class Case:
    name: str
    start: WatchLife
    event: Event
    check: Callable[[WatchLife, WatchLife, Effects], None]

    def __str__(self) -> str:
        return f"{self.start.phase.value}-{type(self.event).__name__}-{self.name}"


def unchanged(before: WatchLife, after: WatchLife, effects: Effects) -> None:
    assert after == before and effects == ()


def changed(effects: Effects = (), **fields: object) -> Callable[[WatchLife, WatchLife, Effects], None]:
    """Exactly ``fields`` changed, and exactly ``effects`` came out."""
    def check(before: WatchLife, after: WatchLife, got: Effects) -> None:
        assert after == replace(before, **fields)  # type: ignore[arg-type]
        assert got == effects
    return check


def in_every_phase(name: str, event: Event, check: Callable[[WatchLife], Callable[..., None]],
                   start: Callable[[WatchLife], WatchLife] = lambda s: s) -> list[Case]:
    return [Case(name, start(AT[p]), event, check(start(AT[p]))) for p in Phase]


def _switched(s: WatchLife) -> Callable[..., None]:
    def check(before: WatchLife, after: WatchLife, effects: Effects) -> None:
        assert after == WatchLife(incarnation=7, slurm_id=52, units=1, restore_step=40, allocation_base=7,
                                  quarantine=Quarantine({"node2": NOW + 60}), ended_ids=frozenset({30, 41}),
                                  last_plan_poll=before.last_plan_poll)
        assert after.phase is Phase.QUEUED and not after.seen and not after.ended and after.state == "active"
        assert effects == (StartOver(nodes={}, forget_node_states=True),)
    return check


def _requeued(s: WatchLife, **fields: object) -> Callable[..., None]:
    return changed((StartOver(nodes=s.nodes),), phase=Phase.SETTLING, running_since=None,
                   relaunched_incarnation=None, step_id_max=-1, stale_step_max=-1, verdict=Verdict.NONE, **fields)


CASES: list[Case] = [
    # the first sight tells a restarted manager the restart count; an array task is numbered by it
    *in_every_phase("first-sight", Shown(at=5.0, restart_count=2),
                    lambda s: changed(seen=True, restart_count=2, slurm_restart_count=2),
                    lambda s: replace(s, seen=False)),
    *in_every_phase("array-task-numbered", Shown(at=5.0, restart_count=2, numbered_by_restart=True),
                    lambda s: changed((NumberLife(incarnation=2),), seen=True, restart_count=2,
                                      slurm_restart_count=2, incarnation=2),
                    lambda s: replace(s, seen=False)),
    *in_every_phase("requeued-task-not-yet-restarted", Shown(at=5.0, restart_count=2, expect_restart=True),
                    lambda s: changed(seen=True), lambda s: replace(s, seen=False)),
    *in_every_phase("seen-before", Shown(at=5.0, restart_count=9, numbered_by_restart=True),
                    lambda s: unchanged, lambda s: replace(s, seen=True)),
    # Slurm's restart count: a new one is the recovery's to judge
    *in_every_phase("new-restart-count", RestartSeen(at=5.0, restart_count=4),
                    lambda s: changed((Restarted(at=5.0, restart_count=4),), slurm_restart_count=4)),
    *in_every_phase("same-restart-count", RestartSeen(at=5.0, restart_count=1), lambda s: unchanged,
                    lambda s: replace(s, slurm_restart_count=1)),
    # the poll's state of the job, by phase
    Case("pending", QUEUED, Polled(at=5.0, slurm_state="PENDING", running=False, finished=False, restart_count=0),
         changed((StateChanged(at=5.0, slurm_state="PENDING"),), slurm_state="PENDING")),
    Case("starts", replace(QUEUED, slurm_state="PENDING", running_restart_count=1),
         Polled(at=5.0, slurm_state="RUNNING", running=True, finished=False, restart_count=2, batch_host="node1",
                nodes=NODES),
         changed((StateChanged(at=5.0, slurm_state="RUNNING"),
                  StartOver(nodes=NODES, forget_phases=False, forget_node_states=True), Started(at=5.0)),
                 slurm_state="RUNNING", phase=Phase.RUNNING, running_restart_count=2, batch_host="node1",
                 running_since=5.0, nodes=NODES)),
    Case("never-ran", replace(QUEUED, slurm_state="PENDING"),
         Polled(at=5.0, slurm_state="FAILED", running=False, finished=True, restart_count=0),
         changed((StateChanged(at=5.0, slurm_state="FAILED"), Ended(at=5.0)), slurm_state="FAILED", ended=True)),
    Case("runs-on", RUNNING, Polled(at=5.0, slurm_state="RUNNING", running=True, finished=False, restart_count=3,
                                    nodes={0: ("elsewhere",)}),
         changed(running_restart_count=3)),
    Case("ends", RUNNING, Polled(at=5.0, slurm_state="COMPLETED", running=False, finished=True, restart_count=0),
         changed((StateChanged(at=5.0, slurm_state="COMPLETED"), Ended(at=5.0)), slurm_state="COMPLETED",
                 ended=True)),
    Case("ended-again", replace(RUNNING, slurm_state="FAILED", ended=True),
         Polled(at=6.0, slurm_state="FAILED", running=False, finished=True, restart_count=0),
         changed((Ended(at=6.0),))),
    Case("comes-back", replace(RUNNING, slurm_state="COMPLETING", ended=True),
         Polled(at=6.0, slurm_state="RUNNING", running=True, finished=False, restart_count=0),
         changed((StateChanged(at=6.0, slurm_state="RUNNING"),), slurm_state="RUNNING", ended=False)),
    Case("old-end-shown", SETTLING, Polled(at=5.0, slurm_state="CANCELLED", running=False, finished=True,
                                           restart_count=1),
         changed((StateChanged(at=5.0, slurm_state="CANCELLED"),), slurm_state="CANCELLED")),
    Case("pending-again", replace(SETTLING, ended=True),
         Polled(at=5.0, slurm_state="PENDING", running=False, finished=False, restart_count=1),
         changed((StateChanged(at=5.0, slurm_state="PENDING"),), slurm_state="PENDING", phase=Phase.QUEUED,
                 ended=False)),
    Case("runs-again", SETTLING, Polled(at=5.0, slurm_state="RUNNING", running=True, finished=False,
                                        restart_count=1, batch_host="node4", nodes={0: ("node4",)}),
         changed((StateChanged(at=5.0, slurm_state="RUNNING"),
                  StartOver(nodes={0: ("node4",)}, forget_phases=False, forget_node_states=True), Started(at=5.0)),
                 slurm_state="RUNNING", phase=Phase.RUNNING, running_restart_count=1, batch_host="node4",
                 running_since=5.0, nodes={0: ("node4",)})),
    # allocation mode: the supervisor moved the life to a successor allocation
    Case("moved", RUNNING, Moved(at=50.0, running=True, batch_host="node7", nodes={0: ("node7",), 1: ("node8",)}),
         changed((StartOver(nodes={0: ("node7",), 1: ("node8",)}, forget_phases=False, forget_node_states=True),),
                 batch_host="node7", running_since=50.0, nodes={0: ("node7",), 1: ("node8",)})),
    Case("same-nodes", RUNNING, Moved(at=50.0, running=True, batch_host="node9", nodes={0: ("node3", "node1", "node2")}),
         unchanged),
    Case("successor-pending", RUNNING, Moved(at=50.0, running=False, nodes={0: ("node7",)}), unchanged),
    Case("not-started", QUEUED, Moved(at=50.0, running=True, nodes={0: ("node7",)}), unchanged),
    Case("requeued", SETTLING, Moved(at=50.0, running=True, nodes={0: ("node7",)}), unchanged),
    # the poll no longer shows the job
    *in_every_phase("gone", Gone(at=5.0), lambda s: changed((Ended(at=5.0),), ended=True),
                    lambda s: replace(s, seen=True)),
    *in_every_phase("never-seen", Gone(at=5.0), lambda s: unchanged, lambda s: replace(s, seen=False)),
    # a task's fault record: whose launch it is
    *in_every_phase("counted", TaskRecord(step_id=7), lambda s: changed((CountRecord(),), step_id_max=7),
                    lambda s: replace(s, step_id_max=6, stale_step_max=5)),
    *in_every_phase("an-earlier-launch", TaskRecord(step_id=5), lambda s: changed((StaleRecord(step_id=5, launch=4),)),
                    lambda s: replace(s, step_id_max=6, stale_step_max=5, relaunched_incarnation=4)),
    *in_every_phase("slurms-own-step", TaskRecord(step_id=SLURM_SPECIAL_STEPS + 2),
                    lambda s: changed((CountRecord(),)), lambda s: replace(s, step_id_max=6, stale_step_max=5)),
    # the confirmer's verdict: journaled once per change
    *in_every_phase("new-verdict", Judged(verdict=Verdict.CONFIRMED),
                    lambda s: changed((RecordVerdict(verdict=Verdict.CONFIRMED),), verdict=Verdict.CONFIRMED)),
    *in_every_phase("same-verdict", Judged(verdict=Verdict.SUSPECT), lambda s: unchanged,
                    lambda s: replace(s, verdict=Verdict.SUSPECT)),
    # the supervisor's failed nodes: quarantined, once
    *in_every_phase("quarantined", NodesLost(nodes=("node2", "node9"), seconds=60.0),
                    lambda s: changed(quarantine=Quarantine({"node9": NOW + 10, "node2": NOW + 60})),
                    lambda s: replace(s, quarantine=Quarantine({"node9": NOW + 10, "node7": NOW - 1}))),
    *in_every_phase("already-quarantined", NodesLost(nodes=("node9",), seconds=60.0), lambda s: unchanged,
                    lambda s: replace(s, quarantine=Quarantine({"node9": NOW + 10}))),
    *in_every_phase("plan-polled", PlanPolled(poll=12), lambda s: changed(last_plan_poll=12)),
    # the recovery's word on the life
    *in_every_phase("requeued", Requeued(restart_count=2),
                    lambda s: _requeued(s, restart_count=2), lambda s: replace(s, relaunched_incarnation=5)),
    *in_every_phase("array-requeued", Requeued(restart_count=2, incarnation=2),
                    lambda s: _requeued(s, restart_count=2, incarnation=2)),
    *in_every_phase("task-requeued", TaskRequeued(restore_step=40), lambda s: _requeued(s, restore_step=40),
                    lambda s: replace(s, stale_step_max=3)),
    *in_every_phase("relaunched", Relaunched(incarnation=104),
                    lambda s: changed((StartOver(nodes=s.nodes),), incarnation=104, relaunched_incarnation=104,
                                      stale_step_max=8, verdict=Verdict.NONE),
                    lambda s: replace(s, step_id_max=8)),
    *in_every_phase("switched", Switched(incarnation=7, slurm_id=52, units=1, restore_step=40,
                                         quarantine=Quarantine({"node2": NOW + 60})), _switched,
                    lambda s: replace(s, ended_ids=frozenset({30}), ended=True, state="waiting", last_plan_poll=4)),
    *in_every_phase("job-state", JobStateSet(state="waiting"), lambda s: changed(state="waiting")),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_transition(case: Case) -> None:
    after, effects = step(case.start, case.event, NOW)
    case.check(case.start, after, effects)


def test_every_transition_of_the_table_is_a_case() -> None:
    covered = {(c.start.phase, type(c.event)) for c in CASES}
    assert set(TRANSITIONS) <= covered, sorted((p.value, t.__name__) for p, t in set(TRANSITIONS) - covered)
    assert len(TRANSITIONS) == len(Phase) * len({type(c.event) for c in CASES})   # every event, every phase


def test_a_life_from_submission_through_a_requeue_a_relaunch_and_the_next_submission() -> None:
    clock = iter(range(100, 200))

    def feed(s: WatchLife, event: Event) -> tuple[WatchLife, Effects]:
        return step(s, event, float(next(clock)))

    s, _ = feed(initial(0, 41, 2), Shown(at=1.0, restart_count=0))
    s, fx = feed(s, Polled(at=2.0, slurm_state="RUNNING", running=True, finished=False, restart_count=0,
                           batch_host="node1", nodes=NODES))
    assert s.running and Started(at=2.0) in fx and s.judged_incarnation(task_base=None, supervised=True) == 0
    s, _ = feed(s, TaskRecord(step_id=0))
    s, fx = feed(s, Relaunched(incarnation=1))        # the supervisor relaunched: launch 1, step 1
    assert (s.incarnation, s.judged_incarnation(task_base=None, supervised=True)) == (1, 1)
    assert feed(s, TaskRecord(step_id=0))[1] == (StaleRecord(step_id=0, launch=1),)
    s, fx = feed(s, RestartSeen(at=3.0, restart_count=1))
    assert fx == (Restarted(at=3.0, restart_count=1),)
    s, _ = feed(s, Requeued(restart_count=1))          # the recovery: the job's own requeue
    assert s.settling and not s.running
    assert s.judged_incarnation(task_base=None, supervised=True) == 0 + REQUEUE_INCARNATION_STRIDE
    s, fx = feed(s, Polled(at=4.0, slurm_state="FAILED", running=False, finished=True, restart_count=1))
    assert s.settling and Ended(at=4.0) not in fx     # 22.05 shows the old life's end a while
    s, _ = feed(s, Polled(at=5.0, slurm_state="PENDING", running=False, finished=False, restart_count=1))
    s, fx = feed(s, Polled(at=6.0, slurm_state="RUNNING", running=True, finished=False, restart_count=1,
                           nodes=NODES))
    assert s.running and s.running_since == 6.0 and s.running_restart_count == 1
    s, fx = feed(s, Polled(at=7.0, slurm_state="FAILED", running=False, finished=True, restart_count=1))
    assert s.ended and fx[-1] == Ended(at=7.0)
    s, _ = feed(s, Switched(incarnation=102, slurm_id=52, units=1, restore_step=30, quarantine=Quarantine()))
    assert (s.phase, s.slurm_id, s.ended_ids, s.restart_count) == (Phase.QUEUED, 52, frozenset({41}), 0)
    assert s.judged_incarnation(task_base=None, supervised=False) == 102


def test_the_judged_incarnation_of_each_kind_of_job() -> None:
    s = replace(initial(3, 41, 1), restart_count=2)
    assert s.judged_incarnation(task_base=None, supervised=False) == 5          # a submission: base + requeues
    assert s.judged_incarnation(task_base=10, supervised=False) == 12           # an array task: its base + restarts
    assert s.judged_incarnation(task_base=None, supervised=True) == 3 + 2 * REQUEUE_INCARNATION_STRIDE
    relaunched = replace(s, relaunched_incarnation=205)
    assert relaunched.judged_incarnation(task_base=None, supervised=True) == 205
    assert relaunched.allocation_incarnation(1) == 3 + REQUEUE_INCARNATION_STRIDE   # not this requeue's relaunch
    assert s.plan_due(0) and not replace(s, last_plan_poll=0).plan_due(0)


def test_a_restarted_manager_carries_on_from_the_journaled_incarnation() -> None:
    s = restored(replace(initial(0, 41, 2), state="waiting"), incarnation=104, slurm_id=43, ended_ids=[41, 42],
                 allocation_base=103, relaunched=True, units=1, restore_step=30)
    assert (s.incarnation, s.slurm_id, s.ended_ids, s.allocation_base, s.relaunched_incarnation, s.units,
            s.restore_step, s.state) == (104, 43, frozenset({41, 42}), 103, 104, 1, 30, "waiting")
    assert s.phase is Phase.QUEUED and not s.seen
    assert restored(s, incarnation=2, slurm_id=43, ended_ids=(), allocation_base=2, relaunched=False, units=1,
                    restore_step=None).relaunched_incarnation is None
