"""From a confirmed failure to the next incarnation: timeline, plan, cancel, drain, resubmit.

Every step is keyed in the journal so that a manager killed anywhere and restarted carries the
recovery on and does each step at most once: the timeline row per failed incarnation
(``open_recovery``), the plan (stored with the ``confirmed`` phase), and the actions through
``perform_once`` (``cancel:<job>:<n>``, ``drain:<job>:<n>:<node>``, ``resubmit:<job>:<n+1>``; an
array task's ``requeue:<job>_<task>:<restart>``). A resubmission interrupted between sbatch and the
journal is found again by its tag in the job comment. Between the cancel and the resubmission the
recovery waits (bounded, journaled as ``old_incarnation_stopping`` / ``old_incarnation_end``) until
Slurm no longer shows the cancelled incarnation RUNNING or COMPLETING.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from slurm_omni.checkpoint.fence import read_fence
from slurm_omni.checkpoint.format import latest_step
from slurm_omni.errors import OmniError
from slurm_omni.manager.actions import ResubmitRefused
from slurm_omni.manager.journal import Recovery, action_key, incarnation_tag, perform_once
from slurm_omni.manager.sources import read_job_heartbeats
from slurm_omni.manager.watch import Watch
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.confirm import NODE_STATE_KIND, Decision, Verdict
from slurm_omni.policy.placement import (
    Action,
    ComponentPlan,
    Plan,
    Quarantine,
    nodes_to_replace,
    plan_grow,
    plan_recovery,
)
from slurm_omni.slurm.backend import ClusterSnapshot
from slurm_omni.slurm.types import JobState

if TYPE_CHECKING:
    from slurm_omni.manager.daemon import Manager

log = logging.getLogger(__name__)

_BUSY = frozenset({JobState.RUNNING, JobState.COMPLETING})


def plan_from_json(obj: dict[str, Any]) -> Plan:
    """A plan as ``journal.to_json`` stored it."""
    until = (obj.get("quarantine") or {}).get("until") or {}
    return Plan(Action(obj["action"]), int(obj["data_parallel_size"]),
                tuple(ComponentPlan(int(c["het_offset"]), tuple(c["nodes"]), tuple(c["added"]), tuple(c["removed"]))
                      for c in obj.get("components") or ()),
                exclude=tuple(obj.get("exclude") or ()), drain=tuple((n, r) for n, r in obj.get("drain") or ()),
                quarantine=Quarantine({str(k): float(v) for k, v in until.items()}),
                wait_until=obj.get("wait_until"), reasons=tuple(obj.get("reasons") or ()))


def start(m: Manager, w: Watch, d: Decision, now: float) -> None:
    """A CONFIRMED decision: open the timeline (once) and carry the recovery as far as it goes."""
    fault, detected = d.fault_at, d.first_signal_at
    if fault is not None and detected is not None:
        fault = min(fault, detected)
    cause, nodes = _root_cause(m, w, d)
    w.pending = m.journal.open_recovery(w.key, w.incarnation, cause, nodes, fault_at=fault,
                                        detected_at=detected, confirmed_at=d.confirmed_at or now)
    m.mark_phase(w.key, w.incarnation, "confirmed", d.confirmed_at or now)
    log.warning("manager: %s incarnation %d: failure confirmed (%s on %s): %s", w.key, w.incarnation, d.cause,
                ",".join(d.nodes) or "-", "; ".join(d.reasons))
    proceed(m, w, now)


def _root_cause(m: Manager, w: Watch, d: Decision) -> tuple[str, tuple[str, ...]]:
    """Tasks that died (or hung) on nodes that Slurm now reports failed are a node failure: when
    Slurm kills a lost node's job, the tasks' exit records often arrive before the poll that shows
    the node DOWN, and the first agreeing signal names the confirmation's cause."""
    if d.cause not in ("task_exit", "hang", "stuck") or not w.nodes:
        return d.cause, d.nodes
    snap = m.poller.poll(force=True) or m.poller.last
    if snap is None:
        return d.cause, d.nodes
    states = {n.name: n.state for n in snap.nodes if n.name in w.node_set}
    lost = sorted(n for n, state in states.items() if state in NODE_STATE_KIND)
    if not lost:
        return d.cause, d.nodes
    return NODE_STATE_KIND[states[lost[0]]], tuple(lost)


def start_without_confirmer(m: Manager, w: Watch, at: float, lost: tuple[str, ...]) -> None:
    """Every rank stopped with a checkpoint (exit 75), so no heartbeat goes stale: either Slurm
    ended the job for ``lost`` nodes (the ranks checkpointed on its SIGTERM), or it was not
    requeued as the ranks asked. Both end the incarnation; Slurm's own word is the confirmation."""
    if lost:
        cause = NODE_STATE_KIND.get(w.node_states[lost[0]], "down")
        why = f"Slurm ended the job: {', '.join(lost)} {cause}"
    elif w.requeued_at is not None:
        cause, why = "requeued", "Slurm requeued the job unasked; every rank checkpointed on its way out"
    else:
        cause, why = "checkpointed", "ranks checkpointed for requeue; the job was not requeued"
    decision = Decision(Verdict.CONFIRMED, at, cause=cause, het_offsets=tuple(w.nodes), nodes=lost,
                        first_signal_at=at, confirmed_at=at, reasons=(why,))
    m.journal.record_decision(w.key, w.incarnation, at, "confirmed", cause, decision)
    w.verdict = Verdict.CONFIRMED
    w.requeued_at = None
    start(m, w, decision, at)


def proceed(m: Manager, w: Watch, now: float) -> None:
    rec = w.pending
    if rec is None:
        return
    try:
        if w.array_task is not None:
            _requeue_task(m, w, rec, now)
            return
        plan = _plan(m, w, rec, now)
        if plan is None:
            return
        _once(m, w, "cancel", f"{w.incarnation}", lambda: m.actions.cancel(w.slurm_id or 0))
        if plan.action is Action.WAIT:
            if w.state != "waiting":
                w.state = "waiting"
                m.journal.set_job_state(w.key, "waiting")
                log.warning("manager: %s waits for nodes: %s", w.key, "; ".join(plan.reasons))
            return
        if not _old_incarnation_stopped(m, w, now):
            return
        for node, reason in plan.drain:
            _once(m, w, "drain", f"{w.incarnation}:{node}", lambda n=node, r=reason: m.actions.drain(n, r))
        _resubmit(m, w, rec, plan, now)
    except ResubmitRefused as e:
        log.error("%s", e)
        m.journal.record_decision(w.key, w.incarnation, now, "refused", "job_file_changed", {"error": str(e)})
        m.journal.set_job_state(w.key, "failed")
        w.state, w.pending = "failed", None
    except OmniError as e:   # Slurm unreachable, sbatch refused...: the next tick tries again
        log.error("manager: %s: recovery step failed, retrying: %s", w.key, e)


def _once(m: Manager, w: Watch, kind: str, suffix: str, act: Any) -> str:
    return perform_once(m.journal, key=f"{kind}:{w.key}:{suffix}", job=w.key, incarnation=w.incarnation, kind=kind,
                        payload={"slurm_job_id": w.slurm_id}, now=m.clock, act=act, find_existing=lambda _: None)


def _old_incarnation_stopped(m: Manager, w: Watch, now: float) -> bool:
    """Has the cancelled incarnation stopped? Its ranks checkpoint on scancel's SIGTERM: that save is
    the newest state, and the next incarnation should restore it rather than fence it out (the
    checkpoint fence refuses the old ranks' saves once the next incarnation started). So wait until a
    poll taken after the cancel no longer shows the job RUNNING or COMPLETING, for at most
    ``end_wait_s`` (a node that stopped answering can keep it COMPLETING for long)."""
    if w.slurm_id is None or w.end_waited:
        return True
    if w.end_wait_since is None:
        w.end_wait_since = now
        m.journal.record_observation(w.key, w.incarnation, "old_incarnation_stopping", now,
                                     {"slurm_job_id": w.slurm_id, "limit_s": m.config.end_wait_s},
                                     key=f"end-wait:{w.key}:{w.incarnation}")
    snap = m.poller.last
    job = snap.job(w.slurm_id) if snap is not None else None
    fresh = snap is not None and snap.taken_at >= w.end_wait_since
    busy = job is not None and any(s in _BUSY for s in (job.state, *(c.state for c in job.components)))
    waited = now - w.end_wait_since
    if fresh and not busy:
        outcome = "stopped"
    elif waited >= m.config.end_wait_s:
        outcome = "timed_out"
        log.warning("manager: %s: Slurm job %d still %s %.0f s after scancel; submitting the next incarnation "
                    "anyway (the checkpoint fence refuses its ranks' later saves)", w.key, w.slurm_id,
                    job.slurm_state if job else "unseen", waited)
    else:
        return False
    m.journal.record_observation(w.key, w.incarnation, "old_incarnation_end", now,
                                 {"slurm_job_id": w.slurm_id, "outcome": outcome, "waited_s": round(waited, 3),
                                  "state": job.slurm_state if job else None},
                                 key=f"end:{w.key}:{w.incarnation}")
    w.end_waited = True
    return True


def _plan(m: Manager, w: Watch, rec: Recovery, now: float) -> Plan | None:
    """The stored plan, or a new one from the newest snapshot (again on every poll while waiting)."""
    if rec.plan is not None and rec.plan.get("action") != Action.WAIT.value:
        return plan_from_json(rec.plan)
    if w.state == "waiting":   # re-plan only from a new poll
        snap = m.poller.last
        if w.last_plan_poll == m.poller.polls:
            return None
    else:                      # node states as they are now, not before the failure
        snap = m.poller.poll(force=True) or m.poller.last
    if snap is None:
        return None
    w.last_plan_poll = m.poller.polls
    plan = _make_plan(w, rec, snap, now)
    if plan.action is Action.WAIT:
        if w.state != "waiting":
            m.journal.record_decision(w.key, w.incarnation, now, "plan", plan.action.value, plan)
        return plan
    m.journal.record_decision(w.key, w.incarnation, now, "plan", plan.action.value, plan)
    m.mark_phase(w.key, w.incarnation, "confirmed", rec.times["confirmed"] or now, plan=plan)
    w.pending = m.journal.recovery(w.key, w.incarnation)
    return plan


def _make_plan(w: Watch, rec: Recovery, snap: ClusterSnapshot, now: float) -> Plan:
    if not w.nodes:   # the incarnation never ran: resubmit it as it was, away from what failed
        return Plan(Action.RESUBMIT, w.units, exclude=tuple(rec.nodes), quarantine=w.quarantine,
                    reasons=("the incarnation never ran: resubmit without a node list",))
    index = ClusterIndex.build(snap.topology, snap.nodes)
    layout = w.layout()
    decision = Decision(Verdict.CONFIRMED, now, cause=rec.cause, nodes=rec.nodes)
    failed = nodes_to_replace(decision, index, layout)
    fault_at = rec.times["fault"] or rec.times["confirmed"] or now
    return plan_recovery(index, layout, failed, now=now, fault_at=fault_at, quarantine=w.quarantine,
                         config=w.placement, drain_reason=f"{rec.cause} in {w.key}")


def next_incarnation(m: Manager, w: Watch) -> int:
    """One past the last life of the job that ran: the life being judged, a later one Slurm showed
    RUNNING (its requeue for a lost node), or one whose ranks wrote a heartbeat. A requeued job that
    the recovery cancelled while PENDING never ran and takes no number. The old submission has
    stopped by now (``_old_incarnation_stopped``), so no life of it comes after. A number this
    recovery journaled before a crash is kept: Slurm may no longer show the old job by then. The
    checkpoint fence (the highest incarnation that started on the job's root) counts too."""
    recorded = [i["number"] for i in m.journal.incarnations(w.key) if i["number"] > w.incarnation]
    if recorded:
        return int(recorded[0])
    lives = [w.life, w.incarnation + w.running_restart_count]
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


def _resubmit(m: Manager, w: Watch, rec: Recovery, plan: Plan, now: float) -> None:
    new = next_incarnation(m, w)
    tag = incarnation_tag(w.key, new)
    restore_step = latest_step(w.reg.ckpt_dir)
    nodes = {c.het_offset: list(c.nodes) for c in plan.components}
    m.journal.add_incarnation(w.key, new, {"units": plan.data_parallel_size, "nodes": nodes,
                                           "data_parallel_size": w.shape.data_parallel_size_for(plan.data_parallel_size),
                                           "restore_step": restore_step, "tag": tag})

    def act() -> str:
        m.crash("resubmit:before_submit")
        job_id = m.actions.resubmit(w.reg, w.shape, plan, plan.data_parallel_size, tag, new)
        m.crash("resubmit:after_submit")
        return str(job_id)

    result = perform_once(m.journal, key=action_key("resubmit", w.key, new), job=w.key, incarnation=new,
                          kind="resubmit", payload={"tag": tag, "plan": plan}, now=m.clock, act=act,
                          find_existing=lambda intent: m.actions.find_by_tag(tag, user=m.user, name=w.reg.name,
                                                                             since=intent.intended_at))
    at = m.clock()
    m.journal.set_incarnation(w.key, new, slurm_job_id=result, submitted_at=at)
    m.journal.set_incarnation(w.key, w.incarnation, ended_at=at, end_reason=rec.cause)
    m.mark_phase(w.key, w.incarnation, "resubmitted", at, new_incarnation=new)
    m.journal.set_job_state(w.key, "active")
    log.warning("manager: %s incarnation %d submitted as Slurm job %s (%s, dp units %d -> %d; %s)", w.key, new,
                result, plan.action.value, w.units, plan.data_parallel_size, "; ".join(plan.reasons))
    w.switch_to(new, int(result), plan.data_parallel_size, awaiting=w.incarnation, restore_step=restore_step,
                quarantine=plan.quarantine)


def _requeue_task(m: Manager, w: Watch, rec: Recovery, now: float) -> None:
    """A failed array task: requeue it alone; the same Slurm job id runs again (restart count + 1)."""
    ref = f"{w.reg.job_id}_{w.array_task}"
    _once(m, w, "requeue", f"{w.incarnation}", lambda: m.actions.requeue_task(ref))
    m.mark_phase(w.key, w.incarnation, "resubmitted", m.clock(), new_incarnation=w.incarnation + 1)
    w.awaiting, w.pending, w.expect_restart = w.incarnation, None, True
    w.restore_step = latest_step(w.heartbeat_dir.parent)
    # The failed life is over: its verdict must not confirm again, and its last heartbeats (read
    # until Slurm shows the restart) are no sign of the next life training.
    w.new_life()


def consider_grow(m: Manager, w: Watch, snap: ClusterSnapshot, now: float) -> None:
    """A shrunk job with free nodes in reach: checkpoint, stop, and resubmit it larger."""
    if w.units >= w.shape.units or w.array_task is not None or not w.nodes:
        return
    index = ClusterIndex.build(snap.topology, snap.nodes)
    plan = plan_grow(index, w.layout(), now=now, quarantine=w.quarantine, config=w.placement)
    if plan is None:
        return
    m.journal.record_decision(w.key, w.incarnation, now, "plan", plan.action.value, plan)
    m.journal.open_recovery(w.key, w.incarnation, "grow", (), fault_at=None, detected_at=now, confirmed_at=now)
    m.mark_phase(w.key, w.incarnation, "confirmed", now, plan=plan)
    w.pending = None
    w.awaiting_grow = now
    _once(m, w, "stop", f"{w.incarnation}", lambda: m.actions.signal_checkpoint(w.slurm_id or 0))
    log.warning("manager: %s: nodes returned; checkpointing to grow (%s)", w.key, "; ".join(plan.reasons))


def finish_grow(m: Manager, w: Watch, now: float) -> None:
    """Resubmit once every rank stopped with a checkpoint (or the stop timed out)."""
    if not (w.quiet or not w.running or w.ended or now - (w.awaiting_grow or now) >= m.config.stop_timeout_s):
        return
    w.pending = m.journal.recovery(w.key, w.incarnation)
    proceed(m, w, now)
