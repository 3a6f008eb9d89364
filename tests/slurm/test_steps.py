"""The in-allocation step's srun argv and srun's stderr, parsed (recorded on Slurm 22.05); which srun a restarted
supervisor adopts (our own uid's: the journaled one, or one whose step Slurm lists)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.cli.submit import parse_sbatch_id
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.steps import (
    TASK_SHIM,
    SrunEvent,
    StepComponent,
    StepLog,
    StepProcess,
    find_step_process,
    foreign_step_processes,
    is_running,
    job_step_names,
    parse_srun_line,
    process_start,
    step_argv,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05"


def test_step_argv_is_one_mpmd_srun_with_every_component_killed_on_a_bad_exit() -> None:
    argv = step_argv([StepComponent(0, ("node1", "node2"), 1), StepComponent(1, ("node3",), 2)],
                     ["omni", "train", "--config", "/a b/job's.toml"], name="omni-7-launch-1",
                     spank_stage="vision:2,text:2", spank_ckpt="/ck")
    assert argv[0] == "srun" and argv.count(":") == 1
    first, second = argv[1:argv.index(":")], argv[argv.index(":") + 1:]
    for part, nodes, ntasks, stage, offset in ((first, "node[1-2]", 2, "0", "0"), (second, "node3", 2, "1", "2")):
        assert "--kill-on-bad-exit=1" in part and f"--nodelist={nodes}" in part and f"--ntasks={ntasks}" in part
        assert "--job-name=omni-7-launch-1" in part and "--omni-stage=vision:2,text:2" in part
        shim = part.index(TASK_SHIM)
        assert part[shim - 2:shim] == ["bash", "-c"]
        assert part[shim + 1:shim + 4] == ["omni-task", stage, offset]
        assert part[-1] == "/a b/job's.toml"        # an argv word, never inside a shell string
        assert not [w for w in part if w.startswith("--chdir")]   # srun's own folder unless given


def test_every_component_starts_in_the_jobs_workdir() -> None:
    argv = step_argv([StepComponent(0, ("node1",), 1), StepComponent(1, ("node3",), 1)], ["python3", "train.py"],
                     name="omni-7-launch-0", chdir="/home/u/my job's dir")
    assert [w for w in argv if w.startswith("--chdir")] == ["--chdir=/home/u/my job's dir"] * 2


def test_step_argv_from_outside_the_allocation_names_its_job_in_every_component() -> None:
    """Allocation mode: the supervisor runs outside the allocation, so srun says which one (--jobid)."""
    comps = [StepComponent(0, ("node1",), 1), StepComponent(1, ("node3",), 1)]
    argv = step_argv(comps, ["omni", "train"], name="omni-7-launch-0", job_id="7")
    assert [a for a in argv if a.startswith("--jobid")] == ["--jobid=7", "--jobid=7"]
    assert argv.index("--jobid=7") < argv.index("bash")
    assert not any(a.startswith("--jobid") for a in step_argv(comps, ["omni", "train"], name="omni-7-launch-0"))


def test_srun_stderr_of_a_node_failure() -> None:
    lines = (FIXTURES / "srun_node_failure.txt").read_text().splitlines()
    events = [e for e in (parse_srun_line(line, 1.0) for line in lines) if e is not None]
    assert [(e.kind, e.node) for e in events[:3]] == [("node_failure", "node4"), ("task_exit", "node4"),
                                                       ("terminating", "")]
    assert events[1].task == 1 and events[1].detail == "Killed"
    assert events[2].step_id == "3.0+1"


def test_the_step_log_hands_each_event_to_its_hook_in_its_own_thread(tmp_path: Path) -> None:
    """The supervisor asks Slurm for a node srun reported failed from the follower's thread, the moment
    srun says it (issue 19: at 512 nodes its loop drained the report seconds late); the event is queued
    too, for the loop."""
    path = tmp_path / "srun.log"
    path.write_text("srun: earlier line\n")
    log = StepLog.follow(str(path), start=path.stat().st_size)
    got: list[tuple[SrunEvent, str]] = []
    seen = threading.Event()

    def hook(event: SrunEvent) -> None:
        got.append((event, threading.current_thread().name))
        seen.set()

    log.on_event = hook
    try:
        with path.open("a") as f:
            f.write("[rank 0] step 3\nsrun: error: Node failure on node7\n")
        assert seen.wait(10)
        assert [(e.kind, e.node, name) for e, name in got] == [("node_failure", "node7", "omni-step-log")]
        assert [(e.kind, e.node) for e in log.drain()] == [("node_failure", "node7")]
    finally:
        log.close()


def test_a_closed_step_log_reads_what_srun_wrote_last_before_it_says_it_read_it_all(tmp_path: Path) -> None:
    """At a launch's end the supervisor takes srun's last lines (its tasks' exits) before it decides
    whether a rank may have refused its input: ``close`` waits for the follower to read to the end."""
    path = tmp_path / "srun.log"
    path.write_text("")
    log = StepLog.follow(str(path))
    with path.open("a") as f:
        f.write("".join(f"srun: error: node{k}: tasks {4 * k}-{4 * k + 3}: Killed\n" for k in range(500)))
        f.write("srun: error: node9: task 37: Exited with exit code 78\n")
    assert log.close(wait_s=10)
    events = log.drain()
    assert len(events) == 501 and events[-1].detail == "Exited with exit code 78"
    gone = StepLog.follow(str(tmp_path / "no-such.log"))   # nothing read: never "read it all"
    assert not gone.close(wait_s=10)


@pytest.mark.parametrize(("line", "kind", "detail"), [
    ("srun: error: node2: task 1: Exited with exit code 3", "task_exit", "Exited with exit code 3"),
    ("srun: error: node5: tasks 2-3: Killed", "task_exit", "Killed"),
    ("srun: Terminating StepId=12.1", "terminating", ""),
    ("srun: Force Terminated StepId=3.0+1", None, ""),
    ("[rank 0] step 3", None, ""),
])
def test_srun_lines(line: str, kind: str | None, detail: str) -> None:
    event = parse_srun_line(line, 0.0)
    assert (event.kind if event else None) == kind
    if event is not None and kind == "task_exit":
        assert event.detail == detail


def _proc(root: Path, pid: int, args: list[bytes], *, uid: int = 1001, start: int = 500, comm: str = "srun") -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "cmdline").write_bytes(b"\0".join(args) + b"\0")
    (root / str(pid) / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (root / str(pid) / "stat").write_text(f"{pid} ({comm} (x) y) S 1 " + " ".join(["0"] * 17) + f" {start} 0 0\n")


def test_a_step_is_adopted_only_as_our_own_uids_journaled_srun_or_a_step_slurm_lists(tmp_path: Path) -> None:
    _proc(tmp_path, 10, [b"/usr/bin/srun", b"--job-name=omni-7-launch-1", b"x"], start=700)
    _proc(tmp_path, 11, [b"bash", b"--job-name=omni-7-launch-2"])
    _proc(tmp_path, 12, [b"srun", b"--job-name=omni-7-launch-2"], uid=1002)          # another user's
    _proc(tmp_path, 13, [b"srun", b"--job-name=omni-7-launch-2"], start=900)
    (tmp_path / "self").mkdir()
    assert process_start(10, str(tmp_path)) == 700

    def find(name: str, journaled: StepProcess | None, listed: tuple[str, ...] = ()) -> StepProcess | None:
        return find_step_process(name, uid=1001, journaled=journaled, slurm_steps=lambda: listed,
                                 proc_root=str(tmp_path))

    assert find("omni-7-launch-1", StepProcess(10, 700)) == StepProcess(10, 700)
    assert find("omni-7-launch-1", StepProcess(10, 0)) == StepProcess(10, 700)      # a journal without it
    assert find("omni-7-launch-1", StepProcess(10, 650)) is None                    # the pid reused
    assert find("omni-7-launch-1", None) is None                                    # nothing says it is ours
    assert find("omni-7-launch-1", None, ("omni-7-launch-1",)) == StepProcess(10, 700)
    assert find("omni-7-launch-2", StepProcess(12, 500), ("omni-7-launch-2",)) is None   # bob's
    assert find("omni-7-launch-2", None, ("omni-7-launch-2",)) == StepProcess(13, 900)
    assert find("omni-7-launch-3", None, ("omni-7-launch-3",)) is None
    assert foreign_step_processes("omni-7-launch-2", uid=1001, proc_root=str(tmp_path)) == [(12, 1002)]
    assert is_running(StepProcess(10, 700), str(tmp_path)) and not is_running(StepProcess(10, 650), str(tmp_path))
    assert not is_running(StepProcess(99, 700), str(tmp_path))


@pytest.mark.cluster
def test_an_unjournaled_srun_is_adopted_when_slurm_lists_its_step(slurm_cluster, tmp_path: Path) -> None:
    """The window between srun's start and its journal line: the process is ours and Slurm lists a step
    of its name in the job; a name Slurm does not list is not adopted."""
    runner = CommandRunner(slurm_cluster.env)
    name = f"omni-test{os.getpid()}-launch-0"
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable", "--nodes=1", f"--output={tmp_path}/out",
                                         f"--wrap=srun --job-name={name} sleep 60"]).stdout)
    try:
        steps = wait_until(lambda: job_step_names(runner, str(job_id)).get(name), 60, "the named step to run")
        assert steps.startswith(f"{job_id}.")
        def listed() -> set[str]:
            return set(job_step_names(runner, str(job_id)))
        found = wait_until(lambda: find_step_process(name, uid=os.getuid(), journaled=None, slurm_steps=listed),
                           30, "the srun to show in /proc")
        assert is_running(found)
        assert find_step_process(name, uid=os.getuid(), journaled=None, slurm_steps=lambda: ()) is None
        assert find_step_process(name, uid=os.getuid() + 1, journaled=None, slurm_steps=listed) is None
    finally:
        runner.run(["scancel", str(job_id)], check=False)
    assert job_step_names(runner, "999999999") == {}


def test_a_launch_across_allocations_is_one_srun_per_allocation_with_ranks_numbered_across_them() -> None:
    from slurm_omni.slurm.steps import SPAN_SHIM, span_argvs

    comps = [StepComponent(0, ("node1", "node5"), 2), StepComponent(1, ("node2",), 1)]
    sruns = span_argvs(comps, {"node1": "10", "node2": "10", "node5": "11"}, ["omni", "train"], name="omni-10-launch-3",
                       stage_names=["vision", "text"], spank_ckpt="/ck", overlap=True, chdir="/w")
    assert [job for job, _ in sruns] == ["10", "11"]
    own, pool = sruns[0][1], sruns[1][1]
    assert own.count(":") == 1 and pool.count(":") == 0
    assert own[1:3] == ["--jobid=10", "--job-name=omni-10-launch-3"] and "--jobid=11" in pool
    assert "--omni-stage=vision:2,text:1" in own and "--omni-stage=vision:2" in pool
    # node1's two vision tasks are ranks 0-1, node5's 2-3 (in the other srun), node2's text task 4
    i = own.index(SPAN_SHIM)
    assert own[i + 1:i + 6] == ["omni-task", "0", "0", "5", "node1=0"]
    j = own.index(SPAN_SHIM, i + 1)
    assert own[j + 1:j + 6] == ["omni-task", "1", "4", "5", "node2=4"]
    k = pool.index(SPAN_SHIM)
    assert pool[k + 1:k + 6] == ["omni-task", "0", "0", "5", "node5=2"] and pool[-2:] == ["omni", "train"]
    assert "--nodelist=node5" in pool and "--ntasks=2" in pool and "--chdir=/w" in pool and "--overlap" in pool


def test_the_span_shim_gives_each_task_its_global_rank(tmp_path: Path) -> None:
    import subprocess

    from slurm_omni.slurm.steps import SPAN_SHIM

    out = subprocess.run(["bash", "-c", SPAN_SHIM, "omni-task", "1", "4", "6", "node2=4,node6=5",
                          "bash", "-c", "echo $RANK $WORLD_SIZE $OMNI_STAGE $OMNI_DP_RANK $LOCAL_RANK"],
                         env={"SLURMD_NODENAME": "node6", "SLURM_LOCALID": "0", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.split() == ["5", "6", "1", "1", "0"], out
    out = subprocess.run(["bash", "-c", SPAN_SHIM, "omni-task", "1", "4", "6", "node2=4", "true"],
                         env={"SLURMD_NODENAME": "node6", "SLURM_LOCALID": "0", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=False)
    assert out.returncode == 78 and "no rank for node node6" in out.stderr
