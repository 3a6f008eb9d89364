"""Heartbeats aggregated per node (OMNI_HEARTBEAT_NODE_DIR, issue 19): the node's ranks write on the
node, one of them copies their beats into one file on the shared folder, a rank writes its own file
when the node folder is unusable (a stopped leader is taken over), and its last beat always."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_omni.elastic.heartbeat import Heartbeat, NodeRelay
from slurm_omni.manager.events import read_heartbeats

INTERVAL = 0.3


def wait_for(what: str, cond: Callable[[], bool], limit_s: float = 20.0) -> None:
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def ranks(shared: Path, node: str, n: int, node_dir: Path | None, first: int = 0) -> list[Heartbeat]:
    return [Heartbeat(shared, rank=r, stage=0, dp_rank=r, incarnation=0, job_id="42", interval_s=INTERVAL,
                      node=node, node_dir=node_dir) for r in range(first, first + n)]


def own_files(shared: Path) -> list[str]:
    return sorted(p.name for p in shared.glob("rank-*.json"))


def test_one_file_per_node_and_the_lead_moves_on(tmp_path: Path) -> None:
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    node1, node2 = ranks(shared, "n1", 4, shm), ranks(shared, "n2", 4, shm, first=4)
    for hb in node1 + node2:
        hb.update(step=3, phase="training")
        hb.start()
    try:
        # steady state: one file per node on the shared folder, every rank in it, no per-rank file
        wait_for("the node files and no per-rank file", lambda: own_files(shared) == [] and sorted(
            p.name for p in shared.glob("node-*")) == ["node-n1.jsonl", "node-n2.jsonl"]
            and len(read_heartbeats(shared)) == 8)
        assert sum(hb.relay is not None and hb.relay.leader for hb in node1) == 1
        local = shm / f"omni-beats-{os.geteuid()}-42-n1"
        assert oct(local.stat().st_mode & 0o777) == "0o700"
        # the leader ends: its last beat is its own file; another rank of the node takes the lead
        leader = next(hb for hb in node1 if hb.relay is not None and hb.relay.leader)
        leader.stop("done", exit_code=0)
        assert leader.path.exists()   # its last beat, in its own file
        # (a late copy sends no rank to its own file: only the node folder unusable does)
        wait_for("only the leader's own file", lambda: own_files(shared) == [leader.path.name])
        rest = [hb for hb in node1 if hb is not leader]
        wait_for("a new leader", lambda: sum(hb.relay is not None and hb.relay.leader for hb in rest) == 1)
        for hb in rest:
            hb.update(step=9)
        wait_for("the new leader's copy", lambda: {b.rank: b.step for b in read_heartbeats(shared)
                                                    if b.node == "n1"} == {
            **{hb._state["rank"]: 9 for hb in rest}, leader._state["rank"]: 3})
        assert {b.rank: b.phase for b in read_heartbeats(shared)}[leader._state["rank"]] == "done"
    finally:
        for hb in node1 + node2:
            if hb._thread.is_alive():
                hb.stop("stopping")
    assert list(shm.iterdir()) == []   # each node's last rank removed its node folder


def test_a_live_leader_whose_copy_is_late_keeps_the_lead_and_no_rank_writes_its_own_file(tmp_path: Path) -> None:
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    slow = NodeRelay(shm, shared_dir=shared, job_id="42", node="n1", rank=99, interval_s=INTERVAL)
    lock = os.open(slow.LOCK, os.O_RDWR | os.O_CREAT, 0o600, dir_fd=slow.folder.fd)
    fcntl.flock(lock, fcntl.LOCK_EX)   # a leader alive (this process) stuck in the shared folder's write
    (slow.folder_path / slow.LEADER).write_bytes(b"0 %d" % os.getpid())
    beats = ranks(shared, "n1", 3, shm)
    try:
        for hb in beats:
            hb.start()
        time.sleep(8 * INTERVAL)   # the node's copy is 8 intervals late: no fallback, no takeover
        assert own_files(shared) == []
        assert not any(hb.relay is not None and (hb.relay.leader or hb.relay.takeovers) for hb in beats)
        # the slow leader goes away: one rank leads, the node's copy carries every rank
        os.close(lock)
        wait_for("the node's copy", lambda: len(read_heartbeats(shared)) == 3)
        assert own_files(shared) == []
    finally:
        for hb in beats:
            hb.stop("stopping")


RANK = f"""
import sys, time
from pathlib import Path
from slurm_omni.elastic.heartbeat import Heartbeat
hb = Heartbeat(Path(sys.argv[1]), rank=int(sys.argv[3]), stage=0, dp_rank=0, incarnation=0, job_id="42",
               interval_s={INTERVAL!r}, node="n1", node_dir=Path(sys.argv[2]))
hb.update(step=1, phase="training")
hb.start()
time.sleep(600)
"""


def test_a_stopped_leader_is_taken_over_by_one_rank_and_its_hang_still_shows(tmp_path: Path) -> None:
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(shared), str(shm), str(r)]) for r in range(3)]
    folder = shm / f"omni-beats-{os.geteuid()}-42-n1"
    try:
        wait_for("the node's copy of 3 ranks", lambda: len(read_heartbeats(shared)) == 3)
        gen, pid = map(int, (folder / "leader").read_text().split())
        leader = next(p for p in procs if p.pid == pid)
        stopped_rank = procs.index(leader)
        os.kill(pid, signal.SIGSTOP)
        before = {b.rank: b.time for b in read_heartbeats(shared)}
        # one other rank of the node takes the lead over with the next lock; none writes its own file
        wait_for("a takeover", lambda: (folder / "leader").read_text().split()[0] == str(gen + 1))
        new_pid = int((folder / "leader").read_text().split()[1])
        assert new_pid != pid and new_pid in {p.pid for p in procs}
        wait_for("the live ranks' beats moving on", lambda: all(
            b.time > before[b.rank] + INTERVAL for b in read_heartbeats(shared) if b.rank != stopped_rank))
        time.sleep(4 * INTERVAL)
        seen = {b.rank: b for b in read_heartbeats(shared)}
        assert seen[stopped_rank].time == before[stopped_rank]   # the stopped rank's hang shows
        assert all(seen[r].time > before[r] for r in range(3) if r != stopped_rank)
        assert own_files(shared) == []
        # resumed, the old leader steps down: the node keeps one leader, the new one
        os.kill(pid, signal.SIGCONT)
        wait_for("the resumed rank's beat", lambda: {b.rank: b.time for b in read_heartbeats(shared)}[stopped_rank]
                 > before[stopped_rank])
        assert (folder / "leader").read_text().split() == [str(gen + 1), str(new_pid)]
        assert own_files(shared) == []
    finally:
        for p in procs:
            p.kill()   # a stopped process too
            p.wait()


def test_without_a_node_name_or_node_folder_every_rank_writes_its_own_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("OMNI_HEARTBEAT_NODE_DIR", "off")   # a node folder is the default: told off
    (hb_a,) = ranks(shared, "", 1, shm)
    (hb_b,) = ranks(shared, "n1", 1, None, first=1)
    assert hb_a.relay is None and hb_b.relay is None
    for hb in (hb_a, hb_b):
        hb.start()
        hb.stop("done", exit_code=0)
    assert own_files(shared) == ["rank-0.json", "rank-1.json"]
    assert not list(shm.iterdir())


def test_a_node_folder_others_can_write_is_refused_and_the_rank_writes_its_own_file(tmp_path: Path) -> None:
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    (shm / f"omni-beats-{os.geteuid()}-42-n1").mkdir(mode=0o777)
    os.chmod(shm / f"omni-beats-{os.geteuid()}-42-n1", 0o777)   # others could plant beats there
    (hb,) = ranks(shared, "n1", 1, shm)
    assert hb.relay is None   # refused (slurm_omni.ownership), one warning
    hb.start()
    hb.stop("done", exit_code=0)
    assert own_files(shared) == ["rank-0.json"]


@pytest.mark.parametrize("setting, expect", [(None, "default"), ("off", None), ("", None), ("OFF", None),
                                             ("/some/node/dir", "/some/node/dir")])
def test_per_node_is_the_default_and_off_falls_back_to_a_file_per_rank(
        monkeypatch: pytest.MonkeyPatch, setting: str | None, expect: str | None) -> None:
    from slurm_omni.formats.heartbeat import DEFAULT_NODE_DIR, node_dir_setting

    env = {} if setting is None else {"OMNI_HEARTBEAT_NODE_DIR": setting}
    want = (DEFAULT_NODE_DIR if DEFAULT_NODE_DIR.is_dir() else None) if expect == "default" else \
        (None if expect is None else Path(expect))
    assert node_dir_setting(env) == want


def test_a_rank_under_slurm_aggregates_in_dev_shm_unless_told_off(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job's ranks (the runtime's Heartbeat) beat per node by default; ``off``: their own files."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here: a file per rank is the fallback")
    job = f"t{os.getpid()}-{time.monotonic_ns()}"   # /dev/shm is the machine's: a job id of this test alone
    monkeypatch.delenv("OMNI_HEARTBEAT_NODE_DIR", raising=False)
    hb = Heartbeat(tmp_path / "hb", rank=0, stage=0, dp_rank=0, incarnation=0, job_id=job, interval_s=INTERVAL,
                   node="nX")
    assert hb.relay is not None and str(hb.relay.folder.path).startswith("/dev/shm/omni-beats-")
    hb.start()
    wait_for("the node file", lambda: (tmp_path / "hb" / "node-nX.jsonl").exists())
    hb.stop("done", exit_code=0)
    assert not Path(hb.relay.folder.path).exists()   # the node's last rank left nothing in /dev/shm
    monkeypatch.setenv("OMNI_HEARTBEAT_NODE_DIR", "off")
    off = Heartbeat(tmp_path / "hb2", rank=0, stage=0, dp_rank=0, incarnation=0, job_id=job, interval_s=INTERVAL,
                    node="nX")
    assert off.relay is None


def test_beats_a_gone_process_left_in_the_node_folder_long_ago_are_not_copied(tmp_path: Path) -> None:
    """A job id used again on this node (a cluster whose ids start over, /dev/shm kept) finds the beats
    of ranks killed with their node in the earlier job: they are removed, not copied as this job's."""
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    local = shm / f"omni-beats-{os.geteuid()}-42-n1"
    local.mkdir(mode=0o700)
    old = json.dumps({"rank": 7, "stage": 0, "dp_rank": 7, "pid": 2 ** 22 + 17, "incarnation": 5, "job_id": "42",
                      "step": 90, "phase": "training", "time": 1.0, "node": "n1", "beats": 3})
    (local / "rank-7.json").write_text(old)
    os.utime(local / "rank-7.json", (1.0, 1.0))   # long ago
    (hb,) = ranks(shared, "n1", 1, shm)
    hb.update(step=1, phase="training")
    hb.start()
    try:
        wait_for("the node file", lambda: (shared / "node-n1.jsonl").exists())
        assert sorted(b.rank for b in read_heartbeats(shared)) == [0]   # not the earlier job's rank 7
        assert not (local / "rank-7.json").exists()
    finally:
        hb.stop("done", exit_code=0)


def test_a_rank_whose_node_folder_the_last_launch_removed_opens_it_again(tmp_path: Path) -> None:
    """The race K=5's 8-node run hit: the dying launch's last rank removes the node folder just after
    a rank of the next launch on the same node opened it. The new rank's beats must still land in a
    folder at the path (one folder per node, so one leader publishes every rank), and leading must
    not raise (it would end the heartbeat thread)."""
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    old = NodeRelay(shm, shared_dir=shared, job_id="42", node="n1", rank=0, interval_s=INTERVAL)
    old.beat(b'{"x": 1}', time.time())
    new = NodeRelay(shm, shared_dir=shared, job_id="42", node="n1", rank=1, interval_s=INTERVAL)
    old.beat(b"", time.time(), last=True)          # the old launch's last rank leaves: folder removed
    assert not new.folder_path.exists()
    try:
        new.lead(time.time())
    except OSError:
        pass                                       # the thread catches it; the next beat reopens
    new.beat(b'{"y": 2}', time.time())
    assert new.folder_path.is_dir()
    assert (new.folder_path / new.name).read_bytes() == b'{"y": 2}'
    later = NodeRelay(shm, shared_dir=shared, job_id="42", node="n1", rank=2, interval_s=INTERVAL)
    assert os.path.samestat(os.fstat(later.folder.fd), os.fstat(new.folder.fd))
    new.close()
    later.close()


def test_a_lock_held_by_a_leader_not_yet_named_is_not_taken_over_and_a_newer_lead_is_not_hidden(tmp_path: Path) -> None:
    """The relay's start-up race (tests/supervisor/test_light_rank.py failed 2 of 17 runs, 10:45): the
    first leader holds the lock but has not written ``leader`` yet, and no copy was published; a
    rank that took over then (pid 0 'stopped or gone', the copy 'infinitely late') led beside it,
    and the first leader's name, written after, hid the takeover for good."""
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    relay = NodeRelay(shm, shared_dir=shared, job_id="42", node="n1", rank=1, interval_s=INTERVAL)
    lock = os.open(relay.LOCK, os.O_RDWR | os.O_CREAT, 0o600, dir_fd=relay.folder.fd)
    fcntl.flock(lock, fcntl.LOCK_EX)   # the first leader, between its lock and its name
    try:
        relay.lead(time.time() + 100 * INTERVAL)
        assert not relay.leader and relay.takeovers == 0
        assert not (relay.folder_path / relay.LEADER).exists()
        os.close(lock)
        lock = -1
        take = relay._take

        def taken_over_meanwhile(gen: int) -> bool:   # another rank names generation 1 just after this take
            took = take(gen)
            (relay.folder_path / relay.LEADER).write_bytes(b"1 %d" % os.getpid())
            return took

        relay._take = taken_over_meanwhile   # type: ignore[method-assign]
        relay.lead(time.time())
        assert not relay.leader   # it stepped down: its name would have hidden the newer lead
        assert (relay.folder_path / relay.LEADER).read_bytes() == b"1 %d" % os.getpid()
    finally:
        if lock >= 0:
            os.close(lock)
        relay.close()


def test_a_node_folder_removed_after_the_rank_beat_there_is_not_made_again(tmp_path: Path) -> None:
    """The job's end removes the node folder (the plugin's epilog; on the embedded cluster's shared
    /dev/shm also while another node's ranks are still being killed): the last rank never removes a
    folder that holds a beat, so a rank that beat there does not make it again (made again, it stayed
    behind the killed rank: omni-beats-0-42-node3 with rank-1.json, leader, lock, published; reproduced
    with a rank on a node whose slurmd was killed, the job cancelled, then slurmd back). The rank is
    still seen, by its own file; nothing is left on the node."""
    shared, shm = tmp_path / "hb", tmp_path / "shm"
    shm.mkdir()
    (hb,) = ranks(shared, "n1", 1, shm)
    hb.update(step=1, phase="training")
    hb.start()
    local = shm / f"omni-beats-{os.geteuid()}-42-n1"
    try:
        wait_for("the node file", lambda: (shared / "node-n1.jsonl").exists() and (local / "rank-0.json").exists())
        for entry in local.iterdir():   # what the epilog does
            entry.unlink()
        local.rmdir()
        hb.update(step=2)
        wait_for("the rank's own file", lambda: own_files(shared) == ["rank-0.json"]
                 and [b.step for b in read_heartbeats(shared) if b.time > time.time() - INTERVAL] == [2])
        time.sleep(3 * INTERVAL)
        assert not local.exists()
    finally:
        hb.stop("stopping", exit_code=0)
    assert not local.exists() and list(shm.iterdir()) == []


def test_a_node_folder_an_earlier_job_left_is_swept_by_the_users_next_rank_there(tmp_path: Path) -> None:
    """A node Slurm took out of a job runs none of its epilog; its rank SIGKILLed later leaves the
    node folder (CI: omni-beats-0-43-node3). The user's next rank on the node removes folders that
    nothing beats in; a folder whose rank still runs (a suspended job), a fresh one, another node's,
    and one another user can write stay."""
    from slurm_omni.formats import encode
    from slurm_omni.formats.heartbeat import HeartbeatRecord

    node_dir, shared = tmp_path / "shm", tmp_path / "hb"
    node_dir.mkdir()
    shared.mkdir()
    uid = os.geteuid()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()

    def folder(job: str, node: str, pid: int, age_s: float, mode: int = 0o700) -> Path:
        f = node_dir / f"omni-beats-{uid}-{job}-{node}"
        f.mkdir(mode=mode)
        f.chmod(mode)
        rec = HeartbeatRecord(rank=1, stage=0, dp_rank=0, pid=pid, incarnation=0, job_id=job, step=9,
                              phase="training", time=time.time() - age_s, node=node, beats=3)
        for name, data in (("rank-1.json", encode(rec)), ("leader", b"0 %d" % pid), ("published", b"x"),
                           ("lock", b"")):
            (f / name).write_bytes(data)
            os.utime(f / name, (time.time() - age_s, time.time() - age_s))
        return f

    left = folder("43", "node3", int(dead), 600)
    suspended = folder("44", "node3", os.getpid(), 600)       # its rank runs (stopped by a suspend)
    fresh = folder("45", "node3", int(dead), 5)               # beat 5 s ago: maybe a rank still starting
    other_node = folder("46", "node4", int(dead), 600)
    writable = folder("47", "node3", int(dead), 600, mode=0o777)
    relay = NodeRelay(node_dir, shared_dir=shared, job_id="50", node="node3", rank=0, interval_s=1.0)
    try:
        assert not left.exists()
        assert suspended.exists() and fresh.exists() and other_node.exists() and writable.exists()
        assert relay.folder_path.is_dir()
    finally:
        relay.close()
        relay.folder.close()
