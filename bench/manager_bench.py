"""The manager at 10,000 nodes: parsing ``sinfo --json``, one tick of the loop, memory.

    .venv/bin/python bench/manager_bench.py [--nodes 10000] [--repeat 5] [--jobs 20]

The ``sinfo --json`` document is the recorded real one (tests/fixtures/slurm-22.05/sinfo_idle.json)
with its node records cloned to ``--nodes`` names under a three-level fat tree (core -> 25
aggregation -> 16 leaves each -> 25 nodes each), 70 % allocated and 1 % down. Printed: the median
parse time without and with the switch tree (the backend attaches each node's switch path) against
the 1 s limit as a ratio; one manager tick (poll + spool + heartbeats + verdicts for ``--jobs``
registered jobs of 2 x 4 ranks) on that snapshot; and memory: tracemalloc of the parsed snapshot
and of the manager after the ticks, and the process RSS.
"""

from __future__ import annotations

import argparse
import copy
import gc
import getpass
import hashlib
import json
import random
import resource
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from slurm_omni.config.site import load_site
from slurm_omni.manager.daemon import Manager, ManagerConfig
from slurm_omni.render.registry import RegistryRecord, register, registered_stages
from slurm_omni.render.request import StagePlan
from slurm_omni.slurm.backend import ClusterSnapshot
from slurm_omni.slurm.parse_json import parse_sinfo_json
from slurm_omni.slurm.types import HetComponent, Job, JobState, Node, Switch, Topology

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "slurm-22.05" / "sinfo_idle.json"
LIMIT_S = 1.0

SITE = """
[stages.vision]
partition = "vision"
gres = "gpu:h100:4"
[stages.text]
partition = "text"
gres = "gpu:h100:4"
[checkpoint]
root = "{root}/ckpt"
[manager]
spool_dir = "{root}/spool"
registry_dir = "{root}/registry"
metrics_dir = "{root}/metrics"
"""


def fat_tree(nodes: int, per_leaf: int = 25, leaves_per_agg: int = 16) -> tuple[Topology, list[str]]:
    names = [f"n{i:05d}" for i in range(nodes)]
    switches: dict[str, Switch] = {}
    leaves = []
    for i in range(0, nodes, per_leaf):
        leaf = f"leaf{i // per_leaf:04d}"
        switches[leaf] = Switch(leaf, 0, nodes=tuple(names[i:i + per_leaf]))
        leaves.append(leaf)
    aggs = []
    for i in range(0, len(leaves), leaves_per_agg):
        agg = f"agg{i // leaves_per_agg:03d}"
        switches[agg] = Switch(agg, 1, switches=tuple(leaves[i:i + leaves_per_agg]))
        aggs.append(agg)
    switches["core"] = Switch("core", 2, switches=tuple(aggs))
    return Topology(switches), names


def synthetic_sinfo(names: list[str], seed: int = 0) -> str:
    """The recorded document with its first node record cloned under every name."""
    doc = json.loads(FIXTURE.read_text())
    template = doc["nodes"][0]
    rng = random.Random(seed)
    nodes = []
    for name in names:
        record = copy.copy(template)
        record["name"] = record["hostname"] = name
        roll = rng.random()
        record["state"] = "down" if roll < 0.01 else "allocated" if roll < 0.71 else "idle"
        record["reason"] = "bench" if roll < 0.01 else ""
        nodes.append(record)
    doc["nodes"] = nodes
    return json.dumps(doc)


def median_time(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class SnapshotBackend:
    """Serves one prepared snapshot; counts polls (the manager must not query per job)."""

    name = "bench"

    def __init__(self, snap: ClusterSnapshot) -> None:
        self.snap = snap
        self.polls = 0

    def snapshot(self, *, user: str | None = None) -> ClusterSnapshot:
        self.polls += 1
        return ClusterSnapshot(self.snap.nodes, self.snap.jobs, self.snap.topology, time.time())

    def jobs(self, *, user: str | None = None) -> list[Job]:
        return list(self.snap.jobs)


def manager_setup(root: Path, nodes: list[Node], topology: Topology, jobs: int) -> tuple[Manager, SnapshotBackend]:
    for sub in ("spool", "registry"):
        (root / sub).mkdir(mode=0o700, parents=True)
    (root / "site.toml").write_text(SITE.format(root=root))
    job_file = root / "job.toml"
    job_file.write_text('[job]\nname = "bench"\ndata_parallel_size = 4\n[[stages]]\nname = "vision"\nnodes = 4\n'
                        '[[stages]]\nname = "text"\nnodes = 4\n[training.data]\nshard_dir = "shards"\n')
    digest = hashlib.sha256(job_file.read_bytes()).hexdigest()
    allocated = [n.name for n in nodes if n.state.value == "allocated"]
    user = getpass.getuser()
    slurm_jobs = []
    now = time.time()
    for j in range(jobs):
        job_id = 1000 + 10 * j
        vision, text = allocated[8 * j:8 * j + 4], allocated[8 * j + 4:8 * j + 8]
        stages = tuple(StagePlan(i, s, s, 4, 1, "gpu:h100:4", 1, "10:00", 0) for i, s in enumerate(("vision", "text")))
        register(root / "registry", RegistryRecord(
            job_id=job_id, kind="het", name=f"bench{j}", cluster="omni", job_file=job_file, job_sha256=digest,
            script=None, ckpt_dir=root / "ckpt" / f"bench{j}", data_parallel_size=4, max_requeues=3, stages=registered_stages(stages)))
        hb = root / "ckpt" / f"bench{j}" / "heartbeat"
        hb.mkdir(mode=0o700, parents=True)
        for rank in range(8):
            (hb / f"rank-{rank}.json").write_text(json.dumps({
                "rank": rank, "stage": rank // 4, "dp_rank": rank % 4, "pid": 1, "incarnation": 0,
                "job_id": str(job_id), "step": 10, "phase": "training", "time": now, "step_time_s": 0.5,
                "last_checkpoint_step": 5, "beats": 3}))
        comps = (HetComponent(job_id, job_id, 0, JobState.RUNNING, tuple(vision)),
                 HetComponent(job_id + 1, job_id, 1, JobState.RUNNING, tuple(text)))
        slurm_jobs.append(Job(job_id, f"bench{j}", user, JobState.RUNNING, "RUNNING", comps))
    backend = SnapshotBackend(ClusterSnapshot(tuple(nodes), tuple(slurm_jobs), topology, time.time()))
    config = ManagerConfig(site=load_site(root / "site.toml"), state_dir=root / "state", poll_interval_s=0.0)
    return Manager(config, backend), backend  # type: ignore[arg-type]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=20)
    args = ap.parse_args()

    topology, names = fat_tree(args.nodes)
    text = synthetic_sinfo(names)
    rss0 = rss_mib()
    bare = median_time(lambda: parse_sinfo_json(text), args.repeat)
    # a fresh tree each time: the first parse after a topology read pays for the node -> path map
    cold = median_time(lambda: parse_sinfo_json(text, Topology(topology.switches)), args.repeat)
    print(f"sinfo --json of {args.nodes} nodes ({len(text) / 2**20:.1f} MiB), median of {args.repeat}:")
    print(f"  parse                 {bare * 1e3:8.1f} ms  = {bare / LIMIT_S:.3f} x the 1 s limit")
    print(f"  parse + switch paths  {cold * 1e3:8.1f} ms  = {cold / LIMIT_S:.3f} x the 1 s limit "
          f"({'within' if cold <= LIMIT_S else 'OVER'})")

    gc.collect()
    tracemalloc.start()
    nodes = parse_sinfo_json(text, topology)
    parsed_mib = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        m, backend = manager_setup(Path(tmp), nodes, topology, args.jobs)
        tracemalloc.start()
        m.tick()                      # first tick: registry, watches, journal rows
        ticks = [median_time(m.tick, args.repeat)]
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"manager tick over {args.nodes} nodes and {args.jobs} jobs x 8 ranks: {ticks[0] * 1e3:.1f} ms "
              f"(polls {backend.polls} for {1 + args.repeat} ticks: one per tick, not per job)")
        print(f"memory: parsed nodes {parsed_mib:.1f} MiB (tracemalloc); manager after ticks {current / 2**20:.1f} MiB, "
              f"peak {peak / 2**20:.1f} MiB (tracemalloc, snapshot shared); process RSS {rss_mib():.0f} MiB "
              f"({rss_mib() - rss0:+.0f} MiB since start)")
        m.close()


if __name__ == "__main__":
    main()
