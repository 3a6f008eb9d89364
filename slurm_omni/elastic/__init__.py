"""slurm-omni for your own training script: layout, checkpoints, heartbeats, the stop protocol.

A plain torch script adopts it with a few lines (``docs/own-script.md``; ``examples/own-script/``)::

    from slurm_omni import elastic

    with elastic.init(stages=("vision", "text")) as run:            # layout, groups, heartbeat, signals
        ckpt = run.checkpointer(modules={"encoder": encoder}, critical=["encoder"],
                                optimizers={"adamw": opt}, state={"sched": sched, "loader": loader})
        start = run.restore()                                     # newest complete step, or 0
        accum = run.layout.accumulation(GLOBAL_BATCH, MICRO_BATCH) # keeps the global batch at any dp
        for step in range(start, max_steps):
            with run.timer.data():
                batch = next(batches)
            ...                                                   # forward, backward, optimizer
            run.end_step(step + 1, checkpoint_every=10, loss=loss, samples=n)  # beats, saves, exits 75

A flat script need not re-indent: ``run = elastic.init(...)`` at the top, ``run.end_step(...)`` in
the loop; the run ends itself at exit (or ``run.close()``) as ``with`` would (docs/own-script.md).

The same script runs under slurm-omni's batch script (``[training] command = [...]`` in the job
file), under ``torchrun`` (one stage per rank... or all of them: every rank runs every stage) and as
one plain process. Exit codes (:mod:`~slurm_omni.elastic.codes`): 0 done, 75 checkpointed on a stop
signal (requeue me), 78 bad input (no restart helps), anything else failed.

Names load on first use: the requeue manager imports the exit codes without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "Layout": "layout", "accumulation_for": "layout",
    "Checkpointer": "checkpointer", "CheckpointMismatch": "checkpointer", "Resume": "checkpointer",
    "Stateful": "checkpointer", "NotStateful": "checkpointer",
    "Heartbeat": "heartbeat", "MetricsLog": "metrics", "StepTimer": "timing", "StopSignals": "stop",
    "TimedStage": "pipelining",
    "Run": "run", "Groups": "run", "init": "run", "init_process_groups": "run", "device_for": "run",
    "EXIT_DONE": "codes", "EXIT_CHECKPOINTED": "codes", "EXIT_FAILED": "codes", "EXIT_BAD_INPUT": "codes",
}

if TYPE_CHECKING:
    from slurm_omni.elastic.checkpointer import (
        Checkpointer,
        CheckpointMismatch,
        NotStateful,
        Resume,
        Stateful,
    )
    from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
    from slurm_omni.elastic.heartbeat import Heartbeat
    from slurm_omni.elastic.layout import Layout, accumulation_for
    from slurm_omni.elastic.metrics import MetricsLog
    from slurm_omni.elastic.pipelining import TimedStage
    from slurm_omni.elastic.run import Groups, Run, device_for, init, init_process_groups
    from slurm_omni.elastic.stop import StopSignals
    from slurm_omni.elastic.timing import StepTimer


def preload() -> None:
    """Import every module of the API now (torch, the checkpoint engine, pipelining): what a warm
    standby (``omni standby serve``) does once before it forks trainers that then start at once."""
    for module in sorted(set(_LAZY.values())):
        importlib.import_module(f"{__name__}.{module}")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "EXIT_BAD_INPUT", "EXIT_CHECKPOINTED", "EXIT_DONE", "EXIT_FAILED", "CheckpointMismatch", "Checkpointer",
    "Groups", "Heartbeat", "Layout", "MetricsLog", "NotStateful", "Resume", "Run", "Stateful", "StepTimer", "StopSignals",
    "TimedStage", "accumulation_for", "device_for", "init", "init_process_groups", "preload",
]
