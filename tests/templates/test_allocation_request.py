"""Allocation mode's request (render/allocation.py), built without running anything: salloc asks for
what the in-allocation script's #SBATCH lines ask; the supervisor gets the batch script's options and
exports; a site that does not allow the mode falls back to the in-allocation batch script."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
from render_support import JOB_FILE

from slurm_omni.config.job import JobFile
from slurm_omni.config.site import ElasticitySite, SiteConfig
from slurm_omni.errors import ConfigError, SlurmError
from slurm_omni.render import HetJobRequest
from slurm_omni.render.allocation import AllocationRequest, allocation_mode


def _site(site: SiteConfig, *, allow: bool, features: bool = True) -> SiteConfig:
    stages = {name: replace(s, partition="gpu", feature=name[:3] if features else "") for name, s in site.stages.items()}
    return replace(site, stages=stages, elasticity=replace(site.elasticity, recovery="resubmit", default_spares=1,
                                                           allow_allocation=allow))


def _request(job: JobFile, site: SiteConfig, digest: str, base: int = 0) -> HetJobRequest:
    job = replace(job, job=replace(job.job, recovery="allocation", account="proj-1"))
    return HetJobRequest(job=job, site=site, job_file=JOB_FILE, job_sha256=digest, user="alice", incarnation_base=base)


def test_salloc_asks_what_the_in_allocation_script_asks_without_a_batch_script(
        job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    request = _request(job, _site(site, allow=True), job_sha256)
    assert allocation_mode(request)
    argv = AllocationRequest(request).salloc_argv()
    assert argv[:3] == ["salloc", "--no-shell", "--no-kill"]
    script = request.materialize()     # the in-allocation script: what the manager resubmits
    sbatch = [shlex.split(line)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    for option in ("--partition=", "--nodes=", "--ntasks-per-node=", "--gres=", "--switches=", "--constraint=",
                   "--time=", "--job-name=", "--account="):
        (ours,) = [a for a in argv if a.startswith(option)]
        assert ours in sbatch, (ours, sbatch)
    assert "--constraint=[vis*2&tex*2]" in argv and "--nodes=4" in argv
    assert not any(a.startswith(("--signal", "--requeue", "--output")) for a in argv)   # no batch shell


def test_the_supervisor_gets_the_batch_scripts_options_and_exports(job: JobFile, site: SiteConfig,
                                                                   job_sha256: str) -> None:
    request = _request(job, _site(site, allow=True), job_sha256, base=4)
    alloc = AllocationRequest(request)
    argv = alloc.supervisor_argv(2001)
    assert argv[argv.index("supervise") + 1] == "--allocation=2001"
    assert "--stages=vision:1:2:1:vis,text:1:2:1:tex" in argv and "--stop-before=120" in argv
    # the hang window the manager's rule uses, the supervisor's too
    assert f"--confirmation-window={request.site.detection.confirmation_window_s:g}" in argv
    assert f"--hang-factor={request.site.detection.confirm.hang_factor:g}" in argv
    assert argv[argv.index("--") + 1:][-2:] == ["--config", str(JOB_FILE)]
    env = alloc.supervisor_env(2001)
    assert env["OMNI_INCARNATION"] == env["OMNI_INCARNATION_BASE"] == "4" and env["OMNI_RECOVERY"] == "allocation"
    assert env["OMNI_HET_JOB_ID"] == env["SLURM_JOB_ID"] == "2001" and env["OMNI_CKPT_DIR"].endswith("/alice/omni-tiny")



def test_the_supervisor_gets_the_jobs_salloc_for_its_pools_unless_the_site_turns_them_off(
        job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    import json

    from slurm_omni.slurm.hostlist import expand
    from slurm_omni.slurm.salloc import pool_salloc_argv, switch_wait

    alloc = AllocationRequest(_request(job, _site(site, allow=True), job_sha256))
    base = json.loads(alloc.supervisor_env(2001)["OMNI_POOL_SALLOC"])
    assert base == alloc.salloc_argv()
    pool = pool_salloc_argv(base, name="omni-2001-pool-0", nodes=2, minutes=7, constraint="[vis*1&tex*1]",
                            switches=f"1@{switch_wait(base)}")
    kept = [a for a in base if a.split("=")[0] in ("--partition", "--gres", "--ntasks-per-node")]
    assert pool[:3] == ["salloc", "--no-shell", "--no-kill"] and all(a in pool for a in kept)
    assert pool[-5:] == ["--job-name=omni-2001-pool-0", "--nodes=2", "--time=7", "--constraint=[vis*1&tex*1]",
                         f"--switches=1@{switch_wait(base)}"]
    assert len([a for a in pool if a.startswith(("--nodes=", "--constraint=", "--switches="))]) == 3
    # the nodes the job lost are excluded, with any the job's own salloc excludes
    again = pool_salloc_argv([*base, "--exclude=node9"], name="p", nodes=1, minutes=7, exclude=("node1", "node2"))
    (excluded,) = [a for a in again if a.startswith("--exclude=")]
    assert sorted(expand(excluded.split("=", 1)[1])) == ["node1", "node2", "node9"]
    off = _site(site, allow=True)
    off = replace(off, elasticity=replace(off.elasticity, pools=False))
    assert "OMNI_POOL_SALLOC" not in AllocationRequest(_request(job, off, job_sha256)).supervisor_env(2001)


def test_the_time_limits_successor_repeats_the_jobs_whole_salloc_under_its_own_name(
        job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    import json

    from slurm_omni.slurm.hostlist import expand
    from slurm_omni.slurm.salloc import successor_salloc_argv

    alloc = AllocationRequest(_request(job, _site(site, allow=True), job_sha256))
    base = json.loads(alloc.supervisor_env(2001)["OMNI_POOL_SALLOC"])
    succ = successor_salloc_argv([*base, "--exclude=node9"], name="omni-2001-successor-0", exclude=("node1",))
    # the whole shape: every argument but the name and the exclusions as the job's own
    assert [a for a in succ if not a.startswith(("--job-name=", "--exclude="))] == \
        [a for a in base if not a.startswith("--job-name=")]
    assert "--job-name=omni-2001-successor-0" in succ
    (excluded,) = [a for a in succ if a.startswith("--exclude=")]
    assert sorted(expand(excluded.split("=", 1)[1])) == ["node1", "node9"]
    # the supervisor asks for it ahead by the site's expected queue wait; 0 or no pools: none
    argv = alloc.supervisor_argv(2001)
    assert "--successor-queue-wait=3600" in argv
    off = _site(site, allow=True)
    off = replace(off, elasticity=replace(off.elasticity, successor_queue_wait_s=0.0))
    assert not any(a.startswith("--successor-queue-wait") for a in
                   AllocationRequest(_request(job, off, job_sha256)).supervisor_argv(2001))
    with pytest.raises(SlurmError, match="salloc --no-shell only"):
        successor_salloc_argv(["sbatch", "x"], name="n")


def test_a_site_that_does_not_allow_it_runs_the_job_in_allocation_with_a_batch_script(
        job: JobFile, site: SiteConfig, job_sha256: str) -> None:
    request = _request(job, _site(site, allow=False), job_sha256)
    assert request.recovery == "in_allocation" and not allocation_mode(request)
    assert "omni-tiny" in request.materialize() and "supervise" in request.materialize()
    with pytest.raises(ConfigError, match="allocation mode needs"):
        AllocationRequest(request)
    # stages that need a heterogeneous job: neither mode, the het script
    het = _request(job, replace(_site(site, allow=True), stages=site.stages), job_sha256)
    assert not allocation_mode(het) and "hetjob" in het.materialize()
    with pytest.raises(ConfigError, match="elasticity.allow_allocation"):
        ElasticitySite(recovery="allocation")
    assert ElasticitySite(recovery="allocation", allow_allocation=True).recovery == "allocation"
