"""A process that saves checkpoints until it is killed (run by test_ckpt_crash in a forkserver child)."""

from __future__ import annotations

from multiprocessing.synchronize import Event
from pathlib import Path

import torch

from slurm_omni.checkpoint import CheckpointConfig, CheckpointEngine, ShardState, latest_step


def content(step: int) -> ShardState:
    """A state that is a function of the step alone, so any checkpoint can be checked bitwise."""
    g = torch.Generator().manual_seed(step)
    return ShardState(
        modules={"vision_encoder": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)},
                 "projector": {"p": torch.full((64,), float(step)).to(torch.bfloat16)},
                 "text_decoder": {"e": torch.randn(512, 128, generator=g)}},
        optimizer={"text_decoder": {"state": {0: {"step": torch.tensor(float(step))}}, "lr": 1e-3 * step}},
        state={"global_step": step})


def save_forever(root: str, ready: Event) -> None:
    torch.set_num_threads(1)
    engine = CheckpointEngine(CheckpointConfig(root=Path(root), keep_last=2))
    step = (latest_step(Path(root)) or 0) + 1
    engine.prepare(content(step))
    ready.set()
    while True:
        engine.save(step, content(step), sync=step % 3 == 0)
        step += 1
