"""What the step supervisor decides, as pure functions (no command, no clock, no file): the
carrying-out is ``slurm_omni/supervisor/run.py``.

One launch of the step at a time. While it runs, the supervisor feeds what it sees to the one
confirmation rule (``policy.confirm``) and, once that confirms, kills the step at once
(:func:`kill_on`). When the launch's srun returned, :func:`after_launch` says what that end means,
in this order:

1. the ranks said done -> :class:`Finish` (the job is done);
2. the supervisor was signalled to stop (the batch shell forwarded the time limit's signal, scancel
   or a requeue; in allocation mode it signals itself its lead before the time limit:
   :func:`stop_due`) -> :class:`Finish` with the step's checkpointed code: nothing failed;
3. Slurm shows the job other than RUNNING (its allocation is ending) -> :class:`Finish`, no relaunch;
4. the node the supervisor runs on (the batch host) failed: no step can start from it (26.05
   keeps such a --no-kill job RUNNING without it) -> :class:`HandOver`;
4a. the launch failed before its first heartbeat the same way as the launch before it
   (``policy.start_failure``: a crash at start that a relaunch repeats) -> :class:`Finish` with exit
   78 (bad input) and the one line: no relaunch, no hand-over;
4b. a rank of the launch exited 78 (bad input: its last heartbeat says so, with its one line; srun
   itself returns 137 when the others were killed for it) -> :class:`Finish` with exit 78 and that
   line: no relaunch can fix the input;
5. too many launches in a row ended before their first step (a crash at start-up that a relaunch
   repeats) -> :class:`HandOver` to the manager's resubmission;
6. otherwise :class:`Recover`: a replacement that was asked for (a planned migration), or a
   grow-back onto a pool allocation that started (``policy.pools.grow_plan``, cause ``grow``), else a
   failure that the rule confirms and the one placement policy
   (``policy.in_allocation.plan_relaunch``) plans; :func:`next_launch` then holds the relaunch
   count to its limit.

A replacement request (``<job>.request.json``, fail-slow's planned migration) is taken at most
once: :func:`request_outcome`. Each launch's rendezvous port (MASTER_PORT) is the first of
:func:`rendezvous_ports` that nothing on the master's host listens on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.in_allocation import Fallback, Relaunch, StepLayout
from slurm_omni.policy.placement import Action, ComponentPlan, Plan
from slurm_omni.policy.pools import GROW, SUCCESSOR
from slurm_omni.policy.recovery import Phase, RecoveryConfig, initial
from slurm_omni.policy.recovery import step as recovery_step
from slurm_omni.policy.recovery_events import FailureConfirmed, MigrationRequested, Planned, RequestPlan, Tick
from slurm_omni.policy.recovery_events import HandOver as RecoveryHandOver
from slurm_omni.policy.recovery_events import Launch as RecoveryLaunch

SIGTERM_CODE = 143
"""128 + SIGTERM: a step Slurm terminated when its job was told to stop."""

PLANNED = "planned"
"""The cause of a launch that replaced nodes on request, not after a failure."""

SUPERVISOR_ROLE = RecoveryConfig(role="supervisor")
"""The recovery table's settings inside the allocation (``policy.recovery``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEnd:
    """What the supervisor knows when a launch's srun returned."""

    number: int
    rc: int
    """The srun's exit code (an adopted step's from its ranks' last heartbeats: :func:`adopted_rc`)."""
    asked_to_stop: bool
    """The supervisor was signalled to stop (by the batch shell: time limit, scancel, requeue; or by
    itself before the time limit in allocation mode)."""
    job_state: str
    """Slurm's state of the job just now; empty when it could not tell."""
    fruitless: int
    """Launches in a row, this one included, that ended before their first step (planned ones
    do not count): :func:`fruitless_launches`."""
    batch_host_lost: str = ""
    """The node the supervisor runs on (the batch host), when Slurm shows it failed."""
    repeated: str = ""
    """The stop line when this launch failed before its first heartbeat the same way as the one
    before it (``policy.start_failure.repeated_failure``)."""
    refused: str = ""
    """A rank's one line when it exited 78 (its last heartbeat's exit code; bad input that no relaunch
    fixes): ``policy.bad_input.refused_by_rank``."""


@dataclass(frozen=True, slots=True)
class Finish:
    """The supervisor ends with ``code`` for the batch script; no relaunch."""

    code: int
    phase: Literal["done", "stopped"]
    """The status file's phase."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HandOver:
    """Give the job to the manager's resubmission (``gave_up`` report, exit failed)."""

    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Recover:
    """A launch to follow: plan it (a requested replacement, else a confirmed failure)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SupervisionLimits:
    max_fruitless: int = 3
    max_relaunches: int = 20


def after_launch(end: LaunchEnd, limits: SupervisionLimits) -> Finish | HandOver | Recover:
    """What the end of a launch means (the order in the module's docstring)."""
    if end.rc == EXIT_DONE:
        return Finish(EXIT_DONE, "done")
    if end.asked_to_stop:
        code = EXIT_CHECKPOINTED if end.rc in (EXIT_CHECKPOINTED, SIGTERM_CODE) else end.rc
        return Finish(code, "stopped", "the supervisor was signalled to stop")
    if end.job_state not in ("RUNNING", ""):
        return Finish(EXIT_CHECKPOINTED if end.rc == EXIT_CHECKPOINTED else EXIT_FAILED, "stopped",
                      f"Slurm shows the job {end.job_state}")
    if end.batch_host_lost:
        # 22.05 and 24.11 end the job for a lost batch host; 26.05 takes it out of a --no-kill job
        # and keeps the job RUNNING without it, where no srun of ours can start.
        return HandOver((f"the batch host {end.batch_host_lost} is lost (this supervisor runs there)",))
    if end.repeated:
        return Finish(EXIT_BAD_INPUT, "stopped", end.repeated)
    if end.refused:
        return Finish(EXIT_BAD_INPUT, "stopped", end.refused)
    if end.fruitless > limits.max_fruitless:
        return HandOver((f"{end.fruitless} launches in a row ended before their first step",))
    return Recover()


def next_launch(number: int, plan: Relaunch | Fallback, limits: SupervisionLimits) -> Relaunch | Fallback:
    """The plan for launch ``number + 1``, or a fallback once the relaunches reached their limit."""
    if isinstance(plan, Relaunch) and number + 1 > limits.max_relaunches:
        return Fallback(plan.layout.failed, (f"{limits.max_relaunches} relaunches reached",))
    return plan


def fruitless_launches(launches: Sequence[tuple[float | None, str]]) -> int:
    """Of ``(first_step_at, cause)`` per launch, oldest first: how many at the end ended before their
    first step, back to one that stepped or was a planned replacement."""
    count = 0
    for first_step_at, cause in reversed(launches):
        if first_step_at is not None or cause in (PLANNED, GROW, SUCCESSOR):
            break
        count += 1
    return count


def kill_on(decision: Decision, *, asked_to_stop: bool, stopping: bool) -> bool:
    """Kill the running step now: the rule confirmed a failure, and the step is not ending because
    it was asked to (a forwarded signal, or a planned replacement's checkpoint)."""
    return decision.verdict is Verdict.CONFIRMED and not asked_to_stop and not stopping


def adopted_rc(phases: Collection[str]) -> int:
    """An adopted step's exit code (lost with the supervisor that started it), from its ranks' last
    heartbeat phases: every one done, every one stopping for requeue, else failed."""
    if phases and set(phases) == {"done"}:
        return EXIT_DONE
    if phases and set(phases) == {"stopping"}:
        return EXIT_CHECKPOINTED
    return EXIT_FAILED


def request_outcome(replace: Sequence[str], running: Collection[str], plan: Relaunch | Fallback | None, *,
                    shrink: bool = False) -> str:
    """A planned request's outcome: ``unknown_node`` (a named node does not run this launch),
    ``no_spare`` (no plan replaces them without shrinking, and the request does not allow a shrink),
    ``below_minimum`` (a request that allows a shrink, and no launch without the nodes fits the
    allocation: the job's minimum data parallelism), else ``accepted``. ``plan``: the plan that
    launches without the named nodes (None when none was made); ``shrink``: the request allows
    fewer data-parallel replicas (the manager's estimate says k-1 healthy ones beat k with a slow one)."""
    if any(n not in running for n in replace):
        return "unknown_node"
    if not isinstance(plan, Relaunch):
        return "below_minimum" if shrink else "no_spare"
    if plan.shrunk and not shrink:
        return "no_spare"
    return "accepted"


PORT_BASE = 20000
PORT_SPAN = 15000
PORT_STRIDE = 1009
"""Candidates after the first are this far apart (prime to the span: every port of the window comes up)."""


def rendezvous_ports(job_id: str, launch: int, *, avoid: tuple[int, int] | None = None,
                     count: int = 8) -> tuple[int, ...]:
    """MASTER_PORT candidates for launch ``launch`` of the job, best first, in
    ``[PORT_BASE, PORT_BASE + PORT_SPAN)``. The first is the launch's own port,
    ``20000 + (job id x 37 + launch) mod 15000`` (a job id that is no number starts at 29500), so
    consecutive launches differ and a dying step's store never holds the next one's; then ports
    :data:`PORT_STRIDE` apart. ``avoid`` (the host's ephemeral range, ``ip_local_port_range``, where
    any outgoing connection takes a port at random) is skipped. Rank 0 listens on the port it is
    given and fails at once when something else listens there (another job's store on a shared node,
    or on the embedded cluster, where every node is this machine), so the supervisor takes the first
    candidate that is free (``supervisor/ports.py``)."""
    start = (int(job_id) * 37) % PORT_SPAN if job_id.isdigit() else 9500
    out: list[int] = []
    for k in range(PORT_SPAN):
        port = PORT_BASE + (start + launch + k * PORT_STRIDE) % PORT_SPAN
        if avoid is not None and avoid[0] <= port <= avoid[1]:
            continue
        out.append(port)
        if len(out) == count:
            break
    return tuple(out)


# -- the road through the one recovery table -------------------------------------------------------
def as_plan(plan: Relaunch | Fallback, before: StepLayout) -> Plan:
    """A relaunch as the recovery table's placement :class:`Plan` (a fallback: ``WAIT``): its
    placement units (as the manager's plans count them, not replicas), per component the nodes it
    runs on, those it gained and those it lost against ``before``."""
    if isinstance(plan, Fallback):
        return Plan(Action.WAIT, 0, exclude=plan.failed, reasons=plan.reasons)
    comps = tuple(ComponentPlan(k, nodes, added=tuple(n for n in plan.added if n in nodes),
                                removed=tuple(n for n in plan.removed if n in before.components[k]))
                  for k, nodes in enumerate(plan.layout.components))
    return Plan(Action.SHRINK if plan.shrunk else Action.RESUBMIT, plan.layout.units, comps,
                exclude=plan.layout.failed, reasons=plan.reasons)


def recovery_road(first: FailureConfirmed | MigrationRequested, plan: Relaunch | Fallback, *, incarnation: int,
                  slurm_job_id: int, before: StepLayout, now: float,
                  config: RecoveryConfig = SUPERVISOR_ROLE) -> tuple[RecoveryLaunch | RecoveryHandOver, tuple[Phase, ...]]:
    """One recovery of an ended launch through the state machine (``policy.recovery.step``, the
    table the manager runs; ``role = "supervisor"``): ``first`` (the rule's confirmation, or a
    replacement that was asked for) opens it, ``plan`` answers its ``RequestPlan``, and the step's
    end answers its stop (the launch's srun has returned: its tasks were killed once the rule
    confirmed, or they exited 75 after the request's USR1). Returns the table's last word, ``Launch``
    (the next launch, in the allocation) or ``HandOver`` (no launch fits: the manager resubmits),
    and the phases it went through."""
    state = initial(incarnation, slurm_job_id)
    answer = Planned(plan=as_plan(plan, before))
    queue: list[Any] = [first]
    phases: list[Phase] = []
    while queue:
        state, effects = recovery_step(state, queue.pop(0), now, config)
        phases.append(state.phase)
        for effect in effects:
            if isinstance(effect, RequestPlan):
                queue.append(answer)
            elif isinstance(effect, (RecoveryLaunch, RecoveryHandOver)):
                return effect, tuple(phases)
        if state.phase is Phase.STOPPING:   # the old launch has ended: whatever stop was asked is done
            queue.append(Tick(quiet=True, running=False, stopped=True, state="ENDED"))
    raise ValueError(f"recovery table: no launch and no hand-over after {first!r} (phases "
                     f"{', '.join(p.value for p in phases)})")


LIVE_PHASES = frozenset({"waiting", "launching", "running", "stopping", "confirming", "ended", "relaunching",
                         "shrinking"})
"""Status phases of a supervisor that has work left (not done, stopped or handed over): the
lifecycle's (``policy.supervisor_lifecycle.Phase``) but its ends; ``waiting``: for its allocation to
start."""


def supervisor_gone(*, phase: str, job_state: str, alive: bool | None, status_age_s: float | None,
                    stale_after_s: float) -> bool:
    """Allocation mode: must a new supervisor be started for this job? Only while its allocation
    runs and its last status says there is work left, when its process is gone (``alive`` False) or,
    on another host (``alive`` None), when its status file is older than ``stale_after_s`` (it
    rewrites it every node poll). Starting one too many is harmless: the second waits for nothing
    and leaves (the job's supervisor lock)."""
    if job_state not in ("RUNNING", "PENDING", "CONFIGURING") or phase not in LIVE_PHASES:
        return False
    if alive is not None:
        return not alive
    return status_age_s is None or status_age_s > stale_after_s


def stop_due(end_time: float | None, now: float, before_s: float) -> bool:
    """Allocation mode: is it time to stop the step for the time limit (no batch shell gets Slurm's
    ``--signal``)? Never without an end time or a lead."""
    return end_time is not None and before_s > 0 and now >= end_time - before_s
