"""bob against alice's checkpoints: folders made first, a planted FENCE, forged manifests. Each is
refused with one line, and alice's own submission works (docs/deployment.md)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from ckpt.states import engine, shard_state
from multiuser_support import User
from omni_configs import job_toml, site_toml

from slurm_omni.checkpoint import format as fmt
from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.multiuser, pytest.mark.cluster]

BIN = Path(sys.executable).parent
NAME = "mu-train"


def _files(alice_dir: Path, ckpt_root: Path, alice: User) -> Path:
    (alice_dir / "site.toml").write_text(site_toml(alice_dir, ckpt_root=ckpt_root, spool_dir="/var/spool/omni-unused"))
    (alice_dir / "job.toml").write_text(job_toml(NAME, time_limit="00:10:00", job_keys=f'log_dir = "{alice_dir}/logs"\n'))
    alice.own(alice_dir)
    return alice_dir / "job.toml"


def _submit(alice: User, alice_dir: Path, env: dict[str, str]) -> tuple[int, str, str]:
    r = alice.run(str(BIN / "omni"), "submit", "--hold", str(alice_dir / "job.toml"), "--site",
                  str(alice_dir / "site.toml"), env={**os.environ, **env})
    return r.returncode, r.stdout, r.stderr


def _cancel(env: dict[str, str], stdout: str) -> None:
    if "submitted job " in stdout:
        CommandRunner(env).run(["scancel", stdout.split("submitted job ")[1].split()[0]], check=False)


@pytest.mark.parametrize("attack", ["bob owns alice's folder", "alice's folder is open, bob's job folder in it"])
def test_a_checkpoint_folder_made_first_by_bob_is_refused(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, shared: Path, attack: str) -> None:
    ckpt = shared / "ckpt"
    _files(alice_dir, ckpt, alice)
    if attack == "bob owns alice's folder":
        r = bob.run("mkdir", "-m", "0777", str(ckpt / "alice"))
        assert r.returncode == 0, r.stderr
        blamed = ckpt / "alice"
    else:
        r = alice.run("mkdir", "-m", "0777", str(ckpt / "alice"))
        assert r.returncode == 0, r.stderr
        (ckpt / "alice").chmod(0o777)                              # past alice's umask
        blamed = ckpt / "alice"
    # bob prepares the job's folder too, with a FENCE that would fence alice's every save off
    for folder in (ckpt / NAME, ckpt / "alice" / NAME):
        bob.run("mkdir", "-m", "0777", "-p", str(folder))
        bob.run("sh", "-c", f'echo \'{{"incarnation": 99}}\' > {folder}/FENCE')
    assert (ckpt / "alice" / NAME).stat().st_uid == bob.uid
    code, out, err = _submit(alice, alice_dir, slurm_cluster.env)
    _cancel(slurm_cluster.env, out)
    assert code != 0, out
    (line,) = err.strip().splitlines()
    assert line.startswith(f"omni: submit: checkpoint folder: couldn't use {blamed}: a directory of uid "), line
    assert f"expected a directory of uid {alice.uid} that only it can write" in line


def test_alices_own_folders_are_hers_and_closed_to_bob(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, shared: Path) -> None:
    ckpt = shared / "ckpt"
    _files(alice_dir, ckpt, alice)
    code, out, err = _submit(alice, alice_dir, slurm_cluster.env)
    try:
        assert code == 0, err
        for folder in (ckpt / "alice", ckpt / "alice" / NAME):
            st = folder.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice.uid, 0o700), folder
        job = ckpt / "alice" / NAME
        for attempt in (["mkdir", str(job / "heartbeat")], ["sh", "-c", f"echo x > {job}/FENCE"],
                        ["ls", str(job)]):
            r = bob.run(*attempt)
            assert r.returncode != 0 and "Permission denied" in r.stderr, (attempt, r)
        record = next((alice_dir / "registry").glob("*.json"))
        assert json.loads(record.read_text())["ckpt_dir"] == str(job)
    finally:
        _cancel(slurm_cluster.env, out)


def _forged(where: Path, edit: str) -> Path:
    with engine(where, keep_last=0) as eng:
        eng.save(10, shard_state(10))
    step = fmt.step_dir(where, 10)
    data = json.loads((step / fmt.MANIFEST).read_bytes())
    piece = data["units"]["projector/model"]["tensors"]["proj.weight"]["pieces"][0]
    if edit == "negative offset":
        piece["offset"] = -4096
    else:
        data["shards"]["rank-00000"]["file"] = edit
    raw = json.dumps(data).encode()
    (step / fmt.MANIFEST).write_bytes(raw)
    fmt.write_marker(step, 10, raw)
    return step


@pytest.mark.parametrize("edit", ["../../../../../home/alice/secret.h5", "negative offset"])
def test_a_manifest_from_bob_cannot_make_alice_read_her_files_or_crash(
        alice: User, bob: User, alice_dir: Path, shared: Path, edit: str) -> None:
    step = _forged(shared / "bob-ckpt", edit)
    bob.own(shared / "bob-ckpt")
    bob.run("chmod", "-R", "go+rX", str(shared / "bob-ckpt"))     # bob shares it: "verify my checkpoint"
    r = alice.run(str(BIN / "omni"), "ckpt", "verify", "--no-progress", str(step))
    assert r.returncode == 1, (r.stdout, r.stderr)
    (line,) = r.stdout.strip().splitlines()[1:] or r.stdout.strip().splitlines()
    assert ("names file" in line and "only rank-00000.h5 in the step directory is allowed" in line) or \
        ("piece at offset -4096" in line and "lies outside its file" in line), r.stdout
    assert "Traceback" not in r.stderr


def test_bob_cannot_make_or_read_alices_spool_folder(slurm_cluster, alice: User, bob: User) -> None:
    """The spool root is root's (0755): only the plugin makes <spool>/<user>, for the job's owner."""
    spool = slurm_cluster.spool
    assert spool.stat().st_uid == 0 and stat.S_IMODE(spool.stat().st_mode) == 0o755
    r = bob.run("mkdir", str(spool / "alice-planted"))
    assert r.returncode != 0 and "Permission denied" in r.stderr
    if (spool / "alice").exists():                                 # made by an earlier job of alice's
        assert (spool / "alice").stat().st_uid == alice.uid
        r = bob.run("ls", str(spool / "alice"))
        assert r.returncode != 0 and "Permission denied" in r.stderr


def test_a_manager_that_may_not_drain_says_so_and_goes_on(slurm_cluster, alice: User, alice_dir: Path,
                                                          shared: Path) -> None:
    """drain_failed needs an operator: a user's manager gets 'Invalid user id' from Slurm, logs one
    line and goes on with the recovery (the action counts as done, so it is not retried forever)."""
    _files(alice_dir, shared / "ckpt", alice)
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING);"
            "from pathlib import Path; from slurm_omni.config.site import load_site;"
            "from slurm_omni.manager.actions import Actions; from slurm_omni.slurm.cli_backend import CliBackend;"
            f"a = Actions(CliBackend(), load_site(Path({str(alice_dir / 'site.toml')!r})), Path({str(alice_dir)!r}));"
            "print(a.drain('node8', 'omni: test'))")
    r = alice.run(sys.executable, "-c", code, env={**os.environ, **slurm_cluster.env})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "node8 not drained (not an operator)"
    assert "couldn't drain node8: Slurm refuses this user" in r.stderr and "Invalid user id" in r.stderr
    node = {n.name: n for n in slurm_cluster.backend().nodes()}["node8"]
    assert "DRAIN" not in node.flags
