"""A launch that failed before its first heartbeat (policy/start_failure.py), alone: the line taken
from its output, what "the same way" ignores, and the verdict after two."""

from __future__ import annotations

import pytest

from slurm_omni.policy.start_failure import (
    MAX_LINE_CHARS,
    StartFailure,
    failure_key,
    failure_line,
    first_line,
    from_output,
    node_failed,
    repeated_failure,
    same_failure,
    stop_line,
    task_exit_code,
)

IMPORT_ERROR = """\
omni: batch shell starting
Traceback (most recent call last):
  File "/home/u/job/train.py", line 3, in <module>
    import nonexistent_module
ModuleNotFoundError: No module named 'nonexistent_module'
srun: error: node2: task 1: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=6012.0
"""


def fail(line: str, code: int = 1, launch: int = 0) -> StartFailure:
    return StartFailure(launch=launch, exit_code=code, line=line, log="/c/supervisor/omni-7-launch-0.log")


def test_the_last_line_of_the_traceback_not_sruns_lines_after_it() -> None:
    assert failure_line(IMPORT_ERROR) == "ModuleNotFoundError: No module named 'nonexistent_module'"


def test_the_newest_traceback_and_its_last_exception_when_chained() -> None:
    text = ("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'old'\n"
            "\nDuring handling of the above exception, another exception occurred:\n\n"
            "Traceback (most recent call last):\n  File \"a.py\", line 9, in <module>\n    x()\n"
            "    ^^^\nFileNotFoundError: [Errno 2] No such file or directory: 'data/train.bin'\n")
    assert failure_line(text) == "FileNotFoundError: [Errno 2] No such file or directory: 'data/train.bin'"


def test_two_ranks_interleaved_and_a_rank_prefix() -> None:
    text = ("[rank0]: Traceback (most recent call last):\n[rank1]: Traceback (most recent call last):\n"
            "[rank0]:   File \"t.py\", line 2, in <module>\n[rank1]:   File \"t.py\", line 2, in <module>\n"
            "[rank0]: RuntimeError: bad shape\n[rank1]: RuntimeError: bad shape\n")
    assert failure_line(text) == "RuntimeError: bad shape"


def test_a_syntax_error_and_a_dotted_exception() -> None:
    syntax = "  File \"/j/train.py\", line 4\n    foo(\n       ^\nSyntaxError: '(' was never closed\n"
    assert failure_line("Traceback (most recent call last):\n" + syntax) == "SyntaxError: '(' was never closed"
    dotted = "Traceback (most recent call last):\n  File \"x\", line 1\ntorch.distributed.DistBackendError: NCCL\n"
    assert failure_line(dotted) == "torch.distributed.DistBackendError: NCCL"


def test_without_a_traceback_the_last_line_that_is_not_slurms_or_ours() -> None:
    text = ("/usr/bin/python3: can't open file '/j/train.py': [Errno 2] No such file or directory\n"
            "srun: error: node1: task 0: Exited with exit code 2\nomni: step failed with exit code 2\n")
    assert failure_line(text) == "/usr/bin/python3: can't open file '/j/train.py': [Errno 2] No such file or directory"
    assert failure_line("srun: error: node1: task 0: Killed\n\n") == ""
    assert failure_line("") == ""


def test_a_long_or_binary_line_is_one_bounded_printable_line() -> None:
    line = failure_line("Traceback (most recent call last):\nValueError: " + "x\x1b" * 400 + "\n")
    assert line.startswith("ValueError: x x") and len(line) == MAX_LINE_CHARS + 3 and line.isprintable()


@pytest.mark.parametrize(("a", "b"), [
    ("RuntimeError: object at 0x7f3a2c1d0e10 is gone", "RuntimeError: object at 0x55d1e0a3b2c0 is gone"),
    ("OSError: port 29517 in use by pid 4411", "OSError: port 20331 in use by pid 917"),
    ("[rank3]: KeyError: 'a'", "KeyError: 'a'"),
    ("ValueError: got  2 items", "ValueError: got 3 items"),
])
def test_what_varies_between_runs_is_ignored(a: str, b: str) -> None:
    assert same_failure(fail(failure_line(f"Traceback (most recent call last):\n{a}\n")),
                        fail(failure_line(f"Traceback (most recent call last):\n{b}\n")))


@pytest.mark.parametrize(("a", "b"), [
    (fail("ModuleNotFoundError: No module named 'a'"), fail("ModuleNotFoundError: No module named 'b'")),
    (fail("ImportError: x"), fail("ModuleNotFoundError: x")),
    (fail("RuntimeError: x", code=1), fail("RuntimeError: x", code=2)),
    (fail("", code=1), fail("RuntimeError: x", code=1)),
])
def test_another_message_exception_or_exit_code_is_another_failure(a: StartFailure, b: StartFailure) -> None:
    assert not same_failure(a, b) and failure_key(a) != failure_key(b)


def test_two_identical_in_a_row_stop_anything_between_them_is_a_fresh_chance() -> None:
    imp = fail("ModuleNotFoundError: No module named 'x'")
    assert repeated_failure([imp]) is None
    assert repeated_failure([]) is None
    assert repeated_failure([imp, fail("ModuleNotFoundError: No module named 'x'", launch=1)]) is not None
    assert repeated_failure([imp, None, imp]) is None                 # a launch that beat in between
    assert repeated_failure([imp, fail("KeyError: 'y'", launch=1)]) is None
    assert repeated_failure([fail("KeyError: 'y'"), imp, imp]) is imp
    assert repeated_failure([imp, imp, None]) is None                  # the newest stepped


def test_the_lines_name_the_job_the_error_the_code_and_the_log() -> None:
    imp = fail("ModuleNotFoundError: No module named 'x'", launch=1)
    stop = stop_line("job 7 (gpt)", imp)
    assert stop == ("job 7 (gpt): the training command failed the same way twice before its first heartbeat "
                    "(exit 1): ModuleNotFoundError: No module named 'x'; full log: "
                    "/c/supervisor/omni-7-launch-0.log; stopped, not relaunched: fix it and submit again")
    assert first_line("job 7 (gpt)", imp) == ("job 7 (gpt): launch 1 failed before its first heartbeat (exit 1): "
                                               "ModuleNotFoundError: No module named 'x' "
                                               "(full log: /c/supervisor/omni-7-launch-0.log)")
    assert "no error line in its output" in stop_line("j", fail("", code=139))


def test_the_first_failing_tasks_code_not_sruns_own() -> None:
    text = IMPORT_ERROR + "srun: error: node3: tasks 2-3: Killed\n"
    got = from_output(text, 137, launch=2, log="/x.log")
    assert got == StartFailure(launch=2, exit_code=1, line="ModuleNotFoundError: No module named 'nonexistent_module'",
                               log="/x.log")
    assert task_exit_code("srun: error: node3: task 0: Killed\n", 137) == 137
    assert from_output("", 300, launch=0, log="").exit_code == 255


@pytest.mark.parametrize("line", [
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
     "port: 20517, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"),
    "RuntimeError: Gloo connectFullMesh failed with ... Connection refused",
    "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
])
def test_a_rendezvous_network_or_device_failure_is_never_the_same_way(line: str) -> None:
    """The next launch has other ports, peers or nodes: the supervisor's fruitless count judges those."""
    assert not same_failure(fail(line), fail(line))
    assert repeated_failure([fail(line), fail(line, launch=1)]) is None


_CRASHED_LINE = "ModuleNotFoundError: No module named 'nonexistent_module_for_omni_test'"
_CRASHED_AT_IMPORT = ("Traceback (most recent call last):\n  File \"/t/crash.py\", line 1, in <module>\n"
                      f"    import nonexistent_module_for_omni_test\n{_CRASHED_LINE}\n")
"""The first rank's whole traceback in the recorded outputs below (the embedded cluster, CI)."""


def test_a_rank_killed_mid_traceback_leaves_the_line_of_the_one_before() -> None:
    """Recorded on the embedded cluster: srun's --kill-on-bad-exit cut the second rank's traceback."""
    text = (_CRASHED_AT_IMPORT +
            "srun: error: node2: task 0: Exited with exit code 1\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=6114.0\n"
            "slurmstepd-node1: error: *** STEP 6114.0 ON node1 CANCELLED AT 2026-12-02T01:00:34 ***\n"
            "Traceback (most recent call last):\n  File \"/t/crash.py\", line 1, in <module>\n"
            "srun: error: node1: task 0: Terminated\nsrun: Force Terminated StepId=6114.0\n"
            "omni: step failed with exit code 143\n")
    got = from_output(text, 143, launch=1, log="")
    assert (got.line, got.exit_code) == (_CRASHED_LINE, 1)


def test_a_rank_killed_mid_exception_with_sruns_line_glued_to_it_leaves_the_line_of_the_one_before() -> None:
    """Recorded in CI (2026-12-03 12:24, job 55, a het job of two components): the second component's
    rank was terminated while it wrote its exception, and srun's line landed on the same line; the
    first life's line differed from the second's, so the manager resubmitted a third time."""
    text = (_CRASHED_AT_IMPORT +
            "srun: error: node3: task 0: Exited with exit code 1\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=55.0\n"
            "srun: launch/slurm: _step_signal: Terminating StepId=56.0\n"
            "slurmstepd-node4: error: *** STEP 56.0 ON node4 CANCELLED AT 2026-12-03T12:24:33 ***\n"
            "Traceback (most recent call last):\n  File \"/t/crash.py\", line 1, in <module>\n"
            "    import nonexistent_module_for_omni_test\n"
            "ModuleNotFoundErrorsrun: error: node4: task 0: Terminated\n"
            "srun: Force Terminated StepId=56.0\nomni: step failed with exit code 143\n")
    got = from_output(text, 143, launch=0, log="")
    assert (got.line, got.exit_code) == (_CRASHED_LINE, 1)
    own = "Traceback (most recent call last):\n  File \"/t/a.py\", line 1, in <module>\nRuntimeError: srun: not found\n"
    assert failure_line(own) == "RuntimeError: srun: not found"   # srun named in a message, not glued to it


def test_a_node_srun_lost_is_the_clusters_failure() -> None:
    assert node_failed("Traceback (most recent call last):\nKeyError: 1\nsrun: error: Node failure on node4\n")
    assert not node_failed(IMPORT_ERROR)


def test_the_exit_code_from_sruns_own_lines_when_kept_apart() -> None:
    """The supervisor's launches: a rank that prints srun-like words does not choose the code."""
    output = IMPORT_ERROR.replace("Exited with exit code 1", "Exited with exit code 9")
    got = from_output(output, 137, launch=0, log="/l.log", srun="srun: error: node2: task 1: Exited with exit code 1\n")
    assert (got.exit_code, got.line) == (1, "ModuleNotFoundError: No module named 'nonexistent_module'")
