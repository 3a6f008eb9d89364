"""Heartbeats at scale (issue 19, "fix what grows badly"): the control plane's CPU per poll at 2,048
ranks, and the heartbeat folder's file-system operations per second in steady state per ranks per node.

    python bench/heartbeat_bench.py                  # about 3 minutes; not in the default CI run
    python bench/heartbeat_bench.py --ranks 2048 --ranks-per-node 1,2,4,8 --window 8

1. **CPU per poll** (synthetic folders, 4 ranks per node): one poll of the manager's reader
   (``manager.sources.read_job_heartbeats`` with the watch's ``HeartbeatScanner``: the folder opened
   and checked, listed, each file stat'ed, the changed ones read and decoded; the step supervisor's
   ``LaunchObserver`` runs the same scanner without the folder check) over the per-rank layout
   (``rank-*.json``, every rank writing its own file: no ``OMNI_HEARTBEAT_NODE_DIR``) and the per-node
   layout (``node-*.json``). Three polls each: **cold** (a new scanner: every file read), **steady**
   (between two polls the files a 0.5 s poll sees change in steady state were rewritten: half of the
   per-rank files at a 1 s interval, every node file, published twice per interval) and **idle**
   (nothing changed: list and stat only). CPU is the process's (``time.process_time``), the median
   of 5, printed as the ratio to the issue's bar of 50 ms per poll at 2,048 ranks.
2. **File-system operations per second** in the heartbeat folder in steady state: real light ranks
   (``bench/light_rank.py``, 2 nodes named on one machine, a 1 s heartbeat interval, 0.5 s steps) for
   each ranks-per-node count, with and without ``OMNI_HEARTBEAT_NODE_DIR`` (a node-local folder
   here, ``/dev/shm`` on a real node). The writers' operations are counted by inotify on the folder
   (create, write, rename, unlink: every process's, nothing assumed); the reader's are the
   scanner's own count (listdir, stat, open) of a 0.5 s poll over the same window. Per node, they
   must not grow with the ranks per node. The same windows count the job's other folders: the
   checkpoint folder and the metrics folder, whose lines go per node with the heartbeats by default
   (the node's leader appends its ranks' new lines to ``node-<NODE>.jsonl`` once per interval,
   ``elastic/node_metrics.py``) and per rank without a node folder. Per node, the node files are
   counted per node that copies (at 1 rank per node, the node of the loss-reporting rank has none:
   that rank writes its own file) and the ranks' own files per job (the loss-reporting rank's line a
   step, whatever the ranks per node).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import HeartbeatRecord, NodeHeader, node_file_name
from slurm_omni.fsio import write_atomic
from slurm_omni.manager.events import HeartbeatScanner
from slurm_omni.manager.sources import read_job_heartbeats
from slurm_omni.supervisor.ports import pick

BAR_S = 0.050
"""The issue's bar: the control plane's CPU per poll at 2,048 ranks."""
LIGHT_RANK = REPO / "bench" / "light_rank.py"
JOB = 7


# -- 1. CPU per poll -----------------------------------------------------------------------------

def _beat(rank: int, now: float, per_node: int) -> HeartbeatRecord:
    return HeartbeatRecord(rank=rank, stage=0, dp_rank=rank, pid=1000 + rank, incarnation=1, job_id=str(JOB),
                           step=17, phase="training", time=now, step_time_s=0.5, compute_s=0.4, data_s=0.01,
                           last_checkpoint_step=15, beats=9, node=f"node{rank // per_node + 1}",
                           metrics={"loss": 2.31, "samples": 8})


def _write_layout(folder: Path, per_node: int, layout: str, stamps: list[float], files: range) -> None:
    """Write ``files`` (rank numbers, or node numbers) with each rank's beat as of ``stamps[rank]``: a
    rank whose stamp did not change writes the same bytes again (a node file's unchanged line)."""
    if layout == "per-rank":
        for r in files:
            write_atomic(folder / f"rank-{r}.json", encode(_beat(r, stamps[r], per_node)), durable=False)
        return
    for n in files:
        node = f"node{n + 1}"
        beats = [encode(_beat(r, stamps[r], per_node)) for r in range(n * per_node, (n + 1) * per_node)]
        write_atomic(folder / node_file_name(node), b"".join([encode(NodeHeader(node=node, time=time.time())), *beats]),
                     durable=False)


def poll_cpu(work: Path, ranks: int, per_node: int, layout: str) -> dict[str, float]:
    """Median CPU seconds of the manager's poll: cold, steady and idle (module doc)."""
    folder = work / f"poll-{layout}-{ranks}"
    folder.mkdir(mode=0o700)
    stamps = [time.time()] * ranks
    nodes = ranks // per_node
    _write_layout(folder, per_node, layout, stamps, range(ranks if layout == "per-rank" else nodes))
    out: dict[str, list[float]] = {"cold": [], "steady": [], "idle": []}
    for run in range(5):
        scanner = HeartbeatScanner()
        for kind in ("cold", "steady", "idle"):
            if kind == "steady":
                # half the ranks beat since the last poll (a 0.5 s poll, a 1 s interval): their own
                # files change, and every node file (its leader publishes twice per interval)
                half = range(run % 2, ranks, 2)
                for r in half:
                    stamps[r] += 1.0
                _write_layout(folder, per_node, layout, stamps, half if layout == "per-rank" else range(nodes))
            c0 = time.process_time()
            beats = read_job_heartbeats(folder, JOB, scanner)
            out[kind].append(time.process_time() - c0)
            if len(beats) != ranks:
                raise SystemExit(f"heartbeat bench: {layout} poll read {len(beats)} beats, expected {ranks}")
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    return {k: sorted(v)[len(v) // 2] for k, v in out.items()}


# -- 2. file-system operations -----------------------------------------------------------------------

IN_MODIFY, IN_MOVED_TO, IN_CREATE, IN_DELETE, IN_Q_OVERFLOW = 0x2, 0x80, 0x100, 0x200, 0x4000
WRITE_OPS = {IN_CREATE: "create", IN_MODIFY: "write", IN_MOVED_TO: "rename", IN_DELETE: "unlink"}


class Inotify:
    """Counts the write-side operations in folders (every process's), through libc's inotify; per
    area (``add``) and operation."""

    def __init__(self, folder: Path | None = None) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise SystemExit(f"heartbeat bench: couldn't start inotify: {os.strerror(ctypes.get_errno())}")
        self.area: dict[int, str] = {}
        self.split: dict[int, dict[str, str]] = {}
        self.names: dict[str, set[str]] = {}
        self.counts = dict.fromkeys(WRITE_OPS.values(), 0)
        self.by_area: dict[str, dict[str, int]] = {}
        self.overflow = False
        if folder is not None:
            self.add(folder, "heartbeat")

    def add(self, folder: Path, area: str, split: dict[str, str] | None = None) -> None:
        """Count the folder's operations as ``area``; those on a name that starts with a key of
        ``split`` as that key's area (the names written are kept per area: ``names``)."""
        wd = self.libc.inotify_add_watch(self.fd, str(folder).encode(), sum(WRITE_OPS))
        if wd < 0:
            raise SystemExit(f"heartbeat bench: couldn't watch {folder}: {os.strerror(ctypes.get_errno())}")
        self.area[wd] = area
        self.split[wd] = dict(split or {})
        for a in (area, *self.split[wd].values()):
            self.by_area.setdefault(a, dict.fromkeys(WRITE_OPS.values(), 0))
            self.names.setdefault(a, set())

    def drain(self) -> None:
        while True:
            try:
                buf = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return
            at = 0
            while at < len(buf):
                wd, mask, _cookie, size = struct.unpack_from("iIII", buf, at)
                name = buf[at + 16:at + 16 + size].split(b"\0", 1)[0].decode(errors="replace")
                at += 16 + size
                self.overflow |= bool(mask & IN_Q_OVERFLOW)
                where = self.area.get(wd, "")
                where = next((a for prefix, a in self.split.get(wd, {}).items() if name.startswith(prefix)), where)
                area = self.by_area.get(where)
                if area is not None and name:
                    self.names[where].add(name)
                for bit, name in WRITE_OPS.items():
                    if mask & bit:
                        self.counts[name] += 1
                        if area is not None:
                            area[name] += 1

    def reset(self) -> None:
        self.drain()
        self.counts = dict.fromkeys(self.counts, 0)
        self.by_area = {k: dict.fromkeys(v, 0) for k, v in self.by_area.items()}
        self.names = {k: set() for k in self.names}

    def close(self) -> None:
        os.close(self.fd)


AREAS = ("heartbeat", "checkpoint", "metrics", "own lines")
"""The folders counted: the heartbeat folder and the rest of the checkpoint folder (the ranks'
checkpoint markers, ``light/rank-N/``), and the metrics folder (the site's, often the same file
system): its node files (``metrics``) apart from the ranks' own ``metrics-*.jsonl`` (``own lines``:
every rank's per rank; per node, the loss-reporting rank's, one file per job written every step, and
what a rank's end leaves)."""


def fs_ops(work: Path, per_node: int, nodes: int, aggregate: bool, window: float, warmup: float,
           ckpt_every: int = 100000) -> dict[str, float]:
    """Operations per second in the job's folders of ``nodes`` x ``per_node`` light ranks: the
    heartbeat folder's (``write_ops_s``, the reader's ``read_ops_s``) and, per area (``AREAS``),
    ``<area>_meta_s`` (create, rename, unlink: the metadata server's) and ``<area>_data_s`` (writes)."""
    run = work / f"ops-{per_node}-{'node' if aggregate else 'rank'}"
    hb, shm, ckpt, metrics = run / "hb", run / "shm", run / "ckpt", run / "metrics"
    world = nodes * per_node
    for d in (run, hb, shm, ckpt, metrics, ckpt / "light", *(ckpt / "light" / f"rank-{r}" for r in range(world))):
        d.mkdir(mode=0o700)
    port, _ = pick(range(43000, 43200))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_"))}
    procs = []
    for r in range(world):
        env = {**base, "RANK": str(r), "WORLD_SIZE": str(world), "OMNI_DP_SIZE": str(world), "OMNI_DP_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMNI_CKPT_DIR": str(run / "ckpt"),
               "OMNI_HEARTBEAT_DIR": str(hb), "OMNI_METRICS_DIR": str(run / "metrics"), "OMNI_JOB_ID": str(JOB),
               "OMNI_INCARNATION": "0", "OMNI_HEARTBEAT_INTERVAL": "1", "OMNI_STEP_DELAY_S": "0.5",
               "OMNI_MAX_STEPS": "100000", "OMNI_LIGHT_CKPT_EVERY": str(ckpt_every), "OMNI_COLLECTIVE_TIMEOUT": "60",
               "SLURMD_NODENAME": f"node{r // per_node + 1}",
               # per node is the ranks' default (/dev/shm), the metrics lines' with it
               # (formats.metrics.per_node_setting); here a folder of the bench's own, or off
               "OMNI_HEARTBEAT_NODE_DIR": str(shm) if aggregate else "off"}
        procs.append(subprocess.Popen([sys.executable, "-S", str(LIGHT_RANK)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    watch = Inotify(hb)
    watch.add(ckpt, "checkpoint")
    watch.add(ckpt / "light", "checkpoint")
    for r in range(world):
        watch.add(ckpt / "light" / f"rank-{r}", "checkpoint")
    watch.add(metrics, "metrics", split={"metrics-": "own lines"})
    scanner = HeartbeatScanner()
    reads = {"listdir": 0, "stat": 0, "open": 0}
    try:
        deadline = time.monotonic() + 60
        while len([b for b in scanner.scan(hb) if b.phase == "training"]) < world:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"heartbeat bench: {world} light ranks did not all start training within 60 s")
            time.sleep(0.2)
        time.sleep(warmup)
        watch.reset()
        start = time.monotonic()
        while (left := start + window - time.monotonic()) > 0:
            watch.drain()
            scanner.scan(hb)
            for k, v in scanner.stats.items():
                reads[k] += v
            time.sleep(min(0.5, left))
        watch.drain()
        took = time.monotonic() - start
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        watch.close()
    if watch.overflow:
        raise SystemExit("heartbeat bench: the inotify queue overflowed: the counts would be low")
    writes = sum(watch.by_area["heartbeat"].values())
    per_area = {}
    for area, counts in watch.by_area.items():
        per_area[f"{area}_meta_s"] = sum(v for k, v in counts.items() if k != "write") / took
        per_area[f"{area}_data_s"] = counts["write"] / took
    return {"write_ops_s": writes / took, "read_ops_s": sum(reads.values()) / took, **per_area,
            "node_files": float(len(watch.names["metrics"])),
            **{f"{k}_s": v / took for k, v in watch.by_area["heartbeat"].items()},
            **{f"{k}_s": v / took for k, v in reads.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", type=int, default=2048, help="ranks for the CPU per poll (4 per node)")
    ap.add_argument("--ranks-per-node", default="1,2,4,8", help="ranks per node for the operations per second")
    ap.add_argument("--nodes", type=int, default=2, help="nodes for the operations per second")
    ap.add_argument("--window", type=float, default=8.0, help="seconds of steady state counted per run")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after every rank trains, before counting")
    ap.add_argument("--ckpt-every", type=int, default=100000, help="the light ranks' checkpoint every this many "
                    "steps (default: none in the window: steady state between checkpoints)")
    ap.add_argument("--no-poll", action="store_true", help="skip the CPU per poll (part 1)")
    args = ap.parse_args(argv)
    per_node_counts = [int(x) for x in args.ranks_per_node.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="omni-hb-bench-") as tmp:
        work = Path(tmp)
        print(f"CPU per poll of the manager's heartbeat reader at {args.ranks} ranks (4 per node; median of 5; "
              f"bar {1000 * BAR_S:.0f} ms)")
        print(f"  {'layout':<10} {'files':>6} {'cold':>9} {'steady':>9} {'idle':>9} {'steady/bar':>11}")
        for layout in () if args.no_poll else ("per-rank", "per-node"):
            cpu = poll_cpu(work, args.ranks, 4, layout)
            files = args.ranks if layout == "per-rank" else args.ranks // 4
            print(f"  {layout:<10} {files:>6} " + " ".join(f"{1000 * cpu[k]:>7.1f}ms" for k in ("cold", "steady", "idle"))
                  + f" {cpu['steady'] / BAR_S:>10.2f}x")
        print(f"\nheartbeat folder operations per second in steady state ({args.nodes} nodes, 1 s interval, "
              f"light ranks; writers by inotify, the reader's 0.5 s poll by its own count)")
        print(f"  {'mode':<9} {'ranks/node':>10} {'ranks':>6} {'write ops/s':>12} {'per node':>9} "
              f"{'read ops/s':>11} {'per node':>9}  writes (create/write/rename/unlink per s)")
        growth = []
        others: list[tuple[str, int, dict[str, float]]] = []
        for aggregate in (False, True):
            totals = []
            for per_node in per_node_counts:
                ops = fs_ops(work, per_node, args.nodes, aggregate, args.window, args.warmup, args.ckpt_every)
                others.append(("per-node" if aggregate else "per-rank", per_node, ops))
                totals.append((ops["write_ops_s"] + ops["read_ops_s"]) / args.nodes)
                detail = "/".join(f"{ops[f'{k}_s']:.1f}" for k in WRITE_OPS.values())
                print(f"  {'per-node' if aggregate else 'per-rank':<9} {per_node:>10} {per_node * args.nodes:>6} "
                      f"{ops['write_ops_s']:>12.1f} {ops['write_ops_s'] / args.nodes:>9.1f} "
                      f"{ops['read_ops_s']:>11.1f} {ops['read_ops_s'] / args.nodes:>9.1f}  {detail}", flush=True)
            if len(totals) > 1:
                growth.append(f"{'per-node' if aggregate else 'per-rank'} files: x{totals[-1] / totals[0]:.2f} "
                              f"({totals[0]:.1f} -> {totals[-1]:.1f} ops/s per node)")
        if growth:
            print(f"  growth of the operations per node, {per_node_counts[0]} -> {per_node_counts[-1]} ranks per node "
                  f"(1: flat): " + "; ".join(growth))
        ckpt = ("none in the window (steady state between checkpoints)" if args.ckpt_every >= 100000
                else f"every {args.ckpt_every} steps")
        print(f"\nthe job's other folders, operations per second per node in the same windows (inotify; metadata: "
              f"create, rename, unlink; data: writes; checkpoints {ckpt})")
        print(f"  {'mode':<9} {'ranks/node':>10} " + " ".join(f"{a + ' meta':>15} {a + ' data':>15}" for a in AREAS[1:]))
        for mode, per_node, ops in others:
            print(f"  {mode:<9} {per_node:>10} " + " ".join(
                f"{ops[a + '_meta_s'] / args.nodes:>15.2f} {ops[a + '_data_s'] / args.nodes:>15.2f}" for a in AREAS[1:]))
        for mode in ("per-rank", "per-node"):
            rows = [ops for m, _, ops in others if m == mode]
            if len(rows) > 1:
                print(f"  {mode}: {per_node_counts[0]} -> {per_node_counts[-1]} ranks per node: " + "; ".join(
                    f"{a} {k} {rows[0][f'{a}_{k}_s'] / args.nodes:.2f} -> {rows[-1][f'{a}_{k}_s'] / args.nodes:.2f}"
                    for a in AREAS[1:] for k in ("meta", "data")))
        metrics_growth = []
        for mode in ("per-rank", "per-node"):
            rows = [ops for m, _, ops in others if m == mode]
            if len(rows) < 2:
                continue
            ends = (rows[0], rows[-1])
            total = [sum(o[f"{a}_{k}_s"] for a in AREAS[2:] for k in ("meta", "data")) / args.nodes for o in ends]
            node = [(o["metrics_meta_s"] + o["metrics_data_s"]) / max(1.0, o["node_files"]) for o in ends]
            own = [o["own lines_meta_s"] + o["own lines_data_s"] for o in ends]
            parts = [f"all per node {_times(total)}"]
            if mode == "per-node":
                files = f"{ends[0]['node_files']:.0f} -> {ends[1]['node_files']:.0f} node files written"
                parts = [f"the node files per node that copies {_times(node)} ({files})",
                         f"the ranks' own files per job {_times(own)} (the loss-reporting rank's, a line a step)",
                         *parts]
            metrics_growth.append(f"{mode}: " + ", ".join(parts))
        if metrics_growth:
            print(f"  growth of the metrics folder's operations, {per_node_counts[0]} -> {per_node_counts[-1]} ranks "
                  "per node (1: flat; per node, the node's heartbeat leader copies its ranks' lines once per "
                  "interval): " + "; ".join(metrics_growth))
    return 0


def _times(pair: list[float]) -> str:
    """``x<ratio> (<first> -> <last>)`` of two rates (``x-`` when the first is 0)."""
    ratio = f"x{pair[1] / pair[0]:.2f}" if pair[0] > 0 else "x-"
    return f"{ratio} ({pair[0]:.2f} -> {pair[1]:.2f} ops/s)"


if __name__ == "__main__":
    sys.exit(main())
