"""The job a drill targets: its registration, its files, and where its ranks run now."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni.config.job import load_job
from slurm_omni.config.site import SiteConfig
from slurm_omni.drill.history import loss_file
from slurm_omni.drill.inject import DrillError, DrillRefused, TaskPid
from slurm_omni.formats.metrics import NODE_FILE_GLOB
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.ownership import current_user
from slurm_omni.render.registry import read_registrations
from slurm_omni.slurm.types import HetComponent, Job, JobState


@dataclass(frozen=True, kw_only=True, slots=True)
class JobHandle:
    """A registered job: its name outlives Slurm job ids (the manager resubmits under the same name)."""

    name: str
    job_id: int
    """Slurm job id it was submitted as."""
    stage_tasks: tuple[int, ...]
    """Ranks per heterogeneous component, in component order (ranks are component-major)."""
    stages: tuple[str, ...] = ()
    """The job's stage names in pipeline order, as registered (any names, any number)."""
    ckpt_dir: Path
    metrics_dir: Path
    heartbeat_dir: Path
    max_steps: int
    """The job file's training.max_steps: the run is done when it logged this step."""
    user: str = ""
    """Who submitted it; another user's job of the same name is never taken for it."""
    data_order: str = "global"
    """The job file's ``[training.parallel] data_order``: the contract a resized run is compared by."""

    @classmethod
    def from_registration(cls, record: dict[str, Any], site: SiteConfig) -> JobHandle:
        name = str(record["name"])
        ckpt = Path(record["ckpt_dir"])
        stages = sorted(record.get("stages") or [], key=lambda s: int(s["het_group"]))
        job_file = load_job(Path(record["job_file"]))
        return cls(name=name, job_id=int(record["job_id"]),
                   stage_tasks=tuple(int(s["nodes"]) * int(s["tasks_per_node"]) for s in stages),
                   stages=tuple(str(s["name"]) for s in stages),
                   ckpt_dir=ckpt, metrics_dir=site.manager.metrics_for(str(record.get("user") or current_user())) / name, heartbeat_dir=ckpt / "heartbeat",
                   max_steps=job_file.training.max_steps, user=str(record.get("user") or ""),
                   data_order=job_file.training.parallel.data_order)

    def rank_nodes(self, job: Job) -> tuple[str, ...]:
        """Nodes where ranks of Slurm job ``job`` run now, by its newest life's heartbeats (rank order).
        An in-allocation job's allocation also holds spares, which run no rank: a drill that takes
        one hits nothing."""
        beats = [hb for hb in read_heartbeats(self.heartbeat_dir) if hb.job_id == str(job.job_id) and hb.node]
        if not beats:
            return ()
        newest = max(hb.incarnation for hb in beats)
        return tuple(dict.fromkeys(hb.node for hb in sorted(beats, key=lambda hb: hb.rank)
                                   if hb.incarnation == newest))

    def rank_offset(self, het_offset: int) -> int:
        return sum(self.stage_tasks[:het_offset])

    def current(self, jobs: list[Job]) -> Job | None:
        """The newest Slurm job of this name that is not finished (the live incarnation)."""
        live = [j for j in jobs if j.name == self.name and not j.state.finished and j.job_id >= self.job_id
                and (not self.user or j.user == self.user)]
        return max(live, key=lambda j: j.job_id) if live else None


def find_registration(site: SiteConfig, job: str) -> dict[str, Any]:
    """The registration of ``job`` (a Slurm job id or a job name: the newest of that name)."""
    registry = site.manager.registry_for(current_user())
    if not registry.is_dir():
        raise DrillError(f"drill: couldn't find job {job!r}: no registry {registry} (omni submit registers jobs)")
    records = read_registrations(registry)
    found = [r for r in records if str(r.get("job_id")) == job or r.get("name") == job]
    if not found:
        raise DrillError(f"drill: couldn't find job {job!r} in {registry} (registered: "
                         f"{', '.join(sorted({str(r.get('name')) for r in records})) or 'none'})")
    return max(found, key=lambda r: int(r["job_id"]))


def pick_node(job: Job, allowed: tuple[str, ...], wanted: str, site: str,
              ranked: tuple[str, ...] = ()) -> tuple[HetComponent, str]:
    """The component and node to drill: ``wanted`` if given, else the job's last node that drills may
    touch among those that run ranks (``ranked``, from the heartbeats; empty: every node of the job):
    the last stage's, usually, and the batch host only when no other node runs ranks (losing it ends
    an in-allocation job's batch script: recovery by resubmission instead of in the allocation).
    Refused when none is allowed."""
    if job.state is not JobState.RUNNING:
        raise DrillError(f"drill: couldn't pick a node: job {job.job_id} is {job.state.value}, not running")
    placed = [(c, n) for c in job.components for n in c.nodes]
    if wanted:
        if wanted not in allowed:
            raise DrillRefused(f"drill: couldn't touch {wanted}: not in drills.allowed_nodes of {site}")
        hit = [(c, n) for c, n in placed if n == wanted]
        if not hit:
            raise DrillError(f"drill: couldn't drill {wanted}: job {job.job_id} runs on "
                             f"{', '.join(n for _, n in placed)} (pick one of them, or omit --node)")
        return hit[0]
    ok = [(c, n) for c, n in placed if n in allowed]
    running = [(c, n) for c, n in ok if n in set(ranked)]
    if ranked and not running:
        raise DrillRefused(f"drill: couldn't drill job {job.job_id}: its ranks run on {', '.join(ranked)}, "
                           f"none in drills.allowed_nodes of {site} (its other nodes are spares)")
    ok = running or ok
    ok = [(c, n) for c, n in ok if n != job.batch_host] or ok
    if not ok:
        raise DrillRefused(f"drill: couldn't drill job {job.job_id}: it runs on {', '.join(n for _, n in placed)}, "
                           f"none in drills.allowed_nodes of {site}")
    return ok[-1]


def pick_task(tasks: list[TaskPid], component: HetComponent, handle: JobHandle,
              rank: int | None) -> tuple[int, TaskPid]:
    """(global rank, task) of ``rank`` among ``tasks`` (this component's tasks on one node)."""
    if not tasks:
        raise DrillError(f"drill: couldn't find the ranks of job {component.job_id}: scontrol listpids lists "
                         "no task on the node (step not started yet?)")
    offset = handle.rank_offset(component.het_offset)
    step = tasks[0].step     # the training step (task_pids lists it first)
    by_rank = {offset + t.global_id: t for t in tasks if t.step == step}
    if rank is None:
        return min(by_rank.items())
    if rank not in by_rank:
        raise DrillError(f"drill: couldn't find rank {rank} on the node: it holds ranks "
                         f"{', '.join(map(str, sorted(by_rank)))}")
    return rank, by_rank[rank]


TAIL_BYTES = 1 << 16
"""How much of the end of each file :func:`latest_incarnation_step` reads: a node file holds every rank
of its node's lines, copied once per heartbeat interval."""


def latest_incarnation_step(metrics_dir: Path, stages: Sequence[str] = ()) -> tuple[int, int] | None:
    """(incarnation, step) of the last line the loss-reporting rank wrote, from the ends of its own
    file and of the node files that carry its lines (``formats.metrics``: under Slurm a node's
    heartbeat leader copies them there once per interval, and the rank's own file gets only what was
    left at its end), the newest by (incarnation, time); ``stages``: the job's stage names in pipeline
    order (empty: the loss file found from the files). Only the files' ends are read: the drill polls
    this while training runs."""
    path = loss_file(metrics_dir, stages) if metrics_dir.is_dir() else None
    if path is None:
        return None
    newest: tuple[float, float, int] | None = None
    for source in [path, *sorted(metrics_dir.glob(NODE_FILE_GLOB))]:
        for obj in _tail_objects(source):
            if source != path and obj.get("file") != path.name:
                continue
            try:
                key = (float(obj["incarnation"]), float(obj.get("time", 0.0)), int(obj["step"]))
            except (ValueError, KeyError, TypeError):
                continue
            if newest is None or key[:2] >= newest[:2]:
                newest = key
    return (int(newest[0]), newest[2]) if newest is not None else None


def _tail_objects(path: Path) -> list[dict[str, Any]]:
    """The JSON objects among the whole lines of the last :data:`TAIL_BYTES` of ``path`` (a line cut by
    the window's start, or torn by a writer, is not JSON and is passed over)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - TAIL_BYTES))
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            obj = json.loads(line)
            return int(obj["incarnation"]), int(obj["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None
