"""What the manager keeps in memory per watched job (or array task), and how it is rebuilt from
the journal after a restart: the current incarnation, its Slurm job id, nodes and confirmer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_omni.config.job import JobFile, load_job
from slurm_omni.errors import OmniError
from slurm_omni.manager.context import ManagerContext
from slurm_omni.manager.events import HeartbeatScanner
from slurm_omni.manager.journal import Journal, Recovery
from slurm_omni.manager.registry import HEARTBEAT_SUBDIR, RegistryRecord
from slurm_omni.manager.shape import Shape
from slurm_omni.policy.confirm import NODE_STATE_KIND, QUIET_PHASES, Confirmer, TaskExit, Verdict
from slurm_omni.policy.in_allocation import REQUEUE_INCARNATION_STRIDE
from slurm_omni.policy.placement import Action, ComponentPlan, JobLayout, PlacementConfig, Plan, Quarantine
from slurm_omni.policy.recovery import RecoveryConfig, RecoveryState, Replayed, initial, resume
from slurm_omni.policy.recovery_events import RecoveryPath
from slurm_omni.slurm.types import Job, NodeState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Watch:
    key: str
    reg: RegistryRecord
    shape: Shape
    placement: PlacementConfig
    confirmer: Confirmer
    heartbeat_dir: Path
    incarnation: int
    """The journal's incarnation of the Slurm job watched now (its rows, decisions, recoveries): a
    submission's OMNI_INCARNATION base. What the ranks carry, and what is judged, is
    :attr:`judged_incarnation` (it adds Slurm's requeues and the supervisor's relaunches)."""
    slurm_id: int | None
    units: int
    array_task: int | None = None
    state: str = "active"                    # active, waiting, done, failed (the journal's job state)
    nodes: dict[int, tuple[str, ...]] = field(default_factory=dict)   # het offset -> nodes, once running
    restart_count: int = 0                   # the requeue whose heartbeats are judged (SLURM_RESTART_COUNT)
    slurm_restart_count: int = 0             # the newest restart count Slurm reported
    running_restart_count: int = 0           # the newest restart count Slurm showed RUNNING
    running: bool = False
    seen_in_slurm: bool = False
    slurm_state: str = ""
    verdict: Verdict = Verdict.NONE
    node_states: dict[str, NodeState] = field(default_factory=dict)
    phases: dict[int, str] = field(default_factory=dict)        # rank -> last heartbeat phase
    progress: tuple[Any, ...] = ()
    progress_written: float = float("-inf")  # when the progress row was last written (manager clock)
    quarantine: Quarantine = field(default_factory=Quarantine)
    restore_step: int | None = None          # newest complete checkpoint when this incarnation was submitted
    recovery: RecoveryState = field(default_factory=lambda: initial(0, None))   # set by new_watch
    recovery_config: RecoveryConfig = field(default_factory=RecoveryConfig)
    slurm_ended: bool = False                # the newest poll showed the job ended (or no longer showed it)
    ended_ids: set[int] = field(default_factory=set)   # Slurm ids of earlier incarnations: must stay gone
    last_plan_poll: int = -1                 # the poll a waiting plan was last made from
    requeue_settling: bool = False           # requeued: Slurm may still show the old life's end state
    allocation_base: int | None = None       # in-allocation: the submission's incarnation (None: incarnation)
    scanner: HeartbeatScanner = field(default_factory=HeartbeatScanner)   # reads only the beats that changed
    relaunched_incarnation: int | None = None   # in-allocation: the supervisor's last relaunch, this requeue
    step_id_max: int = -1                    # the highest step id of this Slurm job's fault records, this requeue
    stale_step_max: int = -1                 # in-allocation: fault records of steps up to it belong to earlier launches
    batch_host: str = ""                     # the incarnation's batch host, once running
    running_since: float | None = None       # when a poll first showed the judged life RUNNING
    max_steps: int | None = None             # the job file's [training] max_steps (None: unreadable)
    log_dir: Path | None = None              # the job file's [job] log_dir (None: unreadable)

    def output(self, slurm_id: int) -> Path | None:
        """The batch script's output file of Slurm job ``slurm_id`` (``--output=<log_dir>/%x-%j.out``);
        None for a sweep's task or an unreadable job file."""
        if self.log_dir is None or self.array_task is not None:
            return None
        return self.log_dir / f"{self.reg.name}-{slurm_id}.out"

    @property
    def node_set(self) -> frozenset[str]:
        return frozenset(n for nodes in self.nodes.values() for n in nodes)

    @property
    def awaiting(self) -> int | None:
        """The failed incarnation whose timeline waits for this one's running and first step."""
        return self.recovery.awaiting

    @property
    def expect_restart(self) -> bool:
        """An array task the manager requeued, before Slurm shows its next life."""
        return self.recovery.expect_restart

    @property
    def quiet(self) -> bool:
        """Every rank reported, and each said it is stopping or done."""
        return bool(self.phases) and set(self.phases.values()) <= QUIET_PHASES

    @property
    def judged_incarnation(self) -> int:
        """The OMNI_INCARNATION being judged (what its ranks' heartbeats and metrics carry): a
        submission's first is its :attr:`incarnation`, and each of Slurm's requeues adds one (in the
        allocation: :meth:`allocation_incarnation`). An array task's are its restart counts, past the
        task's base."""
        if self.array_task is not None:
            base = next((t.incarnation_base for t in self.reg.tasks if t.task_id == self.array_task), 0)
            return base + self.restart_count
        if self.recovery_config.supervised:
            return self.allocation_incarnation(self.restart_count)
        return self.incarnation + self.restart_count

    def allocation_incarnation(self, restart_count: int) -> int:
        """An in-allocation job's incarnation: the one the supervisor last reported relaunching in this
        allocation, else launch 0 after ``restart_count`` requeues (``inalloc.sbatch.j2``: base +
        REQUEUE_INCARNATION_STRIDE x SLURM_RESTART_COUNT)."""
        if self.relaunched_incarnation is not None and restart_count == self.restart_count:
            return self.relaunched_incarnation
        base = self.incarnation if self.allocation_base is None else self.allocation_base
        return base + REQUEUE_INCARNATION_STRIDE * restart_count

    def lost_nodes(self) -> tuple[str, ...]:
        """Nodes of the incarnation that the newest poll showed failed (DOWN, FAIL, DRAIN...)."""
        return tuple(sorted(n for n, state in self.node_states.items() if state.failed and n in self.node_set))

    def lost_kinds(self) -> dict[str, str]:
        """The lost nodes, each with its kind of failure (the recovery's cause)."""
        return {n: NODE_STATE_KIND.get(self.node_states[n], "down") for n in self.lost_nodes()}

    def close(self, journal: Journal, state: str, at: float, reason: str) -> None:
        """The job's last incarnation ended for good (``state``: done, cancelled or failed)."""
        self.state = state
        journal.set_incarnation(self.key, self.incarnation, ended_at=at, end_reason=reason)
        journal.set_job_state(self.key, state)
        if state == "done":
            log.info("manager: %s finished training", self.key)
        elif state == "cancelled":
            log.warning("manager: %s was cancelled in Slurm; not resubmitting", self.key)
        else:
            log.error("manager: %s: %s; not resubmitting", self.key, reason)

    def layout(self) -> JobLayout:
        return self.shape.layout(self.nodes, self.units)

    def started(self, job: Job, at: float) -> None:
        """The incarnation is RUNNING: its nodes are known; confirmation starts over on them."""
        self.running = True
        self.batch_host = job.batch_host
        self.running_since = at
        if self.array_task is None:
            self.nodes = {c.het_offset: c.nodes for c in job.components}
        else:
            self.nodes = {0: job.nodes}
        self.confirmer.reset({k: list(v) for k, v in self.nodes.items()})
        self.node_states.clear()

    def requeued(self) -> None:
        """Slurm requeued the job after a checkpointed exit: the same Slurm job (the same journal
        incarnation) runs again; the judged incarnation moves on with its restart count."""
        self.running = False
        self.running_since = None
        self.requeue_settling = True
        self.relaunched_incarnation = None      # the requeued allocation's supervisor starts again at launch 0
        self.step_id_max = self.stale_step_max = -1   # and Slurm numbers its steps from 0 again
        self.phases.clear()
        self.confirmer.reset({k: list(v) for k, v in self.nodes.items()})
        self.verdict = Verdict.NONE

    def fail_all(self, at: float, why: str) -> None:
        """Slurm says the incarnation ended badly: a level-1 signal on every node of the job (it agrees
        with whichever rank goes stale)."""
        log.info("manager: %s incarnation %d: %s", self.key, self.incarnation, why)
        for offset, nodes in self.nodes.items():
            for node in nodes:
                self.confirmer.observe(TaskExit(at, node, offset, -1, 1, None))

    def relaunched(self, incarnation: int) -> None:
        """The step supervisor relaunched inside the allocation: the same Slurm job, OMNI_INCARNATION
        ``incarnation``, journaled as an incarnation of its own: it is the watch's journal incarnation
        too (after a requeue it was set to ``incarnation - restart_count``, a number no row has, and
        the next resubmission took ``incarnation`` again)."""
        self.incarnation = incarnation
        self.relaunched_incarnation = incarnation
        # the killed step's ranks report their exits after the relaunch (slurmstepd is slow to reap them):
        # its records must not count against the new launch, whose step has a higher id
        self.stale_step_max = self.step_id_max
        self.phases.clear()
        self.confirmer.reset({k: list(v) for k, v in self.nodes.items()})
        self.verdict = Verdict.NONE

    def switch_to(self, incarnation: int, slurm_id: int, units: int, *, restore_step: int | None,
                  quarantine: Quarantine) -> None:
        """The next incarnation was submitted: watch it instead (the recovery goes on judging it)."""
        if self.slurm_id is not None:
            self.ended_ids.add(self.slurm_id)
        self.incarnation, self.slurm_id, self.units = incarnation, slurm_id, units
        self.allocation_base, self.relaunched_incarnation = incarnation, None
        self.step_id_max = self.stale_step_max = -1
        self.restore_step, self.quarantine = restore_step, quarantine
        self.nodes = {}
        self.batch_host = ""
        self.restart_count = self.slurm_restart_count = self.running_restart_count = 0
        self.running = self.seen_in_slurm = self.slurm_ended = False
        self.running_since = None
        self.slurm_state = ""
        self.phases.clear()
        self.node_states.clear()
        self.confirmer.reset({})
        self.verdict = Verdict.NONE
        self.requeue_settling = False
        self.state = "active"


def _job_file(reg: RegistryRecord, path: Path) -> JobFile | None:
    try:
        return load_job(path)
    except OmniError as e:
        log.warning("manager: %s: %s (planning without the global batch constraint)", reg.key, e)
        return None


def new_watch(m: ManagerContext, reg: RegistryRecord, key: str, task_job: Job | None) -> Watch:
    """A job seen for the first time; its incarnation 0 is journaled once it runs (with its nodes)."""
    shape = Shape(reg.stages, reg.data_parallel_size)
    if task_job is None:
        heartbeat_dir = reg.heartbeat_dir
        slurm_id = reg.job_id
        task = None
    else:
        task = task_job.array_task_id
        ckpt = next((t.ckpt_dir for t in reg.tasks if t.task_id == task), reg.ckpt_dir)
        heartbeat_dir = ckpt / HEARTBEAT_SUBDIR
        slurm_id = task_job.job_id
    incarnation = reg.incarnation_base if task is None else 0
    config = RecoveryConfig(same_job=task is not None, end_wait_s=m.config.end_wait_s,
                            stop_timeout_s=m.config.stop_timeout_s, max_requeues=reg.max_requeues)
    job = _job_file(reg, next((t.job_file for t in reg.tasks if t.task_id == task), None) or reg.job_file)
    return Watch(key=key, reg=reg, shape=shape, placement=shape.placement_config(m.config.site, job),
                 max_steps=job.training.max_steps if job is not None else None,
                 log_dir=job.job.log_dir if job is not None else None,
                 confirmer=Confirmer(m.confirm_config, {}), heartbeat_dir=heartbeat_dir, incarnation=incarnation,
                 slurm_id=slurm_id, units=shape.units, array_task=task, recovery=initial(incarnation, slurm_id),
                 allocation_base=incarnation,
                 recovery_config=config)


def restore_watch(m: ManagerContext, reg: RegistryRecord, key: str, task_job: Job | None, state: str) -> Watch:
    """Rebuild after a restart: the newest incarnation with a Slurm job id, its open recovery."""
    w = new_watch(m, reg, key, task_job)
    w.state = state
    incarnations = [i for i in m.journal.incarnations(key) if i["slurm_job_id"]]
    if incarnations and w.array_task is None:
        cur = incarnations[-1]
        w.ended_ids = {int(i["slurm_job_id"]) for i in incarnations[:-1]}
        layout = cur["layout"] or {}
        w.incarnation, w.slurm_id = cur["number"], int(cur["slurm_job_id"])
        w.allocation_base = min(int(i["number"]) for i in incarnations if i["slurm_job_id"] == cur["slurm_job_id"])
        if layout.get("in_allocation"):
            w.relaunched_incarnation = int(cur["number"])
        w.units = int(layout.get("units") or w.units)
        w.restore_step = layout.get("restore_step")
    recoveries = m.journal.recoveries(key)
    for rec in recoveries:
        if rec.plan and isinstance(rec.plan.get("quarantine"), dict):
            until = rec.plan["quarantine"].get("until") or {}
            w.quarantine = Quarantine({str(k): float(v) for k, v in until.items()})
    w.recovery = resume(w.incarnation, w.slurm_id, [replayed(rec) for rec in recoveries], m.clock(),
                        w.recovery_config)
    if w.array_task is not None and w.recovery.open:   # an array task's incarnations are its restart counts
        w.incarnation = w.recovery.incarnation
    return w


def replayed(rec: Recovery) -> Replayed:
    """A journaled recovery as the state machine's ``resume`` reads it."""
    return Replayed(incarnation=rec.incarnation, path=RecoveryPath(rec.path) if rec.path else None, cause=rec.cause,
                    nodes=rec.nodes, confirmed_at=rec.times["confirmed"], resubmitted_at=rec.times["resubmitted"],
                    running_at=rec.times["running"], first_step_at=rec.times["first_step"],
                    new_incarnation=rec.new_incarnation, plan=plan_from_json(rec.plan) if rec.plan else None)


def plan_from_json(obj: dict[str, Any]) -> Plan:
    """A plan as ``journal.to_json`` stored it (``units``; a journal written before the rename says
    ``data_parallel_size`` for the same count of placement units)."""
    until = (obj.get("quarantine") or {}).get("until") or {}
    return Plan(Action(obj["action"]), int(obj["units"] if "units" in obj else obj["data_parallel_size"]),
                tuple(ComponentPlan(int(c["het_offset"]), tuple(c["nodes"]), tuple(c["added"]), tuple(c["removed"]),
                                    int(c.get("leaf_switches") or 0))
                      for c in obj.get("components") or ()),
                exclude=tuple(obj.get("exclude") or ()), drain=tuple((n, r) for n, r in obj.get("drain") or ()),
                quarantine=Quarantine({str(k): float(v) for k, v in until.items()}),
                wait_until=obj.get("wait_until"), reasons=tuple(obj.get("reasons") or ()))
