"""``omni supervise``: the step supervisor, started by an in-allocation batch script, or outside its
allocation by ``omni submit`` and the manager (``--allocation``, docs/allocation-mode.md)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from slurm_omni.errors import ConfigError


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--stages", "stages_text", required=True,
              help="NAME:NODES:TASKS_PER_NODE:SPARES[:FEATURE] per stage, comma-separated, in het-group order.")
@click.option("--min-dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Smallest data-parallel size a relaunch may shrink to.")
@click.option("--units-divide", type=click.IntRange(min=0), default=0, show_default=True,
              help="A unit count must divide this (the global batch in units' micro-batches); 0: any.")
@click.option("--spare-policy", type=click.Choice(["same_switch", "any_switch", "none"]), default="any_switch",
              show_default=True)
@click.option("--max-relaunches", type=click.IntRange(1, 99), default=20, show_default=True)
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True)
@click.option("--confirmation-window", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="Seconds of stale heartbeats with no progress, and no other signal, that confirm a hang (the "
                   "site's detection.confirmation_window_s) and --hang-factor median step times.")
@click.option("--hang-factor", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="A hang confirms no sooner than this many median step times (the site's "
                   "detection.confirm.hang_factor).")
@click.option("--kill-grace", type=click.FloatRange(min=0.0, max=600.0), default=0.0, show_default=True,
              help="After killing a confirmed failed step, wait up to this many seconds for its srun to end (every "
                   "old task it reached gone) before the next launch; 0: start it at once beside the dying tasks.")
@click.option("--spank-ckpt", default="", help="Give every component the SPANK plugin's --omni-stage and this "
              "--omni-ckpt (its per-task fault records).")
@click.option("--standby/--no-standby", default=True, show_default=True,
              help="A warm standby per node: relaunched ranks start with everything imported.")
@click.option("--allocation", "allocation", type=click.IntRange(min=1), default=None,
              help="Allocation mode: supervise this Slurm job (salloc --no-shell) from outside it, with srun --jobid.")
@click.option("--stop-before", type=click.IntRange(min=0), default=0, show_default=True,
              help="Allocation mode: signal the step this many seconds before the job's time limit.")
@click.option("--stop-signal", type=click.Choice(["USR1", "USR2"]), default="USR1", show_default=True,
              help="Allocation mode: the signal the ranks checkpoint on (the job's requeue_signal).")
@click.option("--successor-queue-wait", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Allocation mode with pools: the queue wait a new allocation expects; a successor allocation is "
                   "asked for ahead of the time limit by 1.5 times it plus one relaunch (0: none).")
@click.argument("command", nargs=-1, required=True)
def supervise(stages_text: str, min_dp: int, units_divide: int, spare_policy: str, max_relaunches: int,
              heartbeat_interval: float, confirmation_window: float, hang_factor: float, kill_grace: float,
              spank_ckpt: str, standby: bool,
              allocation: int | None, stop_before: int,
              stop_signal: str, successor_queue_wait: float, command: tuple[str, ...]) -> None:
    """Launch COMMAND as one heterogeneous step over the allocation's active nodes, and relaunch it
    inside the allocation on a confirmed failure (spares, then fewer replicas). Exits 0 when training
    is done, 75 when it stopped for requeue, 1 when the manager must take over."""
    from slurm_omni.policy.in_allocation import parse_stages
    from slurm_omni.slurm.hostlist import expand
    from slurm_omni.slurm.runner import CommandRunner
    from slurm_omni.supervisor.run import CRASH_ENV, Supervisor, SupervisorOptions

    env = os.environ
    needed = ("OMNI_CKPT_DIR", "OMNI_HEARTBEAT_DIR", "OMNI_DP_SIZE")
    missing = [k for k in (needed if allocation else ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", *needed))
               if not env.get(k)]
    if missing:
        raise ConfigError(f"supervise: couldn't start: {', '.join(missing)} not set (the in-allocation batch "
                          f"script sets them; in allocation mode omni submit does)")
    if allocation:   # any srun of ours that does not name --jobid still runs in this allocation
        os.environ["SLURM_JOB_ID"] = os.environ["SLURM_JOBID"] = str(allocation)
    stages = parse_stages(stages_text)
    log_dir = env.get("OMNI_LOG_DIR")
    pool_salloc = _pool_salloc(env.get("OMNI_POOL_SALLOC", "")) if allocation else ()
    opts = SupervisorOptions(
        stages=stages, command=command, job_id=str(allocation) if allocation else env["SLURM_JOB_ID"],
        allocation=() if allocation else tuple(expand(env["SLURM_JOB_NODELIST"])), data_parallel_size=int(env["OMNI_DP_SIZE"]),
        ckpt_dir=Path(env["OMNI_CKPT_DIR"]), heartbeat_dir=Path(env["OMNI_HEARTBEAT_DIR"]),
        incarnation=int(env.get("OMNI_INCARNATION", "0") or 0), min_data_parallel_size=min_dp,
        units_divide=units_divide, spare_policy=spare_policy,  # type: ignore[arg-type]
        max_relaunches=max_relaunches, heartbeat_interval_s=heartbeat_interval,
        confirmation_window_s=confirmation_window, hang_factor=hang_factor, kill_grace_s=kill_grace, spank_ckpt=spank_ckpt,
        log_dir=Path(log_dir) if log_dir else None, crash_at=env.get(CRASH_ENV, ""),
        restart_count=0 if allocation else int(env.get("SLURM_RESTART_COUNT", "0") or 0),
        standby=standby and env.get("OMNI_STANDBY", "1") != "0",
        batch_host="" if allocation else env.get("SLURMD_NODENAME", ""), outside=allocation is not None,
        stop_before_s=stop_before, stop_signal=int(getattr(signal, f"SIG{stop_signal}")),
        workdir=Path(env.get("OMNI_WORKDIR") or os.getcwd()), job_name=env.get("OMNI_JOB_NAME", ""),
        pool_salloc=pool_salloc, successor_queue_wait_s=successor_queue_wait)
    sys.exit(Supervisor(opts, CommandRunner()).run())


def _pool_salloc(text: str) -> tuple[str, ...]:
    """OMNI_POOL_SALLOC: the job's salloc argv as a JSON list of strings (empty: no pools)."""
    import json

    if not text:
        return ()
    try:
        argv = json.loads(text)
    except ValueError:
        argv = None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv) or "--no-shell" not in argv:
        raise ConfigError(f"supervise: couldn't read OMNI_POOL_SALLOC={text[:80]!r} (expected the job's salloc "
                          f"--no-shell argv as a JSON list of strings)")
    return tuple(argv)
