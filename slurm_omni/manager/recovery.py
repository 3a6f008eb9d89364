"""Carrying out a recovery: the manager's side of ``policy/recovery.py``.

``feed`` hands one observation to the watch's state machine and does what it returns, in order;
the effects that ask something (``RequestPlan``, ``Launch``) are answered with the next observation.
Nothing here decides: which step comes next is the state machine's. What the effects change of
the watch's life (``NewLife``, ``WatchNext``, the job state) goes through the watch's own table
(``policy/watch_lifecycle.py``, via ``manager/watch.live``).

Every step is keyed in the journal so that a manager killed anywhere and restarted carries the
recovery on and does each step at most once: the timeline row per failed incarnation
(``open_recovery``), the plan (stored with the ``confirmed`` phase), and the actions through
``perform_once`` (``cancel:<job>:<n>``, ``stop:<job>:<n>``, ``drain:<job>:<n>:<node>``,
``resubmit:<job>:<n+1>``; an array task's ``requeue:<job>_<task>:<restart>``). A resubmission
interrupted between sbatch and the journal is found again by its tag in the job comment. A step
whose effects fail (Slurm unreachable) leaves the state where it was; the next tick tries again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from slurm_omni.checkpoint.fence import read_fence
from slurm_omni.checkpoint.format import latest_step
from slurm_omni.errors import OmniError
from slurm_omni.manager.actions import ResubmitRefused
from slurm_omni.manager.context import ManagerContext
from slurm_omni.manager.journal import action_key, incarnation_tag, perform_once
from slurm_omni.manager.sources import read_job_heartbeats
from slurm_omni.manager.supervisor_reports import allocations_now
from slurm_omni.manager.watch import Watch, live
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.confirm import Decision, TaskExit, Verdict
from slurm_omni.policy.placement import Action, Plan, nodes_to_replace, plan_recovery
from slurm_omni.policy.recovery import step
from slurm_omni.policy.recovery_events import (
    Cancel,
    Close,
    Drain,
    Effect,
    FailAll,
    HandOver,
    Launch,
    Launched,
    LaunchRefused,
    MarkPhase,
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
    WatchNext,
)
from slurm_omni.policy.watch_lifecycle import (
    JobStateSet,
    PlanPolled,
    Relaunched,
    Requeued,
    Switched,
    TaskRequeued,
)
from slurm_omni.slurm.backend import ClusterSnapshot

log = logging.getLogger(__name__)


def feed(m: ManagerContext, w: Watch, obs: Observation, now: float) -> None:
    """Step ``w``'s recovery with ``obs`` and carry out the effects, answering those that ask."""
    queue: deque[Observation] = deque([obs])
    while queue:
        before = w.recovery
        w.recovery, effects = step(before, queue.popleft(), now, w.recovery_config)
        if w.recovery.phase is not before.phase:
            log.debug("manager: %s recovery %s -> %s", w.key, before.phase.value, w.recovery.phase.value)
        try:
            for effect in effects:
                answer = _carry_out(m, w, effect, now)
                if answer is not None:
                    queue.append(answer)
        except ResubmitRefused as e:
            log.error("%s", e)
            queue.append(LaunchRefused(at=now, cause="job_file_changed", error=str(e)))
        except OmniError as e:   # Slurm unreachable, sbatch refused...: the next tick tries again
            log.error("manager: %s: recovery step failed, retrying: %s", w.key, e)
            w.recovery = before
            return


def _carry_out(m: ManagerContext, w: Watch, e: Effect, now: float) -> Observation | None:
    if isinstance(e, OpenRecovery):
        m.journal.open_recovery(w.key, e.incarnation, e.cause, e.nodes, fault_at=e.fault_at,
                                detected_at=e.detected_at, confirmed_at=e.confirmed_at, path=e.path.value)
        log.warning("manager: %s incarnation %d: failure confirmed (%s on %s; path %s)", w.key, e.incarnation,
                    e.cause, ",".join(e.nodes) or "-", e.path.value)
    elif isinstance(e, MarkPhase):
        m.mark_phase(w.key, e.incarnation, e.phase, e.at, new_incarnation=e.new_incarnation, plan=e.plan,
                     path=e.path.value if e.path is not None else None, detail=e.detail)
        if e.phase == "first_step":
            log.info("manager: %s incarnation %d trains again", w.key, w.incarnation)
    elif isinstance(e, RecordDecision):
        m.journal.record_decision(w.key, e.incarnation, e.at, e.verdict, e.cause, e.payload)
    elif isinstance(e, Note):
        prefix, _, rest = e.key.partition(":")
        m.journal.record_observation(w.key, e.incarnation, e.kind, e.at, e.payload, key=f"{prefix}:{w.key}:{rest}")
    elif isinstance(e, SetJobState):
        if e.state == "waiting" and w.state != "waiting":
            log.warning("manager: %s waits for nodes", w.key)
        live(w, JobStateSet(state=e.state), now)
        m.journal.set_job_state(w.key, e.state)
    elif isinstance(e, RequestPlan):
        plan = _plan(m, w, fresh=e.fresh, now=now)
        return None if plan is None else Planned(plan=plan)
    elif isinstance(e, Cancel):
        _once(m, w, "cancel", f"{e.incarnation}", e.incarnation, e.slurm_job_id,
              lambda: "; ".join(m.actions.cancel(j) for j in _held(w, e.slurm_job_id)))
    elif isinstance(e, SignalCheckpoint):
        _once(m, w, "stop", f"{e.incarnation}", e.incarnation, e.slurm_job_id,
              lambda: m.actions.signal_checkpoint(_held(w, e.slurm_job_id)[0]))
        log.warning("manager: %s: checkpointing to move (%s)", w.key, w.recovery.cause)
    elif isinstance(e, Drain):
        _once(m, w, "drain", f"{e.incarnation}:{e.node}", e.incarnation, w.slurm_id,
              lambda: m.actions.drain(e.node, e.reason))
    elif isinstance(e, Launch):
        return _launch(m, w, e)
    elif isinstance(e, WatchNext):
        _watch_next(m, w, e, now)
    elif isinstance(e, NewLife):   # Slurm's requeue: the same job, the judged life moves on
        live(w, Requeued(restart_count=e.restart_count, incarnation=e.incarnation), now)
    elif isinstance(e, FailAll):
        _fail_all(w, e)
    elif isinstance(e, Close):
        _close(m, w, e, now)
    elif isinstance(e, HandOver):   # a supervisor's effect; the manager never runs in that role
        log.error("manager: %s: unexpected hand-over (%s)", w.key, e.reason)
    return None


def _fail_all(w: Watch, e: FailAll) -> None:
    """Slurm says the incarnation ended badly: a level-1 signal on every node of the job (it agrees
    with whichever rank goes stale)."""
    log.info("manager: %s incarnation %d: %s", w.key, w.incarnation, e.why)
    for offset, nodes in w.nodes.items():
        for node in nodes:
            w.confirmer.observe(TaskExit(e.at, node, offset, -1, 1, None))


def _close(m: ManagerContext, w: Watch, e: Close, now: float) -> None:
    """The job's last incarnation ended for good (``e.state``: done, cancelled or failed)."""
    live(w, JobStateSet(state=e.state), now)
    m.journal.set_incarnation(w.key, w.incarnation, ended_at=e.at, end_reason=e.reason)
    m.journal.set_job_state(w.key, e.state)
    if e.state == "done":
        log.info("manager: %s finished training", w.key)
    elif e.state == "cancelled":
        log.warning("manager: %s was cancelled in Slurm; not resubmitting", w.key)
    else:
        log.error("manager: %s: %s; not resubmitting", w.key, e.reason)


def _held(w: Watch, slurm_job_id: int) -> tuple[int, ...]:
    """The allocations a life holds now: in allocation mode the one its supervisor runs it in (a
    successor after a time limit) and its pools (the status file says), else its own Slurm job."""
    return allocations_now(w.reg.ckpt_dir, slurm_job_id)


def _once(m: ManagerContext, w: Watch, kind: str, suffix: str, incarnation: int, slurm_job_id: int | None,
          act: Callable[[], str]) -> str:
    return perform_once(m.journal, key=f"{kind}:{w.key}:{suffix}", job=w.key, incarnation=incarnation, kind=kind,
                        payload={"slurm_job_id": slurm_job_id}, now=m.clock, act=act,
                        find_existing=lambda _: None)


# -- RequestPlan ------------------------------------------------------------------------------------
def _plan(m: ManagerContext, w: Watch, *, fresh: bool, now: float) -> Plan | None:
    """A plan from a snapshot taken now (node states as they are, not before the failure), or,
    while waiting for nodes, from the next new poll only."""
    if fresh:
        snap = m.poller.poll(force=True) or m.poller.last
    else:
        if not w.life.plan_due(m.poller.polls):
            return None
        snap = m.poller.last
    if snap is None:
        return None
    live(w, PlanPolled(poll=m.poller.polls), now)
    return _make_plan(m, w, snap, now)


def _make_plan(m: ManagerContext, w: Watch, snap: ClusterSnapshot, now: float) -> Plan:
    s = w.recovery
    if not w.nodes:   # the incarnation never ran: resubmit it as it was, away from what failed
        return Plan(Action.RESUBMIT, w.units, exclude=s.nodes, quarantine=w.quarantine,
                    reasons=("the incarnation never ran: resubmit without a node list",))
    if w.recovery_config.supervised:
        # taking over from the step supervisor: a new allocation as the job file asks for it, away
        # from every node the job lost (the supervisor's failed nodes are in the quarantine)
        exclude = tuple(sorted({*s.nodes, *w.quarantine.active(now)}))
        return Plan(Action.RESUBMIT, w.units, exclude=exclude, quarantine=w.quarantine,
                    reasons=("taking over from the step supervisor: resubmit without a node list",))
    index = ClusterIndex.build(snap.topology, snap.nodes)
    layout = w.layout()
    failed = nodes_to_replace(Decision(Verdict.CONFIRMED, now, cause=s.cause, nodes=s.nodes), index, layout)
    rec = m.journal.recovery(w.key, s.incarnation)
    fault_at = (rec.times["fault"] or rec.times["confirmed"]) if rec is not None else None
    return plan_recovery(index, layout, failed, now=now, fault_at=fault_at or now, quarantine=w.quarantine,
                         config=w.placement, drain_reason=f"{s.cause} in {w.key}")


# -- Launch -----------------------------------------------------------------------------------------
def _launch(m: ManagerContext, w: Watch, e: Launch) -> Observation | None:
    if e.path is RecoveryPath.REQUEUED:
        return _requeue_task(m, w, e.incarnation)
    if e.path is RecoveryPath.IN_ALLOCATION or e.plan is None:   # the supervisor's road, not the manager's
        log.error("manager: %s: no launch of path %s here", w.key, e.path.value)
        return None
    return _resubmit(m, w, e.plan)


def next_incarnation(m: ManagerContext, w: Watch) -> int:
    """One past the last life of the job that ran: the life being judged, a later one Slurm showed
    RUNNING (its requeue for a lost node), or one whose ranks wrote a heartbeat. A requeued job that
    the recovery cancelled while PENDING never ran and takes no number. The old submission has
    stopped by now (the state machine waited for it), so no life of it comes after. A number this
    recovery journaled before a crash is kept: Slurm may no longer show the old job by then. The
    checkpoint fence (the highest incarnation that started on the job's root) counts too, and so do
    the lives a step supervisor relaunched inside the allocation."""
    recorded = [i["number"] for i in m.journal.incarnations(w.key) if i["number"] > w.incarnation]
    if recorded:
        return int(recorded[0])
    lives = [w.judged_incarnation, w.incarnation]
    if w.recovery_config.supervised:   # a requeue adds REQUEUE_INCARNATION_STRIDE, a relaunch one
        lives.append(w.allocation_incarnation(w.life.running_restart_count))
    else:   # a requeue adds one
        lives.append(w.incarnation + w.life.running_restart_count)
    if w.slurm_id is not None:
        lives += [hb.incarnation for hb in read_job_heartbeats(w.heartbeat_dir, w.slurm_id)]
    try:   # a life that restored (it raised the checkpoint fence) but never beat
        fence = read_fence(w.reg.ckpt_dir)
    except OmniError as e:
        log.warning("manager: %s: %s", w.key, e)
        fence = None
    if fence is not None:
        lives.append(fence.incarnation)
    return max(lives) + 1


def _resubmit(m: ManagerContext, w: Watch, plan: Plan) -> Launched:
    new = next_incarnation(m, w)
    tag = incarnation_tag(w.key, new)
    restore_step = latest_step(w.reg.ckpt_dir)
    nodes = {c.het_offset: list(c.nodes) for c in plan.components}
    m.journal.add_incarnation(w.key, new, {"units": plan.units, "nodes": nodes,
                                           "data_parallel_size": w.shape.data_parallel_size_for(plan.units),
                                           "restore_step": restore_step, "tag": tag})

    def act() -> str:
        m.crash("resubmit:before_submit")
        job_id = m.actions.resubmit(w.reg, w.shape, plan, plan.units, tag, new)
        m.crash("resubmit:after_submit")
        return str(job_id)

    result = perform_once(m.journal, key=action_key("resubmit", w.key, new), job=w.key, incarnation=new,
                          kind="resubmit", payload={"tag": tag, "plan": plan}, now=m.clock, act=act,
                          find_existing=lambda intent: m.actions.find_by_tag(tag, user=m.user, name=w.reg.name,
                                                                             since=intent.intended_at))
    at = m.clock()
    m.journal.set_incarnation(w.key, new, slurm_job_id=result, submitted_at=at)
    m.journal.set_incarnation(w.key, w.incarnation, ended_at=at, end_reason=w.recovery.cause)
    log.warning("manager: %s incarnation %d submitted as Slurm job %s (%s, dp units %d -> %d; %s)", w.key, new,
                result, plan.action.value, w.units, plan.units, "; ".join(plan.reasons))
    return Launched(at=at, incarnation=new, slurm_job_id=int(result), restore_step=restore_step)


def _requeue_task(m: ManagerContext, w: Watch, incarnation: int) -> Launched:
    """A failed array task: requeue it alone; the same Slurm job id runs again (restart count + 1)."""
    ref = f"{w.reg.job_id}_{w.array_task}"
    _once(m, w, "requeue", f"{incarnation}", incarnation, w.slurm_id, lambda: m.actions.requeue_task(ref))
    return Launched(at=m.clock(), incarnation=incarnation + 1, slurm_job_id=w.slurm_id or 0,
                    restore_step=latest_step(w.heartbeat_dir.parent))


# -- WatchNext --------------------------------------------------------------------------------------
def _watch_next(m: ManagerContext, w: Watch, e: WatchNext, now: float) -> None:
    if e.path is RecoveryPath.REQUEUED:
        # The failed life is over: its verdict must not confirm again, and its last heartbeats (read
        # until Slurm shows the restart) are no sign of the next life training.
        live(w, TaskRequeued(restore_step=e.restore_step), now)
    elif e.path is RecoveryPath.IN_ALLOCATION:
        # the same Slurm job trains the next life: journaled as an incarnation of its own
        m.journal.add_incarnation(w.key, e.incarnation, {
            "units": w.units, "data_parallel_size": w.shape.data_parallel_size_for(w.units),
            "nodes": {str(k): list(v) for k, v in w.nodes.items()}, "restore_step": latest_step(w.reg.ckpt_dir),
            "in_allocation": True})
        m.journal.set_incarnation(w.key, e.incarnation, slurm_job_id=str(e.slurm_job_id), started_at=m.clock())
        live(w, Relaunched(incarnation=e.incarnation), now)
    else:
        live(w, Switched(incarnation=e.incarnation, slurm_id=e.slurm_job_id, units=e.units or w.units,
                         restore_step=e.restore_step, quarantine=e.quarantine or w.quarantine), now)
