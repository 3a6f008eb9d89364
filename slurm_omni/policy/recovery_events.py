"""What the recovery state machine (``policy/recovery.py``) takes in and gives out: frozen
observations (what the manager or the step supervisor saw) and frozen effects (what it is to do,
in order). Pure types; nothing here acts."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from slurm_omni.policy.confirm import Decision
from slurm_omni.policy.placement import Plan, Quarantine


class RecoveryPath(enum.Enum):
    IN_ALLOCATION = "in_allocation"
    RESUBMITTED = "resubmitted"
    REQUEUED = "requeued"
    PLANNED_MIGRATION = "planned_migration"


# -- observations ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Tick:
    """Every loop: what the judged (or the stopping) life looks like now."""

    quiet: bool = False          # every rank reported, and each said stopping or done
    running: bool = True         # Slurm shows it RUNNING (it started and has not ended)
    ended: bool = False          # Slurm showed it ended
    stopped: bool | None = None  # a poll taken since ``state.since`` shows it no longer RUNNING/COMPLETING
    state: str = ""              # its Slurm state in that poll (for the journal)
    lost: Mapping[str, str] = field(default_factory=dict)   # its nodes the newest poll shows failed -> kind
    batch_host_lost: str = ""    # its batch host, when among ``lost``: a step supervisor ran there


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureConfirmed:
    """The confirmer's CONFIRMED decision; ``lost``: nodes of the job Slurm now shows failed -> kind."""

    decision: Decision
    lost: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class LifeRequeued:
    """Slurm runs the judged life's job again (same id, higher restart count)."""

    at: float
    restart_count: int
    quiet: bool
    lost: Mapping[str, str] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class LifeEnded:
    """Slurm shows the judged life ended (or no longer shows it)."""

    at: float
    slurm_state: str = ""        # "" when it left the queue unseen
    completed: bool = False      # COMPLETED, or every rank said done
    cancelled: bool = False      # CANCELLED (by its user or an admin: the manager cancels only what it replaces)
    quiet: bool = False
    trained: bool = True         # some rank reported
    restart_count: int = 0
    lost: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class LifeNumbered:
    """A restarted manager learnt the judged life's number from Slurm (an array task's restart count)."""

    incarnation: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """The answer to ``RequestPlan``."""

    plan: Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Launched:
    """The answer to ``Launch``: the next life exists."""

    at: float
    incarnation: int
    slurm_job_id: int
    restore_step: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchRefused:
    """The launch can never work (the job file changed since it was registered)."""

    at: float
    cause: str
    error: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LifeRunning:
    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstStep:
    """A rank of the next life trained past its restore step."""

    at: float
    step: int


class _Beat(Protocol):
    @property
    def phase(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def time(self) -> float: ...


def first_step_seen(beats: Sequence[_Beat], restore_step: int | None) -> FirstStep | None:
    """The next life's first step past its restore, as its ranks' newest beats show it: the earliest
    beat of a rank that completed a step after ``restore_step`` (none: a fresh start, past step 0), in
    any phase after ``starting``. A short life can train, finish and write ``done`` (or ``stopping``,
    ``failed``) between two polls of the manager: its last beat still shows that it trained again.
    ``at`` is then the time of that beat, later than the step itself."""
    ahead = [hb for hb in beats if hb.phase != "starting" and hb.step > (restore_step or 0)]
    if not ahead:
        return None
    first = min(ahead, key=lambda hb: hb.time)
    return FirstStep(at=first.time, step=first.step)


@dataclass(frozen=True, kw_only=True, slots=True)
class GrowPossible:
    """A shrunk job with free nodes in reach (``placement.plan_grow``)."""

    at: float
    plan: Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationRequested:
    """Fail-slow (issue 14): move off ``nodes`` at a checkpoint, to ``plan`` (placement's)."""

    at: float
    plan: Plan
    nodes: tuple[str, ...]
    cause: str = "fail_slow"


@dataclass(frozen=True, kw_only=True, slots=True)
class SupervisorReport:
    """What the step supervisor did inside the allocation (its report file)."""

    at: float
    kind: Literal["relaunched", "gave_up"]
    cause: str = ""
    nodes: tuple[str, ...] = ()
    incarnation_before: int = 0
    incarnation_after: int | None = None
    fault_at: float | None = None
    detected_at: float | None = None
    confirmed_at: float | None = None
    removed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    added: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    spares_left: Mapping[str, int] = field(default_factory=dict)
    data_parallel_size: int | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputRefused:
    """The judged life showed bad input (``policy/bad_input.py``): no restart can fix it.
    ``cancel``: its Slurm job, when it still runs (a command that never beats)."""

    at: float
    cause: str
    line: str
    cancel: int | None = None


Observation = (Tick | FailureConfirmed | InputRefused | LifeRequeued | LifeEnded | LifeNumbered | Planned | Launched | LaunchRefused
               | LifeRunning | FirstStep | GrowPossible | MigrationRequested | SupervisorReport)


# -- effects --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class OpenRecovery:
    """Open the timeline of ``incarnation``'s failure (once)."""

    incarnation: int
    path: RecoveryPath
    cause: str
    nodes: tuple[str, ...]
    fault_at: float | None
    detected_at: float | None
    confirmed_at: float
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class MarkPhase:
    """A timeline phase of ``incarnation``'s recovery (the first mark wins)."""

    incarnation: int
    phase: Literal["confirmed", "resubmitted", "running", "first_step"]
    at: float
    new_incarnation: int | None = None
    plan: Plan | None = None
    path: RecoveryPath | None = None
    detail: Mapping[str, Any] | None = None
    """What the step supervisor reported of an in-allocation relaunch (nodes removed, added, spares left)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordDecision:
    incarnation: int
    at: float
    verdict: str
    cause: str
    payload: Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Note:
    """A journal observation of the recovery's own (``key`` makes a repeat a no-op)."""

    incarnation: int
    kind: str
    at: float
    payload: Mapping[str, Any]
    key: str


@dataclass(frozen=True, kw_only=True, slots=True)
class SetJobState:
    state: Literal["active", "waiting", "failed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestPlan:
    """Plan from a snapshot taken now (``fresh``), or from the next new poll only (waiting)."""

    fresh: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancel:
    """End what is left of ``incarnation`` (``cancel:<job>:<n>``; the supervisor: its step)."""

    incarnation: int
    slurm_job_id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SignalCheckpoint:
    """USR1 to the ranks: checkpoint and exit 75 (``stop:<job>:<n>``)."""

    incarnation: int
    slurm_job_id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Drain:
    incarnation: int
    node: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """Start the next life: sbatch (resubmitted, planned_migration), scontrol requeue (requeued),
    srun inside the allocation (in_allocation). Answered by ``Launched``."""

    path: RecoveryPath
    incarnation: int              # the failed one
    plan: Plan | None


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchNext:
    """Watch the next life instead: a new Slurm job, or the same one (``same_job``)."""

    path: RecoveryPath
    incarnation: int
    slurm_job_id: int
    units: int | None
    restore_step: int | None
    quarantine: Quarantine | None
    same_job: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class NewLife:
    """Slurm runs the same incarnation again after a checkpointed exit: judge its next restart
    count from scratch (``incarnation`` set for an array task, whose incarnations are restart counts)."""

    restart_count: int
    incarnation: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class FailAll:
    """Slurm says the life ended badly: a level-1 signal on every node of it."""

    at: float
    why: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Close:
    """The job's last life ended for good."""

    state: Literal["done", "cancelled", "failed"]
    at: float
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class HandOver:
    """Supervisor: nothing left to relaunch in the allocation; the manager takes over."""

    at: float
    reason: str


Effect = (OpenRecovery | MarkPhase | RecordDecision | Note | SetJobState | RequestPlan | Cancel | SignalCheckpoint
          | Drain | Launch | WatchNext | NewLife | FailAll | Close | HandOver)
Effects = tuple[Effect, ...]
