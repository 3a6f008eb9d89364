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

from bench.scale_bench import (
    FAULTS,
    Result,
    Run,
    kill_leftover_steps,
    load_results,
    log_slope,
    overrun_at,
    run_value,
    step_plan,
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


def test_a_fault_keeps_in_hand_the_steps_ranks_made_after_it_at_the_size_before_scaled() -> None:
    # at 64 nodes the ranks stepped 2 s on after the node loss, 0.5 s after the crash, none after the hang
    smaller = Result(nodes=64, ranks=252, runs=[Run("alloc", "node", overrun_s=2.0), Run("inalloc", "node", overrun_s=1.0),
                                               Run("alloc", "crash", overrun_s=0.5), Run("alloc", "hang", overrun_s=0.0)])
    overrun = overrun_at(512, [smaller])
    assert overrun == {"node": 24.0, "crash": 6.0, "hang": 0.0}   # the larger path's, x 512/64, x 1.5
    total, slack = step_plan(_args(), 0.5, overrun)
    assert slack == {"node": 52, "crash": 16, "hang": 4}          # (2 s + the overrun) / 0.5 s
    assert total == 10 + (3 + 52) + (3 + 16) + (3 + 4) + (3 + 4)
    assert overrun_at(512, []) == {}


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
