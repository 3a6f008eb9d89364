"""The manager's fail-slow watch: heartbeats into the detector (policy/failslow.py), its verdicts
into the journal, ``omni status`` and a Prometheus file, and a planned migration off a flagged node.

Graded: a node FLAGGED by the detector is first a warning (journaled as decision ``failslow`` /
``flagged``, shown by ``omni status``, exported in ``<metrics_dir>/omni-failslow.prom``). Then, when
``judge_migration`` says it pays, a planned migration at the next checkpoint boundary: the plan
(a replacement by topology, or a shrink) is journaled with the estimate it used, the ranks get
SIGUSR1 (they checkpoint at the end of the step and exit 75): the recovery state machine's
``MigrationRequested`` (policy/recovery.py, path ``planned_migration``) cancels and resubmits with the
slow node excluded and quarantined, and the next life restores the checkpoint just written. No step is lost and nothing here is a failure:
the confirmer never sees these verdicts. Once the next incarnation has trained for a window, the
outcome (the step time it measured against the estimate) is journaled too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from slurm_omni.checkpoint.format import write_atomic
from slurm_omni.config.job import load_job
from slurm_omni.errors import OmniError
from slurm_omni.manager import recovery
from slurm_omni.manager.context import ManagerContext
from slurm_omni.manager.events import HeartbeatRecord
from slurm_omni.manager.status import FAILSLOW_VERDICT as VERDICT
from slurm_omni.manager.supervisor_reports import read_status_view, request_outcome, write_request
from slurm_omni.manager.watch import Watch
from slurm_omni.ownership import NotOwnedError, ensure_dir, user_folder
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.failslow import (
    Estimate,
    FailSlowDetector,
    MigrationBudget,
    Mitigation,
    NodeState,
    Report,
    StepSample,
    first_flagged,
    judge_migration,
)
from slurm_omni.policy.placement import Action, Plan, plan_recovery
from slurm_omni.policy.recovery import Phase
from slurm_omni.policy.recovery_events import MigrationRequested

log = logging.getLogger(__name__)

PROM_NAME = "omni-failslow.prom"
SUPERVISOR_FRESH_S = 30.0   # a supervisor status older than this does not answer requests
REQUEST_ANSWER_S = 60.0     # the supervisor reads the request every node poll (seconds): then fall back


@dataclass
class FailSlowJob:
    """One job's detector and what was journaled of it (the incarnation it judges)."""

    detector: FailSlowDetector
    incarnation: int
    budget: MigrationBudget = field(default_factory=MigrationBudget)
    states: dict[str, NodeState] = field(default_factory=dict)    # node -> last journaled state
    job_slow: bool = False
    migrating: bool = False
    outcome_due: tuple[int, Estimate, Mitigation] | None = None   # (incarnation migrated from, the estimate, action)
    kept: dict[str, float] = field(default_factory=dict)   # node -> when a migration was judged not to pay
    max_steps: int | None = None
    report: Report | None = None
    request: tuple[str, float, str, MigrationBudget] | None = None
    """An in-allocation replacement asked of the step supervisor: (id, when, node, the budget before)."""
    refused: set[str] = field(default_factory=set)   # nodes the supervisor would not replace: resubmit


class FailSlowWatch:
    def __init__(self, m: ManagerContext) -> None:
        self.m = m
        self.config = m.config.site.failslow
        self.jobs: dict[str, FailSlowJob] = {}
        self._prom_text = ""
        self._prom_at = float("-inf")
        self._broken: set[str] = set()
        self._prom_refused: set[str] = set()

    def _job(self, w: Watch) -> FailSlowJob:
        fs = self.jobs.get(w.key)
        if fs is None:
            fs = self.jobs[w.key] = FailSlowJob(FailSlowDetector(self.config), w.incarnation)
            try:
                fs.max_steps = load_job(w.reg.job_file).training.max_steps
            except OmniError as e:
                log.warning("manager: %s: %s (fail-slow estimates without the remaining steps)", w.key, e)
        if fs.incarnation != w.incarnation:   # a new incarnation: other nodes, a new baseline
            fs.detector.reset()
            fs.states.clear()
            fs.incarnation, fs.job_slow, fs.migrating, fs.report, fs.request = w.incarnation, False, False, None, None
        return fs

    def observe(self, w: Watch, beats: list[HeartbeatRecord], now: float) -> None:
        """Feed the newest heartbeats of the life being judged; evaluate; warn, migrate, journal. The
        fail-slow watch is advice: whatever goes wrong in it must not stop the manager's loop."""
        if not self.config.enabled or w.array_task is not None or not w.running:
            return
        try:
            self._observe(w, beats, now)
        except Exception:   # logged once per job; failure recovery goes on without it
            if w.key not in self._broken:
                self._broken.add(w.key)
                log.exception("manager: %s: fail-slow watch failed; it stays off for this job", w.key)

    def _observe(self, w: Watch, beats: list[HeartbeatRecord], now: float) -> None:
        if w.key in self._broken:
            return
        fs = self._job(w)
        for hb in beats:
            if hb.phase == "training" and hb.compute_s is not None and hb.data_s is not None and hb.node:
                fs.detector.observe(StepSample(hb.time, hb.rank, hb.stage, hb.node, hb.step, hb.compute_s,
                                               hb.data_s, hb.step_time_s, hb.cpu_wait_s or 0.0))
        report = fs.detector.evaluate(now)
        fs.report = report
        self._journal_changes(w, fs, report, now)
        self._outcome(w, fs, report, now)
        if fs.request is not None:
            self._follow_request(w, fs, fs.request, now)
        if report.flagged and not fs.migrating and w.recovery.phase is Phase.WATCHING:
            self._consider_migration(w, fs, report, now)

    def _journal_changes(self, w: Watch, fs: FailSlowJob, report: Report, now: float) -> None:
        m = self.m
        for v in report.nodes:
            old = fs.states.get(v.node, NodeState.OK)
            if v.state is old or v.state is NodeState.SUSPECT or (v.state is NodeState.OK and old is NodeState.SUSPECT):
                fs.states[v.node] = v.state if v.state is not NodeState.SUSPECT else old
                continue
            fs.states[v.node] = v.state
            cause = "flagged" if v.state is NodeState.FLAGGED else "cleared"
            m.journal.record_decision(w.key, w.incarnation, now, VERDICT, cause, {
                "node": v.node, "stage": v.stage, "ratio": round(v.ratio, 3), "z": round(v.z, 1), "kind": v.kind,
                "level_s": v.level_s, "peer_level_s": v.peer_level_s, "since": v.since, "summary": report.summary})
            log.warning("manager: %s: fail-slow %s: %s", w.key, cause, report.summary if cause == "flagged"
                        else f"{v.node} back to {v.ratio:.2f}x its peers")
        if report.job.slow != fs.job_slow:
            fs.job_slow = report.job.slow
            m.journal.record_decision(w.key, w.incarnation, now, VERDICT, "job_slow" if report.job.slow else "job_ok",
                                      {"ratio": round(report.job.ratio, 3), "cause": report.job.cause,
                                       "step_time_s": report.job.step_time_s,
                                       "best_step_time_s": report.job.best_step_time_s, "summary": report.summary})
            if report.job.slow:
                log.warning("manager: %s: %s (no migration: moving nodes cannot fix it)", w.key, report.summary)

    def _consider_migration(self, w: Watch, fs: FailSlowJob, report: Report, now: float) -> None:
        m = self.m
        snap = m.poller.last
        if snap is None or not w.nodes:
            return
        node = first_flagged(report).node
        if now - fs.kept.get(node, float("-inf")) < self.config.window_s or node not in w.node_set:
            return   # judged again once per window: a spare may free up, the estimate may change
        # a spare inside the allocation first (the step supervisor's), else the cluster's by resubmission;
        # a supervisor with no spare left can still drop the node's replica (a shrink by request)
        spares_left = self._supervisor_spares(w, node, now)
        replicas = w.shape.data_parallel_size_for(w.units)
        in_allocation = spares_left is not None and spares_left > 0
        shrink_in_allocation = spares_left == 0 and replicas > 1
        plan: Plan | None = None
        if not (in_allocation or shrink_in_allocation):
            try:
                index = ClusterIndex.build(snap.topology, snap.nodes)
                plan = plan_recovery(index, w.layout(), [node], now=now,
                                     fault_at=now - m.config.site.elasticity.spare_wait_s,
                                     quarantine=w.quarantine, config=w.placement)
            except OmniError as e:   # e.g. an in-allocation job's one allocation is no per-stage layout
                log.info("manager: %s: fail-slow: no resubmission plan off %s: %s", w.key, node, e)
            else:
                why = f"fail-slow: {node} is slow, not failed: quarantined, not drained"
                plan = replace(plan, drain=(), reasons=(*plan.reasons, why))
        step = int(w.progress[0]) if w.progress else 0
        remaining = max(0, (fs.max_steps or step) - step)
        decision = judge_migration(report, config=self.config, replicas=replicas, remaining_steps=remaining,
                                   spare_available=in_allocation or (plan is not None and plan.action is Action.RESUBMIT),
                                   can_shrink=shrink_in_allocation or (plan is not None and plan.action is Action.SHRINK),
                                   budget=fs.budget, now=now)
        payload: dict[str, Any] = {"node": node, "reasons": list(decision.reasons), "estimate": decision.estimate,
                                   "plan": plan if decision.action in (Mitigation.REPLACE, Mitigation.SHRINK) else None}
        if decision.action not in (Mitigation.REPLACE, Mitigation.SHRINK):
            if node not in fs.kept:   # journaled once per episode, re-judged quietly
                m.journal.record_decision(w.key, w.incarnation, now, VERDICT, "keep", payload)
                log.warning("manager: %s: fail-slow: keeping %s: %s", w.key, node, "; ".join(decision.reasons))
            fs.kept[node] = now
            return
        if w.slurm_id is not None and ((in_allocation and decision.action is Mitigation.REPLACE)
                                       or (shrink_in_allocation and decision.action is Mitigation.SHRINK)):
            # the step supervisor replaces the node by its spare (or drops its replica) at a checkpoint,
            # in the same Slurm job
            rid = f"failslow-{w.key}-{w.incarnation}-{node}-{int(now)}"
            payload.update(path="in_allocation", request=rid, plan=None)
            m.journal.record_decision(w.key, w.incarnation, now, VERDICT, decision.action.value, payload)
            write_request(w.reg.ckpt_dir, w.slurm_id, rid, [node], shrink=decision.action is Mitigation.SHRINK)
            fs.request = (rid, now, node, fs.budget)
            fs.migrating = True
            fs.budget = fs.budget.add(now)
            if decision.estimate is not None:
                fs.outcome_due = (w.incarnation, decision.estimate, decision.action)
            log.warning("manager: %s: fail-slow: asked the step supervisor to %s %s (request %s): %s", w.key,
                        "replace" if decision.action is Mitigation.REPLACE else "drop the replica of", node, rid,
                        "; ".join(decision.reasons))
            return
        if plan is None:
            return
        m.journal.record_decision(w.key, w.incarnation, now, VERDICT, decision.action.value, payload)
        fs.migrating = True
        fs.budget = fs.budget.add(now)
        if decision.estimate is not None:
            fs.outcome_due = (w.incarnation, decision.estimate, decision.action)
        log.warning("manager: %s: fail-slow: planned migration off %s (%s): %s", w.key, node, decision.action.value,
                    "; ".join(decision.reasons))
        # the recovery state machine's planned stop: checkpoint on USR1 (exit 75), cancel, relaunch by the plan
        recovery.feed(m, w, MigrationRequested(at=now, plan=plan, nodes=(node,)), now)

    def _supervisor_spares(self, w: Watch, node: str, now: float) -> int | None:
        """The spares a step supervisor has left, when one runs this job, answers (its status is
        fresh), runs ``node`` and has not refused it: ask it (it refuses a spare of the wrong kind, or
        a shrink below the job's minimum; then the resubmission is the fallback). None: ask no one."""
        fs = self.jobs.get(w.key)
        if not w.recovery_config.supervised or w.slurm_id is None or (fs is not None and node in fs.refused):
            return None
        view = read_status_view(w.reg.ckpt_dir, w.slurm_id)
        if (view is None or view.phase != "running" or node not in view.nodes
                or now - view.updated_at > SUPERVISOR_FRESH_S):
            return None
        return view.spares_left

    def _follow_request(self, w: Watch, fs: FailSlowJob, request: tuple[str, float, str, MigrationBudget],
                        now: float) -> None:
        """The supervisor's answer to the replacement asked of it. Accepted: it relaunches (its report
        makes the next incarnation); refused, or no answer in time: the planned migration by resubmission."""
        rid, at, node, budget = request
        outcome = request_outcome(w.reg.ckpt_dir, w.slurm_id, rid) if w.slurm_id is not None else None
        if outcome in ("accepted", "carried_out"):
            return
        if outcome is None and now - at < REQUEST_ANSWER_S:
            return
        # refused (no spare of the node's kind, the node not in the step) or no answer: judged again
        # at once, by resubmission (the migration asked of the supervisor does not count)
        fs.request, fs.migrating, fs.budget = None, False, budget
        fs.refused.add(node)
        fs.kept.pop(node, None)
        why = f"the step supervisor answered {outcome}" if outcome else f"no answer in {REQUEST_ANSWER_S:.0f}s"
        self.m.journal.record_decision(w.key, w.incarnation, now, VERDICT, "request_refused",
                                       {"node": node, "request": rid, "outcome": outcome, "summary": why})
        log.warning("manager: %s: fail-slow: %s to replacing %s: judged again for a resubmission", w.key, why, node)

    def _outcome(self, w: Watch, fs: FailSlowJob, report: Report, now: float) -> None:
        if fs.outcome_due is None or fs.outcome_due[0] == w.incarnation or report.job.step_time_s is None:
            return
        if not report.nodes:   # a full window of the new incarnation first
            return
        origin, est, action = fs.outcome_due
        fs.outcome_due = None
        measured = report.job.step_time_s
        estimated = est.step_shrink_s if action is Mitigation.SHRINK and est.step_shrink_s is not None \
            else est.step_replace_s
        self.m.journal.record_decision(w.key, w.incarnation, now, VERDICT, "outcome", {
            "migrated_from_incarnation": origin, "action": action.value, "step_before_s": est.step_now_s,
            "step_estimated_s": estimated, "step_measured_s": measured,
            "speedup": est.step_now_s / measured if measured else None})
        log.info("manager: %s: fail-slow migration outcome (%s): %.3fs/step (estimated %.3f, before %.3f)", w.key,
                 action.value, measured, estimated, est.step_now_s)

    # -- export --------------------------------------------------------------------------------
    def write_prom(self, now: float) -> None:
        """``<metrics_dir>/omni-failslow.prom`` for node_exporter's textfile collector: when it changed,
        at most once per poll interval."""
        if now - self._prom_at < self.m.config.poll_interval_s:
            return
        self._prom_at = now
        lines = ["# HELP omni_failslow_node_ratio A node's median own step time over its stage peers'.",
                 "# TYPE omni_failslow_node_ratio gauge",
                 "# HELP omni_failslow_flagged 1 while the fail-slow detector flags the node.",
                 "# TYPE omni_failslow_flagged gauge",
                 "# HELP omni_failslow_job_ratio The job's median step time over its best window.",
                 "# TYPE omni_failslow_job_ratio gauge",
                 "# HELP omni_failslow_migrations Planned fail-slow migrations in the last hour.",
                 "# TYPE omni_failslow_migrations gauge"]
        for key, fs in sorted(self.jobs.items()):
            rep = fs.report
            if rep is None:
                continue
            job = _label(key)
            for v in rep.nodes:
                where = f'job="{job}",node="{_label(v.node)}",stage="{v.stage}"'
                lines.append(f"omni_failslow_node_ratio{{{where}}} {v.ratio:.4f}")
                lines.append(f"omni_failslow_flagged{{{where}}} {int(v.state is NodeState.FLAGGED)}")
            lines.append(f'omni_failslow_job_ratio{{job="{job}"}} {rep.job.ratio:.4f}')
            lines.append(f'omni_failslow_migrations{{job="{job}"}} {fs.budget.used(rep.time)}')
        text = "\n".join(lines) + "\n"
        if text == self._prom_text:
            return
        below, directory = user_folder(self.m.config.site.manager.metrics_dir, self.m.user)
        try:   # node_exporter (another user) reads it: ours, nobody else may write it, 0755
            with ensure_dir(directory, below=below, what="manager: metrics", mode=0o755) as folder:
                write_atomic(directory / PROM_NAME, text.encode(), mode=0o644, durable=False, dir_fd=folder.fd)
            self._prom_text = text
        except NotOwnedError as e:
            if str(e) not in self._prom_refused:   # once per reason: it is retried every poll
                self._prom_refused.add(str(e))
                log.warning("%s", e)
        except OSError as e:
            log.warning("manager: couldn't write %s: %s", directory / PROM_NAME, e)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
