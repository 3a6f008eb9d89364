"""The node's copies held by the process that forks the trainers (the standby server,
``peer.hold_copies``): a trainer it forks restores from the copies it inherited, in its own memory,
bitwise, asking the keeper nothing; it drops every inherited buffer (spares at once, the copies once its
restore ended), and so does whatever it forks itself; a copy held after the fork is still read from the
holder; the replica keeper, a process of its own, serves the holder's copy to a peer."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.states import assert_same, engine, modules, optimizer_state, shard_state
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import held, held_native, peer

SHM = Path("/dev/shm")
NODE = "n1"

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")


@pytest.fixture
def holder(tmp_path: Path, job: str) -> Iterator[held.HeldServer]:
    """This process holds the node's copies, as the standby server does."""
    try:
        held_native.build()
    except held_native.BuildError as e:
        pytest.skip(str(e))
    server = peer.hold_copies(job, tmp_path, NODE, base=SHM, cap_bytes=None)
    assert server is not None
    yield server
    server.stop()
    server.store.close()


def mapped(addr: int) -> bool:
    """Does this process map ``addr``?"""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def vm_flags(addr: int) -> list[str]:
    """The kernel's flags of this process's mapping of ``addr`` (``dc``: not copied at a fork)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return head[1:]
    return []


def in_child(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work`` run in a forked child (the trainer the holder forks); what it returned, or its error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = work()
        except BaseException:   # noqa: BLE001 - the parent reports it
            out = {"error": traceback.format_exc()}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data or b'{"error": "the child said nothing"}')
    assert "error" not in out, out["error"]
    return dict(out)


def test_a_trainer_forked_by_the_holder_restores_from_its_own_memory_and_drops_it(
        tmp_path: Path, job: str, holder: held.HeldServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        for step in (100, 200, 300):
            eng.save(step, shard_state(step), sync=True)
    (fmt.step_dir(tmp_path, 300) / "rank-00000.h5").unlink()   # only memory can give it back
    store = holder.store
    store.drop([c.name for c in store.where([]) if c.name.startswith("step-200.")])   # its buffer: a spare
    copies = {c.name: c.addr for c in store.where([])}
    spares = [b.addr for b in store._spare.values()]
    assert len(copies) == 1 and spares
    assert "dc" not in vm_flags(next(iter(copies.values())))   # the trainers it forks inherit it

    def trainer() -> dict[str, Any]:
        found = held.inherited(job)
        assert found is not None and {n: c.addr for n, c in found.items()} == copies
        assert not any(mapped(a) for a in spares), "a spare buffer is still shared with the holder"
        assert all(mapped(a) for a in copies.values())

        def no_keeper(*_: object, **__: object) -> None:
            raise AssertionError("the trainer asked the keeper")

        monkeypatch.setattr(held.KeeperClient, "ask", no_keeper)
        monkeypatch.setattr(held.KeeperClient, "ask_soon", no_keeper)
        grandchild = in_child(lambda: {"inherited": held.inherited(job),
                                       "mapped": [mapped(a) for a in copies.values()]})
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
            assert r.step == 300 and r.source == "memory"
            assert {c.pid for c in r._files.held.values()} == {held.HERE}
            for name, want in modules(300).items():
                assert_same(r.module(name), want, name)
            assert_same(r.optimizer("text_decoder"), optimizer_state(300))
            assert r.state == shard_state(300).state
            released = held.inherited(job) is None
        return {"grandchild": grandchild, "released": released,
                "mapped": [mapped(a) for a in copies.values()]}

    out = in_child(trainer)
    # what the trainer forks (a data loader's workers) drops every inherited buffer at once
    assert out["grandchild"] == {"inherited": None, "mapped": [False]}
    # the trainer dropped the copies once its restore had read them
    assert out["released"] and out["mapped"] == [False]
    # the holder still holds them, and takes the next step
    assert {c.name: c.addr for c in store.where([])} == copies
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(400, shard_state(400), sync=True)
    assert sorted(c.name.split(".")[0] for c in store.where([])) == ["step-300", "step-400"]


def test_a_copy_held_after_the_fork_is_read_from_the_holder(
        tmp_path: Path, job: str, holder: held.HeldServer) -> None:
    """The table a trainer inherits is the holder's at the fork: a step held later (an old rank's last
    save still being copied) is read from the holder's memory, as without inheritance."""
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the trainer, forked before step 200 was held
        os.close(r)
        os.close(go_w)
        out: dict[str, Any] = {}
        try:
            os.read(go_r, 1)
            with engine(tmp_path, memory_tier=True, memory_job=job) as e, e.restore() as session:
                out = {"step": session.step, "source": session.source,
                       "pids": sorted({c.pid for c in session._files.held.values()}),
                       "same": all(bool((session.module(n)[k] == v).all()) for n, sd in modules(200).items()
                                   for k, v in sd.items())}
        except BaseException:   # noqa: BLE001 - the parent reports it
            out = {"error": traceback.format_exc()}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    os.close(go_r)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(200, shard_state(200), sync=True)
    (fmt.step_dir(tmp_path, 200) / "rank-00000.h5").unlink()
    os.write(go_w, b"x")
    os.close(go_w)
    with os.fdopen(r, "rb") as f:
        got = json.loads(f.read())
    os.waitpid(pid, 0)
    assert got == {"step": 200, "source": "memory", "pids": [os.getpid()], "same": True}, got


def test_the_replica_keeper_serves_the_holders_copy_to_a_peer(
        tmp_path: Path, job: str, holder: held.HeldServer) -> None:
    """Where the standby holds the node's copies, the replica keeper (``own_copies=False``) serves one
    to a replacement node from the holder's memory, bitwise; a name the holder lacks is refused."""
    keeper = peer.Keeper(job, tmp_path, NODE, base=SHM, bind="127.0.0.1", host="127.0.0.1", own_copies=False)
    keeper.start()
    try:
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
            eng.save(100, shard_state(100), sync=True)
        (name,) = [c.name for c in holder.store.where([])]
        path = fmt.step_dir(tmp_path, 100) / "rank-00000.h5"
        size = path.stat().st_size
        key = peer.load_secret(tmp_path)
        stream = peer.open_stream("127.0.0.1", keeper.port, key, job=job, name=name, size=size)
        try:
            got = bytearray(size)
            assert stream.recv_into(memoryview(got)) == size
        finally:
            stream.close()
        assert bytes(got) == path.read_bytes()
        with pytest.raises(peer.PeerError, match="has no"):
            peer.open_stream("127.0.0.1", keeper.port, key, job=job, name=name.replace("step-100", "step-99"),
                             size=size)
    finally:
        keeper.stop()


def test_without_huge_pages_no_trainer_inherits_the_copies(
        tmp_path: Path, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel gives no transparent huge pages, a fork would copy a page-table entry per 4 KiB
    held: the holder's buffers are not inherited (``MADV_DONTFORK``), and a trainer it forks reads the
    copies from the holder's memory, bitwise."""
    try:
        held_native.build()
    except held_native.BuildError as e:
        pytest.skip(str(e))
    thp = tmp_path / "enabled"
    thp.write_text("always madvise [never]\n")
    monkeypatch.setattr(held, "THP_ENABLED", thp)
    monkeypatch.setattr(peer, "THP_ENABLED", thp)
    monkeypatch.setattr(peer, "huge_pages", lambda: held.huge_pages(thp))
    assert not held.huge_pages(thp)
    server = peer.hold_copies(job, tmp_path, NODE, base=SHM, cap_bytes=None)
    assert server is not None
    try:
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
            eng.save(100, shard_state(100), sync=True)
        (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").unlink()
        (addr,) = [c.addr for c in server.store.where([])]
        assert "dc" in vm_flags(addr)   # MADV_DONTFORK: no fork copies its page tables

        def trainer() -> dict[str, Any]:
            with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
                same = all(bool((r.module(n)[k] == v).all()) for n, sd in modules(100).items() for k, v in sd.items())
                return {"inherited": held.inherited(job), "mapped": mapped(addr), "source": r.source,
                        "pids": sorted({c.pid for c in r._files.held.values()}), "same": same}

        assert in_child(trainer) == {"inherited": None, "mapped": False, "source": "memory", "pids": [os.getpid()],
                                     "same": True}
    finally:
        server.stop()
        server.store.close()


def test_a_copy_on_4_kib_pages_is_not_inherited_but_read_from_the_holder(
        tmp_path: Path, job: str, holder: held.HeldServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer the kernel gave mostly 4 KiB pages (a fragmented node) is not inherited (a fork would copy
    an entry per 4 KiB of it): ``MADV_DONTFORK``, out of the trainer's table, read from the holder."""
    monkeypatch.setattr(held, "huge_bytes", lambda lo, hi: 0)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").unlink()
    (addr,) = [c.addr for c in holder.store.where([])]
    assert "dc" in vm_flags(addr)

    def trainer() -> dict[str, Any]:
        table = held.inherited(job)
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
            same = all(bool((r.module(n)[k] == v).all()) for n, sd in modules(100).items() for k, v in sd.items())
            return {"table": table, "source": r.source,
                    "pids": sorted({c.pid for c in r._files.held.values()}), "same": same}

    assert in_child(trainer) == {"table": {}, "source": "memory", "pids": [os.getpid()], "same": True}
