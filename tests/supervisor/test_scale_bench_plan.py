"""bench/scale_bench.py's pure parts: the run's steps planned from the measured pace, the slopes, and
an earlier run's figures read back for --include (the bench itself needs a cluster: docs/in-allocation.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.metrics_tail import MetricsTail
from bench.scale_bench import (
    FAULTS,
    Result,
    Run,
    extra_at,
    extra_steps,
    kill_leftover_steps,
    load_results,
    log_slope,
    run_value,
    step_plan,
    whole_run,
    write_json,
)


def _args(**kw: object) -> argparse.Namespace:
    base = {"cpu_window": 5.0, "ckpt_every": 3, "faults": list(FAULTS), "step_delay": 0.5}
    return argparse.Namespace(**{**base, **kw})


def test_steps_are_planned_at_the_pace_the_smaller_sizes_measured() -> None:
    # paced 0.5 s: a 10-step window, then per fault (and the last life) a checkpoint and 2 s of steps
    assert step_plan(_args(), 0.5) == (10 + (3 + 4) * 4, {"node": 4, "crash": 4, "hang": 4})
    # ranks stepping in 2.5 s: 2 window steps and the slack's floor of 3 steps; far fewer steps to finish
    assert step_plan(_args(), 2.5) == (2 + (3 + 3) * 4, {"node": 3, "crash": 3, "hang": 3})


def test_a_fault_keeps_in_hand_the_extra_steps_it_took_at_the_size_before_scaled() -> None:
    # at 64 nodes the node loss took 2 s of steps beyond its checkpoint, the crash 0.5 s, the hang none
    smaller = Result(nodes=64, ranks=252, runs=[Run("alloc", "node", extra_s=2.0), Run("inalloc", "node", extra_s=1.0),
                                               Run("alloc", "crash", extra_s=0.5), Run("alloc", "hang", extra_s=0.0)])
    extra, source = extra_at(256, [smaller])
    assert extra == {"node": 12.0, "crash": 3.0, "hang": 0.0}   # the larger path's, x 256/64, x 1.5
    assert source["node"] == "2.0 s at 64 nodes (alloc), scaled"
    total, slack = step_plan(_args(), 0.5, extra)
    assert slack == {"node": 28, "crash": 10, "hang": 4}          # (2 s + the extra) / 0.5 s
    assert total == 10 + (3 + 28) + (3 + 10) + (3 + 4) + (3 + 4)
    # at most x MAX_SCALE: 64 -> 512 nodes as 64 -> 256 (8 -> 64 nodes scaled noise into 40 s of idle steps)
    assert extra_at(512, [smaller])[0] == extra
    assert extra_at(512, []) == ({}, {})


def test_a_sizes_own_figure_plans_its_next_job_unscaled() -> None:
    """512 nodes (14:05): the plan took 256's "0 steps after the fault" while 512's node loss took
    about 9; the second job of a size plans from the first job's own figure."""
    smaller = Result(nodes=256, ranks=1020, runs=[Run("alloc", "node", extra_s=0.0), Run("alloc", "hang", extra_s=1.0)])
    own = [Run("inalloc", "node", extra_s=6.0), Run("inalloc", "crash", na="timeout")]
    extra, source = extra_at(512, [smaller], own)
    assert extra == {"node": 9.0, "hang": 3.0}   # this size's own x 1.5; the hang from 256 x 2 x 1.5
    assert source["node"] == "6.0 s measured at this size (inalloc)"
    # a larger size's figures never plan a smaller one
    assert extra_at(64, [smaller]) == ({}, {})


def test_the_extra_steps_of_a_fault() -> None:
    # checkpoint 3 after base 12 waited for; the next launch restored 24: 9 steps beyond the least
    assert extra_steps(24, 12, 3) == 9
    # launch 0: its steady-state window's 10 steps come first
    assert extra_steps(15, 0, 3, 10) == 2
    assert extra_steps(12, 12, 3) == 0


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
        assert kill_leftover_steps({"987654", "12"}, state, tmp_path / "work") == [ours.pid]
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
