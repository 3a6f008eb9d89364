"""The step supervisor's lifecycle as one transition table (pure: no command, no file, time passed in).

``supervisor/run.py`` feeds it what it saw and carries out the effects it returns; it decides
nothing. One launch of the step at a time::

    WAITING --AllocationPolled(RUNNING)--> LAUNCHING (TakeAllocation)    [allocation mode only]
    LAUNCHING --Replayed--> LAUNCHING (StartStandbys, FirstLaunch) | DONE | FALLBACK (Exit)
    LAUNCHING --LaunchJournaled, LaunchRunning--> RUNNING
    RUNNING --Watched(confirmed)--> CONFIRMING (KillStep) --Watched(grace over)--> (LeaveStep)
    RUNNING --Watched(request accepted | time limit near | signal)--> STOPPING (SignalStep | ForwardStop)
    RUNNING | STOPPING --SuccessorPolled--> (AskSuccessor)                    [allocation mode: the time limit]
          | STOPPING (SignalStep: the planned save; the next launch moves to the successor)
          | (DropSuccessor: it did not start before the stop, or it is gone: the manager's resubmission)
    LAUNCHING | RUNNING | STOPPING | CONFIRMING --LaunchEnded--> DONE | STOPPED | FALLBACK (Exit) | ENDED (Plan)
    ENDED --Planned--> RELAUNCHING | SHRINKING (IntendLaunch) --LaunchJournaled--> LAUNCHING
          --Planned(no launch fits, the relaunch limit)--> FALLBACK (GiveUp, Exit)

What a launch's end means (:func:`policy.supervision.after_launch`), the relaunch limit
(``next_launch``), when a running step is killed (``kill_on``) and the time limit's lead
(``stop_due``) are the table's rules; a recovery itself goes through the one recovery table
(``policy.recovery.step``, role supervisor, via ``policy.supervision.recovery_road``), the one the
manager runs. The phase is what the status file says (``formats.supervisor.SupervisorPhase``).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from enum import Enum

from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_DONE, EXIT_FAILED
from slurm_omni.policy.confirm import Decision
from slurm_omni.policy.in_allocation import Fallback, Relaunch, StepLayout
from slurm_omni.policy.pools import successor_due
from slurm_omni.policy.recovery_events import FailureConfirmed, MigrationRequested
from slurm_omni.policy.recovery_events import HandOver as TableHandOver
from slurm_omni.policy.supervision import (
    Finish,
    HandOver,
    LaunchEnd,
    SupervisionLimits,
    after_launch,
    kill_on,
    next_launch,
    recovery_road,
    stop_due,
)

KILLED_RC = 128 + signal.SIGKILL
"""What a launch whose tasks were killed (SIGKILL) counts as when its srun is left behind."""


class Phase(str, Enum):
    WAITING = "waiting"
    """Allocation mode: for the allocation to start."""
    LAUNCHING = "launching"
    """A launch is journaled; its srun is being started (or found, adopted)."""
    RUNNING = "running"
    STOPPING = "stopping"
    """The step was asked to checkpoint and end (a planned replacement, the time limit, a signal)."""
    CONFIRMING = "confirming"
    """The rule confirmed a failure while the step ran: its tasks are killed, its srun given a grace."""
    ENDED = "ended"
    """The launch ended and a recovery follows: its plan is being made."""
    RELAUNCHING = "relaunching"
    """The next launch is planned (the recovery table said Launch)."""
    SHRINKING = "shrinking"
    """The next launch is planned with fewer placement units than this one (no spare was left)."""
    DONE = "done"
    STOPPED = "stopped"
    FALLBACK = "fallback"
    """Handed over to the manager's resubmission."""


TERMINAL = frozenset({Phase.DONE, Phase.STOPPED, Phase.FALLBACK})
LIVE_PHASES = frozenset(p.value for p in Phase if p not in TERMINAL)
"""Status phases of a supervisor with work left (the manager starts a new one when it is gone)."""
_WATCHED = frozenset({Phase.RUNNING, Phase.STOPPING, Phase.CONFIRMING})
_ENDING = frozenset({Phase.LAUNCHING, *_WATCHED})


@dataclass(frozen=True, kw_only=True, slots=True)
class LifecycleConfig:
    limits: SupervisionLimits = field(default_factory=SupervisionLimits)
    kill_grace_s: float = 0.0
    """After killing a confirmed failed step's tasks, wait this long for its srun before relaunching."""
    stop_before_s: float = 0.0
    """Allocation mode: stop the step this long before the allocation's time limit."""
    stop_signal: int = signal.SIGUSR1
    outside: bool = False
    """Allocation mode: no batch script ends the allocation, the supervisor releases it when done."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SupervisorState:
    phase: Phase
    launch: int | None = None
    """The current launch's number."""
    end_time: float | None = None
    """Allocation mode: the allocation's time limit (Unix time)."""
    asked_to_stop: bool = False
    """A signal (forwarded to the step) or the time limit asked this supervisor to stop."""
    stopping: bool = False
    """The step was asked to checkpoint for a planned replacement: its end is no failure."""
    killed_at: float | None = None
    successor: str = ""
    """Allocation mode: the successor allocation's state as the journal last said (``policy.pools.
    SUCCESSOR_STATES``; empty: none asked for while this allocation runs)."""
    moving: bool = False
    """The step was asked to checkpoint because the successor started: the next launch runs there."""


def initial(*, outside: bool) -> SupervisorState:
    return SupervisorState(phase=Phase.WAITING if outside else Phase.LAUNCHING)


# -- observations -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AllocationPolled:
    """Allocation mode, WAITING: Slurm's state of the allocation; ``ours``: it is this user's."""

    at: float
    state: str
    user_id: int | None = None
    """The allocation's owner (None: Slurm did not say)."""
    my_uid: int = -1
    has_nodes: bool = True
    end_time: float | None = None
    signalled: bool = False
    """This supervisor was signalled to stop while it waited."""


@dataclass(frozen=True, slots=True)
class Replayed:
    """The journal, read at start: its outcome (``done``, ``fallback`` or empty) and current launch."""

    at: float
    outcome: str
    launch: int | None


@dataclass(frozen=True, slots=True)
class LaunchJournaled:
    at: float
    launch: int
    end_time: float | None = None
    """The launch runs in a successor allocation: its time limit (the successor is now the allocation)."""


@dataclass(frozen=True, slots=True)
class LaunchRunning:
    """The launch's srun started, or was found running (adopted), or was found gone."""

    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Watched:
    """One tick while the launch runs: the rule's verdict now, whether a signal asked this
    supervisor to stop, and (only on a node poll) whether a replacement request was just accepted
    and whether the time limit is to be checked."""

    at: float
    decision: Decision | None = None
    signalled: bool = False
    request_accepted: bool = False
    check_time_limit: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class SuccessorPolled:
    """Allocation mode, every node poll of a running launch: the successor allocation as the journal
    knows it (``state``: empty when none was asked for, else ``policy.pools.SUCCESSOR_STATES``; a
    restarted supervisor learns it from its journal here), and how long before this allocation's time
    limit to ask for it (``lead_s``, :func:`policy.pools.successor_lead_s`)."""

    at: float
    state: str
    lead_s: float
    job_id: str = ""


@dataclass(frozen=True, slots=True)
class LaunchEnded:
    """The launch's srun returned (or was left behind): everything its end means."""

    at: float
    end: LaunchEnd


@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """ENDED: the recovery's opening (a confirmed failure, or a replacement that was asked for) and
    the placement policy's plan for the next launch."""

    at: float
    first: FailureConfirmed | MigrationRequested
    plan: Relaunch | Fallback
    before: StepLayout
    incarnation: int
    slurm_job_id: int


Event = (AllocationPolled | Replayed | LaunchJournaled | LaunchRunning | Watched | SuccessorPolled | LaunchEnded
         | Planned)


# -- effects ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TakeAllocation:
    """Allocation mode: the allocation runs: take its nodes as Slurm lists them now."""


@dataclass(frozen=True, slots=True)
class StartStandbys:
    """The job goes on: keep a warm standby on every node (those not found running)."""


@dataclass(frozen=True, slots=True)
class FirstLaunch:
    """No launch journaled yet: plan and journal launch 0."""


@dataclass(frozen=True, slots=True)
class KillStep:
    """Kill the running step's tasks now (the rule confirmed a failure)."""


@dataclass(frozen=True, slots=True)
class LeaveStep:
    """The killed step's srun had its grace: count the launch ended with ``rc`` (its LaunchEnded
    follows) and reap the srun later."""

    rc: int


@dataclass(frozen=True, slots=True)
class SignalStep:
    """Ask the step to checkpoint and end (a planned replacement): ``signum`` to its srun."""

    signum: int


@dataclass(frozen=True, slots=True)
class ForwardStop:
    """Allocation mode: the time limit is ``stop_before_s`` away: ``signum`` to the step, as if the
    batch shell had forwarded Slurm's signal."""

    signum: int


@dataclass(frozen=True, slots=True)
class AskSuccessor:
    """Ask Slurm for a successor allocation of the job's whole shape now (in the background, journaled)."""

    reason: str


@dataclass(frozen=True, slots=True)
class MoveToSuccessor:
    """The successor started: the running step is asked to checkpoint (its ``SignalStep`` follows);
    the next launch runs on the successor and this allocation is released."""

    job_id: str


@dataclass(frozen=True, slots=True)
class DropSuccessor:
    """No move: give the successor back (when it is still open) and say in one line that the time
    limit's stop and the manager's resubmission follow (today's behaviour)."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class JournalDone:
    """Training is done: journal it (and, in allocation mode, release the allocation)."""

    release: bool


@dataclass(frozen=True, slots=True)
class ReleaseAllocation:
    """Allocation mode: a journal already done (its predecessor may have died before releasing)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """ENDED: make the recovery's plan (a requested replacement, else confirm and place)."""


@dataclass(frozen=True, slots=True)
class IntendLaunch:
    """Journal launch ``number`` with ``relaunch``'s layout (then its report); ``road``: the recovery
    table's phases, for the log line."""

    number: int
    relaunch: Relaunch
    cause: str
    """``planned`` for a replacement that was asked for, else the confirmed failure's cause."""
    road: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Hand over to the manager's resubmission: journal the fallback, the ``gave_up`` report.
    ``failed``: None for the launch's own failed nodes (plus, with ``lost_batch_host``, the nodes
    lost under it: the launch's end is confirmed first)."""

    reasons: tuple[str, ...]
    failed: tuple[str, ...] | None = None
    lost_batch_host: bool = False


@dataclass(frozen=True, slots=True)
class Exit:
    """The supervisor ends with ``code``; ``reason``: the line to log (empty: none)."""

    code: int
    reason: str = ""


Effect = (TakeAllocation | StartStandbys | FirstLaunch | KillStep | LeaveStep | SignalStep | ForwardStop | JournalDone
          | ReleaseAllocation | Plan | IntendLaunch | GiveUp | Exit | AskSuccessor | MoveToSuccessor | DropSuccessor)


class IllegalTransition(ValueError):
    """An event the phase cannot take (a bug in the caller: the table has no such row)."""


def step(state: SupervisorState, event: Event, config: LifecycleConfig
         ) -> tuple[SupervisorState, tuple[Effect, ...]]:
    """The next state and the effects to carry out, in order."""
    phase = state.phase
    if isinstance(event, AllocationPolled) and phase is Phase.WAITING:
        return _allocation(state, event)
    if isinstance(event, Replayed) and phase is Phase.LAUNCHING:
        if event.outcome == "done":
            return replace(state, phase=Phase.DONE), (
                *((ReleaseAllocation(),) if config.outside else ()), Exit(EXIT_DONE))
        if event.outcome == "fallback":
            return replace(state, phase=Phase.FALLBACK), (Exit(EXIT_FAILED),)
        if event.launch is None:
            return state, (StartStandbys(), FirstLaunch())
        return replace(state, launch=event.launch), (StartStandbys(),)
    if isinstance(event, LaunchJournaled) and phase in (Phase.LAUNCHING, Phase.RELAUNCHING, Phase.SHRINKING):
        if event.end_time is not None:   # the launch runs in the successor: it is the allocation now
            return replace(state, phase=Phase.LAUNCHING, launch=event.launch, stopping=False, killed_at=None,
                           end_time=event.end_time, successor="", moving=False), ()
        return replace(state, phase=Phase.LAUNCHING, launch=event.launch, stopping=False, killed_at=None,
                       moving=False), ()
    if isinstance(event, LaunchRunning) and phase is Phase.LAUNCHING:
        return replace(state, phase=Phase.RUNNING, stopping=False, killed_at=None), ()
    if isinstance(event, Watched) and phase in _WATCHED:
        return _watched(state, event, config)
    if isinstance(event, SuccessorPolled) and phase in (Phase.RUNNING, Phase.STOPPING):
        return _successor(state, event, config)
    if isinstance(event, LaunchEnded) and phase in _ENDING:
        return _ended(state, event, config)
    if isinstance(event, Planned) and phase is Phase.ENDED:
        return _planned(state, event, config)
    raise IllegalTransition(f"supervisor lifecycle: no transition from {phase.value} on {type(event).__name__}")


def _allocation(state: SupervisorState, e: AllocationPolled) -> tuple[SupervisorState, tuple[Effect, ...]]:
    if e.user_id is not None and e.user_id != e.my_uid:
        return replace(state, phase=Phase.STOPPED), (
            Exit(EXIT_FAILED, f"it belongs to uid {e.user_id}, not {e.my_uid}"),)
    if e.state == "RUNNING" and e.has_nodes:
        return replace(state, phase=Phase.LAUNCHING, end_time=e.end_time), (TakeAllocation(),)
    if e.state not in ("PENDING", "CONFIGURING", "RUNNING"):
        return replace(state, phase=Phase.STOPPED), (Exit(EXIT_FAILED, f"it is {e.state or 'gone'}: nothing to supervise"),)
    if e.signalled:
        return replace(state, phase=Phase.STOPPED, asked_to_stop=True), (
            Exit(EXIT_FAILED, "signalled to stop while it waited"),)
    return state, ()   # still queued (or RUNNING without its nodes listed yet): poll again


def _watched(state: SupervisorState, e: Watched, c: LifecycleConfig) -> tuple[SupervisorState, tuple[Effect, ...]]:
    if state.phase is Phase.CONFIRMING:   # killed: only the grace for its srun is left
        if state.killed_at is not None and e.at - state.killed_at >= c.kill_grace_s:
            return state, (LeaveStep(KILLED_RC),)   # its end follows: LaunchEnded
        return state, ()
    effects: list[Effect] = []
    asked = state.asked_to_stop or e.signalled
    stopping = state.stopping
    if (e.check_time_limit and not asked and not state.moving   # moving: the ranks already save
            and stop_due(state.end_time, e.at, c.stop_before_s)):
        asked = True
        effects.append(ForwardStop(c.stop_signal))
    if e.request_accepted and not stopping:
        stopping = True
        effects.append(SignalStep(signal.SIGUSR1))   # checkpoint and exit 75
    phase = Phase.STOPPING if (asked or stopping) else state.phase
    if e.decision is not None and kill_on(e.decision, asked_to_stop=asked, stopping=stopping):
        return replace(state, phase=Phase.CONFIRMING, asked_to_stop=asked, stopping=stopping, killed_at=e.at), (
            *effects, KillStep())
    return replace(state, phase=phase, asked_to_stop=asked, stopping=stopping), tuple(effects)


SUCCESSOR_OPEN = frozenset({"asking", "requested", "granted"})


def _successor(state: SupervisorState, e: SuccessorPolled, c: LifecycleConfig
               ) -> tuple[SupervisorState, tuple[Effect, ...]]:
    """The time limit's successor (docs/allocation-mode.md, "Time limit"): asked once, ``lead_s``
    ahead, while the step still trains; when it starts before the stop, the step checkpoints (a
    planned save) and the next launch runs there; when it has not started by the stop (or Slurm ended
    it before the move), it is dropped and the time limit's stop and resubmission follow."""
    was = state.successor
    state = replace(state, successor=e.state)
    stop_at = None if state.end_time is None else state.end_time - c.stop_before_s
    late = stop_at is not None and e.at >= stop_at
    if state.moving:
        if e.state in ("ended", "released"):   # gone between the planned save and the next launch
            return replace(state, moving=False), (DropSuccessor(e.job_id, "it ended before the launch on it"),)
        return state, ()
    if not e.state:
        if state.phase is Phase.RUNNING and not state.asked_to_stop and not state.stopping and successor_due(
                state.end_time, e.at, lead_s=e.lead_s, stop_before_s=c.stop_before_s, asked=False):
            left = (state.end_time or e.at) - e.at
            return replace(state, successor="asking"), (
                AskSuccessor(f"the allocation ends in {left:.0f} s; asked {e.lead_s:.0f} s ahead"),)
        return state, ()
    if e.state in ("ended", "released"):
        if was in SUCCESSOR_OPEN:
            return state, (DropSuccessor(e.job_id, "Slurm ended it before it was used"),)
        return state, ()
    if e.state == "granted" and not late and state.phase is Phase.RUNNING and not state.asked_to_stop \
            and not state.stopping:
        return replace(state, phase=Phase.STOPPING, stopping=True, moving=True), (
            MoveToSuccessor(e.job_id), SignalStep(signal.SIGUSR1))
    if late and e.state in SUCCESSOR_OPEN:
        return replace(state, successor="released"), (
            DropSuccessor(e.job_id, "it did not start before the time limit's stop"),)
    return state, ()


def _ended(state: SupervisorState, e: LaunchEnded, c: LifecycleConfig) -> tuple[SupervisorState, tuple[Effect, ...]]:
    what = after_launch(e.end, c.limits)
    if state.moving and not e.end.asked_to_stop and not isinstance(what, HandOver) and not (
            isinstance(what, Finish) and (what.phase == "done" or what.code == EXIT_BAD_INPUT)):
        # the planned save for the successor: the next launch runs there, whatever this allocation does
        return replace(state, phase=Phase.ENDED), (Plan(),)
    if isinstance(what, Finish):
        if what.phase == "done":
            return replace(state, phase=Phase.DONE), (JournalDone(release=c.outside), Exit(what.code))
        return replace(state, phase=Phase.STOPPED), (Exit(what.code, what.reason),)
    if isinstance(what, HandOver):
        return replace(state, phase=Phase.FALLBACK), (
            GiveUp(what.reasons, lost_batch_host=bool(e.end.batch_host_lost)), Exit(EXIT_FAILED))
    return replace(state, phase=Phase.ENDED), (Plan(),)


def _planned(state: SupervisorState, e: Planned, c: LifecycleConfig) -> tuple[SupervisorState, tuple[Effect, ...]]:
    number = state.launch if state.launch is not None else 0
    relaunch = next_launch(number, e.plan, c.limits)
    if isinstance(relaunch, Fallback):   # a failure's: the table's HandOver; a requested replacement's: the limit
        return replace(state, phase=Phase.FALLBACK), (GiveUp(relaunch.reasons, relaunch.failed), Exit(EXIT_FAILED))
    effect, phases = recovery_road(e.first, relaunch, incarnation=e.incarnation, slurm_job_id=e.slurm_job_id,
                                   before=e.before, now=e.at)
    if isinstance(effect, TableHandOver):
        return replace(state, phase=Phase.FALLBACK), (
            GiveUp((effect.reason,), relaunch.layout.failed), Exit(EXIT_FAILED))
    road = " -> ".join(p.value for p in phases)
    cause = e.first.cause if isinstance(e.first, MigrationRequested) else e.first.decision.cause
    phase = Phase.SHRINKING if relaunch.shrunk else Phase.RELAUNCHING
    return replace(state, phase=phase), (IntendLaunch(number + 1, relaunch, cause, road),)
