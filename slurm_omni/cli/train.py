"""``omni train --config job.toml``: the program srun starts on every rank."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Job file; its [training] table is used.")
def train(config_path: Path) -> None:
    """Train one rank of the multimodal pipeline; the layout comes from RANK, WORLD_SIZE, OMNI_* (see
    slurm_omni/runtime/layout.py). Exits 0 when done, 75 after a checkpoint on SIGUSR1/SIGTERM
    (requeue me), anything else on failure."""
    from slurm_omni.runtime.signals import StopRequest

    stop = StopRequest().install()   # before torch is imported: an early signal is kept, not fatal
    from slurm_omni.config.training import load_training_file
    from slurm_omni.runtime.layout import Layout
    from slurm_omni.runtime.loop import Trainer

    cfg = load_training_file(config_path)
    layout = Layout.from_env()
    logging.getLogger(__name__).info("train: rank %d stage %s replica %d/%d", layout.rank, layout.stage_name,
                                     layout.data_parallel_rank, layout.data_parallel_size)
    code = Trainer(cfg, layout, stop).run()
    stop.ignore_while_exiting()      # a TERM during interpreter teardown would otherwise kill us (143)
    # Everything is saved, closed and out of the process group: leave without the interpreter's
    # teardown of torch and gloo, which took over 4 s on a loaded machine, longer than the embedded
    # cluster's KillWait (5 s): a cancelled job's ranks were SIGKILLed after saving, and the batch
    # shell with them, before it could say that it was not requeueing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
