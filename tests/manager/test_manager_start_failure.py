"""A script that crashes at import in an in-allocation job, on the embedded cluster with the manager:
the step supervisor shows the traceback's last line in the job's own output (with where the whole
launch log is) and relaunches once; the second identical failure stops the job with one line (exit
78, no third launch, no hand-over to a resubmission), which the manager closes the job with and
``omni status`` shows. Also: the ranks started in the job's workdir (a relative script path). The
resubmission path's twin is in test_manager_bad_input.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import BIN, JOB_ENV, ManagerRun, list_jobs
from omni_configs import site_toml
from support import wait_until

from slurm_omni.supervisor.journal import SupervisorJournal, journal_path

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

ERROR = "ModuleNotFoundError: No module named 'nonexistent_module_for_omni_test'"
JOB = """
[job]
name = "crash-inalloc"
data_parallel_size = 1
time_limit = "00:10:00"
signal_before_s = 60
log_dir = "{tmp}/logs"
workdir = "work"
recovery = "in_allocation"
[[stages]]
name = "vision"
nodes = 1
spares = 1
[[stages]]
name = "text"
nodes = 1
spares = 0
[training]
max_steps = 10
command = ["{{python}}", "crash.py"]
"""


def test_a_crash_at_import_in_the_allocation_is_shown_relaunched_once_and_stopped(slurm_cluster, tmp_path: Path) -> None:
    site = site_toml(tmp_path, spool_dir=slurm_cluster.spool, tables='[elasticity]\nrecovery = "in_allocation"\n')
    (tmp_path / "site.toml").write_text(site.replace('partition = "vision"', 'partition = "debug"')
                                        .replace('partition = "text"', 'partition = "debug"'))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "crash.py").write_text("import nonexistent_module_for_omni_test\n")
    (tmp_path / "job.toml").write_text(JOB.format(tmp=tmp_path))
    env = {**os.environ, **slurm_cluster.env, **JOB_ENV, "PATH": f"{BIN}:{os.environ['PATH']}"}
    run = ManagerRun(tmp_path, env, "crash-inalloc")
    try:
        job_id = run.submit()
        run.start_manager()
        key = run.key
        wait_until(lambda: run.rows("SELECT state FROM jobs WHERE name = ?", key) == [("failed",)], 180,
                   f"the job to be closed\n{run.job_log(job_id)}\n{run.manager_log()[-3000:]}", interval_s=1.0)
        out = (tmp_path / "logs" / f"crash-inalloc-{job_id}.out").read_text()
        launch_log = run.heartbeat_dir.parent / "supervisor" / f"omni-{job_id}-launch-0.log"
        # the job's own output: the first failure's line and its full log, then the stop, one line
        assert (f"supervisor: job {job_id} (crash-inalloc): launch 0 failed before its first heartbeat (exit 1): "
                f"{ERROR} (full log: {launch_log})") in out, out[-3000:]
        stop = (f"job {job_id} (crash-inalloc): the training command failed the same way twice before its first "
                f"heartbeat (exit 1): {ERROR}; full log: {launch_log.with_name(f'omni-{job_id}-launch-1.log')}; "
                "stopped, not relaunched: fix it and submit again")
        assert f"supervisor: {stop}" in out and "step refused its input (exit 78" in out
        launches = SupervisorJournal(journal_path(run.heartbeat_dir.parent, str(job_id))).state.launches
        assert [la.number for la in launches] == [0, 1]                         # relaunched once, no more
        assert "No module named" in launch_log.read_text()                      # ran in workdir: crash.py found
        refused = run.rows("SELECT cause, payload FROM decisions WHERE job = ? AND verdict = 'refused'", key)
        assert len(refused) == 1, (run.rows("SELECT incarnation, verdict, cause, payload FROM decisions WHERE job = ?", key),
                                   run.rows("SELECT number, end_reason FROM incarnations WHERE job = ?", key),
                                   run.manager_log()[-4000:])
        ((cause, payload),) = refused
        assert cause == "repeated_failure" and json.loads(payload)["line"] == stop
        assert not [j for j in list_jobs(run.env) if j.comment.startswith(f"omni.{key}.")]   # never resubmitted
        status = subprocess.run([str(BIN / "omni"), "status", "--site-config", str(run.site), "--state-dir",
                                 str(run.state_dir)], env=run.env, capture_output=True, text=True, timeout=60,
                                check=True).stdout
        assert f"stopped (repeated_failure): {stop}" in status
        assert f"failed before its first heartbeat (incarnation 1, Slurm job {job_id}, exit 1): {ERROR}" in status
    finally:
        run.cleanup()
