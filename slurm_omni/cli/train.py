"""``omni train --config job.toml``: the program srun starts on every rank.

The built-in trainer is a user of the public API like any script (``docs/own-script.md``): the
layout, process groups, heartbeat, stop protocol and checkpoints come from ``slurm_omni.elastic``;
the model, data and pipeline from ``slurm_omni.runtime``.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Job file; its [training] table is used.")
def train(config_path: Path) -> None:
    """Train one rank of the multimodal pipeline; the layout comes from RANK, WORLD_SIZE, OMNI_* (see
    slurm_omni/elastic/layout.py). Exits 0 when done, 75 after a checkpoint on SIGUSR1/SIGTERM
    (requeue me), 78 on bad input (another script's checkpoint), anything else on failure."""
    from slurm_omni import elastic

    stop = elastic.StopSignals().install()   # before torch is imported: an early signal is kept, not fatal
    from slurm_omni.config.training import load_training_file
    from slurm_omni.runtime.loop import GAUGES, Trainer
    from slurm_omni.runtime.model import STAGE_NAMES

    cfg = load_training_file(config_path)
    # The trainer ends the process: 0 when done, 75 after a stop signal's checkpoint, both with
    # run.exit(fast=True) once saved and closed (the interpreter's teardown of torch and gloo
    # outlasted the cluster's KillWait under load); an error leaves the run's with block, which
    # writes the last heartbeat and exits with the error's code.
    with elastic.init(stages=STAGE_NAMES, max_steps=cfg.max_steps, backend=cfg.parallel.backend, stop=stop,
                      metric_help=GAUGES) as run:
        Trainer(cfg, run).train()
