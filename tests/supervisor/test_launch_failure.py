"""``omni launch-failure`` (the heterogeneous job's batch script after a failed step) and the record
it leaves for the manager, alone: a log, an environment and a heartbeat folder, no Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_omni.cli.launch_failure import launch_failure
from slurm_omni.manager.sources import read_start_failures

LOG = ("an earlier life's lines\nValueError: old\n",
       ("Traceback (most recent call last):\n  File \"/j/train.py\", line 2, in <module>\n    import tiktokn\n"
        "ModuleNotFoundError: No module named 'tiktokn'\nsrun: error: node1: task 0: Exited with exit code 1\n"))


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    log = tmp_path / "logs" / "gpt-7.out"
    log.parent.mkdir()
    log.write_text("".join(LOG))
    heartbeat = tmp_path / "ckpt" / "heartbeat"       # no rank started: nobody made it
    heartbeat.parent.mkdir(mode=0o700)
    env = {"SLURM_JOB_ID": "7", "OMNI_HEARTBEAT_DIR": str(heartbeat), "OMNI_INCARNATION": "2", "OMNI_JOB_NAME": "gpt"}
    return log, heartbeat, env


def test_a_step_that_never_beat_gets_its_line_in_the_output_and_a_record(job: tuple[Path, Path, dict[str, str]]) -> None:
    log, heartbeat, env = job
    start = len(LOG[0])                                # this life's part of the output only
    result = CliRunner().invoke(launch_failure, ["--log", str(log), "--start", str(start), "--rc", "137"], env=env)
    assert result.exit_code == 0
    assert result.output == (f"omni: job 7 (gpt): launch 2 failed before its first heartbeat (exit 1): "
                             f"ModuleNotFoundError: No module named 'tiktokn' (full log: {log})\n")
    (record,) = read_start_failures(heartbeat, 7)
    assert (record.incarnation, record.exit_code, record.line, record.log) == (
        2, 1, "ModuleNotFoundError: No module named 'tiktokn'", str(log))
    assert heartbeat.stat().st_mode & 0o777 == 0o700


def test_a_step_that_beat_is_the_confirmers_and_leaves_nothing(job: tuple[Path, Path, dict[str, str]]) -> None:
    log, heartbeat, env = job
    heartbeat.mkdir(mode=0o700)
    (heartbeat / "rank-0.json").write_text(json.dumps({
        "rank": 0, "stage": 0, "dp_rank": 0, "pid": 5, "incarnation": 2, "job_id": "7", "step": 3,
        "phase": "training", "time": 1764460000.0}))
    result = CliRunner().invoke(launch_failure, ["--log", str(log), "--rc", "1"], env=env)
    assert result.exit_code == 0 and result.output == ""
    assert read_start_failures(heartbeat, 7) == []


def test_a_step_that_lost_a_node_leaves_nothing(job: tuple[Path, Path, dict[str, str]]) -> None:
    log, heartbeat, env = job
    log.write_text("".join(LOG) + "srun: error: Node failure on node2\n")
    result = CliRunner().invoke(launch_failure, ["--log", str(log), "--rc", "1"], env=env)
    assert result.exit_code == 0 and result.output == ""
    assert read_start_failures(heartbeat, 7) == []


def test_a_supervisor_launch_reads_srun_apart_from_the_ranks(tmp_path: Path) -> None:
    """What a rank printed (a fake node failure) is no report of srun's: the launch is still recorded."""
    from slurm_omni.supervisor.launch_failure import read_failure

    out, srun = tmp_path / "omni-7-launch-0.log", tmp_path / "omni-7-launch-0.srun.log"
    out.write_text(LOG[1] + "srun: error: Node failure on node1\n")
    srun.write_text("srun: error: node1: task 0: Exited with exit code 3\n")
    got = read_failure(out, start=0, rc=137, launch=0, srun_log=srun)
    assert got is not None and (got.exit_code, got.line) == (3, "ModuleNotFoundError: No module named 'tiktokn'")
    srun.write_text("srun: error: Node failure on node1\n")
    assert read_failure(out, start=0, rc=137, launch=0, srun_log=srun) is None
