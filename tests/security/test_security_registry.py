"""Issue 18, finding 7, and issue 21, item 8: the registry folder. ``manager.registry_dir`` with
``{user}`` sits in a 1777 folder, so bob can make ``<registry>/alice`` before alice does. Before the fix
``omni submit`` registered her job in bob's folder (sbatch had already run), and her manager refused
that folder at the start of every tick and so handled no job at all, naming the spool; a manager that
made the folder itself made it 0755 and then refused it four times a second. Now ``omni submit``
refuses a registry folder that is not hers before sbatch, in one line naming it and the fix; the
manager makes its registry 0700, and a registry folder it cannot use is one line (once, then on
change) while the jobs it watches are still handled."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from multiuser_support import User
from omni_configs import job_toml, site_toml
from security_support import BIN, omni
from support import wait_until

from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.multiuser, pytest.mark.cluster, pytest.mark.timeout(300)]

NAME = "sec-registry"


def _files(alice: User, alice_dir: Path, shared: Path, spool: Path) -> Path:
    registry = shared / "registry"                                  # the site's, 1777: a folder per user in it
    registry.mkdir()
    registry.chmod(0o1777)
    (alice_dir / "site.toml").write_text(site_toml(alice_dir, ckpt_root=shared / "ckpt", spool_dir=spool,
                                                   registry_dir=registry / "{user}"))
    (alice_dir / "job.toml").write_text(job_toml(NAME, time_limit="00:10:00",
                                                 job_keys=f'log_dir = "{alice_dir}/logs"\n'))
    alice.own(alice_dir)
    return registry


def _alices_jobs(env: dict[str, str]) -> list[str]:
    out = CommandRunner(env).run(["squeue", "-h", "-u", "alice", "-n", NAME, "-o", "%i"], check=False).stdout
    return out.split()


def test_submit_refuses_a_registry_folder_bob_made_before_sbatch(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, shared: Path) -> None:
    registry = _files(alice, alice_dir, shared, slurm_cluster.spool)
    r = bob.run("mkdir", "-m", "0777", str(registry / "alice"))
    assert r.returncode == 0, r.stderr
    (registry / "alice").chmod(0o777)                              # past bob's umask
    before = set(_alices_jobs(slurm_cluster.env))

    done = omni(alice, "submit", "--hold", str(alice_dir / "job.toml"), "--site", str(alice_dir / "site.toml"),
                env=slurm_cluster.env)

    submitted = set(_alices_jobs(slurm_cluster.env)) - before
    for job_id in submitted:
        CommandRunner(slurm_cluster.env).run(["scancel", job_id], check=False)
    assert done.returncode != 0 and not submitted, (done.stdout, done.stderr)   # refused before sbatch
    assert os.listdir(registry / "alice") == []                     # nothing of alice's in bob's folder
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"omni: submit: registry folder: couldn't use {registry / 'alice'}: a directory of "
                           f"uid {bob.uid} with mode 0777"), line
    assert "someone else made it first" in line and "manager.registry_dir" in line, line


def test_the_manager_makes_its_registry_private_and_a_foreign_one_stops_no_watched_job(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, shared: Path) -> None:
    registry = _files(alice, alice_dir, shared, slurm_cluster.spool)
    env = {**os.environ, **slurm_cluster.env, "HOME": str(alice.home), "USER": "alice", "LOGNAME": "alice"}
    log_path = alice_dir / "manager.log"
    with open(log_path, "wb") as log:                               # its state in the registry: the default
        manager = subprocess.Popen(
            ["setpriv", f"--reuid={alice.uid}", f"--regid={alice.gid}", "--init-groups", str(BIN / "omni"), "-v",
             "manager", "run", "--site-config", str(alice_dir / "site.toml"), "--poll-interval", "1",
             "--tick", "0.25"], env=env, stdout=log, stderr=subprocess.STDOUT)
    job_id = ""

    def said(text: str) -> bool:
        if manager.poll() is not None:
            raise AssertionError(f"the manager exited {manager.returncode}: {log_path.read_text()[-3000:]}")
        return text in log_path.read_text(errors="replace")

    try:
        wait_until(lambda: (registry / "alice" / "manager" / "journal.sqlite").exists() and manager.poll() is None,
                   60, "the manager to make its state in its registry")
        st = (registry / "alice").stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.uid, 0o700)   # made private: it passes its own check
        done = omni(alice, "submit", "--hold", str(alice_dir / "job.toml"), "--site", str(alice_dir / "site.toml"),
                    env=slurm_cluster.env)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.split("submitted job ")[1].split()[0]
        wait_until(lambda: said(f"manager: watching {NAME}-{job_id}"), 60, "the manager to watch the job")

        os.chown(registry / "alice", bob.uid, bob.gid)              # the registry folder is someone else's now
        wait_until(lambda: said("manager: registry: couldn't use"), 30, "the manager to refuse the registry")
        CommandRunner(slurm_cluster.env).run(["scancel", job_id])   # the watched job still gets handled
        wait_until(lambda: said(f"manager: {NAME}-{job_id} was cancelled in Slurm"), 60,
                   "the manager to see the watched job cancelled")
        os.chown(registry / "alice", alice.uid, alice.gid)
        wait_until(lambda: said(f"manager: registry {registry / 'alice'} is usable again"), 30,
                   "the manager to use the registry again")
    finally:
        manager.send_signal(signal.SIGTERM)
        try:
            manager.wait(timeout=20)
        except subprocess.TimeoutExpired:
            manager.kill()
            manager.wait()
        if job_id:
            CommandRunner(slurm_cluster.env).run(["scancel", job_id], check=False)
    text = log_path.read_text(errors="replace")
    refusals = [line for line in text.splitlines() if "couldn't use" in line]
    assert len(refusals) == 1, refusals[:6]                         # once, not four times a second
    assert f"manager: registry: couldn't use {registry / 'alice'}: a directory of uid {bob.uid}" in refusals[0]
    assert "spool" not in refusals[0] and "tick failed" not in text, text[-3000:]
