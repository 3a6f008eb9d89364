"""The requeue manager: keeps registered jobs training.

One loop, every ``tick_s``: a throttled poll (one ``sinfo --json`` + one ``squeue --json`` per
``poll_interval_s``, serving every job), the spool (strigger node events, SPANK fault records) and
each job's heartbeat files. Every observation is journaled (heartbeats when a rank's phase changes;
the newest step and heartbeat time go to the job's progress row), fed to the job incarnation's
``Confirmer``, and every change of verdict is journaled as a decision. What a recovery does next is
one state machine's (``policy/recovery.py``): the loop turns what it saw into the machine's
observations (a CONFIRMED verdict, Slurm's requeue or end of the life, the next life running, its
first step, a tick) and ``recovery.feed`` carries out the effects it returns. What the watched
job's life is (queued, running, requeued and settling, ended; its restart counts, nodes, verdict)
is another table's (``policy/watch_lifecycle.py``): the poll feeds it through ``_carry_out_life``,
and nothing else here changes it.

The runtime's exit codes are not failures: a rank whose last heartbeat says ``done`` (exit 0) or
``stopping`` (exit 75, checkpointed for requeue) never goes stale, a fault record with exit 0 or 75
is journaled but is no level-1 signal, and a job whose ranks all stopped for requeue but that Slurm
did not requeue is resubmitted as it was (while its ``max_requeues`` allows).
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_omni.config.site import SiteConfig
from slurm_omni.elastic.codes import EXIT_CHECKPOINTED, EXIT_DONE
from slurm_omni.errors import OmniError
from slurm_omni.manager import recovery
from slurm_omni.manager.actions import Actions
from slurm_omni.manager.context import ManagerConfig
from slurm_omni.manager.events import FaultRecord, HeartbeatRecord, NodeEvent, consume
from slurm_omni.manager.failslow import FailSlowWatch
from slurm_omni.manager.journal import ENDED_STATES, JOB_STATES, Journal
from slurm_omni.manager.registry import RegistryRecord, read_registry
from slurm_omni.manager.sources import Poller, SpoolItem, read_job_heartbeats, read_refusal, read_spool
from slurm_omni.manager.start_failures import StartFailures
from slurm_omni.manager.status import START_FAILURE_VERDICT as START_FAILURE
from slurm_omni.manager.status import write_timeline
from slurm_omni.manager.supervisor_reports import allocations_now, read_reports, read_status, supervised
from slurm_omni.manager.watch import Watch, live, new_watch, restore_watch
from slurm_omni.ownership import NotOwnedError, ensure_own_dir, user_folder
from slurm_omni.policy.bad_input import (
    BadInput,
    RankEnd,
    classify_end,
    job_label,
    never_beat,
    refused_by_rank,
)
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.confirm import NODE_STATE_KIND, Decision, NodeObservation, TaskExit, Verdict
from slurm_omni.policy.placement import plan_grow
from slurm_omni.policy.recovery import Phase
from slurm_omni.policy.recovery_events import (
    FailureConfirmed,
    GrowPossible,
    InputRefused,
    LifeEnded,
    LifeNumbered,
    LifeRequeued,
    LifeRunning,
    Tick,
    first_step_seen,
)
from slurm_omni.policy.supervision import supervisor_gone
from slurm_omni.policy.watch_lifecycle import (
    Ended,
    Gone,
    JobStateSet,
    Judged,
    Moved,
    NodesLost,
    NumberLife,
    Polled,
    Restarted,
    RestartSeen,
    Shown,
    StaleRecord,
    Started,
    StateChanged,
    TaskRecord,
)
from slurm_omni.policy.watch_lifecycle import Event as LifeEvent
from slurm_omni.slurm.backend import ClusterSnapshot, SlurmBackend
from slurm_omni.slurm.types import Job, JobState, Node
from slurm_omni.supervisor.outside import process_alive, read_process

log = logging.getLogger(__name__)

_ALIVE = frozenset({JobState.PENDING, JobState.RUNNING, JobState.SUSPENDED, JobState.REQUEUED})
_BUSY = frozenset({JobState.RUNNING, JobState.COMPLETING})
SUPERVISOR_RESTART_S = 10.0
"""Allocation mode: at most one new step supervisor per job this often (one that failed to start
is tried again after it)."""
SUPERVISOR_STALE_S = 30.0
"""Allocation mode: a supervisor on another host is taken as gone when its status file (rewritten
every node poll, 3 s) is this old."""
UNMATCHED_TTL_S = 120.0
"""A spool event that concerns none of the watched jobs stays this long before it is journaled
(under no job) and removed."""


def default_state_dir(site: SiteConfig, user: str | None = None) -> Path:
    """Beside the registry: ``/var/lib/slurm-omni/manager`` for the example site config; inside the
    user's own registry folder when ``registry_dir`` is per user (``{user}``)."""
    if "{user}" in str(site.manager.registry_dir):
        return site.manager.registry_for(user or user_name(os.geteuid())) / "manager"
    return site.manager.registry_dir.parent / "manager"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class Manager:
    def __init__(self, config: ManagerConfig, backend: SlurmBackend, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.backend = backend
        self.clock = clock
        self.uid = os.geteuid()
        self.user = user_name(self.uid)
        # the registry (when the state is in it) and the state folder, made 0700 and checked: a manager
        # that made its own registry 0755 refused it on every tick after
        below, registry = user_folder(config.site.manager.registry_dir, self.user)
        if config.state_dir.is_relative_to(registry):
            ensure_own_dir(registry, below=below, what="manager: registry", private=True)
        ensure_own_dir(config.state_dir, what="manager: state folder", private=True)
        self.journal = Journal(config.journal_path)
        self.poller = Poller(backend, config.poll_interval_s)
        self.actions = Actions(backend, config.site, config.state_dir)
        self.confirm_config = config.confirm_config()
        self.watches: dict[str, Watch] = {}
        self.failslow = FailSlowWatch(self)
        self._refused: set[str] = set()
        self.start_failures = StartFailures(self.journal)
        self._seen_shared: set[str] = set()   # node events read from <spool>/nodes (not ours to remove)
        self._timeline_dirty = True
        self._barrier_logged: dict[str, float] = {}
        self._supervisor_started: dict[str, float] = {}
        self._registry_refused = ""
        """The registry folder's refusal last logged (empty while it is usable)."""

    def close(self) -> None:
        self.journal.close()

    def crash(self, point: str) -> None:
        """The drills' fault injection: die here as SIGKILL would (no cleanup, nothing flushed)."""
        if self.config.crash_at == point:
            log.warning("manager: crash point %s reached: SIGKILL", point)
            os.kill(os.getpid(), signal.SIGKILL)

    def _say_what_carries_on(self) -> None:
        """A restarted manager names what its journal left open: the state machine resumes each
        recovery from the journal and re-emits its keyed actions, which perform_once finds done or
        does once."""
        open_ = self.journal.open_recoveries()
        pending = self.journal.pending_actions()
        if open_ or pending:
            log.info("manager: carrying on %d open recoveries (%s) and %d actions not known done (%s)",
                     len(open_), ", ".join(f"{r.job}/{r.incarnation}" for r in open_[:8]) or "-",
                     len(pending), ", ".join(f"{a.kind} {a.job}/{a.incarnation} {a.state}" for a in pending[:8]) or "-")

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        log.info("manager: watching %s as %s (poll every %.1fs)", self.config.site.manager.registry_for(self.user),
                 self.user, self.config.poll_interval_s)
        self._say_what_carries_on()
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.tick(force_poll=once)
            except (OmniError, OSError, sqlite3.Error) as e:   # the next tick tries again; the journal holds the rest
                log.error("manager: tick failed: %s", e)
            except Exception as e:  # noqa: BLE001 - a bug must not end the daemon that keeps every job alive
                self._barrier("", e)
            if once:
                return
            stop.wait(max(0.0, self.config.tick_s - (time.monotonic() - started)))

    def tick(self, *, force_poll: bool = False) -> None:
        snap = self.poller.poll(force=force_poll)
        now = self.clock()
        if snap is not None or not self.watches:
            self._sync_registry(now, snap)
        self._spool(now)
        nodes = {n.name: n for n in snap.nodes} if snap is not None else {}
        for w in list(self.watches.values()):
            if w.state in ENDED_STATES:
                continue
            try:
                if snap is not None:
                    self._observe_poll(w, snap, nodes, now)
                self._heartbeats(w, now)
                self._supervisor(w, now)
                self.start_failures.observe(w, self._label(w))
                self._decide(w, now, snap)
            except Exception as e:  # noqa: BLE001 - one job's trouble never stops the others; it retries next tick
                self._barrier(w.key, e)
        self._export_timeline()
        self.failslow.write_prom(now)

    def _barrier(self, key: str, error: Exception) -> None:
        """One line for an error that escaped the handling of ``key`` (or of the tick); the
        traceback at debug level, and the same line at most once a minute."""
        line = f"manager: couldn't handle {key or 'the tick'}: {type(error).__name__}: {error}"
        last = self._barrier_logged.get(line)
        mono = time.monotonic()
        if last is None or mono - last >= 60.0:
            self._barrier_logged[line] = mono
            log.error("%s", line[:500])
        log.debug("manager: traceback of %s", key or "the tick", exc_info=error)

    # -- registry -------------------------------------------------------------------------------
    def _sync_registry(self, now: float, snap: ClusterSnapshot | None) -> None:
        registry = self.config.site.manager.registry_for(self.user)
        try:
            records = read_registry(registry, uid=self.uid)
        except NotOwnedError as e:   # one line, again only when it changes; the watched jobs go on
            if str(e) != self._registry_refused:
                log.error("%s (jobs already watched are still handled; new ones wait)", e)
                self._registry_refused = str(e)
            return
        if self._registry_refused:
            log.info("manager: registry %s is usable again", registry)
            self._registry_refused = ""
        for reg in records:
            try:
                if reg.kind == "het":
                    self._ensure_watch(reg, None, reg.key, now)
                elif snap is not None:
                    for job in snap.jobs:
                        if job.array_job_id == reg.job_id and job.array_task_id is not None:
                            self._ensure_watch(reg, job, f"{reg.key}_{job.array_task_id}", now)
            except Exception as e:  # noqa: BLE001 - one registration's trouble never stops the others
                self._barrier(reg.key, e)

    def _ensure_watch(self, reg: RegistryRecord, task_job: Job | None, key: str, now: float) -> None:
        if key in self.watches:
            return
        known = {j["name"]: j for j in self.journal.jobs(self.uid, states=JOB_STATES)}
        if key in known:
            w = restore_watch(self, reg, key, task_job, known[key]["state"])
        else:
            self.journal.register_job(key, self.uid, reg.to_spec(), now)
            w = new_watch(self, reg, key, task_job)
        self.watches[key] = w
        log.info("manager: watching %s (Slurm job %s, incarnation %d, state %s)", key, w.slurm_id,
                 w.incarnation, w.state)

    # -- sources --------------------------------------------------------------------------------
    def _spool(self, now: float) -> None:
        items = read_spool(self.config.site.manager.spool_dir, self.user)
        followed = {w.key: self._allocation_now(w) for w in self.watches.values()
                    if w.state not in ENDED_STATES} if items else {}
        for item in items:
            if item.shared and item.key in self._seen_shared:
                continue
            matched = False
            for w in self.watches.values():
                if w.state in ENDED_STATES or not (item.concerns(w.slurm_id, w.node_set) or item.concerns(
                        followed.get(w.key), frozenset())):   # a task's fault record in a successor allocation
                    continue
                matched = True
                try:
                    self._observe_event(w, item)
                except Exception as e:  # noqa: BLE001 - as for the per-job barrier in tick()
                    self._barrier(w.key, e)
            if not matched:
                if now - item.event.time < UNMATCHED_TTL_S:
                    continue   # maybe a job registered a moment from now; others' tools may read it too
                self.journal.record_observation("", None, _kind(item), item.event.time, item.event, key=item.key)
            if item.shared:
                self._seen_shared.add(item.key)
            else:
                consume(item.path)
        self._seen_shared &= {item.key for item in items if item.shared}   # the trigger program prunes old ones

    def _observe_event(self, w: Watch, item: SpoolItem) -> None:
        event = item.event
        fresh = self.journal.record_observation(w.key, w.incarnation, _kind(item), event.time, event,
                                                key=f"{item.key}:{w.key}")
        if not fresh:
            return
        if isinstance(event, NodeEvent):
            w.confirmer.observe_all(event.observations())
        elif isinstance(event, FaultRecord):
            if event.signal is None and event.exit_code in (EXIT_DONE, EXIT_CHECKPOINTED):
                return   # the runtime's own "done" / "checkpointed for requeue": not a fault
            for effect in live(w, TaskRecord(step_id=event.step_id), self.clock()):
                if isinstance(effect, StaleRecord):
                    log.info("manager: %s: a task of step %d.%d (an earlier launch) exited on %s after the "
                             "relaunch: not counted against launch %s", w.key, event.job_id, event.step_id,
                             event.node, effect.launch)
                    return
            w.confirmer.observe(TaskExit(event.time, event.node, event.het_offset if w.array_task is None else 0,
                                         event.task_id, event.exit_code, event.signal))

    def _heartbeats(self, w: Watch, now: float) -> None:
        if w.slurm_id is None or w.expect_restart:   # a requeued array task: its next life's beats come
            return                                     # with the restart count Slurm has not shown yet
        beats = self._judged_beats(w)
        refused = refused_by_rank(self._label(w), [_rank_end(hb) for hb in beats]) if w.recovery.judging else None
        if refused is not None:
            at = max(hb.time for hb in beats if hb.exit_code is not None)
            recovery.feed(self, w, InputRefused(at=at, cause=refused.cause, line=refused.line), now)
            return
        if not beats:
            self._first_heartbeat_due(w, now)
        for hb in beats:
            if w.phases.get(hb.rank) != hb.phase:
                w.phases[hb.rank] = hb.phase
                self.journal.record_observation(w.key, w.incarnation, "heartbeat_phase", hb.time, hb,
                                                key=f"hb:{w.key}:{w.slurm_id}:{hb.incarnation}:{hb.rank}:{hb.phase}")
            w.confirmer.observe(hb.observation(het_job=w.array_task is None))
        first = first_step_seen(beats, w.restore_step) if w.awaiting is not None else None
        if first is not None:
            recovery.feed(self, w, first, now)
        self.failslow.observe(w, beats, now)
        if beats:
            progress = (max(hb.step for hb in beats),
                        max((hb.last_checkpoint_step for hb in beats if hb.last_checkpoint_step is not None),
                            default=None),
                        max(hb.time for hb in beats))
            # the progress row is for `omni status`: at most one write per poll interval per job
            if progress != w.progress and now - w.progress_written >= max(1.0, self.config.poll_interval_s):
                w.progress = progress
                w.progress_written = now
                self.journal.update_progress(w.key, global_step=progress[0], last_checkpoint_step=progress[1],
                                             heartbeat_at=progress[2],
                                             progress_at=w.confirmer.evaluate(now).last_progress_at)

    # -- bad input (policy/bad_input.py): no restart can fix it -----------------------------------
    def _label(self, w: Watch) -> str:
        return job_label(w.slurm_id, w.reg.name if w.array_task is None else f"{w.reg.name}, task {w.array_task}")

    def _judged_beats(self, w: Watch) -> list[HeartbeatRecord]:
        """The judged life's heartbeats as the folder holds them now."""
        if w.slurm_id is None:
            return []
        judged = w.judged_incarnation
        return [hb for hb in read_job_heartbeats(w.heartbeat_dir, w.slurm_id, w.scanner) if hb.incarnation == judged]

    def _ever_beat(self, w: Watch) -> bool:
        """Some life of the job wrote a heartbeat (the journal keeps every phase change)."""
        return bool(w.phases) or self.journal.has_observation(w.key, "heartbeat_phase")

    def _first_heartbeat_due(self, w: Watch, now: float) -> None:
        """A running life without a heartbeat: past ``detection.first_heartbeat_s``, and no life of
        the job ever beat, its command never calls elastic.init: cancel it, do not restart it."""
        if not w.running or w.life.running_since is None or w.life.ended or w.slurm_id is None or not w.recovery.judging:
            return
        limit = self.config.site.detection.first_heartbeat_s
        running_for = now - w.life.running_since
        if running_for < limit:
            return
        bad = never_beat(label=self._label(w), running_for_s=running_for, limit_s=limit, beats=0,
                         ever_beat=self._ever_beat(w))
        if bad is not None:
            recovery.feed(self, w, InputRefused(at=now, cause=bad.cause, line=bad.line, cancel=w.slurm_id), now)

    def _bad_end(self, w: Watch, job: Job | None) -> BadInput | None:
        """How the judged life ended, read again now (the last heartbeats of the Slurm job's newest
        life: a step supervisor may have relaunched it since the manager last looked; the batch
        script's refusal), when that is bad input."""
        if w.slurm_id is None:
            return None
        # the supervisor's own stop (it saw no node of the launch lost) is final; otherwise a start
        # failure counts only when no node was lost
        repeated = self.start_failures.stopped(w, self._label(w)) or (None if w.lost_kinds() else
                                                      self.start_failures.repeated(w, self._label(w)))
        if repeated is not None:
            return repeated
        judged = w.judged_incarnation
        beats = [hb for hb in read_job_heartbeats(w.heartbeat_dir, w.slurm_id, w.scanner) if hb.incarnation >= judged]
        newest = max((hb.incarnation for hb in beats), default=judged)
        bad = classify_end(label=self._label(w),
                            completed=job is not None and job.state is JobState.COMPLETED,
                            cancelled=job is not None and job.state is JobState.CANCELLED,
                            lost=bool(w.lost_kinds()),
                            ranks=[_rank_end(hb) for hb in beats if hb.incarnation == newest],
                            max_steps=w.max_steps, refusal=read_refusal(w.heartbeat_dir, w.slurm_id, judged),
                            ever_beat=self._ever_beat(w), slurm_state=job.slurm_state if job is not None else "",
                            output=str(w.output(w.slurm_id) or ""))
        if bad is not None and bad.cause == "no_heartbeat" and self.start_failures.of_judged(w) is not None:
            return None   # it failed at start with a line: one more life, and a second such failure stops it
        return bad

    def _supervisor(self, w: Watch, now: float) -> None:
        """A step supervisor in the job's allocation (its status file is there): its failures are
        its own to handle first, and its reports move the recovery (docs/recovery.md)."""
        if w.slurm_id is None or w.array_task is not None:
            return
        present = supervised(w.reg.ckpt_dir, w.slurm_id)
        if present != w.recovery_config.supervised:
            w.recovery_config = replace(w.recovery_config, supervised=present)
            log.info("manager: %s: Slurm job %d %s a step supervisor", w.key, w.slurm_id,
                     "has" if present else "no longer has")
        self._keep_supervisor(w, now)
        if not present:
            return
        for report in read_reports(w.reg.ckpt_dir, w.slurm_id):
            # a node the job lost is never used again by it
            live(w, NodesLost(nodes=tuple(report.failed_nodes), seconds=w.placement.quarantine_s), now)
            recovery.feed(self, w, report.observation, now)

    def _keep_supervisor(self, w: Watch, now: float) -> None:
        """Allocation mode (the supervisor runs outside the allocation, its process record is there):
        start a new supervisor when the last one is gone while its allocation runs; it picks up what
        its predecessor journaled (docs/allocation-mode.md)."""
        if w.slurm_id is None or w.state in ENDED_STATES:
            return
        record = read_process(w.reg.ckpt_dir, str(w.slurm_id))
        if record is None or now - self._supervisor_started.get(w.key, 0.0) < SUPERVISOR_RESTART_S:
            return
        status = read_status(w.reg.ckpt_dir, w.slurm_id)
        if not supervisor_gone(phase=status.phase if status else "launching", job_state=w.life.slurm_state,
                               alive=process_alive(record),
                               status_age_s=now - status.updated_at if status else None,
                               stale_after_s=SUPERVISOR_STALE_S):
            return
        self._supervisor_started[w.key] = now
        try:
            pid = self.actions.start_supervisor(w.reg, w.slurm_id)
        except OmniError as e:
            log.error("manager: %s: couldn't start a new step supervisor: %s", w.key, e)
            return
        self.journal.record_decision(w.key, w.incarnation, now, "supervisor_started", "supervisor_gone",
                                     {"slurm_job_id": w.slurm_id, "pid": pid, "was": {"host": record.host,
                                                                                       "pid": record.pid}})
        log.warning("manager: %s: the step supervisor of Slurm job %d (pid %d on %s) is gone; started another "
                    "(pid %d)", w.key, w.slurm_id, record.pid, record.host, pid)

    def _observe_poll(self, w: Watch, snap: ClusterSnapshot, nodes: dict[str, Node], now: float) -> None:
        """What the poll shows of the job, fed to its life's table in order: its first sight, its
        nodes' states (the confirmer's), its restart count (a requeue is the recovery's to judge),
        then its state; the daemon carries out what the table returns."""
        if w.slurm_id is None:
            return
        self._bury(w, snap)
        followed = self._allocation_now(w)
        job = snap.job(followed)
        if job is None:
            if w.slurm_id in snap.unreadable_jobs:
                return   # Slurm listed it but its record could not be read this poll: no news, not gone
            self._carry_out_life(w, Gone(at=snap.taken_at), job, now)
            return
        if job.user != self.user:
            if w.key not in self._refused:
                self._refused.add(w.key)
                self.journal.record_decision(w.key, w.incarnation, now, "refused", "foreign_job",
                                             {"slurm_user": job.user, "manager_user": self.user})
                log.error("manager: couldn't act on %s: Slurm job %s belongs to %s, not %s", w.key,
                          w.slurm_id, job.user, self.user)
            live(w, JobStateSet(state="failed"), now)
            return
        self._carry_out_life(w, Shown(at=snap.taken_at, restart_count=job.restart_count,
                                      expect_restart=w.expect_restart,
                                      numbered_by_restart=w.array_task is not None and not w.recovery.open), job, now)
        for name in w.node_set:
            node = nodes.get(name)
            if node is None or w.node_states.get(name) == node.state:
                continue
            w.node_states[name] = node.state
            obs = NodeObservation(snap.taken_at, name, node.state, node.reason)
            self.journal.record_observation(w.key, w.incarnation, "node_state", snap.taken_at, obs)
            w.confirmer.observe(obs)
        job_nodes = {c.het_offset: c.nodes for c in job.components} if w.array_task is None else {0: job.nodes}
        if followed != w.slurm_id:   # moved to a successor allocation: confirmation starts over on its nodes
            before = w.node_set
            self._carry_out_life(w, Moved(at=snap.taken_at, running=job.state is JobState.RUNNING,
                                          batch_host=job.batch_host, nodes=job_nodes), job, now)
            if w.node_set != before:
                log.warning("manager: %s runs in allocation %d now (after Slurm job %d)", w.key, followed, w.slurm_id)
        requeued = self._carry_out_life(w, RestartSeen(at=snap.taken_at, restart_count=job.restart_count), job, now)
        if requeued and (not w.recovery.judging or w.slurm_id != job.job_id):
            return   # a recovery started (and may have switched to the next incarnation)
        self._carry_out_life(w, Polled(
            at=snap.taken_at, slurm_state=job.slurm_state, running=job.state is JobState.RUNNING,
            finished=job.state.finished, restart_count=job.restart_count, batch_host=job.batch_host,
            nodes=job_nodes), job, now)

    def _carry_out_life(self, w: Watch, event: LifeEvent, job: Job | None, now: float) -> bool:
        """Step ``w``'s life with what the poll showed and carry out the effects; whether there were any."""
        effects = live(w, event, now)
        for e in effects:
            if isinstance(e, NumberLife):
                recovery.feed(self, w, LifeNumbered(incarnation=e.incarnation), now)
            elif isinstance(e, Restarted) and job is not None:
                self._restarted(w, job, e.at)
            elif isinstance(e, StateChanged) and job is not None:
                self.journal.record_observation(w.key, w.incarnation, "job_state", e.at,
                                                {"slurm_job_id": w.slurm_id, "state": e.slurm_state,
                                                 "reason": job.reason, "restart_count": job.restart_count})
            elif isinstance(e, Started):
                self.journal.add_incarnation(w.key, w.incarnation, {
                    "units": w.units, "data_parallel_size": w.shape.data_parallel_size_for(w.units),
                    "nodes": {str(k): list(v) for k, v in w.nodes.items()}, "restore_step": w.restore_step})
                self.journal.set_incarnation(w.key, w.incarnation, slurm_job_id=str(w.slurm_id), started_at=e.at)
                if w.awaiting is not None:
                    recovery.feed(self, w, LifeRunning(at=e.at), now)
            elif isinstance(e, Ended):
                self._ended(w, job, e.at)
        return bool(effects)

    def _allocation_now(self, w: Watch) -> int:
        """The Slurm job the watched life runs in: in allocation mode its supervisor may have moved it
        to a successor allocation at a time limit (the status file says which); else its own."""
        if w.slurm_id is None or not supervised(w.reg.ckpt_dir, w.slurm_id):
            return w.slurm_id or 0
        return allocations_now(w.reg.ckpt_dir, w.slurm_id)[0]

    def _bury(self, w: Watch, snap: ClusterSnapshot) -> None:
        """An ended incarnation that came back (its batch script requeues itself when scancel's
        SIGTERM makes the ranks checkpoint and exit 75) would train beside its successor into the
        same checkpoints: cancel it again."""
        for old_id in w.life.ended_ids:
            job = snap.job(old_id)
            if job is None or job.state not in _ALIVE or job.user != self.user:
                continue
            self.journal.record_observation(w.key, w.incarnation, "ended_incarnation_back", snap.taken_at,
                                            {"slurm_job_id": old_id, "state": job.slurm_state})
            log.warning("manager: %s: ended Slurm job %d is %s again; cancelling it", w.key, old_id, job.slurm_state)
            try:
                self.actions.cancel(old_id)
            except OmniError as e:
                log.error("%s", e)

    def _restarted(self, w: Watch, job: Job, at: float) -> None:
        """Slurm requeued the job (same id, restart count + 1); the state machine says what it means."""
        self._last_words(w)
        if w.state in ENDED_STATES:   # its last words refused its input
            return
        quiet = w.quiet
        lost = w.lost_kinds()
        self.journal.record_observation(w.key, w.incarnation, "requeued", at,
                                        {"restart_count": job.restart_count, "checkpointed": quiet,
                                         "lost_nodes": sorted(lost)})
        recovery.feed(self, w, LifeRequeued(at=at, restart_count=job.restart_count, quiet=quiet, lost=lost,
                                            reason=job.reason or job.slurm_state), self.clock())

    def _last_words(self, w: Watch) -> None:
        """Read the ending life's heartbeats again before judging its end: a tick reads them after
        the poll, and a rank that wrote "stopping" or "done" and exited at once (omni train leaves
        without the interpreter's teardown) can be requeued or gone by the next poll."""
        try:
            self._heartbeats(w, self.clock())
        except OmniError as e:
            log.warning("manager: %s: couldn't read the last heartbeats: %s", w.key, e)

    def _ended(self, w: Watch, job: Job | None, at: float) -> None:
        self._last_words(w)
        if w.state in ENDED_STATES:
            return
        bad = self._bad_end(w, job) if w.recovery.judging and not w.recovery.life_ended else None
        if bad is not None:
            recovery.feed(self, w, InputRefused(at=at, cause=bad.cause, line=bad.line), self.clock())
            return
        if (w.recovery.judging and not w.recovery.life_ended and w.array_task is None
                and not (job is not None and job.state in (JobState.CANCELLED, JobState.COMPLETED))
                and not w.lost_kinds() and self.start_failures.of_judged(w) is not None):
            # the first failure before a heartbeat: a failure like any other (no node to blame), one more life
            decision = Decision(Verdict.CONFIRMED, at, cause=START_FAILURE, nodes=())
            recovery.feed(self, w, FailureConfirmed(decision=decision, lost={}), self.clock())
            return
        phases = set(w.phases.values())
        recovery.feed(self, w, LifeEnded(
            at=at, slurm_state=job.slurm_state if job is not None else "",
            completed=(job is not None and job.state is JobState.COMPLETED) or phases == {"done"},
            cancelled=job is not None and job.state is JobState.CANCELLED, quiet=w.quiet, trained=bool(phases),
            restart_count=w.life.restart_count, lost=w.lost_kinds()), self.clock())

    # -- decisions ------------------------------------------------------------------------------
    def _decide(self, w: Watch, now: float, snap: ClusterSnapshot | None) -> None:
        """A tick of the recovery (its bounded waits, its outstanding steps); then, while the life is
        judged, the confirmer's verdict, and a grow when a shrunk job's nodes came back."""
        recovery.feed(self, w, self._tick(w), now)
        if not w.recovery.judging or w.state in ENDED_STATES:
            return
        decision = w.confirmer.evaluate(now)
        if live(w, Judged(verdict=decision.verdict), now):   # a new verdict (RecordVerdict)
            self.journal.record_decision(w.key, w.incarnation, now, decision.verdict.value, decision.cause, decision)
        if decision.verdict is Verdict.CONFIRMED:
            recovery.feed(self, w, FailureConfirmed(decision=decision, lost=self._lost_now(w)), now)
        elif (snap is not None and self.config.grow and decision.verdict is Verdict.NONE and w.running
              and w.recovery.phase is Phase.WATCHING and w.array_task is None and w.nodes
              and w.units < w.shape.units):
            index = ClusterIndex.build(snap.topology, snap.nodes)
            plan = plan_grow(index, w.layout(), now=now, quarantine=w.quarantine, config=w.placement)
            if plan is not None:
                recovery.feed(self, w, GrowPossible(at=now, plan=plan), now)

    def _tick(self, w: Watch) -> Tick:
        """The judged life now; while a recovery waits for the old life to stop, whether a poll taken
        since the wait began shows it no longer RUNNING or COMPLETING."""
        s, snap = w.recovery, self.poller.last
        stopped, state = None, ""
        if s.phase is Phase.STOPPING and s.slurm_job_id is not None and snap is not None:
            job = snap.job(s.slurm_job_id)
            state = job.slurm_state if job is not None else ""
            if s.since is not None and snap.taken_at >= s.since:
                stopped = job is None or not any(st in _BUSY for st in (job.state, *(c.state for c in job.components)))
        lost = w.lost_kinds()
        return Tick(quiet=w.quiet, running=w.running and not w.life.ended, ended=w.life.ended, stopped=stopped,
                    state=state, lost=lost, batch_host_lost=w.life.batch_host if w.life.batch_host in lost else "")

    def _lost_now(self, w: Watch) -> dict[str, str]:
        """Nodes of the life that a poll taken now shows failed, with their kind: tasks that died on
        them are a node failure (policy/recovery.root_cause)."""
        snap = self.poller.poll(force=True) or self.poller.last
        if snap is None or not w.nodes:
            return {}
        mine = w.node_set
        return {n.name: NODE_STATE_KIND[n.state] for n in snap.nodes if n.name in mine and n.state in NODE_STATE_KIND}

    def mark_phase(self, job: str, incarnation: int, phase: str, at: float, **extra: Any) -> None:
        """Journal a phase of a recovery timeline; the timeline file follows within the tick."""
        self.journal.mark_phase(job, incarnation, phase, at, **extra)
        self._timeline_dirty = True

    def _export_timeline(self) -> None:
        if self._timeline_dirty:
            write_timeline(self.journal, self.uid, self.config.timeline_path)
            self._timeline_dirty = False


def _rank_end(hb: HeartbeatRecord) -> RankEnd:
    return RankEnd(rank=hb.rank, phase=hb.phase, step=hb.step, exit_code=hb.exit_code, error=hb.error)


def _kind(item: SpoolItem) -> str:
    return f"node_{item.event.kind}" if isinstance(item.event, NodeEvent) else "task_exit"
