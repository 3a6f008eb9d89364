"""The step supervisor's decisions (policy/supervision.py), alone: what a launch's end means, when a
running step is killed, a replacement request's outcome."""

from __future__ import annotations

import pytest

from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.in_allocation import Fallback, Relaunch, StepLayout
from slurm_omni.policy.placement import Action
from slurm_omni.policy.recovery import Phase
from slurm_omni.policy.recovery_events import FailureConfirmed, Launch, MigrationRequested, RecoveryPath
from slurm_omni.policy.recovery_events import HandOver as TableHandOver
from slurm_omni.policy.supervision import (
    PLANNED,
    PORT_BASE,
    PORT_SPAN,
    Finish,
    HandOver,
    LaunchEnd,
    Recover,
    SupervisionLimits,
    adopted_rc,
    after_launch,
    as_plan,
    fruitless_launches,
    kill_on,
    next_launch,
    recovery_road,
    rendezvous_ports,
    request_outcome,
    stop_due,
    supervisor_gone,
)

LIMITS = SupervisionLimits(max_fruitless=3, max_relaunches=2)


def _end(rc: int, *, stop: bool = False, state: str = "RUNNING", fruitless: int = 0, host: str = "",
         repeated: str = "", refused: str = "") -> LaunchEnd:
    return LaunchEnd(number=0, rc=rc, asked_to_stop=stop, job_state=state, fruitless=fruitless, batch_host_lost=host,
                     repeated=repeated, refused=refused)


@pytest.mark.parametrize(("end", "expected"), [
    (_end(EXIT_DONE, stop=True, state="COMPLETING"), Finish(EXIT_DONE, "done")),   # done wins over all
    (_end(143, stop=True), Finish(EXIT_CHECKPOINTED, "stopped", "the supervisor was signalled to stop")),
    (_end(EXIT_CHECKPOINTED, stop=True), Finish(EXIT_CHECKPOINTED, "stopped", "the supervisor was signalled to stop")),
    (_end(137, stop=True), Finish(137, "stopped", "the supervisor was signalled to stop")),
    (_end(137, state="COMPLETING"), Finish(EXIT_FAILED, "stopped", "Slurm shows the job COMPLETING")),
    (_end(EXIT_CHECKPOINTED, state="PENDING"), Finish(EXIT_CHECKPOINTED, "stopped", "Slurm shows the job PENDING")),
    (_end(1, fruitless=4), HandOver(("4 launches in a row ended before their first step",))),
    (_end(1, fruitless=3), Recover()),
    (_end(137, host="node1", fruitless=4), HandOver(("the batch host node1 is lost (this supervisor runs there)",))),
    (_end(137, host="node1", state="FAILED"), Finish(EXIT_FAILED, "stopped", "Slurm shows the job FAILED")),
    (_end(137, state=""), Recover()),   # Slurm could not tell: a failure still recovers
    # the same failure before the first heartbeat twice: bad input, before the fruitless hand-over
    (_end(137, fruitless=4, repeated="job 7 (x): ... twice"), Finish(EXIT_BAD_INPUT, "stopped", "job 7 (x): ... twice")),
    (_end(1, fruitless=2, repeated="the line"), Finish(EXIT_BAD_INPUT, "stopped", "the line")),
    (_end(1, stop=True, repeated="the line"), Finish(1, "stopped", "the supervisor was signalled to stop")),
    # a rank exited 78 after its first heartbeat (srun says 137: the others were killed for it): no relaunch
    (_end(137, refused="job 7 (x): rank 1 refused its input: ..."),
     Finish(EXIT_BAD_INPUT, "stopped", "job 7 (x): rank 1 refused its input: ...")),
    (_end(137, fruitless=4, refused="r"), Finish(EXIT_BAD_INPUT, "stopped", "r")),
    (_end(137, stop=True, refused="r"), Finish(137, "stopped", "the supervisor was signalled to stop")),
])
def test_what_the_end_of_a_launch_means(end: LaunchEnd, expected: object) -> None:
    assert after_launch(end, LIMITS) == expected


def _relaunch(units: int = 1, before: int = 1) -> Relaunch:
    layout = StepLayout((("node1",), ("node2",)), (), ("node3",), units, {})
    return Relaunch(layout, ("node3",), ("node2",), before, ())


def test_the_relaunch_count_is_held_to_its_limit() -> None:
    assert next_launch(1, _relaunch(), LIMITS) == _relaunch()
    assert next_launch(2, _relaunch(), LIMITS) == Fallback(("node3",), ("2 relaunches reached",))
    fallback = Fallback(("node3",), ("below the minimum",))
    assert next_launch(0, fallback, LIMITS) is fallback


def test_fruitless_launches_count_back_to_one_that_stepped_or_was_planned() -> None:
    assert fruitless_launches([]) == 0
    assert fruitless_launches([(1.0, ""), (None, "down"), (None, "task_exit")]) == 2
    assert fruitless_launches([(None, ""), (None, PLANNED), (None, "down")]) == 1
    assert fruitless_launches([(None, ""), (None, "down")]) == 2


def test_a_confirmed_failure_kills_the_step_unless_it_was_asked_to_end() -> None:
    confirmed = Decision(Verdict.CONFIRMED, 1.0, cause="down", nodes=("node3",))
    suspect = Decision(Verdict.SUSPECT, 1.0)
    assert kill_on(confirmed, asked_to_stop=False, stopping=False)
    assert not kill_on(confirmed, asked_to_stop=True, stopping=False)
    assert not kill_on(confirmed, asked_to_stop=False, stopping=True)
    assert not kill_on(suspect, asked_to_stop=False, stopping=False)   # a slow step is no failure


@pytest.mark.parametrize(("phases", "rc"), [
    (["done", "done"], EXIT_DONE), (["stopping"], EXIT_CHECKPOINTED), (["done", "stopping"], EXIT_FAILED),
    (["training"], EXIT_FAILED), ([], EXIT_FAILED)])
def test_an_adopted_steps_exit_code_from_its_ranks_last_phases(phases: list[str], rc: int) -> None:
    assert adopted_rc(phases) == rc


def test_a_replacement_request_outcome() -> None:
    running = ("node1", "node2", "node3")
    assert request_outcome(["node9"], running, _relaunch()) == "unknown_node"
    assert request_outcome(["node3"], running, None) == "no_spare"
    assert request_outcome(["node3"], running, Fallback((), ())) == "no_spare"
    assert request_outcome(["node3"], running, _relaunch(units=1, before=2)) == "no_spare"   # shrinking
    assert request_outcome(["node3"], running, _relaunch()) == "accepted"
    # a request that allows a shrink (the manager's estimate: k-1 healthy replicas beat k with a slow one)
    assert request_outcome(["node3"], running, _relaunch(units=1, before=2), shrink=True) == "accepted"
    assert request_outcome(["node3"], running, _relaunch(), shrink=True) == "accepted"     # a spare after all
    assert request_outcome(["node3"], running, Fallback((), ()), shrink=True) == "below_minimum"
    assert request_outcome(["node3"], running, None, shrink=True) == "below_minimum"
    assert request_outcome(["node9"], running, _relaunch(units=1, before=2), shrink=True) == "unknown_node"


def test_rendezvous_ports_start_at_the_launchs_own_port_then_spread_and_skip_the_ephemeral_range() -> None:
    first = rendezvous_ports("15001", 0)
    assert first[0] == 20000 + (15001 * 37) % 15000 == 20037
    assert rendezvous_ports("15001", 1)[0] == 20038          # the next launch never shares the old store's
    assert len(set(first)) == len(first) == 8
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in first)
    assert rendezvous_ports("not-a-number", 2)[0] == 29502
    # a job whose own port lies in the ephemeral range starts at the next candidate outside it
    job = next(str(j) for j in range(1, 2000) if 32768 <= 20000 + (j * 37) % 15000 <= 34000)
    ports = rendezvous_ports(job, 0, avoid=(32768, 60999), count=20)
    plain = rendezvous_ports(job, 0, count=40)
    assert ports == tuple(p for p in plain if not 32768 <= p <= 60999)[:20] and ports[0] != plain[0]
    # every port of the window comes up once
    every = rendezvous_ports("7", 3, count=PORT_SPAN)
    assert sorted(every) == list(range(PORT_BASE, PORT_BASE + PORT_SPAN))


BEFORE = StepLayout((("node1", "node4"), ("node2", "node3")), ("node5", "node6"), (), 2, {})
CONFIRMED = FailureConfirmed(decision=Decision(Verdict.CONFIRMED, 10.0, cause="down", nodes=("node3",),
                                               first_signal_at=9.5, confirmed_at=10.0))


def _replaced() -> Relaunch:
    layout = StepLayout((("node1", "node4"), ("node2", "node6")), ("node5",), ("node3",), 2, {})
    return Relaunch(layout, ("node3",), ("node6",), 2, ("component 1: 1 node(s) on the same leaf",))


def test_a_confirmed_failure_goes_through_the_table_to_a_launch_in_the_allocation() -> None:
    effect, phases = recovery_road(CONFIRMED, _replaced(), incarnation=3, slurm_job_id=42, before=BEFORE, now=11.0)
    assert phases == (Phase.PLANNING, Phase.STOPPING, Phase.LAUNCHING)
    assert isinstance(effect, Launch) and effect.path is RecoveryPath.IN_ALLOCATION and effect.incarnation == 3
    plan = effect.plan
    assert plan is not None and plan.action is Action.RESUBMIT and plan.units == 2
    assert [(c.het_offset, c.nodes, c.added, c.removed) for c in plan.components] == [
        (0, ("node1", "node4"), (), ()), (1, ("node2", "node6"), ("node6",), ("node3",))]
    assert plan.exclude == ("node3",) and plan.reasons == _replaced().reasons


def test_a_shrink_is_a_shrink_plan_and_no_launch_that_fits_hands_over() -> None:
    shrunk = Relaunch(StepLayout((("node1",), ("node2",)), ("node4",), ("node3", "node6"), 1, {}),
                      ("node3", "node4"), (), 2, ("shrink 2 -> 1 placement unit(s)",))
    effect, _ = recovery_road(CONFIRMED, shrunk, incarnation=3, slurm_job_id=42, before=BEFORE, now=11.0)
    assert isinstance(effect, Launch) and effect.plan is not None
    assert effect.plan.action is Action.SHRINK and effect.plan.units == 1   # placement units, not replicas
    effect, phases = recovery_road(CONFIRMED, Fallback(("node3",), ("no spare", "below min")), incarnation=3,
                                   slurm_job_id=42, before=BEFORE, now=11.0)
    assert phases == (Phase.PLANNING, Phase.CLOSED)
    assert isinstance(effect, TableHandOver) and effect.reason == "no spare; below min"


def test_a_requested_replacement_goes_through_the_checkpoint_stop_then_launches() -> None:
    replaced = _replaced()
    asked = MigrationRequested(at=10.0, plan=as_plan(replaced, BEFORE), nodes=("node3",), cause="planned")
    effect, phases = recovery_road(asked, replaced, incarnation=3, slurm_job_id=42, before=BEFORE, now=11.0)
    assert phases == (Phase.STOPPING, Phase.STOPPING, Phase.LAUNCHING)
    assert isinstance(effect, Launch) and effect.path is RecoveryPath.PLANNED_MIGRATION
    assert effect.plan == as_plan(replaced, BEFORE)


def test_allocation_mode_the_first_nodes_loss_is_recovered_in_the_allocation_like_any_other() -> None:
    """With no batch host (allocation mode) the first node of the allocation is one node among the
    others: its end means a recovery, and the table's road launches on a spare in the same job."""
    assert isinstance(after_launch(_end(137, host=""), LIMITS), Recover)
    first = FailureConfirmed(decision=Decision(Verdict.CONFIRMED, 10.0, cause="down", nodes=("node1",),
                                               first_signal_at=9.5, confirmed_at=10.0))
    layout = StepLayout((("node5", "node4"), ("node2", "node3")), ("node6",), ("node1",), 2, {})
    relaunch = Relaunch(layout, ("node1",), ("node5",), 2, ("component 0: 1 node(s) on the same leaf",))
    effect, phases = recovery_road(first, relaunch, incarnation=3, slurm_job_id=42, before=BEFORE, now=11.0)
    assert phases == (Phase.PLANNING, Phase.STOPPING, Phase.LAUNCHING)
    assert isinstance(effect, Launch) and effect.path is RecoveryPath.IN_ALLOCATION and effect.plan is not None
    assert effect.plan.components[0].removed == ("node1",) and effect.plan.components[0].added == ("node5",)


@pytest.mark.parametrize(("end_time", "now", "before", "due"), [
    (None, 100.0, 300, False),        # Slurm gave no end time
    (1000.0, 100.0, 0, False),        # no lead asked for
    (1000.0, 699.0, 300, False),
    (1000.0, 700.0, 300, True),
    (1000.0, 1200.0, 300, True),      # late: still stop
])
def test_allocation_mode_stops_the_step_its_lead_before_the_time_limit(end_time: float | None, now: float,
                                                                       before: int, due: bool) -> None:
    assert stop_due(end_time, now, before) is due


@pytest.mark.parametrize(("phase", "state", "alive", "age", "gone"), [
    ("running", "RUNNING", False, 1.0, True),          # its process is gone on this host
    ("running", "RUNNING", True, 500.0, False),        # alive, however old its status
    ("relaunching", "RUNNING", None, 31.0, True),      # on another host, its status stale
    ("running", "RUNNING", None, 5.0, False),          # on another host, its status fresh
    ("launching", "PENDING", None, None, True),        # never wrote a status, from another host
    ("waiting", "PENDING", None, 12.0, False),         # waits in the queue, its status fresh
    ("waiting", "PENDING", False, 12.0, True),         # its process gone while the job waits
    ("done", "RUNNING", False, 1.0, False),            # nothing left to do
    ("fallback", "RUNNING", False, 1.0, False),        # handed over to the manager
    ("stopped", "RUNNING", False, 1.0, False),         # stopped for the time limit
    ("running", "COMPLETED", False, 1.0, False),       # its allocation ended
    ("running", "", False, 1.0, False),                # Slurm does not know the job (yet or any more)
])
def test_allocation_mode_a_new_supervisor_only_for_a_gone_one_with_work_left(
        phase: str, state: str, alive: bool | None, age: float | None, gone: bool) -> None:
    assert supervisor_gone(phase=phase, job_state=state, alive=alive, status_age_s=age, stale_after_s=30.0) is gone
