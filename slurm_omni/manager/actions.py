"""What the manager does to Slurm, all through the backend (never a command of its own).

Resubmission renders the heterogeneous job again through the render code (``HetJobRequest``) with
the job file resized to the new layout, keeps the rendered script next to the journal and submits
it with one set of per-component options per het group (``sbatch OPTS0 : OPTS1 script``, which
Slurm 22.05 merges with the script's ``#SBATCH hetjob`` components in order): ``--nodelist`` for
the chosen nodes, ``--exclude`` for failed and quarantined ones, and ``--comment`` with the
incarnation's tag so that a restarted manager finds a submission it made but did not journal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import subprocess
from collections.abc import Sequence
from pathlib import Path

from slurm_omni.config.job import JobFile, load_job
from slurm_omni.config.site import SiteConfig
from slurm_omni.errors import OmniError, SlurmError
from slurm_omni.fsio import write_atomic
from slurm_omni.manager.registry import RegistryRecord
from slurm_omni.manager.shape import Shape
from slurm_omni.policy.placement import Plan
from slurm_omni.render import HetJobRequest
from slurm_omni.render.allocation import AllocationRequest
from slurm_omni.slurm.backend import SlurmBackend
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor.outside import start_detached

log = logging.getLogger(__name__)

# scancel's words for a job that is already gone: cancelling it again is success.
_GONE = ("already completing or completed", "Invalid job id specified")
# scontrol's words when the user may not update nodes.
_NOT_ALLOWED = ("Invalid user id", "Access/permission denied")


class ResubmitRefused(OmniError):
    """The job file changed since it was registered: resubmitting would train something else."""


class Actions:
    def __init__(self, backend: SlurmBackend, site: SiteConfig, state_dir: Path) -> None:
        self.backend = backend
        self.site = site
        self.scripts = state_dir / "scripts"
        self._supervisors: list[subprocess.Popen[bytes]] = []

    def start_supervisor(self, reg: RegistryRecord, slurm_job_id: int) -> int:
        """Allocation mode: a new step supervisor for ``slurm_job_id``, detached, on this host (the one
        that ran it is gone); it takes over its predecessor's journal. Its pid."""
        job = self.job_file(reg)
        request = HetJobRequest(job=job, site=self.site, job_file=reg.job_file, job_sha256=reg.job_sha256,
                                incarnation_base=reg.incarnation_base)
        alloc = AllocationRequest(request)
        runner: CommandRunner = getattr(self.backend, "runner", None) or CommandRunner()
        self._supervisors = [p for p in self._supervisors if p.poll() is None]   # reap the ones that left
        proc = start_detached(runner, alloc.supervisor_argv(slurm_job_id),
                              {**(reg.environment or {}), **alloc.supervisor_env(slurm_job_id)},
                              job.job.log_dir / f"{job.job.name}-{slurm_job_id}.supervisor.log")
        self._supervisors.append(proc)
        return proc.pid

    def cancel(self, slurm_job_id: int) -> str:
        """End what is left of an incarnation (the runner bounds scancel with its timeout)."""
        try:
            self.backend.cancel(str(slurm_job_id))
        except SlurmError as e:
            if not any(g in str(e) for g in _GONE):
                raise
            return f"{slurm_job_id} already gone"
        return f"{slurm_job_id} cancelled"

    def signal_checkpoint(self, slurm_job_id: int, signal: str = "USR1") -> str:
        """Ask the step's ranks to checkpoint and exit 75 (before a planned resize)."""
        self.backend.cancel(str(slurm_job_id), signal=signal)
        return f"{slurm_job_id} signalled {signal}"

    def drain(self, node: str, reason: str) -> str:
        """Drain a failed node; a manager whose user Slurm does not let update nodes (not root,
        SlurmUser or an operator: ``slurm_update error: Invalid user id``) says so once and goes on."""
        try:
            self.backend.set_node_state(node, "DRAIN", reason)
        except SlurmError as e:
            if not any(d in str(e) for d in _NOT_ALLOWED):
                raise
            log.warning("manager: couldn't drain %s: Slurm refuses this user (%s); an operator may drain it "
                        "(drain_failed needs an operator account)", node, str(e).strip()[:200])
            return f"{node} not drained (not an operator)"
        return f"{node} drained"

    def requeue_task(self, array_ref: str) -> str:
        """A failed array task alone (``scontrol requeue <array>_<task>``, bounded by a timeout)."""
        self.backend.requeue(array_ref)
        return f"{array_ref} requeued"

    def job_file(self, reg: RegistryRecord) -> JobFile:
        """The registered job file, refused when its bytes changed since registration."""
        try:
            data = reg.job_file.read_bytes()
        except OSError as e:
            raise ResubmitRefused(f"manager: couldn't read job file {reg.job_file}: {e.strerror}") from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != reg.job_sha256:
            raise ResubmitRefused(f"manager: couldn't resubmit {reg.key}: {reg.job_file} changed since it was "
                                  f"registered (sha256 {digest[:12]} != {reg.job_sha256[:12]}; submit it anew)")
        return load_job(reg.job_file)

    def render(self, reg: RegistryRecord, shape: Shape, plan: Plan, units: int, tag: str, incarnation: int) -> Path:
        """The next incarnation's script; its ranks number their first life ``incarnation``."""
        return self._render(self._request(reg, shape, plan, units, incarnation), tag)

    def _request(self, reg: RegistryRecord, shape: Shape, plan: Plan, units: int, incarnation: int) -> HetJobRequest:
        """The next incarnation's request: a heterogeneous job pinned to ``plan``'s nodes asks for the
        leaf switches they span; an in-allocation job asks for its allocation as the job file does."""
        job = shape.resized(self.job_file(reg), units)
        request = HetJobRequest(job=job, site=self.site, job_file=reg.job_file, job_sha256=reg.job_sha256,
                                incarnation_base=incarnation)
        if request.in_allocation()[0] is not None:
            return request
        return dataclasses.replace(request, job=shape.pinned(job, plan))

    def _render(self, request: HetJobRequest, tag: str) -> Path:
        script = request.materialize()
        self.scripts.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.scripts / f"{tag}.sbatch"
        write_atomic(path, script)
        return path

    def resubmit(self, reg: RegistryRecord, shape: Shape, plan: Plan, units: int, tag: str, incarnation: int) -> int:
        """Submit the next incarnation; returns its Slurm job id (the het leader's)."""
        request = self._request(reg, shape, plan, units, incarnation)
        script = self._render(request, tag)
        if reg.environment is None:
            log.warning("manager: %s has no recorded environment (registered by an older omni submit): "
                        "resubmitting with the manager's", reg.key)
        # sbatch hands the job the environment it runs with: the submitter's, not the manager's
        in_allocation = request.in_allocation()[0] is not None
        args = exclude_args(plan, tag) if in_allocation else placement_args(plan, tag, len(shape.stages))
        return self.backend.submit(str(script), args, env=reg.environment)

    def find_by_tag(self, tag: str, *, user: str, name: str, since: float) -> str | None:
        """The job carrying ``tag`` in its comment (a submission a crash kept out of the journal).
        Tags are predictable, so a job counts only when it is ``user``'s, is named ``name`` and was
        submitted after the intent was journaled (``since``; squeue gives whole seconds): anyone can
        plant a held job with the next tag."""
        for job in self.backend.jobs():
            if job.comment != tag:
                continue
            if job.user != user or job.name != name or job.submit_time is None or job.submit_time < math.floor(since):
                log.error("manager: couldn't adopt Slurm job %s carrying tag %s: user %s, name %s, submitted at "
                          "%s (expected user %s, name %s, submitted at or after %d)", job.job_id, tag, job.user,
                          job.name, job.submit_time, user, name, math.floor(since))
                continue
            return str(job.job_id)
        return None


def exclude_args(plan: Plan, tag: str) -> list[str]:
    """An in-allocation job is one homogeneous allocation whose supervisor places the stages itself:
    only the tag and the nodes it must not get (every node the job lost)."""
    return [f"--comment={tag}", *([f"--exclude={compress(plan.exclude)}"] if plan.exclude else [])]


def placement_args(plan: Plan, tag: str, components: int) -> list[str]:
    """``OPTS0 : OPTS1 ...``: each component's nodelist and excluded nodes, the tag on the leader."""
    args: list[str] = []
    for offset in range(components):
        nodes: Sequence[str] = plan.nodelist(offset) if plan.components else ()
        if offset:
            args.append(":")
        else:
            args.append(f"--comment={tag}")
        if nodes:
            args.append(f"--nodelist={compress(nodes)}")
        exclude = [n for n in plan.exclude if n not in set(nodes)]
        if exclude:
            args.append(f"--exclude={compress(exclude)}")
    return args
