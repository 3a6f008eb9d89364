"""What the manager keeps in memory per watched job (or array task), and how it is rebuilt from
the journal after a restart: the job's configuration and observers (confirmer, heartbeat scanner),
its life (``policy/watch_lifecycle.py``: the incarnation, its Slurm job id, restart counts, nodes)
and its recovery (``policy/recovery.py``), each changed only through its table."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slurm_omni.config.job import JobFile, load_job
from slurm_omni.errors import OmniError
from slurm_omni.manager.context import ManagerContext
from slurm_omni.manager.events import HeartbeatScanner
from slurm_omni.manager.journal import Recovery
from slurm_omni.manager.registry import HEARTBEAT_SUBDIR, RegistryRecord
from slurm_omni.manager.shape import Shape
from slurm_omni.policy.confirm import NODE_STATE_KIND, QUIET_PHASES, Confirmer
from slurm_omni.policy.placement import Action, ComponentPlan, JobLayout, PlacementConfig, Plan, Quarantine
from slurm_omni.policy.recovery import RecoveryConfig, RecoveryState, Replayed, initial, resume
from slurm_omni.policy.recovery_events import RecoveryPath
from slurm_omni.policy.watch_lifecycle import Effect, Effects, Event, StartOver, WatchLife, restored, step
from slurm_omni.policy.watch_lifecycle import initial as initial_life
from slurm_omni.slurm.types import Job, NodeState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Watch:
    """One watched job: its configuration, its observers, and two tables' states. Nothing here
    changes them but :func:`live` (the watch's life, ``policy/watch_lifecycle.py``) and
    ``manager/recovery.feed`` (the recovery, ``policy/recovery.py``); the rest is what the ranks
    and Slurm last showed (phases, node states, progress)."""

    key: str
    reg: RegistryRecord
    shape: Shape
    placement: PlacementConfig
    confirmer: Confirmer
    heartbeat_dir: Path
    life: WatchLife
    array_task: int | None = None
    node_states: dict[str, NodeState] = field(default_factory=dict)
    phases: dict[int, str] = field(default_factory=dict)        # rank -> last heartbeat phase
    progress: tuple[Any, ...] = ()
    progress_written: float = float("-inf")  # when the progress row was last written (manager clock)
    recovery: RecoveryState = field(default_factory=lambda: initial(0, None))   # set by new_watch
    recovery_config: RecoveryConfig = field(default_factory=RecoveryConfig)
    scanner: HeartbeatScanner = field(default_factory=HeartbeatScanner)   # reads only the beats that changed
    max_steps: int | None = None             # the job file's [training] max_steps (None: unreadable)
    log_dir: Path | None = None              # the job file's [job] log_dir (None: unreadable)

    # what the life holds, as the rest of the manager reads it (read only: the table changes it)
    @property
    def incarnation(self) -> int:
        return self.life.incarnation

    @property
    def slurm_id(self) -> int | None:
        return self.life.slurm_id

    @property
    def units(self) -> int:
        return self.life.units

    @property
    def state(self) -> str:
        """The journal's job state: active, waiting, done, cancelled, failed."""
        return self.life.state

    @property
    def nodes(self) -> Mapping[int, tuple[str, ...]]:
        return self.life.nodes

    @property
    def running(self) -> bool:
        return self.life.running

    @property
    def quarantine(self) -> Quarantine:
        return self.life.quarantine

    @property
    def restore_step(self) -> int | None:
        return self.life.restore_step

    def output(self, slurm_id: int) -> Path | None:
        """The batch script's output file of Slurm job ``slurm_id`` (``--output=<log_dir>/%x-%j.out``);
        None for a sweep's task or an unreadable job file."""
        if self.log_dir is None or self.array_task is not None:
            return None
        return self.log_dir / f"{self.reg.name}-{slurm_id}.out"

    @property
    def node_set(self) -> frozenset[str]:
        return self.life.node_set

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
        """The OMNI_INCARNATION being judged (``WatchLife.judged_incarnation``)."""
        task_base = None
        if self.array_task is not None:
            task_base = next((t.incarnation_base for t in self.reg.tasks if t.task_id == self.array_task), 0)
        return self.life.judged_incarnation(task_base=task_base, supervised=self.recovery_config.supervised)

    def allocation_incarnation(self, restart_count: int) -> int:
        return self.life.allocation_incarnation(restart_count)

    def lost_nodes(self) -> tuple[str, ...]:
        """Nodes of the incarnation that the newest poll showed failed (DOWN, FAIL, DRAIN...)."""
        return tuple(sorted(n for n, state in self.node_states.items() if state.failed and n in self.node_set))

    def lost_kinds(self) -> dict[str, str]:
        """The lost nodes, each with its kind of failure (the recovery's cause)."""
        return {n: NODE_STATE_KIND.get(self.node_states[n], "down") for n in self.lost_nodes()}

    def layout(self) -> JobLayout:
        return self.shape.layout(self.nodes, self.units)


def live(w: Watch, event: Event, now: float) -> Effects:
    """Step ``w``'s life with ``event``; carry out what concerns the watch alone (confirmation
    starting over) and return the rest, in order, for the caller to carry out."""
    w.life, effects = step(w.life, event, now)
    rest: list[Effect] = []
    for e in effects:
        if isinstance(e, StartOver):
            if e.forget_phases:
                w.phases.clear()
            if e.forget_node_states:
                w.node_states.clear()
            w.confirmer.reset({k: list(v) for k, v in e.nodes.items()})
        else:
            rest.append(e)
    return tuple(rest)


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
                 confirmer=Confirmer(m.confirm_config, {}), heartbeat_dir=heartbeat_dir,
                 life=initial_life(incarnation, slurm_id, shape.units), array_task=task,
                 recovery=initial(incarnation, slurm_id), recovery_config=config)


def restore_watch(m: ManagerContext, reg: RegistryRecord, key: str, task_job: Job | None, state: str) -> Watch:
    """Rebuild after a restart: the newest incarnation with a Slurm job id, its open recovery."""
    w = new_watch(m, reg, key, task_job)
    life = replace(w.life, state=state)
    incarnations = [i for i in m.journal.incarnations(key) if i["slurm_job_id"]]
    if incarnations and w.array_task is None:
        cur = incarnations[-1]
        layout = cur["layout"] or {}
        life = restored(life, incarnation=cur["number"], slurm_id=int(cur["slurm_job_id"]),
                        ended_ids={int(i["slurm_job_id"]) for i in incarnations[:-1]},
                        allocation_base=min(int(i["number"]) for i in incarnations
                                            if i["slurm_job_id"] == cur["slurm_job_id"]),
                        relaunched=bool(layout.get("in_allocation")), units=int(layout.get("units") or life.units),
                        restore_step=layout.get("restore_step"))
    recoveries = m.journal.recoveries(key)
    for rec in recoveries:
        if rec.plan and isinstance(rec.plan.get("quarantine"), dict):
            until = rec.plan["quarantine"].get("until") or {}
            life = replace(life, quarantine=Quarantine({str(k): float(v) for k, v in until.items()}))
    w.recovery = resume(life.incarnation, life.slurm_id, [replayed(rec) for rec in recoveries], m.clock(),
                        w.recovery_config)
    if w.array_task is not None and w.recovery.open:   # an array task's incarnations are its restart counts
        life = replace(life, incarnation=w.recovery.incarnation)
    w.life = life
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
