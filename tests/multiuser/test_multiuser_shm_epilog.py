"""Nothing of a job stays in /dev/shm after it ends (issues 22 and 19): alice's 3-node job leaves
heartbeat folders and memory-tier copies on every node as its ranks do, one of its nodes is set DOWN
mid-run (its processes killed, the node taken out of the job: it runs no epilog for it), the job is
cancelled; the plugin's job epilog on the remaining nodes removes every node's objects of the job
(the embedded cluster's nodes share one /dev/shm). bob's folder with a name of alice's job and his
symlink with such a name survive, and so does the file a link inside alice's folder points to."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
from multiuser_support import User
from support import wait_until

from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.multiuser, pytest.mark.cluster]

SHM = Path("/dev/shm")
NODES = ("node1", "node2", "node3")
LOST = "node3"

SCRIPT = """#!/bin/bash
#SBATCH --nodes=3 --nodelist={nodes} --ntasks-per-node=1 --no-kill --time=5 --output={out}/job.out
srun --no-kill bash -c '
    u=$(id -u)
    b=/dev/shm/omni-beats-$u-$SLURM_JOB_ID-$SLURMD_NODENAME
    m=/dev/shm/omni-$u/$SLURM_JOB_ID
    mkdir -p -m 700 "$b" "$m/peer" && chmod 700 /dev/shm/omni-$u
    echo "{{}}" > "$b/rank-$SLURM_PROCID.json"
    ln -s {victim}/precious "$b/link"
    head -c 4096 /dev/zero > "$m/step-1.rank-0000$SLURM_PROCID.j.1.h5"
    head -c 512 /dev/zero > "$m/peer/step-1.rank-0000$SLURM_PROCID.j.2.h5"
    touch {out}/ready-$SLURMD_NODENAME
    exec sleep 600'
"""


def _jobs_objects(uid: int, job_id: int) -> list[str]:
    """What of the job is in /dev/shm and belongs to its owner."""
    found = [p.name for p in SHM.glob(f"omni-beats-{uid}-{job_id}-*") if p.lstat().st_uid == uid]
    if (SHM / f"omni-{uid}" / str(job_id)).exists():
        found.append(f"omni-{uid}/{job_id}")
    return found


def test_a_job_that_lost_a_node_leaves_nothing_in_dev_shm(slurm_cluster, alice: User, bob: User,
                                                          alice_dir: Path) -> None:
    runner = CommandRunner(slurm_cluster.env)
    victim = Path("/tmp") / f"omni-epilog-victim-{uuid.uuid4().hex[:8]}"
    victim.mkdir(mode=0o755)
    (victim / "precious").write_text("root's")
    script = alice_dir / "job.sh"
    script.write_text(SCRIPT.format(nodes=",".join(NODES), out=alice_dir, victim=victim))
    alice.own(alice_dir)
    r = alice.run("sbatch", "--parsable", "--hold", str(script), env={**os.environ, **slurm_cluster.env})
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip().split(";")[0])
    # bob, knowing the id: his folder and a symlink with names of alice's job on nodes it does not use
    bobs = SHM / f"omni-beats-{alice.uid}-{job_id}-node8"
    link = SHM / f"omni-beats-{alice.uid}-{job_id}-node7"
    planted = [bobs, link]
    try:
        assert bob.run("mkdir", "-m", "755", str(bobs)).returncode == 0
        assert bob.run("touch", str(bobs / "rank-0.json")).returncode == 0
        assert bob.run("ln", "-s", str(victim), str(link)).returncode == 0
        runner.run(["scontrol", "release", str(job_id)])
        wait_until(lambda: all((alice_dir / f"ready-{n}").exists() for n in NODES), 90,
                   "the job's objects on its three nodes", interval_s=0.5)
        assert len(_jobs_objects(alice.uid, job_id)) == 4

        runner.run(["scontrol", "update", f"nodename={LOST}", "state=DOWN", "reason=omni-test"])
        wait_until(lambda: runner.run(["squeue", "-h", "-j", str(job_id), "-o", "%N"]).stdout.strip() == "node[1-2]",
                   60, f"job {job_id} to go on without {LOST}", interval_s=0.5)
        runner.run(["scancel", str(job_id)])
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 90,
                   f"job {job_id} to end (its epilogs run before it leaves the queue)", interval_s=0.5)
        assert _jobs_objects(alice.uid, job_id) == []
        runner.run(["scontrol", "update", f"nodename={LOST}", "state=RESUME"])
        wait_until(lambda: "idle" in runner.run(["sinfo", "-h", "-n", LOST, "-o", "%T"]).stdout, 60,
                   f"{LOST} back", interval_s=0.5)
        assert _jobs_objects(alice.uid, job_id) == []

        assert bobs.is_dir() and bobs.stat().st_uid == bob.uid and (bobs / "rank-0.json").exists()
        assert link.is_symlink() and os.readlink(link) == str(victim)
        assert (victim / "precious").read_text() == "root's"
        logs = "".join((slurm_cluster.state_dir / "nodes" / n / "slurmd.log").read_text()
                       for n in NODES[:2])
        assert f"omni: job_epilog: job {job_id} (uid {alice.uid})" in logs
        assert f"omni-beats-{alice.uid}-{job_id}-node" in logs   # what it left, named (bob's or his link)
    finally:
        runner.run(["scancel", str(job_id)], check=False)
        runner.run(["scontrol", "update", f"nodename={LOST}", "state=RESUME"], check=False)
        for path in planted:
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(SHM / f"omni-beats-{alice.uid}-{job_id}-{LOST}", ignore_errors=True)
        shutil.rmtree(victim, ignore_errors=True)
