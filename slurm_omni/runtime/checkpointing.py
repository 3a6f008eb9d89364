"""The built-in trainer's checkpoints, through the public :class:`slurm_omni.elastic.Checkpointer`.

Every rank saves its shard: the stage's modules (``vision``: vision_encoder, projector; ``text``:
text_decoder), each with its own optimiser, and the data plan's positions as a small state. The
positions are global (the same on every rank), so a run with another replica count takes them from
any old replica (the checkpointer's default re-cut) and cuts the batch by itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slurm_omni.config.training import TrainingConfig
from slurm_omni.elastic.checkpointer import Checkpointer
from slurm_omni.elastic.layout import Layout as PublicLayout
from slurm_omni.runtime.data import DataPlan
from slurm_omni.runtime.layout import NUM_STAGES, Layout

LOAD_ORDER = ("vision_encoder", "projector", "text_decoder")
"""The order the first step needs the modules; the vision tower is the critical one."""
STAGE_NAMES = ("vision", "text")
SCRIPT = "omni train"


@dataclass(frozen=True, slots=True)
class Restored:
    global_step: int
    state: dict[str, Any]
    layout_changed: bool
    load_s: float


def public_layout(layout: Layout) -> PublicLayout:
    """The runtime's layout in the public API's terms (same ranks, stages and folders)."""
    return PublicLayout(
        rank=layout.rank, world_size=layout.world_size, local_rank=layout.local_rank,
        stage_names=STAGE_NAMES[:NUM_STAGES], stages=layout.stages, data_parallel_size=layout.data_parallel_size,
        data_parallel_rank=layout.data_parallel_rank, incarnation=layout.incarnation, job_id=layout.job_id,
        job_name=os.environ.get("OMNI_JOB_NAME") or "local", ckpt_dir=layout.ckpt_dir,
        heartbeat_dir=layout.heartbeat_dir, metrics_dir=layout.metrics_dir, master_addr=layout.master_addr,
        master_port=layout.master_port, heartbeat_interval_s=layout.heartbeat_interval_s)


class _Positions:
    """The data plan as a ``state_dict()`` object."""

    def __init__(self, plan: DataPlan) -> None:
        self.plan = plan

    def state_dict(self) -> dict[str, Any]:
        return self.plan.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan.load_state(state)


class StageCheckpointer:
    """Saves and restores one rank's modules, optimisers and the data positions."""

    def __init__(self, cfg: TrainingConfig, layout: Layout, parts: Mapping[str, nn.Module],
                 optimizers: Mapping[str, torch.optim.Optimizer], plan: DataPlan) -> None:
        self.cfg = cfg
        self.layout = layout
        self.names = tuple(sorted(parts, key=lambda n: LOAD_ORDER.index(n) if n in LOAD_ORDER else len(LOAD_ORDER)))
        self.micro_batches = 0
        self.step = -1
        self.checkpointer = Checkpointer(
            public_layout(layout), modules={n: parts[n] for n in self.names}, critical=self.names[:1],
            optimizers=optimizers, state={"data": _Positions(plan)}, extra=self._extra,
            keep_last=cfg.checkpoint.keep_last, script=SCRIPT)

    def _extra(self) -> dict[str, Any]:
        return {"samples_seen": self.step * self.cfg.parallel.global_batch_size,
                "layout": {"data_parallel_size": self.layout.data_parallel_size,
                           "micro_batches": self.micro_batches, "schedule": self.cfg.parallel.schedule,
                           "incarnation": self.layout.incarnation}}

    @property
    def last_persisted_step(self) -> int | None:
        return self.checkpointer.last_persisted_step

    @property
    def last_blocking_s(self) -> float | None:
        return self.checkpointer.last_blocking_s

    @property
    def last_persist_s(self) -> float | None:
        return self.checkpointer.last_persist_s

    def prepare(self, micro_batches: int) -> None:
        """Allocate the host buffers before the first step, so the first save blocks no longer than later ones."""
        self.micro_batches = micro_batches
        self.checkpointer.prepare()

    def save(self, global_step: int, *, sync: bool) -> None:
        """Checkpoint ``global_step``; async unless ``sync`` (signals and the last step)."""
        self.step = global_step
        self.checkpointer.save(global_step, sync=sync)

    def poll(self) -> None:
        self.checkpointer.poll()

    def restore_latest(self, reduce_min: Callable[[int], int] = lambda step: step) -> Restored | None:
        """Load the newest checkpoint every rank's shards verify into the modules, optimisers and data
        plan; ``reduce_min`` is the ranks' collective minimum (checkpoint/agree.py)."""
        resume = self.checkpointer.restore(reduce_min)
        if resume is None:
            return None
        return Restored(global_step=resume.step, state=resume.extra or {}, layout_changed=resume.layout_changed,
                        load_s=resume.load_s)

    def close(self) -> None:
        self.checkpointer.close()
