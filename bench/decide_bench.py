"""The supervisor's own work in decide (issue 19): from the rule's confirmation to the next launch
journaled, on a synthetic job of N nodes x 4 ranks, no cluster.

    .venv/bin/python bench/decide_bench.py [--sizes 64,256,512] [--repeat 5] [--profile 512]

One real ``Supervisor`` (journal, heartbeat folder, rule, plan: its own code) over a runner that
answers Slurm's commands at once with synthetic output of the job's size (``scontrol show node``
records as Slurm 22.05 prints them, a two-level switch tree, ``squeue``), so that what is timed is the
supervisor's CPU alone, not slurmctld's. The job's ranks beat into per-node files
(``node-<NODE>.jsonl``, as the light ranks' and the runtime's leaders write them) for a few seconds
of synthetic time; then the last node's srun reports a node failure and its ranks stop beating.
Timed: the tick that confirms (the rule, the kill), the step's end, the plan and the next launch's
journal line, as the watch loop runs them. Printed per size: CPU ms (median), the log-log slope
between sizes, the Slurm commands run in decide, and with ``--profile N`` the top functions by
cumulative time at N nodes (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_omni.policy.in_allocation import StageSpec
from slurm_omni.policy.supervisor_lifecycle import LaunchRunning, Replayed, Watched
from slurm_omni.slurm.hostlist import compress, expand
from slurm_omni.slurm.runner import CommandResult
from slurm_omni.slurm.steps import SrunEvent, StepLog, parse_srun_line
from slurm_omni.supervisor.node_reads import NodeAnswer
from slurm_omni.supervisor.run import Supervisor, SupervisorOptions

TASKS_PER_NODE = 4
LEAF = 32
JOB = "4242"


def node_record(name: str, state: str) -> str:
    return (f"NodeName={name} Arch=x86_64 CoresPerSocket=1 \n   CPUAlloc=4 CPUEfctv=4 CPUTot=4 CPULoad=0.06\n"
            f"   AvailableFeatures=(null)\n   ActiveFeatures=(null)\n   Gres=(null)\n"
            f"   NodeAddr=127.0.0.1 NodeHostName=vm Port=16900 Version=22.05.8\n"
            f"   RealMemory=4096 AllocMem=0 FreeMem=23321 Sockets=4 Boards=1\n"
            f"   State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
            f"   Partitions=debug \n   BootTime=2026-11-30T00:15:11 SlurmdStartTime=2026-11-30T00:20:33\n"
            f"   CfgTRES=cpu=4,mem=4G,billing=4\n   AllocTRES=cpu=4\n\n")


class _Done:
    """A started command that has ended (scancel; the step's srun, with 137): what the supervisor reaps."""

    pid = 0

    def __init__(self, returncode: int = 0) -> None:
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


class SyntheticSlurm:
    """Answers the supervisor's Slurm commands at once for a job on ``nodes`` (``down``: DOWN)."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self.nodes = list(nodes)
        self.down: set[str] = set()
        self.calls: list[str] = []
        leaves = [self.nodes[i:i + LEAF] for i in range(0, len(self.nodes), LEAF)]
        self.topology = "".join(f"SwitchName=leaf{k} Level=0 LinkSpeed=1 Nodes={compress(leaf)}\n"
                                for k, leaf in enumerate(leaves))
        self.topology += (f"SwitchName=root Level=1 LinkSpeed=1 Nodes={compress(self.nodes)} "
                          f"Switches=leaf[0-{len(leaves) - 1}]\n")

    def run(self, argv: Sequence[str], **_: Any) -> CommandResult:
        argv = list(argv)
        self.calls.append(" ".join(argv[:3]))
        out = ""
        if argv[:3] == ["scontrol", "show", "topology"]:
            out = self.topology
        elif argv[:3] == ["scontrol", "show", "node"]:
            out = "".join(node_record(n, "DOWN" if n in self.down else "ALLOCATED") for n in expand(argv[3]))
        elif argv[0] == "squeue" and "--steps" in argv:
            out = f"{JOB}.0 omni-{JOB}-launch-0\n"
        elif argv[0] == "squeue":
            out = "RUNNING\n"
        return CommandResult(tuple(argv), 0, out, "", 0.0)

    def spawn(self, argv: Sequence[str], **_: Any) -> _Done:
        self.calls.append(" ".join(list(argv)[:2]) + " (started)")
        return _Done()


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def write_beats(hb_dir: Path, nodes: Sequence[str], *, t: float, step: int, skip: str = "",
                last: dict[int, dict[str, Any]] | None = None) -> None:
    """Every node's ``node-<NODE>.jsonl`` as its leader writes it (a header, a line per rank);
    ``last``: rank -> the fields of its last word (its phase, exit code, error)."""
    for i, node in enumerate(nodes):
        if node == skip:
            continue
        lines = [json.dumps({"node": node, "time": t})]
        for k in range(TASKS_PER_NODE):
            rank = i * TASKS_PER_NODE + k
            lines.append(json.dumps({"rank": rank, "stage": 0, "dp_rank": rank, "pid": 1000 + rank,
                                     "incarnation": 0, "job_id": JOB, "step": step, "phase": "training",
                                     "time": t, "step_time_s": 0.5, "last_checkpoint_step": None,
                                     "beats": step + 1, "node": node, **(last or {}).get(rank, {})},
                                    separators=(",", ":")))
        (hb_dir / f"node-{node}.jsonl").write_text("\n".join(lines) + "\n")


def one_decide(n: int, work: Path, profile: cProfile.Profile | None = None, *, fault: str = "node",
               watched: bool = True, exit_code: int = 1, srun_log: bool = True) -> dict[str, Any]:
    """A job of ``n`` active nodes and one spare: steady beats, the last node lost (``fault`` "node")
    or its rank crashed ("crash": srun reports the task's exit with ``exit_code`` and the step
    terminating) or hung ("hang": its ranks silent, no new step for 20 s), decide timed. ``watched``:
    the watch's full reads answered before the fault (else none came). Every rank beats once more
    after the confirmation, before the kill (at 512 nodes the ranks beat on through the kill's start);
    a crashed rank's last beat says its exit code. ``srun_log``: srun's stderr is a file the
    supervisor follows and srun ended with the step (else no srun is known: a step adopted)."""
    nodes = [f"node{k}" for k in range(1, n + 2)]
    active, lost = nodes[:n], nodes[n - 1]
    hb_dir, ckpt = work / "hb", work / "ckpt"
    hb_dir.mkdir()
    ckpt.mkdir()
    slurm = SyntheticSlurm(nodes)
    clock = Clock(1_800_000_000.0)
    opts = SupervisorOptions(stages=(StageSpec("main", n, TASKS_PER_NODE, 1),), command=("true",), job_id=JOB,
                             allocation=tuple(nodes), data_parallel_size=n * TASKS_PER_NODE, ckpt_dir=ckpt,
                             heartbeat_dir=hb_dir, incarnation=0, standby=False, log_dir=work / "logs",
                             confirmation_window_s=10.0, hang_factor=10.0)
    sup = Supervisor(opts, slurm, clock=clock)   # type: ignore[arg-type]
    sup._release_predecessors()
    sup._feed(Replayed(clock(), sup.journal.state.outcome, None))   # the first launch journaled
    cur = sup.journal.state.current
    if cur is None:
        raise SystemExit("decide_bench: the first launch was not journaled")
    observer = sup._observe(cur)
    sup._observer = observer
    sup._feed(LaunchRunning(clock()))
    # steady state: 6 s of beats every second, a step every second, polled every 0.5 s
    t0 = clock.now
    for s in range(12):
        clock.now = t0 + 0.5 * s
        if s % 2 == 0:
            write_beats(hb_dir, active, t=clock.now, step=s // 2)
        sup._heartbeats(cur, observer)
        if watched and s % 6 == 0:   # the watch's full read of the job's and nodes' states (its thread: not timed)
            names = (*cur.layout.nodes, *cur.layout.spares)
            sup._known.take(NodeAnswer(tuple(sup.slurm.node_info(names)[0]), clock.now, clock.now, True,
                                       sup.slurm.job_state()))
        sup._feed(Watched(at=clock.now, decision=observer.confirmer.evaluate(clock.now)), cur=cur)
    # the fault: the last node's ranks stop; its srun says so; Slurm shows it DOWN
    fault_at = clock.now
    for s in range(1, 9 if fault != "hang" else 41):   # a hang: no new step, the lost node's ranks silent, 20 s
        clock.now = fault_at + 0.5 * s
        if s % 2 == 0:
            write_beats(hb_dir, active, t=clock.now, step=6 + (s // 2 if fault != "hang" else 0), skip=lost)
        sup._heartbeats(cur, observer)
    if fault == "node":
        slurm.down.add(lost)
        observer.srun(SrunEvent(clock.now, "node_failure", node=lost, step_id=f"{JOB}.0"), ending_on_request=False)
    elif fault == "crash":
        crashed = n * TASKS_PER_NODE - 1
        said = f"srun: error: {lost}: task {crashed}: Exited with exit code {exit_code}\n" \
               f"srun: Terminating StepId={JOB}.0\n"
        for line in said.splitlines():
            event = parse_srun_line(line, clock.now)
            if event is not None:   # as the watch loop took them
                observer.srun(event, ending_on_request=False)
        if srun_log:
            (work / "srun.err").write_text(said + "".join(f"srun: error: {node}: tasks {4 * i}-{4 * i + 3}: Killed\n"
                                                          for i, node in enumerate(active[:-1])))
    if srun_log and fault == "crash":
        sup._step_log = StepLog.follow(str(work / "srun.err"))
        sup._proc = _Done(137)   # type: ignore[assignment]
    slurm.calls.clear()
    observer.scanner.stats = {"listdir": 0, "stat": 0, "open": 0}   # the files decide opens (its scans')
    # decide: the tick that confirms (kill), the grace's end (the step counted ended), the plan, journaled
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    sup._feed(Watched(at=clock.now, decision=observer.confirmer.evaluate(clock.now)), cur=cur)
    crashed_last = {n * TASKS_PER_NODE - 1: {"phase": "failed", "exit_code": exit_code, "error": "bad --lr"}} \
        if fault == "crash" else {}
    write_beats(hb_dir, active, t=clock.now + 0.1, step=10, last=crashed_last)   # beats until the kill
    rc = sup._feed(Watched(at=clock.now), cur=cur)
    code = sup._after(cur, rc if rc is not None else 137)
    if profile is not None:
        profile.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    nxt = sup.journal.state.current
    if code is None and (nxt is None or nxt.number != 1 or (fault == "node") == (lost in nxt.layout.nodes)):
        raise SystemExit(f"decide_bench: the next launch was not planned {'without' if fault == 'node' else 'with'} "
                         f"{lost} at {n} nodes")   # crash, hang: in place
    return {"cpu": cpu, "wall": wall, "commands": list(slurm.calls), "next": nxt, "code": code,
            "opened": observer.scanner.stats["open"]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,512", help="Active nodes per job, comma-separated.")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="cProfile decide at this size (one run).")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="omni-decide-") as tmp:
                runs.append(one_decide(n, Path(tmp)))
        cpu = statistics.median(r["cpu"] for r in runs)
        wall = statistics.median(r["wall"] for r in runs)
        rows.append((n, cpu, wall, runs[0]["commands"]))
    print(f"decide's own work (confirmation -> next launch journaled), {TASKS_PER_NODE} ranks per node, "
          f"median of {args.repeat}; Slurm answered at once (synthetic)")
    print(f"{'nodes':>6} {'ranks':>6} {'cpu ms':>8} {'wall ms':>8}  commands in decide")
    for n, cpu, wall, cmds in rows:
        print(f"{n:>6} {n * TASKS_PER_NODE:>6} {cpu * 1e3:>8.1f} {wall * 1e3:>8.1f}  {', '.join(cmds) or 'none'}")
    for (a, ca, _, _), (b, cb, _, _) in itertools.pairwise(rows):
        if ca > 0 and cb > 0:
            print(f"  log-log slope of decide's CPU {a} -> {b} nodes: {math.log(cb / ca) / math.log(b / a):+.2f}")
    if args.profile:
        prof = cProfile.Profile()
        with tempfile.TemporaryDirectory(prefix="omni-decide-") as tmp:
            one_decide(args.profile, Path(tmp), prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(f"\ncProfile of decide at {args.profile} nodes (cumulative):")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
