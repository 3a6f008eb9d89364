"""Losing rank 0's node costs no more than losing any other (issue 22: at most one step lost). Every
rank writes its shard and record of a step, and rank 0 alone commits it once all are there: when rank
0's node dies between its own record and that commit, the step was complete but never committed, and
the next life went back one step more. The next life's rank 0 now commits it while its fence is
pending (``persist.finish_orphaned``); a step some rank never wrote, or one an incarnation in between
already passed over, stays uncommitted. Two ranks as threads, each "node" its own tmpfs folder."""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.states import engine
from ckpt.test_ckpt_memonly import _restore_all
from ckpt.test_ckpt_ranks import layout, state_of, weights
from slurm_omni.checkpoint import CheckpointEngine, peer, persist
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.fence import raise_fence

SHM = Path("/dev/shm")
RING = {"A": "B", "B": "A", "C": "B"}
LAYS = [layout(rank, dp=1) for rank in range(2)]


class NodeLost(Exception):
    """Rank 0's node died: nothing after this point of its persist happened."""


@pytest.fixture
def shm() -> Iterator[Path]:
    base = SHM / f"omni-rank0lost-{uuid.uuid4().hex[:10]}"
    base.mkdir(mode=0o700)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def on(root: Path, rank: int, life: int, shm: Path | None = None, node: str = "") -> CheckpointEngine:
    config: dict[str, Any] = {"layout": LAYS[rank], "incarnation": f"run-{life}", "incarnation_number": life,
                              "commit_timeout_s": 30}
    if shm is not None:
        config |= {"memory_tier": True, "memory_job": "j1", "memory_dir": shm / node}
    eng = engine(root, **config)
    if shm is not None:
        assert eng.memory is not None
        eng.peers = peer.Replicas("j1", root, node, RING, eng.memory)
    return eng


def run_life0(root: Path, monkeypatch: pytest.MonkeyPatch, *, last_files: bool, shm: Path | None = None,
              rank1_writes_last: bool = True) -> None:
    """Life 1: both ranks save step 10 (files) and step 11 (``last_files``: files, else memory only); rank
    0's node dies after its own shard and record of 11, before its commit of 11."""
    real = persist.commit

    def dies_at_11(root: Path, step: int, *args: Any, **kw: Any) -> Any:
        if step == 11:
            raise NodeLost
        return real(root, step, *args, **kw)

    monkeypatch.setattr(persist, "commit", dies_at_11)
    nodes = ["A", "B"]
    wrote_10 = threading.Barrier(2)

    def rank(r: int) -> None:
        with on(root, r, 1, shm, nodes[r]) as eng:
            eng.save(10, state_of(LAYS[r], 10), sync=True)
            wrote_10.wait(30)
            if r == 0:
                with pytest.raises(NodeLost):
                    eng.save(11, state_of(LAYS[r], 11), sync=True, files=last_files)
            elif rank1_writes_last:
                eng.save(11, state_of(LAYS[r], 11), sync=True, files=last_files)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.setattr(persist, "commit", real)
    assert [e.step for e in fmt.complete(root)] == [10]   # 11 was written by every rank, never committed


def steps(got: list[Any]) -> list[int | None]:
    out = [r.step if r else None for r in got]
    for r in got:
        if r is not None:
            r.close()
    return out


def test_a_step_whose_rank_0_died_before_its_commit_is_committed_by_the_next_life(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    run_life0(tmp_path, monkeypatch, last_files=True)
    engines = [on(tmp_path, 0, 2), on(tmp_path, 1, 2)]   # rank 0 on a replacement node: files only
    try:
        got = _restore_all(engines)
        assert [r.source if r else None for r in got] == ["file system", "file system"]
        assert got[0] is not None and set(got[0].module("vision_encoder")) == set(weights("vision", 11)["vision_encoder"])
        assert steps(got) == [11, 11]   # before: 10, two steps behind the life's last
    finally:
        for eng in engines:
            eng.close()
    manifest = fmt.read_manifest(fmt.step_dir(tmp_path, 11))
    assert manifest.incarnation == "run-1"   # committed as life 1's rank 0 would have
    assert [e.step for e in fmt.complete(tmp_path)] == [11, 10]
    assert not [e for e in fmt.scan(tmp_path) if e.status is fmt.Status.WRITING]
    (line,) = [r.getMessage() for r in caplog.records if "committed for incarnation" in r.getMessage()]
    assert "step 11" in line and "rank 0 had not committed it" in line


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")
def test_rank_0s_node_lost_before_its_commit_of_a_memory_only_step_costs_no_step_more(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's case: memory every step, node A (rank 0) lost with its memory; its replacement C reads
    rank 0's shard of the memory-only step from its ring peer B, rank 1 from its own node B."""
    keepers = {n: peer.Keeper("j1", tmp_path, n, base=shm / n, bind="127.0.0.1", host="127.0.0.1") for n in "AB"}
    for k in keepers.values():
        k.start()
    try:
        run_life0(tmp_path, monkeypatch, last_files=False, shm=shm)
        keepers["A"].stop()
        shutil.rmtree(shm / "A")
        engines = [on(tmp_path, 0, 2, shm, "C"), on(tmp_path, 1, 2, shm, "B")]
        try:
            got = _restore_all(engines)
            assert [r.source if r else None for r in got] == ["peer memory", "memory"]
            assert steps(got) == [11, 11]
        finally:
            for eng in engines:
                eng.close()
        assert fmt.memory_only(fmt.step_dir(tmp_path, 11))
    finally:
        for k in keepers.values():
            k.stop()


def test_a_step_some_rank_never_wrote_stays_uncommitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_life0(tmp_path, monkeypatch, last_files=True, rank1_writes_last=False)
    engines = [on(tmp_path, 0, 2), on(tmp_path, 1, 2)]
    try:
        assert steps(_restore_all(engines)) == [10, 10]
    finally:
        for eng in engines:
            eng.close()
    assert [e.step for e in fmt.complete(tmp_path)] == [10]
    assert [e.path.name for e in fmt.scan(tmp_path) if e.status is fmt.Status.WRITING] == ["step-11.tmp.i1"]


def test_a_step_an_incarnation_in_between_passed_over_is_not_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_life0(tmp_path, monkeypatch, last_files=True)
    raise_fence(tmp_path, 2, "run-2")   # life 2 started without finishing it: its horizon is 10
    assert persist.finish_orphaned(tmp_path, 3) is None
    assert [e.step for e in fmt.complete(tmp_path)] == [10]


def test_life_1s_rank_0_resumed_after_the_takeover_touches_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 stopped (a partition), not dead: it resumes its commit of 11 after life 2 took it over."""
    run_life0(tmp_path, monkeypatch, last_files=True)
    raise_fence(tmp_path, 2, "run-2", finish=persist.finish_orphaned)
    caplog.set_level(logging.WARNING)
    assert persist.commit(tmp_path, 11, 2, "run-1", 30.0, number=1) is None   # fenced at its commit, at once
    assert [e.step for e in fmt.complete(tmp_path)] == [11, 10]
    assert fmt.read_manifest(fmt.step_dir(tmp_path, 11)).incarnation == "run-1"
