"""After the drills: wait for the job to finish and compare it with the reference run."""

from __future__ import annotations

import time
from pathlib import Path

from slurm_omni.drill.equivalence import DEFAULT_RTOL, Equivalence, check_equivalence
from slurm_omni.drill.history import load_history
from slurm_omni.drill.inject import DrillError
from slurm_omni.drill.job import latest_incarnation_step
from slurm_omni.drill.run import DrillRunner


def wait_done(runner: DrillRunner, timeout_s: float) -> None:
    """Until the job logged its last step and no job of its name is left in Slurm."""
    handle = runner.handle
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = latest_incarnation_step(handle.metrics_dir, handle.stages)
        if seen is not None and seen[1] >= handle.max_steps and handle.current(runner.backend.jobs()) is None:
            return
        time.sleep(runner.slurm_poll_s * 2)
    seen = latest_incarnation_step(handle.metrics_dir, handle.stages)
    raise DrillError(f"drill: couldn't see job {handle.name} finish within {timeout_s:.0f}s: last step "
                     f"{seen[1] if seen else '-'} of {handle.max_steps} (squeue; omni status)")


def verify_run(runner: DrillRunner, reference: Path, *, rtol: float = DEFAULT_RTOL,
               timeout_s: float = 600.0) -> Equivalence:
    wait_done(runner, timeout_s)
    return check_equivalence(load_history(runner.handle.metrics_dir, runner.handle.stages),
                             load_history(reference, runner.handle.stages), rtol=rtol,
                             data_order="per_replica" if runner.handle.data_order == "per_replica" else "global")
