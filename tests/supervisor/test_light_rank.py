"""bench/light_rank.py, the scale lane's rank without torch, and bench/light_rank.c, the same rank in
C (what the scale bench runs), speak the runtime's contract: their files decode with the package's
own schemas, every rank resumes from the newest step all of them hold, and their exit codes are the
runtime's (0, 75, 78). Every contract test runs on both ranks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from bench.light_build import BuildError, build, compiler, rank_argv
from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE
from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import HeartbeatRecord
from slurm_omni.formats.metrics import parse_line, read_folder
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.supervisor.ports import pick

LIGHT_RANK = Path(__file__).resolve().parents[2] / "bench" / "light_rank.py"


def _compiled(dest: Path, **kw: object) -> Path:
    if compiler() is None:
        pytest.skip("no C compiler (cc, gcc or $CC): the C light rank is not built here")
    try:
        return build(dest, **kw)  # type: ignore[arg-type]
    except BuildError as e:   # a compiler that finds a warning in our source: a failure, not a skip
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def c_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bench/light_rank.c compiled as the scale bench compiles it (warnings are errors)."""
    return _compiled(tmp_path_factory.mktemp("light-c"))


@pytest.fixture(params=["python", "c"])
def rank(request: pytest.FixtureRequest) -> list[str]:
    """The command of one light rank: the Python reference or the C rank."""
    if request.param == "python":
        return [sys.executable, "-S", str(LIGHT_RANK)]
    return [str(request.getfixturevalue("c_rank"))]


def _env(tmp_path: Path, rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    (tmp_path / "shm").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), OMNI_DP_SIZE=str(world), OMNI_DP_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMNI_CKPT_DIR=str(tmp_path / "ckpt"),
               OMNI_HEARTBEAT_DIR=str(tmp_path / "hb"), OMNI_METRICS_DIR=str(tmp_path / "metrics"),
               OMNI_JOB_ID="42", OMNI_HEARTBEAT_INTERVAL="0.05", OMNI_STEP_DELAY_S="0.01",
               OMNI_COLLECTIVE_TIMEOUT="60", SLURMD_NODENAME=f"node{rank + 1}",
               # per node by default (/dev/shm); here the test's own node-local folder
               OMNI_HEARTBEAT_NODE_DIR=str(tmp_path / "shm"))
    env.update(extra)
    return env


def _start(tmp_path: Path, world: int, rank: list[str], **extra: str) -> list[subprocess.Popen[bytes]]:
    port, _ = pick(range(41000, 41100))
    return [subprocess.Popen(rank, env=_env(tmp_path, r, world, port, **extra),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]


def _beat(tmp_path: Path, rank: int) -> HeartbeatRecord | None:
    """The rank's newest beat through the package's one reader (its own file or its node's)."""
    return next((b for b in read_heartbeats(tmp_path / "hb") if b.rank == rank), None)


def _codes(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    return [p.wait(timeout=60) for p in procs]


def _first_lines(tmp_path: Path, incarnation: int) -> dict[int, dict[str, object]]:
    out: dict[int, dict[str, object]] = {}
    for lines in read_folder(tmp_path / "metrics").values():   # the rank's own file and its node's
        for where, line in lines:
            rec = parse_line(line, where)   # the package's strict reader
            if rec.incarnation == incarnation and rec.rank not in out:
                out[rec.rank] = json.loads(line)
    return out


def test_light_ranks_run_resume_from_the_step_all_hold_and_finish(tmp_path: Path, rank: list[str]) -> None:
    assert _codes(_start(tmp_path, 3, rank, OMNI_MAX_STEPS="12", OMNI_INCARNATION="0")) == [EXIT_DONE] * 3
    beats = read_heartbeats(tmp_path / "hb")
    assert sorted(b.rank for b in beats) == [0, 1, 2]
    assert {(b.phase, b.step, b.exit_code, b.last_checkpoint_step) for b in beats} == {("done", 12, 0, 12)}
    assert {b.node for b in beats} == {"node1", "node2", "node3"}
    own = sorted((tmp_path / "hb").glob("rank-*.json"))   # the last beats: the bytes the runtime's encode() writes
    assert len(own) == 3
    for path in own:
        data = path.read_bytes()
        assert encode(msgspec.json.decode(data, type=HeartbeatRecord)) == data, data
    # the metrics lines went per node (node-<NODE>.jsonl, copied by the node's leader), by default: every
    # step once; the loss rank's (replica 0 of the last stage, alone on node1) straight to its own file
    assert sorted(p.name for p in (tmp_path / "metrics").glob("node-*.jsonl")) == ["node-node2.jsonl", "node-node3.jsonl"]
    own = (tmp_path / "metrics" / "metrics-main-0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in own] == list(range(1, 13))
    for lines in read_folder(tmp_path / "metrics").values():
        assert [parse_line(t, w).step for w, t in lines] == list(range(1, 13))
    assert not list((tmp_path / "shm").iterdir())   # the node folders removed by their last rank
    markers = sorted(p.name for p in (tmp_path / "ckpt" / "light" / "rank-1").iterdir())
    assert markers == ["step-10.json", "step-12.json", "step-5.json"]   # every 5 and the last
    # rank 2 lost its newest marker, rank 0 an older one: everyone resumes from step 10, the newest
    # all hold, and markers older than it go
    (tmp_path / "ckpt" / "light" / "rank-2" / "step-12.json").unlink()
    (tmp_path / "ckpt" / "light" / "rank-0" / "step-5.json").unlink()
    assert _codes(_start(tmp_path, 3, rank, OMNI_MAX_STEPS="14", OMNI_INCARNATION="1")) == [EXIT_DONE] * 3
    assert sorted(p.name for p in (tmp_path / "ckpt" / "light" / "rank-1").iterdir()) == \
        ["step-10.json", "step-12.json", "step-14.json"]
    first = _first_lines(tmp_path, 1)
    assert sorted(first) == [0, 1, 2]
    assert {line["restored_step"] for line in first.values()} == {10}
    assert {line["step"] for line in first.values()} == {11}
    for line in first.values():
        started, ready, restored = (float(line[k]) for k in ("task_started_at", "groups_ready_at", "restored_at"))
        assert 0 < started <= ready <= restored


def test_ranks_that_start_before_rank_0_join_and_rank_0_says_when_its_store_listened(
        tmp_path: Path, rank: list[str]) -> None:
    """Ranks refused while rank 0 is not up join once it listens, three of them on one node (one
    tries for the node, the others wait on its lock, which the last one through removes); rank 0's
    one line (what the scale bench splits the rendezvous with) says when its store listened and had
    every join."""
    from bench.scale_bench import STORE_LINE

    port, _ = pick(range(41000, 41100))
    env = {"OMNI_MAX_STEPS": "3", "OMNI_INCARNATION": "0"}
    peers = [subprocess.Popen(rank, env=_env(tmp_path, r, 5, port, **env, **({"SLURMD_NODENAME": "node2"} if r < 4 else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(1, 5)]
    time.sleep(0.3)   # the peers start first and are refused
    before = time.time()
    zero = subprocess.Popen(rank, env=_env(tmp_path, 0, 5, port, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert _codes([zero, *peers]) == [EXIT_DONE] * 5
    said = zero.stdout.read().decode() if zero.stdout else ""
    m = STORE_LINE.search(said)
    assert m is not None, said
    assert before < float(m["listening"]) <= float(m["joined"]) and int(m["ranks"]) == 5 and int(m["wakes"]) >= 1
    first = _first_lines(tmp_path, 0)
    assert sorted(first) == [0, 1, 2, 3, 4]
    assert float(m["joined"]) <= float(first[0]["groups_ready_at"])   # rank 0 answered after the last join
    assert not list((tmp_path / "shm").iterdir())   # no probe lock left, the node folders removed


def test_rank_0_on_a_taken_port_exits_1_and_its_last_beat_says_why(tmp_path: Path, rank: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        env = _env(tmp_path, 0, 2, taken.getsockname()[1], OMNI_MAX_STEPS="3")
        proc = subprocess.run(rank, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    beat = _beat(tmp_path, 0)
    assert beat is not None and beat.phase == "failed" and beat.exit_code == 1
    assert "OSError" in beat.error and "Errno 98" in beat.error, beat.error


def test_a_stop_signal_saves_and_exits_75(tmp_path: Path, rank: list[str]) -> None:
    procs = _start(tmp_path, 2, rank, OMNI_MAX_STEPS="100000", OMNI_STEP_DELAY_S="0.05", OMNI_INCARNATION="3")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (b := _beat(tmp_path, 1)) is not None and b.step >= 2:
            break
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    assert _codes(procs) == [EXIT_CHECKPOINTED] * 2
    for b in read_heartbeats(tmp_path / "hb"):
        assert (b.phase, b.exit_code, b.incarnation) == ("stopping", EXIT_CHECKPOINTED, 3)
        assert b.last_checkpoint_step == b.step
        assert (tmp_path / "ckpt" / "light" / f"rank-{b.rank}" / f"step-{b.step}.json").exists()


def test_a_blocked_rank_beats_without_stepping_and_a_stop_ends_it_without_saving(tmp_path: Path, rank: list[str]) -> None:
    """The scale bench's hang: SIGURG puts a rank in a collective that never returns (it beats, it
    never steps); a stop signal then ends it with exit 1 and no new checkpoint."""
    procs = _start(tmp_path, 1, rank, OMNI_MAX_STEPS="100000", OMNI_STEP_DELAY_S="0.02", OMNI_LIGHT_CKPT_EVERY="1000")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (b := _beat(tmp_path, 0)) is not None and b.step >= 2:
            break
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGURG)
    time.sleep(0.3)   # the step in flight ends; then no other starts
    held = _beat(tmp_path, 0)
    assert held is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ((b := _beat(tmp_path, 0)) is None or b.beats < held.beats + 3):
        time.sleep(0.05)
    later = _beat(tmp_path, 0)
    assert later is not None and later.beats >= held.beats + 3 and later.step == held.step
    assert later.phase == "training"
    procs[0].send_signal(signal.SIGTERM)
    assert _codes(procs) == [1]
    last = _beat(tmp_path, 0)
    assert last is not None
    assert (last.phase, last.exit_code, last.step) == ("failed", 1, held.step)
    assert last.last_checkpoint_step is None and not (tmp_path / "ckpt" / "light" / "rank-0").exists()


def test_ranks_with_no_step_in_common_exit_78(tmp_path: Path, rank: list[str]) -> None:
    assert _codes(_start(tmp_path, 2, rank, OMNI_MAX_STEPS="5")) == [EXIT_DONE] * 2
    (tmp_path / "ckpt" / "light" / "rank-1" / "step-5.json").rename(tmp_path / "ckpt" / "light" / "rank-1" / "step-4.json")
    assert _codes(_start(tmp_path, 2, rank, OMNI_MAX_STEPS="10", OMNI_INCARNATION="1")) == [EXIT_BAD_INPUT] * 2
    assert {(b.phase, b.exit_code) for b in read_heartbeats(tmp_path / "hb")} == {("failed", EXIT_BAD_INPUT)}


@pytest.mark.parametrize("bad", [{"WORLD_SIZE": "two"}, {"OMNI_DP_RANK": "5"}, {"MASTER_PORT": ""},
                                 {"OMNI_METRICS_PER_NODE": "maybe"}])
def test_input_no_restart_can_fix_exits_78_with_one_line(tmp_path: Path, bad: dict[str, str], rank: list[str]) -> None:
    env = {**_env(tmp_path, 1, 2, 1), **bad}
    proc = subprocess.run(rank, env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == EXIT_BAD_INPUT
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("light rank: couldn't")
    if "WORLD_SIZE" not in bad:   # the rank knew who it was: its last beat says why
        beat = _beat(tmp_path, 1)
        assert beat is not None and (beat.phase, beat.exit_code) == ("failed", EXIT_BAD_INPUT) and beat.error.startswith("light rank:")


def test_light_ranks_aggregate_their_beats_per_node(tmp_path: Path, rank: list[str]) -> None:
    """Per node (the default; OMNI_HEARTBEAT_NODE_DIR names the folder): the 4 ranks of one node beat on the node and one of them copies their
    beats into node-<NODE>.jsonl, which the package's reader decodes; the last beats are each rank's own."""
    shm = tmp_path / "shm"
    procs = _start(tmp_path, 4, rank, OMNI_MAX_STEPS="150", OMNI_INCARNATION="0", SLURMD_NODENAME="nodeA",
                   OMNI_HEARTBEAT_NODE_DIR=str(shm))
    node_file = tmp_path / "hb" / "node-nodeA.jsonl"
    seen: set[int] = set()
    end = time.monotonic() + 60
    local = shm / f"omni-beats-{os.geteuid()}-42-nodeA"
    modes = set()
    while procs[0].poll() is None and time.monotonic() < end and seen != {0, 1, 2, 3}:
        if local.exists():
            modes.add(local.stat().st_mode & 0o777)
        if node_file.exists():
            seen |= {b.rank for b in read_heartbeats(tmp_path / "hb") if b.phase == "training"
                     and not (tmp_path / "hb" / f"rank-{b.rank}.json").exists()}
        time.sleep(0.02)
    assert _codes(procs) == [EXIT_DONE] * 4
    assert seen == {0, 1, 2, 3}   # each rank's training beats reached the shared folder through the node file
    assert modes == {0o700}
    assert not local.exists()   # the node's last rank removed the node folder
    beats = read_heartbeats(tmp_path / "hb")
    assert {(b.rank, b.phase, b.step, b.exit_code) for b in beats} == {(r, "done", 150, 0) for r in range(4)}
    assert sorted(p.name for p in (tmp_path / "hb").glob("rank-*.json")) == [f"rank-{r}.json" for r in range(4)]


def test_a_stopped_leader_is_taken_over_by_one_rank_and_its_hang_still_shows(tmp_path: Path, rank: list[str]) -> None:
    """A node's leader SIGSTOPped keeps its lock: one other rank of the node takes the lead over (the
    next generation's lock, named in ``leader``), no rank writes its own file on the shared folder, and
    the stopped rank's beat, still copied, stops while its peers' go on (issue 19, the 512-node collapse)."""
    shm = tmp_path / "shm"
    procs = _start(tmp_path, 3, rank, OMNI_MAX_STEPS="1000000", OMNI_INCARNATION="0", SLURMD_NODENAME="nodeA",
                   OMNI_HEARTBEAT_NODE_DIR=str(shm), OMNI_HEARTBEAT_INTERVAL="0.1")
    folder, hb = shm / f"omni-beats-{os.geteuid()}-42-nodeA", tmp_path / "hb"

    def wait(what: str, cond: Callable[[], bool]) -> None:
        end = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            assert all(p.poll() is None for p in procs), f"a rank ended waiting for {what}"
            time.sleep(0.02)

    def lead() -> list[str]:
        try:
            return (folder / "leader").read_text().split()
        except FileNotFoundError:
            return []

    try:
        wait("the node's copy of 3 ranks", lambda: {b.rank for b in read_heartbeats(hb)} == {0, 1, 2})
        wait("a leader", lambda: len(lead()) == 2)
        gen, pid = map(int, lead())
        stopped = next(r for r, p in enumerate(procs) if p.pid == pid)
        procs[stopped].send_signal(signal.SIGSTOP)
        before = {b.rank: b.beats for b in read_heartbeats(hb)}
        wait("a takeover", lambda: lead()[:1] == [str(gen + 1)])
        assert int(lead()[1]) in {p.pid for p in procs} - {pid}
        wait("the live ranks' beats moving on", lambda: all(
            b.beats >= before[b.rank] + 3 for b in read_heartbeats(hb) if b.rank != stopped))
        assert {b.rank: b.beats for b in read_heartbeats(hb)}[stopped] == before[stopped]   # its hang shows
        assert sorted(p.name for p in hb.glob("rank-*.json")) == []   # no rank fell back to its own file
    finally:
        for p in procs:
            p.kill()   # a stopped one too
            p.wait()


def _remove_folder(folder: Path) -> None:
    """What the job's end does (the plugin's epilog): every file, then the folder; a file the running
    rank writes meanwhile (its next beat's temporary) is taken next turn."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for p in folder.iterdir():
            p.unlink(missing_ok=True)
        try:
            folder.rmdir()
            return
        except OSError:
            continue
    raise AssertionError(f"couldn't remove {folder}")


def test_a_rank_whose_node_folder_the_jobs_end_removed_does_not_make_it_again(tmp_path: Path,
                                                                               rank: list[str]) -> None:
    """The node folder removed after the rank beat there (the job's end: the epilog; the last rank of
    a life never removes a folder that holds a beat): the rank does not make it again (made again, it
    stayed behind the rank once killed: a node whose slurmd died, issue 22), says so once and beats
    into its own file to its end, as the runtime's NodeRelay does."""
    shm = tmp_path / "shm"
    procs = _start(tmp_path, 1, rank, OMNI_MAX_STEPS="100000", OMNI_STEP_DELAY_S="0.05", OMNI_INCARNATION="1",
                   SLURMD_NODENAME="nodeA", OMNI_HEARTBEAT_NODE_DIR=str(shm))
    local = shm / f"omni-beats-{os.geteuid()}-42-nodeA"
    node_file, own = tmp_path / "hb" / "node-nodeA.jsonl", tmp_path / "hb" / "rank-0.json"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ((local / "rank-0.json").exists() and node_file.exists()):
            time.sleep(0.02)
        assert node_file.exists(), "no node file before the removal"
        _remove_folder(local)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not own.exists():
            time.sleep(0.02)
        assert own.exists(), "the rank's beats did not go to its own file"
        time.sleep(0.3)
        assert not local.exists()
        assert procs[0].poll() is None
        procs[0].send_signal(signal.SIGUSR1)
        assert _codes(procs) == [EXIT_CHECKPOINTED]
        said = procs[0].stdout.read().decode() if procs[0].stdout else ""
        assert said.count("removed after this rank beat there") == 1, said
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not local.exists() and list(shm.iterdir()) == []


def test_the_python_relay_opens_a_folder_the_life_before_removed_before_its_first_beat(tmp_path: Path) -> None:
    """The race of a relaunch (issue 19, 512 nodes: 1,373 times in one launch): the dying launch's last
    rank removes the node folder after a rank of the next launch opened it and before its first beat;
    that rank opens the folder at its path again and its beats go on through the node."""
    sys.path.insert(0, str(LIGHT_RANK.parent))
    try:
        from light_relay import Relay
    finally:
        sys.path.remove(str(LIGHT_RANK.parent))
    shm, shared = tmp_path / "shm", tmp_path / "hb"
    shm.mkdir()
    shared.mkdir()
    old = Relay.open(str(shm), "42", "nodeA", 0, str(shared), 0.05)
    new = Relay.open(str(shm), "42", "nodeA", 1, str(shared), 0.05)
    assert old is not None and new is not None
    old.beat(b"", time.time(), last=True)   # no beat of the new rank in it yet: removed
    assert not Path(new.path).exists()
    new.beat(b'{"y": 2}', time.time())
    assert (Path(new.path) / "rank-1.json").read_bytes() == b'{"y": 2}'


@pytest.mark.parametrize("setting", [None, "off"])
def test_beats_go_per_node_by_default_and_per_rank_when_off(tmp_path: Path, setting: str | None, rank: list[str]) -> None:
    """Unset, OMNI_HEARTBEAT_NODE_DIR means /dev/shm (the node's ranks publish node-<NODE>.jsonl);
    ``off``: every rank writes its own file and no node file appears."""
    job = f"t{uuid.uuid4().hex[:12]}"   # /dev/shm is the machine's: a job id no other test uses
    extra = {"OMNI_JOB_ID": job, "SLURMD_NODENAME": "nodeA", "OMNI_MAX_STEPS": "40", "OMNI_INCARNATION": "0"}
    port, _ = pick(range(41000, 41100))
    envs = [_env(tmp_path, r, 2, port, **extra) for r in range(2)]
    for env in envs:
        del env["OMNI_HEARTBEAT_NODE_DIR"]
        if setting is not None:
            env["OMNI_HEARTBEAT_NODE_DIR"] = setting
    procs = [subprocess.Popen(rank, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for env in envs]
    node_file, local = tmp_path / "hb" / "node-nodeA.jsonl", Path("/dev/shm") / f"omni-beats-{os.geteuid()}-{job}-nodeA"
    seen_local = False
    while any(p.poll() is None for p in procs):
        seen_local |= local.exists()
        time.sleep(0.02)
    assert _codes(procs) == [EXIT_DONE] * 2
    assert node_file.exists() == seen_local == (setting is None)
    assert not local.exists()
    assert {(b.rank, b.phase, b.step) for b in read_heartbeats(tmp_path / "hb")} == {(0, "done", 40), (1, "done", 40)}


@pytest.mark.parametrize("value", [6.461143493652344e-05, 1.5e-05, -6.4e-05, 1e-05, 1e-06, 2.5e-07, 0.0001, 0.5,
                                   1796217469.8657355, 1e16, 1.2345678901234568e17, -1e22, 0.0])
def test_floats_are_written_as_the_runtime_writes_them(value: float) -> None:
    # a rank that fell behind steps at once: a step time of 6.5e-05 s, which repr writes with an exponent
    sys.path.insert(0, str(LIGHT_RANK.parent))
    try:
        import light_rank
    finally:
        sys.path.remove(str(LIGHT_RANK.parent))
    assert light_rank._encode(value).encode() == msgspec.json.encode(value)


FLOAT_HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "light_rank.h"
int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        struct buf b = {0};
        put_float(&b, strtod(argv[i], NULL), 1);
        puts(b.p);
        free(b.p);
    }
    return 0;
}
"""


def test_the_c_rank_writes_floats_as_the_runtime_writes_them(tmp_path: Path) -> None:
    """The C rank's float writer (light_io.c in a harness) against msgspec, the runtime's."""
    values = [6.461143493652344e-05, 1.5e-05, -6.4e-05, 1e-05, 1e-06, 2.5e-07, 0.0001, 0.5, 1796217469.8657355,
              1e16, 1.2345678901234568e17, -1e22, 0.0, 123.0, 1e15, 0.1 + 0.2, 5e-324, 1.7976931348623157e308]
    harness = tmp_path / "float_harness.c"
    harness.write_text(FLOAT_HARNESS)
    binary = _compiled(tmp_path / "out", sources=(harness, LIGHT_RANK.parent / "light_io.c"),
                       extra=("-I", str(LIGHT_RANK.parent), "-lm"))
    out = subprocess.run([str(binary), *map(repr, values)], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.split() == [msgspec.json.encode(v).decode() for v in values]


def test_without_a_compiler_the_bench_says_so_and_runs_the_python_rank(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    argv, said = rank_argv("c", sys.executable, tmp_path)
    assert argv == [sys.executable, "-S", str(LIGHT_RANK)]
    assert "fell back" in said and "couldn't compile" in said and "\n" not in said


def test_a_c_rank_and_a_python_rank_agree_through_one_store(tmp_path: Path, c_rank: Path) -> None:
    """One rendezvous protocol: rank 0 in C with a Python peer, then rank 0 in Python with a C peer;
    the second life resumes from the step both hold."""
    python = [sys.executable, "-S", str(LIGHT_RANK)]
    for life, kinds in enumerate([([str(c_rank)], python), (python, [str(c_rank)])]):
        port, _ = pick(range(41000, 41100))
        procs = [subprocess.Popen(argv, env=_env(tmp_path, r, 2, port, OMNI_MAX_STEPS=str(5 * (life + 1)),
                                                 OMNI_INCARNATION=str(life)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r, argv in enumerate(kinds)]
        assert _codes(procs) == [EXIT_DONE] * 2
    first = _first_lines(tmp_path, 1)
    assert {line["restored_step"] for line in first.values()} == {5} and sorted(first) == [0, 1]


def test_a_rank_joins_the_cgroup_it_is_given_or_says_why_and_runs_on(tmp_path: Path, rank: list[str]) -> None:
    """OMNI_LIGHT_CGROUP: the rank writes its pid into <folder>/cgroup.procs at its start (here a plain
    folder stands for the cgroup); a folder it cannot write to: one line, and it trains on."""
    group = tmp_path / "group"
    group.mkdir()
    procs = _start(tmp_path, 1, rank, OMNI_MAX_STEPS="2", OMNI_LIGHT_CGROUP=str(group))
    assert _codes(procs) == [EXIT_DONE]
    beat = _beat(tmp_path, 0)
    assert beat is not None and (group / "cgroup.procs").read_text() == str(beat.pid)
    missing = tmp_path / "no-such-group"
    procs = _start(tmp_path, 1, rank, OMNI_MAX_STEPS="2", OMNI_INCARNATION="1", OMNI_LIGHT_CGROUP=str(missing))
    assert _codes(procs) == [EXIT_DONE]
    assert procs[0].stdout is not None
    out = procs[0].stdout.read().decode()
    lines = [line for line in out.splitlines() if "cgroup" in line]
    assert len(lines) == 1 and lines[0].startswith(f"light rank: couldn't join the cgroup {missing}: "), out


def test_the_ranks_finish_together_at_the_first_step_due_at_the_finish_time(tmp_path: Path, rank: list[str]) -> None:
    """OMNI_LIGHT_FINISH_FILE (the scale bench's end of a run): ranks with a budget they never reach
    read a wall-clock time from the file after each step and all end at the first step of their life
    due at or after it, with a marker of it; a life that starts after that time ends at its restore."""
    finish = tmp_path / "finish"
    extra = {"OMNI_MAX_STEPS": "100000", "OMNI_STEP_DELAY_S": "0.05", "OMNI_LIGHT_FINISH_FILE": str(finish)}
    procs = _start(tmp_path, 3, rank, OMNI_INCARNATION="0", **extra)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ((b := _beat(tmp_path, 2)) is None or b.step < 3):
        time.sleep(0.05)
    at = time.time() + 0.3
    (tmp_path / "finish.tmp").write_text(f"{at!r}\n")
    (tmp_path / "finish.tmp").rename(finish)
    assert _codes(procs) == [EXIT_DONE] * 3
    beats = read_heartbeats(tmp_path / "hb")
    assert len({(b.phase, b.exit_code, b.step, b.last_checkpoint_step) for b in beats}) == 1
    last = beats[0].step
    assert beats[0].phase == "done" and beats[0].last_checkpoint_step == last and 3 < last < 100
    for r in range(3):
        assert (tmp_path / "ckpt" / "light" / f"rank-{r}" / f"step-{last}.json").exists()
    # the last step is the first one due at or after the finish time: made at it or later, the one
    # before it not
    times: dict[int, dict[int, float]] = {}
    for lines in read_folder(tmp_path / "metrics").values():
        for where, text in lines:
            rec = parse_line(text, where)
            times.setdefault(rec.rank, {})[rec.step] = rec.time
    assert sorted(times) == [0, 1, 2]
    for steps in times.values():
        assert max(steps) == last and steps[last] >= at
    # the next life restores that step; the finish time is past: it ends there, no step made
    assert _codes(_start(tmp_path, 3, rank, OMNI_INCARNATION="1", **extra)) == [EXIT_DONE] * 3
    assert {(b.incarnation, b.phase, b.step) for b in read_heartbeats(tmp_path / "hb")} == {(1, "done", last)}


@pytest.mark.parametrize(("text", "env"), [("soon", {}), ("1e999", {}), ("12.5", {"OMNI_STEP_DELAY_S": "0"})])
def test_a_finish_time_that_cannot_work_exits_78_with_one_line(tmp_path: Path, rank: list[str], text: str,
                                                               env: dict[str, str]) -> None:
    (tmp_path / "finish").write_text(text)
    extra = {"OMNI_MAX_STEPS": "100000", "OMNI_LIGHT_FINISH_FILE": str(tmp_path / "finish"), **env}
    proc = subprocess.run(rank, env=_env(tmp_path, 0, 1, 1, **extra), capture_output=True, text=True, timeout=30,
                          check=False)
    assert proc.returncode == EXIT_BAD_INPUT
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("light rank: couldn't"), proc.stderr
    assert ("OMNI_STEP_DELAY_S=0" if env else f"couldn't read a finish time in {tmp_path / 'finish'}: ") in proc.stderr
