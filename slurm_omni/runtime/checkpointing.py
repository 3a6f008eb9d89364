"""The runtime's side of the checkpoint engine: what goes into a checkpoint and how it comes back.

Each stage is one shard (``stage-0`` = vision encoder + projector, ``stage-1`` = text decoder); only
replica 0 of a stage writes it (the replicas hold identical weights). The vision stage is the
committer. The meta holds the global step, every source's data position and the layout that wrote it;
positions are global, so a run with another replica count re-cuts them by itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slurm_omni.checkpoint import CheckpointEngine, capture_rng_state, find_latest_complete, restore_rng_state
from slurm_omni.config.training import TrainingConfig
from slurm_omni.errors import CheckpointError
from slurm_omni.runtime.data import DataPlan
from slurm_omni.runtime.layout import NUM_STAGES, Layout
from slurm_omni.runtime.model import MODULES_BY_STAGE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Restored:
    global_step: int
    meta: dict[str, Any]
    load_s: float


class StageCheckpointer:
    """Saves and restores one stage's modules, optimiser and the data positions."""

    def __init__(self, cfg: TrainingConfig, layout: Layout, module: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.cfg = cfg
        self.layout = layout
        self.module = module
        self.optimizer = optimizer
        self.writes = layout.data_parallel_rank == 0
        self.engine = CheckpointEngine(layout.ckpt_dir, shard=f"stage-{layout.stage}", shard_index=layout.stage,
                                       num_shards=NUM_STAGES, keep_last=cfg.checkpoint.keep_last)
        self.last_step: int | None = None
        self.last_blocking_s: float | None = None

    def _modules(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: getattr(self.module, name).state_dict() for name in MODULES_BY_STAGE[self.layout.stage]}

    def _meta(self, global_step: int, plan: DataPlan, micro_batches: int) -> dict[str, Any]:
        return {
            "global_step": global_step,
            "data": plan.state(),
            "samples_seen": global_step * self.cfg.parallel.global_batch_size,
            "layout": {"data_parallel_size": self.layout.data_parallel_size, "micro_batches": micro_batches,
                       "schedule": self.cfg.parallel.schedule, "incarnation": self.layout.incarnation},
            "rng": capture_rng_state(),
        }

    def save(self, global_step: int, plan: DataPlan, micro_batches: int, *, sync: bool) -> None:
        """Checkpoint ``global_step``; async unless ``sync`` (signals and the last step)."""
        if not self.writes:
            return
        t0 = time.monotonic()
        save = self.engine.save_sync if sync else self.engine.save
        save(global_step, modules=self._modules(), optimizer=self.optimizer.state_dict(),
             meta=self._meta(global_step, plan, micro_batches))
        self.last_blocking_s = time.monotonic() - t0
        self.last_step = global_step
        log.info("checkpoint: step %d %s (blocked %.3fs)", global_step, "saved" if sync else "started",
                 self.last_blocking_s)

    def restore_latest(self, plan: DataPlan) -> Restored | None:
        """Load the newest complete checkpoint into the module, optimiser and data plan."""
        if find_latest_complete(self.layout.ckpt_dir) is None:
            return None
        t0 = time.monotonic()
        names = MODULES_BY_STAGE[self.layout.stage]
        handle = self.engine.restore(step=None, critical=names[:1])
        for name in names:
            getattr(self.module, name).load_state_dict(handle.module(name))
        self.optimizer.load_state_dict(handle.optimizer())
        handle.wait_all()
        meta = dict(handle.meta)
        if int(meta.get("global_step", -1)) != handle.step:
            raise CheckpointError(f"runtime: couldn't resume: checkpoint step {handle.step} has meta for "
                                  f"step {meta.get('global_step')}")
        plan.load_state(meta["data"])
        if "rng" in meta:
            restore_rng_state(meta["rng"])
        self.last_step = handle.step
        return Restored(global_step=handle.step, meta=meta, load_s=time.monotonic() - t0)

    def close(self) -> None:
        self.engine.wait()
        self.engine.close()
