"""The reference run: the same job file trained once without a fault, on this machine.

It uses the local launcher (the ranks get the environment srun would give them) with one thread per
rank, sample tracing on, and its own checkpoint, heartbeat and metrics folders. The drilled job must
also run with ``OMP_NUM_THREADS=1`` for the bitwise comparison (``JOB_ENV`` below; ``omni submit``
passes the submitting environment on to the ranks).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from slurm_omni.config.job import load_job
from slurm_omni.drill.inject import DrillError
from slurm_omni.elastic.codes import EXIT_DONE
from slurm_omni.render.request import command_env, training_command
from slurm_omni.runtime.launch import LocalJob, launch_local

JOB_ENV = {"OMNI_TRACE_SAMPLES": "1", "OMP_NUM_THREADS": "1"}
"""What a drilled job's ranks need in their environment: traced sample ids, one thread per rank."""


def start_reference(job_file: Path, run_dir: Path) -> LocalJob:
    """Start the reference ranks in ``run_dir`` (emptied first); ``run_dir/metrics`` gets their files."""
    job = load_job(job_file)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    return launch_job(job_file, data_parallel_size=job.job.data_parallel_size, run_dir=run_dir, extra_env=JOB_ENV)


def launch_job(job_file: Path, *, data_parallel_size: int, run_dir: Path, incarnation: int = 0,
               extra_env: Mapping[str, str] | None = None) -> LocalJob:
    """The job file's ranks on this machine as the batch script would start them: its ``[training]
    command`` (with its ``[training.env]`` and ``OMNI_MAX_STEPS``) or the built-in trainer."""
    path = job_file.resolve()
    job = load_job(path)
    env = {"OMNI_MAX_STEPS": str(job.training.max_steps), **command_env(job, None, path), **(extra_env or {})}
    command = training_command(job, None, path) if job.training.command else ()
    return launch_local(path, data_parallel_size=data_parallel_size, run_dir=run_dir, incarnation=incarnation,
                        extra_env=env, command=command, stages=tuple(s.name for s in job.stages))


def finish_reference(local: LocalJob, run_dir: Path, timeout_s: float) -> Path:
    """Wait for the reference ranks; their metrics folder."""
    codes = local.wait(timeout_s)
    if any(c != EXIT_DONE for c in codes):
        tail = local.logs().strip().splitlines()[-1:] or ["no output"]
        raise DrillError(f"drill: couldn't finish the reference run in {run_dir}: exit codes {codes} "
                         f"({tail[0][:200]})")
    return run_dir / "metrics"


def run_reference(job_file: Path, run_dir: Path, timeout_s: float = 600.0) -> Path:
    return finish_reference(start_reference(job_file, run_dir), run_dir, timeout_s)
