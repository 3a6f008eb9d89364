"""alice's job and alice's manager, as a site runs them: a rank of hers dies, the plugin (root, in
slurmstepd) writes the fault record into her spool folder, her manager confirms it (level 1 from the
task exit) and resubmits; bob's held job carrying her predictable tag is not adopted."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
from manager.manager_cluster_support import BIN, JOB_ENV, ManagerRun, job_file_text, list_jobs, site_text
from multiuser_support import User

from slurm_omni.manager.journal import incarnation_tag
from slurm_omni.runtime.synth import SynthSpec, write_shards
from slurm_omni.slurm.types import JobState

pytestmark = [pytest.mark.multiuser, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(400)]


def test_alices_task_exit_reaches_her_manager_and_bobs_planted_tag_is_not_adopted(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, shared: Path) -> None:
    write_shards(SynthSpec(out_dir=shared / "shards", pairs=32, text=16, shard_size=16))
    os.system(f"chmod -R a+rX {shared / 'shards'}")
    name = "mu-alice"
    (alice_dir / "site.toml").write_text(site_text(alice_dir, slurm_cluster.spool).replace(
        f'root = "{alice_dir / "ckpt"}"', f'root = "{shared / "ckpt"}"'))
    (alice_dir / "job.toml").write_text(job_file_text(name, alice_dir, shared / "shards"))
    alice.own(alice_dir)
    env = {**os.environ, **slurm_cluster.env, **JOB_ENV, "PATH": f"{BIN}:{os.environ['PATH']}"}
    run = ManagerRun(alice_dir, env, name, user="alice", ckpt_root=shared / "ckpt")
    try:
        job_id = run.submit()
        run.start_manager(OMNI_MANAGER_CRASH_AT="resubmit:before_submit")
        beats = run.wait_steps(job_id, 2, 4)
        os.kill(beats[1]["pid"], signal.SIGKILL)                   # alice's text rank dies; its node stays up
        assert run.proc is not None
        assert run.proc.wait(timeout=90) == -signal.SIGKILL, run.manager_log()   # intent journaled, no sbatch
        # Level 1 came from the plugin's record, written as root into alice's own folder and read by her manager.
        own = slurm_cluster.spool / "alice"
        st = own.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.uid, 0o700)
        exits = run.rows("SELECT payload FROM observations WHERE job = ? AND kind = 'task_exit'", run.key)
        assert exits, run.manager_log()

        tag = incarnation_tag(run.key, 1)                          # predictable: omni.<name>-<jobid>.1
        planted = bob.run("sbatch", "--parsable", "--hold", f"--job-name={name}", f"--comment={tag}",
                          "--output=/dev/null", "--wrap=sleep 300", env=env)
        assert planted.returncode == 0, planted.stderr
        planted_id = int(planted.stdout.strip().split(";")[0])
        run.extra_jobs.add(planted_id)

        run.start_manager()
        (rec,) = run.wait_recovery(1, "first_step", timeout_s=180)
        assert rec.cause == "task_exit"
        new_id = int(run.incarnations()[1]["slurm_job_id"])
        assert new_id != planted_id
        tagged = [j for j in list_jobs(env) if j.comment == tag]
        assert {j.user for j in tagged if j.job_id == new_id} == {"alice"}
        (bobs,) = [j for j in tagged if j.job_id == planted_id]
        assert bobs.user == "bob" and bobs.state is JobState.PENDING               # untouched
        assert f"couldn't adopt Slurm job {planted_id} carrying tag {tag}: user bob" in run.manager_log()
    finally:
        run.cleanup()
