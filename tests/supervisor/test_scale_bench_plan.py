"""bench/scale_bench.py's pure parts: how a job ends (bench/scale_end.py: the step budget, the finish
time, what a wait that gave up says, the finish check), the slopes, an earlier run's figures read back
for --include, and what the run left behind (the bench itself needs a cluster: docs/in-allocation.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.metrics_tail import MetricsTail
from bench.scale_bench import (
    CONTROL_SHARES,
    FAULTS,
    Result,
    Run,
    after_applied,
    beat_folders_of,
    decide_delta,
    kill_leftovers,
    leftover,
    load_results,
    log_slope,
    realtime,
    remove_beat_folders,
    run_value,
    stuck_steps,
    teardown_s,
    v2_weight,
    verdicts,
    whole_run,
    write_json,
)
from bench.scale_end import (
    JOB_TIME_S,
    beats_said,
    finish_check,
    finish_time,
    launch_ranks,
    ranks_said,
    step_budget,
    unplanned,
    wait_ended,
)
from slurm_omni.formats.heartbeat import HeartbeatRecord


def _args(**kw: object) -> argparse.Namespace:
    base = {"cpu_window": 5.0, "ckpt_every": 3, "faults": list(FAULTS), "step_delay": 0.5}
    return argparse.Namespace(**{**base, **kw})


def _hb(rank: int, step: int, phase: str = "training", ckpt: int | None = None, code: int | None = None) -> HeartbeatRecord:
    return HeartbeatRecord(rank=rank, stage=0, dp_rank=rank, pid=100 + rank, incarnation=1, job_id="7", step=step,
                           phase=phase, time=1.0, last_checkpoint_step=ckpt, exit_code=code)


def test_the_budget_outlasts_the_jobs_time_limit_and_the_finish_time_is_steps_ahead() -> None:
    # paced 0.5 s: the 1 h limit holds 7,200 steps; the ranks never step faster, so never reach it
    assert step_budget(0.5) == 7201 and step_budget(0.5) * 0.5 > JOB_TIME_S
    with pytest.raises(ValueError, match="pace 0"):
        step_budget(0.0)
    # at least 2 s and 3 paced steps after its write: a rank reads it after every step, one is enough
    assert finish_time(100.0, 0.5) == 102.0 and finish_time(100.0, 1.0) == 103.0


def test_a_wait_that_gave_up_says_what_ended_it_and_what_the_ranks_said() -> None:
    """23:55, 512 nodes: "did not all checkpoint step 15 within 600s" when the job had ended after
    60 s; now the job's end, the wait's own timeout, and the ranks' steps, apart."""
    assert wait_ended("COMPLETED", 60.4, 600) == "the job ended (COMPLETED) after 60 s of the wait's 600 s"
    assert wait_ended("", 600.2, 600) == "timed out after 600 s"
    beats = [_hb(0, 40, ckpt=39), _hb(1, 41, ckpt=12)]
    assert beats_said(beats, 4, 1, 7201) == "2/4 ranks beat in launch 1: steps 40-41, the least checkpoint step 12"
    done = [_hb(0, 56, "done", 56, 0), _hb(1, 56, "done", 56, 0)]
    said = ("2/2 ranks beat in launch 2: steps 56-56, the least checkpoint step 56, phases done; steps exhausted: "
            "ranks ended at their budget of 56")
    assert beats_said(done, 2, 2, 56) == said
    assert beats_said([], 2, 0, 56) == "no rank beat in launch 0"


def test_the_run_finished_only_with_every_rank_done_at_one_saved_step_below_the_budget() -> None:
    done = [_hb(r, 58, "done", 58, 0) for r in range(3)]
    assert finish_check(done, 3, 7201) == (True, "3/3 ranks done at step 58")
    # one rank passed the finish time's step before it read it: not one step
    apart = [*done[:2], _hb(2, 59, "done", 59, 0)]
    assert finish_check(apart, 3, 7201) == (False, "3/3 ranks done at steps 58-59 (2 different)")
    # the budget ended the run, not the bench
    assert finish_check(done, 3, 58) == (False, "3/3 ranks done at step 58 (steps exhausted: the budget is 58)")
    assert finish_check([*done[:2], _hb(2, 58, "failed", 57, 1)], 3, 7201) == (False, "2/3 ranks done at step 58")
    unsaved = finish_check([_hb(0, 58, "done", 57, 0)], 1, 7201)
    assert unsaved == (False, "1/1 ranks done at step 58 (not every one saved its last step)")
    assert finish_check([], 3, 7201) == (False, "0/3 ranks done")


def test_a_relaunch_the_bench_did_not_cause_is_named() -> None:
    """23:55, 512 nodes in-allocation: launch 1 confirmed a hang nobody injected (level 2 alone for
    12.8 s at load 1,000) and launch 2 followed; the bench waited on launch 1's beats till the end."""
    assert unplanned(4, [0, 1, 2]) == []
    assert unplanned(4, [0, 2]) == [2]
    assert unplanned(1, []) == []


def test_the_whole_run_against_the_15_minute_bar() -> None:
    def size(n: int, na: str = "") -> Result:
        return Result(nodes=n, ranks=4 * (n - 1), runs=[Run(p, f, na=na) for p in ("inalloc", "alloc") for f in FAULTS])

    every = [size(8), size(64), size(256), size(512)]
    assert whole_run(601.0, every).endswith(": PASS")
    assert whole_run(1200.0, every) == ("the whole run: 1200 s (20.0 min) against the bar of 15 min: MISS (x1.33)")
    # never PASS for what was not measured: 512's hang not injected
    part = [size(8), size(64), size(256), Result(nodes=512, ranks=2044, runs=[
        *(Run(p, f) for p in ("inalloc", "alloc") for f in ("node", "crash")), Run("inalloc", "hang", na="x")])]
    assert whole_run(601.0, part).endswith("not shown (not measured whole here: 512 nodes)")
    assert "MISS (x1.11; not measured whole here: 256, 512 nodes)" in whole_run(1000.0, every[:2])


def test_the_metrics_tail_reads_each_line_once_and_keeps_each_ranks_first(tmp_path: Path) -> None:
    def line(rank: int, inc: int, step: int, t: float, **kw: object) -> str:
        return json.dumps({"time": t, "rank": rank, "incarnation": inc, "step": step, **kw}) + "\n"

    node = tmp_path / "node-node1.jsonl"
    own = tmp_path / "metrics-main-1.jsonl"
    node.write_text(line(0, 1, 13, 10.0, restored_step=12) + line(1, 1, 13, 10.1, restored_step=12))
    tail = MetricsTail(tmp_path)
    first = tail.first_lines(1)
    assert sorted(first) == [0, 1] and first[0]["restored_step"] == 12
    # a torn tail is left until its line is whole; the rank's own file repeats a line: counted once
    with node.open("a") as f:
        f.write(line(0, 1, 14, 10.5) + '{"time": 11.0, "ra')
    own.write_text(line(1, 1, 13, 10.1, restored_step=12) + line(1, 1, 15, 11.2))
    tail.update()
    assert tail.last_step[1] == 15 and tail.torn == 0 and tail.first[1][1]["restored_step"] == 12
    with node.open("a") as f:
        f.write('nk": 0}\n' + line(2, 2, 16, 12.0))
    assert sorted(tail.first_lines(2)) == [2] and tail.torn == 1
    # a replaced file is read from its start
    own.unlink()
    own.write_text(line(3, 2, 17, 13.0))
    assert sorted(tail.first_lines(2)) == [2, 3]


def test_slopes_and_the_phase_sums() -> None:
    assert log_slope((64, 1.0), (512, 8.0)) == pytest.approx(1.0)
    assert log_slope((64, 2.0), (512, 2.0)) == pytest.approx(0.0)
    assert log_slope((64, None), (512, 2.0)) is None and log_slope((64, 0.0), (512, 2.0)) is None
    r = Result(nodes=64, ranks=252, runs=[Run("inalloc", "node", phases={
        "detect": 0.1, "confirm": 1.0, "decide": 0.5, "launch": 4.0, "rendezvous": 0.2, "first_step": 0.5})])
    assert run_value(r, "inalloc", "node", "detect+confirm") == pytest.approx(1.1)
    assert run_value(r, "inalloc", "node", "start") == pytest.approx(4.7)
    assert run_value(r, "alloc", "node", "launch") is None


def test_an_earlier_run_reads_back_with_its_source(tmp_path: Path) -> None:
    r = Result(nodes=8, ranks=28, step_s=0.5, cpu_per_poll={"inalloc": 0.004}, checks=["PASS x"],
               memory={"rank_mib": 4.0}, scan=(0.001, 0.002),
               runs=[Run("inalloc", "crash", load=3.0, phases={"detect": 0.2}, total=2.0), Run("alloc", "hang", na="timeout")])
    out = tmp_path / "results.json"
    write_json([r], out, _args())
    doc = json.loads(out.read_text())
    assert doc["sizes"][0]["runs"][1]["na"] == "timeout" and "measured" in doc
    back = load_results(out)
    assert len(back) == 1 and back[0].runs == r.runs and back[0].step_s == 0.5 and back[0].scan == (0.001, 0.002)
    assert back[0].checks[0] == "PASS x" and back[0].checks[-1].startswith(f"(from {out}:")


def test_the_slurmstepd_of_the_runs_own_jobs_left_after_the_cluster_went_down_are_killed() -> None:
    """One of an earlier size's steps spoke to the next cluster's node of the same name (issue 19,
    512 nodes): the bench kills its own jobs' slurmstepd, no other's: not another job's of its own
    cluster, and not the same job id's of another cluster on the host (each holds a socket bound in its
    own cluster's spool, as slurmstepd does)."""
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="sb-", dir="/tmp"))   # a Unix socket's path holds 107 bytes
    state, other_state = tmp_path / "cluster", tmp_path / "other-cluster"
    hold = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
            "open(sys.argv[1] + '.up', 'w').close(); time.sleep(60)")

    def stepd(job: str, spool: Path) -> subprocess.Popen[bytes]:
        spool.mkdir(parents=True, exist_ok=True)
        sock = spool / f"node1_{job}.0"
        p = subprocess.Popen(["bash", "-c", f'exec -a "slurmstepd: [{job}.0]" "$0" -c "$1" "$2"', sys.executable, hold,
                              str(sock)])
        for _ in range(500):   # until it has exec'd under the new name and bound its socket
            if Path(f"{sock}.up").exists() and Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"slurmstepd"):
                break
            subprocess.run(["sleep", "0.02"], check=True)
        return p

    ours = stepd("987654", state / "nodes" / "node1" / "spool")
    other_job = stepd("987655", state / "nodes" / "node1" / "spool")
    other_cluster = stepd("987654", other_state / "nodes" / "node1" / "spool")
    try:
        assert list(kill_leftovers({"987654", "12"}, state, tmp_path / "work")) == [ours.pid]
        assert ours.wait(timeout=10) == -9
        assert other_job.poll() is None and other_cluster.poll() is None
    finally:
        for p in (ours, other_job, other_cluster):
            p.kill()
            p.wait()
        shutil.rmtree(tmp_path)


def test_a_leftover_step_is_ours_only_by_a_socket_bound_under_this_clusters_state_dir() -> None:
    """Job ids name no cluster (each embedded cluster on the host counts its own): the killer takes a
    slurmstepd only when it holds a socket bound under this cluster's state folder. Read from the real
    /proc/net/unix of this process's own sockets, one bound in each of two clusters' spools."""
    import shutil
    import socket
    import tempfile

    from bench.scale_bench import holds_socket, socket_inodes_under

    tmp_path = Path(tempfile.mkdtemp(prefix="sb-", dir="/tmp"))   # a Unix socket's path holds 107 bytes
    ours, theirs = tmp_path / "ours" / "nodes" / "node1" / "spool", tmp_path / "theirs" / "nodes" / "node1" / "spool"
    ours.mkdir(parents=True)
    theirs.mkdir(parents=True)
    a, b = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    try:
        a.bind(str(ours / "node1_4003.0"))
        b.bind(str(theirs / "node1_4003.0"))
        (ours / "node1_4003.0").unlink()  # the name stays in the kernel's table after the file goes
        table = Path("/proc/net/unix").read_text()
        mine = socket_inodes_under(table, tmp_path / "ours")
        assert mine == {os.fstat(a.fileno()).st_ino}
        assert socket_inodes_under(table, tmp_path / "ou") == set()  # a prefix of a name is not its folder
        assert holds_socket(os.getpid(), mine)
        assert not holds_socket(os.getpid(), socket_inodes_under(table, tmp_path / "elsewhere"))
    finally:
        a.close()
        b.close()
        shutil.rmtree(tmp_path)


def test_the_next_launch_waits_for_the_old_ranks_only_when_two_launches_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """512 nodes with the Python rank (14:26): the new ranks started beside 2,044 SIGKILLed ones and the
    host ran out of memory; the bench then asks the supervisor to wait for the killed step's srun."""
    import bench.scale_bench as sb

    measured = [Result(nodes=256, ranks=1020, memory={"rank_mib": 5.5, "slurmstepd_mib": 1.0, "slurmd_mib": 2.0})]
    monkeypatch.setattr(sb, "mem_available_mib", lambda: 20 * 1024.0)
    why = sb.two_launches_fit(512, measured, 2 * 1024)
    assert why.startswith("two launches need about 23.0 GiB (2 x (512 slurmstepd x 1.0 + 2044 ranks x 5.5 MiB))")
    assert sb.two_launches_fit(512, [Result(nodes=256, ranks=1020, memory={"rank_mib": 0.3, "slurmstepd_mib": 1.0})],
                               2 * 1024) == ""
    assert sb.two_launches_fit(512, [], 2 * 1024) == ""   # nothing measured yet: nothing to say
    # whatever the memory: from 512 nodes a relaunch waits for the killed step (one host's cores, one munged)
    assert sb.one_host_relaunch(256) == ""
    assert sb.one_host_relaunch(512).startswith("512 nodes on one host: a relaunch beside a killed step of 2044 ranks")


def test_what_the_run_left_goes_by_its_environment_and_nothing_else_does(tmp_path: Path) -> None:
    """An interrupted bench left the in-allocation supervisor and its srun and squeue running (each
    reparented to init once its slurmstepd went): a process whose OMNI_ variables point into this
    run's folder is the run's; one of another run's folder, or a slurmstepd of another cluster, not."""
    root = b"/dev/shm/scale/20261203-0503/"
    never = lambda: pytest.fail("a process that is no slurmstepd needs no socket")
    env = [b"PATH=/usr/bin", b"OMNI_CKPT_DIR=/dev/shm/scale/20261203-0503/n512-inalloc/ckpt"]
    assert leftover(["python", "-m", "slurm_omni.cli.main", "supervise"], env, {"14007"}, root, never)
    assert leftover(["srun", "--overlap"], env, set(), root, never)
    other = [b"OMNI_CKPT_DIR=/dev/shm/scale/20261203-0400/n8-inalloc/ckpt", b"SLURM_JOB_ID=14007"]
    assert not leftover(["squeue"], other, {"14007"}, root, never)
    assert not leftover(["bash"], [b"HOME=/dev/shm/scale/20261203-0503/"], {"14007"}, root, never)
    assert leftover(["slurmstepd: [14007.batch]"], [], {"14007"}, root, lambda: True)
    assert not leftover(["slurmstepd: [14007.0]"], [], {"14007"}, root, lambda: False)
    assert not leftover(["slurmstepd: [14008.0]"], [], {"14007"}, root, lambda: True)
    # a real one: killed; the same program pointing elsewhere, and this process, spared
    run_root = tmp_path / "20261203-0503"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleeper, env={**os.environ, "OMNI_CKPT_DIR": str(run_root / "n8-alloc" / "ckpt")})
    theirs = subprocess.Popen(sleeper, env={**os.environ, "OMNI_CKPT_DIR": str(tmp_path / "other" / "ckpt")})
    try:
        for _ in range(200):   # until each has exec'd with its environment
            if all(b"OMNI_CKPT_DIR" in Path(f"/proc/{p.pid}/environ").read_bytes() for p in (ours, theirs)):
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert kill_leftovers(set(), tmp_path / "cluster", run_root) == {ours.pid: Path(sys.executable).name}
        assert ours.wait(timeout=10) == -9 and theirs.poll() is None
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()


def test_the_pid_space_is_widened_for_a_size_above_64_nodes_only(tmp_path: Path) -> None:
    """proctrack/pgid and 32,768 pids: a 512-node relaunch's task took an old group's id and the old
    step's slurmstepd SIGKILLed it (07:37); the bench raises kernel.pid_max for the large sizes."""
    from bench.scale_bench import PID_MAX_WANTED, widen_pid_space

    pid_max = tmp_path / "pid_max"
    pid_max.write_text("32768\n")
    assert widen_pid_space([8, 64], pid_max) == "" and pid_max.read_text() == "32768\n"
    assert widen_pid_space([8, 512], pid_max) == f"kernel.pid_max 32768 -> {PID_MAX_WANTED} (Debian 12's default)"
    assert int(pid_max.read_text()) == PID_MAX_WANTED
    assert widen_pid_space([512], pid_max) == f"kernel.pid_max={PID_MAX_WANTED}"
    assert "unread" in widen_pid_space([512], tmp_path / "missing")


def test_a_launch_counts_the_ranks_of_the_nodes_the_supervisor_journaled_for_it() -> None:
    first = [[f"node{i}" for i in range(1, 512)]]
    shrunk = [[f"node{i}" for i in range(1, 512) if i % 11]]   # 465 of 511 nodes left
    assert launch_ranks(first, 4) == 2044
    assert launch_ranks(shrunk, 4) == 4 * 465
    assert launch_ranks([["a", "b"], ["c"]], 2) == 6   # every component's nodes
    assert ranks_said(2044, 2044) == "2044"
    assert ranks_said(1860, 2044) == "1860 (shrunk from 2044)"
    with pytest.raises(ValueError, match="0 tasks per node"):
        launch_ranks(first, 0)


def test_a_shrunk_launch_is_checked_against_its_own_ranks_not_the_jobs() -> None:
    # 1,852 ranks of a launch shrunk from 2,044, every one done at one saved step: finished
    beats = [_hb(r, 30, "done", ckpt=30, code=0) for r in range(1852)]
    ranks = launch_ranks([[f"node{i}" for i in range(463)]], 4)
    assert finish_check(beats, ranks, 7201) == (True, "1852/1852 ranks done at step 30")
    ok, said = finish_check(beats, 2044, 7201)   # the job's first count would call it unfinished
    assert not ok and said.startswith("1852/2044")


def test_the_node_heartbeat_folders_of_the_runs_own_jobs_go_and_no_other(tmp_path: Path) -> None:
    names = ["omni-beats-0-16001-node1", "omni-beats-0-16001-node512", "omni-beats-0-160011-node1",
             "omni-beats-0-42-node3", "omni-beats-1000-16001-node1", "other"]
    assert beat_folders_of({"16001"}, 0, names) == ["omni-beats-0-16001-node1", "omni-beats-0-16001-node512"]
    assert beat_folders_of(set(), 0, names) == []
    uid = os.geteuid()
    (tmp_path / f"omni-beats-{uid}-7-node1").mkdir()
    (tmp_path / f"omni-beats-{uid}-7-node1" / "node-node1.jsonl").write_text("{}\n")
    (tmp_path / "target").mkdir()
    (tmp_path / f"omni-beats-{uid}-7-node2").symlink_to(tmp_path / "target")   # a link: left alone
    (tmp_path / f"omni-beats-{uid}-8-node1").mkdir()                           # another job's
    assert remove_beat_folders({"7"}, tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["target", f"omni-beats-{uid}-7-node2", f"omni-beats-{uid}-8-node1"])


def test_the_steps_left_of_a_job_that_is_done_are_its_numbered_steps_on_this_cluster() -> None:
    argvs = {10: ["slurmstepd: [2101.1]"], 11: ["slurmstepd: [2101.batch]"], 12: ["slurmstepd: [2101.extern]"],
             13: ["slurmstepd: [21011.1]"], 14: ["slurmstepd: [2101.3]"], 15: ["python", "slurmstepd: [2101.2]"],
             16: [], 17: ["slurmstepd: [2101.4]"], 18: ["slurmstepd: [2101.1]"]}
    ours = {10, 11, 12, 13, 15, 16, 17, 18}   # 14 holds another cluster's socket (the same job id there)
    # one step's slurmstepd on two nodes: both (a step's end waits for every node's)
    assert stuck_steps(argvs, "2101", lambda pid: pid in ours) == {10: "2101.1", 17: "2101.4", 18: "2101.1"}
    assert stuck_steps(argvs, "9", lambda pid: True) == {}


# the 11:35 lane's 512-node in-allocation supervisor (batch.out), its lines around launch 0's decide
_DECIDE_LOG = """\
2026-12-03 11:41:54,874 slurm_omni.supervisor.run DEBUG supervisor: launch 0: deciding (process CPU 1.023 s)
2026-12-03 11:42:31,231 slurm_omni.supervisor.run DEBUG supervisor: launch 0: its srun ended 36.358 s after the kill
2026-12-03 11:42:31,233 slurm_omni.supervisor.run DEBUG supervisor: launch 0: deciding (process CPU 1.298 s)
2026-12-03 11:42:31,241 slurm_omni.supervisor.run DEBUG supervisor: launch 1 journaled (process CPU 1.305 s)
2026-12-03 11:43:12,700 slurm_omni.supervisor.run DEBUG supervisor: launch 1: its srun ended 21.480 s after the kill
"""


def test_the_killed_steps_teardown_is_read_per_launch() -> None:
    assert teardown_s(_DECIDE_LOG, 0) == pytest.approx(36.358)
    assert teardown_s(_DECIDE_LOG, 1) == pytest.approx(21.480)
    assert teardown_s(_DECIDE_LOG, 2) is None


_WAIT_LOG = """\
2026-12-03 14:27:36,446 slurm_omni.supervisor.run DEBUG supervisor: launch 0: deciding (process CPU 1.012 s, waited for a core 0.410 s)
2026-12-03 14:28:02,100 slurm_omni.supervisor.run DEBUG supervisor: launch 0: deciding (process CPU 1.300 s, waited for a core 0.502 s)
2026-12-03 14:28:02,131 slurm_omni.supervisor.run DEBUG supervisor: launch 1 journaled (process CPU 1.310 s, waited for a core 0.530 s)
2026-12-03 14:28:40,000 slurm_omni.supervisor.run DEBUG supervisor: launch 1: deciding (process CPU 2.000 s, waited for a core 0.900 s)
2026-12-03 14:28:41,000 slurm_omni.supervisor.run DEBUG supervisor: launch 2 journaled (process CPU 2.010 s, waited for a core 0.700 s)
"""


def test_decides_cpu_and_wait_for_a_core_are_read_from_the_first_deciding_line_to_the_next_launch() -> None:
    assert decide_delta(_WAIT_LOG, 0, 2) == pytest.approx(0.298)
    assert decide_delta(_WAIT_LOG, 0, 3) == pytest.approx(0.028)   # from the line after the teardown
    assert decide_delta(_WAIT_LOG, 1, 3) == 0.0   # a thread that ended took its wait along: never below 0
    assert decide_delta(_WAIT_LOG, 2, 3) is None
    # a log of a supervisor before the wait was said: the CPU as before, no wait
    assert decide_delta(_DECIDE_LOG, 0, 2) == pytest.approx(0.282)
    assert decide_delta(_DECIDE_LOG, 0, 3) is None


def test_decide_grown_by_the_wait_for_a_core_names_it_with_the_figure(capsys: pytest.CaptureFixture[str]) -> None:
    def sized(nodes: int, decide: float, wait: float) -> Result:
        return Result(nodes=nodes, ranks=4 * nodes, runs=[
            Run("inalloc", f, phases={"decide": decide}, split={"decide_wait": wait, "decide_cpu": 0.01})
            for f in ("node", "crash")])
    args = argparse.Namespace(paths=["inalloc"], faults=["node", "crash"])
    verdicts(sized(64, 0.011, 0.001), sized(512, 0.110, 0.100), args, 0.0)   # the rest: 10 ms at both sizes
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("decide"))
    assert line.split()[1] == "LIMIT" and "waiting for a core in it 0.00s -> 0.10s" in line
    verdicts(sized(64, 0.011, 0.001), sized(512, 0.500, 0.100), args, 0.0)   # the rest 10 -> 400 ms
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("decide"))
    assert line.split()[1] == "MISS"


def _sized(nodes: int, decide: float, teardown: float) -> Result:
    return Result(nodes=nodes, ranks=4 * nodes, runs=[Run("inalloc", f, phases={"decide": decide},
                                                          split={"teardown": teardown, "decide_cpu": 0.01})
                                                      for f in ("node", "crash")])


def test_decide_grown_by_the_killed_steps_teardown_alone_names_it_as_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(paths=["inalloc"], faults=["node", "crash"])
    verdicts(_sized(64, 1.2, 1.0), _sized(512, 36.4, 36.2), args, 0.0)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("decide"))
    assert line.split()[1] == "LIMIT" and "teardown" in line and "decide without it slope -0.00" in line
    below = Result(nodes=64, ranks=256, runs=[Run("inalloc", f, phases={"decide": 0.2}) for f in ("node", "crash")])
    verdicts(below, _sized(512, 36.4, 36.2), args, 0.0)   # below 512 the next launch does not wait: no teardown
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("decide"))
    assert line.split()[1] == "LIMIT" and "decide without it slope -0.00" in line
    verdicts(_sized(64, 1.2, 1.0), _sized(512, 40.0, 30.0), args, 0.0)   # the rest grows 0.2 -> 10 s
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("decide"))
    assert line.split()[1] == "MISS"


def test_the_node_loss_is_also_counted_from_the_faults_own_command_answered() -> None:
    def sized(nodes: int, confirmed: float, cmd: float) -> Result:
        return Result(nodes=nodes, runs=[Run("alloc", "node", phases={"detect": 0.0, "confirm": confirmed},
                                             fault_cmd_s=cmd)])
    line = after_applied(sized(8, 0.05, 0.01), sized(512, 0.55, 0.50), "alloc")
    assert "+0.01 / +0.50 s" in line and "0.04 -> 0.05 s" in line
    assert after_applied(sized(8, 0.05, 0.01), sized(512, 0.55, 0.50), "inalloc") == ""


def test_the_supervisors_own_decide_line_is_what_the_bench_reads() -> None:
    from bench.scale_bench import _JOURNALED
    from slurm_omni.supervisor.run import _cpu_and_wait

    m = _JOURNALED.search(f"supervisor: launch 3 journaled ({_cpu_and_wait()})")
    assert m is not None and float(m[2]) > 0
    assert m[3] is not None and float(m[3]) >= 0   # this kernel keeps schedstat (/proc/self/task/*/schedstat)


def test_the_control_planes_weight_is_the_most_either_cgroup_version_takes() -> None:
    # v1 takes cpu.shares up to 262,144; v2 refuses a cpu.weight above 10,000, and the group would not be made
    assert CONTROL_SHARES == 262144
    assert v2_weight(CONTROL_SHARES) == 10000
    assert v2_weight(1024) == 100 and v2_weight(256) == 25 and v2_weight(2) == 1


def test_real_time_moves_every_thread_of_a_live_process_or_says_none_moved() -> None:
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        moved = realtime(proc.pid, 1)
        policies = {os.sched_getscheduler(t) for t in tids}
        if moved:   # root, and a cgroup that may run real-time: every thread, not the first alone
            assert moved == len(tids) == 2 and policies == {os.SCHED_RR}
        else:       # refused (not root, or no real-time runtime in this cgroup): nothing changed
            assert policies == {os.SCHED_OTHER}
    finally:
        proc.kill()
        proc.wait()
    assert realtime(proc.pid, 1) == 0   # gone
