"""Inputs of the template tests."""

from __future__ import annotations

import re
import time
from pathlib import Path

from support import wait_until

from slurm_omni.slurm.runner import CommandRunner

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("data")
GOLDEN = Path(__file__).with_name("golden")
# Where the golden scripts say the job file lives: fixed, so goldens do not depend on the checkout.
JOB_FILE = Path("/shared/jobs/omni-tiny/job.toml")



def job_rows(runner: CommandRunner, job_id: int) -> list[dict[str, str]]:
    """``scontrol show job -o``: one dict per het component or array task."""
    out = runner.run(["scontrol", "show", "job", "-o", str(job_id)], check=False).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]


def start_requeued_now(runner: CommandRunner, job_id: int, restarts: int) -> None:
    """Wait until every component of ``job_id`` is pending after its ``restarts``-th requeue, then
    let it start now: Slurm 22.05 holds a requeued job back (BeginTime) for ~121 s."""
    wait_until(lambda: (rows := job_rows(runner, job_id)) and all(
        r["JobState"] == "PENDING" and r["Restarts"] == str(restarts) for r in rows), 60,
        f"job {job_id} to be requeued", interval_s=0.3)      # 22.05 requeues het components one by one
    time.sleep(2)                   # sooner, and the new life dies of "Job credential revoked"
    for row in job_rows(runner, job_id):
        runner.run(["scontrol", "update", f"JobId={row['JobId']}", "StartTime=now"], check=False)
