"""Event files: strict formats, bounded reads, rejection into rejected/, the SPANK record as C writes it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_omni.manager import events
from slurm_omni.manager.events import EventRejected
from slurm_omni.ownership import NotOwnedError, check_own_dir, ensure_own_dir
from slurm_omni.policy.confirm import TaskExit
from slurm_omni.slurm.types import NodeState

FAULT = {"version": 1, "kind": "task_exit", "job_id": 43, "het_job_id": 42, "het_offset": 1, "step_id": 0,
         "node": "n3", "stage": "text", "stage_rank": 2, "task_id": 5, "local_task_id": 1, "pid": 77, "exit_code": None,
         "signal": 9, "core_dumped": False, "time": "2026-11-30T00:00:00.120Z", "time_unix": 1764460800.12}
BEAT = {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42", "step": 17,
        "phase": "training", "time": 1764460000.12, "step_time_s": 0.031, "last_checkpoint_step": 10, "beats": 9}


def dumps(obj: object) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize("text,kind,nodes", [
    ('{"version": 1, "kind": "down", "nodes": "n[1-2]", "time": 5}', "down", ("n1", "n2")),
    ('{"version": 1, "kind": "drained", "nodes": "a7,b[01-02]", "time": 5.5}', "drained", ("a7", "b01", "b02")),
    ('{"time": 1, "nodes": "x", "kind": "up", "version": 1}', "up", ("x",)),
])
def test_node_event_parses(text: str, kind: str, nodes: tuple[str, ...]) -> None:
    ev = events.parse_node_event(text.encode())
    assert (ev.kind, ev.node_names) == (kind, nodes)
    obs = ev.observations()
    assert [o.node for o in obs] == list(nodes)
    assert obs[0].state is {"down": NodeState.DOWN, "drained": NodeState.DRAINED, "up": NodeState.IDLE}[kind]


@pytest.mark.parametrize("text,match", [
    ('{"version": 2, "kind": "down", "nodes": "n1", "time": 5}', "version"),
    ('{"version": 1, "kind": "reboot", "nodes": "n1", "time": 5}', "kind"),
    ('{"version": 1, "kind": "down", "nodes": "", "time": 5}', "nodes"),
    ('{"version": 1, "kind": "down", "nodes": "n[1-", "time": 5}', "hostlist"),
    ('{"version": 1, "kind": "down", "nodes": "n1", "time": NaN}', "malformed"),
    ('{"version": 1, "kind": "down", "nodes": "n1", "time": -1}', "time"),
    ('{"version": 1, "kind": "down", "nodes": "n1", "time": true}', "time"),
    ('{"version": 1, "kind": "down", "nodes": "n1"}', "missing required field `time`"),
    ('{"version": 1, "kind": "down", "nodes": "n1", "time": 5, "cmd": "rm"}', "unknown field `cmd`"),
    ('{"version": 1, "kind": "down", "kind": "up", "nodes": "n1", "time": 5}', "duplicate"),
    ('["down", "n1"]', "object"),
    ('{"version": 1, "kind": "down", "nodes": "n1", ', "parse"),
    ("\xff\xfe", "parse"),
])
def test_node_event_rejected(text: str, match: str) -> None:
    with pytest.raises(EventRejected, match=match):
        events.parse_node_event(text.encode("latin-1"))


def test_fault_record_parses_to_task_exit() -> None:
    rec = events.parse_fault_record(dumps(FAULT))
    assert rec.het_offset == 1 and rec.signal == 9 and rec.time == pytest.approx(1764460800.12)
    assert rec.observation() == TaskExit(rec.time, "n3", 1, 5, None, 9)
    plain = events.parse_fault_record(dumps({**FAULT, "het_job_id": -1, "het_offset": -1, "signal": None,
                                             "exit_code": 1}))
    assert plain.het_job_id is None and plain.het_offset is None and plain.observation().faulty
    assert plain.observation().het_offset is None


@pytest.mark.parametrize("change,match", [
    ({"signal": None}, "exactly one"), ({"exit_code": 1}, "exactly one"), ({"signal": 300}, "signal"),
    ({"job_id": "43"}, "job_id"), ({"node": ""}, "node"), ({"node": "n\n1"}, "node"),
    ({"core_dumped": 0}, "core_dumped"), ({"kind": "node"}, "kind"), ({"extra": 1}, "unknown"),
    ({"task_id": -1}, "task_id"),
])
def test_fault_record_rejected(change: dict[str, object], match: str) -> None:
    with pytest.raises(EventRejected, match=match):
        events.parse_fault_record(dumps({**FAULT, **change}))


def test_heartbeat_parses_with_and_without_node() -> None:
    hb = events.parse_heartbeat(dumps(BEAT))
    assert hb.observation().het_offset == 1 and hb.observation().global_step == 17 and hb.node == ""
    assert hb.observation(het_job=False).het_offset is None
    assert events.parse_heartbeat(dumps({**BEAT, "node": "n4", "step_time_s": None})).observation().node == "n4"


def test_heartbeat_own_times_are_optional() -> None:
    assert events.parse_heartbeat(dumps(BEAT)).compute_s is None
    hb = events.parse_heartbeat(dumps({**BEAT, "compute_s": 0.02, "data_s": 0, "node": "n4"}))
    assert (hb.compute_s, hb.data_s) == (0.02, 0)
    assert events.parse_heartbeat(dumps({**BEAT, "compute_s": None, "data_s": None})).data_s is None


@pytest.mark.parametrize("change,match", [({"phase": "dreaming"}, "phase"), ({"step": -2}, "step"),
                                          ({"step_time_s": False}, "step_time_s"), ({"rank": "3"}, "rank"),
                                          ({"node": "n\n4"}, "node"), ({"time": -5}, "time"),
                                          ({"compute_s": -0.1}, "compute_s"), ({"data_s": "1"}, "data_s"),
                                          ({"metrics": {"loss": "x"}}, "metrics"),
                                          ({"metrics": {f"m{i}": i for i in range(17)}}, "metrics"),
                                          ({"error": "e" * 401}, "error")])
def test_heartbeat_rejected(change: dict[str, object], match: str) -> None:
    with pytest.raises(EventRejected, match=match):
        events.parse_heartbeat(dumps({**BEAT, **change}))


def test_heartbeat_keys_of_a_newer_runtime_are_ignored() -> None:
    hb = events.parse_heartbeat(dumps({**BEAT, "gpu_util": 0.9, "compute_s": 0.02}))
    assert hb.step == 17 and hb.compute_s == pytest.approx(0.02)


def test_runtime_heartbeat_file_parses(tmp_path: Path) -> None:
    from slurm_omni.elastic.heartbeat import Heartbeat
    from slurm_omni.elastic.layout import Layout
    env = {"RANK": "1", "WORLD_SIZE": "2", "OMNI_HEARTBEAT_DIR": str(tmp_path), "SLURM_JOB_ID": "42",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "OMNI_CKPT_DIR": str(tmp_path / "ckpt"),
           "OMNI_METRICS_DIR": str(tmp_path / "metrics"), "OMNI_HEARTBEAT_INTERVAL": "0.05",
           "OMNI_DP_SIZE": "1", "OMNI_STAGES": "vision,text"}
    layout = Layout.from_env(env=env)
    hb = Heartbeat(layout.heartbeat_dir, rank=layout.rank, stage=layout.stage, dp_rank=layout.data_parallel_rank,
                   incarnation=layout.incarnation, job_id=layout.job_id, interval_s=layout.heartbeat_interval_s,
                   node="node3", node_dir=tmp_path / "shm")   # per node (the default), on the test's own folder
    hb.update(step=3, step_time_s=0.2, phase="training", compute_s=0.15, data_s=0.01)
    hb.stop("done")
    recs = events.read_heartbeats(tmp_path)
    assert len(recs) == 1 and recs[0].step == 3 and recs[0].phase == "done" and recs[0].stage == 1
    assert (recs[0].node, recs[0].compute_s, recs[0].data_s) == ("node3", 0.15, 0.01)


def private(tmp_path: Path) -> Path:
    return ensure_own_dir(tmp_path / "spool", private=True)


def test_scan_spool_accepts_rejects_and_orders(tmp_path: Path) -> None:
    spool = private(tmp_path)
    events.write_event_file(spool, "node-down-2.json", events.format_node_event("down", "n[1-2]", 20.0))
    events.write_event_file(spool, "fault-43.0-n3-5-1.json", dumps(FAULT))
    (spool / "node-bad.json").write_text("{not json")
    (spool / "fault-big.json").write_bytes(b" " * (events.MAX_FAULT_BYTES + 1))
    (spool / "notes.txt").write_text("hello")
    (spool / ".node-x.json.tmp").write_text("half")          # being written: left alone
    os.symlink("/etc/passwd", spool / "node-link.json")
    os.mkfifo(spool / "fault-fifo.json")
    found = events.scan_spool(spool)
    assert [p.name for p, _ in found] == ["node-down-2.json", "fault-43.0-n3-5-1.json"]   # by event time
    assert sorted(p.name for p in (spool / "rejected").iterdir()) == [
        "fault-big.json", "fault-fifo.json", "node-bad.json", "node-link.json", "notes.txt"]
    assert (spool / ".node-x.json.tmp").exists()
    for path, _ in found:
        events.consume(path)
    assert events.scan_spool(spool) == []


def test_heartbeat_dir_scan(tmp_path: Path) -> None:
    (tmp_path / "rank-0.json").write_bytes(dumps({**BEAT, "rank": 0}))
    (tmp_path / "rank-1.json").write_text('{"rank": 1}')
    (tmp_path / "other.json").write_text("x")
    recs = events.read_heartbeats(tmp_path)
    assert [r.rank for r in recs] == [0]
    assert (tmp_path / "rejected" / "rank-1.json").exists() and (tmp_path / "other.json").exists()
    assert events.read_heartbeats(tmp_path / "missing") == []


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_spool_must_be_private(tmp_path: Path, mode: int) -> None:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    spool.chmod(mode)
    with pytest.raises(NotOwnedError, match=r"with mode 0\d\d\d \(expected a directory of uid \d+ that only it can use; chmod 700 it\)"):
        check_own_dir(spool, "events: spool", private=True)


def test_trigger_program_writes_a_valid_event(tmp_path: Path) -> None:
    spool = private(tmp_path)
    assert events.trigger_main([str(spool), "fail", "n[3-4]"]) == 0
    assert events.trigger_main([str(spool), "explode", "n1"]) == 2
    assert events.trigger_main([str(spool), "down", "n[1-"]) == 1
    (path, ev), = events.scan_spool(spool / events.NODES_SUBDIR, shared=True)
    assert path.name.startswith("node-fail-") and ev.node_names == ("n3", "n4")
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)      # every user's manager reads node events
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o755)


HARNESS = r"""
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "fault.h"
int main(int argc, char **argv) {
    struct omni_fault f; char path[4096]; char err[256];
    struct omni_owner owner = {getuid(), getgid(), argv[2]};
    memset(&f, 0, sizeof(f));
    f.job_id = 43; f.het_job_id = 42; f.het_offset = 1; f.step_id = 0;
    strcpy(f.node, "n3"); strcpy(f.stage, "te\"xt"); f.stage_rank = 2; f.task_id = 5; f.local_task_id = 1; f.pid = 77;
    f.status = 9;  /* killed by SIGKILL */
    f.time.tv_sec = 1764460800; f.time.tv_nsec = 120000000;
    if (omni_fault_write(argv[1], &owner, &f, path, sizeof(path), err, sizeof(err)) < 0) { puts(err); return 1; }
    f.status = 3 << 8;  /* exit code 3 */ f.het_job_id = -1; f.het_offset = -1; f.task_id = 6;
    if (omni_fault_write(argv[1], &owner, &f, path, sizeof(path), err, sizeof(err)) < 0) { puts(err); return 1; }
    return argc > 3;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
def test_spank_fault_record_as_written_by_c(tmp_path: Path) -> None:
    spank = Path(__file__).resolve().parents[2] / "spank"
    if not (spank / "fault.c").exists():
        pytest.skip("spank/fault.c not present")
    (tmp_path / "h.c").write_text(HARNESS)
    exe = tmp_path / "h"
    subprocess.run(["gcc", "-std=gnu11", f"-I{spank}", "-o", str(exe), str(tmp_path / "h.c"),
                    str(spank / "fault.c"), str(spank / "args.c")],   # fault.c's omni_set_err is in args.c
                   check=True, capture_output=True, timeout=60)
    root = tmp_path / "spool"
    root.mkdir(mode=0o755)
    subprocess.run([str(exe), str(root), "me"], check=True, timeout=10)
    spool = root / "me"                                   # the plugin made the user's folder, 0700
    assert oct(spool.stat().st_mode & 0o777) == oct(0o700) and spool.stat().st_uid == os.getuid()
    found = [ev for _, ev in events.scan_spool(spool)]
    assert not (spool / "rejected").exists()
    assert len(found) == 2
    by_task = {ev.task_id: ev for ev in found if isinstance(ev, events.FaultRecord)}
    assert by_task[5].signal == 9 and by_task[5].exit_code is None and by_task[5].het_offset == 1
    assert by_task[5].stage == 'te"xt' and by_task[5].time == pytest.approx(1764460800.12)
    assert by_task[5].stage_rank == 2
    assert by_task[6].exit_code == 3 and by_task[6].signal is None and by_task[6].het_offset is None


def test_read_spool_takes_the_users_records_and_everyones_node_events(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from slurm_omni.manager.sources import read_spool
    root = tmp_path / "spool"
    root.mkdir(mode=0o755)
    assert read_spool(root, "me") == []                         # no record yet: the plugin makes <spool>/me
    assert events.trigger_main([str(root), "down", "n3"]) == 0
    own = ensure_own_dir(root / "me", private=True)
    (own / "fault-43.0-n3-5-1.json").write_bytes(dumps(FAULT))
    items = read_spool(root, "me")
    assert [(i.shared, type(i.event).__name__) for i in items] == [(False, "FaultRecord"), (True, "NodeEvent")]
    (root / "nodes" / "node-down-1-1.json").write_text("{")    # not ours to move: skipped, kept
    (root / "nodes").chmod(0o775)                               # others could inject node failures
    assert [i.shared for i in read_spool(root, "me")] == [False]
    assert "couldn't use node events in" in caplog.text and "mode 0775" in caplog.text
    (root / "nodes").chmod(0o755)
    assert [i.shared for i in read_spool(root, "me")] == [False, True]
    assert (root / "nodes" / "node-down-1-1.json").exists() and "skipped" in caplog.text
