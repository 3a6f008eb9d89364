"""The pipeline schedule and the gradient collectives of one rank.

Its process groups are the public API's (``run.groups`` of ``slurm_omni.elastic.init``; every rank
creates every group, in the same order, as torch.distributed requires):
- one pipeline group per replica ``r``: ranks ``(r, dp + r)`` (its vision rank and its text rank);
  the schedule's send/recv run in it, and the global gradient norm is summed over it;
- one data-parallel group per stage: that stage's ``dp`` ranks; gradients are averaged in it.
Colocated ranks (both stages on one rank) have one-rank pipeline groups and one data-parallel group
of all ranks; their two stages run under the looped schedules (BFS for GPipe, interleaved 1F1B).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase

from slurm_omni import elastic
from slurm_omni.config.training import ModelConfig, OptimConfig, ParallelConfig
from slurm_omni.runtime.model import STAGE_NAMES, lm_loss

log = logging.getLogger(__name__)


def build_schedule(model: ModelConfig, parallel: ParallelConfig, modules: dict[int, nn.Module],
                   micro_batches: int, device: torch.device, group: dist.ProcessGroup,
                   timer: elastic.StepTimer) -> _PipelineSchedule:
    """The schedule of this rank's stage(s). Shapes are given up front (static metadata), so a stage
    never runs an extra forward to infer them. ``timer`` (the run's) gets the stages' own compute
    time (:class:`slurm_omni.elastic.TimedStage`), without their waits for the peer stage."""
    b = parallel.micro_batch_size
    ids = torch.zeros(b, dtype=torch.int64, device=device)
    ids_act = torch.zeros(b, dtype=torch.float64, device=device, requires_grad=True)  # model.ids_as_activation
    image_tokens = torch.zeros(b, model.num_patches, model.text_width, device=device, requires_grad=True)
    images = torch.zeros(b, model.image_size, model.image_size, model.channels, device=device)
    logits = torch.zeros(b, model.seq_len, model.vocab_size, device=device, requires_grad=True)
    shapes: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {
        0: ((images, ids), (image_tokens, ids_act)), 1: ((image_tokens, ids_act), (logits,))}
    stages: list[_PipelineStageBase] = [
        elastic.TimedStage(module, index, len(STAGE_NAMES), device, input_args=shapes[index][0],
                           output_args=shapes[index][1], group=group, timer=timer)
        for index, module in sorted(modules.items())]
    if len(stages) == 1:
        single = ScheduleGPipe if parallel.schedule == "gpipe" else Schedule1F1B
        return single(stages[0], n_microbatches=micro_batches, loss_fn=lm_loss)
    looped = ScheduleLoopedBFS if parallel.schedule == "gpipe" else ScheduleInterleaved1F1B
    return looped(stages, n_microbatches=micro_batches, loss_fn=lm_loss)


def average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, dp_size: int) -> None:
    """Average this rank's gradients over its replicas with one flat all-reduce."""
    if dp_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dp_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_global_norm(params: list[nn.Parameter], group: dist.ProcessGroup, max_norm: float) -> float:
    """Clip by the norm over both stages' gradients; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device
    sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum().reshape(1).to(device)
    dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


def lr_at(optim: OptimConfig, global_step: int, max_steps: int) -> float:
    """Learning rate for the step that takes the job from ``global_step`` to ``global_step + 1``.
    A function of the global step only, so a resized or resumed run follows the same curve."""
    if global_step < optim.warmup_steps:
        return optim.lr * (global_step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (global_step - optim.warmup_steps) / span)
    if optim.schedule == "linear":
        return optim.lr + (optim.min_lr - optim.lr) * progress
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))
