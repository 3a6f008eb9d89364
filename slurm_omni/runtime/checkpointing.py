"""The runtime's side of the checkpoint engine: what goes into a checkpoint and how it comes back.

Every rank saves its shard (the engine writes a replicated tensor once, from one replica, and rank 0
commits once every rank's shard is durable). The stage names the shard's modules: ``vision``
(vision_encoder, projector) and ``text`` (text_decoder); each module has its own optimiser. The
runtime state saved with every shard holds the global step, each source's data position and the
layout that wrote it. The positions are global (the same on every rank), so a run with another
replica count takes them from any old rank and re-cuts the batch by itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slurm_omni.checkpoint import CheckpointConfig, CheckpointEngine, ShardLayout, ShardState
from slurm_omni.checkpoint.agree import Loaded, restore_agreed
from slurm_omni.checkpoint.engine import SaveResult
from slurm_omni.config.training import TrainingConfig
from slurm_omni.errors import CheckpointError
from slurm_omni.runtime.data import DataPlan
from slurm_omni.runtime.layout import Layout

log = logging.getLogger(__name__)

LOAD_ORDER = ("vision_encoder", "projector", "text_decoder")
"""The order the first step needs the modules; the vision tower is the critical one."""


@dataclass(frozen=True, slots=True)
class Restored:
    global_step: int
    state: dict[str, Any]
    layout_changed: bool
    load_s: float


def shard_layout(layout: Layout) -> ShardLayout:
    return ShardLayout(rank=layout.rank, world_size=layout.world_size, stage=layout.stage_name,
                       data_parallel_rank=layout.data_parallel_rank,
                       data_parallel_size=layout.data_parallel_size)


class StageCheckpointer:
    """Saves and restores one rank's modules, optimisers and the data positions."""

    def __init__(self, cfg: TrainingConfig, layout: Layout, parts: Mapping[str, nn.Module],
                 optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self.cfg = cfg
        self.layout = layout
        self.parts = parts
        self.optimizers = optimizers
        self.names = tuple(parts)
        self.engine = CheckpointEngine(
            CheckpointConfig(root=layout.ckpt_dir, keep_last=cfg.checkpoint.keep_last, load_order=LOAD_ORDER,
                             critical=self.names[:1], incarnation=f"{layout.job_id}.{layout.incarnation}",
                             incarnation_number=layout.incarnation),
            shard_layout(layout))
        self.last_step: int | None = None
        """Newest step saved or being saved."""
        self.last_persisted_step: int | None = None
        """Newest step whose shard of this rank is durable (restored counts too)."""
        self.last_blocking_s: float | None = None
        self.last_persist_s: float | None = None
        self._pending: SaveResult | None = None

    def _state(self, global_step: int, plan: DataPlan, micro_batches: int) -> ShardState:
        return ShardState(
            modules={name: self.parts[name].state_dict() for name in self.names},
            optimizer={name: self.optimizers[name].state_dict() for name in self.names},
            state={
                "global_step": global_step,
                "data": plan.state(),
                "samples_seen": global_step * self.cfg.parallel.global_batch_size,
                "layout": {"data_parallel_size": self.layout.data_parallel_size, "micro_batches": micro_batches,
                           "schedule": self.cfg.parallel.schedule, "incarnation": self.layout.incarnation},
            })

    def prepare(self, plan: DataPlan, micro_batches: int) -> None:
        """Allocate the host buffers before the first step, so the first save blocks no longer than later ones."""
        self.engine.prepare(self._state(-1, plan, micro_batches))

    def save(self, global_step: int, plan: DataPlan, micro_batches: int, *, sync: bool) -> None:
        """Checkpoint ``global_step``; async unless ``sync`` (signals and the last step)."""
        self.poll()
        result = self.engine.save(global_step, self._state(global_step, plan, micro_batches), sync=sync)
        self.last_blocking_s = result.blocking_s
        self.last_step = global_step
        self._pending = result
        self.poll()
        log.info("checkpoint: step %d %s (blocked %.3fs)", global_step, "saved" if sync else "started",
                 result.blocking_s)

    def poll(self) -> None:
        """Pick up the persist time of a finished background save."""
        if self._pending is not None and self._pending.persisted.done():
            stats = self._pending.persisted.result()
            if not stats.fenced:   # a newer incarnation started on the root: nothing was saved
                self.last_persist_s = stats.persist_s
                self.last_persisted_step = stats.step
            self._pending = None

    def restore_latest(self, plan: DataPlan, reduce_min: Callable[[int], int] = lambda step: step) -> Restored | None:
        """Load the newest checkpoint every rank's shards verify into the modules, optimisers and data
        plan; ``reduce_min`` is the ranks' collective minimum (checkpoint/agree.py)."""
        t0 = time.monotonic()
        return restore_agreed(lambda bound: self._restore(plan, bound, t0), reduce_min, rank=self.layout.rank)

    def _restore(self, plan: DataPlan, bound: int | None, t0: float) -> Loaded[Restored] | None:
        session = self.engine.restore(max_step=bound)   # critical: the config's, self.names[:1]
        if session is None:
            return None
        try:
            for name in self.names:
                self.parts[name].load_state_dict(session.module(name))
                self.optimizers[name].load_state_dict(session.optimizer(name))
            state = session.state if session.state is not None else session.states[0]
            if not isinstance(state, dict) or int(state.get("global_step", -1)) != session.step:
                raise CheckpointError(f"runtime: couldn't resume from step-{session.step}: its runtime "
                                      f"state is for step {state.get('global_step') if isinstance(state, dict) else state}")
            plan.load_state(state["data"])
            session.wait()
            changed = session.layout_changed
        finally:
            session.close()
        self.last_step = self.last_persisted_step = session.step
        return Loaded(session.step, Restored(global_step=session.step, state=state, layout_changed=changed,
                                             load_s=time.monotonic() - t0), session.fallbacks)

    def close(self) -> None:
        self.engine.close()
