"""The reference run: the same job file trained once without a fault, on this machine.

It uses the local launcher (the ranks get the environment srun would give them) with one thread per
rank, sample tracing on, and its own checkpoint, heartbeat and metrics folders. The drilled job must
also run with ``OMP_NUM_THREADS=1`` for the bitwise comparison (``JOB_ENV`` below; ``omni submit``
passes the submitting environment on to the ranks).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from slurm_omni.config.job import load_job
from slurm_omni.drill.inject import DrillError
from slurm_omni.runtime import exitcodes
from slurm_omni.runtime.launch import LocalJob, launch_local

JOB_ENV = {"OMNI_TRACE_SAMPLES": "1", "OMP_NUM_THREADS": "1"}
"""What a drilled job's ranks need in their environment: traced sample ids, one thread per rank."""


def start_reference(job_file: Path, run_dir: Path) -> LocalJob:
    """Start the reference ranks in ``run_dir`` (emptied first); ``run_dir/metrics`` gets their files."""
    job = load_job(job_file)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    return launch_local(job_file.resolve(), data_parallel_size=job.job.data_parallel_size, run_dir=run_dir,
                        extra_env=JOB_ENV)


def finish_reference(local: LocalJob, run_dir: Path, timeout_s: float) -> Path:
    """Wait for the reference ranks; their metrics folder."""
    codes = local.wait(timeout_s)
    if any(c != exitcodes.EXIT_DONE for c in codes):
        tail = local.logs().strip().splitlines()[-1:] or ["no output"]
        raise DrillError(f"drill: couldn't finish the reference run in {run_dir}: exit codes {codes} "
                         f"({tail[0][:200]})")
    return run_dir / "metrics"


def run_reference(job_file: Path, run_dir: Path, timeout_s: float = 600.0) -> Path:
    return finish_reference(start_reference(job_file, run_dir), run_dir, timeout_s)
