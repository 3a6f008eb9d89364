"""Bad input on the embedded cluster: a job that no restart can fix ends with one line naming the
job and what to fix (manager log, journal, ``omni status``), and is never resubmitted. One manager
watches five jobs at once: a program not found on the node, a script that exits 0 before its last
step, one that never writes a heartbeat (``detection.first_heartbeat_s`` is short here), one whose
state_dict refuses the checkpoint after a real recovery (the exit-78 close path), one whose next
life is another script (other modules) that finds the first one's checkpoint in its folder, and one
that crashes at import (its traceback's last line in the job's output and in ``omni status``, one
resubmission, stopped after the second identical failure), and one that hands the checkpointer a
plain DataLoader (no state_dict: 78 at once, issue 21)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from manager_cluster_support import BIN, JOB_ENV, ManagerRun, list_jobs
from omni_configs import site_toml
from support import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

FIRST_HEARTBEAT_S = 60
"""Long enough for a torch script to import and beat on a loaded 2-core machine (the silent job waits it out)."""
JOB = """
[job]
name = "{name}"
data_parallel_size = 1
time_limit = "00:10:00"
signal_before_s = 60
max_requeues = 3
log_dir = "{tmp}/logs"
[[stages]]
name = "vision"
nodes = 1
[[stages]]
name = "text"
nodes = 1
[training]
max_steps = 10
command = {command}
"""

SCRIPT = '''
"""Test script: "early" beats three steps and exits 0 (no elastic context to catch it); "refuse"
checkpoints step 2 and dies at step 3 in its first life, and its state refuses to load in the next;
"other" does the same, and its next life is another script: its module has another name."""
import os
import sys
import time

import torch

from slurm_omni import elastic


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        raise ValueError(f"counter state {state} does not fit this script's counter")


mode = sys.argv[1]
if mode == "early":
    run = elastic.init(distributed=False)
    for step in range(1, 4):
        run.step_done(step, loss=1.0)
    time.sleep(3 * run.layout.heartbeat_interval_s)   # the heartbeat thread writes step 3
    os._exit(0)
with elastic.init(max_steps=10) as run:
    if mode == "loader":   # refused when handed over: exit 78, one line
        loader = torch.utils.data.DataLoader(range(64), batch_size=4, shuffle=True, num_workers=2)
        run.checkpointer(modules={run.layout.stage_name: torch.nn.Linear(1, 1)}, state={"loader": loader})
    counter = Counter() if mode == "refuse" else None
    name = run.layout.stage_name if mode == "refuse" or run.layout.incarnation == 0 else "head"
    run.checkpointer(modules={name: torch.nn.Linear(1, 1)}, state={"counter": counter} if counter else {})
    start = run.restore()
    for step in range(start, 10):
        if counter is not None:
            counter.n += 1
        if step == 2 and run.layout.incarnation == 0:
            raise RuntimeError("the first life dies after its checkpoint")
        run.end_step(step + 1, checkpoint_every=2, loss=1.0)
        time.sleep(0.3)
'''


def _submit(run: ManagerRun, job_file: Path) -> int:
    done = subprocess.run([str(BIN / "omni"), "submit", str(job_file), "--site", str(run.site)], env=run.env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    job_id = int(done.stdout.split("submitted job ")[1].split()[0])
    run.extra_jobs.add(job_id)
    return job_id


def _closed(run: ManagerRun, key: str) -> dict[str, object] | None:
    rows = run.rows("SELECT cause, payload FROM decisions WHERE job = ? AND verdict = 'refused'", key)
    state = run.rows("SELECT state FROM jobs WHERE name = ?", key)
    if not rows or state != [("failed",)]:
        return None
    ((cause, payload),) = rows
    return {"cause": cause, "line": json.loads(payload)["line"]}


@pytest.fixture(scope="module")
def bad_jobs(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagerRun, dict[str, int]]]:
    tmp = tmp_path_factory.mktemp("bad-input")
    tables = (f"[detection]\nheartbeat_interval_s = 0.5\nfirst_heartbeat_s = {FIRST_HEARTBEAT_S}\n"
              '[elasticity]\nspare_policy = "any_switch"\n')
    (tmp / "site.toml").write_text(site_toml(tmp, spool_dir=slurm_cluster.spool, tables=tables))
    (tmp / "script.py").write_text(SCRIPT)
    # on the submitter's PATH (omni submit checks the program), not on the PATH the job file gives the node
    trainer = tmp / "bin" / "trainer"
    trainer.parent.mkdir()
    trainer.write_text("#!/bin/sh\nexit 0\n")
    trainer.chmod(0o755)
    commands = {"notfound": ["trainer"], "early": ["{python}", str(tmp / "script.py"), "early"],
                "silent": ["/bin/sleep", "600"], "refuse": ["{python}", str(tmp / "script.py"), "refuse"],
                "other": ["{python}", str(tmp / "script.py"), "other"],
                "crash": ["{python}", "crash.py"],                      # relative: found in the workdir
                "loader": ["{python}", str(tmp / "script.py"), "loader"]}
    (tmp / "crash.py").write_text("import nonexistent_module_for_omni_test\n")
    env = {**os.environ, **slurm_cluster.env, **JOB_ENV, "PATH": f"{trainer.parent}:{BIN}:{os.environ['PATH']}"}
    run = ManagerRun(tmp, env, "bad-input")
    try:
        ids = {}
        for case, command in commands.items():
            path = tmp / f"{case}.toml"
            node_path = '[training.env]\nPATH = "/usr/bin:/bin"\n' if case == "notfound" else ""
            path.write_text(JOB.format(name=f"bad-{case}", tmp=tmp, command=json.dumps(command)) + node_path)
            ids[case] = _submit(run, path)
        run.start_manager()
        keys = [f"bad-{case}-{job_id}" for case, job_id in ids.items()]
        wait_until(lambda: all(_closed(run, k) for k in keys), 240,
                   "every bad job to be closed\n" + "\n".join(run.job_log(i) for i in ids.values()), interval_s=1.0)
        yield run, ids
    finally:
        run.cleanup()


def _incarnations(run: ManagerRun, key: str) -> list[dict[str, object]]:
    with run.journal() as journal:
        return journal.incarnations(key)


def _check_closed_once(run: ManagerRun, case: str, job_id: int) -> str:
    """The job was closed with one refusal line, in the log and in ``omni status``, and never resubmitted."""
    key = f"bad-{case}-{job_id}"
    closed = _closed(run, key)
    assert closed is not None
    line = str(closed["line"])
    assert line.startswith(f"job {job_id} (bad-{case}): ")
    assert line in run.manager_log()
    assert not run.recoveries(key)                        # no recovery opened after the refusal...
    assert {i["slurm_job_id"] for i in _incarnations(run, key)} <= {str(job_id)}   # ...nothing resubmitted
    assert not [j for j in list_jobs(run.env) if j.comment.startswith(f"omni.{key}.")]   # no sbatch by the manager
    status = subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "status", "--site-config", str(run.site),
                             "--state-dir", str(run.state_dir)], env=run.env, capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert f"stopped ({closed['cause']}): {line}" in status
    return line


def test_a_program_not_found_is_one_line_and_no_restart(bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    line = _check_closed_once(run, "notfound", ids["notfound"])
    assert "trainer not found on " in line and "fix [training] command" in line


def test_an_exit_0_before_the_last_step_is_one_line_and_no_restart(bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    line = _check_closed_once(run, "early", ids["early"])
    assert "the training command exited 0 at step 3 of 10: a script must run to its last step" in line


def test_a_script_that_never_beats_is_cancelled_with_one_line(bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    line = _check_closed_once(run, "silent", ids["silent"])
    assert f"(detection.first_heartbeat_s = {FIRST_HEARTBEAT_S})" in line and "elastic.init()" in line
    wait_until(lambda: not [j for j in list_jobs(run.env) if j.job_id == ids["silent"] and not j.state.finished],
               60, "the silent job to be cancelled")


def test_a_state_dict_that_refuses_closes_the_job_after_one_recovery(
        bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    key = f"bad-refuse-{ids['refuse']}"
    (rec,) = run.recoveries(key)                           # the crash of the first life: recovered once
    assert rec.incarnation == 0 and rec.new_incarnation == 1
    incarnations = _incarnations(run, key)
    assert [i["number"] for i in incarnations] == [0, 1]   # and the refusal stopped it there
    ((cause, payload),) = run.rows("SELECT cause, payload FROM decisions WHERE job = ? AND verdict = 'refused'", key)
    line = json.loads(payload)["line"]
    assert cause == "state_dict" and line.startswith(f"job {incarnations[1]['slurm_job_id']} (bad-refuse): rank ")
    assert "counter.load_state_dict refused step-2: ValueError: counter state {'n': 2} does not fit" in line
    assert line in run.manager_log()


def test_a_checkpoint_of_another_script_closes_the_job_after_one_recovery(
        bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    key = f"bad-other-{ids['other']}"
    (rec,) = run.recoveries(key)
    assert rec.incarnation == 0 and rec.new_incarnation == 1
    incarnations = _incarnations(run, key)
    assert [i["number"] for i in incarnations] == [0, 1]
    ((cause, payload),) = run.rows("SELECT cause, payload FROM decisions WHERE job = ? AND verdict = 'refused'", key)
    line = json.loads(payload)["line"]
    assert cause == "foreign_checkpoint"
    assert line.startswith(f"job {incarnations[1]['slurm_job_id']} (bad-other): rank ") and line in run.manager_log()
    assert "step-2 holds " in line and "this script has " in line and "head" in line
    assert "give this job its own checkpoint folder, or move the old one away" in line


def _status(run: ManagerRun, *extra: str) -> str:
    return subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "status", *extra, "--site-config",
                           str(run.site), "--state-dir", str(run.state_dir)], env=run.env, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_a_crash_at_import_is_shown_resubmitted_once_and_stopped_after_the_second_identical_failure(
        bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    key = f"bad-crash-{ids['crash']}"
    error = "ModuleNotFoundError: No module named 'nonexistent_module_for_omni_test'"
    incarnations = _incarnations(run, key)    # the first life may end before a poll saw it running
    assert {i["number"] for i in incarnations} <= {0, 1} and incarnations[-1]["number"] == 1, incarnations
    assert len(run.rows("SELECT key FROM actions WHERE job = ? AND kind = 'resubmit'", key)) == 1   # one, no more
    (rec,) = run.recoveries(key)
    assert rec.cause == "start_failure" and rec.new_incarnation == 1
    first_out = (run.tmp / "logs" / f"bad-crash-{ids['crash']}.out").read_text()
    # the first life's own output: the traceback's last line, summed up after the step's end
    assert (f"omni: job {ids['crash']} (bad-crash): launch 0 failed before its first heartbeat (exit 1): {error} "
            f"(full log: ") in first_out, first_out[-2000:]
    closed = _closed(run, key)
    assert closed is not None and closed["cause"] == "repeated_failure"
    second = incarnations[-1]["slurm_job_id"]
    assert str(closed["line"]).startswith(f"job {second} (bad-crash): the training command failed the same way "
                                          f"twice before its first heartbeat (exit 1): {error}; full log: ")
    assert str(closed["line"]).endswith("; stopped, not relaunched: fix it and submit again")
    text = _status(run)
    assert f"stopped (repeated_failure): {closed['line']}" in text
    assert f"failed before its first heartbeat (incarnation 1, Slurm job {second}, exit 1): {error}" in text
    (job,) = [j for j in json.loads(_status(run, "--json"))["jobs"] if j["name"] == key]
    assert job["start_failure"]["line"] == error and job["start_failure"]["count"] == 2


def test_a_plain_data_loader_handed_to_the_checkpointer_is_one_line_and_no_restart(
        bad_jobs: tuple[ManagerRun, dict[str, int]]) -> None:
    run, ids = bad_jobs
    line = _check_closed_once(run, "loader", ids["loader"])
    assert "couldn't take state['loader']: torch.utils.data.dataloader.DataLoader has no state_dict()" in line
    assert "StatefulDataLoader" in line
