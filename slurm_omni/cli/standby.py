"""``omni standby serve``: the warm standby of one node (started by the step supervisor)."""

from __future__ import annotations

import os

import click

from slurm_omni.errors import ConfigError


@click.group()
def standby() -> None:
    """Warm standbys of an in-allocation job."""


@standby.command()
def serve() -> None:
    """Import the trainer once and fork it for every task of a relaunched step on this node."""
    from slurm_omni.ownership import NotOwnedError
    from slurm_omni.standby.server import open_standby_dir, socket_path
    from slurm_omni.standby.server import serve as run_server

    job, node = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURMD_NODENAME", "")
    if not job or not node:
        raise ConfigError("standby: couldn't start: SLURM_JOB_ID or SLURMD_NODENAME not set (run it with srun)")
    try:
        with open_standby_dir(job) as folder:
            path = socket_path(folder.path, job, node)
    except NotOwnedError as e:   # the clients refuse that folder too: the ranks on this node start cold
        raise NotOwnedError(f"{e}; no warm standby on {node}: its ranks start cold") from None

    def stop() -> None:
        # the job's end (the supervisor stops its standbys with SIGUSR2, Slurm a step with SIGTERM):
        # free the job's memory tier on this node (checkpoint/memtier.py)
        from pathlib import Path

        from slurm_omni.checkpoint.memtier import DEFAULT_DIR, free_job

        free_job(job, base=Path(os.environ.get("OMNI_MEMORY_DIR") or DEFAULT_DIR))

    run_server(path, on_stop=stop)
