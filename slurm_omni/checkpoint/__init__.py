"""The checkpoint store: async, atomic, checksummed h5py checkpoints with critical-module-first restore.

How the training runtime uses it::

    from slurm_omni.checkpoint import CheckpointConfig, CheckpointEngine, ShardLayout, ShardState

    engine = CheckpointEngine(CheckpointConfig(root=ckpt_dir, keep_last=3,
                                               load_order=("vision_encoder", "projector", "text_decoder"),
                                               critical=("vision_encoder", "projector")),
                              ShardLayout(rank=rank, world_size=world, stage="vision",
                                          data_parallel_rank=dp_rank, data_parallel_size=dp_size))
    restored = engine.restore(into={"vision_encoder": model.vision_encoder.state_dict(), ...})
    if restored is not None:           # critical weights are in place, RNG streams restored
        step = restored.step
        data.load(restored.state)      # None if this stage's data-parallel size changed: see .states
        opt.load_state_dict(restored.optimizer("vision_encoder"))  # waits for that unit only
    engine.prepare(state())            # allocate host buffers before the first step
    while training:
        ...
        if step % every == 0:
            engine.save(step, state())             # blocks for the snapshot only
    engine.close()

``ShardState(modules={name: state_dict}, optimizer={name: opt_state}, state=json_able)``; wrap a tensor
that is cut across data-parallel ranks (ZeRO) in ``DpSplit``. The on-disk format is in ``format.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# torch takes seconds to import; ``omni ckpt ls`` and the requeue manager use format.py alone, so the
# names below load on first use.
_LAZY = {
    "CheckpointConfig": "engine", "CheckpointEngine": "engine", "SaveResult": "engine",
    "CheckpointCorrupt": "format", "find_latest_complete": "format", "latest_step": "format",
    "PersistStats": "persist", "Restore": "restore", "SaveRequest": "signals",
    "ShardLayout": "snapshot", "ShardState": "snapshot", "DpSplit": "tree",
    "capture_rng_state": "rng:capture", "restore_rng_state": "rng:restore",
}

if TYPE_CHECKING:
    from slurm_omni.checkpoint.engine import CheckpointConfig, CheckpointEngine, SaveResult
    from slurm_omni.checkpoint.format import CheckpointCorrupt, find_latest_complete, latest_step
    from slurm_omni.checkpoint.persist import PersistStats
    from slurm_omni.checkpoint.restore import Restore
    from slurm_omni.checkpoint.rng import capture as capture_rng_state
    from slurm_omni.checkpoint.rng import restore as restore_rng_state
    from slurm_omni.checkpoint.signals import SaveRequest
    from slurm_omni.checkpoint.snapshot import ShardLayout, ShardState
    from slurm_omni.checkpoint.tree import DpSplit


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr or name)


__all__ = [
    "CheckpointConfig", "CheckpointCorrupt", "CheckpointEngine", "DpSplit", "PersistStats",
    "Restore", "SaveRequest", "SaveResult", "ShardLayout", "ShardState", "capture_rng_state",
    "find_latest_complete", "latest_step", "restore_rng_state",
]
