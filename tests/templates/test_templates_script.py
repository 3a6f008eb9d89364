"""The rendered batch script run by bash with stub srun/scontrol: hostile names come back
unchanged, exit codes map to done / requeue / failed, and the requeue signal reaches the step."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.config.job import JobFile
from slurm_omni.config.site import SiteConfig
from slurm_omni.errors import ConfigError
from slurm_omni.render import ArrayJobRequest, DrillRequest, HetJobRequest
from slurm_omni.render.request import DRILL_WRAPPER
from slurm_omni.runtime import exitcodes

HOSTILE = "dir with space/quote'\"/$(touch PWNED)/`touch PWNED2`/semi;colon|pipe/new\nline/*?[a]/%x/tab\t/"


def _hostile_request(job: JobFile, site: SiteConfig, tmp_path: Path) -> tuple[HetJobRequest, Path, Path]:
    job_file = tmp_path / HOSTILE / "job.toml"
    ckpt_root = tmp_path / HOSTILE / "ckpt"
    site = replace(site, checkpoint=replace(site.checkpoint, root=ckpt_root))
    log_dir = tmp_path / "logs with space/and 'quote'/$(x)"
    job = replace(job, job=replace(job.job, log_dir=log_dir))
    return HetJobRequest(job=job, site=site, job_file=job_file, job_sha256="0" * 64), job_file, ckpt_root


def _run(script: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    return subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)


def _recorded(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    out = Path(env["STUB_OUT"])
    argv = out.joinpath("argv").read_bytes().decode().split("\0")[:-1]
    pairs = (item.split("=", 1) for item in out.joinpath("env").read_bytes().decode().split("\0") if "=" in item)
    return argv, dict(pairs)


def test_hostile_names_pass_bash_n(job: JobFile, site: SiteConfig, tmp_path: Path) -> None:
    request, _, _ = _hostile_request(job, site, tmp_path)
    path = tmp_path / "job.sbatch"
    path.write_text(request.materialize())
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr


def test_hostile_names_come_back_unchanged(job: JobFile, site: SiteConfig, tmp_path: Path,
                                           stub_env: dict[str, str]) -> None:
    request, job_file, ckpt_root = _hostile_request(job, site, tmp_path)
    r = _run(request.materialize(), stub_env, tmp_path)
    assert r.returncode == exitcodes.EXIT_DONE, r.stderr
    argv, env = _recorded(stub_env)
    assert argv[-4:] == ["omni", "train", "--config", str(job_file)]
    assert f"--omni-ckpt={ckpt_root / job.job.name}" in argv
    assert "--het-group=0,1" in argv and "--omni-stage=vision:2,text:2" in argv
    assert env["OMNI_JOB_FILE"] == str(job_file)
    assert env["OMNI_CKPT_DIR"] == str(ckpt_root / job.job.name)
    assert Path(env["OMNI_CKPT_DIR"]).is_dir()
    assert not list(tmp_path.rglob("PWNED*"))


def test_layout_environment(job: JobFile, site: SiteConfig, tmp_path: Path, stub_env: dict[str, str]) -> None:
    site = replace(site, checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"))
    request = HetJobRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0" * 64)
    r = _run(request.materialize(), {**stub_env, "SLURM_RESTART_COUNT": "2"}, tmp_path)
    assert r.returncode == 0, r.stderr
    _, env = _recorded(stub_env)
    assert env["MASTER_ADDR"] == "10.1.2.3"                    # NodeAddr of the first node of group 0
    assert env["MASTER_PORT"] == str(20000 + 123 % 20000)
    assert (env["OMNI_DP_SIZE"], env["OMNI_STAGES"], env["OMNI_INCARNATION"]) == ("2", "vision,text", "2")


@pytest.mark.parametrize(("step_exit", "script_exit"), [
    (exitcodes.EXIT_DONE, exitcodes.EXIT_DONE),
    (exitcodes.EXIT_CHECKPOINTED, exitcodes.EXIT_CHECKPOINTED),   # no requeue signal came: not requeued
    (exitcodes.EXIT_FAILED, exitcodes.EXIT_FAILED),
    (137, exitcodes.EXIT_FAILED),
    (143, exitcodes.EXIT_FAILED),                                 # TERM without the requeue signal
    (exitcodes.EXIT_MISALIGNED, exitcodes.EXIT_FAILED),
])
def test_exit_codes(job: JobFile, site: SiteConfig, tmp_path: Path, stub_env: dict[str, str], step_exit: int,
                    script_exit: int) -> None:
    site = replace(site, checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"))
    script = HetJobRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0" * 64).materialize()
    r = _run(script, {**stub_env, "STUB_MODE": f"exit:{step_exit}"}, tmp_path)
    assert r.returncode == script_exit, r.stderr
    assert not Path(stub_env["STUB_OUT"], "requeue").exists()


@pytest.mark.parametrize(("mode", "sig", "restarts", "requeued", "says"), [
    ("checkpoint-on-signal", "USR1", 0, True, "got SIGUSR1; forwarding it to the step"),
    ("checkpoint-on-signal", "USR1", 3, False, "3 restarts reached MAX_REQUEUES=3, not requeueing"),
    ("checkpoint-on-signal", "TERM", 0, False, "step checkpointed without SIGUSR1 to this shell; not requeueing"),
    ("terminated-on-usr1", "USR1", 0, True, "step ended by SIGTERM after SIGUSR1; taken as checkpointed"),
])
def test_only_the_requeue_signal_requeues(job: JobFile, site: SiteConfig, tmp_path: Path,
                                          stub_env: dict[str, str], mode: str, sig: str, restarts: int,
                                          requeued: bool, says: str) -> None:
    """The ranks checkpoint and exit 75 on USR1 and on TERM alike; only USR1 (Slurm's warning
    before the time limit) asks for the job to run again."""
    site = replace(site, checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"))
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(
        HetJobRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0" * 64).materialize())
    assert job.job.max_requeues == 3
    env = {**stub_env, "STUB_MODE": mode, "SLURM_RESTART_COUNT": str(restarts)}
    proc = subprocess.Popen(["bash", str(script_path)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: Path(stub_env["STUB_OUT"], "ready").exists(), 30, "the stub step to start")
        time.sleep(0.2)          # the stub's trap is set before it writes "ready"; bash's is set earlier
        os.kill(proc.pid, getattr(signal, f"SIG{sig}"))
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exitcodes.EXIT_CHECKPOINTED, err
    assert Path(stub_env["STUB_OUT"], "signals").read_text() == f"{sig}\n"
    assert f"got SIG{sig}; forwarding it to the step" in err and says in err
    requeue = Path(stub_env["STUB_OUT"], "requeue")
    assert requeue.exists() is requeued
    if requeued:
        assert requeue.read_text() == "123\n"


def test_array_task_runs_its_own_job_file(job: JobFile, site: SiteConfig, tmp_path: Path,
                                          stub_env: dict[str, str]) -> None:
    site = replace(site, checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"))
    second = replace(job, job=replace(job.job, name="omni-b"))
    files = (tmp_path / "a $(x).toml", tmp_path / "b 'q'.toml")
    script = ArrayJobRequest(jobs=(job, second), site=site, job_files=files,
                             job_sha256s=("0" * 64, "1" * 64)).materialize()
    r = _run(script, {**stub_env, "SLURM_ARRAY_TASK_ID": "1"}, tmp_path)
    assert r.returncode == 0, r.stderr
    argv, env = _recorded(stub_env)
    assert argv[-2:] == ["--config", str(files[1])]
    assert "--ntasks=4" in argv and "--omni-stage=vision:2,text:2" in argv
    assert (env["OMNI_JOB_NAME"], env["OMNI_CKPT_DIR"]) == ("omni-b", str(tmp_path / "ckpt" / "omni-b"))
    r = _run(script, {**stub_env, "SLURM_ARRAY_TASK_ID": "2"}, tmp_path)
    assert r.returncode == exitcodes.EXIT_FAILED and "has no job file" in r.stderr


@pytest.mark.parametrize(("rank", "node", "killed"), [("3", "node5", True), ("2", "node5", False),
                                                      ("3", "node1", False)])
def test_drill_wrapper_signals_only_the_target_on_an_allowed_node(rank: str, node: str, killed: bool) -> None:
    argv = ["bash", "-c", DRILL_WRAPPER, "omni-drill", "node5,node6", "3", "0", "KILL", "sleep", "2"]
    r = subprocess.run(argv, env={**os.environ, "RANK": rank, "SLURMD_NODENAME": node}, capture_output=True,
                       text=True, timeout=30, check=False)
    assert (r.returncode == -signal.SIGKILL) is killed, r.stderr
    assert r.returncode in (0, -signal.SIGKILL)


def test_drill_refused_without_allowed_nodes(job: JobFile, site: SiteConfig) -> None:
    site = replace(site, drills=replace(site.drills, allowed_nodes=""))
    with pytest.raises(ConfigError, match="drills.allowed_nodes is empty"):
        DrillRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0", rank=0, after_s=1).materialize()


def test_drill_rank_checked(job: JobFile, site: SiteConfig) -> None:
    with pytest.raises(ConfigError, match="expected 0 <= rank < 4"):
        DrillRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0", rank=4, after_s=1).materialize()
