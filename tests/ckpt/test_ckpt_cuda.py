"""Device tensors: snapshot through page-locked buffers, restore through staging onto the device.

Skipped without CUDA; bench/ckpt_gpu.sh runs it on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.states import assert_same, engine, modules
from slurm_omni.checkpoint import ShardState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_device_state_round_trips_bitwise_into_device_targets(tmp_path: Path) -> None:
    host = modules(4)
    on_device = {m: {k: t.cuda() for k, t in sd.items()} for m, sd in host.items()}
    with engine(tmp_path) as eng:
        assert eng._files.arena.pin
        eng.save(4, ShardState(modules=on_device))
    targets = {m: {k: torch.zeros_like(t) for k, t in sd.items()} for m, sd in on_device.items()}
    with engine(tmp_path) as eng, eng.restore(into=targets) as r:
        r.wait()
        assert all(t.is_cuda for sd in targets.values() for t in sd.values())
        assert_same({m: {k: t.cpu() for k, t in sd.items()} for m, sd in targets.items()}, host)
    with engine(tmp_path) as eng, eng.restore(device="cuda") as r:
        got = r.module("text_decoder")
        assert all(t.is_cuda for t in got.values())
        assert_same({k: t.cpu() for k, t in got.items()}, host["text_decoder"])


def test_cuda_rng_streams_are_saved_and_restored(tmp_path: Path) -> None:
    torch.cuda.manual_seed_all(5)
    torch.rand(3, device="cuda")
    with engine(tmp_path) as eng:
        eng.save(1, ShardState(modules={"m": {"w": torch.ones(1)}}))
    want = torch.rand(4, device="cuda").cpu()
    torch.cuda.manual_seed_all(99)
    with engine(tmp_path) as eng, eng.restore():
        pass
    assert torch.equal(torch.rand(4, device="cuda").cpu(), want)
