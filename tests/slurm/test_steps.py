"""The in-allocation step's srun argv and srun's stderr, parsed (recorded on Slurm 22.05)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_omni.slurm.steps import TASK_SHIM, StepComponent, find_step_process, parse_srun_line, step_argv

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


def test_srun_stderr_of_a_node_failure() -> None:
    lines = (FIXTURES / "srun_node_failure.txt").read_text().splitlines()
    events = [e for e in (parse_srun_line(line, 1.0) for line in lines) if e is not None]
    assert [(e.kind, e.node) for e in events[:3]] == [("node_failure", "node4"), ("task_exit", "node4"),
                                                       ("terminating", "")]
    assert events[1].task == 1 and events[1].detail == "Killed"
    assert events[2].step_id == "3.0+1"


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


def test_find_step_process_reads_srun_command_lines(tmp_path: Path) -> None:
    for pid, args in ((10, [b"/usr/bin/srun", b"--job-name=omni-7-launch-1", b"x"]),
                      (11, [b"bash", b"--job-name=omni-7-launch-2"]), (12, [b"srun", b"--job-name=omni-7-launch-2"])):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(args) + b"\0")
    (tmp_path / "self").mkdir()
    assert find_step_process("omni-7-launch-1", str(tmp_path)) == 10
    assert find_step_process("omni-7-launch-2", str(tmp_path)) == 12
    assert find_step_process("omni-7-launch-3", str(tmp_path)) is None
