"""Several ranks write one checkpoint together; restore onto the same or another data-parallel size.

Ranks run as threads here: the engine coordinates through the file system only (shard records, then
rank 0's commit), never through collectives, so threads exercise the same protocol as processes.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.states import assert_same, engine
from slurm_omni.checkpoint import DpSplit, ShardLayout, ShardState
from slurm_omni.checkpoint import format as fmt
from slurm_omni.errors import CheckpointError

STAGES = {"vision": ("vision_encoder", "projector"), "text": ("text_decoder",)}
FULL = torch.arange(70, dtype=torch.float32).reshape(10, 7)   # an optimizer tensor cut across replicas


def layout(rank: int, dp: int = 2) -> ShardLayout:
    stage = "vision" if rank < dp else "text"
    return ShardLayout(rank=rank, world_size=2 * dp, stage=stage, data_parallel_rank=rank % dp,
                       data_parallel_size=dp)


def weights(stage: str, step: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return {m: {f"layer{i}.weight": torch.randn(32 + i, 16, generator=g) for i in range(5)} for m in STAGES[stage]}


def state_of(lay: ShardLayout, step: int) -> ShardState:
    piece = torch.tensor_split(FULL * step, lay.data_parallel_size)[lay.data_parallel_rank]
    first = STAGES[lay.stage][0]
    return ShardState(modules=weights(lay.stage, step),
                      optimizer={first: {"exp_avg": DpSplit(piece.clone()), "lr": 0.1}},
                      state={"dp_rank": lay.data_parallel_rank, "positions": [step, lay.rank]})


def save_all(root: Path, step: int, ranks: list[int], *, dp: int = 2, timeout: float = 30,
             state: Any = state_of) -> dict[int, BaseException]:
    errors: dict[int, BaseException] = {}

    def one(rank: int) -> None:
        lay = layout(rank, dp)
        try:
            with engine(root, layout=lay, incarnation="run-1", commit_timeout_s=timeout) as eng:
                eng.save(step, state(lay, step), sync=True)
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_four_ranks_commit_one_checkpoint_and_spread_the_replicated_writes(tmp_path: Path) -> None:
    assert save_all(tmp_path, 5, [0, 1, 2, 3]) == {}
    manifest = fmt.read_manifest(fmt.step_dir(tmp_path, 5))
    assert manifest.world_size == 4 and manifest.stages() == {"vision": 2, "text": 2}
    assert all(s.file for s in manifest.shards.values()), "every replica writes a share of its stage"
    for unit in manifest.units.values():
        for t in unit.tensors.values():
            assert len(t.pieces) == (2 if t.split_dim is not None else 1)
    assert manifest.units["vision_encoder/optim"].tensors["exp_avg"].shape == (10, 7)


def test_same_layout_restores_each_rank_its_own_piece_and_state(tmp_path: Path) -> None:
    assert save_all(tmp_path, 5, [0, 1, 2, 3]) == {}
    for rank in range(4):
        lay = layout(rank)
        with engine(tmp_path, layout=lay, incarnation="run-2") as eng, eng.restore() as r:
            want = state_of(lay, 5)
            assert not r.layout_changed and r.state == want.state
            for name, sd in want.modules.items():
                assert_same(r.module(name), sd, name)
            first = STAGES[lay.stage][0]
            got = r.optimizer(first)
            assert_same(got["exp_avg"], want.optimizer[first]["exp_avg"].tensor)
            assert got["lr"] == 0.1


@pytest.mark.parametrize("new_dp", [1, 3, 4, 11])
def test_another_data_parallel_size_recuts_split_tensors(tmp_path: Path, new_dp: int) -> None:
    assert save_all(tmp_path, 5, [0, 1, 2, 3]) == {}
    for dp_rank in range(new_dp):
        lay = ShardLayout(rank=dp_rank, world_size=2 * new_dp, stage="vision", data_parallel_rank=dp_rank,
                          data_parallel_size=new_dp)
        with engine(tmp_path, layout=lay, incarnation="run-2") as eng, eng.restore() as r:
            assert r.layout_changed and r.state is None
            assert [s["dp_rank"] for s in r.states] == [0, 1]
            assert_same(r.module("projector"), weights("vision", 5)["projector"])
            assert_same(r.optimizer("vision_encoder")["exp_avg"],
                        torch.tensor_split(FULL * 5, new_dp)[dp_rank].contiguous())


def test_a_missing_rank_means_no_checkpoint_and_the_leftovers_are_swept_later(tmp_path: Path) -> None:
    errors = save_all(tmp_path, 5, [0, 1, 2], timeout=1)
    assert list(errors) == [0] and "no shard from rank(s) 3" in str(errors[0])
    assert fmt.complete(tmp_path) == [] and fmt.scan(tmp_path)[0].status is fmt.Status.WRITING
    assert save_all(tmp_path, 10, [0, 1, 2, 3]) == {}
    assert [(e.step, e.status) for e in fmt.scan(tmp_path)] == [(10, fmt.Status.COMPLETE)]


def test_a_record_left_by_an_earlier_incarnation_is_not_taken(tmp_path: Path) -> None:
    tmp = fmt.tmp_dir(tmp_path, 5)
    tmp.mkdir()
    (tmp / "rank-00003.json").write_text(json.dumps({"step": 5, "incarnation": "run-0"}))
    errors = save_all(tmp_path, 5, [0, 1, 2], timeout=1)
    assert "rank(s) 3" in str(errors[0]) and fmt.complete(tmp_path) == []


def test_replicas_that_saved_different_tensors_do_not_commit(tmp_path: Path) -> None:
    def uneven(lay: ShardLayout, step: int) -> ShardState:
        s = state_of(lay, step)
        if lay.rank == 1:
            s.modules["projector"]["extra"] = torch.ones(1)  # type: ignore[index]
        return s

    errors = save_all(tmp_path, 5, [0, 1, 2, 3], timeout=5, state=uneven)
    assert "saved different tensors" in str(errors[0]) and fmt.complete(tmp_path) == []


def test_a_stage_the_checkpoint_does_not_know_is_an_error(tmp_path: Path) -> None:
    assert save_all(tmp_path, 5, [0, 1, 2, 3]) == {}
    with engine(tmp_path, layout=ShardLayout(stage="audio"), incarnation="x") as eng, \
            pytest.raises(CheckpointError, match="no modules for stage 'audio'"):
        eng.restore()


def test_several_ranks_need_one_incarnation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OMNI_INCARNATION", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CheckpointError, match="OMNI_INCARNATION"):
        engine(tmp_path, layout=layout(0))
    monkeypatch.setenv("OMNI_INCARNATION", "7")
    assert engine(tmp_path, layout=layout(0)).incarnation == "7"


def test_a_new_layout_reads_only_the_old_pieces_it_overlaps(tmp_path: Path) -> None:
    """10 rows saved as [0, 5) and [5, 10); 4 new ranks take [0, 3), [3, 6), [6, 8), [8, 10). A flipped
    byte in the second old piece stops the ranks that need it, and only them."""
    assert save_all(tmp_path, 5, [0, 1, 2, 3]) == {}
    step = fmt.step_dir(tmp_path, 5)
    second = fmt.read_manifest(step).units["vision_encoder/optim"].tensors["exp_avg"].pieces[1]
    with open(step / f"{second.shard}.h5", "r+b") as f:
        f.seek(second.offset + second.nbytes - 1)   # the last row: only new ranks 1, 2 and 3 need it
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0x40]))
    lay = ShardLayout(rank=0, world_size=8, stage="vision", data_parallel_rank=0, data_parallel_size=4)
    with engine(tmp_path, layout=lay, incarnation="run-2") as eng, eng.restore() as r:
        assert r.step == 5 and r.layout_changed
        assert_same(r.optimizer("vision_encoder")["exp_avg"], torch.tensor_split(FULL * 5, 4)[0].contiguous())
    lay = ShardLayout(rank=1, world_size=8, stage="vision", data_parallel_rank=1, data_parallel_size=4)
    # found while opening (then nothing older to fall back to) or on first use
    with engine(tmp_path, layout=lay, incarnation="run-2") as eng, pytest.raises(CheckpointError), \
            eng.restore() as r:
        r.optimizer("vision_encoder")
    (entry,) = fmt.scan(tmp_path)
    assert entry.status is fmt.Status.CORRUPT and "checksum mismatch in vision_encoder/optim/exp_avg" in entry.reason
