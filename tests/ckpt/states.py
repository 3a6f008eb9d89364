"""Training-shaped state for the checkpoint tests: three modules, an AdamW state, data positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slurm_omni.checkpoint import CheckpointConfig, CheckpointEngine, ShardLayout, ShardState

MODULES = ("vision_encoder", "projector", "text_decoder")


def modules(seed: int, *, scale: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "vision_encoder": {f"blocks.{i}.weight": torch.randn(64 * scale, 32, generator=g) for i in range(4)}
        | {"patch.bias": torch.randn(32, generator=g).to(torch.bfloat16)},
        "projector": {"proj.weight": torch.randn(16, 32, generator=g, dtype=torch.float64),
                      "proj.steps": torch.tensor(seed, dtype=torch.int64)},
        "text_decoder": {"embed.weight": torch.randn(128 * scale, 32, generator=g).to(torch.bfloat16),
                         "lm_head.weight": torch.randn(32, 128, generator=g)},
    }


def optimizer_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        net(torch.randn(3, 8)).square().sum().backward()
        opt.step()
    return opt.state_dict()


def shard_state(seed: int, *, scale: int = 1) -> ShardState:
    return ShardState(modules=modules(seed, scale=scale),
                      optimizer={"text_decoder": optimizer_state(seed)},
                      state={"global_step": seed, "data": {"pairs": 3 * seed, "text": 5 * seed}})


def engine(root: Path, **config: Any) -> CheckpointEngine:
    layout = config.pop("layout", ShardLayout())
    return CheckpointEngine(CheckpointConfig(root=root, **config), layout)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bitwise equality through nested dicts, lists, tuples and tensors (dtype included)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(_bytes(got), _bytes(want)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert got == want, where


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
