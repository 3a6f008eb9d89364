"""Allocation mode (``[job] recovery = "allocation"``): the job's nodes come from an allocation
without a batch script (``salloc --no-shell --no-kill``), and the step supervisor runs outside it,
beside the manager, launching the stages with ``srun --jobid`` (docs/allocation-mode.md).

Building is separate from running, as for batch scripts: :class:`AllocationRequest` gives the salloc
argv (the same partition, node count, gres, constraint counts and switches as the in-allocation
script's ``#SBATCH`` lines) and the supervisor's argv and environment; ``omni submit`` and the
manager's restart of a dead supervisor run them. Nothing here runs a command.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from slurm_omni.errors import ConfigError
from slurm_omni.render.request import (
    AllocationShape,
    HetJobRequest,
    _job_env,
    _units_divide,
    omni_argv,
    plan_stages,
    supervisor_stages_arg,
    training_command,
)

RECOVERY = "allocation"

POOL_SALLOC_ENV = "OMNI_POOL_SALLOC"
"""The job's own salloc argv (JSON), for the supervisor's pool allocations (``policy/pools.py``);
unset when the site turns pools off (``elasticity.pools = false``)."""


def allocation_mode(request: HetJobRequest) -> bool:
    """Does this job run in allocation mode: asked for (job file or site default), allowed by the
    site, and its stages fit one allocation (else the batch script says why it is a het job)?"""
    return request.recovery == RECOVERY and request.in_allocation()[0] is not None


@dataclass(frozen=True, slots=True)
class AllocationRequest:
    """The salloc of an allocation-mode job and its supervisor's command line."""

    request: HetJobRequest

    def __post_init__(self) -> None:
        if self.request.recovery != RECOVERY:
            raise ConfigError(f"render: couldn't build an allocation for {self.request.job.job.name}: recovery is "
                              f"{self.request.recovery!r} (allocation mode needs recovery = \"allocation\" and "
                              f"elasticity.allow_allocation = true)")

    @property
    def shape(self) -> AllocationShape:
        shape, why_not = self.request.in_allocation()
        if shape is None:
            raise ConfigError(f"render: couldn't build an allocation for {self.request.job.job.name}: {why_not}")
        return shape

    def salloc_argv(self) -> list[str]:
        """``salloc --no-shell --no-kill`` of every stage's nodes plus spares. No ``--signal``: with
        no batch shell to signal, the supervisor stops the step itself before the time limit."""
        shape, j = self.shape, self.request.job.job
        argv = ["salloc", "--no-shell", "--no-kill", f"--job-name={j.name}", f"--time={j.time_limit}",
                f"--partition={shape.partition}", f"--nodes={shape.nodes}",
                f"--ntasks-per-node={shape.tasks_per_node}", f"--gres={shape.gres}",
                f"--switches={shape.switches}@{shape.switch_wait}"]
        if shape.constraint:
            argv.append(f"--constraint={shape.constraint}")
        if shape.cpus_per_task:
            argv.append(f"--cpus-per-task={shape.cpus_per_task}")
        if j.account:
            argv.append(f"--account={j.account}")
        if j.qos:
            argv.append(f"--qos={j.qos}")
        return argv

    def supervisor_argv(self, job_id: int) -> list[str]:
        """``omni supervise --allocation=J ... -- COMMAND``: the same options as the batch script's."""
        r = self.request
        plans = plan_stages(r.job, r.site)
        command = r.command or training_command(r.job, r.site, r.job_file)
        argv = [*omni_argv(r.site), "supervise", f"--allocation={job_id}", f"--stages={supervisor_stages_arg(plans)}",
                f"--min-dp={r.site.elasticity.min_data_parallel_size}", f"--units-divide={_units_divide(r.job, plans)}",
                f"--spare-policy={r.site.elasticity.spare_policy}",
                f"--max-relaunches={r.site.elasticity.max_relaunches}",
                f"--heartbeat-interval={r.site.detection.heartbeat_interval_s:g}",
                f"--confirmation-window={r.site.detection.confirmation_window_s:g}",
                f"--hang-factor={r.site.detection.confirm.hang_factor:g}",
                f"--stop-before={r.job.job.signal_before_s}"]
        if r.site.elasticity.pools and r.site.elasticity.successor_queue_wait_s > 0:
            argv.append(f"--successor-queue-wait={r.site.elasticity.successor_queue_wait_s:g}")
        if r.site.use_spank_plugin:
            argv.append(f"--spank-ckpt={r.site.checkpoint.job_dir(r.user, r.job.job.name)}")
        return [*argv, "--", *command]

    def supervisor_env(self, job_id: int) -> dict[str, str]:
        """What the batch script would export (the ranks inherit it through ``srun --jobid``), and
        SLURM_JOB_ID: an srun that does not name ``--jobid`` still runs in the allocation (22.05
        takes the variable for it) instead of asking for a new one; OMNI_POOL_SALLOC: the job's own
        salloc, which a pool allocation repeats with the nodes the job misses."""
        r = self.request
        env = _job_env(r.job, r.site, r.job_file, plan_stages(r.job, r.site), r.user)
        pools = {POOL_SALLOC_ENV: json.dumps(self.salloc_argv())} if r.site.elasticity.pools else {}
        return {**env, "OMNI_INCARNATION_BASE": str(r.incarnation_base), "OMNI_INCARNATION": str(r.incarnation_base),
                "OMNI_HET_JOB_ID": str(job_id), "OMNI_RECOVERY": RECOVERY, "SLURM_JOB_ID": str(job_id), **pools}

    def dry_run(self) -> str:
        """``omni render``'s account of what ``omni submit`` will run instead of sbatch (comment lines,
        for after the script's first line: the script itself is the manager's fallback)."""
        words = self.supervisor_argv(0)
        words[words.index("--allocation=0")] = "--allocation=J"
        # a path may hold a newline: it must not end the comment and start a line of bash
        return "".join(f"# {line if line.isprintable() else json.dumps(line)}\n" for line in (
            "Allocation mode (recovery = \"allocation\"): omni submit does not sbatch this script; it runs",
            "  " + shlex.join(self.salloc_argv()),
            "and, with the job id J salloc prints, beside the submitting shell (detached):",
            "  " + shlex.join(words),
            "This script is what the manager resubmits when the allocation itself is lost."))
