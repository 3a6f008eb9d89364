"""Fail-slow on the embedded cluster: detection time, throughput before/during/after a migration, and
false migrations, against a healthy run measured in the same invocation.

A two-stage job with two replicas (one rank per node: vision on two nodes, text on two) trains under
the manager with the site's ``[failslow]`` table. Runs:

1. healthy: no fault; its median global throughput (global batch / step time, from the ranks'
   metrics) is the reference;
2. per factor F (1.3, 1.5, 2): ``omni drill slow-node`` makes one vision node F times slower; the
   detection time is from the drill's start to the manager's journaled ``failslow`` warning of that
   node; the throughput is measured before the drill, during it (until the migration) and after the
   migrated incarnation trains again, and so is, in the same seconds, the throughput of the same job
   file running healthy beside it on this machine (the local launcher, never drilled): on a machine
   shared with other jobs the load moves both alike, so "after / healthy beside it" is the figure of
   the goal (>= 0.9), "after / healthy run alone" is printed too;
3. ``--normal-runs`` runs without a fault, half of them under competing CPU load (two busy loops):
   any planned migration in them is a false one.

Printed: the figures per run, then the medians, the ratio of throughput after the migration to the
healthy run last. ``--record DIR`` also writes every run's heartbeat series (JSON lines), which is
how ``tests/fixtures/heartbeats/`` was made.

Usage:  .venv/bin/python bench/failslow_bench.py --quick      (one factor, 1.5, and 2 normal runs)
        .venv/bin/python bench/failslow_bench.py --parallel 2 (1.3, 1.5, 2 and 10 normal runs, two at
                                                               once; about 30 minutes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slurm_omni.errors import OmniError
from slurm_omni.formats.metrics import read_folder
from slurm_omni.manager.events import read_heartbeats

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 8
DETECT_TIMEOUT_S = 150.0   # a slowed node not flagged by then counts as not found
BIN = Path(sys.executable).parent

SITE = """
cluster = "omni"
[stages.vision]
partition = "vision"
gres = "gpu:h100:4"
[stages.text]
partition = "text"
gres = "gpu:h100:4"
[checkpoint]
root = "{tmp}/ckpt"
[elasticity]
spare_policy = "any_switch"
quarantine_s = 3600
[failslow]
{failslow}
[drills]
allowed_nodes = "node[1-8]"
[manager]
spool_dir = "{spool}"
registry_dir = "{tmp}/registry"
metrics_dir = "{tmp}/metrics"
"""

JOB = """
[job]
name = "{name}"
data_parallel_size = 2
time_limit = "00:20:00"
signal_before_s = 60
max_requeues = 3
log_dir = "{tmp}/logs"
[[stages]]
name = "vision"
nodes = 2
switches = 2
[[stages]]
name = "text"
nodes = 2
switches = 2
[training]
max_steps = {max_steps}
log_every = 1
[training.model]
preset = "tiny"
vision_width = 96
vision_depth = 3
text_width = 96
text_depth = 3
[training.parallel]
global_batch_size = 8
micro_batch_size = 2
[training.data]
shard_dir = "{shards}"
[training.checkpoint]
every_steps = 50
keep_last = 2
"""


def cluster() -> tuple[dict[str, str], Path]:
    from slurm_omni.cluster.local import LocalCluster

    lc = LocalCluster(Path(os.environ.get("OMNI_CLUSTER_DIR", REPO / ".omni" / "cluster")))
    lc.up(wait_s=120)
    env = {**os.environ, **lc.env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(BIN.parent)}
    return env, lc.paths.spool


@dataclass
class Run:
    """One job under its own manager, with a heartbeat recorder."""

    tmp: Path
    env: dict[str, str]
    name: str
    job_env: dict[str, str] = field(default_factory=dict)
    job_id: int = 0
    manager: subprocess.Popen[bytes] | None = None
    series: list[dict[str, Any]] = field(default_factory=list)
    _seen: set[tuple[str, int, int]] = field(default_factory=set)
    last_step: dict[str, int] = field(default_factory=dict)   # Slurm job -> the highest step any beat showed
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def heartbeat_dir(self) -> Path:
        """``<root>/<user>/<job>/heartbeat`` (per-user checkpoint folders), or ``<root>/<job>/heartbeat``."""
        found = sorted((self.tmp / "ckpt").glob(f"*/{self.name}/heartbeat"))
        return found[0] if found else self.tmp / "ckpt" / self.name / "heartbeat"

    @property
    def journal(self) -> Path:
        return self.tmp / "state" / "journal.sqlite"

    def start(self, max_steps: int, failslow: str, spool: Path) -> None:
        from slurm_omni.runtime.synth import SynthSpec, write_shards

        write_shards(SynthSpec(out_dir=self.tmp / "shards", pairs=32, text=16, shard_size=16))
        (self.tmp / "site.toml").write_text(SITE.format(tmp=self.tmp, spool=spool, failslow=failslow))
        (self.tmp / "job.toml").write_text(JOB.format(name=self.name, tmp=self.tmp, shards=self.tmp / "shards",
                                                      max_steps=max_steps))
        log = open(self.tmp / "manager.log", "wb")   # noqa: SIM115 (closed with the process)
        self.manager = subprocess.Popen(
            [sys.executable, "-m", "slurm_omni.cli.main", "-v", "manager", "run", "--site-config",
             str(self.tmp / "site.toml"), "--state-dir", str(self.tmp / "state"), "--poll-interval", "1",
             "--tick", "0.25"], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        env = {**self.env, "OMP_NUM_THREADS": "1", **self.job_env}
        out = subprocess.run([str(BIN / "omni"), "submit", str(self.tmp / "job.toml"), "--site",
                              str(self.tmp / "site.toml")], env=env, capture_output=True, text=True,
                             timeout=60, check=True).stdout
        self.job_id = int(out.split("submitted job ")[1].split()[0])
        threading.Thread(target=self._record, daemon=True).start()

    def _record(self) -> None:
        while not self._stop.is_set():
            for hb in self.beats():
                key = (str(hb.get("job_id")), int(hb.get("rank", -1)), int(hb.get("step", -1)))
                self.last_step[key[0]] = max(self.last_step.get(key[0], -1), key[2])
                if hb.get("phase") == "training" and hb.get("compute_s") is not None and key not in self._seen:
                    self._seen.add(key)
                    self.series.append(hb)
            self._stop.wait(0.2)

    def beats(self) -> list[dict[str, Any]]:
        """Every rank's newest beat through the package's one reader (its own file or its node's)."""
        if not self.heartbeat_dir.is_dir():
            return []
        return [msgspec.structs.asdict(b) for b in read_heartbeats(self.heartbeat_dir)]

    def live_job(self) -> str | None:
        """The Slurm job id whose ranks beat most recently."""
        beats = [b for b in self.beats() if b.get("phase") in ("training", "checkpointing")]
        return max(beats, key=lambda b: b["time"])["job_id"] if beats else None

    def step(self) -> int:
        return max((b["step"] for b in self.beats()), default=-1)

    def done(self) -> bool:
        beats = self.beats()
        return bool(beats) and all(b["phase"] == "done" for b in beats if b["job_id"] == self.live_job_any())

    def live_job_any(self) -> str | None:
        beats = self.beats()
        return max(beats, key=lambda b: b["time"])["job_id"] if beats else None

    def rows(self, query: str, *args: object) -> list[tuple[Any, ...]]:
        if not self.journal.exists():
            return []
        con = sqlite3.connect(f"file:{self.journal}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute(query, args).fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            con.close()

    def failslow_decisions(self) -> list[tuple[float, str, dict[str, Any]]]:
        rows = self.rows("SELECT time, cause, payload FROM decisions WHERE verdict = 'failslow' ORDER BY id")
        return [(float(t), str(c), json.loads(p)) for t, c, p in rows]

    def migrations(self) -> list[tuple[float, str]]:
        return [(t, c) for t, c, _ in self.failslow_decisions() if c in ("replace", "shrink")]

    def throughput(self, t0: float, t1: float) -> float | None:
        """Global samples per second between t0 and t1: steps completed (max over ranks) over time."""
        pts = sorted((hb["time"], hb["step"]) for hb in self.series if t0 <= hb["time"] <= t1 and hb["rank"] == 0)
        if len(pts) < 3:
            return None
        # heartbeats come every interval, not every step: steps done over the time between beats
        rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(pts) if b[0] > a[0] and b[1] >= a[1]]
        return GLOBAL_BATCH * statistics.median(rates) if rates else None

    def close(self) -> None:
        self._stop.set()
        from slurm_omni.slurm.runner import CommandRunner

        runner = CommandRunner(self.env, timeout_s=20)
        for job in {self.job_id, *(int(b["job_id"]) for b in self.beats())}:
            try:
                runner.run(["scancel", str(job)])
            except OmniError as e:   # best effort at the end of a run
                print(f"  (scancel {job}: {e})")
        if self.manager is not None and self.manager.poll() is None:
            self.manager.send_signal(signal.SIGTERM)
            try:
                self.manager.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.manager.kill()


def wait(probe: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def burners(n: int) -> list[subprocess.Popen[bytes]]:
    """Competing CPU load: ``n`` busy loops (the noisy neighbour)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def node_of_rank(run: Run, rank: int) -> str:
    job = run.live_job()
    return next(b["node"] for b in run.beats() if b["rank"] == rank and b["job_id"] == job)


def start_drill(run: Run, node: str, factor: float, method: str) -> subprocess.Popen[bytes]:
    log = open(run.tmp / f"drill-{node}.log", "ab")   # noqa: SIM115
    proc = subprocess.Popen([str(BIN / "omni"), "drill", "slow-node", "--job", run.name, "--node", node,
                             "--factor", str(factor), "--method", method, "--site", str(run.tmp / "site.toml")],
                            env=run.env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def stop_drill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def record(run: Run, out: Path | None, label: str) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    keys = ("time", "rank", "stage", "node", "step", "compute_s", "data_s", "cpu_wait_s", "step_time_s", "job_id")
    with open(out / f"{label}.jsonl", "w") as f:
        f.writelines(json.dumps({k: hb.get(k) for k in keys}) + "\n" for hb in sorted(run.series, key=lambda h: h["time"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="factor 1.5 only, 2 normal runs, shorter phases")
    ap.add_argument("--factors", default="", help="comma-separated slow-down factors (default 1.3,1.5,2)")
    ap.add_argument("--normal-runs", type=int, default=-1, help="runs without a fault (default 10, quick 2)")
    ap.add_argument("--normal-s", type=float, default=-1, help="seconds of training per normal run")
    ap.add_argument("--method", default="signals", choices=("auto", "cgroup", "signals"))
    ap.add_argument("--failslow", default="", help="extra [failslow] lines for the site config")
    ap.add_argument("--record", type=Path, help="write each run's heartbeat series here")
    ap.add_argument("--only", default="", help="record: one scenario (steady, noisy, slow-node, job-slow, slow-data)")
    ap.add_argument("--summarize", type=Path, help="print what the detector sees in the recorded series of DIR")
    ap.add_argument("--parallel", type=int, default=1,
                    help="normal runs at once (2 fill the embedded cluster's 8 nodes; more load on the cores)")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    factors = [float(f) for f in (args.factors or ("1.5" if args.quick else "1.3,1.5,2")).split(",")]
    normal_runs = args.normal_runs if args.normal_runs >= 0 else (2 if args.quick else 10)
    normal_s = args.normal_s if args.normal_s > 0 else (60.0 if args.quick else 90.0)
    env, spool = cluster()
    root = Path(tempfile.mkdtemp(prefix="failslow-bench-", dir=REPO / ".omni"))
    failslow = args.failslow.replace("\\n", "\n")
    if args.only:
        return record_only(args.only, env, spool, root, failslow, args.record, args.method)
    print(f"fail-slow bench in {root} (method {args.method}); command: {' '.join([sys.executable, *sys.argv])}",
          flush=True)
    loads: list[float] = []

    healthy = Run(root / "healthy", env, "fs-healthy")
    healthy.tmp.mkdir()
    healthy.start(100_000, failslow, spool)
    wait(lambda: healthy.step() >= 5, 240, "the healthy run's first steps")
    t0 = time.time()
    time.sleep(normal_s / 2)
    ref = healthy.throughput(t0, time.time())
    healthy.close()
    record(healthy, args.record, "healthy")
    loads.append(os.getloadavg()[0])
    print(f"healthy: {ref:.2f} samples/s (load {loads[-1]:.1f})" if ref else "healthy: no throughput measured",
          flush=True)

    results = []
    for factor in factors:
        results.append(slow_run(root, env, spool, failslow, factor, args.method, normal_s, args.record))
        loads.append(results[-1]["load"])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        normal = list(pool.map(lambda i: normal_run(root, env, spool, failslow, i, normal_s, args.record),
                               range(normal_runs)))
    false_migrations = sum(migrated for migrated, _ in normal)
    loads.extend(load for _, load in normal)

    print(f"\nsummary (medians; 1-min load average during the runs: median {statistics.median(loads):.1f}, "
          f"{min(loads):.1f}-{max(loads):.1f})")
    for key in ("detect_s", "migrate_s", "back_s", "before", "during", "after", "lost_steps"):
        vals = [r[key] for r in results if r[key] is not None]
        print(f"  {key}: {statistics.median(vals):.2f}" if vals else f"  {key}: -")
    print(f"  false migrations: {false_migrations} of {normal_runs} runs without an injected slowdown (goal: 0)")
    for r in results:
        found = (f"{r['node']} flagged after {r['detect_s']:.1f}s" if r["detect_s"] is not None
                 else f"not flagged within {DETECT_TIMEOUT_S:.0f}s")
        goal = " (goal: <= 60 s)" if r["factor"] == 1.5 else ""
        print(f"  factor {r['factor']}: {found}{goal}, load {r['load']:.1f}")
    afters = [r["after"] for r in results if r["after"]]
    beside = [r["after"] / r["peer_after"] for r in results if r["after"] and r["peer_after"]]
    if ref and afters:
        print(f"  healthy run (alone, first) {ref:.2f} samples/s, after migration {statistics.median(afters):.2f} "
              f"samples/s: {statistics.median(afters) / ref:.2f} (the load moves between the two)")
    if beside:
        print(f"throughput after migration / healthy run beside it: {statistics.median(beside):.2f} (goal >= 0.9)")
    else:
        print("throughput after migration / healthy run: not measured")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def peer_throughput(metrics: Path, t0: float, t1: float) -> float | None:
    """Global samples per second of the side-by-side healthy peer between t0 and t1 (its rank 0's
    metrics lines: one per step, with its time)."""
    pts = []
    for lines in read_folder(metrics).values():   # own files and node files
        for _, line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("rank") == 0 and t0 <= r.get("time", 0) <= t1:
                pts.append((r["time"], r["step"]))
    pts.sort()
    if len(pts) < 3 or pts[-1][0] <= pts[0][0]:
        return None
    return GLOBAL_BATCH * (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def slow_run(root: Path, env: dict[str, str], spool: Path, failslow: str, factor: float, method: str,
             normal_s: float, out: Path | None) -> dict[str, Any]:
    """One run with a vision node made ``factor`` times slower until the manager migrated off it. Beside
    it, on this machine and never drilled, the same job file runs healthy (the local launcher): its
    throughput in the same seconds is the peer the phases are compared with (the other engineers'
    load moves both alike)."""
    from slurm_omni.drill.reference import JOB_ENV, launch_job

    run = Run(root / f"slow-{factor}", env, f"fs-slow-{str(factor).replace('.', '-')}")
    run.tmp.mkdir()
    run.start(100_000, failslow, spool)
    peer = launch_job(run.tmp / "job.toml", data_parallel_size=2, run_dir=run.tmp / "peer", extra_env=JOB_ENV)
    peer_metrics = run.tmp / "peer" / "metrics"
    try:
        wait(lambda: run.step() >= 5, 240, "first steps")
        t_before = time.time()
        time.sleep(40)   # a full window and a usual level of every node before the node turns slow
        node = node_of_rank(run, 0)   # a vision node
        drill = start_drill(run, node, factor, method)
        t_fault = time.time()
        try:
            try:
                warned = wait(lambda: next((t for t, c, p in run.failslow_decisions()
                                            if c == "flagged" and p.get("node") == node), None),
                              DETECT_TIMEOUT_S, "a fail-slow warning")
            except RuntimeError:
                others = [(p.get("node"), c) for _, c, p in run.failslow_decisions()]
                print(f"factor {factor}: {node} not flagged within {DETECT_TIMEOUT_S:.0f}s (decisions: "
                      f"{others or 'none'})", flush=True)
                return {"factor": factor, "detect_s": None, "migrate_s": None, "back_s": None,
                        "before": run.throughput(t_before, t_fault), "during": run.throughput(t_fault, time.time()),
                        "after": None, "peer_after": None, "node": node, "lost_steps": None,
                        "load": os.getloadavg()[0]}
            migrated = wait(lambda: next((t for t, _ in run.migrations()), None), 120, "a planned migration")
            new_job = wait(lambda: next((j for j in [run.live_job()] if j and j != str(run.job_id)), None), 180,
                           "the migrated incarnation")
        finally:
            stop_drill(drill)
        t_back = wait(lambda: next((hb["time"] for hb in run.series if hb["job_id"] == new_job), None), 180,
                      "the migrated incarnation's first step")
        time.sleep(normal_s / 2)
        t_end = time.time()
        before = run.throughput(t_before, t_fault)
        during = run.throughput(t_fault, migrated)
        after = run.throughput(t_back + 5, t_end)
        peers = [peer_throughput(peer_metrics, a, b) for a, b in ((t_before, t_fault), (t_fault, migrated),
                                                                 (t_back + 5, t_end))]
        lost = lost_steps(run)
        print(f"factor {factor}: {node} flagged after {warned - t_fault:.1f}s, migration planned after "
              f"{migrated - t_fault:.1f}s, training again {t_back - migrated:.1f}s later; throughput before "
              f"{_f(before)} during {_f(during)} after {_f(after)} samples/s, the healthy peer beside it "
              f"{' / '.join(_f(p) for p in peers)}; steps lost {lost}; load {os.getloadavg()[0]:.1f}", flush=True)
        wrong = sorted({p.get("node") for _, c, p in run.failslow_decisions() if c == "flagged"} - {node})
        if wrong:
            print(f"factor {factor}: also flagged (not drilled): {', '.join(map(str, wrong))}", flush=True)
        return {"factor": factor, "detect_s": warned - t_fault, "migrate_s": migrated - t_fault,
                "back_s": t_back - migrated, "before": before, "during": during, "after": after,
                "peer_after": peers[2], "node": node, "lost_steps": lost, "load": os.getloadavg()[0]}
    finally:
        peer.kill()
        run.close()
        record(run, out, f"slow-node-{factor}")


def normal_run(root: Path, env: dict[str, str], spool: Path, failslow: str, i: int, normal_s: float,
               out: Path | None) -> tuple[bool, float]:
    """A run without a fault (odd ones under competing CPU load): (whether it migrated, a false one;
    the load average at its end)."""
    noisy = i % 2 == 1
    run = Run(root / f"normal-{i}", env, f"fs-normal-{i}")
    run.tmp.mkdir()
    run.start(100_000, failslow, spool)
    load: list[subprocess.Popen[bytes]] = []
    try:
        wait(lambda: run.step() >= 5, 240, "first steps")
        load = burners(2) if noisy else []
        time.sleep(normal_s)
        migrations = run.migrations()
        decisions = [c for _, c, _ in run.failslow_decisions()]
        load_now = os.getloadavg()[0]
        print(f"normal run {i} ({'noisy' if noisy else 'quiet'}): {run.step()} steps, fail-slow decisions "
              f"{decisions or 'none'}, migrations {len(migrations)}, load {load_now:.1f}", flush=True)
        return bool(migrations), load_now
    finally:
        for p in load:
            p.kill()
            p.wait()
        run.close()
        record(run, out, f"normal-{i}-{'noisy' if noisy else 'quiet'}")


def lost_steps(run: Run) -> int | None:
    """Steps the migrated incarnation had to redo: the highest step the old one reached minus the step
    the next one restored (the journal's incarnation layout)."""
    rows = run.rows("SELECT number, slurm_job_id, layout FROM incarnations ORDER BY number")
    if len(rows) < 2:
        return None
    old_job, new_layout = str(rows[0][1]), json.loads(rows[1][2] or "{}")
    restored = new_layout.get("restore_step")
    if restored is None or old_job not in run.last_step:
        return None
    return run.last_step[old_job] - int(restored)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def record_only(scenario: str, env: dict[str, str], spool: Path, root: Path, failslow: str,
                out: Path | None, method: str) -> int:
    """One recorded series for the detector's fixtures: 40 s normal, then 60 s of the scenario."""
    # a slow shared data source from step 100 on (about 40 s in at 2.5 steps/s): every rank's loading
    # takes 0.1 s longer
    job_env = {"OMNI_DATA_DELAY_S": "0.1@100"} if scenario == "slow-data" else {}
    run = Run(root / scenario, env, f"fs-rec-{scenario}", job_env=job_env)
    run.tmp.mkdir()
    # warn only: a recording must not migrate away from what it records
    run.start(100_000, failslow + "\nmigrate = false\n", spool)
    procs: list[subprocess.Popen[bytes]] = []
    drills: list[subprocess.Popen[bytes]] = []
    slowed: list[str] = []
    try:
        wait(lambda: run.step() >= 5, 240, "first steps")
        time.sleep(40)
        mark = time.time()
        if scenario == "noisy":
            procs = burners(2)
        elif scenario == "slow-node":
            slowed = [node_of_rank(run, 0)]
        elif scenario == "job-slow":
            job = run.live_job()
            slowed = sorted({b["node"] for b in run.beats() if b["job_id"] == job})
        # one drill for every node of the job: their ranks stop and run in step
        from slurm_omni.slurm.hostlist import compress

        drills = [start_drill(run, compress(slowed), 1.5, method)] if slowed else []
        time.sleep(60)
        print(f"{scenario}: {len(run.series)} samples, change at {mark:.1f}", flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{scenario}.json").write_text(json.dumps({
                "scenario": scenario, "change_at": mark, "method": method, "job_env": job_env,
                "slowed_nodes": slowed, "factor": 1.5 if slowed else None,
                "change_step": 100 if scenario == "slow-data" else None}, indent=1) + "\n")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for d in drills:
            stop_drill(d)
        run.close()
        record(run, out, scenario)
        shutil.rmtree(root, ignore_errors=True)
    return 0


def summarize(folder: Path) -> int:
    """Per recorded series: the largest ratio and z a node not slowed reached, when the slowed node was
    flagged after the change, and the whole-job verdicts (what docs/failslow.md tabulates)."""
    from slurm_omni.policy.failslow import FailSlowConfig, replay, samples_from

    config = FailSlowConfig()
    print("| series | samples | step s (median) | unslowed nodes: max ratio / max z | slowed node flagged after "
          "the change | whole job slower (cause) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in sorted(folder.glob("*.jsonl")):
        meta_path = path.with_suffix(".json")
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        samples = samples_from(json.loads(line) for line in path.read_text().splitlines() if line)
        if not samples:
            continue
        start = float(meta.get("change_at") or samples[0].time)
        if meta.get("change_step"):
            start = min(s.time for s in samples if s.step >= meta["change_step"])
        result = replay(samples, config)
        slowed = set(meta.get("slowed_nodes") or ())
        others = [v for r in result.reports for v in r.nodes if v.node not in slowed]
        flagged = {n: t - start for n, t in result.first_flag.items()}
        slow_jobs = [r for r in result.reports if r.job.slow]
        steps = [s.step_time_s for s in samples if s.step_time_s is not None]
        job = (f"from {slow_jobs[0].time - start:+.0f}s ({', '.join(sorted({r.job.cause for r in slow_jobs}))})"
               if slow_jobs else "no")
        print(f"| {path.stem} | {len(samples)} | {statistics.median(steps):.3f} | "
              f"{max((v.ratio for v in others), default=0):.2f} / {max((v.z for v in others), default=0):.1f} | "
              f"{', '.join(f'{n} {d:+.0f}s' for n, d in sorted(flagged.items())) or 'none'} | {job} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
