"""The manager's watch of one Slurm job as one transition table (pure: no command, no file, time
passed in).

What the manager knows of the job it watches (the journal incarnation, its Slurm job id, the
restart counts Slurm showed, whether the life runs, has ended, was requeued, which steps' task
records belong to earlier launches, the confirmer's verdict) is one frozen :class:`WatchLife`;
``step(life, event, now) -> (life, effects)`` is the only way it changes. The daemon
(``manager/daemon.py``) feeds it what a poll, a fault record or the confirmer showed, the recovery
(``manager/recovery.py``) what its table decided (a requeue, a relaunch, the next submission); both
carry out the effects. ``manager/watch.py`` holds the life beside the job's configuration and its
observers (confirmer, heartbeat scanner). One life, in one direction::

    QUEUED --Polled(RUNNING)--> RUNNING (Started) --Polled(finished) | Gone--> ended (Ended)
    QUEUED | RUNNING --RestartSeen--> (Restarted: the recovery says what the requeue means)
    QUEUED | RUNNING --Requeued | TaskRequeued--> SETTLING (StartOver)
    SETTLING --Polled(finished)--> SETTLING (Slurm 22.05 shows the old life's end a while)
    SETTLING --Polled(not finished)--> QUEUED | RUNNING (Started)
    any --Relaunched--> the same phase, the next launch's incarnation (StartOver)
    any --Switched--> QUEUED, the next submission (StartOver)
    RUNNING --Moved--> RUNNING on the successor allocation's nodes (StartOver)

``ended`` is a flag beside the phase (the newest poll showed the job ended or no longer showed
it): a life that ran keeps RUNNING until it is requeued or replaced, as the recovery judges its
end. ``TRANSITIONS`` lists every (phase, event) pair of the table: every event has a row in every
phase; only ``Polled`` and ``Moved`` mean something different in each.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from slurm_omni.policy.confirm import Verdict
from slurm_omni.policy.in_allocation import REQUEUE_INCARNATION_STRIDE
from slurm_omni.policy.placement import Quarantine

SLURM_SPECIAL_STEPS = 0xFFFFFFF0
"""Step ids from here up are Slurm's own (batch, extern, interactive): not launches of the job's step."""


class Phase(enum.Enum):
    QUEUED = "queued"
    """Submitted (or just switched to): this life has not been seen RUNNING."""
    RUNNING = "running"
    """A poll showed this life RUNNING: its nodes are known (it stays so after it ends, until the
    recovery requeues or replaces it)."""
    SETTLING = "settling"
    """Requeued: the same Slurm job runs again; until a poll shows it no longer finished, Slurm
    may still show the old life's end state (22.05: FAILED or CANCELLED with the new restart count)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchLife:
    incarnation: int
    """The journal's incarnation of the Slurm job watched now (its rows, decisions, recoveries): a
    submission's OMNI_INCARNATION base. What the ranks carry, and what is judged, is
    :meth:`judged_incarnation` (it adds Slurm's requeues and the supervisor's relaunches)."""
    slurm_id: int | None
    units: int
    phase: Phase = Phase.QUEUED
    state: str = "active"
    """The journal's job state: active, waiting, done, cancelled, failed."""
    seen: bool = False
    """A poll showed this Slurm job (a restarted manager learns the restart count from the first)."""
    ended: bool = False
    """The newest poll showed the job ended (or no longer showed it)."""
    nodes: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Het offset -> nodes, once running."""
    batch_host: str = ""
    running_since: float | None = None
    """When a poll first showed the judged life RUNNING."""
    restart_count: int = 0
    """The requeue whose heartbeats are judged (SLURM_RESTART_COUNT)."""
    slurm_restart_count: int = 0
    """The newest restart count Slurm reported."""
    running_restart_count: int = 0
    """The newest restart count Slurm showed RUNNING."""
    slurm_state: str = ""
    verdict: Verdict = Verdict.NONE
    """The confirmer's verdict last journaled for the judged life."""
    quarantine: Quarantine = field(default_factory=Quarantine)
    restore_step: int | None = None
    """The newest complete checkpoint when this incarnation was submitted."""
    ended_ids: frozenset[int] = frozenset()
    """Slurm ids of earlier incarnations: they must stay gone."""
    allocation_base: int | None = None
    """In the allocation: the submission's incarnation (None: ``incarnation``)."""
    relaunched_incarnation: int | None = None
    """In the allocation: the supervisor's last relaunch, this requeue."""
    step_id_max: int = -1
    """The highest step id of this Slurm job's task records, this requeue."""
    stale_step_max: int = -1
    """In the allocation: task records of steps up to it belong to earlier launches."""
    last_plan_poll: int = -1
    """The poll a waiting plan was last made from."""

    @property
    def running(self) -> bool:
        return self.phase is Phase.RUNNING

    @property
    def settling(self) -> bool:
        return self.phase is Phase.SETTLING

    @property
    def node_set(self) -> frozenset[str]:
        return frozenset(n for nodes in self.nodes.values() for n in nodes)

    def allocation_incarnation(self, restart_count: int) -> int:
        """An in-allocation job's incarnation: the one the supervisor last reported relaunching in this
        allocation, else launch 0 after ``restart_count`` requeues (``inalloc.sbatch.j2``: base +
        REQUEUE_INCARNATION_STRIDE x SLURM_RESTART_COUNT)."""
        if self.relaunched_incarnation is not None and restart_count == self.restart_count:
            return self.relaunched_incarnation
        base = self.incarnation if self.allocation_base is None else self.allocation_base
        return base + REQUEUE_INCARNATION_STRIDE * restart_count

    def judged_incarnation(self, *, task_base: int | None, supervised: bool) -> int:
        """The OMNI_INCARNATION being judged (what its ranks' heartbeats and metrics carry): a
        submission's first is its ``incarnation``, and each of Slurm's requeues adds one (in the
        allocation: :meth:`allocation_incarnation`). An array task's (``task_base``: its base) are
        its restart counts, past the task's base."""
        if task_base is not None:
            return task_base + self.restart_count
        if supervised:
            return self.allocation_incarnation(self.restart_count)
        return self.incarnation + self.restart_count

    def plan_due(self, poll: int) -> bool:
        """While waiting for nodes: a plan is made again from each new poll only."""
        return poll != self.last_plan_poll


def initial(incarnation: int, slurm_id: int | None, units: int) -> WatchLife:
    return WatchLife(incarnation=incarnation, slurm_id=slurm_id, units=units, allocation_base=incarnation)


# -- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Shown:
    """A poll shows the job: the first sight tells a restarted manager the restart count."""

    at: float
    restart_count: int
    expect_restart: bool = False
    """An array task the recovery requeued, before Slurm shows its next life: its count is not yet this one."""
    numbered_by_restart: bool = False
    """An array task with no open recovery: its incarnations are its restart counts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartSeen:
    """The poll's restart count of the job (after its nodes' states were observed)."""

    at: float
    restart_count: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Polled:
    """The poll's state of the job (after a requeue was judged)."""

    at: float
    slurm_state: str
    running: bool
    """Slurm shows it RUNNING."""
    finished: bool
    restart_count: int
    batch_host: str = ""
    nodes: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Het offset -> nodes as this poll shows them (what the life runs on once it starts)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Moved:
    """Allocation mode: the poll shows the life in another allocation than its first (a successor
    its supervisor moved it to at a time limit; the status file says which)."""

    at: float
    running: bool
    """Slurm shows that allocation RUNNING."""
    batch_host: str = ""
    nodes: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class Gone:
    """The poll no longer shows the job (and did not fail to read it)."""

    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskRecord:
    """A task's fault record of step ``step_id`` of this Slurm job."""

    step_id: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Judged:
    """The confirmer's verdict on the judged life now."""

    verdict: Verdict


@dataclass(frozen=True, kw_only=True, slots=True)
class NodesLost:
    """Nodes the step supervisor reported failed: the job never uses them again (for ``seconds``)."""

    nodes: tuple[str, ...]
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanPolled:
    """A plan was made from poll number ``poll``."""

    poll: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Requeued:
    """The recovery says Slurm's requeue starts the judged life again (``NewLife``): the same Slurm
    job; the judged incarnation moves on with the restart count (an array task's incarnation too)."""

    restart_count: int
    incarnation: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskRequeued:
    """The recovery requeued an array task (``WatchNext``, path requeued)."""

    restore_step: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Relaunched:
    """The step supervisor relaunched inside the allocation as OMNI_INCARNATION ``incarnation``."""

    incarnation: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Switched:
    """The next incarnation was submitted: watch it instead."""

    incarnation: int
    slurm_id: int
    units: int
    restore_step: int | None
    quarantine: Quarantine


@dataclass(frozen=True, kw_only=True, slots=True)
class JobStateSet:
    """The recovery set the journal's job state (waiting, active, done, cancelled, failed)."""

    state: str


Event = (Shown | RestartSeen | Polled | Moved | Gone | TaskRecord | Judged | NodesLost | PlanPolled | Requeued | TaskRequeued
         | Relaunched | Switched | JobStateSet)


# -- effects --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class NumberLife:
    """An array task's incarnation is its restart count: tell the recovery (``LifeNumbered``)."""

    incarnation: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Restarted:
    """Slurm requeued the job (same id, a new restart count): the recovery judges what it means."""

    at: float
    restart_count: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StateChanged:
    """Slurm shows the job in a new state: journal it."""

    at: float
    slurm_state: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    """The life runs: journal it with its nodes; the recovery learns it (``LifeRunning``) when it waits for it."""

    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Ended:
    """The poll showed the job ended or gone: its end is judged (every such poll)."""

    at: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StartOver:
    """Confirmation starts over on ``nodes``; the ranks' phases (and the node states) are forgotten."""

    nodes: Mapping[int, tuple[str, ...]]
    forget_phases: bool = True
    forget_node_states: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class CountRecord:
    """The task record belongs to the judged launch: the confirmer observes it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StaleRecord:
    """The task record belongs to a launch before the supervisor's relaunch: not counted."""

    step_id: int
    launch: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordVerdict:
    """A new verdict: journal the decision."""

    verdict: Verdict


Effect = (NumberLife | Restarted | StateChanged | Started | Ended | StartOver | CountRecord | StaleRecord
          | RecordVerdict)
Effects = tuple[Effect, ...]


# -- the transitions ------------------------------------------------------------------------------
def step(life: WatchLife, event: Event, now: float) -> tuple[WatchLife, Effects]:
    """One event: the next life and what to do, in order."""
    handler = _TABLE.get((life.phase, type(event)))
    if handler is None:
        return life, ()
    return handler(life, event, now)


def _shown(s: WatchLife, e: Shown, now: float) -> tuple[WatchLife, Effects]:
    if s.seen:
        return s, ()
    if e.expect_restart:
        return replace(s, seen=True), ()
    s = replace(s, seen=True, restart_count=e.restart_count, slurm_restart_count=e.restart_count)
    if not e.numbered_by_restart:
        return s, ()
    return replace(s, incarnation=e.restart_count), (NumberLife(incarnation=e.restart_count),)


def _restart_seen(s: WatchLife, e: RestartSeen, now: float) -> tuple[WatchLife, Effects]:
    if e.restart_count == s.slurm_restart_count:
        return s, ()
    return replace(s, slurm_restart_count=e.restart_count), (Restarted(at=e.at, restart_count=e.restart_count),)


def _state_seen(s: WatchLife, e: Polled) -> tuple[WatchLife, list[Effect]]:
    if e.slurm_state == s.slurm_state:
        return s, []
    return replace(s, slurm_state=e.slurm_state), [StateChanged(at=e.at, slurm_state=e.slurm_state)]


def _polled_queued(s: WatchLife, e: Polled, now: float) -> tuple[WatchLife, Effects]:
    """Not yet running: a poll that shows it RUNNING starts the life on the nodes it shows."""
    s, effects = _state_seen(s, e)
    s = replace(s, ended=e.finished)
    if e.running:
        s = replace(s, phase=Phase.RUNNING, running_restart_count=max(s.running_restart_count, e.restart_count),
                    batch_host=e.batch_host, running_since=e.at, nodes=dict(e.nodes))
        effects += [StartOver(nodes=s.nodes, forget_phases=False, forget_node_states=True), Started(at=e.at)]
    if e.finished:
        effects.append(Ended(at=e.at))
    return s, tuple(effects)


def _polled_running(s: WatchLife, e: Polled, now: float) -> tuple[WatchLife, Effects]:
    s, effects = _state_seen(s, e)
    s = replace(s, ended=e.finished)
    if e.running:
        s = replace(s, running_restart_count=max(s.running_restart_count, e.restart_count))
    if e.finished:
        effects.append(Ended(at=e.at))
    return s, tuple(effects)


def _polled_settling(s: WatchLife, e: Polled, now: float) -> tuple[WatchLife, Effects]:
    """Requeued: Slurm 22.05 shows the job with its new restart count but the old life's FAILED (or
    CANCELLED) until it is PENDING again: not the end of this life. Once it shows otherwise, the
    life is queued (or running) again."""
    if e.finished:
        seen, effects = _state_seen(s, e)
        return seen, tuple(effects)
    return _polled_queued(replace(s, phase=Phase.QUEUED), e, now)


def _moved_running(s: WatchLife, e: Moved, now: float) -> tuple[WatchLife, Effects]:
    """The running life's nodes are the new allocation's: confirmation starts over on them (the
    node states of the old ones are forgotten; the ranks' phases are the same life's)."""
    nodes = frozenset(n for ns in e.nodes.values() for n in ns)
    if not e.running or nodes == s.node_set:
        return s, ()
    moved = replace(s, batch_host=e.batch_host, running_since=e.at, nodes=dict(e.nodes))
    return moved, (StartOver(nodes=moved.nodes, forget_phases=False, forget_node_states=True),)


def _moved_not_running(s: WatchLife, e: Moved, now: float) -> tuple[WatchLife, Effects]:
    """Not running yet (or requeued): the next ``Polled`` starts it on the nodes it shows."""
    return s, ()


def _gone(s: WatchLife, e: Gone, now: float) -> tuple[WatchLife, Effects]:
    if not s.seen:
        return s, ()
    return replace(s, ended=True), (Ended(at=e.at),)


def _task_record(s: WatchLife, e: TaskRecord, now: float) -> tuple[WatchLife, Effects]:
    if e.step_id >= SLURM_SPECIAL_STEPS:   # the batch or extern step: no launch of the job's step
        return s, (CountRecord(),)
    if e.step_id <= s.stale_step_max:
        # the killed step's ranks report their exits after the relaunch (slurmstepd is slow to reap them)
        return s, (StaleRecord(step_id=e.step_id, launch=s.relaunched_incarnation),)
    return replace(s, step_id_max=max(s.step_id_max, e.step_id)), (CountRecord(),)


def _judged(s: WatchLife, e: Judged, now: float) -> tuple[WatchLife, Effects]:
    if e.verdict is s.verdict:
        return s, ()
    return replace(s, verdict=e.verdict), (RecordVerdict(verdict=e.verdict),)


def _nodes_lost(s: WatchLife, e: NodesLost, now: float) -> tuple[WatchLife, Effects]:
    active = s.quarantine.active(now)
    lost = [n for n in e.nodes if n not in active]
    if not lost:
        return s, ()
    return replace(s, quarantine=s.quarantine.add(lost, now, e.seconds)), ()


def _plan_polled(s: WatchLife, e: PlanPolled, now: float) -> tuple[WatchLife, Effects]:
    return replace(s, last_plan_poll=e.poll), ()


def _requeue(s: WatchLife, *, restart_count: int, incarnation: int, restore_step: int | None) -> tuple[WatchLife, Effects]:
    """The same Slurm job runs again: the requeued allocation's supervisor starts again at launch 0
    and Slurm numbers its steps from 0 again; the last life's verdict and phases count no more."""
    nxt = replace(s, phase=Phase.SETTLING, restart_count=restart_count, incarnation=incarnation,
                  restore_step=restore_step, running_since=None, relaunched_incarnation=None, step_id_max=-1,
                  stale_step_max=-1, verdict=Verdict.NONE)
    return nxt, (StartOver(nodes=s.nodes),)


def _requeued(s: WatchLife, e: Requeued, now: float) -> tuple[WatchLife, Effects]:
    return _requeue(s, restart_count=e.restart_count,
                    incarnation=s.incarnation if e.incarnation is None else e.incarnation, restore_step=s.restore_step)


def _task_requeued(s: WatchLife, e: TaskRequeued, now: float) -> tuple[WatchLife, Effects]:
    return _requeue(s, restart_count=s.restart_count, incarnation=s.incarnation, restore_step=e.restore_step)


def _relaunched(s: WatchLife, e: Relaunched, now: float) -> tuple[WatchLife, Effects]:
    """The same Slurm job trains the next launch, journaled as an incarnation of its own: it is the
    journal incarnation too (after a requeue, ``incarnation - restart_count`` is a number no row
    has, and the next resubmission would take ``incarnation`` again). The killed step's ranks report
    their exits after the relaunch: its records (lower step ids) do not count against the new launch."""
    return (replace(s, incarnation=e.incarnation, relaunched_incarnation=e.incarnation,
                    stale_step_max=s.step_id_max, verdict=Verdict.NONE),
            (StartOver(nodes=s.nodes),))


def _switched(s: WatchLife, e: Switched, now: float) -> tuple[WatchLife, Effects]:
    ended_ids = s.ended_ids if s.slurm_id is None else s.ended_ids | {s.slurm_id}
    nxt = WatchLife(incarnation=e.incarnation, slurm_id=e.slurm_id, units=e.units, restore_step=e.restore_step,
                    quarantine=e.quarantine, ended_ids=ended_ids, allocation_base=e.incarnation,
                    last_plan_poll=s.last_plan_poll)
    return nxt, (StartOver(nodes={}, forget_node_states=True),)


def _job_state(s: WatchLife, e: JobStateSet, now: float) -> tuple[WatchLife, Effects]:
    return replace(s, state=e.state), ()


_Handler = Callable[[WatchLife, Any, float], tuple[WatchLife, Effects]]
_EVERY_PHASE: dict[type, _Handler] = {
    Shown: _shown,
    RestartSeen: _restart_seen,
    Gone: _gone,
    TaskRecord: _task_record,
    Judged: _judged,
    NodesLost: _nodes_lost,
    PlanPolled: _plan_polled,
    Requeued: _requeued,
    TaskRequeued: _task_requeued,
    Relaunched: _relaunched,
    Switched: _switched,
    JobStateSet: _job_state,
}
"""Events that mean the same in every phase."""
_TABLE: dict[tuple[Phase, type], _Handler] = {
    **{(p, t): h for p in Phase for t, h in _EVERY_PHASE.items()},
    (Phase.QUEUED, Polled): _polled_queued,
    (Phase.RUNNING, Polled): _polled_running,
    (Phase.SETTLING, Polled): _polled_settling,
    (Phase.QUEUED, Moved): _moved_not_running,
    (Phase.RUNNING, Moved): _moved_running,
    (Phase.SETTLING, Moved): _moved_not_running,
}
TRANSITIONS: tuple[tuple[Phase, type], ...] = tuple(_TABLE)
"""Every (phase, event type) pair that has a transition (every pair: no event is refused in any phase)."""


def restored(life: WatchLife, *, incarnation: int, slurm_id: int, ended_ids: Iterable[int], allocation_base: int,
             relaunched: bool, units: int, restore_step: int | None) -> WatchLife:
    """A restarted manager's life of the newest incarnation the journal gave a Slurm job id (a
    relaunch inside the allocation is the supervisor's last): not yet seen in Slurm."""
    return replace(life, incarnation=incarnation, slurm_id=slurm_id, ended_ids=frozenset(ended_ids),
                   allocation_base=allocation_base, relaunched_incarnation=incarnation if relaunched else None,
                   units=units, restore_step=restore_step)
