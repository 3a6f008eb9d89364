"""Issue 18, finding 1: the warm standbys' sockets. A rank of an in-allocation job hands its
environment and its stdin, stdout and stderr to the standby server at
``$TMPDIR/omni-standby-<uid>-<job>/omni-standby-<job>-<node>.sock``. Before the fix nobody checked
who made that folder or who listened: bob made it first, alice's standby servers refused to start,
and her ranks sent bob their environment and stdio; bob answered "status 0", the job ended
COMPLETED and no step had trained. Now the folder is opened by descriptor and must be alice's and
private (the supervisor, every server and every client check it), the client checks the server's
uid (SO_PEERCRED) as the server checks the client's, and anything else is one clear line and a cold
start: bob gets nothing and the job trains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from manager.manager_cluster_support import JOB_ENV, job_file_text, make_shards
from multiuser_support import User
from omni_configs import site_toml
from security_support import omni, open_to_all
from support import wait_until

from slurm_omni.formats.metrics import read_folder
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.standby import CLIENT

pytestmark = [pytest.mark.multiuser]

NAME = "sec-standby"
NODES = [f"node{i}" for i in range(1, 9)]

# bob's standby "server": listens on the sockets alice's ranks would use, records every hello it
# gets (the rank's environment) and answers that the trainer ran and exited 0
BOBS_SERVER = r"""
import json, os, socket, sys, threading
folder, job, log, ready = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def answer(conn):
    data = conn.recv(1 << 20)
    with open(log, "a") as out:
        out.write(json.dumps(sorted(json.loads(data.split(b"\n")[0]).get("env", {}))) + "\n")
    conn.sendall(b'{"pid": 1}\n{"status": 0}\n')
    conn.close()
socks = []
for node in sys.argv[5:]:
    path = os.path.join(folder, f"omni-standby-{job}-{node}.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o777)
    s.listen(16)
    socks.append(s)
    threading.Thread(target=lambda s=s: [answer(s.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
open(ready, "w").close()
threading.Event().wait()
"""


def _bobs_server(bob: User, folder: Path, job: str, nodes: list[str], work: Path) -> subprocess.Popen[bytes]:
    """bob's folder (0755, made first) and his server in it; ``work/hellos`` gets what it is sent."""
    work.mkdir(mode=0o777, exist_ok=True)
    work.chmod(0o777)
    r = bob.run("mkdir", "-m", "0755", str(folder))
    assert r.returncode == 0, r.stderr
    argv = ["setpriv", f"--reuid={bob.uid}", f"--regid={bob.gid}", "--init-groups", sys.executable, "-c",
            BOBS_SERVER, str(folder), job, str(work / "hellos"), str(work / "ready"), *nodes]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(work / "server.err", "wb"))  # noqa: SIM115
    wait_until(lambda: (work / "ready").exists() or proc.poll() is not None, 30, "bob's server to listen")
    assert proc.poll() is None, (work / "server.err").read_text()
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _hellos(work: Path) -> list[list[str]]:
    path = work / "hellos"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _client(alice: User, tmpdir: Path, job: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """The task's side as alice: the standby client of node1, asked for ``omni --version``."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "SLURM_JOB_ID": job, "SLURMD_NODENAME": "node1",
           "OMNI_SECRET": "alice's"}
    return alice.run(sys.executable, "-S", str(CLIENT), *(extra or ("node",)), "--", "--version", env=env,
                     timeout=120)


def test_a_standby_folder_or_socket_of_bobs_gets_nothing_and_the_task_starts_cold(
        alice: User, bob: User, shared: Path) -> None:
    """No job needed: alice's client (what srun runs for each task) on the real file system, against
    bob's folder made first, then against bob's server behind a socket in alice's own private folder."""
    tmpdir = shared / "tmp"                                         # a node's $TMPDIR: 1777
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)
    job = "424242"
    folder = tmpdir / f"omni-standby-{alice.uid}-{job}"
    server = _bobs_server(bob, folder, job, ["node1"], shared / "bob")
    try:
        done = _client(alice, tmpdir, job)
    finally:
        _stop(server)
    assert _hellos(shared / "bob") == [], "alice's task sent bob its environment"
    assert done.returncode == 0 and "slurm-omni" in done.stdout, (done.stdout, done.stderr)   # a cold start
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"omni standby client: couldn't use {folder}: a directory of uid {bob.uid}"), line
    assert line.endswith("; starting cold"), line

    # alice's own private folder, but the socket in it is bob's server's (root moved it there: the
    # client must not rely on the folder alone)
    shutil.rmtree(folder)
    (shared / "bob" / "ready").unlink()
    bobs = shared / "bob" / "sock"
    server = _bobs_server(bob, bobs, job, ["node1"], shared / "bob")
    try:
        assert alice.run("mkdir", "-m", "0700", str(folder)).returncode == 0
        os.rename(bobs / f"omni-standby-{job}-node1.sock", folder / f"omni-standby-{job}-node1.sock")
        done = _client(alice, tmpdir, job)
    finally:
        _stop(server)
    assert _hellos(shared / "bob") == [], "alice's task sent bob its environment"
    assert done.returncode == 0 and "slurm-omni" in done.stdout, (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert line == (f"omni standby client: couldn't use the standby server at {folder}/omni-standby-{job}-node1.sock: "
                    f"it runs as uid {bob.uid}, not ours ({alice.uid}); starting cold"), line


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_in_allocation_job_whose_standby_folder_bob_made_first_trains_and_tells_bob_nothing(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, shared: Path) -> None:
    shards = open_to_all(make_shards(shared))
    site = site_toml(alice_dir, ckpt_root=shared / "ckpt", spool_dir=slurm_cluster.spool,
                     tables='[elasticity]\nrecovery = "in_allocation"\ndefault_spares = 0\n')
    for stage in ("vision", "text"):                                # one allocation: one partition for both
        site = site.replace(f'partition = "{stage}"', 'partition = "debug"')
    (alice_dir / "site.toml").write_text(site)
    (alice_dir / "job.toml").write_text(job_file_text(NAME, alice_dir, shards, max_steps=4))
    alice.own(alice_dir)
    env = {**slurm_cluster.env, **JOB_ENV, "TMPDIR": "/tmp"}
    done = omni(alice, "submit", "--hold", str(alice_dir / "job.toml"), "--site", str(alice_dir / "site.toml"),
                env=env)
    assert done.returncode == 0, done.stderr
    job = done.stdout.split("submitted job ")[1].split()[0]
    folder = Path("/tmp") / f"omni-standby-{alice.uid}-{job}"        # every node of the embedded cluster: one /tmp
    runner = CommandRunner({**os.environ, **slurm_cluster.env})
    server = None
    try:
        server = _bobs_server(bob, folder, job, NODES, shared / "bob")
        r = alice.run("scontrol", "release", job, env={**os.environ, **slurm_cluster.env})
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 360
        while any(i.split("+")[0] == job for i in runner.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()):
            assert time.monotonic() < deadline, f"job {job} still in squeue"
            time.sleep(2)
    finally:
        if server is not None:
            _stop(server)
        runner.run(["scancel", job], check=False)
        shutil.rmtree(folder, ignore_errors=True)
    out = (alice_dir / "logs" / f"{NAME}-{job}.out").read_text(errors="replace")
    assert _hellos(shared / "bob") == [], "alice's ranks sent bob their environment"
    lines = [line for line in out.splitlines() if "standby folder: couldn't use" in line]
    assert len(lines) == 1, out[-3000:]
    assert f"supervisor: standby folder: couldn't use {folder}: a directory of uid {bob.uid}" in lines[0], lines[0]
    assert "the ranks start cold" in lines[0], lines[0]
    steps = [json.loads(line)["step"] for lines in read_folder(alice_dir / "metrics" / NAME).values()
             for _, line in lines]
    assert steps and max(steps) == 4, out[-3000:]                   # it trained, to the end
