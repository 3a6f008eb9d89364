"""``omni launch-failure``: run by a heterogeneous job's batch script after its step failed.

When no rank of the life wrote a heartbeat (a crash at start: an import error, a missing file), it
prints the failure's line where the user looks (the job's own output) and records it for the manager,
which shows it in ``omni status`` and stops the job when the next life fails the same way
(``policy/start_failure.py``). It never changes the batch script's exit code.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

log = logging.getLogger(__name__)


@click.command("launch-failure")
@click.option("--log", "log_path", required=True, help="The job's output file (the batch script's stdout).")
@click.option("--start", type=click.IntRange(min=0), default=0, help="Where this life's step started in it.")
@click.option("--rc", type=int, required=True, help="The step's exit code.")
def launch_failure(log_path: str, start: int, rc: int) -> None:
    """Show and record the step's failure when it came before the first heartbeat."""
    from slurm_omni.policy.start_failure import first_line
    from slurm_omni.supervisor.launch_failure import beat, read_failure, write_record

    env = os.environ
    job_id, heartbeat_dir = env.get("SLURM_JOB_ID", ""), env.get("OMNI_HEARTBEAT_DIR", "")
    if not job_id or not heartbeat_dir:
        click.echo("omni: launch-failure: SLURM_JOB_ID and OMNI_HEARTBEAT_DIR not set (the batch script sets them)",
                   err=True)
        return
    incarnation = int(env.get("OMNI_INCARNATION", "0") or 0)
    if beat(Path(heartbeat_dir), job_id, incarnation):
        return   # it trained: the confirmer judges this failure, and its traceback is in the output above
    failure = read_failure(Path(log_path), start=start, rc=rc, launch=incarnation)
    if failure is None:
        return   # srun lost a node: the cluster's failure, the manager's to recover
    label = f"job {job_id} ({env.get('OMNI_JOB_NAME', '?')})"
    click.echo(f"omni: {first_line(label, failure)}", err=True)
    try:
        write_record(Path(heartbeat_dir), job_id=job_id, incarnation=incarnation, failure=failure)
    except OSError as e:
        click.echo(f"omni: launch-failure: couldn't record it in {heartbeat_dir}: {e.strerror}", err=True)
