"""Each incarnation stages its unfinished checkpoint apart from the others': an old rank stopped in
its commit (SIGSTOP, as a network partition does) and resumed while the new incarnation writes the
same step removes nothing of the new one's, and the new one commits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.states import assert_same, engine
from ckpt.test_ckpt_ranks import layout, state_of
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import persist as persist_mod
from slurm_omni.checkpoint.fence import raise_fence

TESTS = Path(__file__).resolve().parents[1]


def _wait_for(probe: object, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():   # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _staged(root: Path, step: int, rank: int, incarnation: str) -> bool:
    """A shard record of ``incarnation`` for ``step`` in some staging folder of ``root``."""
    for path in root.glob(f"step-{step}.tmp*/{fmt.shard_name(rank)}.json"):
        try:
            if json.loads(path.read_bytes()).get("incarnation") == incarnation:
                return True
        except ValueError:
            continue
    return False


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_an_old_rank_resumed_in_its_commit_leaves_the_new_incarnations_step_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old0 = subprocess.Popen([sys.executable, "-m", "ckpt.stale_rank_child", str(root), "30", "3"],
                            cwd=TESTS, env={**os.environ, "PYTHONPATH": str(TESTS)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    new1 = None
    try:
        # rank 0 of incarnation 3 writes its shard and waits in its commit for rank 1's record
        _wait_for(lambda: _staged(root, 30, 0, "3") or old0.poll() is not None, "the old rank 0's shard")
        with engine(root, layout=layout(1, dp=1), incarnation="3", incarnation_number=3) as old1:
            assert not old1.save(30, state_of(layout(1, dp=1), 1030), sync=True).fenced
        # ... then has every record and stops before it looks at the fence again
        _wait_for(lambda: old0.poll() is not None or _stopped(old0.pid), "the old rank 0 to stop in its commit")
        assert old0.poll() is None, old0.communicate()
        # the new incarnation starts and writes step 30 while the old rank 0 is stopped
        raise_fence(root, 4, "4")
        new1 = engine(root, layout=layout(1, dp=1), incarnation="4", incarnation_number=4)
        assert not new1.save(30, state_of(layout(1, dp=1), 30), sync=True).fenced
        assert _staged(root, 30, 1, "4")
        os.kill(old0.pid, signal.SIGCONT)
        out, err = old0.communicate(timeout=120)
        assert old0.returncode == 0, err
        assert json.loads(out.splitlines()[-1]) == {"fenced": True, "committed": False}
        assert "fenced at its commit" in err
    finally:
        if old0.poll() is None:
            os.kill(old0.pid, signal.SIGCONT)
            old0.kill()
            old0.wait()
        if new1 is not None:
            new1.close()
    assert _staged(root, 30, 1, "4"), "the old incarnation removed the new one's shard"
    with engine(root, layout=layout(0, dp=1), incarnation="4", incarnation_number=4, commit_timeout_s=10) as new0:
        saved = new0.save(30, state_of(layout(0, dp=1), 30), sync=True)
        assert saved.persisted.result().committed
    (entry,) = fmt.complete(root)
    assert entry.step == 30 and entry.incarnation == 4
    assert [e.status for e in fmt.scan(root)] == [fmt.Status.COMPLETE]   # no staging folder left
    for rank in (0, 1):
        lay = layout(rank, dp=1)
        with engine(root, layout=lay, incarnation="5", incarnation_number=5) as third, third.restore() as r:
            assert r.step == 30 and r.state == state_of(lay, 30).state
            for name, tensors in state_of(lay, 30).modules.items():
                assert_same(r.module(name), tensors, name)


def _commit_as(root: Path, step: int, number: int, seed: int, monkeypatch: pytest.MonkeyPatch | None = None) -> bool:
    """Both ranks of incarnation ``number`` save ``step``; with ``monkeypatch`` its fence checks
    pass (a check made just before a newer incarnation started). True when rank 0 committed."""
    with contextlib.ExitStack() as stack:
        if monkeypatch is not None:
            m = stack.enter_context(monkeypatch.context())
            m.setattr(persist_mod, "fenced_by", lambda root, number: None)
        for rank in (1, 0):
            lay = layout(rank, dp=1)
            eng = stack.enter_context(engine(root, layout=lay, incarnation=str(number), incarnation_number=number,
                                             commit_timeout_s=10))
            stats = eng.save(step, state_of(lay, seed), sync=True).persisted.result()
        return stats.committed


def test_a_late_commit_never_replaces_the_step_a_newer_incarnation_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raise_fence(tmp_path, 4, "4")
    assert _commit_as(tmp_path, 30, 4, 30)
    # incarnation 3 passed its fence checks before 4 started and commits the same step now
    assert not _commit_as(tmp_path, 30, 3, 1030, monkeypatch)
    (entry,) = fmt.complete(tmp_path)
    assert entry.step == 30 and entry.incarnation == 4
    assert fmt.read_manifest(entry.path).incarnation == "4"
    assert [e.status for e in fmt.scan(tmp_path)] == [fmt.Status.COMPLETE]   # its own staging removed


def test_a_newer_incarnation_replaces_an_older_ones_late_copy_of_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raise_fence(tmp_path, 3, "3")
    assert _commit_as(tmp_path, 20, 3, 20)
    raise_fence(tmp_path, 4, "4")
    assert _commit_as(tmp_path, 30, 3, 1030, monkeypatch)    # the late commit lands: it does not count
    assert [e.step for e in fmt.complete(tmp_path)] == [20]
    assert _commit_as(tmp_path, 30, 4, 30)                    # the same step again: the late copy retired
    assert [(e.step, e.incarnation) for e in fmt.complete(tmp_path)] == [(30, 4), (20, 3)]
    assert fmt.read_manifest(fmt.step_dir(tmp_path, 30)).incarnation == "4"


def test_only_a_newer_incarnation_sweeps_an_older_ones_staging(tmp_path: Path) -> None:
    for step, tag in ((10, "i3"), (40, "i3"), (10, "i5"), (40, "i5"), (10, "rjob.7")):
        (tmp_path / f"step-{step}.tmp.{tag}").mkdir()
    fmt.tmp_dir(tmp_path, 10).mkdir()                         # a writer before per-incarnation staging
    raise_fence(tmp_path, 4, "4")
    persist_mod.retire(tmp_path, keep_last=2, newest=30, number=4)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    # incarnation 3's staging goes whatever its step, 5's (newer) stays, unnumbered ones below 30 go
    assert left == ["step-10.tmp.i5", "step-40.tmp.i5"]
    # incarnation 3, fenced out, sweeps nothing
    (tmp_path / "step-10.tmp.i4").mkdir()
    persist_mod.retire(tmp_path, keep_last=2, newest=30, number=3)
    assert (tmp_path / "step-10.tmp.i4").is_dir()
    assert sorted((e.step, e.incarnation) for e in fmt.scan(tmp_path))[:2] == [(10, 4), (10, 5)]


def test_staging_folders_are_named_by_incarnation() -> None:
    root = Path("/ckpt")
    assert fmt.staging_dir(root, 30, "4", 4).name == "step-30.tmp.i4"
    assert fmt.staging_dir(root, 30, "1234.0/x", None).name == "step-30.tmp.r1234.0_x"
    assert [fmt.staging_step(n) for n in ("step-30.tmp.i4", "step-30.tmp", "step-30", "step-30.old-5",
                                          "step-30.tmp.i4/")] == [30, 30, None, None, None]
