"""Fault to the first training step after the restore, five recovery paths side by side on the same
job and the same faults, on the embedded cluster (issues 13 and 20):

  (a) allocation     slurm-omni's step supervisor, outside the allocation (salloc --no-shell --no-kill,
                     no batch script) beside the manager, relaunches with srun --jobid in it
  (a') in_allocation slurm-omni's step supervisor in the batch script relaunches inside the same
                     --no-kill allocation
  (b) resubmit       slurm-omni's manager cancels the heterogeneous job and submits the next one
  (c) requeue        Slurm's own requeue (--requeue, JobRequeue=1) of the heterogeneous job
  (d) torchrun       torchrun's elastic restart inside one allocation (c10d rendezvous,
                     --nnodes=1:2, --max-restarts, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)

Faults: ``node`` (the last node of the pipeline's last stage set DOWN in Slurm; for torchrun, whose
ranks run every stage, a node that is not the batch host), ``first`` (the job's first node set DOWN:
the batch host of a job with a batch script, the first node of an allocation without one; for
torchrun the node whose agent holds the c10d store) and ``rank`` (the trainer process of a rank on
the ``node`` fault's node SIGKILLed, found by its heartbeat's node). The job (2 vision + 2 text
nodes, one spare per stage where the path holds spares) lands on the first leaf switch of the idle
cluster, so a lost node's replacement (an allocation's spare, or the node a resubmission is pinned
to) is on the other leaf: each node trial names the replacement and its leaf. On the busy cluster every node the job does not hold
gets another job (``--exclusive``) and more wait in the queue behind them (slurm_omni.cluster.busy,
``queued``): a node the job frees goes to them, so a path that goes through the queue waits there
(its queue wait, Slurm's SubmitTime to StartTime, is printed). Times: the fault is this script's
clock at injection; the first step is the earliest metrics record (the runtime's own timestamp) of a
later incarnation. A path that does not recover from a fault (Slurm does not requeue a job for a
crashed rank) says so instead of a number; a trial whose fault could not be injected (or that failed
before it) measured nothing, and a goal that depends on it prints n/a with the reason, never PASS.

An in-allocation trial is split by the product's own timestamps: the supervisor's journal (srun
reported the fault, the rule confirmed it, the next launch journaled) and the new life's first
metrics line (its tasks started, process groups ready, restored, first step).

    python bench/recovery_bench.py                # every path and fault, idle and busy, 3 repeats
    python bench/recovery_bench.py --paths in_allocation,resubmit --faults node --busy --repeats 5
    python bench/recovery_bench.py --paths in_allocation --idle --memory-tier   # with the memory tier

Each trial also prints the steps lost (the faulted life's last step minus the step the next life
restored: work done again) and where the next life's ranks restored from (``memory``, ``file system``).

The paths run interleaved (repeat 1 of every path, then repeat 2, ...) so that a change of the
machine's load falls on all of them. Prints one line per trial (with the 1-minute load average),
then per path the median, the spread (min-max) and the median load, the ratios in_allocation / each
other path, and the issue's goals with PASS or MISS.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[1]

from slurm_omni.cluster.busy import BusyCluster
from slurm_omni.cluster.local import LocalCluster
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.errors import OmniError
from slurm_omni.formats.metrics import read_tree
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.render import HetJobRequest
from slurm_omni.runtime.synth import SynthSpec, write_shards
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor.journal import read_status
from slurm_omni.supervisor.outside import process_alive, read_process

PATHS = ("allocation", "in_allocation", "resubmit", "requeue", "torchrun")
FAULTS = ("node", "first", "rank")
NODE_FAULTS = frozenset({"node", "first"})
SUPERVISED = frozenset({"allocation", "in_allocation"})
"""Paths whose step supervisor journals its relaunches (the split of the time, the replacement)."""
MANAGED = frozenset({"allocation", "in_allocation", "resubmit"})
"""Paths submitted with ``omni submit`` beside a running manager (it restarts the outside supervisor,
resubmits a lost allocation)."""
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
allow_allocation = {allow}
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
memory_tier = {memory_tier}
{cadence}"""

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
first=1
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    srun --nodes=1 --ntasks=1 --nodelist="$node" torchrun --nnodes=1:2 --nproc-per-node=2 \\
        --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} --rdzv-id=$SLURM_JOB_ID \\
        --rdzv-conf=join_timeout=30,last_call_timeout=1 --monitor-interval=0.1 --no-python \\
        bash -c 'export OMNI_INCARNATION=${{TORCHELASTIC_RESTART_COUNT:-0}} OMNI_JOB_ID=$SLURM_JOB_ID; exec "$@"' \\
        omni-rank {omni} train --config {job} &
    # The c10d store lives in the agent that binds the endpoint first, and every slurmd here shares
    # 127.0.0.1: the first node's agent binds it before the others start, so the faults (never on
    # the first node) do not take the store away from the survivor.
    for _ in $(seq 600); do
        (( first )) || break
        [[ -n $(ss -Hltn "sport = :{port}") ]] && break
        sleep 0.1
    done
    first=0
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
    load: float = 0.0
    """1-minute load average at the fault."""
    queue_wait: float | None = None
    """Resubmission: the new job's SubmitTime to StartTime (s)."""
    phases: dict[str, float] = field(default_factory=dict)
    """In-allocation: where the time went (see PHASES)."""
    injected: bool = True
    """False: the fault was never injected (``note`` says why), so the trial measured nothing."""
    steps_lost: int | None = None
    """The last step the faulted life finished minus the step the next life restored (work redone)."""
    source: str = ""
    """Where the next life's ranks restored from (their first metrics lines' restore_source), e.g.
    ``memory x4`` or ``file system x2, memory x2``."""


PHASES = ("detect", "confirm", "decide", "srun", "groups", "restore", "step")
"""detect: fault -> srun reports it; confirm: -> the rule confirmed; decide: -> the next launch
journaled (kill, job and node states, placement); srun: -> the first task of it started; groups: ->
the last rank's process groups ready; restore: -> the last rank restored; step: -> the first step."""


class Bench:
    def __init__(self, root: Path, *, step_delay: float, after_steps: int, timeout_s: float,
                 busy_seconds: int = 90, memory_tier: bool = False, memory_every: int = 0) -> None:
        self.root = root
        self.memory_tier = memory_tier
        self.memory_every = memory_every
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
        self.busy_seconds = busy_seconds

    # -- one trial --------------------------------------------------------------------------------
    def trial(self, path: str, fault: str, busy: bool) -> Trial:
        self.count += 1
        work = self.root / f"{self.count:02d}-{path}-{fault}-{'busy' if busy else 'idle'}"
        work.mkdir(parents=True)
        (work / "logs").mkdir()
        filler = BusyCluster(self.backend, seconds=self.busy_seconds, tag=f"bench-{os.getpid()}", queued=8)
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
            load = os.getloadavg()[0]
            held = self._nodes_held(work)
            t_fault, lost, note = self._inject(work, path, fault, job_id)
            if not t_fault:
                return Trial(path, fault, busy, None, note, load, injected=False)
            if path == "requeue" and fault == "rank":
                return Trial(path, fault, busy, None, "Slurm requeues a job for a lost node only: the batch "
                                                      "script ends failed", load)
            first = self._first_step_after(work, inc, t_fault)
            if first is None:
                return Trial(path, fault, busy, None, f"no step after the fault within {self.timeout_s:.0f} s"
                             f" ({note})", load)
            trial = Trial(path, fault, busy, first - t_fault, note, load)
            trial.steps_lost, trial.source = self._lost_and_source(work, inc)
            if fault in NODE_FAULTS:
                trial.note += "; " + self._replacement(work, path, job_id, lost, held)
            if path in SUPERVISED:
                trial.phases = self._phases(work, job_id, inc, t_fault)
            if path == "resubmit":
                trial.queue_wait, nodes = self._queue_wait(work, job_id)
                trial.note += f"; resubmitted job waited {trial.queue_wait:.0f} s in the queue, ran on {nodes}" \
                    if trial.queue_wait is not None else "; no resubmitted job found"
            return trial
        finally:
            filler.clear()
            self._stop_outside_supervisor(work, path, job_id)
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
        site.write_text(SITE.format(work=work, spool=self.cluster.paths.spool, spank=str(path not in SUPERVISED).lower(),
                                    recovery=path if path in SUPERVISED else "resubmit",
                                    allow=str(path == "allocation").lower()))
        job = work / "job.toml"
        job.write_text(JOB.format(tag=f"{self.count:02d}", work=work, shards=self.shards,
                                  memory_tier=str(self.memory_tier).lower(),
                                  cadence=f"memory_every_steps = {self.memory_every}\nfiles_every = 10\n"
                                  if self.memory_tier and self.memory_every else ""))
        return site, job

    def _submit(self, work: Path, path: str) -> tuple[int, subprocess.Popen[bytes] | None]:
        site, job = self._files(work, path)
        if path in MANAGED:
            log = open(work / "manager.log", "wb")  # noqa: SIM115 (closed with the process)
            manager = subprocess.Popen([str(BIN / "omni"), "-v", "manager", "run", "--site-config", str(site),
                                        "--state-dir", str(work / "state"), "--poll-interval", "1", "--tick", "0.25"],
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            out = subprocess.run([str(BIN / "omni"), "submit", "--site", str(site), str(job)], env=self.env,
                                 capture_output=True, text=True, check=True).stdout
            words = out.split()     # "submitted job N (name) ..."
            return int(words[2]) if words[:2] == ["submitted", "job"] and words[2].isdigit() \
                else self._job_id(work), manager
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

    def _stop_outside_supervisor(self, work: Path, path: str, job_id: int) -> None:
        """Allocation mode: the step supervisor runs on this host, detached (docs/allocation-mode.md);
        the trial's end stops it by its process record (the allocation is cancelled just after)."""
        if path != "allocation" or not job_id:
            return
        for found in (work / "ckpt").rglob(f"supervisor/{job_id}.process.json"):
            record = read_process(found.parent.parent, str(job_id))     # <ckpt>/supervisor/<J>.process.json
            if record is not None and process_alive(record):
                try:
                    os.kill(record.pid, signal.SIGTERM)
                except OSError:
                    continue

    # -- what the run recorded ----------------------------------------------------------------------
    def _nodes_held(self, work: Path) -> set[str]:
        """Every node the trial's jobs hold now (allocations' spares included)."""
        out = self.runner.run(["squeue", "-h", "-t", "RUNNING", "-o", "%j %N"], check=False).stdout
        names = {f"bench-{self.count:02d}", "bench-torchrun"}
        return {n for line in out.splitlines() if len(line.split()) == 2 and line.split()[0] in names
                for n in expand(line.split()[1])}

    def _leaf(self, node: str) -> str:
        path = self.backend.topology().switch_path(node)
        return path[-1] if path else "?"

    def _replacement(self, work: Path, path: str, job_id: int, lost: str, held: set[str]) -> str:
        """Which node took the lost one's place, and on which leaf switch: the supervisor's status
        (a spare of the allocation) or the nodes the trial's jobs hold now that they did not before."""
        added: list[str] = []
        found = next((work / "ckpt").rglob(f"supervisor/{job_id}.status.json"), None)
        status = read_status(found) if path in SUPERVISED and found is not None else None
        if status is not None:
            added = next((list(r.added) for r in status.recoveries if lost in r.removed), [])
        if not added:
            added = sorted(self._nodes_held(work) - held)
        if not added:
            return f"no node new to the trial's jobs took {lost}'s place ({self._leaf(lost)}): nodes it already held"
        leaves = {self._leaf(n) for n in added}
        where = "another leaf" if self._leaf(lost) not in leaves else "the same leaf"
        return f"replacement {','.join(added)} on {','.join(sorted(leaves))} ({lost} on {self._leaf(lost)}: {where})"

    def _queue_wait(self, work: Path, job_id: int) -> tuple[float | None, str]:
        """The resubmitted job's time in the queue, from Slurm's SubmitTime and StartTime (s)."""
        later = [j for j in self._jobs_named(work) if j > job_id]
        if not later:
            return None, ""
        out = self.runner.run(["scontrol", "show", "job", "-o", str(later[-1])], check=False).stdout
        fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
        try:
            submit = time.mktime(time.strptime(fields["SubmitTime"], "%Y-%m-%dT%H:%M:%S"))
            start = time.mktime(time.strptime(fields["StartTime"], "%Y-%m-%dT%H:%M:%S"))
        except (KeyError, ValueError):
            return None, ""
        return start - submit, fields.get("NodeList", "")

    def _phases(self, work: Path, job_id: int, inc: int, t_fault: float) -> dict[str, float]:
        """Where an in-allocation relaunch's time went, from the supervisor's journal and the new
        life's first metrics lines (empty when a record is missing)."""
        journals = list((work / "ckpt").rglob(f"supervisor/{job_id}.jsonl"))
        if not journals:
            return {}
        recs = [json.loads(line) for line in journals[0].read_text().splitlines() if line.strip()]
        launch = next((r for r in recs if r["kind"] == "launch" and int(r["incarnation"]) > inc), None)
        confirmed = next((r for r in recs if r["kind"] == "confirmed" and int(r["launch"]) == int(launch["launch"]) - 1),
                         None) if launch else None
        first = [r for r in self._records(work) if launch and int(r["incarnation"]) == int(launch["incarnation"])]
        first_lines: dict[int, dict[str, Any]] = {}
        for r in sorted(first, key=lambda r: r["time"]):
            first_lines.setdefault(int(r["rank"]), r)
        lines = list(first_lines.values())
        if not (launch and confirmed and lines and all(r.get("restored_at") for r in lines)):
            return {}
        started = [r["task_started_at"] for r in lines if r.get("task_started_at")]
        marks = [t_fault, confirmed["detected_at"], confirmed["confirmed_at"], launch["time"],
                 min(started) if started else None, max(r["groups_ready_at"] for r in lines),
                 max(r["restored_at"] for r in lines), min(r["time"] for r in lines)]
        if started == [] or any(m is None for m in marks):
            return {}
        return {name: float(marks[k + 1] - marks[k]) for k, name in enumerate(PHASES)}

    def _lost_and_source(self, work: Path, inc: int) -> tuple[int | None, str]:
        """Steps lost (the faulted life's last step minus the step the next life restored) and where the
        next life's ranks restored from; waits a little for every rank's first line of the next life."""
        deadline = time.monotonic() + 30
        while True:
            recs = self._records(work)
            old = [r for r in recs if int(r["incarnation"]) == inc]
            later = [r for r in recs if int(r["incarnation"]) > inc]
            new_inc = min((int(r["incarnation"]) for r in later), default=None)
            new = sorted((r for r in later if int(r["incarnation"]) == new_inc), key=lambda r: r["step"])
            firsts: dict[int, dict[str, Any]] = {}
            for r in new:
                firsts.setdefault(int(r["rank"]), r)
            if len(firsts) >= len({int(r["rank"]) for r in old}) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        if not old or not new:
            return None, ""
        lost = max(int(r["step"]) for r in old) - (min(int(r["step"]) for r in new) - 1)
        counts: dict[str, int] = {}
        for r in firsts.values():
            counts[str(r.get("restore_source") or "nothing")] = counts.get(str(r.get("restore_source") or "nothing"), 0) + 1
        return lost, ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))

    def _records(self, work: Path) -> list[dict[str, Any]]:
        out = []
        for lines in read_tree(work / "metrics").values():   # own files and node files
            for _, line in lines:
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
    def _fault_node(self, work: Path, path: str, fault: str, job_id: int) -> str:
        """``node`` and ``rank``: the last node of the last stage (never the batch host); ``first``:
        the job's first node (the batch host, or an allocation's first node)."""
        out = self.runner.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        lists = [expand(line.split(" NodeList=")[1].split()[0]) for line in out.splitlines() if " NodeList=" in line]
        if fault == "first":
            host = out.split(" BatchHost=")[1].split()[0] if " BatchHost=" in out else ""
            return host if host and path != "allocation" else lists[0][0]
        if path in SUPERVISED:
            status = read_status(next((work / "ckpt").rglob(f"{job_id}.status.json")))
            if status is None or not status.components:
                raise OmniError(f"bench: couldn't read the supervisor's status of job {job_id}")
            return status.components[-1][-1]
        if path == "torchrun":
            return lists[0][-1]          # not the batch host (the rendezvous endpoint lives there)
        return lists[-1][-1]             # the last het component: the last stage

    def _inject(self, work: Path, path: str, fault: str, job_id: int) -> tuple[float, str, str]:
        node = self._fault_node(work, path, fault, job_id)
        if fault in NODE_FAULTS:
            t = time.time()
            self.runner.run(["scontrol", "update", f"nodename={node}", "state=DOWN", "reason=recovery-bench"])
            return t, node, f"{node} DOWN"
        # by node, not by stage: torchrun's ranks run every stage and all report the first
        # the one reader: a rank's own file or its node's (per node by default, formats/heartbeat.py)
        beats = [msgspec.structs.asdict(b) for folder in (work / "ckpt").rglob("heartbeat") if folder.is_dir()
                 for b in read_heartbeats(folder)]
        beats = [b for b in beats if b.get("node") == node and b.get("phase") == "training"]
        if not beats:
            return 0.0, "", f"no training rank's heartbeat names {node}: no trainer to kill"
        target = max(beats, key=lambda b: b["rank"])
        t = time.time()
        os.kill(int(target["pid"]), signal.SIGKILL)
        return t, "", f"rank {target['rank']} (pid {target['pid']}) SIGKILL"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _cell(trials: list[Trial]) -> dict[str, Any]:
    secs = [t.seconds for t in trials if t.seconds is not None]
    waits = [t.queue_wait for t in trials if t.queue_wait is not None]
    return {"median": _median(secs), "min": min(secs) if secs else None, "max": max(secs) if secs else None,
            "n": len(secs), "of": len(trials), "load": _median([t.load for t in trials]),
            "queue_wait": _median(waits),
            "phases": {ph: _median([t.phases[ph] for t in trials if ph in t.phases]) for ph in PHASES}
            if any(t.phases for t in trials) else {},
            "notes": sorted({t.note for t in trials if t.seconds is None}),
            "injected": sum(t.injected for t in trials),
            "steps_lost": [t.steps_lost for t in trials if t.steps_lost is not None],
            "sources": sorted({t.source for t in trials if t.source}),
            "unmeasured": sorted({t.note for t in trials if not t.injected}),
            "other_leaf": sum(t.seconds is not None and "another leaf" in t.note for t in trials)}


def summarize(trials: list[Trial], paths: list[str], faults: list[str], states: list[bool]) -> list[str]:
    """The table, the ratios and the goals, as printed lines."""
    cells = {(b, f, p): _cell([t for t in trials if (t.busy, t.fault, t.path) == (b, f, p)])
             for b in states for f in faults for p in paths}
    out = ["", ("fault -> first step after restore: median, spread (min-max), trials that recovered, "
                "median 1-min load at the fault"),
           f"  {'cluster':7} {'fault':5} {'path':13} {'median':>8} {'spread':>15} {'n':>5} {'load':>5}  notes"]
    for (b, f, p), c in cells.items():
        med = f"{c['median']:7.2f}s" if c["median"] is not None else "     n/a"
        spread = f"{c['min']:.2f}-{c['max']:.2f}" if c["median"] is not None else "-"
        notes = []
        if c["queue_wait"] is not None:
            notes.append(f"queue wait {c['queue_wait']:.0f} s")
        if c["phases"]:
            notes.append(" ".join(f"{ph} {v:.2f}" for ph, v in c["phases"].items() if v is not None))
        if c["steps_lost"]:
            notes.append(f"steps lost {'/'.join(str(n) for n in c['steps_lost'])}, restored from "
                         f"{' | '.join(c['sources']) or '?'}")
        notes += c["notes"][:1]
        out.append(f"  {'busy' if b else 'idle':7} {f:5} {p:13} {med} {spread:>15} {c['n']:>2}/{c['of']:<2} "
                   f"{c['load'] or 0:5.1f}  {'; '.join(notes)}")
    ours = base_path(paths)
    out.append(f"\nratios {ours} / path (medians):")
    for b in states:
        for f in faults:
            base = cells[(b, f, ours)]["median"] if ours else None
            parts = [f"{p} {base / cells[(b, f, p)]['median']:.3f}x" if base and cells[(b, f, p)]["median"]
                     else f"{p} n/a" for p in paths if p != ours]
            out.append(f"  {'busy' if b else 'idle'} {f:5}: " + "; ".join(parts))
    out.append("\ngoals (issues 13 and 20):")
    out.extend(goals(cells, paths, faults, states))
    return out


def _verdict(ok: bool | None) -> str:
    return "PASS" if ok else "n/a " if ok is None else "MISS"


def base_path(paths: list[str]) -> str:
    """The path the others are compared with: the fastest mode measured (allocation, else in_allocation)."""
    return next((p for p in ("allocation", "in_allocation") if p in paths), "")


def _why(c: dict[str, Any] | None) -> str:
    """Why a cell holds no figure: its trials' own notes (not injected, not recovered), else 'not run'."""
    if not c or not c["of"]:
        return "not run"
    return "; ".join((c["unmeasured"] + c["notes"])[:1]) or "no trial measured"


def goals(cells: dict[tuple[bool, str, str], dict[str, Any]], paths: list[str], faults: list[str],
          states: list[bool]) -> list[str]:
    """Each goal PASS or MISS on a figure, or n/a with the reason when a figure it needs is missing."""
    out = []
    def med(b: bool, f: str, p: str) -> float | None:
        c = cells.get((b, f, p))
        return c["median"] if c else None
    for p in ("allocation", "in_allocation"):
        # the batch host's loss ends an in-allocation job (a trip through the queue): no 3 s goal there
        for f in ("node", "first") if p == "allocation" else ("node",):
            if p not in paths or f not in faults or False not in states:
                continue
            a, c = med(False, f, p), cells.get((False, f, p))
            what = "node loss" if f == "node" else "loss of the allocation's first node"
            out.append(f"  {_verdict(a <= 3.0 if a is not None else None)}  (a) idle {what}, {p} <= 3 s: "
                       + (f"{a:.2f} s (load {c['load']:.1f})" if a is not None and c else _why(c)))
    ours_path = base_path(paths)
    for f in faults:
        if True not in states:
            break
        ours, theirs = med(True, f, ours_path), med(True, f, "resubmit")
        ok = ours / theirs <= 0.1 if ours is not None and theirs else None
        wait = cells.get((True, f, "resubmit"), {}).get("queue_wait")
        out.append(f"  {_verdict(ok)}  (b) busy {f} loss, {ours_path or 'allocation'} <= 0.1 x resubmit: "
                   + (f"{ours:.2f} / {theirs:.2f} s = {ours / theirs:.3f}x (resubmission queue wait "
                      f"{wait if wait is None else round(wait)} s)" if ok is not None and ours and theirs
                      else _why(cells.get((True, f, ours_path)) if ours is None else cells.get((True, f, "resubmit")))))
    for p in paths:
        if p not in ("resubmit", "requeue", "in_allocation", "allocation") or "node" not in faults:
            continue
        for b in states:
            c = cells.get((b, "node", p))
            if not c or not c["injected"]:
                ok, text = None, _why(c)
            elif c["n"] < c["injected"]:
                ok, text = False, f"{c['n']} of {c['injected']} recovered ({_why(c)})"
            elif c["other_leaf"] < c["n"]:      # a replacement on the lost node's own leaf tests nothing here
                ok, text = None, f"{c['n'] - c['other_leaf']} of {c['n']} trials replaced the node on its own leaf"
            else:
                ok, text = True, f"{c['n']} of {c['injected']} trials, every replacement on the other leaf"
            out.append(f"  {_verdict(ok)}  (d) {'busy' if b else 'idle'} node loss, {p} recovers with a "
                       f"replacement on another leaf: {text}")
    for b in states:
        for f in faults:
            ours, theirs = med(b, f, ours_path), med(b, f, "torchrun")
            c = cells.get((b, f, "torchrun"))
            if c is None or not c["of"]:
                continue                                  # torchrun not run
            if ours is None:
                ok, text = None, f"{ours_path or 'allocation'} not measured: {_why(cells.get((b, f, ours_path)))}"
            elif theirs is None and not c["injected"]:   # no fault reached torchrun: nothing to compare
                ok, text = None, f"torchrun not measured: {'; '.join(c['unmeasured'][:1])}"
            elif theirs is None:
                ok, text = True, f"{ours:.2f} s; torchrun did not recover ({'; '.join(c['notes'][:1])})"
            else:
                ok, text = ours < theirs, f"{ours:.2f} s vs torchrun {theirs:.2f} s ({ours / theirs:.3f}x)"
            out.append(f"  {_verdict(ok)}  (c) {'busy' if b else 'idle'} {f}, ahead of torchrun: {text}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--states", default="idle,busy", help="idle, busy or both (comma-separated)")
    p.add_argument("--busy", action="store_true", help="the busy cluster only (--states busy)")
    p.add_argument("--idle", action="store_true", help="the idle cluster only (--states idle)")
    p.add_argument("--repeats", type=int, default=3, help="trials per path, fault and cluster state (medians)")
    p.add_argument("--busy-seconds", type=int, default=90, help="how long each filler job of the busy cluster runs")
    p.add_argument("--step-delay", type=float, default=0.1)
    p.add_argument("--after-steps", type=int, default=3, help="inject this many steps after the first checkpoint")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--work", type=Path, default=Path("/tmp") / f"omni-recovery-bench-{os.getpid()}")
    p.add_argument("--json", type=Path, help="write every trial here")
    p.add_argument("--memory-tier", action="store_true",
                   help="the job keeps its checkpoints in node-local memory too ([training.checkpoint] memory_tier; "
                        "in-allocation jobs only, others restore from the file system)")
    p.add_argument("--memory-every", type=int, default=0,
                   help="with --memory-tier: a memory snapshot every N steps and the file system every 10th "
                        "(the demo's cadence with 1); 0: the cadence the run chooses")
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    faults = [x for x in a.faults.split(",") if x]
    names = ["busy"] if a.busy else ["idle"] if a.idle else [x for x in a.states.split(",") if x]
    bad = sorted(set(paths) - set(PATHS)) + sorted(set(faults) - set(FAULTS)) + sorted(set(names) - {"idle", "busy"})
    if a.memory_every < 0:
        print(f"recovery_bench: --memory-every {a.memory_every} (0: the run's own cadence, or a positive count)")
        return 2
    if bad or a.repeats < 1:
        print(f"recovery_bench: unknown {bad[0] if bad else a.repeats!r} (paths: {', '.join(PATHS)}; "
              f"faults: {', '.join(FAULTS)}; states: idle, busy; repeats >= 1)")
        return 2
    states = [n == "busy" for n in ("idle", "busy") if n in names]
    bench = Bench(a.work, step_delay=a.step_delay, after_steps=a.after_steps, timeout_s=a.timeout,
                  busy_seconds=a.busy_seconds, memory_tier=a.memory_tier, memory_every=a.memory_every)
    trials: list[Trial] = []
    for busy in states:
        for fault in faults:
            for rep in range(a.repeats):
                for path in paths:
                    try:
                        t = bench.trial(path, fault, busy)
                    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                        t = Trial(path, fault, busy, None, f"trial failed: {e}", os.getloadavg()[0], injected=False)
                    trials.append(t)
                    shown = f"{t.seconds:7.2f} s" if t.seconds is not None else "    n/a  "
                    phases = " ".join(f"{k} {v:.2f}" for k, v in t.phases.items())
                    lost = f"  steps lost {t.steps_lost}, restored from {t.source}" if t.steps_lost is not None else ""
                    print(f"{'busy' if busy else 'idle'} {fault:4} {path:13} #{rep + 1} {shown}  load {t.load:5.1f}  "
                          f"{t.note}{'  [' + phases + ']' if phases else ''}{lost}", flush=True)
                    if a.json:
                        a.json.write_text(json.dumps([x.__dict__ for x in trials], indent=1))
    for line in summarize(trials, paths, faults, states):
        print(line)
    print(f"\nrerun (best on an idle machine): {shlex.join([sys.executable, *sys.argv])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
