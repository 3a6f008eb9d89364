"""The memory tier's peer copies (``checkpoint/peer.py``), three "nodes" in one process (each its own
tmpfs folder, a keeper on TCP): a replacement node restores from its peer's memory, bitwise; a node
lost with its peer, a bad replica, a wrong secret or a fenced sender each leave the file system."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from malformed_inputs import garbage

from ckpt.states import assert_same, engine, modules, optimizer_state, shard_state
from slurm_omni.checkpoint import CheckpointEngine, peer
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.fence import raise_fence
from slurm_omni.checkpoint.memtier import MemoryTier, free_job, job_dir

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")
RING = {"A": "B", "B": "A"}


@pytest.fixture
def shm() -> Iterator[Path]:
    base = SHM / f"omni-peertest-{uuid.uuid4().hex[:10]}"
    base.mkdir(mode=0o700)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def keeper_b(tmp_path: Path, shm: Path) -> Iterator[peer.Keeper]:
    keeper = peer.Keeper("j1", tmp_path, "B", base=shm / "B", bind="127.0.0.1", host="127.0.0.1")
    keeper.start()
    yield keeper
    keeper.stop()


def test_a_keeper_started_in_a_thread_has_said_where_it_listens_when_start_returns(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save right after ``start()`` finds the address (once, under nice 19 at load 500, it found
    none and left the step's replica to the file system): here the serving thread never runs at all."""
    keeper = peer.Keeper("j1", tmp_path, "B", base=shm / "B", bind="127.0.0.1", host="127.0.0.1")
    try:
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", lambda self: None)
            keeper.start()
        assert peer.keeper_path(tmp_path, "B").exists()
    finally:
        keeper.stop()


def on_node(root: Path, shm: Path, node: str, **config: Any) -> CheckpointEngine:
    eng = engine(root, memory_tier=True, memory_job="j1", memory_dir=shm / node, **config)
    assert eng.memory is not None
    eng.peers = peer.Replicas("j1", root, node, RING, eng.memory)
    return eng


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_replacement_node_restores_from_its_peers_memory_bitwise(tmp_path: Path, shm: Path,
                                                                  keeper_b: peer.Keeper) -> None:
    with on_node(tmp_path, shm, "A") as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    name = f"step-200.rank-00000.{eng.incarnation}.h5"
    area = job_dir(shm / "B", "j1") / peer.PEER_AREA
    assert stat.S_IMODE(area.stat().st_mode) == 0o700
    assert sorted(os.listdir(area)) == [f"step-100.rank-00000.{eng.incarnation}.h5", name]
    assert stat.S_IMODE((area / name).stat().st_mode) == 0o600
    rec = peer.read_replica(tmp_path, 0)
    assert rec is not None and [(c.holder, c.step) for c in rec.copies] == [("B", 200), ("B", 100)]
    # node A is gone (its memory with it), and the file system's shard too: only B's copy can answer
    shutil.rmtree(shm / "A")
    (fmt.step_dir(tmp_path, 200) / "rank-00000.h5").unlink()
    with on_node(tmp_path, shm, "C") as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "peer memory"
        for mod, want in modules(200).items():
            assert_same(r.module(mod), want, mod)
        assert_same(r.optimizer("text_decoder"), optimizer_state(200))
    # read once, straight into the tensors: nothing of it kept on C (its next save is its own copy)
    assert not [n for n in os.listdir(job_dir(shm / "C", "j1")) if n != peer.PEER_AREA]
    with on_node(tmp_path, shm, "C") as eng, eng.restore() as r:
        assert r.source == "peer memory"


def test_the_older_of_two_kept_steps_is_fetched_when_the_ranks_agree_on_it(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper) -> None:
    with on_node(tmp_path, shm, "A") as eng:
        for step in (100, 200, 300):
            eng.save(step, shard_state(step), sync=True)
    rec = peer.read_replica(tmp_path, 0)
    assert rec is not None and [c.step for c in rec.copies] == [300, 200]
    assert len(os.listdir(keeper_b.area)) == 2
    shutil.rmtree(shm / "A")
    (fmt.step_dir(tmp_path, 200) / "rank-00000.h5").unlink()
    with on_node(tmp_path, shm, "C") as eng, eng.restore(max_step=250) as r:   # the agreed bound
        assert r.step == 200 and r.source == "peer memory"
        assert_same(r.module("vision_encoder"), modules(200)["vision_encoder"])


def test_a_node_lost_with_its_peer_restores_from_the_file_system(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper, caplog: pytest.LogCaptureFixture) -> None:
    with on_node(tmp_path, shm, "A") as eng:
        eng.save(100, shard_state(100), sync=True)
    keeper_b.stop()                                       # B lost: its keeper and its memory
    shutil.rmtree(shm / "A")
    shutil.rmtree(shm / "B")
    with on_node(tmp_path, shm, "C") as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        assert_same(r.module("projector"), modules(100)["projector"])
    (line,) = warnings(caplog)
    assert "couldn't fetch rank-00000 of step-100 from B" in line and "file system" in line


def test_with_the_holder_lost_the_writer_nodes_own_copy_is_fetched(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper, caplog: pytest.LogCaptureFixture) -> None:
    """A lost holder, the writer's node alive (its rank moved elsewhere): its keeper serves its own copy."""
    keeper_a = peer.Keeper("j1", tmp_path, "A", base=shm / "A", bind="127.0.0.1", host="127.0.0.1")
    keeper_a.start()
    try:
        with on_node(tmp_path, shm, "A") as eng:
            eng.save(100, shard_state(100), sync=True)
        rec = peer.read_replica(tmp_path, 0)
        assert rec is not None and (rec.copies[0].holder, rec.copies[0].origin) == ("B", "A")
        keeper_b.stop()
        shutil.rmtree(shm / "B")
        (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").unlink()
        with on_node(tmp_path, shm, "C") as eng, eng.restore() as r:
            assert r.step == 100 and r.source == "peer memory"
            assert_same(r.module("projector"), modules(100)["projector"])
        assert warnings(caplog) == []
    finally:
        keeper_a.stop()


def test_a_bad_replica_is_dropped_and_the_same_step_read_from_the_file_system(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper, caplog: pytest.LogCaptureFixture) -> None:
    with on_node(tmp_path, shm, "A") as eng:
        eng.save(100, shard_state(100), sync=True)
    manifest = fmt.read_manifest(fmt.step_dir(tmp_path, 100))
    piece = manifest.units["text_decoder/model"].tensors["lm_head.weight"].pieces[0]
    copy = job_dir(shm / "B", "j1") / peer.PEER_AREA / f"step-100.rank-00000.{manifest.incarnation}.h5"
    with open(copy, "r+b") as f:
        f.seek(piece.offset + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with on_node(tmp_path, shm, "C") as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        assert_same(r.module("text_decoder"), modules(100)["text_decoder"])
    (line,) = warnings(caplog)
    assert "lm_head.weight" in line and "a peer's memory" in line and "file system" in line
    assert sorted(e.step for e in fmt.complete(tmp_path)) == [100]   # not marked: the checkpoint is sound


def test_a_stream_broken_midway_falls_back_to_the_file_system_with_one_line(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    with on_node(tmp_path, shm, "A") as eng:
        eng.save(100, shard_state(100), sync=True)
    real = peer._send_file

    def half(sock: socket.socket, fd: int, size: int) -> None:   # the holder dies halfway through
        real(sock, fd, size // 2)
        sock.shutdown(socket.SHUT_RDWR)

    monkeypatch.setattr(peer, "_send_file", half)
    with on_node(tmp_path, shm, "C") as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        assert_same(r.module("text_decoder"), modules(100)["text_decoder"])
        assert_same(r.optimizer("text_decoder"), optimizer_state(100))
    (line,) = warnings(caplog)
    assert "from B's memory: it ended at" in line and "a peer's memory" in line and "file system" in line, line
    assert sorted(e.step for e in fmt.complete(tmp_path)) == [100]   # not marked: the checkpoint is sound


def test_a_keeper_answers_only_requests_signed_with_the_jobs_secret(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper) -> None:
    shard = tmp_path / "x.h5"
    shard.write_bytes(os.urandom(1000))
    wrong = bytes(32)
    with pytest.raises(ConnectionError, match="secret"):
        peer.put("127.0.0.1", keeper_b.port, wrong, job="j1", name="step-1.rank-00000.i.h5", path=shard,
                 number=None)
    assert os.listdir(keeper_b.area) == []
    key = peer.load_secret(tmp_path)
    assert peer.put("127.0.0.1", keeper_b.port, key, job="j1", name="step-1.rank-00000.i.h5", path=shard,
                    number=None) == 1000
    into = os.open(shm / "got", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ConnectionError, match="secret"):
            peer.get("127.0.0.1", keeper_b.port, wrong, job="j1", name="step-1.rank-00000.i.h5", into=into, size=0)
        assert peer.get("127.0.0.1", keeper_b.port, key, job="j1", name="step-1.rank-00000.i.h5", into=into,
                        size=1000) == 1000
    finally:
        os.close(into)
    assert (shm / "got").read_bytes() == shard.read_bytes()
    # no path out of the peer area, and only this job's names
    for name in ("../../x.h5", "step-1.rank-00000.i.h5/../../x", "secret"):
        with pytest.raises((peer.PeerError, ConnectionError)):
            peer.put("127.0.0.1", keeper_b.port, key, job="j1", name=name, path=shard, number=None)
    with pytest.raises(peer.PeerError, match="not a shard copy of job j1"):
        peer.put("127.0.0.1", keeper_b.port, key, job="j2", name="step-2.rank-00000.i.h5", path=shard, number=None)
    secret = peer.meta_dir(tmp_path) / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700


def test_an_older_incarnation_cannot_replicate_after_a_newer_one_started(
        tmp_path: Path, shm: Path, keeper_b: peer.Keeper) -> None:
    with on_node(tmp_path, shm, "A", incarnation="j.1", incarnation_number=1) as old:
        old.save(100, shard_state(100), sync=True)
        raise_fence(tmp_path, 2, "j.2")
        assert old.save(200, shard_state(200), sync=True).fenced
    assert os.listdir(keeper_b.area) == ["step-100.rank-00000.j.1.h5"]
    shard = fmt.step_dir(tmp_path, 100) / "rank-00000.h5"
    key = peer.load_secret(tmp_path)
    with pytest.raises(peer.PeerError, match="incarnation 2 started since"):
        peer.put("127.0.0.1", keeper_b.port, key, job="j1", name="step-300.rank-00000.j.1.h5", path=shard, number=1)
    assert peer.put("127.0.0.1", keeper_b.port, key, job="j1", name="step-300.rank-00000.j.2.h5", path=shard,
                    number=2) > 0
    assert sorted(os.listdir(keeper_b.area)) == ["step-100.rank-00000.j.1.h5", "step-300.rank-00000.j.2.h5"]


def test_freeing_the_job_removes_the_peer_area(tmp_path: Path, shm: Path, keeper_b: peer.Keeper) -> None:
    with on_node(tmp_path, shm, "A") as eng:
        eng.save(100, shard_state(100), sync=True)
    MemoryTier("j1", base=shm / "B")   # B's own copies live beside the peer area
    assert os.listdir(keeper_b.area)
    assert free_job("j1", base=shm / "B") > 0
    assert not job_dir(shm / "B", "j1").exists()


def test_the_standby_runs_the_nodes_keeper_and_frees_its_peer_area_when_stopped(tmp_path: Path, shm: Path) -> None:
    """``omni standby serve`` (what the supervisor runs on every node) forks the node's keeper where the
    job keeps a memory tier; stopped at the job's end, both go and nothing of the job stays in memory."""
    short = Path(tempfile.mkdtemp(prefix="sb", dir="/tmp"))   # a socket's path has at most 107 bytes
    env = {**os.environ, "SLURM_JOB_ID": "j1", "SLURMD_NODENAME": "B", "TMPDIR": str(short),
           "OMNI_MEMORY_TIER": "1", "OMNI_CKPT_DIR": str(tmp_path), "OMNI_MEMORY_DIR": f"{shm}/%n",
           "OMNI_NODE_ADDR": "127.0.0.1"}
    env.pop("OMNI_MEMORY_KEEPER", None)
    server = subprocess.Popen([sys.executable, "-m", "slurm_omni.cli.main", "standby", "serve"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while peer.read_keeper(tmp_path, "B") is None and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        addr = peer.read_keeper(tmp_path, "B")
        assert addr is not None and addr.job == "j1", "the standby started no keeper"
        shard = tmp_path / "x.h5"
        shard.write_bytes(os.urandom(4096))
        peer.put(addr.host, addr.port, peer.load_secret(tmp_path), job="j1", name="step-1.rank-00002.j1.0.h5",
                 path=shard, number=None)
        assert os.listdir(job_dir(shm / "B", "j1") / peer.PEER_AREA) == ["step-1.rank-00002.j1.0.h5"]
        sock = short / f"omni-standby-{os.geteuid()}-j1" / "omni-standby-j1-B.sock"
        while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(short, ignore_errors=True)
    assert not job_dir(shm / "B", "j1").exists()
    with pytest.raises(OSError):
        socket.create_connection((addr.host, addr.port), timeout=2).close()


KEEPER_REC = {"node": "n3", "host": "10.0.0.3", "port": 40122, "pid": 7, "job": "42"}
REPLICA_REC = {"rank": 3, "copies": [{"step": 30, "incarnation": "42.1", "holder": "n7",
                                      "name": "step-30.rank-00003.42.1.h5", "size": 10}]}


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(keeper=garbage(KEEPER_REC), replica=garbage(REPLICA_REC))
def test_the_records_readers_take_any_bytes(tmp_path: Path, keeper: bytes, replica: bytes) -> None:
    """Another process's files: a record or None (one line), never another exception."""
    peer.keeper_path(tmp_path, "n3").parent.mkdir(parents=True, exist_ok=True)
    peer.replica_path(tmp_path, 3).parent.mkdir(parents=True, exist_ok=True)
    peer.keeper_path(tmp_path, "n3").write_bytes(keeper)
    peer.replica_path(tmp_path, 3).write_bytes(replica)
    got = peer.read_keeper(tmp_path, "n3")
    assert got is None or 1 <= got.port <= 65535
    rec = peer.read_replica(tmp_path, 3)
    assert rec is None or all(c.size >= 0 for c in rec.copies)


def test_a_keeper_survives_garbage_and_serves_the_next_client(tmp_path: Path, keeper_b: peer.Keeper) -> None:
    for junk in (b"", b"\xff" * 8, b"\x00\x00\x00\x05{}}}}" + bytes(32), b"\x7f\xff\xff\xff" + b"x" * 100):
        with socket.create_connection(("127.0.0.1", keeper_b.port), timeout=5) as s:
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except OSError:   # the keeper hung up on it (reset, broken pipe, not connected): what it should do
                pass
    shard = tmp_path / "x.h5"
    shard.write_bytes(b"y" * 100)
    assert peer.put("127.0.0.1", keeper_b.port, peer.load_secret(tmp_path), job="j1",
                    name="step-1.rank-00000.i.h5", path=shard, number=None) == 100
