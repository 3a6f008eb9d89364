"""On the embedded cluster, the memory tier's peer copies (issue 22): an in-allocation demo job (its
text stage on two nodes: three nodes in the ring) keeps its checkpoints in each node's memory (one
tmpfs folder per node, ``OMNI_MEMORY_DIR=.../%n``: the 8 slurmd share one host) and a replica on its
ring peer. Lost-with-its-peer: two nodes at once, X and the peer P that holds X's replica (set DOWN,
then their standbys, keepers and memory gone; neither is the batch host); the supervisor relaunches
on two spares: X's shards come from the file system (its replica died with P), P's from the third
node's keeper (each text rank reads both: ``peer memory and file system``), the third node's ranks
restore from their own memory; every rank the same step. Lost-alone: X only; every rank restores
from memory, the replacement's shards from their holders' keepers. The loss equals a run that never failed, bitwise, and nothing of the job stays in memory. A few
minutes on 2 shared cores (a 60-step job, a relaunch, the reference run beside it): behind
``OMNI_MEMTIER_CLUSTER=1``, as the memory tier's other cluster test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until

from slurm_omni.checkpoint import peer
from slurm_omni.checkpoint.memtier import job_dir
from slurm_omni.config.site import load_site
from slurm_omni.drill import story
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.formats.metrics import read_folder
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.ownership import current_user
from slurm_omni.policy.replica_ring import decode_ring
from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("OMNI_MEMTIER_CLUSTER") != "1",
                                 reason="OMNI_MEMTIER_CLUSTER=1 runs the memory tier on the cluster (minutes)")]

NAME = "omni-peertier"


def _node_processes(job_id: int, node: str) -> list[int]:
    """The job's processes on ``node``: its standby server, the keeper it forked, the ranks there."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ours = env.get(b"SLURM_JOB_ID") == str(job_id).encode() and env.get(b"SLURMD_NODENAME") == node.encode()
        if ours and b"SLURM_STEP_ID" in env and (b"slurm_omni" in cmdline or b"client.py" in cmdline):
            found.append(int(entry))
    return found


def _lose(runner: CommandRunner, job_id: int, nodes: list[str], shm: Path, downed: list[str]) -> None:
    """The nodes DOWN, then everything of the job on them and their memory gone at once (before the
    supervisor, which polls the nodes every few seconds, can relaunch: a lost node's keeper answers
    nobody)."""
    for node in nodes:
        runner.run(["scontrol", "update", f"nodename={node}", "state=DOWN", "reason=omni-test"])
        downed.append(node)
    for node in nodes:
        for pid in _node_processes(job_id, node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(shm / node, ignore_errors=True)


def _firsts(metrics: Path) -> dict[tuple[int, int], dict[str, Any]]:
    firsts: dict[tuple[int, int], dict[str, Any]] = {}
    for lines in read_folder(metrics).values():   # own files and node files
        for _, line in lines:
            doc = json.loads(line)
            firsts.setdefault((doc["incarnation"], doc["rank"]), doc)
    return firsts


@pytest.fixture
def shm() -> Iterator[Path]:
    """The job's per-node tmpfs folders (``OMNI_MEMORY_DIR=<this>/%n``), removed whatever the outcome."""
    path = Path("/dev/shm") / f"omni-peerdrill-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ring_of_a_rank(job_id: int) -> dict[str, str] | None:
    """``OMNI_MEMTIER_RING`` as a running rank of the job got it from the supervisor."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == str(job_id).encode() and env.get(b"OMNI_MEMTIER_RING"):
            return decode_ring(env[b"OMNI_MEMTIER_RING"].decode())
    return None


@pytest.mark.parametrize("with_holder", [True, False], ids=["lost-with-its-peer", "lost-alone"])
def test_a_lost_node_restores_from_its_peers_memory_or_with_its_peer_from_the_file_system(
        slurm_cluster, tmp_path: Path, shm: Path, with_holder: bool) -> None:
    files = story.DemoFiles(tmp_path / "demo")
    story.write_files(files, slurm_cluster.cluster)
    site = files.site.read_text()
    for key, value in {"use_spank_plugin = true": "use_spank_plugin = false",
                       "default_spares = 1": "default_spares = 2",    # the demo site's stages share one partition
                       "[elasticity]\n": '[elasticity]\nrecovery = "in_allocation"\n',
                       f'memory_dir = "{files.shm}/%n"': f'memory_dir = "{shm}/%n"'}.items():
        assert key in site
        site = site.replace(key, value)
    files.site.write_text(site)
    job = files.job.read_text()
    for key, value in {'name = "omni-demo"': f'name = "{NAME}"', "max_steps = 80": "max_steps = 60",
                       'name = "text"\nnodes = 1': 'name = "text"\nnodes = 2',
                       "every_steps = 10": "every_steps = 5",
                       "memory_every_steps = 1\nfiles_every = 10": "memory_every_steps = 5\nfiles_every = 1"}.items():
        assert key in job
        job = job.replace(key, value)
    files.job.write_text(job)
    story.synthesize(files)
    # every rank's and standby's environment (sbatch passes the submitter's on): one folder per node
    env = {**story.job_environment(slurm_cluster.cluster), "OMNI_STEP_DELAY_S": "0.5",
           "OMNI_MEMORY_DIR": f"{shm}/%n"}
    ckpt = tmp_path / "demo" / "ckpt" / current_user() / NAME
    metrics = load_site(files.site).manager.metrics_for(current_user()) / NAME
    runner = CommandRunner(slurm_cluster.env)
    job_id, downed = 0, list[str]()

    def replicated() -> int | None:
        """The step whose four shards each have a replica recorded (one step for all)."""
        recs = [peer.read_replica(ckpt, rank) for rank in range(4)]
        steps = {r.copies[0].step for r in recs if r is not None and r.copies}
        return steps.pop() if len(steps) == 1 and all(r is not None and r.copies for r in recs) else None

    def placed() -> dict[int, str] | None:
        """rank -> node once all four ranks beat in one incarnation."""
        # the one reader: a rank's own file or its node's (per node by default)
        beats = read_heartbeats(ckpt / "heartbeat") if (ckpt / "heartbeat").is_dir() else []
        if len(beats) != 4 or len({b.incarnation for b in beats}) != 1 or not all(b.node for b in beats):
            return None
        return {b.rank: b.node for b in beats}

    try:
        job_id = story.submit(files, env)
        wait_until(replicated, 300, "a checkpoint replicated to the peers")
        nodes = wait_until(placed, 120, "where the ranks run")
        ring = wait_until(lambda: _ring_of_a_rank(job_id), 60, "the ring a rank got")
        assert sorted(ring) == sorted(set(nodes.values())), (ring, nodes)
        batch_host = runner.run(["scontrol", "show", "job", str(job_id)]).stdout.split("BatchHost=")[1].split()[0]
        lost = next(x for x in sorted(ring) if batch_host not in (x, ring[x]))
        holder = ring[lost]                       # lost together with the replica it keeps of ``lost``
        assert ring[holder] == batch_host         # ``holder``'s own replica survives on the third node
        _lose(runner, job_id, [lost, holder] if with_holder else [lost], shm, downed)
        reference = start_reference(files.job, files.reference)
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 600,
                   "the job to finish")
        ref_metrics = finish_reference(reference, files.reference, 300)
    finally:
        if job_id:
            runner.run(["scancel", str(job_id)], check=False)
        for node in downed:
            runner.run(["scontrol", "update", f"nodename={node}", "state=RESUME"], check=False)
    firsts = _firsts(metrics)
    lives = sorted({life for life, _ in firsts})
    assert len(lives) == 2, lives
    source = {rank: doc.get("restore_source") for (life, rank), doc in firsts.items() if life == lives[1]}
    # each rank reads every shard of its stage (its data-parallel peers' too): the ranks of a stage that
    # ran on the lost nodes read the lost holder's shard from the file system and the other from the
    # third node's keeper; the third node's ranks only their own memory
    stage = {rank for rank, node in nodes.items() if node != batch_host}   # the text ranks, each reading both
    if with_holder:
        # the lost nodes' ranks read the lost holder's shard from the file system, the other from the
        # third node's keeper; the third node's ranks only their own memory
        want = {rank: "peer memory and file system" if rank in stage else "memory" for rank in nodes}
        logs = "\n".join(p.read_text(errors="replace") for p in [*files.work.rglob("*.log"),
                                                                   *files.work.rglob("*.out")])
        lost_shards = sorted(f"rank-{rank:05d}" for rank, node in nodes.items() if node == lost)
        assert all(f"couldn't fetch {shard} of step-" in logs and f"from {holder}" in logs
                   for shard in lost_shards), [line for line in logs.splitlines() if "fetch" in line][:5]
    else:
        # one node lost: every shard from memory, the lost node's from its holder, the survivor's own
        # from its node (the replacement asks the holder, else the node that wrote it)
        want = {rank: "peer memory" if rank in stage else "memory" for rank in nodes}
    assert source == want, (source, nodes, ring)
    eq = story.compare(files, metrics, ref_metrics)
    assert eq.ok, eq.problems
    assert eq.loss.mode == "bitwise" and eq.loss.steps_compared == 60
    wait_until(lambda: not any(job_dir(shm / n, str(job_id)).exists() for n in os.listdir(shm)) or None, 60,
               "the job's memory freed on every node")
