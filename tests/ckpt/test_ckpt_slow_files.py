"""A slow shared file system does not hold the memory tier back (issue 22): while a step's file system
write is in flight, the memory-only steps after it are snapshotted, written into the tier and committed
(the engine's second lane and host buffer), and the restore still takes the newest step every rank can
restore. The file system write is held at the file boundary (``persist._write_file`` into the
checkpoint root) until the test lets it go; a watchdog lets it go anyway so a regression fails instead
of hanging."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from ckpt.states import assert_same, engine, modules, shard_state
from ckpt.test_ckpt_memonly import _restore_all, tier
from ckpt.test_ckpt_ranks import layout, state_of
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import persist
from slurm_omni.checkpoint.memtier import job_dir

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")


class SlowFiles:
    """``persist._write_file`` into ``root`` waits for :meth:`release` (the watchdog's after 60 s)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.go = threading.Event()
        self.writing = 0
        self.done: list[int] = []
        self._lock = threading.Lock()
        self._real = persist._write_file
        self._watchdog = threading.Timer(60, self.go.set)
        self._watchdog.start()
        monkeypatch.setattr(persist, "_write_file", self._write)

    def _write(self, path: Path, snap: Any, *args: Any) -> int:
        if not path.is_relative_to(self.root):
            return self._real(path, snap, *args)
        with self._lock:
            self.writing += 1
        self.go.wait()
        size = self._real(path, snap, *args)
        with self._lock:
            self.writing -= 1
            self.done.append(snap.step)
        return size

    def release(self) -> None:
        self.go.set()
        self._watchdog.cancel()


def test_memory_snapshots_keep_their_cadence_while_a_file_system_write_is_in_flight(
        tmp_path: Path, nodes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowFiles(tmp_path, monkeypatch)
    with engine(tmp_path, **tier(nodes, "a")) as eng:
        eng.save(9, shard_state(9), sync=True, files=False)
        files = eng.save(10, shard_state(10))   # the file system step: its write is held
        memory = [eng.save(step, shard_state(step), files=False) for step in (11, 12, 13)]
        stats = [r.persisted.result(timeout=30) for r in memory]
        # every memory-only step committed while step 10's write was still held: none waited for it
        assert not files.persisted.done() and slow.writing == 1 and slow.done == []
        assert [s.step for s in stats] == [11, 12, 13] and all(s.committed and s.memory_only for s in stats)
        assert [e.step for e in fmt.complete(tmp_path)] == [13, 12]   # the two newest memory-only steps
        slow.release()
        assert files.persisted.result(timeout=60).committed
    assert slow.done == [10]
    # step 10's staging folder survived the memory steps' retention, and committed with its shard file
    assert [e.step for e in fmt.complete(tmp_path)] == [13, 12, 10]
    assert (fmt.step_dir(tmp_path, 10) / "rank-00000.h5").exists()
    # the late file system step did not push the newer memory-only steps out of the tier
    names = sorted(p.name.split(".")[0] for p in job_dir(nodes / "a", "job-1").iterdir() if p.is_file())
    assert names == ["step-12", "step-13"]
    with engine(tmp_path, **tier(nodes, "a")) as eng, eng.restore() as r:
        assert r.step == 13 and r.source == "memory"
        for name, want in modules(13).items():
            assert_same(r.module(name), want, name)


def test_with_a_file_system_write_in_flight_the_ranks_still_agree_on_the_newest_step_all_can_restore(
        tmp_path: Path, nodes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks, the file system write of step 10 held on both while 11 and 12 go to memory; then
    rank 1's node is replaced (its memory empty): both restore 10, the newest step with files, once its
    write is through; with both nodes' memory, 12."""
    slow = SlowFiles(tmp_path, monkeypatch)
    lays = [layout(rank, dp=1) for rank in range(2)]
    held: list[bool] = [False, False]
    saved = threading.Barrier(3)

    def rank(r: int) -> None:
        with engine(tmp_path, layout=lays[r], incarnation="run-1", commit_timeout_s=60, **tier(nodes, f"n{r}")) as eng:
            eng.save(9, state_of(lays[r], 9), sync=True, files=False)
            files = eng.save(10, state_of(lays[r], 10))
            for step in (11, 12):
                eng.save(step, state_of(lays[r], step), files=False).persisted.result(timeout=30)
            held[r] = not files.persisted.done()
            saved.wait(60)
            files.persisted.result(timeout=60)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    saved.wait(60)
    assert held == [True, True]
    assert [e.step for e in fmt.complete(tmp_path)][:2] == [12, 11]
    slow.release()
    for t in threads:
        t.join(60)
    assert [e.step for e in fmt.complete(tmp_path)] == [12, 11, 10]
    for replaced, want in (("replacement", 10), ("n1", 12)):
        engines = [engine(tmp_path, layout=lays[0], incarnation=f"run-{replaced}", **tier(nodes, "n0")),
                   engine(tmp_path, layout=lays[1], incarnation=f"run-{replaced}", **tier(nodes, replaced))]
        try:
            got = _restore_all(engines)
            assert [r.step if r else None for r in got] == [want, want], replaced
            for r in got:
                if r is not None:
                    r.close()
        finally:
            for eng in engines:
                eng.close()
