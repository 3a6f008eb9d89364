"""The time limit's successor that does not start in time, on the embedded cluster (a lane:
``OMNI_SUCCESSOR_LANE=1``, about 3-4 minutes; docs/allocation-mode.md, "Time limit: a successor
allocation"): a job in allocation mode with a 3-minute allocation asks for its successor while the
step trains, but every other node is held by a filler job, so the successor waits in the queue.
At the time limit's stop (60 s before the end) the supervisor gives it back with one line, the
ranks checkpoint and exit 75 as without a successor, and the manager resubmits the job when the
allocation ends (today's fallback: the in-allocation batch script)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import REPO, make_shards, manager_run
from support import wait_until
from test_successor_time_limit import _site

from slurm_omni.elastic.codes import EXIT_CHECKPOINTED
from slurm_omni.policy.pools import SUCCESSOR
from slurm_omni.supervisor.journal import Successor, SupervisorJournal, journal_path

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(os.environ.get("OMNI_SUCCESSOR_LANE") != "1",
                                 reason="a lane (3-4 min): OMNI_SUCCESSOR_LANE=1")]

NAME = "succ-late"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("succ-late-data"))


def test_a_successor_that_does_not_start_by_the_stop_is_given_back_and_the_manager_resubmits(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name=NAME, dp=1,
                     max_steps=2000) as run:
        run.site.write_text(_site(tmp_path, slurm_cluster.spool))
        run.tmp.joinpath("job.toml").write_text(run.tmp.joinpath("job.toml").read_text().replace(
            'time_limit = "00:10:00"', 'time_limit = "00:03:00"'))
        job_id = run.submit()
        run.start_manager()
        run.wait_watching(job_id)
        ckpt = run.heartbeat_dir.parent
        sup_log = tmp_path / "logs" / f"{NAME}-{job_id}.supervisor.log"
        runner = run.runner()
        name = f"omni-{job_id}-successor-0"

        def say() -> str:
            return sup_log.read_text(errors="replace")[-4000:] if sup_log.exists() else "(no supervisor log)"

        def successor() -> Successor | None:
            return SupervisorJournal(journal_path(ckpt, str(job_id))).state.successors.get(name)

        filler = 0
        try:
            run.wait_steps(job_id, 2, 2, timeout_s=120)
            # every other node busy: the successor must wait in the queue
            shown = runner.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
            ours = shown.split(" NodeList=")[1].split()[0]
            idle = runner.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).stdout.split()
            free = sorted({n for n in idle if n not in runner.run(["scontrol", "show", "hostnames", ours]).stdout.split()})
            filler = run.sbatch(f"--nodes={len(free)}", f"--nodelist={','.join(free)}", "--exclusive",
                                "--job-name=succ-filler", "--time=10", "--wrap=sleep 600")
            wait_until(lambda: runner.run(["squeue", "-h", "-j", str(filler), "-o", "%T"], check=False)
                       .stdout.strip() == "RUNNING", 60, "the filler to run")
            asked = wait_until(lambda: (s := successor()) is not None and s.job_id and s, 90,
                               f"the successor's request\n{say()}", interval_s=0.5)
            run.extra_jobs.add(int(asked.job_id))
            assert runner.run(["squeue", "-h", "-j", asked.job_id, "-o", "%T"]).stdout.strip() == "PENDING"
            # the stop: given back, one line, the step stopped as without a successor
            wait_until(lambda: (s := successor()) is not None and s.state == "released", 120,
                       f"the successor to be given back\n{say()}", interval_s=0.5)
            assert "did not start before the time limit's stop: the time limit's stop and the manager's " \
                   "resubmission follow" in say()
            wait_until(lambda: runner.run(["squeue", "-h", "-j", asked.job_id], check=False).stdout.strip() == "",
                       60, "the successor to leave the queue")
            # the allocation ends at its limit; the manager resubmits (the filler gives its nodes back)
            wait_until(lambda: runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip() == "",
                       150, f"allocation {job_id} to end\n{say()}")
            runner.run(["scancel", str(filler)], check=False)
            incs = wait_until(lambda: (i := run.incarnations()) and len(i) >= 2 and i[-1]["slurm_job_id"] and i, 120,
                              f"the manager's resubmission\n{run.manager_log()[-3000:]}")
        finally:
            if filler:
                runner.run(["scancel", str(filler)], check=False)
        assert incs[0]["slurm_job_id"] == str(job_id) and incs[-1]["slurm_job_id"] != str(job_id)
        journal = SupervisorJournal(journal_path(ckpt, str(job_id))).state
        assert [la.cause for la in journal.launches if la.cause == SUCCESSOR] == []
        assert journal.launches[-1].ended == EXIT_CHECKPOINTED, say()
        assert "SIGUSR1 to the step (the ranks checkpoint)" in say()
