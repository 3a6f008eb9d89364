"""The memory tier's copies held in the node keeper's anonymous memory (``checkpoint/held.py``): a
restart reads them with process_vm_readv, bitwise; the fence, the cap, a failed allocation, a bad
copy and refused ptrace access each fall back with one line; another user reads nothing; the memory
ends with the keeper."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.states import assert_same, engine, modules, optimizer_state, shard_state
from slurm_omni.checkpoint import ShardLayout, held, held_native, peer
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.fence import raise_fence
from slurm_omni.checkpoint.memtier import MemoryTier, free_job, job_dir
from slurm_omni.errors import CheckpointError
from slurm_omni.formats import RecordRejected, decode
from slurm_omni.formats.memtier_keeper import HoldReply, HoldRequest

SHM = Path("/dev/shm")
NODE = "n1"

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")


@pytest.fixture
def keeper(tmp_path: Path, job: str) -> Iterator[peer.Keeper]:
    """The node's keeper, serving from a thread of this process (the standby forks it in a job)."""
    k = peer.Keeper(job, tmp_path, NODE, base=SHM, bind="127.0.0.1", host="127.0.0.1")
    k.start()
    wait_for(held.socket_path(job_dir(SHM, job), NODE))
    yield k
    k.stop()


@pytest.fixture(params=["c", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The restore's copy-and-hash loop from the keeper's memory: the C one (``held_native``; built
    here where set-up did not) or the Python one, its fallback."""
    lib = None
    if request.param == "c":
        try:
            held_native.build()
        except held_native.BuildError as e:
            pytest.skip(str(e))
        lib, why = held_native.load()
        assert lib is not None, why
    monkeypatch.setattr(held, "_NATIVE", [lib])
    return str(request.param)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"no {path}"


def files_in_tmpfs(job: str) -> list[str]:
    return sorted(n for n in os.listdir(job_dir(SHM, job)) if n.endswith(".h5"))


def held_names(job: str) -> list[str]:
    reply = held.KeeperClient(job_dir(SHM, job), job, NODE).ask("where")
    return sorted(c.name for c in reply.copies)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_keeper_process_holds_the_copies_and_a_restart_reads_them_bitwise(tmp_path: Path, job: str) -> None:
    """The keeper in its own process, as in a job: the copies live in its memory, not on the tmpfs;
    the restart reads them across processes; when the keeper ends, its memory goes with it."""
    code = ("import sys; from pathlib import Path; from slurm_omni.checkpoint import peer; "
            "peer.run_keeper(sys.argv[1], Path(sys.argv[2]), sys.argv[3], base=Path('/dev/shm'), cap_bytes=None)")
    proc = subprocess.Popen([sys.executable, "-c", code, job, str(tmp_path), NODE])
    try:
        wait_for(held.socket_path(job_dir(SHM, job), NODE))
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
            for step in (100, 200, 300):
                eng.save(step, shard_state(step), sync=True)
        assert files_in_tmpfs(job) == []
        assert held_names(job) == [f"step-{s}.rank-00000.{eng.incarnation}.h5" for s in (200, 300)]   # keeps two
        # the file system's shard is gone: only the keeper's memory can give the bytes back
        (fmt.step_dir(tmp_path, 300) / "rank-00000.h5").unlink()
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
            assert r.step == 300 and r.source == "memory"
            assert r.read_bytes["memory"] > 0 and r.read_bytes["buffered"] == 0
            for name, want in modules(300).items():
                assert_same(r.module(name), want, name)
            assert_same(r.optimizer("text_decoder"), optimizer_state(300))
            assert r.state == shard_state(300).state
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    # nothing of the copies was ever on the tmpfs; the keeper's socket went with it
    assert os.listdir(job_dir(SHM, job)) == ["peer"] and not os.listdir(job_dir(SHM, job) / "peer")
    free_job(job, base=SHM)
    assert not job_dir(SHM, job).exists()


def test_a_corrupted_copy_in_the_keeper_falls_back_to_the_file_system_with_one_line(
        tmp_path: Path, job: str, keeper: peer.Keeper, caplog: pytest.LogCaptureFixture, loop: str) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    (name,) = held_names(job)
    view = keeper.held.get(name)
    assert view is not None
    view[len(view) // 2] ^= 0xFF
    view.release()
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        assert_same(r.module("projector"), modules(100)["projector"])
    (line,) = warnings(caplog)
    assert "checksum mismatch" in line and "dropped the copy" in line and "file system" in line, line
    assert held_names(job) == []


def test_a_keeper_gone_since_the_copies_were_found_is_a_bad_copy_not_a_failure(
        tmp_path: Path, job: str, keeper: peer.Keeper, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    """The keeper ended (its node's standby stopped, or it was killed) between the restore's ``where``
    and its reads: ESRCH is a bad copy, one line, the same step from the files; no failed restore
    (with either loop)."""
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    real = MemoryTier.sources

    def found_then_gone(self: MemoryTier, manifest: fmt.Manifest, **kw: Any) -> dict[str, Path | held.HeldCopy]:
        found = real(self, manifest, **kw)
        assert found and all(isinstance(c, held.HeldCopy) for c in found.values())
        return {k: held.HeldCopy(c.name, 2**22 + 7, c.addr, c.size) for k, c in found.items()   # no such pid
                if isinstance(c, held.HeldCopy)}

    monkeypatch.setattr(MemoryTier, "sources", found_then_gone)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        assert_same(r.module("projector"), modules(100)["projector"])
    (line,) = warnings(caplog)
    assert "keeper's memory" in line and "No such process" in line and "file system" in line, line


def test_an_older_incarnation_cannot_publish_into_the_keeper_after_a_newer_one_started(
        tmp_path: Path, job: str, keeper: peer.Keeper, caplog: pytest.LogCaptureFixture) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job, incarnation="j.1", incarnation_number=1) as old:
        old.save(100, shard_state(100), sync=True)
        raise_fence(tmp_path, 2, "j.2")   # the next life started on the root
        assert old.save(200, shard_state(200), sync=True).fenced
    assert held_names(job) == ["step-100.rank-00000.j.1.h5"]
    shard = fmt.step_dir(tmp_path, 100) / "rank-00000.h5"
    tier = MemoryTier(job, base=SHM)
    assert tier.publish(shard, step=300, rank=0, incarnation="j.1", root=tmp_path, number=1) is None
    assert any("not kept in memory" in w and "incarnation 2 started since" in w for w in warnings(caplog))
    assert tier.publish(shard, step=300, rank=0, incarnation="j.2", root=tmp_path, number=2) == shard
    assert held_names(job) == ["step-100.rank-00000.j.1.h5", "step-300.rank-00000.j.2.h5"]
    assert files_in_tmpfs(job) == []


def test_the_keepers_cap_leaves_the_step_to_the_file_system_with_one_line(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture) -> None:
    k = peer.Keeper(job, tmp_path, NODE, base=SHM, bind="127.0.0.1", host="127.0.0.1", cap_bytes=4096)
    k.start()
    try:
        wait_for(held.socket_path(job_dir(SHM, job), NODE))
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
            eng.save(100, shard_state(100), sync=True)
            eng.save(200, shard_state(200), sync=True)
        assert held_names(job) == [] and files_in_tmpfs(job) == []
    finally:
        k.stop()
    (line,) = warnings(caplog)
    assert "would pass the cap" in line and "memory_gib" in line and "the file system has it" in line, line
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "file system"


def test_a_failed_allocation_leaves_the_step_to_the_file_system_with_one_line(
        tmp_path: Path, job: str, keeper: peer.Keeper, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(size: int, **_: object) -> held._Buffer:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(held, "_Buffer", no_memory)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    assert held_names(job) == [] and files_in_tmpfs(job) == []
    (line,) = warnings(caplog)
    assert "no memory" in line and "the file system has it" in line, line


def test_refused_ptrace_access_keeps_tmpfs_copies_with_one_line(
        tmp_path: Path, job: str, keeper: peer.Keeper, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Yama ptrace_scope 2 or 3 (EPERM): the first copy finds it; the copies are tmpfs files, as before."""
    def refused(pid: int, remote: int, local: int, n: int) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(held, "read_remote", refused)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    assert held_names(job) == []
    assert files_in_tmpfs(job) == [f"step-{s}.rank-00000.{eng.incarnation}.h5" for s in (100, 200)]
    (line,) = warnings(caplog)
    assert "ptrace" in line and "tmpfs" in line, line
    monkeypatch.undo()
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "memory"
        assert_same(r.module("projector"), modules(200)["projector"])


def test_without_a_keeper_the_copies_are_tmpfs_files(tmp_path: Path, job: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slurm_omni.checkpoint.memtier")
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    assert files_in_tmpfs(job) == [f"step-100.rank-00000.{eng.incarnation}.h5"]
    assert warnings(caplog) == []
    assert any("no keeper answers" in r.getMessage() for r in caplog.records)


def test_a_memory_only_step_moves_into_the_keeper(tmp_path: Path, job: str, keeper: peer.Keeper) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True, files=False)
    assert files_in_tmpfs(job) == []
    assert held_names(job) == [f"step-{s}.rank-00000.{eng.incarnation}.h5" for s in (100, 200)]
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "memory"
        assert_same(r.optimizer("text_decoder"), optimizer_state(200))


def test_a_memory_only_step_the_keeper_refuses_stays_a_tmpfs_copy_with_one_line(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The keeper's cap refuses the hand-over: the memory-only step's only copy is its tmpfs file, which
    stays (the line says so, not "the file system has it"), and a restart reads it."""
    k = peer.Keeper(job, tmp_path, NODE, base=SHM, bind="127.0.0.1", host="127.0.0.1", cap_bytes=4096)
    k.start()
    try:
        wait_for(held.socket_path(job_dir(SHM, job), NODE))
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
            eng.save(100, shard_state(100), sync=True, files=False)
        assert held_names(job) == []
        assert files_in_tmpfs(job) == [f"step-100.rank-00000.{eng.incarnation}.h5"]
        (line,) = warnings(caplog)
        assert "would pass the cap" in line and "tmpfs copy" in line and "stays" in line, line
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
            assert r.step == 100 and r.source == "memory"
            assert_same(r.optimizer("text_decoder"), optimizer_state(100))
    finally:
        k.stop()


def test_another_user_cannot_read_the_keepers_memory_or_ask_it(tmp_path: Path, job: str, keeper: peer.Keeper) -> None:
    try:
        pwd.getpwnam("alice")
    except KeyError:
        pytest.skip("no user alice")
    if os.geteuid() != 0 or shutil.which("runuser") is None or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, runuser and /usr/bin/python3 to act as alice")
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    copy = held.KeeperClient(job_dir(SHM, job), job, NODE).ask("where").copies[0]
    probe = (
        "import ctypes, sys\n"
        "class V(ctypes.Structure): _fields_ = [('b', ctypes.c_void_p), ('n', ctypes.c_size_t)]\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "buf = ctypes.create_string_buffer(4096)\n"
        "mine, theirs = V(ctypes.addressof(buf), 4096), V(int(sys.argv[2]), 4096)\n"
        "n = libc.process_vm_readv(int(sys.argv[1]), ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)\n"
        "print(n, ctypes.get_errno())\n")
    out = subprocess.run(["runuser", "-u", "alice", "--", "/usr/bin/python3", "-c", probe, str(os.getpid()),
                          str(copy.addr)], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["-1", str(errno.EPERM)], out
    # the socket's folder is the user's 0700 one: alice cannot reach the keeper at all
    ask = subprocess.run(["runuser", "-u", "alice", "--", "/usr/bin/python3", "-c",
                          "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])",
                          str(held.socket_path(job_dir(SHM, job), NODE))], capture_output=True, text=True,
                         timeout=60, check=False)
    assert ask.returncode != 0 and "Permission denied" in ask.stderr, ask.stderr


def test_the_keeper_serves_its_own_nodes_copy_to_a_peer_from_memory(
        tmp_path: Path, job: str, keeper: peer.Keeper) -> None:
    """A replacement node asks the writer's node for a copy (its ring peer lost): served from memory."""
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    (name,) = held_names(job)
    size = (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").stat().st_size
    stream = peer.open_stream("127.0.0.1", keeper.port, peer.load_secret(tmp_path), job=job, name=name, size=size)
    try:
        got = bytearray(size)
        assert stream.recv_into(memoryview(got)) == size
    finally:
        stream.close()
    assert bytes(got) == (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").read_bytes()


@pytest.mark.parametrize("data", [b"", b"{}", b'{"op": "hold"}', b'{"op": "rm", "job": "1"}',
                                  b'{"op": "where", "job": "1", "names": ["../x"]}',
                                  b'{"op": "where", "job": "1", "extra": 1}'])
def test_a_malformed_request_is_rejected(data: bytes) -> None:
    with pytest.raises(RecordRejected):
        decode(data, HoldRequest, "a keeper record")


def test_the_records_round_trip() -> None:
    from slurm_omni.formats import encode

    req = HoldRequest(op="hold", job="42", names=["step-30.rank-00003.42.1.h5"], source="/c/x.partial", number=1)
    assert decode(encode(req), HoldRequest, "r") == req
    rep = HoldReply(ok=False, refused="cap", error="over")
    assert decode(encode(rep), HoldReply, "r") == rep


def restore_threads_alive() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("omni-ckpt-restore"))


def test_a_restore_from_the_keepers_memory_runs_no_more_io_threads_than_cpus(
        tmp_path: Path, job: str, keeper: peer.Keeper) -> None:
    """Every byte in memory: the I/O threads only copy and hash, so no more of them than the CPUs this
    process may run on (whatever ``restore_threads`` says); the same step from the file system, after
    the keeper is gone, gets the threads it asks for."""
    cpus = len(os.sched_getaffinity(0))
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        for step in (100, 200):
            eng.save(step, shard_state(step), sync=True)
    before = restore_threads_alive()
    with engine(tmp_path, memory_tier=True, memory_job=job, restore_threads=cpus + 6) as eng, eng.restore() as r:
        assert r.source == "memory" and r.read_bytes["memory"] > 0
        assert_same(r.optimizer("text_decoder"), optimizer_state(200))
        # the C loop reads on the restoring thread too: cpus - 1 of the pool's beside it
        assert min(1, cpus - 1) <= restore_threads_alive() - before <= cpus
    keeper.stop()
    with engine(tmp_path, memory_tier=True, memory_job=job, restore_threads=cpus + 6) as eng, eng.restore() as r:
        assert r.source == "file system"
        assert_same(r.optimizer("text_decoder"), optimizer_state(200))
        assert r._threads == cpus + 6


def test_a_checked_read_hands_each_step_to_the_checksum_as_it_lands() -> None:
    """``read_checked``: the bytes land where asked, every step goes to ``update`` in order, a short last
    step included (its digest is the whole range's); a process that is gone is an OSError (ESRCH)."""
    import xxhash

    src = bytearray(os.urandom(5 * 4096 + 123))
    at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst = bytearray(len(src) - 100)
    steps: list[int] = []
    digest = xxhash.xxh3_64()

    def update(view: memoryview) -> None:
        steps.append(len(view))
        digest.update(view)

    held.read_checked(os.getpid(), at + 100, memoryview(dst), update, step=4096)
    assert dst == src[100:] and steps == [4096] * 5 + [23]
    assert digest.hexdigest() == xxhash.xxh3_64(bytes(src[100:])).hexdigest()
    with pytest.raises(OSError) as e:
        held.read_checked(2**22 + 7, at, memoryview(dst), update)   # no such pid
    assert e.value.errno == errno.ESRCH


def test_both_loops_land_the_same_bytes_with_the_same_xxh3(loop: str) -> None:
    """``read_hashed`` (the C loop, or the Python one where it is not built): the bytes land where asked
    and the digest is python xxhash's of them, a short last step and a range under one step included;
    a process that is gone is an OSError (ESRCH) naming the keeper's pid; a range it does not map, EFAULT."""
    import xxhash

    src = bytearray(os.urandom(3 * 65536 + 4097))
    at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    for lo, hi, step in ((0, len(src), 65536), (100, len(src), 4096), (7, 300, held.READ_STEP), (5, 5, 4096)):
        dst = bytearray(hi - lo)
        got = held.read_hashed(os.getpid(), at + lo, memoryview(dst), step=step)
        assert dst == src[lo:hi]
        assert got == xxhash.xxh3_64(bytes(src[lo:hi])).hexdigest(), (loop, lo, hi, step)
    dst = bytearray(4096)
    with pytest.raises(OSError) as e:
        held.read_hashed(2**22 + 7, at, memoryview(dst))   # no such pid
    assert e.value.errno == errno.ESRCH and str(2**22 + 7) in str(e.value)
    with pytest.raises(OSError) as e:
        held.read_hashed(os.getpid(), 8, memoryview(dst))   # nothing mapped there
    assert e.value.errno == errno.EFAULT


@pytest.fixture
def c_loop(tmp_path: Path) -> Iterator[None]:
    """The C loop built into ``tmp_path`` and the one ``held`` uses for the test (skips where it does not build)."""
    try:
        held_native.build(tmp_path)
    except held_native.BuildError as e:
        pytest.skip(str(e))
    lib, why = held_native.load(tmp_path)
    assert lib is not None, why
    old = list(held._NATIVE)
    held._NATIVE[:] = [lib]
    yield
    held._NATIVE[:] = old


def test_a_batch_reads_every_piece_and_stops_at_the_first_bad_one(c_loop: None) -> None:
    """``read_batch`` (the C loop's whole plan): every piece lands where asked and matches its xxh3, on
    one thread or several; a piece whose xxh3 is not the one given is MISMATCH, and on one thread
    nothing after it is read; a keeper gone is its errno (ESRCH) for the piece that found it."""
    import concurrent.futures

    import xxhash

    src = bytearray(os.urandom(1 << 20))
    at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    spans = [(0, 0), (0, 5), (5, 70000), (70000, 70001), (70001, 500000), (500000, len(src))]
    dst = [bytearray(max(1, hi - lo)) for lo, hi in spans]

    def plan(wrong: int | None = None, pid: int = os.getpid()) -> list[tuple[int, int, int, int, int]]:
        return [(at + lo, ctypes.addressof(ctypes.c_char.from_buffer(d)), hi - lo,
                 int(xxhash.xxh3_64(bytes(src[lo:hi])).hexdigest(), 16) ^ (k == wrong), pid)
                for k, ((lo, hi), d) in enumerate(zip(spans, dst, strict=True))]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for threads in (1, 3):
            for d in dst:
                d[:] = bytes(len(d))
            assert held.read_batch(plan(), threads=threads, helpers=pool, step=4096) == [0] * len(spans)
            assert all(d[:hi - lo] == src[lo:hi] for (lo, hi), d in zip(spans, dst, strict=True))
        assert held.read_batch(plan(wrong=2), threads=1, helpers=None, step=4096) == \
            [0, 0, held.MISMATCH] + [held.NOT_READ] * 3
        status = held.read_batch(plan(wrong=2), threads=3, helpers=pool, step=4096)
        assert status[2] == held.MISMATCH and set(status[:2] + status[3:]) <= {0, held.NOT_READ}, status
        gone = held.read_batch(plan(pid=2**22 + 7), threads=1, helpers=None)
        assert gone[0] == 0 and gone[1] == errno.ESRCH and gone[2:] == [held.NOT_READ] * 4   # (0 bytes: no read)


def test_a_plans_helpers_read_what_is_published_while_it_is_still_planned(c_loop: None) -> None:
    """``Plan``: the helpers wait in C for pieces and read each one once published, before ``run``;
    a plan left early (an error while planning) stops them: nothing hangs, nothing more is read."""
    import concurrent.futures

    import xxhash

    src = bytearray(os.urandom(4 * 65536))
    at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    want = [int(xxhash.xxh3_64(bytes(src[k * 65536:(k + 1) * 65536])).hexdigest(), 16) for k in range(4)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        dst = [bytearray(65536) for _ in range(4)]
        with held.Plan(4, threads=3, helpers=pool, step=4096) as plan:
            for k in range(2):
                plan.add(at + k * 65536, ctypes.addressof(ctypes.c_char.from_buffer(dst[k])), 65536, want[k],
                         os.getpid())
            plan.publish()
            deadline = time.monotonic() + 30
            while (dst[0] != src[:65536] or dst[1] != src[65536:2 * 65536]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert dst[0] == src[:65536] and dst[1] == src[65536:2 * 65536]   # read before run()
            for k in range(2, 4):
                plan.add(at + k * 65536, ctypes.addressof(ctypes.c_char.from_buffer(dst[k])), 65536, want[k],
                         os.getpid())
            assert plan.run() == [0] * 4
        assert b"".join(dst) == src
        dst = [bytearray(65536) for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(RuntimeError), held.Plan(4, threads=3, helpers=pool) as plan:
            plan.add(at, ctypes.addressof(ctypes.c_char.from_buffer(dst[0])), 65536, want[0], os.getpid())
            raise RuntimeError("planning failed")
        assert time.monotonic() - started < 10 and dst[0] == bytes(65536)   # never published: not read


def test_a_restore_from_the_keeper_loads_in_place_into_the_models_tensors(
        tmp_path: Path, job: str, keeper: peer.Keeper, loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``into``: each tensor's bytes go straight into the model's own tensor, with the C loop in one
    batch for the whole restore, or piece by piece with the Python loop; a model whose tensor has
    another shape is the same clear error as from the file system, nothing marked."""
    batches: list[int] = []
    real = held.Plan.run

    def counted(plan: held.Plan) -> list[int]:
        batches.append(plan.count)
        return real(plan)

    monkeypatch.setattr(held.Plan, "run", counted)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    targets = {m: {k: torch.zeros_like(t) for k, t in sd.items()} for m, sd in modules(100).items()}
    optim = optimizer_state(100)
    targets["text_decoder/optim"] = {"state": {i: {k: torch.zeros_like(v) for k, v in st.items()}
                                               for i, st in optim["state"].items()},
                                     "param_groups": optim["param_groups"]}
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore(into=targets) as r:
        assert r.source == "memory"
        for name, want in modules(100).items():
            got = r.module(name)
            assert_same(got, want, name)
            assert all(got[k] is targets[name][k] for k in want), name
        got_optim = r.optimizer("text_decoder")
        assert_same(got_optim, optim)
        assert got_optim["state"][0]["exp_avg"] is targets["text_decoder/optim"]["state"][0]["exp_avg"]
    assert batches == ([sum(len(sd) for sd in modules(100).values()) + 2 * 3] if loop == "c" else [])
    wrong = {"vision_encoder": {k: torch.zeros(3) for k in modules(100)["vision_encoder"]}}
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, \
            pytest.raises(CheckpointError, match="the model"):
        eng.restore(into=wrong)
    assert [e.step for e in fmt.complete(tmp_path)] == [100]


def test_a_target_the_pieces_cannot_land_in_gets_its_bytes_once_they_are_read(
        tmp_path: Path, job: str, keeper: peer.Keeper, c_loop: None) -> None:
    """A model tensor the C loop cannot write into (not contiguous): its piece lands in a tensor of the
    restore's and is copied into the model's once read and checked; the units whose tensors are the
    model's own are built while the pieces are still read."""
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    want = modules(100)
    targets = {m: {k: torch.zeros_like(t) for k, t in sd.items()} for m, sd in want.items()}
    name, first = next((m, k) for m, sd in want.items() for k, t in sd.items() if t.dim() == 2)
    strided = torch.zeros(tuple(reversed(want[name][first].shape))).t()
    assert not strided.is_contiguous()
    targets[name][first] = strided
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore(into=targets) as r:
        assert r.source == "memory"
        for m, sd in want.items():
            got = r.module(m)
            assert_same(got, sd, m)
            assert all(got[k] is targets[m][k] for k in sd), m
    assert torch.equal(strided, want[name][first])


def test_the_keepers_where_is_asked_before_the_manifest_is_parsed(
        tmp_path: Path, job: str, keeper: peer.Keeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore sends its ``where`` first and reads the answer once the manifest is parsed (the
    keeper answers meanwhile); a question that could not be sent is asked again, as before."""
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    calls: list[str] = []
    real_manifest, real_open, real_ask = fmt.read_manifest, held.KeeperClient._open, held.KeeperClient.ask

    def read_manifest(*a: Any, **kw: Any) -> fmt.Manifest:
        calls.append("manifest")
        return real_manifest(*a, **kw)

    def opened(self: held.KeeperClient) -> Any:
        calls.append("connect")
        return real_open(self)

    def asked(self: held.KeeperClient, op: str, **kw: Any) -> Any:
        calls.append(op)
        return real_ask(self, op, **kw)

    monkeypatch.setattr(fmt, "read_manifest", read_manifest)
    monkeypatch.setattr(held.KeeperClient, "_open", opened)
    monkeypatch.setattr(held.KeeperClient, "ask", asked)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.source == "memory"
        assert_same(r.module("projector"), modules(100)["projector"])
    assert calls[:2] == ["connect", "manifest"] and "where" not in calls, calls

    def refused_once(self: held.KeeperClient) -> Any:
        calls.append("connect")
        if calls.count("connect") == 1:
            raise ConnectionRefusedError("refused once")
        return real_open(self)

    calls.clear()
    monkeypatch.setattr(held.KeeperClient, "_open", refused_once)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.source == "memory"
        assert_same(r.module("projector"), modules(100)["projector"])
    assert "where" in calls, calls


def test_an_error_while_the_plan_is_built_reaches_the_restore_and_stops_its_readers(
        tmp_path: Path, job: str, keeper: peer.Keeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the restore cannot make (a dtype this torch lacks) while the helpers already read the
    first pieces: the restore raises that one line, no reader is left waiting on the plan."""
    from slurm_omni.checkpoint import reader

    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    real = reader.from_name

    def no_float64(name: str) -> torch.dtype:
        if name == "float64":
            raise CheckpointError("checkpoint: unknown tensor dtype 'float64' (written by a newer torch?)")
        return real(name)

    monkeypatch.setattr(reader, "from_name", no_float64)
    before = restore_threads_alive()
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, \
            pytest.raises(CheckpointError, match="unknown tensor dtype 'float64'"):
        eng.restore()
    deadline = time.monotonic() + 30
    while restore_threads_alive() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert restore_threads_alive() == before


@pytest.mark.parametrize("new_dp", [1, 3])
def test_a_restore_from_the_keeper_recuts_split_tensors_for_another_data_parallel_size(
        tmp_path: Path, job: str, keeper: peer.Keeper, new_dp: int) -> None:
    """Two data-parallel ranks saved their pieces into the node's keeper; a relaunch with another
    data-parallel size reads the pieces it overlaps from memory and cuts them again."""
    from ckpt.test_ckpt_ranks import FULL, layout, state_of, weights

    errors: dict[int, BaseException] = {}

    def save(rank: int) -> None:
        try:
            with engine(tmp_path, layout=layout(rank), incarnation="run-1", memory_tier=True,
                        memory_job=job) as eng:
                eng.save(5, state_of(layout(rank), 5), sync=True)
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors[rank] = e

    savers = [threading.Thread(target=save, args=(r,)) for r in range(4)]
    for t in savers:
        t.start()
    for t in savers:
        t.join(60)
    assert errors == {} and len(held_names(job)) == 4
    for dp_rank in range(new_dp):
        lay = vision_layout(dp_rank, new_dp)
        with engine(tmp_path, layout=lay, incarnation="run-2", memory_tier=True, memory_job=job) as eng, \
                eng.restore() as r:
            assert r.source == "memory" and r.layout_changed
            assert_same(r.module("projector"), weights("vision", 5)["projector"])
            assert_same(r.optimizer("vision_encoder")["exp_avg"],
                        torch.tensor_split(FULL * 5, new_dp)[dp_rank].contiguous())


def vision_layout(dp_rank: int, dp: int) -> ShardLayout:
    return ShardLayout(rank=dp_rank, world_size=2 * dp, stage="vision", data_parallel_rank=dp_rank,
                       data_parallel_size=dp)


def test_without_the_c_loop_a_restore_reads_with_the_python_loop_and_says_so_in_one_line(
        tmp_path: Path, job: str, keeper: peer.Keeper, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(held_native, "BUILD_DIR", tmp_path / "not-built")
    monkeypatch.setattr(held, "_NATIVE", [])
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    for _ in range(2):
        with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
            assert r.step == 100 and r.source == "memory"
            assert_same(r.optimizer("text_decoder"), optimizer_state(100))
    (line,) = warnings(caplog)
    assert "not built" in line and "setup.sh" in line and "Python loop" in line, line


def test_the_c_loop_builds_warning_free_and_only_its_own_sources_load(tmp_path: Path) -> None:
    """Compiled with -Wall -Wextra -Werror (a warning fails the build); the name carries the sources'
    hash, so a library built from other sources is not loaded."""
    try:
        built = held_native.build(tmp_path)
    except held_native.BuildError as e:
        pytest.skip(str(e))
    lib, why = held_native.load(tmp_path)
    assert lib is not None and why == "" and built == held_native.library_path(tmp_path)
    assert "the C loop" in held_native.describe(lib)
    built.rename(tmp_path / "libomni_held_read.0000000000000000.so")
    lib, why = held_native.load(tmp_path)
    assert lib is None and "not built" in why


def test_a_held_buffer_is_on_huge_pages_where_the_kernel_allows_it() -> None:
    """THP for anonymous memory ``madvise`` or ``always``: the copy's buffer is 2 MiB aligned and advised."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages here")
    buf = held._Buffer(5 << 20)
    try:
        assert buf.addr % held.HUGE == 0 and buf.capacity == 6 << 20
        view = buf.view(5 << 20)
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(view)), 1, 5 << 20)
        view.release()
        smaps = Path(f"/proc/{os.getpid()}/smaps").read_text()
        block = smaps[smaps.index(f"{buf.addr - buf.skip:x}-"):]
        anon_huge = int(block.split("AnonHugePages:")[1].split()[0])
        assert anon_huge >= 2048, block[:1500]
    finally:
        buf.close()


HOLDER = """
import ctypes, mmap, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.prctl(0x59616d61, ctypes.c_ulong(-1).value, 0, 0, 0)   # held.allow_readers
buf = mmap.mmap(-1, 1 << 21, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf[:5] = b"alice"
print(os.getpid(), ctypes.addressof(ctypes.c_char.from_buffer(buf)), flush=True)
time.sleep(60)
"""

READER = """
import ctypes, sys
class V(ctypes.Structure): _fields_ = [('b', ctypes.c_void_p), ('n', ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(5)
mine, theirs = V(ctypes.addressof(buf), 5), V(int(sys.argv[2]), 5)
n = libc.process_vm_readv(int(sys.argv[1]), ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
print(n, ctypes.get_errno(), buf.raw.decode(errors="replace"))
"""


def test_as_unprivileged_users_a_sibling_of_the_same_user_reads_the_holders_memory_and_another_user_cannot() -> None:
    """The site's shape without root: alice's keeper (after ``allow_readers``) is read by another process
    of alice's that is not its descendant (a rank is the keeper's sibling under the standby); bob's
    process gets EPERM from the kernel."""
    for user in ("alice", "bob"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.skip(f"no user {user}")
    if os.geteuid() != 0 or shutil.which("runuser") is None or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, runuser and /usr/bin/python3 to act as alice and bob")
    holder = subprocess.Popen(["runuser", "-u", "alice", "--", "/usr/bin/python3", "-c", HOLDER],
                              stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        assert holder.stdout is not None
        # the holder names itself: runuser is its parent, and a holder of an earlier run (this
        # machine's other sessions run these tests too) may still sleep under alice's uid
        said, addr = holder.stdout.readline().split()
        pid = int(said)
        assert os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam("alice").pw_uid

        def read_as(user: str) -> list[str]:
            return subprocess.run(["runuser", "-u", user, "--", "/usr/bin/python3", "-c", READER, str(pid), addr],
                                  capture_output=True, text=True, timeout=60, check=True).stdout.split()

        assert read_as("alice") == ["5", "0", "alice"]
        assert read_as("bob")[:2] == ["-1", str(errno.EPERM)]
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)   # killing runuser alone leaves it sleeping, an orphan
            except ProcessLookupError:
                pass
        holder.kill()
        holder.wait()


def test_an_older_incarnation_racing_the_fence_never_retires_or_replaces_a_newer_ones_copies(tmp_path: Path) -> None:
    """A stalled rank of incarnation 1 whose request passed the fence check just before incarnation 2
    raised it (a race the fence file cannot close): the keeper still retires only copies of incarnations
    no newer than the asker's, so incarnation 2's copies stay."""
    from slurm_omni.checkpoint.memtier import parse_name

    store = held.HeldStore("j", parse=parse_name, fenced=lambda number: None, room=lambda n: "", keep=2)
    source = tmp_path / "shard.h5"
    source.write_bytes(os.urandom(10000))

    def hold(step: int, number: int) -> HoldReply:
        return store.hold(HoldRequest(op="hold", job="j", names=[f"step-{step}.rank-00000.j.{number}.h5"],
                                      source=str(source), number=number))

    try:
        assert hold(10, 2).ok and hold(20, 2).ok
        assert hold(30, 1).ok   # the stale life's copy is held under its own name, touching nothing
        assert sorted(c.name for c in store.where([])) == [
            "step-10.rank-00000.j.2.h5", "step-20.rank-00000.j.2.h5", "step-30.rank-00000.j.1.h5"]
        assert hold(40, 2).ok   # the newer life retires what is older than its keep, the stale copy included
        assert sorted(c.name for c in store.where([])) == ["step-30.rank-00000.j.1.h5", "step-40.rank-00000.j.2.h5"]
        view = store.get("step-40.rank-00000.j.2.h5")
        assert view is not None and bytes(view) == source.read_bytes()
        view.release()
    finally:
        store.close()
