"""The fence: an old incarnation still saving after a newer one restored commits nothing, and a late
commit that slipped past its check does not become the checkpoint the next restore takes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ckpt.states import assert_same, engine, modules, shard_state
from slurm_omni.checkpoint import fence as fence_mod
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import persist as persist_mod


def newest(root: Path) -> int | None:
    return fmt.latest_step(root)


def test_an_old_incarnation_saving_after_a_new_one_restored_is_fenced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old = engine(tmp_path, incarnation="41.0", incarnation_number=0)
    try:
        old.save(10, shard_state(10), sync=True)
        with engine(tmp_path, incarnation="42.1", incarnation_number=1) as new:
            session = new.restore()
            assert session is not None and session.step == 10
            session.close()
            assert json.loads((tmp_path / fence_mod.FENCE).read_text())["incarnation"] == 1
            # the old incarnation, still running, saves a newer step: refused, training goes on
            with caplog.at_level(logging.WARNING, logger="slurm_omni.checkpoint.persist"):
                late = old.save(20, shard_state(20), sync=True)
            assert late.fenced and not late.persisted.result().committed
            assert "fenced" in caplog.text and "incarnation 1 (42.1)" in caplog.text
            assert [(e.step, e.status) for e in fmt.scan(tmp_path)] == [(10, fmt.Status.COMPLETE)]   # tmp removed
            assert newest(tmp_path) == 10
            # an async save of the old one is refused the same way, and says so when it is over
            late_async = old.save(25, shard_state(25))
            assert late_async.persisted.result().fenced and late_async.fenced
            # the new incarnation saves and commits as usual
            assert not new.save(15, shard_state(15), sync=True).fenced
        assert newest(tmp_path) == 15
        with engine(tmp_path, incarnation="43.2", incarnation_number=2) as third:
            session = third.restore()
            assert session is not None and session.step == 15
            assert_same(session.module("projector"), modules(15)["projector"])
            session.close()
    finally:
        old.close()


def test_a_late_commit_that_passed_its_check_before_the_fence_does_not_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine(tmp_path, incarnation="41.0", incarnation_number=0) as old:
        old.save(10, shard_state(10), sync=True)
        with engine(tmp_path, incarnation="42.1", incarnation_number=1) as new:
            session = new.restore()
            assert session is not None and session.step == 10
            session.close()
            # the old commit checked the fence before it rose and lands now, after the new one read
            with monkeypatch.context() as m:
                m.setattr(persist_mod, "fenced_by", lambda root, number: None)
                assert old.save(30, shard_state(30), sync=True).persisted.result().committed
            assert (fmt.step_dir(tmp_path, 30) / fmt.MARKER).exists()
            assert newest(tmp_path) == 10          # committed after the horizon of incarnation 1: no count
            new.save(12, shard_state(12), sync=True)
            assert newest(tmp_path) == 12
        with engine(tmp_path, incarnation="43.2", incarnation_number=2) as third:
            session = third.restore()
            assert session is not None and session.step == 12   # what incarnation 1 wrote, not the late 30
            session.close()
        entries = {e.step: e.status for e in fmt.scan(tmp_path)}
        assert entries[30] is fmt.Status.FENCED and entries[12] is fmt.Status.COMPLETE


def test_checkpoints_of_earlier_incarnations_before_the_fence_are_what_a_restore_takes(tmp_path: Path) -> None:
    for number, step in ((0, 5), (1, 8)):
        with engine(tmp_path, incarnation=f"j.{number}", incarnation_number=number) as eng:
            if number:
                session = eng.restore()
                assert session is not None and session.step == 5
                session.close()
            eng.save(step, shard_state(step), sync=True)
    with engine(tmp_path, incarnation="j.2", incarnation_number=2) as eng:
        session = eng.restore()
        assert session is not None and session.step == 8
        session.close()
    marker = json.loads((fmt.step_dir(tmp_path, 8) / fmt.MARKER).read_text())
    manifest = json.loads((fmt.step_dir(tmp_path, 8) / fmt.MANIFEST).read_text())
    assert marker["incarnation"] == manifest["incarnation_number"] == 1


def test_other_ranks_restore_after_rank_0_raised_and_two_incarnations_never_share_a_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine(tmp_path, incarnation="j.0", incarnation_number=0) as eng:
        eng.save(3, shard_state(3), sync=True)
    # rank 1 of incarnation 1 waits for its rank 0's horizon; without it, it gives up after the wait
    waited = fence_mod.await_raise(tmp_path, 1, 0.2)
    assert waited is not None and waited.incarnation == 0
    fence_mod.raise_fence(tmp_path, 1, "j.1")
    got = fence_mod.await_raise(tmp_path, 1, 5.0)
    assert got is not None and got.horizon_of(1) == fence_mod.Raise(1, "j.1", 3)
    written: list[str] = []
    real = persist_mod._write_file
    monkeypatch.setattr(persist_mod, "_write_file", lambda path, *a: written.append(path.name) or real(path, *a))
    with engine(tmp_path, incarnation="j.1", incarnation_number=1) as eng:
        eng.save(4, shard_state(4), sync=True)
    assert written == ["rank-00000.h5.j.1.partial"]
