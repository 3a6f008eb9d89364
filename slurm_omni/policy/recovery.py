"""A recovery as one state machine: observations in, effects out, one table of transitions.

``step(state, observation, now, config) -> (state, effects)`` is the whole of it. It runs no
command, reads no clock (``now`` is passed in) and writes nothing: the manager (and the step
supervisor inside the allocation, with ``role = "supervisor"``) feeds it what it saw and carries
out what it returns, journaling each action in two phases. A fault is followed in one direction:

    watching --FailureConfirmed--> planning --Planned--> stopping --Tick(stopped)--> launching
        --Launched--> starting --LifeRunning--> restoring --FirstStep--> watching

with side roads: ``waiting`` (the plan says WAIT for nodes), ``delegated`` (a supervised job: the
supervisor decides; the manager takes over when it gives up, the allocation ends or it stays
silent), ``stopping`` with ``stop = checkpoint`` first (a grow or a planned migration: USR1, the
ranks checkpoint and exit 75), and the array-task road (``launching`` right after the
confirmation: Slurm requeues the same job id). ``TRANSITIONS`` lists every (phase, observation)
pair that changes anything; any other pair leaves the state as it is.

Paths (``RecoveryPath``): ``in_allocation`` (the supervisor relaunches the step inside the same
Slurm job), ``resubmitted`` (cancel and sbatch of the next incarnation), ``requeued`` (Slurm runs
the same job id again: an array task) and ``planned_migration`` (fail-slow: checkpoint, stop, move).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.placement import Action, Plan
from slurm_omni.policy.recovery_events import (
    Cancel,
    Close,
    Drain,
    Effect,
    Effects,
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
)


class Phase(enum.Enum):
    WATCHING = "watching"      # no recovery open: the judged life trains (or has not started)
    DELEGATED = "delegated"    # supervised job, failure confirmed: the supervisor decides
    PLANNING = "planning"      # confirmed: a plan from a fresh snapshot is needed
    WAITING = "waiting"        # the plan says WAIT for nodes: plan again on every new poll
    STOPPING = "stopping"      # the old life was told to end (``stop``): until it has, or a bound passes
    LAUNCHING = "launching"    # drains and the launch of the next life are outstanding
    STARTING = "starting"      # the next life was launched; not yet seen running
    RESTORING = "restoring"    # running; no step past the restore yet
    CLOSED = "closed"          # the job ended for good (done, cancelled, failed, refused)


JUDGING = frozenset({Phase.WATCHING, Phase.STARTING, Phase.RESTORING})
"""Phases in which the life being watched is judged (its confirmer's verdicts count)."""


class Stop(enum.Enum):
    CANCEL = "cancel"            # scancel (the manager) or the step ended (the supervisor)
    CHECKPOINT = "checkpoint"    # USR1: the ranks checkpoint and exit 75 (grow, planned migration)


Role = Literal["manager", "supervisor"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryConfig:
    """One job's recovery settings."""

    role: Role = "manager"
    """Who runs this machine: the manager (resubmits) or the step supervisor (relaunches in the allocation)."""
    supervised: bool = False
    """Manager side: a step supervisor runs in the job's allocation and decides first."""
    same_job: bool = False
    """An array task: Slurm requeues the same job id (no plan, no cancel, no sbatch)."""
    end_wait_s: float = 35.0
    """After the cancel: how long to wait for Slurm to show the old life no longer RUNNING/COMPLETING."""
    stop_timeout_s: float = 60.0
    """After USR1: how long the ranks may take to checkpoint and stop."""
    takeover_s: float = 60.0
    """Supervised: how long the manager waits for the supervisor's report before it takes over."""
    max_requeues: int = 3
    """A life that checkpointed and was not requeued is resubmitted while its restart count is below this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryState:
    phase: Phase = Phase.WATCHING
    incarnation: int
    """The life the manager judges; once a recovery is open, the one that failed."""
    slurm_job_id: int | None
    """The Slurm job of ``incarnation`` (before the recovery)."""
    path: RecoveryPath | None = None
    cause: str = ""
    nodes: tuple[str, ...] = ()
    plan: Plan | None = None
    stop: Stop | None = None
    since: float | None = None
    """When the phase's bounded wait began (stopping, delegated)."""
    next_incarnation: int | None = None
    next_slurm_job_id: int | None = None
    requeued_at: float | None = None
    """Slurm requeued the judged life unasked: once every rank is quiet, that is the confirmation."""
    restarted: bool = False
    """Array road: Slurm showed the requeued task's next restart count."""
    life_ended: bool = False
    """The judged life's end was acted on (closed or recovering): later sightings change nothing."""

    @property
    def open(self) -> bool:
        return self.phase not in (Phase.WATCHING, Phase.CLOSED)

    @property
    def judging(self) -> bool:
        return self.phase in JUDGING

    @property
    def awaiting(self) -> int | None:
        """The failed incarnation whose timeline waits for the next life's running and first step."""
        return self.incarnation if self.phase in (Phase.STARTING, Phase.RESTORING) else None

    @property
    def expect_restart(self) -> bool:
        """Array road: the task was requeued, Slurm has not shown its next life yet."""
        return self.phase is Phase.STARTING and self.path is RecoveryPath.REQUEUED and not self.restarted


def initial(incarnation: int, slurm_job_id: int | None) -> RecoveryState:
    return RecoveryState(incarnation=incarnation, slurm_job_id=slurm_job_id)


# -- the transitions ------------------------------------------------------------------------------
def step(state: RecoveryState, obs: Observation, now: float, config: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """One observation: the next state and what to do, in order."""
    handler = _TABLE.get((state.phase, type(obs)))
    if handler is None:
        return state, ()
    return handler(state, obs, now, config)


# Judging: the watched life's failure starts a recovery; Slurm's word on it may too.
def _confirmed(s: RecoveryState, o: FailureConfirmed, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    d = o.decision
    if d.verdict is not Verdict.CONFIRMED:
        return s, ()
    cause, nodes = root_cause(d, o.lost)
    fault = d.fault_at
    if fault is not None and d.first_signal_at is not None:
        fault = min(fault, d.first_signal_at)
    return _open(s, cause, nodes, fault_at=fault, detected_at=d.first_signal_at, confirmed_at=d.confirmed_at or now,
                 now=now, c=c)


def root_cause(d: Decision, lost: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """Tasks that died (or hung) on nodes Slurm now reports failed are a node failure: when Slurm
    kills a lost node's job, the tasks' exit records often arrive before the poll that shows the
    node DOWN, and the first agreeing signal names the confirmation's cause."""
    if d.cause not in ("task_exit", "hang", "stuck") or not lost:
        return d.cause, d.nodes
    names = tuple(sorted(lost))
    return lost[names[0]], names


def _open(s: RecoveryState, cause: str, nodes: tuple[str, ...], *, fault_at: float | None,
          detected_at: float | None, confirmed_at: float, now: float, c: RecoveryConfig,
          effects: Effects = (), delegate: bool = True) -> tuple[RecoveryState, Effects]:
    """A confirmed failure of the judged life: open its timeline, take the job's road (a failure
    Slurm itself ended the job for is never the supervisor's: it went down with the job)."""
    inc = s.incarnation
    delegated = c.supervised and c.role == "manager" and delegate
    if c.role == "supervisor":
        path = RecoveryPath.IN_ALLOCATION
    elif c.same_job:
        path = RecoveryPath.REQUEUED
    elif delegated:
        path = RecoveryPath.IN_ALLOCATION    # until the manager has to take over
    else:
        path = RecoveryPath.RESUBMITTED
    opened = (*effects,
              OpenRecovery(incarnation=inc, path=path, cause=cause, nodes=nodes, fault_at=fault_at,
                           detected_at=detected_at, confirmed_at=confirmed_at),
              MarkPhase(incarnation=inc, phase="confirmed", at=confirmed_at))
    base = RecoveryState(incarnation=inc, slurm_job_id=s.slurm_job_id, path=path, cause=cause, nodes=nodes,
                         life_ended=s.life_ended)
    if c.same_job:
        return replace(base, phase=Phase.LAUNCHING), (*opened, Launch(path=path, incarnation=inc, plan=None))
    if delegated:
        return replace(base, phase=Phase.DELEGATED, since=now), opened
    return replace(base, phase=Phase.PLANNING), (*opened, RequestPlan(fresh=True))


def _by_slurm(s: RecoveryState, at: float, lost: Mapping[str, str], now: float,
              c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """Every rank stopped with a checkpoint (exit 75), so no heartbeat goes stale: either Slurm
    ended the job for ``lost`` nodes (the ranks checkpointed on its SIGTERM), or it was not
    requeued as the ranks asked. Both end the life; Slurm's own word is the confirmation."""
    nodes = tuple(sorted(lost))
    if nodes:
        cause = lost[nodes[0]]
        why = f"Slurm ended the job: {', '.join(nodes)} {cause}"
    elif s.requeued_at is not None:
        cause, why = "requeued", "Slurm requeued the job unasked; every rank checkpointed on its way out"
    else:
        cause, why = "checkpointed", "ranks checkpointed for requeue; the job was not requeued"
    decision = Decision(Verdict.CONFIRMED, at, cause=cause, nodes=nodes, first_signal_at=at, confirmed_at=at,
                        reasons=(why,))
    record = RecordDecision(incarnation=s.incarnation, at=at, verdict="confirmed", cause=cause, payload=decision)
    return _open(replace(s, life_ended=True, requeued_at=None), cause, nodes, fault_at=at, detected_at=at,
                 confirmed_at=at, now=now, c=c, effects=(record,), delegate=False)


def _requeued(s: RecoveryState, o: LifeRequeued, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """Slurm requeued the job (same id, restart count + 1): after a checkpointed exit that is the
    job's own requeue; otherwise (JobRequeue after a node failure) the life ended badly."""
    if s.expect_restart:   # the array task this recovery requeued
        return replace(s, restarted=True), (NewLife(restart_count=o.restart_count, incarnation=o.restart_count),)
    if o.lost:
        # Slurm killed the job for a lost node and requeued it (JobRequeue): a node failure,
        # whatever the ranks' last words (on Slurm's SIGTERM they checkpoint and exit 75). The
        # recovery cancels the requeued job to place the next life by topology instead.
        return _by_slurm(s, o.at, o.lost, now, c)
    if o.quiet:
        return s, (NewLife(restart_count=o.restart_count),)
    # Requeued without a lost node in sight: the life being judged ended badly. Its ranks' beats
    # stop (the next life's carry another restart count and are not read).
    return replace(s, requeued_at=o.at), (
        FailAll(at=o.at, why=f"requeued by Slurm ({o.reason or 'no reason given'})"),)


def _ended(s: RecoveryState, o: LifeEnded, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.life_ended or s.expect_restart:
        return s, ()
    closed = replace(s, phase=Phase.CLOSED, life_ended=True)
    if o.completed:
        return closed, (Close(state="done", at=o.at, reason="done"),)
    if o.cancelled and not o.lost:
        # scancel by its user or an admin; the ranks checkpointed on its SIGTERM, but nobody asked
        # for the job to run again
        return closed, (Close(state="cancelled", at=o.at, reason="cancelled in Slurm"),)
    if o.quiet:
        if o.lost or o.restart_count < c.max_requeues:
            return _by_slurm(s, o.at, o.lost, now, c)
        return closed, (Close(state="failed", at=o.at, reason="checkpointed; max_requeues reached"),)
    if not o.trained:   # it never trained: resubmitting a job that cannot start helps nobody
        return closed, (Close(state="failed", at=o.at, reason=f"ended {o.slurm_state or 'unseen'} before training"),)
    return s, (FailAll(at=o.at, why=f"job {o.slurm_state or 'left the queue'}"),)


def _input_refused(s: RecoveryState, o: InputRefused, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """Bad input in the judged life (a command not found, a rank's exit 78, an exit 0 before the last
    step, no heartbeat ever): every life would end the same way, so the job ends here, with the line
    saying what to fix; a life still running is cancelled first."""
    judged = s.next_incarnation if s.phase is not Phase.WATCHING and s.next_incarnation is not None else s.incarnation
    cancel: Effects = () if o.cancel is None else (Cancel(incarnation=judged, slurm_job_id=o.cancel),)
    return (replace(s, phase=Phase.CLOSED, life_ended=True),
            (RecordDecision(incarnation=judged, at=o.at, verdict="refused", cause=o.cause, payload={"line": o.line}),
             *cancel, Close(state="failed", at=o.at, reason=o.line)))


def _numbered(s: RecoveryState, o: LifeNumbered, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    return replace(s, incarnation=o.incarnation), ()


def _judging_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.requeued_at is not None and o.quiet:
        # requeued by Slurm and every rank checkpointed on its way out: no rank will go stale; the
        # nodes it lost may show only now (the poll that saw the requeue came first)
        return _by_slurm(s, s.requeued_at, o.lost, now, c)
    return s, ()


def _planned_stop(s: RecoveryState, o: GrowPossible | MigrationRequested, now: float,
                  c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """A stop the job did not ask for but gains from: checkpoint (USR1), then cancel and relaunch."""
    if s.slurm_job_id is None or c.same_job:
        return s, ()
    if isinstance(o, MigrationRequested):
        path, cause, nodes = RecoveryPath.PLANNED_MIGRATION, o.cause, o.nodes
    else:
        path, cause, nodes = RecoveryPath.RESUBMITTED, "grow", ()
    inc = s.incarnation
    return (RecoveryState(phase=Phase.STOPPING, stop=Stop.CHECKPOINT, since=o.at, incarnation=inc,
                          slurm_job_id=s.slurm_job_id, path=path, cause=cause, nodes=nodes, plan=o.plan),
            (RecordDecision(incarnation=inc, at=o.at, verdict="plan", cause=o.plan.action.value, payload=o.plan),
             OpenRecovery(incarnation=inc, path=path, cause=cause, nodes=nodes, fault_at=None, detected_at=o.at,
                          confirmed_at=o.at),
             MarkPhase(incarnation=inc, phase="confirmed", at=o.at, plan=o.plan),
             SignalCheckpoint(incarnation=inc, slurm_job_id=s.slurm_job_id)))


def _relaunched(s: RecoveryState, o: SupervisorReport, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """The supervisor relaunched inside the allocation (before or after the manager confirmed)."""
    if o.kind == "gave_up":
        if s.phase is Phase.DELEGATED:
            return _take_over(s, now, f"the step supervisor gave up: {o.reason}")
        return s, ()
    if o.incarnation_after is None or o.incarnation_after <= s.incarnation or s.slurm_job_id is None:
        return s, ()
    inc = s.incarnation
    effects: list[Effect] = []
    if s.phase is not Phase.DELEGATED:
        confirmed = o.confirmed_at if o.confirmed_at is not None else o.at
        effects += [OpenRecovery(incarnation=inc, path=RecoveryPath.IN_ALLOCATION, cause=o.cause, nodes=o.nodes,
                                 fault_at=o.fault_at, detected_at=o.detected_at, confirmed_at=confirmed),
                    MarkPhase(incarnation=inc, phase="confirmed", at=confirmed)]
    detail = {"removed": dict(o.removed), "added": dict(o.added), "spares_left": dict(o.spares_left),
              "data_parallel_size": o.data_parallel_size}
    effects += [Note(incarnation=inc, kind="supervisor_relaunch", at=o.at, payload=detail,
                     key=f"relaunch:{inc}:{o.incarnation_after}"),
                MarkPhase(incarnation=inc, phase="resubmitted", at=o.at, new_incarnation=o.incarnation_after,
                          path=RecoveryPath.IN_ALLOCATION, detail=detail),
                MarkPhase(incarnation=inc, phase="running", at=o.at),   # the relaunched step runs in the same job
                WatchNext(path=RecoveryPath.IN_ALLOCATION, incarnation=o.incarnation_after, slurm_job_id=s.slurm_job_id, units=None, restore_step=None,
                          quarantine=None, same_job=True)]
    return (RecoveryState(phase=Phase.RESTORING, incarnation=inc, slurm_job_id=s.slurm_job_id,
                          path=RecoveryPath.IN_ALLOCATION, cause=o.cause or s.cause, nodes=o.nodes or s.nodes,
                          next_incarnation=o.incarnation_after, next_slurm_job_id=s.slurm_job_id, restarted=True),
            tuple(effects))


# Delegated: the supervisor decides; the manager takes over when it cannot.
def _take_over(s: RecoveryState, now: float, why: str) -> tuple[RecoveryState, Effects]:
    return (replace(s, phase=Phase.PLANNING, path=RecoveryPath.RESUBMITTED, since=None),
            (RecordDecision(incarnation=s.incarnation, at=now, verdict="takeover", cause=s.cause,
                            payload={"reason": why}),
             MarkPhase(incarnation=s.incarnation, phase="confirmed", at=now, path=RecoveryPath.RESUBMITTED),
             RequestPlan(fresh=True)))


def _delegated_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if o.ended:
        return _take_over(s, now, "the allocation ended")
    if o.batch_host_lost:
        # The supervisor runs in the batch script: it went with its node. 22.05 and 24.11 end the
        # job for a lost batch host; 26.05 keeps a --no-kill job RUNNING without it, until its
        # time limit: no report will come, and the plan cancels the allocation.
        return _take_over(s, now, f"the batch host {o.batch_host_lost} is lost: the step supervisor ran there")
    if s.since is not None and now - s.since >= c.takeover_s:
        return _take_over(s, now, f"no report from the step supervisor in {c.takeover_s:g} s")
    return s, ()


def _delegated_end(s: RecoveryState, o: LifeEnded, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    return _take_over(replace(s, life_ended=True), now, f"the allocation ended ({o.slurm_state or 'left the queue'})")


def _delegated_requeued(s: RecoveryState, o: LifeRequeued, now: float,
                        c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """Slurm requeued the allocation (its batch host was lost): the supervisor went with it."""
    return _take_over(s, now, f"Slurm requeued the allocation ({o.reason or 'no reason given'})")


# Planning and waiting: a plan, then end the old life.
def _planning_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.plan is not None:   # a plan journaled before a restart
        return _planned(s, Planned(plan=s.plan), now, c)
    return s, (RequestPlan(fresh=True),)


def _planned(s: RecoveryState, o: Planned, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    plan, inc = o.plan, s.incarnation
    cancel: Effects = ()
    if s.slurm_job_id is not None:
        cancel = (Cancel(incarnation=inc, slurm_job_id=s.slurm_job_id),)
    if plan.action is Action.WAIT:
        if c.role == "supervisor":
            return (replace(s, phase=Phase.CLOSED, plan=plan),
                    (HandOver(at=now, reason="; ".join(plan.reasons) or "no spare and below the minimum"),))
        if s.phase is Phase.WAITING:
            return s, ()
        return (replace(s, phase=Phase.WAITING, plan=None),
                (RecordDecision(incarnation=inc, at=now, verdict="plan", cause=plan.action.value, payload=plan),
                 *cancel, SetJobState(state="waiting")))
    decided: Effects = ()
    if s.plan is None:
        decided = (RecordDecision(incarnation=inc, at=now, verdict="plan", cause=plan.action.value, payload=plan),
                   MarkPhase(incarnation=inc, phase="confirmed", at=now, plan=plan))
    stopping = replace(s, phase=Phase.STOPPING, stop=Stop.CANCEL, since=now, plan=plan)
    if s.slurm_job_id is None:
        return _stopped(stopping, now, None, "", c, decided)
    return stopping, (*decided, *cancel, Note(incarnation=inc, kind="old_incarnation_stopping", at=now,
                                              payload={"slurm_job_id": s.slurm_job_id, "limit_s": c.end_wait_s},
                                              key=f"end-wait:{inc}"))


def _waiting_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    return s, (RequestPlan(fresh=False),)


# Stopping: the old life ends (bounded), then the next one is launched.
def _stopping_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    waited = now - (s.since if s.since is not None else now)
    if s.stop is Stop.CHECKPOINT:
        if not (o.quiet or not o.running or o.ended or waited >= c.stop_timeout_s):
            return s, ()
        if s.slurm_job_id is None:
            return _stopped(replace(s, stop=Stop.CANCEL, since=now), now, None, "", c)
        return (replace(s, stop=Stop.CANCEL, since=now),
                (Cancel(incarnation=s.incarnation, slurm_job_id=s.slurm_job_id),
                 Note(incarnation=s.incarnation, kind="old_incarnation_stopping", at=now,
                      payload={"slurm_job_id": s.slurm_job_id, "limit_s": c.end_wait_s},
                      key=f"end-wait:{s.incarnation}")))
    if o.stopped:
        return _stopped(s, now, "stopped", o.state, c)
    if waited >= c.end_wait_s:
        # a node that stopped answering can keep the job COMPLETING for long; the checkpoint fence
        # refuses the old ranks' later saves once the next life started
        return _stopped(s, now, "timed_out", o.state, c)
    return s, ()


def _stopped(s: RecoveryState, now: float, outcome: str | None, slurm_state: str, c: RecoveryConfig,
             before: Effects = ()) -> tuple[RecoveryState, Effects]:
    """The old life has stopped (or the wait is over): drain what failed, launch the next life."""
    inc = s.incarnation
    effects: list[Effect] = list(before)
    if outcome is not None:
        waited = round(now - (s.since if s.since is not None else now), 3)
        effects.append(Note(incarnation=inc, kind="old_incarnation_end", at=now,
                            payload={"slurm_job_id": s.slurm_job_id, "outcome": outcome, "waited_s": waited,
                                     "state": slurm_state or None}, key=f"end:{inc}"))
    plan = s.plan
    if plan is not None and c.role == "manager":
        effects += [Drain(incarnation=inc, node=n, reason=r) for n, r in plan.drain]
    path = s.path or RecoveryPath.RESUBMITTED
    effects.append(Launch(path=path, incarnation=inc, plan=plan))
    return replace(s, phase=Phase.LAUNCHING, stop=None, since=None), tuple(effects)


def _stopping_ended(s: RecoveryState, o: LifeEnded, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """While the ranks were asked to checkpoint for a move: training finished (nothing to move), or
    its user cancelled the job (nobody asked for it to run again)."""
    if s.stop is not Stop.CHECKPOINT:
        return s, ()
    if o.completed:
        return replace(s, phase=Phase.CLOSED, life_ended=True), (Close(state="done", at=o.at, reason="done"),)
    if o.cancelled and not o.lost:
        return (replace(s, phase=Phase.CLOSED, life_ended=True),
                (Close(state="cancelled", at=o.at, reason="cancelled in Slurm"),))
    return s, ()


def _stopping_requeued(s: RecoveryState, o: LifeRequeued, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """USR1 before a grow: the ranks exit 75 and the batch script requeues the job; that life is
    the same incarnation again (not running until it starts)."""
    if s.stop is Stop.CHECKPOINT:
        return s, (NewLife(restart_count=o.restart_count),)
    return s, ()


# Launching: the next life, until the executor says it exists.
def _launching_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    plan = s.plan
    effects: list[Effect] = []
    if plan is not None and c.role == "manager":   # drains are keyed: a repeat is a no-op
        effects += [Drain(incarnation=s.incarnation, node=n, reason=r) for n, r in plan.drain]
    effects.append(Launch(path=s.path or RecoveryPath.RESUBMITTED, incarnation=s.incarnation, plan=plan))
    return s, tuple(effects)


def _launched(s: RecoveryState, o: Launched, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    inc, plan = s.incarnation, s.plan
    same = s.path in (RecoveryPath.REQUEUED, RecoveryPath.IN_ALLOCATION) and o.slurm_job_id == s.slurm_job_id
    effects: list[Effect] = [MarkPhase(incarnation=inc, phase="resubmitted", at=o.at, new_incarnation=o.incarnation)]
    if c.role == "manager" and not same:
        effects.append(SetJobState(state="active"))
    effects.append(WatchNext(path=s.path or RecoveryPath.RESUBMITTED, incarnation=o.incarnation, slurm_job_id=o.slurm_job_id,
                             units=plan.units if plan is not None else None, restore_step=o.restore_step,
                             quarantine=plan.quarantine if plan is not None else None, same_job=same))
    return (replace(s, phase=Phase.STARTING, next_incarnation=o.incarnation, next_slurm_job_id=o.slurm_job_id,
                    restarted=not (s.path is RecoveryPath.REQUEUED), life_ended=False, requeued_at=None),
            tuple(effects))


def _refused(s: RecoveryState, o: LaunchRefused, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    return (replace(s, phase=Phase.CLOSED),
            (RecordDecision(incarnation=s.incarnation, at=o.at, verdict="refused", cause=o.cause,
                            payload={"error": o.error}), SetJobState(state="failed")))


# Starting and restoring: the next life runs, then trains past its restore step.
def _running(s: RecoveryState, o: LifeRunning, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.expect_restart:
        return s, ()
    return replace(s, phase=Phase.RESTORING), (MarkPhase(incarnation=s.incarnation, phase="running", at=o.at),)


def _first_step(s: RecoveryState, o: FirstStep, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.expect_restart:
        return s, ()
    nxt = s.next_incarnation if s.next_incarnation is not None else s.incarnation
    nxt_id = s.next_slurm_job_id if s.next_slurm_job_id is not None else s.slurm_job_id
    return initial(nxt, nxt_id), (MarkPhase(incarnation=s.incarnation, phase="first_step", at=o.at),)


def _next_life_confirmed(s: RecoveryState, o: FailureConfirmed, now: float,
                         c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """The next life failed before its first step: its own recovery (this timeline stays open)."""
    if s.expect_restart:
        return s, ()
    return _confirmed(_watching_next(s), o, now, c)


def _next_life_requeued(s: RecoveryState, o: LifeRequeued, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.expect_restart:
        return _requeued(s, o, now, c)
    nxt, effects = _requeued(_watching_next(s), o, now, c)
    return (nxt, effects) if nxt.open else (replace(s, requeued_at=nxt.requeued_at), effects)


def _next_life_ended(s: RecoveryState, o: LifeEnded, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.expect_restart:
        return s, ()
    nxt, effects = _ended(_watching_next(s), o, now, c)
    return (nxt, effects) if nxt.open or nxt.phase is Phase.CLOSED else (s, effects)


def _next_life_report(s: RecoveryState, o: SupervisorReport, now: float,
                      c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    """The supervisor relaunched again (the next life failed too, inside the allocation)."""
    if s.expect_restart:
        return s, ()
    nxt, effects = _relaunched(_watching_next(s), o, now, c)
    return (nxt, effects) if effects else (s, ())


def _next_life_tick(s: RecoveryState, o: Tick, now: float, c: RecoveryConfig) -> tuple[RecoveryState, Effects]:
    if s.requeued_at is not None and o.quiet:
        return _by_slurm(_watching_next(s), s.requeued_at, o.lost, now, c)
    return s, ()


def _watching_next(s: RecoveryState) -> RecoveryState:
    """The next life as the judged one (its predecessor's timeline waits no more)."""
    nxt = s.next_incarnation if s.next_incarnation is not None else s.incarnation
    nxt_id = s.next_slurm_job_id if s.next_slurm_job_id is not None else s.slurm_job_id
    return replace(initial(nxt, nxt_id), requeued_at=s.requeued_at, life_ended=s.life_ended)


_Handler = Callable[[RecoveryState, Any, float, RecoveryConfig], tuple[RecoveryState, Effects]]
_TABLE: dict[tuple[Phase, type], _Handler] = {
    (Phase.WATCHING, FailureConfirmed): _confirmed,
    (Phase.WATCHING, LifeRequeued): _requeued,
    (Phase.WATCHING, LifeEnded): _ended,
    (Phase.WATCHING, Tick): _judging_tick,
    (Phase.WATCHING, LifeNumbered): _numbered,
    (Phase.WATCHING, InputRefused): _input_refused,
    (Phase.STARTING, InputRefused): _input_refused,
    (Phase.RESTORING, InputRefused): _input_refused,
    (Phase.WATCHING, GrowPossible): _planned_stop,
    (Phase.WATCHING, MigrationRequested): _planned_stop,
    (Phase.WATCHING, SupervisorReport): _relaunched,
    (Phase.DELEGATED, SupervisorReport): _relaunched,
    (Phase.DELEGATED, Tick): _delegated_tick,
    (Phase.DELEGATED, LifeEnded): _delegated_end,
    (Phase.DELEGATED, LifeRequeued): _delegated_requeued,
    (Phase.PLANNING, Planned): _planned,
    (Phase.PLANNING, Tick): _planning_tick,
    (Phase.WAITING, Planned): _planned,
    (Phase.WAITING, Tick): _waiting_tick,
    (Phase.STOPPING, Tick): _stopping_tick,
    (Phase.STOPPING, LifeRequeued): _stopping_requeued,
    (Phase.STOPPING, LifeEnded): _stopping_ended,
    (Phase.LAUNCHING, Tick): _launching_tick,
    (Phase.LAUNCHING, Launched): _launched,
    (Phase.LAUNCHING, LaunchRefused): _refused,
    (Phase.STARTING, LifeRunning): _running,
    (Phase.STARTING, FirstStep): _first_step,
    (Phase.STARTING, FailureConfirmed): _next_life_confirmed,
    (Phase.STARTING, LifeRequeued): _next_life_requeued,
    (Phase.STARTING, LifeEnded): _next_life_ended,
    (Phase.STARTING, Tick): _next_life_tick,
    (Phase.STARTING, SupervisorReport): _next_life_report,
    (Phase.RESTORING, FirstStep): _first_step,
    (Phase.RESTORING, FailureConfirmed): _next_life_confirmed,
    (Phase.RESTORING, LifeRequeued): _next_life_requeued,
    (Phase.RESTORING, LifeEnded): _next_life_ended,
    (Phase.RESTORING, Tick): _next_life_tick,
    (Phase.RESTORING, SupervisorReport): _next_life_report,
}
TRANSITIONS: tuple[tuple[Phase, type], ...] = tuple(_TABLE)
"""Every (phase, observation type) pair that has a transition; the rest change nothing."""


# -- after a restart ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Replayed:
    """One recovery as the journal holds it (a restarted manager's memory)."""

    incarnation: int
    path: RecoveryPath | None
    cause: str
    nodes: tuple[str, ...]
    confirmed_at: float | None
    resubmitted_at: float | None
    running_at: float | None
    first_step_at: float | None
    new_incarnation: int | None
    plan: Plan | None


def resume(incarnation: int, slurm_job_id: int | None, recoveries: Sequence[Replayed], now: float,
           config: RecoveryConfig) -> RecoveryState:
    """The state a restarted manager carries on from: the newest open recovery of the incarnation
    it watches (``incarnation``: the newest with a Slurm job id; an array task's is the recovery's
    own). Every effect it then emits again is found done in the journal (or by its tag in Slurm)."""
    state = initial(incarnation, slurm_job_id)
    for rec in recoveries:
        plan = rec.plan if rec.plan is not None and rec.plan.action is not Action.WAIT else None
        base = RecoveryState(incarnation=rec.incarnation, slurm_job_id=slurm_job_id, path=rec.path, cause=rec.cause,
                             nodes=rec.nodes, plan=plan)
        if config.same_job:   # an array task's incarnations are its restart counts
            if rec.resubmitted_at is None:
                state = replace(base, phase=Phase.LAUNCHING, path=RecoveryPath.REQUEUED)
            elif rec.first_step_at is None:
                state = replace(base, phase=Phase.STARTING, path=RecoveryPath.REQUEUED,
                                next_incarnation=rec.new_incarnation)
        elif rec.incarnation == incarnation and rec.resubmitted_at is None:
            if rec.path is RecoveryPath.IN_ALLOCATION and config.supervised:
                state = replace(base, phase=Phase.DELEGATED, since=now)
            elif rec.cause == "grow" or rec.path is RecoveryPath.PLANNED_MIGRATION:
                state = replace(base, phase=Phase.STOPPING, stop=Stop.CHECKPOINT, since=rec.confirmed_at)
            else:
                state = replace(base, phase=Phase.PLANNING)
        elif rec.new_incarnation == incarnation and rec.first_step_at is None:
            state = replace(base, phase=Phase.RESTORING if rec.running_at is not None else Phase.STARTING,
                            next_incarnation=incarnation, next_slurm_job_id=slurm_job_id, restarted=True)
    return state
