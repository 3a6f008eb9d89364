"""Recovery and the control plane at 8 to 512 emulated nodes on one machine (issue 19's scale lane).

    python bench/scale_bench.py                          # 8, 64, 256, 512 nodes (not in CI)
    python bench/scale_bench.py --sizes 8,64 --ctld-port 61017 --slurmd-base-port 61100 --first-job-id 4001

Per size it brings the embedded cluster up with that many slurmd (``omni cluster up --nodes N``,
leaves of 16 nodes, its own state directory), submits one ``--no-kill`` allocation of every node
whose batch script runs the step supervisor (``omni supervise``, the in-allocation path, warm
standbys off) over N-1 active nodes and one spare, 4 light ranks per node (``bench/light_rank.py``:
the runtime's environment, heartbeats, checkpoint markers and exit codes without torch). Once every
rank has checkpointed it sets a node that runs ranks DOWN (``scontrol update state=DOWN``) and times
the recovery from the product's own timestamps:

  detect      fault -> the supervisor's first signal of it (journal ``confirmed.detected_at``)
  confirm     -> the rule confirmed it (``confirmed_at``)
  decide      -> the next launch journaled (``launch`` record: kill, job and node states, placement)
  launch      -> every task of the next launch running (the last rank's ``task_started_at``, its
                 first metrics line: srun to 4(N-1) processes)
  rendezvous  -> every rank joined rank 0's store and agreed on the restored step (the last
                 ``groups_ready_at``)
  first step  -> the first step after the restore (journal ``first_step``)

and the supervisor's own CPU (utime + stime from /proc) per heartbeat poll (every 0.5 s) in steady
state, before the fault. At the end of each size it checks, from the files, that every rank of the
new launch restored the same step and that the run finished (journal ``done``, every rank's last
beat ``done`` at max steps, the job COMPLETED). The end prints the table and the log-log slope of
each phase between the smallest and the largest size measured. A size that cannot run here (too
little memory, a timeout) prints n/a and why, never a figure.

Memory per daemon and per rank is measured at every size (private memory, /proc/PID/smaps_rollup):
the next size is refused beforehand when it would not fit in MemAvailable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slurm_omni.cluster.local import LocalCluster
from slurm_omni.cluster.spec import ClusterSpec
from slurm_omni.errors import SlurmError
from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import HeartbeatRecord
from slurm_omni.formats.metrics import parse_line
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path
from slurm_omni.supervisor.run import SupervisorOptions

LIGHT_RANK = REPO / "bench" / "light_rank.py"
PHASES = ("detect", "confirm", "decide", "launch", "rendezvous", "first_step")
TASKS_PER_NODE = 4
_POLL = next(f.default for f in dataclasses.fields(SupervisorOptions) if f.name == "heartbeat_poll_s")
HEARTBEAT_POLL_S = _POLL if isinstance(_POLL, float) else 0.5
"""The supervisor reads the heartbeats this often."""
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    nodes: int
    ranks: int = 0
    na: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    total: float | None = None
    up_s: float | None = None
    cpu_per_poll: float | None = None
    srun_cpu_per_s: float | None = None
    memory: dict[str, float] = field(default_factory=dict)
    """Mean private MiB: slurmd, slurmstepd, rank; idle slurmd CPU (ms per s)."""
    checks: list[str] = field(default_factory=list)
    load: float = 0.0
    scan: tuple[float, float] | None = None
    step_s: float | None = None
    """The ranks' median step time in steady state (their heartbeats' step_time_s), paced at --step-delay."""
    """One heartbeat scan over this many ranks' files: CPU and wall seconds."""


# -- /proc ---------------------------------------------------------------------------------------
def private_mib(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = sum(int(line.split()[1]) for line in text.splitlines() if line.startswith(("Private_Clean", "Private_Dirty")))
    return kb / 1024


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cmdline(pid: int) -> list[str]:
    try:
        return [c.decode(errors="replace") for c in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if c]
    except OSError:
        return []


def pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- one size ------------------------------------------------------------------------------------
class Size:
    def __init__(self, args: argparse.Namespace, nodes: int, root: Path) -> None:
        self.args = args
        self.nodes = nodes
        self.work = root / f"n{nodes}"
        self.spec = ClusterSpec(nodes=nodes, nodes_per_switch=4 if nodes <= 8 else 16, cpus_per_node=TASKS_PER_NODE,
                                gpus_per_node=0, ctld_port=args.ctld_port, slurmd_base_port=args.slurmd_base_port,
                                first_job_id=args.first_job_id, partitions=())
        self.cluster = LocalCluster(Path(args.state_dir), self.spec)
        self.runner = CommandRunner(self.cluster.env, timeout_s=60)
        # the bench's own polls: one quick try (a slurmctld gone must not hold the table for minutes)
        self.poller = CommandRunner(self.cluster.env, timeout_s=20, retries=1)
        self.result = Result(nodes=nodes, ranks=TASKS_PER_NODE * (nodes - 1))
        self.job_id = ""

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} n={self.nodes}] {msg}", flush=True)

    def up(self) -> None:
        recorded = self.cluster.recorded_spec()
        if recorded is not None and recorded != self.spec and any(self.cluster.running().values()):
            self.log("taking the previous cluster down")
            LocalCluster(Path(self.args.state_dir)).down()
        started = time.monotonic()
        self.cluster.up(wait_s=120)
        self.result.up_s = time.monotonic() - started
        self.log(f"cluster up in {self.result.up_s:.1f}s")
        slurmds = [pid for name, pid in self.cluster.running().items() if name.startswith("slurmd:") and pid]
        before = {p: cpu_s(p) for p in slurmds}
        time.sleep(5)
        cpu = [(c - b) / 5 for p, b in before.items() if b is not None and (c := cpu_s(p)) is not None]
        mem = [m for p in slurmds if (m := private_mib(p)) is not None]
        self.result.memory["slurmd_mib"] = mean(mem) or 0.0
        self.result.memory["slurmd_idle_cpu_ms_per_s"] = 1000 * (mean(cpu) or 0.0)
        ctld = self.cluster.running().get("slurmctld")
        if ctld:
            self.result.memory["slurmctld_mib"] = private_mib(ctld) or 0.0

    def submit(self) -> None:
        w = self.work
        for d in ("ckpt", "hb", "metrics", "logs"):
            (w / d).mkdir(parents=True, exist_ok=True)
        (w / "hb").chmod(0o700)
        active = self.nodes - 1
        env = {
            "OMNI_CKPT_DIR": w / "ckpt", "OMNI_HEARTBEAT_DIR": w / "hb", "OMNI_METRICS_DIR": w / "metrics",
            "OMNI_LOG_DIR": w / "logs", "OMNI_DP_SIZE": TASKS_PER_NODE * active, "OMNI_STAGES": "main",
            "OMNI_MAX_STEPS": self.args.max_steps, "OMNI_STEP_DELAY_S": self.args.step_delay,
            "OMNI_HEARTBEAT_INTERVAL": 1, "OMNI_JOB_NAME": f"scale-{self.nodes}", "OMNI_STANDBY": 0,
            "OMNI_LIGHT_CKPT_EVERY": self.args.ckpt_every, "OMNI_COLLECTIVE_TIMEOUT": self.args.timeout,
        }
        if self.args.heartbeat_node_dir:   # one heartbeat file per node (elastic/heartbeat.py)
            env["OMNI_HEARTBEAT_NODE_DIR"] = self.args.heartbeat_node_dir
        exports = "\n".join(f"export {k}={shlex.quote(str(v))}" for k, v in env.items())
        supervise = [sys.executable, "-m", "slurm_omni.cli.main", "supervise",
                     f"--stages=main:{active}:{TASKS_PER_NODE}:1", "--heartbeat-interval=1", "--no-standby",
                     "--", sys.executable, "-S", str(LIGHT_RANK)]
        script = w / "job.sbatch"
        script.write_text(
            "#!/bin/bash\n"
            f"#SBATCH --job-name=scale-{self.nodes}\n#SBATCH --nodes={self.nodes}\n"
            f"#SBATCH --ntasks-per-node={TASKS_PER_NODE}\n#SBATCH --no-kill\n#SBATCH --time=01:00:00\n"
            f"#SBATCH --output={w / 'batch.out'}\n#SBATCH --chdir={REPO}\n"
            f"{exports}\nexport PYTHONPATH={shlex.quote(str(REPO))}\n"
            f"exec {shlex.join(supervise)}\n")
        proc = self.runner.run(["sbatch", "--parsable", str(script)])
        self.job_id = proc.stdout.strip().split(";")[0]
        self.log(f"job {self.job_id}: {self.result.ranks} light ranks on {active} nodes + 1 spare")

    def journal(self) -> SupervisorJournal:
        return SupervisorJournal(journal_path(self.work / "ckpt", self.job_id))

    def raw_journal(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(line) for line in journal_path(self.work / "ckpt", self.job_id).read_text().splitlines()
                    if line.strip()]
        except (OSError, ValueError):
            return []

    def wait(self, what: str, cond: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            if self.job_finished():
                return bool(cond())
            time.sleep(1.0)
        return False

    def job_state(self) -> str:
        try:
            proc = self.poller.run(["scontrol", "show", "job", "-o", self.job_id], check=False)
        except SlurmError:
            return "?"
        for part in proc.stdout.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        return "?"

    def job_finished(self) -> bool:
        return self.job_state() in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    def beats(self, incarnation: int) -> list[Any]:
        return [b for b in read_heartbeats(self.work / "hb") if b.incarnation == incarnation]

    def supervisor_pid(self) -> int | None:
        for pid in pids():
            argv = cmdline(pid)
            if "supervise" in argv and any(a.startswith("--stages=main:") for a in argv):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if f"SLURM_JOB_ID={self.job_id}\0".encode() in env:
                    return pid
        return None

    def steady_state(self, inc: int) -> None:
        """The supervisor's CPU per heartbeat poll, srun's CPU, and memory per process, before the fault."""
        sup = self.supervisor_pid()
        sruns = [p for p in pids() if cmdline(p)[:1] == ["srun"] and f"--job-name=omni-{self.job_id}-launch-0"
                 in cmdline(p)]
        window = self.args.cpu_window
        if sup is not None:
            b0, s0 = cpu_s(sup), [cpu_s(p) for p in sruns]
            time.sleep(window)
            b1, s1 = cpu_s(sup), [cpu_s(p) for p in sruns]
            if b0 is not None and b1 is not None:
                self.result.cpu_per_poll = (b1 - b0) / (window / HEARTBEAT_POLL_S)
            used = [b - a for a, b in zip(s0, s1, strict=True) if a is not None and b is not None]
            if used:
                self.result.srun_cpu_per_s = sum(used) / window
        steps, ranks = [], []
        tag = f"[{self.job_id}."
        for pid in pids():
            argv = cmdline(pid)
            if argv and argv[0].startswith("slurmstepd") and tag in " ".join(argv):
                steps.append(pid)
            elif len(argv) == 3 and argv[1:] == ["-S", str(LIGHT_RANK)]:   # not srun, not the supervisor
                ranks.append(pid)
        self.result.memory["slurmstepd_mib"] = mean([m for p in steps if (m := private_mib(p)) is not None]) or 0.0
        self.result.memory["rank_mib"] = mean([m for p in ranks[:256] if (m := private_mib(p)) is not None]) or 0.0
        self.result.memory["slurmstepd_count"] = len(steps)
        self.result.memory["rank_count"] = len(ranks)

    def run(self) -> Result:
        r, args = self.result, self.args
        self.up()
        self.submit()
        ranks = r.ranks
        every = args.ckpt_every
        # launch 0 running, and every rank past its second checkpoint
        ok = self.wait("launch 0", lambda: (la := self.journal().state.launches) and la[0].first_step_at, args.timeout)
        if not ok:
            r.na = f"launch 0 made no step within {args.timeout:.0f}s (job {self.job_state()}; {self.work}/logs)"
            return r
        inc0 = self.journal().state.launches[0].incarnation
        ok = self.wait("checkpoints", lambda: len(b := self.beats(inc0)) == ranks and
                       min(x.last_checkpoint_step or 0 for x in b) >= 2 * every, args.timeout)
        if not ok:
            r.na = f"the ranks did not all checkpoint step {2 * every} within {args.timeout:.0f}s"
            return r
        self.log("launch 0 steady: measuring the control plane")
        self.steady_state(inc0)
        times = sorted(b.step_time_s for b in self.beats(inc0) if b.step_time_s is not None)
        r.step_s = times[len(times) // 2] if times else None
        st = self.journal().state
        victim = st.launches[0].layout.components[0][-1]
        held = [x.last_checkpoint_step for x in self.beats(inc0)]
        if min(s or 0 for s in held) >= args.max_steps - every:
            r.na = "the run got too close to max steps before the fault (raise --max-steps)"
            return r
        r.load = os.getloadavg()[0]
        fault_at = time.time()
        self.runner.run(["scontrol", "update", f"nodename={victim}", "state=DOWN", "reason=scale-bench"])
        self.log(f"{victim} set DOWN (load {r.load:.1f})")
        try:
            ok = self.wait("relaunch", lambda: len(la := self.journal().state.launches) > 1 and la[1].first_step_at,
                           args.timeout)
            if not ok:
                st = self.journal().state
                r.na = (f"no first step of a relaunch within {args.timeout:.0f}s (launches {len(st.launches)}, "
                        f"outcome {st.outcome or '-'}, job {self.job_state()})")
                return r
            self.log("relaunched; waiting for the run to finish")
            finished = self.wait("done", lambda: self.job_finished(), args.timeout)
            self.phases(fault_at)
            self.check(finished)
        finally:
            self.runner.run(["scontrol", "update", f"nodename={victim}", "state=RESUME"], check=False)
        return r

    def phases(self, fault_at: float) -> None:
        r = self.result
        st = self.journal().state
        l0, l1 = st.launches[0], st.launches[1]
        conf = l0.confirmed
        first = self.first_lines(l1.incarnation)
        started = [float(x["task_started_at"]) for x in first.values() if x.get("task_started_at")]
        ready = [float(x["groups_ready_at"]) for x in first.values() if x.get("groups_ready_at")]
        marks: list[tuple[str, float | None]] = [
            ("detect", conf.detected_at if conf else None), ("confirm", conf.confirmed_at if conf else None), ("decide", l1.started_at),
            ("launch", max(started) if len(started) == r.ranks else None),
            ("rendezvous", max(ready) if len(ready) == r.ranks else None), ("first_step", l1.first_step_at)]
        prev: float | None = fault_at
        for name, at in marks:
            if at is not None and prev is not None:
                r.phases[name] = float(at) - prev
            prev = float(at) if at is not None else None
        if l1.first_step_at is not None:
            r.total = l1.first_step_at - fault_at

    def first_lines(self, incarnation: int) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for path in (self.work / "metrics").glob("metrics-*.jsonl"):
            for number, line in enumerate(path.read_text().splitlines()):
                rec = parse_line(line, f"{path}:{number + 1}")
                if rec.incarnation == incarnation and rec.rank not in out:
                    out[rec.rank] = json.loads(line)
        return out

    def check(self, finished: bool) -> None:
        r, st = self.result, self.journal().state
        l1 = st.launches[-1]
        first = self.first_lines(l1.incarnation)
        restored = {x.get("restored_step") for x in first.values()}
        ok_restore = len(first) == r.ranks and len(restored) == 1 and next(iter(restored)) not in (None, 0)
        r.checks.append(f"{'PASS' if ok_restore else 'FAIL'} every rank of launch {l1.number} restored the same step: "
                        f"{len(first)}/{r.ranks} ranks, restored steps {sorted(s for s in restored if s is not None)}")
        beats = self.beats(l1.incarnation)
        done = [b for b in beats if b.phase == "done" and b.exit_code == 0 and b.step == self.args.max_steps]
        state = self.job_state()
        ok_done = finished and st.outcome == "done" and len(done) == r.ranks and state == "COMPLETED"
        r.checks.append(f"{'PASS' if ok_done else 'FAIL'} the run finished: journal {st.outcome or '-'}, "
                        f"{len(done)}/{r.ranks} ranks done at step {self.args.max_steps}, job {state}")


# -- the table -----------------------------------------------------------------------------------
def fmt(v: float | None, unit: str = "s", digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def slope(a: tuple[int, float | None], b: tuple[int, float | None]) -> str:
    (n0, v0), (n1, v1) = a, b
    if v0 is None or v1 is None or v0 <= 0 or v1 <= 0 or n0 == n1:
        return "n/a"
    return f"{math.log(v1 / v0) / math.log(n1 / n0):+.2f}"


def report(results: list[Result], heartbeat_node_dir: str = "") -> None:
    beats = f"a heartbeat file per node (OMNI_HEARTBEAT_NODE_DIR={heartbeat_node_dir})" if heartbeat_node_dir \
        else "a heartbeat file per rank"
    print(f"\nnode loss, in-allocation path (step supervisor), 4 light ranks per active node, 1 spare, {beats}")
    head = f"{'nodes':>5} {'ranks':>5} " + " ".join(f"{p:>10}" for p in (*PHASES, "total")) + \
        f" {'cpu/poll':>9} {'srun cpu':>9} {'load':>5}"
    print(head)
    for r in results:
        if r.na:
            print(f"{r.nodes:>5} {r.ranks:>5}  n/a: {r.na}")
            continue
        print(f"{r.nodes:>5} {r.ranks:>5} " + " ".join(f"{fmt(r.phases.get(p)):>10}" for p in PHASES) +
              f" {fmt(r.total):>10} {fmt(None if r.cpu_per_poll is None else 1000 * r.cpu_per_poll, 'ms', 1):>9}"
              f" {fmt(r.srun_cpu_per_s, 's/s'):>9} {r.load:>5.1f}")
    print("\nmemory (private MiB per process) and cost of the cluster")
    for r in results:
        m = r.memory
        if not m:
            continue
        print(f"{r.nodes:>5} nodes: up {fmt(r.up_s, 's', 0)}; ranks step in {fmt(r.step_s)}; slurmd {m.get('slurmd_mib', 0):.1f} MiB "
              f"(idle {m.get('slurmd_idle_cpu_ms_per_s', 0):.1f} ms CPU/s each), slurmctld "
              f"{m.get('slurmctld_mib', 0):.1f} MiB, slurmstepd {m.get('slurmstepd_mib', 0):.1f} MiB "
              f"x {int(m.get('slurmstepd_count', 0))}, light rank {m.get('rank_mib', 0):.1f} MiB "
              f"x {int(m.get('rank_count', 0))}")
    measured = [r for r in results if not r.na]
    pairs = [(measured[0], measured[-1])] if len(measured) >= 2 else []
    from64 = [r for r in measured if r.nodes >= 64]
    if len(from64) >= 2 and from64[0] is not measured[0]:   # the issue's: 64 to the largest
        pairs.append((from64[0], from64[-1]))
    if pairs:
        print("\nlog-log slope (1: linear in nodes; 0: flat)")
        print(f"  {'':<11} " + " ".join(f"{f'{a.nodes}->{b.nodes}':>10}" for a, b in pairs))
        for p in (*PHASES, "total", "cpu/poll"):
            def value(r: Result, p: str = p) -> float | None:
                return r.total if p == "total" else r.cpu_per_poll if p == "cpu/poll" else r.phases.get(p)
            print(f"  {p:<11} " + " ".join(f"{slope((a.nodes, value(a)), (b.nodes, value(b))):>10}" for a, b in pairs))
    print("\none full heartbeat scan (read_heartbeats: every file read, as a first poll) over synthetic per-rank "
          "files, CPU / wall, median of 5 (a poll after the first reads what changed: bench/heartbeat_bench.py)")
    for r in results:
        if r.scan is not None:
            print(f"  {r.ranks:>5} ranks: {1000 * r.scan[0]:.1f} ms / {1000 * r.scan[1]:.1f} ms "
                  f"({1e6 * r.scan[0] / max(1, r.ranks):.0f} us CPU per file)")
    print("\nchecks")
    for r in results:
        for line in r.checks or ([f"n/a: {r.na}"] if r.na else []):
            print(f"  {r.nodes:>4} nodes: {line}")


def scan_cost(ranks: int, work: Path) -> tuple[float, float]:
    """CPU and wall seconds of one ``read_heartbeats`` (what the supervisor and the manager run per
    poll) over ``ranks`` heartbeat files written here (the median of 5): the part of the poll that
    grows with the ranks, measured without a cluster, so also for a size that cannot run."""
    folder = work / f"scan-{ranks}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = time.time()
    for r in range(ranks):
        (folder / f"rank-{r}.json").write_bytes(encode(HeartbeatRecord(
            rank=r, stage=0, dp_rank=r, pid=1000 + r, incarnation=1, job_id="1", step=17, phase="training",
            time=now, step_time_s=0.5, last_checkpoint_step=15, beats=9, node=f"node{r // TASKS_PER_NODE + 1}")))
    runs = []
    for _ in range(5):
        c0, w0 = time.process_time(), time.perf_counter()
        read_heartbeats(folder)
        runs.append((time.process_time() - c0, time.perf_counter() - w0))
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    return sorted(c for c, _ in runs)[2], sorted(w for _, w in runs)[2]


SATURATED = 3.0
"""The ranks step this many times slower than paced: the machine's cores are the limit."""


def saturated(nodes: int, measured: list[Result], paced_s: float) -> str:
    """Empty unless a smaller size already saturated the machine (its ranks stepped SATURATED x slower
    than paced: every figure of a larger one would be the machine's, not the control plane's)."""
    prev = next((r for r in reversed(measured) if r.step_s is not None), None)
    if prev is None or prev.step_s is None or prev.step_s < SATURATED * paced_s:
        return ""
    return (f"the machine's own limit: at {prev.nodes} nodes the {prev.ranks} light ranks already stepped in "
            f"{prev.step_s:.1f} s instead of the paced {paced_s:.1f} s (load {prev.load:.0f} on "
            f"{os.cpu_count()} cores), and {TASKS_PER_NODE * (nodes - 1)} would need twice the CPU")


def fits(nodes: int, measured: list[Result], reserve_mib: float) -> str:
    """Empty when the size fits in MemAvailable by the per-process figures measured so far."""
    got = [r.memory for r in measured if r.memory.get("rank_mib")]
    if not got:
        return ""
    m = got[-1]
    ranks = TASKS_PER_NODE * (nodes - 1)
    need = nodes * (m["slurmd_mib"] + m["slurmstepd_mib"]) + ranks * m["rank_mib"]
    have = mem_available_mib() - reserve_mib
    if need > have:
        return (f"needs about {need / 1024:.1f} GiB ({nodes} x slurmd {m['slurmd_mib']:.1f} + slurmstepd "
                f"{m['slurmstepd_mib']:.1f} MiB, {ranks} ranks x {m['rank_mib']:.1f} MiB), {have / 1024:.1f} GiB "
                f"available after a {reserve_mib / 1024:.0f} GiB reserve")
    return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,512", help="Node counts, comma-separated.")
    p.add_argument("--state-dir", default=str(REPO / ".omni" / "cluster-scale"))
    p.add_argument("--work", default=str(REPO / ".omni" / "scale-bench"), help="The job's files (the checkpoint folder).")
    p.add_argument("--ctld-port", type=int, default=16817)
    p.add_argument("--slurmd-base-port", type=int, default=16900)
    p.add_argument("--first-job-id", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--step-delay", type=float, default=0.5, help="Seconds per light step.")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--cpu-window", type=float, default=10.0, help="Seconds of steady state the CPU is measured over.")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds each wait of a size may take.")
    p.add_argument("--reserve-gib", type=float, default=3.0, help="Memory left to the rest of the machine.")
    p.add_argument("--keep-cluster", action="store_true", help="Leave the last size's cluster up.")
    p.add_argument("--heartbeat-node-dir", default="",
                   help="OMNI_HEARTBEAT_NODE_DIR for the ranks (e.g. /dev/shm): one heartbeat file per node instead "
                        "of one per rank (bench/heartbeat_bench.py measures both)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    root = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
    results: list[Result] = []
    try:
        for n in sizes:
            scan = scan_cost(TASKS_PER_NODE * (n - 1), root)
            why = fits(n, results, args.reserve_gib * 1024) or saturated(n, results, args.step_delay)
            if why:
                results.append(Result(nodes=n, ranks=TASKS_PER_NODE * (n - 1), na=why, scan=scan))
                print(f"[n={n}] n/a: {why}", flush=True)
                continue
            size = Size(args, n, root)
            size.result.scan = scan
            try:
                results.append(size.run())
            except Exception as e:  # noqa: BLE001 (one size's failure is its n/a, not the end of the table)
                size.result.na = f"{type(e).__name__}: {e}"
                results.append(size.result)
            finally:
                if not (args.keep_cluster and n == sizes[-1]):
                    size.cluster.down()
    finally:
        report(results, args.heartbeat_node_dir)
    return 0 if all(not r.na and all(c.startswith("PASS") for c in r.checks) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
