"""Fault to the first training step after the restore, four recovery paths side by side on the same
job and the same faults, on the embedded cluster (issue 13):

  (a) in_allocation  slurm-omni's step supervisor relaunches inside the same --no-kill allocation
  (b) resubmit       slurm-omni's manager cancels the heterogeneous job and submits the next one
  (c) requeue        Slurm's own requeue (--requeue, JobRequeue=1) of the heterogeneous job
  (d) torchrun       torchrun's elastic restart inside one allocation (c10d rendezvous,
                     --nnodes=1:2, --max-restarts, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)

Faults: ``node`` (a node of the text stage set DOWN in Slurm, not the batch host) and ``rank`` (the
trainer process of a text rank SIGKILLed). ``--busy`` fills every node the job does not hold with
other jobs of a few minutes (slurm_omni.cluster.busy), so that a path that goes through the queue
waits. Times: the fault is this script's clock at injection; the first step is the earliest metrics
record (the runtime's own timestamp) of a later incarnation. A path that does not recover from a
fault (Slurm does not requeue a job for a crashed rank) says so instead of a number.

    python bench/recovery_bench.py                       # every path and fault, idle cluster, 1 repeat
    python bench/recovery_bench.py --paths in_allocation,resubmit --faults node --busy --repeats 3

Prints one line per trial, then medians and the ratios in_allocation / each other path.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from slurm_omni.cluster.busy import BusyCluster
from slurm_omni.cluster.local import LocalCluster
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.render import HetJobRequest
from slurm_omni.runtime.synth import SynthSpec, write_shards
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.runner import CommandRunner

PATHS = ("in_allocation", "resubmit", "requeue", "torchrun")
FAULTS = ("node", "rank")
BIN = Path(sys.executable).parent

SITE = """
cluster = "omni"
use_spank_plugin = {spank}
[stages.vision]
partition = "debug"
gres = "gpu:h100:4"
[stages.text]
partition = "debug"
gres = "gpu:h100:4"
[checkpoint]
root = "{work}/ckpt"
[detection]
heartbeat_interval_s = 1
[elasticity]
recovery = "{recovery}"
default_spares = 1
[drills]
allowed_nodes = "node[1-8]"
[manager]
spool_dir = "{spool}"
registry_dir = "{work}/registry"
metrics_dir = "{work}/metrics"
"""

JOB = """
[job]
name = "bench-{tag}"
data_parallel_size = 2
time_limit = "00:20:00"
signal_before_s = 60
max_requeues = 3
log_dir = "{work}/logs"
[[stages]]
name = "vision"
nodes = 2
[[stages]]
name = "text"
nodes = 2
[training]
max_steps = 100000
[training.model]
preset = "tiny"
[training.parallel]
global_batch_size = 4
micro_batch_size = 1
[training.data]
shard_dir = "{shards}"
[[training.data.sources]]
name = "pairs"
weight = 3.0
[[training.data.sources]]
name = "text"
weight = 1.0
[training.checkpoint]
every_steps = 5
keep_last = 2
"""

TORCHRUN = """#!/bin/bash
#SBATCH --job-name=bench-torchrun
#SBATCH --no-kill
#SBATCH --partition=debug
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:20:00
#SBATCH --output={log}
export OMNI_CKPT_DIR={ckpt} OMNI_HEARTBEAT_DIR={ckpt}/heartbeat OMNI_METRICS_DIR={metrics}
export OMNI_HEARTBEAT_INTERVAL=1 OMNI_DEVICE=cpu TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
mkdir -p -- "$OMNI_CKPT_DIR"
# One srun per node: Slurm 22.05 terminates a whole step when one of its nodes fails (srun: "Node
# failure"), which would take the surviving torchrun agent with it.
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    srun --nodes=1 --ntasks=1 --nodelist="$node" torchrun --nnodes=1:2 --nproc-per-node=2 \\
        --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} --rdzv-id=$SLURM_JOB_ID \\
        --rdzv-conf=join_timeout=30,last_call_timeout=1 --monitor-interval=0.1 --no-python \\
        bash -c 'export OMNI_INCARNATION=${{TORCHELASTIC_RESTART_COUNT:-0}} OMNI_JOB_ID=$SLURM_JOB_ID; exec "$@"' \\
        omni-rank {omni} train --config {job} &
done
wait
"""


@dataclass
class Trial:
    path: str
    fault: str
    busy: bool
    seconds: float | None
    note: str = ""


class Bench:
    def __init__(self, root: Path, *, step_delay: float, after_steps: int, timeout_s: float) -> None:
        self.root = root
        self.cluster = LocalCluster(Path(os.environ.get("OMNI_CLUSTER_DIR", REPO / ".omni" / "cluster")))
        self.cluster.up(wait_s=120)
        self.env = {**os.environ, **self.cluster.env, "PATH": f"{BIN}:{os.environ['PATH']}",
                    "OMNI_STEP_DELAY_S": str(step_delay), "OMNI_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
        self.runner = CommandRunner(self.cluster.env, timeout_s=30)
        self.backend = CliBackend(env=self.cluster.env)
        self.after_steps = after_steps
        self.timeout_s = timeout_s
        self.shards = root / "shards"
        if not self.shards.exists():
            write_shards(SynthSpec(out_dir=self.shards, pairs=32, text=16, shard_size=16))
        self.count = 0

    # -- one trial --------------------------------------------------------------------------------
    def trial(self, path: str, fault: str, busy: bool) -> Trial:
        self.count += 1
        work = self.root / f"{self.count:02d}-{path}-{fault}-{'busy' if busy else 'idle'}"
        work.mkdir(parents=True)
        (work / "logs").mkdir()
        filler = BusyCluster(self.backend, seconds=150, tag=f"bench-{os.getpid()}")
        manager: subprocess.Popen[bytes] | None = None
        lost = ""
        job_id = 0
        try:
            if path == "torchrun":
                job_id = self._submit_torchrun(work)
            else:
                job_id, manager = self._submit(work, path)
            inc = self._wait_steps(work, self.after_steps)
            if busy:
                filler.fill()
            t_fault, lost, note = self._inject(work, path, fault, job_id)
            if not t_fault:
                return Trial(path, fault, busy, None, note)
            if path == "requeue" and fault == "rank":
                return Trial(path, fault, busy, None, "Slurm requeues a job for a lost node only: the batch "
                                                      "script ends failed")
            first = self._first_step_after(work, inc, t_fault)
            if first is None:
                return Trial(path, fault, busy, None, f"no step after the fault within {self.timeout_s:.0f} s")
            return Trial(path, fault, busy, first - t_fault, note)
        finally:
            filler.clear()
            if manager is not None:
                manager.send_signal(signal.SIGTERM)
                try:
                    manager.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    manager.kill()
            for jid in self._jobs_named(work):
                self.runner.run(["scancel", str(jid)], check=False)
            if lost:
                self.runner.run(["scontrol", "update", f"nodename={lost}", "state=RESUME"], check=False)
            self._wait_queue_empty(work)

    def _files(self, work: Path, path: str) -> tuple[Path, Path]:
        site = work / "site.toml"
        site.write_text(SITE.format(work=work, spool=self.cluster.paths.spool, spank=str(path != "in_allocation").lower(),
                                    recovery="in_allocation" if path == "in_allocation" else "resubmit"))
        job = work / "job.toml"
        job.write_text(JOB.format(tag=f"{self.count:02d}", work=work, shards=self.shards))
        return site, job

    def _submit(self, work: Path, path: str) -> tuple[int, subprocess.Popen[bytes] | None]:
        site, job = self._files(work, path)
        if path == "resubmit":
            log = open(work / "manager.log", "wb")  # noqa: SIM115 (closed with the process)
            manager = subprocess.Popen([str(BIN / "omni"), "-v", "manager", "run", "--site-config", str(site),
                                        "--state-dir", str(work / "state"), "--poll-interval", "1", "--tick", "0.25"],
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            out = subprocess.run([str(BIN / "omni"), "submit", "--site", str(site), str(job)], env=self.env,
                                 capture_output=True, text=True, check=True).stdout
            return int(out.split()[-1]) if out.split()[-1].isdigit() else self._job_id(work), manager
        script = HetJobRequest(job=load_job(job), site=load_site(site), job_file=job,
                               job_sha256="0" * 64).materialize()
        out = self.runner.run(["sbatch", "--parsable"], input_text=script, env=self.env).stdout
        return int(out.strip().split(";")[0]), None

    def _submit_torchrun(self, work: Path) -> int:
        _, job = self._files(work, "torchrun")
        script = TORCHRUN.format(log=shlex.quote(str(work / "logs" / "torchrun-%j.out")),
                                 ckpt=shlex.quote(str(work / "ckpt" / "torchrun")),
                                 metrics=shlex.quote(str(work / "metrics")), port=29400 + self.count,
                                 omni=shlex.quote(str(BIN / "omni")), job=shlex.quote(str(job)))
        out = self.runner.run(["sbatch", "--parsable"], input_text=script, env=self.env).stdout
        return int(out.strip().split(";")[0])

    def _job_id(self, work: Path) -> int:
        jobs = self._jobs_named(work)
        return jobs[0] if jobs else 0

    def _jobs_named(self, work: Path) -> list[int]:
        names = {f"bench-{self.count:02d}", "bench-torchrun"}
        out = self.runner.run(["squeue", "-h", "-o", "%F %j"], check=False).stdout
        return sorted({int(line.split()[0]) for line in out.splitlines()
                       if len(line.split()) == 2 and line.split()[1] in names})

    def _wait_queue_empty(self, work: Path) -> None:
        deadline = time.monotonic() + 60
        while self._jobs_named(work) and time.monotonic() < deadline:
            time.sleep(1)

    # -- what the run recorded ----------------------------------------------------------------------
    def _records(self, work: Path) -> list[dict[str, Any]]:
        out = []
        for f in (work / "metrics").rglob("metrics-*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def _wait_steps(self, work: Path, steps: int) -> int:
        """Until a checkpoint exists and training went ``steps`` beyond it; the incarnation then."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            recs = self._records(work)
            if recs and max(r["step"] for r in recs) >= 5 + steps:
                return max(int(r["incarnation"]) for r in recs)
            time.sleep(0.5)
        raise RuntimeError(f"bench: no training progress in {work}")

    def _first_step_after(self, work: Path, inc: int, t_fault: float) -> float | None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            later = [r["time"] for r in self._records(work) if int(r["incarnation"]) > inc and r["time"] > t_fault]
            if later:
                return float(min(later))
            time.sleep(0.3)
        return None

    # -- faults ---------------------------------------------------------------------------------------
    def _text_node(self, work: Path, path: str, job_id: int) -> str:
        if path == "in_allocation":
            status = json.loads(next((work / "ckpt").rglob(f"{job_id}.status.json")).read_text())
            return str(status["components"][1][-1])
        out = self.runner.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        lists = [expand(line.split(" NodeList=")[1].split()[0]) for line in out.splitlines() if " NodeList=" in line]
        if path == "torchrun":
            return lists[0][-1]          # not the batch host (the rendezvous endpoint lives there)
        return lists[-1][-1]             # het component 1: text

    def _inject(self, work: Path, path: str, fault: str, job_id: int) -> tuple[float, str, str]:
        if fault == "node":
            node = self._text_node(work, path, job_id)
            t = time.time()
            self.runner.run(["scontrol", "update", f"nodename={node}", "state=DOWN", "reason=recovery-bench"])
            return t, node, f"{node} DOWN"
        beats = [json.loads(p.read_text()) for p in (work / "ckpt").rglob("heartbeat/rank-*.json")]
        beats = [b for b in beats if b.get("stage") == 1 and b.get("phase") == "training"]
        if not beats:
            return 0.0, "", "no text rank heartbeat to find the trainer by"
        target = max(beats, key=lambda b: b["rank"])
        t = time.time()
        os.kill(int(target["pid"]), signal.SIGKILL)
        return t, "", f"rank {target['rank']} (pid {target['pid']}) SIGKILL"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--busy", action="store_true", help="the busy cluster only")
    p.add_argument("--both", action="store_true", help="idle and busy")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--step-delay", type=float, default=0.1)
    p.add_argument("--after-steps", type=int, default=3, help="inject this many steps after the first checkpoint")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--work", type=Path, default=Path("/tmp") / f"omni-recovery-bench-{os.getpid()}")
    p.add_argument("--json", type=Path, help="write every trial here")
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    faults = [x for x in a.faults.split(",") if x]
    bad = sorted(set(paths) - set(PATHS)) + sorted(set(faults) - set(FAULTS))
    if bad:
        print(f"recovery_bench: unknown {bad[0]!r} (paths: {', '.join(PATHS)}; faults: {', '.join(FAULTS)})")
        return 2
    states = [False, True] if a.both else [a.busy]
    bench = Bench(a.work, step_delay=a.step_delay, after_steps=a.after_steps, timeout_s=a.timeout)
    trials: list[Trial] = []
    for busy in states:
        for fault in faults:
            for path in paths:
                for _ in range(a.repeats):
                    try:
                        t = bench.trial(path, fault, busy)
                    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                        t = Trial(path, fault, busy, None, f"trial failed: {e}")
                    trials.append(t)
                    shown = f"{t.seconds:7.2f} s" if t.seconds is not None else "    n/a  "
                    print(f"{'busy' if busy else 'idle'} {fault:4} {path:13} {shown}  {t.note}", flush=True)
    if a.json:
        a.json.write_text(json.dumps([t.__dict__ for t in trials], indent=1))
    print("\nmedian fault -> first step after restore (s), and in_allocation / path:")
    for busy in states:
        for fault in faults:
            med = {path: _median([t.seconds for t in trials if t.path == path and t.fault == fault
                                  and t.busy == busy and t.seconds is not None]) for path in paths}
            base = med.get("in_allocation")
            cells = []
            for path in paths:
                m = med[path]
                ratio = f" ({base / m:.2f}x)" if base is not None and m and path != "in_allocation" else ""
                cells.append(f"{path} {m:.2f}{ratio}" if m is not None else f"{path} n/a")
            print(f"  {'busy' if busy else 'idle'} {fault:4}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
