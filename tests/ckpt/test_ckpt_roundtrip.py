"""Save then restore reproduces every tensor bitwise, every structure, and every RNG stream."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.states import assert_same, engine, modules, optimizer_state, shard_state
from slurm_omni.checkpoint import ShardState, capture_rng_state, restore_rng_state
from slurm_omni.checkpoint.tree import DpSplit, escape, flatten, tensors_of, unflatten
from slurm_omni.errors import CheckpointError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


def odd_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {f"t.{str(d).removeprefix('torch.')}": (torch.randn(5, 3, generator=g) * 40).to(d) for d in DTYPES}
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    out |= {
        "special.f32": special, "special.bf16": special.to(torch.bfloat16),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 7), "transposed": torch.randn(4, 6, generator=g).t(),
        "strided": torch.arange(40, dtype=torch.int32)[::3], "key/with%slash": torch.ones(2), "": torch.zeros(1),
    }
    return out


def test_every_dtype_and_shape_comes_back_bitwise(tmp_path: Path) -> None:
    want = odd_tensors()
    state = ShardState(modules={"vision_encoder": want})
    with engine(tmp_path) as eng:
        eng.save(1, state)
    with engine(tmp_path) as eng:
        r = eng.restore()
        assert r is not None and r.step == 1
        assert_same(r.module("vision_encoder"), {k: v.contiguous() for k, v in want.items()})
        r.close()


def test_modules_optimizer_and_runtime_state_round_trip(tmp_path: Path) -> None:
    with engine(tmp_path) as eng:
        eng.save(10, shard_state(10))
        eng.save(20, shard_state(20))
    with engine(tmp_path) as eng, eng.restore() as r:
        assert r is not None and r.step == 20
        for name, sd in modules(20).items():
            assert_same(r.module(name), sd, name)
        opt = r.optimizer("text_decoder")
        assert_same(opt, optimizer_state(20))
        assert isinstance(next(iter(opt["state"])), int) and opt["param_groups"][0]["betas"] == (0.9, 0.95)
        assert r.optimizer("vision_encoder") is None
        assert r.state == {"global_step": 20, "data": {"pairs": 60, "text": 100}}
        assert not r.layout_changed and r.states == [r.state]


def test_optimizer_state_loads_into_a_real_optimizer(tmp_path: Path) -> None:
    net = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(3, 8)).sum().backward()
    opt.step()
    with engine(tmp_path) as eng:
        eng.save(1, ShardState(modules={"m": net.state_dict()}, optimizer={"m": opt.state_dict()}), sync=True)
    net2 = torch.nn.Linear(8, 4)
    opt2 = torch.optim.AdamW(net2.parameters())
    with engine(tmp_path) as eng, eng.restore(into={"m": net2.state_dict()}) as r:
        opt2.load_state_dict(r.optimizer("m"))
        assert_same(net2.state_dict(), net.state_dict())
        assert_same(opt2.state_dict(), opt.state_dict())


def test_restore_into_targets_loads_in_place(tmp_path: Path) -> None:
    src = modules(3)
    with engine(tmp_path) as eng:
        eng.save(3, ShardState(modules=src))
    targets = {name: {k: torch.zeros_like(v) for k, v in sd.items()} for name, sd in src.items()}
    before = {k: v.data_ptr() for k, v in targets["vision_encoder"].items()}
    with engine(tmp_path) as eng, eng.restore(into=targets) as r:
        r.wait()
    assert {k: v.data_ptr() for k, v in targets["vision_encoder"].items()} == before
    assert_same(targets, src)


def test_every_rng_stream_continues_as_if_never_stopped(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.rand(17), random.random(), np.random.rand(5)
    with engine(tmp_path) as eng:
        eng.save(1, ShardState(modules={"m": {"w": torch.ones(2)}}))
    expected = [random.random() for _ in range(3)], np.random.rand(4).tolist(), torch.rand(4).tolist()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    with engine(tmp_path) as eng, eng.restore():
        pass
    got = [random.random() for _ in range(3)], np.random.rand(4).tolist(), torch.rand(4).tolist()
    assert got == expected


def test_rng_state_is_json_and_round_trips() -> None:
    import json

    state = json.loads(json.dumps(capture_rng_state()))
    a = random.random(), float(np.random.rand()), float(torch.rand(1))
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


@pytest.mark.parametrize("key", ["a/b", "%", "%2F", "", ".", "a.b.c", "naïve"])
def test_escaped_keys_never_collide(key: str) -> None:
    tree = {key: torch.ones(1), "a%2Fb": torch.zeros(1), 3: [torch.ones(2), (1, "x", None)]}
    skeleton, leaves = flatten(tree, where="m")
    assert len({leaf.path for leaf in leaves}) == len(leaves)
    by_path = {leaf.path: leaf.tensor for leaf in leaves}
    assert_same(unflatten(skeleton, by_path.__getitem__), tree)
    assert "/" not in escape(key)


@pytest.mark.parametrize("tree", [
    {"a/b": torch.ones(1), "%": torch.zeros(1), "": torch.ones(2), ".": torch.ones(3), 3: [torch.ones(2), (1, "x", None)]},
    {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(1.0)}, 1: {"exp_avg": torch.zeros(2)}},
     "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.99), "foreach": None}]},
    {"w": torch.nn.Parameter(torch.ones(2)), "shape": torch.Size([2, 3]), "split": DpSplit(torch.ones(4), 0)},
    {"np": np.arange(3), "scalar": np.float32(2.0), "nested": {"deeper": {"t": torch.ones(1)}}},
], ids=["escaped-keys", "optimizer", "parameter-size-dpsplit", "numpy"])
def test_a_restores_targets_are_flattens_tensors(tree: dict[object, object]) -> None:
    """``tensors_of`` (the restore's walk of its targets) finds the tensors ``flatten`` does, by the same
    paths, the same objects (numpy arrays as flatten's own views)."""
    _, leaves = flatten(tree, where="m")
    found = tensors_of(tree, where="m")
    assert sorted(found) == sorted(leaf.path for leaf in leaves)
    for leaf in leaves:
        assert found[leaf.path].data_ptr() == leaf.tensor.data_ptr()


@pytest.mark.parametrize("tree", [{True: torch.ones(1)}, {1.5: torch.ones(1)}, {"a": object()}])
def test_a_restores_targets_that_flatten_refuses_are_refused_alike(tree: dict[object, object]) -> None:
    with pytest.raises(CheckpointError) as flat:
        flatten(tree, where="m")
    with pytest.raises(CheckpointError) as walked:
        tensors_of(tree, where="m")
    assert str(walked.value) == str(flat.value)


def test_h5ls_lists_the_modules_and_h5dump_prints_bfloat16_values(tmp_path: Path) -> None:
    if shutil.which("h5ls") is None:
        pytest.skip("hdf5-tools not installed (scripts/setup.sh installs it)")
    with engine(tmp_path) as eng:
        eng.save(5, ShardState(modules={"vision_encoder": {"w": torch.tensor([1.5, -2.25]).to(torch.bfloat16)},
                                        "projector": {"p": torch.ones(2, 2)}}))
    h5 = tmp_path / "step-5" / "rank-00000.h5"
    listing = subprocess.run(["h5ls", "-r", str(h5)], capture_output=True, text=True, check=True).stdout
    assert "/vision_encoder/model/w" in listing and "/projector/model/p" in listing
    dump = subprocess.run(["h5dump", "-d", "/vision_encoder/model/w", str(h5)], capture_output=True, text=True,
                          check=True).stdout
    assert "1.5, -2.25" in dump and "xxh3_64" in dump
