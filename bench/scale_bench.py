"""Recovery and the control plane at 8 to 512 emulated nodes on one machine (issue 19's scale lane).

    python bench/scale_bench.py                          # 8, 64, 256, 512 nodes (not in CI)
    python bench/scale_bench.py --sizes 8,64 --ctld-port 61017 --slurmd-base-port 61100 --first-job-id 4001
    python bench/scale_bench.py --sizes 8 --faults node --paths alloc      # one fault, one path

Per size it brings the embedded cluster up with that many slurmd (``omni cluster up --nodes N``,
leaves of 16 nodes, its own state directory) and runs one job per path, 4 light ranks per active
node (``bench/light_rank.c``, compiled here with cc, or with ``--rank python`` its reference
``bench/light_rank.py``: the runtime's environment, heartbeats, checkpoint markers and exit codes
without torch), one spare per fault, warm standbys off:

  inalloc  ``sbatch --no-kill`` whose batch script runs the step supervisor (``omni supervise``);
  alloc    ``salloc --no-shell --no-kill`` and the supervisor outside it (``omni supervise
           --allocation=J``, allocation mode: docs/allocation-mode.md), which releases it when done.

Each job takes every fault in turn (``--faults``, default node, crash, hang), each once the launch
running has checkpointed past the step it restored:

  node   a node that runs ranks set DOWN (``scontrol update state=DOWN``);
  crash  a rank SIGKILLed;
  hang   a rank SIGSTOPped, and its peers told (light_rank.BLOCK_SIGNAL) that the collective it
         never joins does not return: they beat and stop stepping, as real ranks do;
  shrink (not by default; after node) a second node set DOWN once the spare is taken: the supervisor
         relaunches one node short, data parallelism shrunk (its ranks checked as the shrunk launch's).

The ranks step in step on rank 0's clock (as a collective keeps real ranks) with a budget of steps
they never reach (the job's time limit at the pace), so no fault depends on how far the ranks of a
killed step ran on (at 512 nodes a node loss leaves them stepping for its whole confirmation): each
fault waits for the launch running to checkpoint past the step it restored, and once the last
fault's recovery has stepped the bench ends the run itself: it writes a finish time, and every light
rank ends at the first step of its life due at or after it (bench/scale_end.py,
``OMNI_LIGHT_FINISH_FILE``). A relaunch the supervisor makes on its own (a hang confirmed where none
was injected) is followed, and named by a check. The supervisors run with a 10 s hang window and a
hang factor of 10 (``--confirmation-window``, ``--hang-factor``; the site's defaults are 30 and 30): a
hang confirms in about 10 s instead of 30, a policy constant, not a cost of scale.

and times each recovery from the product's own timestamps:

  detect      fault -> the supervisor's first signal of it (journal ``confirmed.detected_at``)
  confirm     -> the rule confirmed it (``confirmed_at``)
  decide      -> the next launch journaled (``launch`` record: kill, job and node states, placement)
  launch      -> every task of the next launch running (the last rank's ``task_started_at``, its
                 first metrics line: srun to 4 x active nodes processes)
  rendezvous  -> every rank joined rank 0's store and agreed on the restored step (the last
                 ``groups_ready_at``)
  first step  -> every rank made its first step after the restore (the last rank's first metrics
                 line of the new launch; one paced step, --step-delay, is in it)

Decide is split into its Slurm commands (each named; the same two timed bare by the bench in steady
state, slurmctld's answer at that size with no failure to handle) and the supervisor's own CPU in it
(its debug log), which the machine's load does not stretch; launch against its floor (every
slurmstepd's and every rank's start on this machine's cores); rendezvous against its floor
(``JOIN_FLOOR``: as many running processes joining one server and waking on its answer, with no
Slurm and no interpreter's start). The bar for every phase from the confirmation to the first step
is a log-log slope of at most 0.5 between 64 and 512 nodes; a phase above it is LIMIT when what the
control plane itself does stays within the bar and the floor measured beside it grows as the phase
does (named with its figures), else MISS.

with the control plane's CPU: the supervisor's (utime + stime from /proc) per heartbeat poll (every
0.5 s) in steady state, and per recovery (fault -> first step) the supervisor's with its sruns,
scancels and squeues, and slurmctld's. At the end of each job it checks, from the files, that every
rank of every relaunch restored the same step, that every relaunch followed a fault the bench
injected, and that the run finished (journal ``done``, every rank's last beat ``done`` at one step,
saved, below the budget, the job COMPLETED, or in allocation mode CANCELLED by its supervisor, which
exits 0). The end prints the table, the log-log slope of each phase between 64
nodes (else the smallest) and the largest size measured, the machine's own limit when the ranks'
step time shows it, and writes the figures as JSON (``--json``; ``python -m bench.goodput
--scale-json`` fits them). A size that cannot run here (too little memory, a timeout, a machine
already saturated by the size before) prints n/a and why, never a figure. Last, where each size's
wall time went (``WALL``) and the whole run's wall time against issue 19's bar of 15 minutes with
8, 64, 256 and 512 nodes in it (PASS only when every one of them ran every fault here).

Memory per daemon and per rank is measured at every size (private memory, /proc/PID/smaps_rollup):
the next size is refused beforehand when it would not fit in MemAvailable, and a job whose old and
new launch would not fit at once asks the supervisor to wait for the killed step (``--kill-grace``).
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu_share import Sampler, others_line, share_line
from bench.heartbeat_bench import Inotify
from bench.light_build import BUILD_DIR, rank_argv
from bench.light_rank import BLOCK_SIGNAL
from bench.metrics_tail import MetricsTail
from bench.scale_end import (
    JOB_TIME_S,
    beats_said,
    finish_check,
    finish_time,
    launch_ranks,
    ranks_said,
    step_budget,
    unplanned,
    wait_ended,
)
from slurm_omni.cluster.local import NODE_MUNGED, LocalCluster
from slurm_omni.cluster.spec import LARGE_SETTINGS, ClusterSpec
from slurm_omni.errors import SlurmError
from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import NODE_DIR_OFF, HeartbeatRecord, node_dir_setting
from slurm_omni.fsio import write_atomic
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.runner import CommandRunner, ScontrolSession
from slurm_omni.slurm.steps import step_name
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path
from slurm_omni.supervisor.run import SupervisorOptions

LIGHT_RANK = REPO / "bench" / "light_rank.py"
C_RANK = BUILD_DIR / "light_rank"
RANK_ARGV: list[str] = [sys.executable, "-S", str(LIGHT_RANK)]
"""One rank's command: the C rank unless --rank python (or no compiler), set by main."""
RANK_KIND = "python -S bench/light_rank.py"


def is_light_rank(argv: list[str]) -> bool:
    """A light rank's process, of either kind (a run before this one may have left the other)."""
    return argv[1:] == ["-S", str(LIGHT_RANK)] or argv == [str(C_RANK)]
PHASES = ("detect", "confirm", "decide", "launch", "rendezvous", "first_step")
SPLIT = ("decide_cmds", "decide_cpu", "decide_wait", "teardown", "to_srun", "srun_to_task", "task_spread", "rdv_listen", "rdv_join", "rdv_answer")
"""decide_cmds: the blocking Slurm commands' seconds inside decide (the rest is the supervisor's own
work); decide_cpu: the supervisor's own CPU seconds in decide (its debug log: the process's CPU when
it confirmed and when it journaled the next launch), which the machine's load does not stretch;
decide_wait: the seconds the deciding thread was runnable and waited for a core from the killed step's
end (its last ``deciding`` line) to the next launch's record (the kernel's schedstat in those lines):
the machine's load on the control plane, not its work;
teardown: the killed step's srun ending after the kill (the supervisor's line ``its srun ended X s
after the kill``): Slurm's slurmstepd killing every task of the step, inside decide, which the next
launch waits for from 512 nodes (``--kill-grace``);
to_srun: the next launch journaled -> its srun started; srun_to_task: -> the first task running;
task_spread: the first task -> the last (launch = to_srun + srun_to_task + task_spread); rdv_join: the
last task running -> rank 0's store had every join and answered, of which rdv_listen is the part before
rank 0's store listened (its line in the step's output, ``STORE_LINE``; 0 when it listened before the
last task ran); rdv_answer: -> the last rank read its answer."""
TASKS_PER_NODE = 4
_POLL = next(f.default for f in dataclasses.fields(SupervisorOptions) if f.name == "heartbeat_poll_s")
HEARTBEAT_POLL_S = _POLL if isinstance(_POLL, float) else 0.5
"""The supervisor reads the heartbeats this often."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
IDLE_S = 1.0
"""Seconds slurmd's idle CPU is measured over after the cluster is up (0.0 ms/s at every size)."""
POLL_S = 0.25
"""The bench's own polls (beats, journal, lines)."""
JOB_POLL_S = 30.0
"""Slurm is asked for the job's state at most this often while the bench waits on the files (at once
when the journal has an outcome): at 512 nodes and load 1,000-2,000 one ``scontrol show job`` can
take the poller's whole 20 s, and the 17:37 run's bench waited 41 s for a checkpoint its ranks had
long passed (the 512 in-allocation hang was not injected: the ranks had finished)."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE",
         "BOOT_FAIL")
"""Slurm's states of a job that is over."""
_CMD_LINE = re.compile(r"(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) slurm_omni\.slurm\.runner DEBUG "
                       r"(?P<kind>ran|started) \((?P<argv>[^)]*)\)(?: -> -?\d+ in (?P<took>[\d.]+)s)?")
"""The runner's debug lines: ``ran (argv) -> rc in Xs`` and ``started (argv)``."""
STORE_LINE = re.compile(r"light rank 0: store listening at (?P<listening>[0-9.e+-]+), every join at "
                        r"(?P<joined>[0-9.e+-]+) \((?P<ranks>\d+) ranks, (?P<wakes>\d+) wake-ups\)$", re.MULTILINE)
"""Rank 0's line in the step's output (bench/light_rank.py, light_rank.c): when its store listened and
when it had every rank's join (Unix time)."""
_ANSWERED = re.compile(r"(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) \S+ DEBUG supervisor: Slurm's state "
                       r"of (?P<nodes>\S+) answered (?P<took>[\d.]+) s after it was asked")
"""The supervisor's read of the nodes srun reported failed: when it was answered and how long it took."""
_LATE = re.compile(r"(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) \S+ DEBUG supervisor: launch \d+: "
                   r"(?P<what>(?:srun's report|Slurm's answer) taken|the heartbeat poll took) (?P<took>[\d.]+) s")
"""The supervisor's loop late (``supervisor/run.py`` LATE_S): what it took late, or a slow heartbeat poll."""
_DECIDING = re.compile(r"supervisor: launch (\d+): deciding \(process CPU ([\d.]+) s(?:, waited for a core ([\d.]+) s)?\)")
_JOURNALED = re.compile(r"supervisor: launch (\d+) journaled \(process CPU ([\d.]+) s(?:, waited for a core ([\d.]+) s)?\)")
"""The supervisor's debug lines around decide: its process's CPU when it confirmed launch N, and
when it journaled launch N + 1; and the seconds its threads waited, runnable, for a core (schedstat),
where it says."""
_TEARDOWN = re.compile(r"supervisor: launch (\d+): its srun ended ([\d.]+) s after the kill")
"""The supervisor's line when the killed step's srun ended (``supervisor/run.py``)."""


WALL = ("floors", "up", "idle", "start", "steady", "to_fault", "recovery", "lines", "finish", "down")
"""Where a size's wall time goes: floors (the heartbeat scan and the rendezvous floor, measured
before the cluster), up (the cluster), idle (slurmd's idle CPU, waiting for every node idle between
jobs), start (submission to launch 0's first step), steady (the steady-state window), to_fault (the
ranks checkpointing past their restored step before each fault), recovery (fault to the next launch's
first step, as the journal records it), lines (none since 2026-12-03: the new launch's first
metrics lines are read in the next fault's wait), finish (the finish time written -> the job's end), down (the cluster down, leftovers killed)."""
BAR_S = 15 * 60.0
BAR_SIZES = (8, 64, 256, 512)
"""Issue 19: ``python bench/scale_bench.py`` finishes in under 15 minutes with these sizes in it."""

FAULTS = ("node", "crash", "hang")
"""node: a node of the step set DOWN (scontrol); crash: a rank SIGKILLed; hang: a rank SIGSTOPped and
its peers blocked in the collective it never joins (light_rank.BLOCK_SIGNAL)."""
EXTRA_FAULTS = ("shrink",)
"""Asked for by name only: shrink, a node set DOWN after node took the spare (a relaunch one node short)."""
NODE_FAULTS = ("node", "shrink")
SPARES = 1
"""Spare nodes per job: the node loss takes it; a crashed or hung rank's node is alive and kept."""
PATHS = ("inalloc", "alloc")
"""inalloc: sbatch, the supervisor in the batch script; alloc: salloc --no-shell, the supervisor
outside with --allocation (allocation mode, docs/allocation-mode.md)."""


@dataclass
class Run:
    """One fault through one path: the recovery's phases (seconds from the phase before)."""

    path: str
    fault: str
    na: str = ""
    load: float = 0.0
    fault_at: float = 0.0
    cause: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    total: float | None = None
    cpu_recovery: float | None = None
    """The supervisor's CPU (with its sruns, scancels, squeues) from the fault to the first step."""
    ctld_cpu: float | None = None
    """slurmctld's CPU over the same time."""
    split: dict[str, float] = field(default_factory=dict)
    """decide and launch split (``SPLIT``): from the supervisor's debug log and the ranks' first lines."""
    step_at_fault: int | None = None
    """The most advanced rank's step when the fault was injected."""
    launch: int | None = None
    """The launch the fault hit (the journal's number); the next one is its recovery."""
    overrun_s: float | None = None
    """Seconds of steps the ranks made after the fault (their highest step in the old launch's lines;
    they step on until their step is killed)."""
    decide_cmds: list[str] = field(default_factory=list)
    """The Slurm commands the supervisor ran or started between the confirmation and the next launch's
    record, each ``name seconds`` (a started one ``name +``): none may be per node."""
    confirmed_by: list[str] = field(default_factory=list)
    """The rule's reason, then each signal it rests on as the supervisor heard it (journal
    ``confirmed.signals``): ``source kind node +seconds after the fault``."""
    cpu_share: dict[str, Any] = field(default_factory=dict)
    """Fault -> first step: ``seconds``, CPU seconds per process class (``cpu``) and processes per
    class (``procs``), from bench/cpu_share.py's sampler."""
    fault_cmd_s: float | None = None
    """The fault's own Slurm command, from ``fault_at`` to its end (a node loss: ``scontrol update
    state=DOWN``, whose start ``fault_at`` is): slurmctld has the node DOWN somewhere inside it, so
    no report of the loss can come before its RPC, and at 512 nodes the command's own start (exec, the
    slurm.conf parse) was part of "srun's report +0.12 s"."""


@dataclass
class Result:
    nodes: int
    ranks: int = 0
    na: str = ""
    runs: list[Run] = field(default_factory=list)
    up_s: float | None = None
    cpu_per_poll: dict[str, float] = field(default_factory=dict)
    """Per path: the supervisor's CPU seconds per heartbeat poll in steady state."""
    memory: dict[str, float] = field(default_factory=dict)
    """Mean private MiB: slurmd, slurmstepd, rank; idle slurmd CPU (ms per s); in steady state the CPU
    (ms per s) of a slurmstepd, a rank, slurmctld and all of them together (``*_cpu_ms_per_s``)."""
    checks: list[str] = field(default_factory=list)
    load: float = 0.0
    scan: tuple[float, float] | None = None
    """One heartbeat scan over this many ranks' files: CPU and wall seconds."""
    fs_ops: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per path, in steady state: operations per second on the job's folders (``<area>_meta``: create,
    rename, unlink; ``<area>_data``: writes), every node together."""
    step_s: float | None = None
    """The ranks' median step time in steady state (their heartbeats' step_time_s), paced at --step-delay."""
    elapsed_s: float | None = None
    """Wall seconds of the whole size (cluster up to down)."""
    wall: dict[str, float] = field(default_factory=dict)
    """Where the size's wall time went (``WALL``), seconds per part."""
    included: bool = False
    """Read from an earlier run's results (``--include``), not measured by this one."""
    bare_cmds: dict[str, float] = field(default_factory=dict)
    """decide's two Slurm commands (``squeue`` of the job, ``scontrol show node`` of its nodes) run
    bare by the bench in steady state: wall seconds, median of 3 (slurmctld's answer at this size
    with no failure to handle)."""
    cpu_share: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per path, in the steady-state window: ``seconds``, CPU seconds per process class, processes
    per class (bench/cpu_share.py)."""
    join_floor: float | None = None
    """The machine's floor of the rendezvous: this many ranks' processes (forked, already running)
    connect to one server, send their steps, and wake on its answer: wall seconds from the start
    to the last one awake, without Slurm or an interpreter's start (``join_floor``)."""

    def run(self, path: str, fault: str) -> Run | None:
        return next((r for r in self.runs if r.path == path and r.fault == fault), None)


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


OWN_JOBS: set[str] = set()
"""The Slurm jobs this run made (their slurmstepd may outlive the cluster's ``down``)."""


def socket_inodes_under(net_unix: str, folder: Path) -> set[int]:
    """The inodes of the Unix sockets bound under ``folder``, from the text of /proc/net/unix (columns
    Num RefCount Protocol Flags Type St Inode Path). A slurmstepd listens on
    ``<SlurmdSpoolDir>/<node>_<job>.<step>``, and the name stays in the table after the file is gone."""
    prefix = str(folder).rstrip("/") + "/"
    inodes = set()
    for line in net_unix.splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[7].startswith(prefix) and fields[6].isdigit():
            inodes.add(int(fields[6]))
    return inodes


def holds_socket(pid: int, inodes: set[int]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in inodes:
            return True
    return False


def kill_slurmds(cluster: LocalCluster) -> None:
    """SIGKILL a size's slurmd before its cluster goes down: the size's jobs are over and its checks
    made, and the cluster is not used again; SIGTERM let 400+ of 512 slurmd run on past ``down``'s
    20 s wait at load 1,000 (17:44: 29 s of the size's 548). slurmctld and munged still stop on
    SIGTERM (slurmctld saves its state)."""
    for name, pid in cluster.running().items():
        if name.startswith("slurmd:") and pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)   # its own session (LocalCluster starts each so)
            except OSError:
                pass


def leftover(argv: list[str], environ: list[bytes], jobs: set[str], root: bytes, holds_ours: Any) -> bool:
    """A process this run left: a slurmstepd of ``jobs`` that holds a socket under this cluster's state
    folder (``holds_ours()``: job ids name no cluster), or any process whose environment points an
    OMNI_ variable into this run's own folder ``root`` (bytes, ending in /): the light ranks, the
    supervisors of both paths and what they started (srun, the stage wrapper, squeue, scancel), which
    a slurmstepd's SIGKILL or the bench's own interruption leaves reparented to init."""
    if argv and argv[0].startswith("slurmstepd: ["):
        return argv[0][len("slurmstepd: ["):].split(".")[0] in jobs and holds_ours()
    return any(e.startswith(b"OMNI_") and root in e for e in environ)


def kill_leftovers(jobs: set[str], state_dir: Path, root: Path) -> dict[int, str]:
    """SIGKILL what this run left running after a size's cluster went down (``leftover``), never
    this process or its parents: a step killed late outlived the 11:00 512-node run's cluster and
    spoke to the next cluster's node of the same name and port ("Orphan StepId=4101.0 reported on node
    node335"); that run's relaunch then dropped node335 too. A slurmstepd's SIGKILL leaves its tasks
    running (each a process group of its own, reparented to init), and an interrupted bench left the
    in-allocation supervisor with its srun and squeue: those go by their environment. Returns what
    it killed: pid -> the program's name."""
    try:
        ours_sockets = socket_inodes_under(Path("/proc/net/unix").read_text(), state_dir.resolve())
    except OSError:
        ours_sockets = set()
    prefix = (str(root.resolve()).rstrip("/") + "/").encode()
    spared = {os.getpid(), *ancestors()}
    killed: dict[int, str] = {}
    for pid in pids():
        if pid in spared:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:   # gone, or not ours to read
            env = []
        argv = cmdline(pid)
        if leftover(argv, env, jobs, prefix, lambda pid=pid: holds_socket(pid, ours_sockets)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
            name = argv[0].split(":")[0] if argv else "?"
            killed[pid] = ("supervisor" if "supervise" in argv else "light rank" if is_light_rank(argv)
                           else Path(name).name)
    return killed


def stuck_steps(argvs: dict[int, list[str]], job_id: str, holds_ours: Any) -> dict[int, str]:
    """The slurmstepd of ``job_id``'s numbered steps (``slurmstepd: [JOB.N]``; not its batch or extern
    step) among ``argvs`` (pid -> argv) that hold a socket of this cluster (``holds_ours(pid)``: job
    ids name no cluster): pid -> step. Every one: a step runs a slurmstepd on each of its nodes, and
    two of one step were left on two nodes (2026-12-04 18:56, 64 nodes: the one kept per step was
    killed, the other held the job's end for 7 minutes)."""
    out: dict[int, str] = {}
    for pid, argv in argvs.items():
        if not argv or not argv[0].startswith("slurmstepd: [") or not argv[0].endswith("]"):
            continue
        job, _, step = argv[0][len("slurmstepd: ["):-1].partition(".")
        if job == job_id and step.isdigit() and holds_ours(pid):
            out[pid] = f"{job}.{step}"
    return out


def beat_folders_of(jobs: set[str], uid: int, names: list[str]) -> list[str]:
    """The names among ``names`` (a node-local heartbeat folder's entries) that are the node folders of
    ``jobs`` (``omni-beats-<uid>-<job>-<node>``, elastic/heartbeat.py): the lane's embedded clusters run
    no SPANK epilog, which removes them on a site, so a run of 8-512 nodes left one per node and job
    (400+ after two 64-node runs, issue 19)."""
    prefixes = tuple(f"omni-beats-{uid}-{job}-" for job in jobs)
    return sorted(n for n in names if prefixes and n.startswith(prefixes))


def remove_beat_folders(jobs: set[str], base: Path) -> int:
    """Remove this run's node folders under ``base`` (``beat_folders_of``; a folder only, never what a
    link points to); how many went."""
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    gone = 0
    for name in beat_folders_of(jobs, os.geteuid(), names):
        path = base / name
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            shutil.rmtree(path)
            gone += 1
        except OSError:
            pass
    return gone


def ancestors() -> list[int]:
    out, pid = [], os.getppid()
    while pid > 1:
        out.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's cpu controller (this machine's); cgroup v2 keeps cpu.idle and cpu.weight at the root."""


def v2_weight(shares: int) -> int:
    """cgroup v1 ``cpu.shares`` (a session's 1024, at most 262,144) as cgroup v2 ``cpu.weight`` (a
    session's 100, within 1-10,000: a value outside is refused)."""
    return min(10000, max(1, shares * 100 // 1024))


class RankGroup:
    """The cgroup the light ranks join at their start (``OMNI_LIGHT_CGROUP``, bench/light_rank.py),
    with a quarter of a session's CPU weight (``cpu.shares=256``, cgroup v2 ``cpu.weight=25``). One
    host stands for 512 nodes: on a cluster the ranks run on their own nodes' cores and never take
    slurmctld's or the supervisor's; here every slurmstepd is a session of its own (an autogroup, which
    the scheduler weighs as it does slurmctld's), so 512 steps of 4 ranks starved slurmctld
    (``scontrol show node`` answered in 11-15 s at load 1,000+). In the group the ranks weigh as one
    session: slurmctld gets 4/5 of a core against all of them. Not the idle class (``cpu.idle=1``):
    ranks that get no CPU while anything else runs stop beating, and the supervisor confirmed hangs
    that were not (13:33, 8 nodes beside other work). Only the ranks join: slurmd, slurmstepd, srun,
    slurmctld and the supervisor (in the batch step's session in-allocation, a session of its own in
    allocation mode) keep their weight. A rank's interpreter starts before it joins, so the launch's
    process start is on the normal weight."""

    SHARES = 256

    def __init__(self, name: str, shares: int = SHARES) -> None:
        self.path: Path | None = None
        self.how = "not made"
        folder = (CGROUP_CPU if (CGROUP_CPU / "cpu.shares").exists() else Path("/sys/fs/cgroup")) / name
        try:
            folder.mkdir(exist_ok=True)
            if (folder / "cpu.shares").exists():
                (folder / "cpu.shares").write_text(str(shares))
                self.how = f"cpu.shares={shares}, a session's 1024"
            else:
                weight = v2_weight(shares)
                (folder / "cpu.weight").write_text(str(weight))
                self.how = f"cpu.weight={weight}, a session's 100"
            self.path = folder
        except OSError as e:
            self.how = f"not made ({e}): its processes run at the weight of their sessions"

    def join(self, pid: int, *, leave: bool = False) -> bool:
        """``pid`` (every thread of it) into this group, or back to the parent group (``leave``); its
        children to come follow it, those it has do not."""
        if self.path is None:
            return False
        try:
            ((self.path.parent if leave else self.path) / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:   # gone
            return False

    @contextlib.contextmanager
    def this_thread(self) -> Iterator[None]:
        """The calling thread (and what it forks meanwhile) in the group for the block, then back in the
        parent group. cgroup v1 moves one thread (``tasks``); elsewhere nothing moves."""
        tid = threading.get_native_id()
        moved = False
        if self.path is not None and (self.path / "tasks").exists():
            try:
                (self.path / "tasks").write_text(str(tid))
                moved = True
            except OSError:
                pass
        try:
            yield
        finally:
            if moved:
                try:
                    (self.path.parent / "tasks").write_text(str(tid))   # type: ignore[union-attr]
                except OSError:
                    pass

    def remove(self) -> None:
        """Empty (a rank still there goes back to the parent group) and removed."""
        if self.path is None:
            return
        try:
            left = (self.path / "cgroup.procs").read_text().split()
            for pid in left:
                try:
                    (self.path.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            self.path.rmdir()
        except OSError as e:
            print(f"couldn't remove the ranks' cgroup {self.path}: {e}", flush=True)
        self.path = None


CONTROL_RT = 0
"""SCHED_RR priority of every thread of slurmctld and the control plane's munged; 0: none (--control-rt)."""
CONTROL_RT_DEFAULT = 1
"""The lane's default: the control plane's daemons real-time at the lowest priority. A cgroup's weight
(CONTROL_SHARES) is a share of the CPU over time, not a wake-up: at 512 nodes the lost node's read, asked
at srun's report while 511 slurmstepd tore the step down, still waited 0.00-0.09 s for slurmctld and
munged to run (2026-12-04 17:52-18:09, three runs: the node loss confirmed 2.6 x the 8-node time, median).
Real-time, a woken slurmctld or munged thread runs at once, as it does on the control plane's own host,
whatever the nodes' daemons do: the same read answered in 0.00-0.01 s at 512 nodes (18:45-18:52). Bounded
by RT_RUNTIME_US; ``--control-rt 0`` reproduces the runs before."""
RT_RUNTIME_US = 300000
"""The control plane's group may run real-time 0.3 s of every second on each core (its cpu.rt_runtime_us;
cgroup v1 with real-time group scheduling, as here; elsewhere the threads are refused, counted 0 in the
log): a real-time thread that spins cannot take the machine, and slurmctld and munged use 1-2 % of it in
steady state."""


def realtime(pid: int, prio: int) -> int:
    """Every thread of ``pid`` into SCHED_RR at ``prio`` (threads it starts later follow); how many
    moved (0: gone, or refused where the group may not run real-time)."""
    moved = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_RR, os.sched_param(prio))
            moved += 1
        except OSError:
            pass
    return moved


RANK_GROUP: RankGroup | None = None
NODE_GROUP: RankGroup | None = None
CONTROL_GROUP: RankGroup | None = None
MUNGE_GROUP: RankGroup | None = None
"""The nodes' own munged (``spec.node_munged``), as heavy as the control plane, in a group of its own."""
CONTROL_SHARES = 262144
"""The control plane (slurmctld, munged, and the supervisor with its sruns and reads of Slurm, both
paths; and the bench's node fault, which stands for slurmctld finding the node dead) weighs as much as
cgroup v1 allows (cpu.shares 262,144; cgroup v2 cpu.weight 10,000): on a cluster it runs on hosts of its
own (issue 19: "a control plane outside the allocation"), never on the nodes' cores, so nothing the
nodes do delays it; weights count only while it has work, and it uses 1-2 % of the machine in steady
state. A node loss ends the step at once (srun's ``--kill-on-bad-exit`` counts the lost node's tasks
as killed: probe 2026-12-03 20:40, with ``srun -k`` too), so the teardown of 2,044 tasks by 511
slurmstepd, each reading the one host's /proc of 3,000+ processes (on a cluster its own node's few), filled
both cores from +0.05 s after the fault, inside the confirmation's read of the lost node. At two
sessions' weight (2048, until 2026-12-03) that read waited 0.06-0.60 s (six reads at 512 nodes, median
0.27) and the node loss confirmed at 4.2-4.3 x the 8-node time; ``--trace-ctld`` showed why: in the
0.67 s after a fault munged's threads ran 55 ms and sat 2.7 s runnable on the run queue (summed over
threads), slurmctld's 1.6 ms and 0.5 s, while slurmstepd took 72 % of the machine's samples (perf -a;
20:21-20:27). At 262,144 the same read answered in 0.01 s on both paths with 512 nodes alone (20:41),
0.04-0.20 s in runs where smaller sizes went before (20:45, 22:05); the confirmation at 512 stayed
2.6-4.9 x the 8-node time (docs/in-allocation.md). 16 sessions (16384) tried 2026-12-03 14:10-14:45, before the kept scontrol and the heartbeat
scan's own thread: the read answered 0.01-1.13 s and two of four confirmations waited on the
supervisor's heartbeat poll, blocked 14.9 and 17.4 s. ``--control-shares`` sets it (2048 reproduces
the runs before)."""
NODE_SHARES = 1024
"""The emulated nodes' daemons: every slurmd joins it after the cluster is up, and the slurmstepd it
forks (with their tasks until the ranks join RANK_GROUP) follow, weighing one session together. On a
cluster slurmd and slurmstepd run on the nodes' cores, never on slurmctld's or the supervisor's;
here each slurmstepd is a session of its own (an autogroup as heavy as slurmctld's), and while a
512-node step was torn down slurmctld answered the supervisor's one-node read of the lost node in
2-4 s (256-512 nodes, 14:05: the node loss's confirmation). The in-allocation supervisor, started by
its batch step's slurmstepd, leaves the group once the bench finds it (on a cluster it has its
batch host's cores): it, its sruns and its reads of Slurm weigh as its session again."""


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


# -- one size ------------------------------------------------------------------------------------
def process_tree_cpu(root: int) -> float | None:
    """CPU seconds of ``root`` (its own and its reaped children's) and of its live descendants: the
    control plane's work through its sruns, scancels and squeues too."""
    try:
        fields = Path(f"/proc/{root}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    total = sum(int(f) for f in fields[11:15]) / CLK_TCK
    return total + sum(cpu_s(pid) or 0.0 for pid in descendants(root))


def descendants(root: int) -> list[int]:
    """The live processes below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for pid in pids():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class Size:
    """One cluster size: the cluster up once, then one job per path, each running every fault in turn."""

    def __init__(self, args: argparse.Namespace, nodes: int, root: Path, measured: list[Result] | None = None) -> None:
        self.args = args
        self.measured = measured or []
        """The sizes measured before: their memory per process says whether two launches fit at once."""
        self.nodes = nodes
        self.root = root
        self.spec = ClusterSpec(nodes=nodes, nodes_per_switch=4 if nodes <= 8 else 16, cpus_per_node=TASKS_PER_NODE,
                                gpus_per_node=0, ctld_port=args.ctld_port, slurmd_base_port=args.slurmd_base_port,
                                first_job_id=args.first_job_id, partitions=(), scale_lane=True)
        self.cluster = LocalCluster(Path(args.state_dir), self.spec)
        self.runner = CommandRunner(self.cluster.env, timeout_s=60)
        # the bench's own polls: one quick try (a slurmctld gone must not hold the table for minutes)
        self.poller = CommandRunner(self.cluster.env, timeout_s=20, retries=1)
        self.result = Result(nodes=nodes, ranks=TASKS_PER_NODE * (nodes - SPARES))
        # where the machine's CPU goes, per process class; a sample of 3,000 processes costs ~50 ms
        self.sampler = Sampler(conf=str(self.cluster.paths.slurm_conf), jobs=OWN_JOBS, light_rank=RANK_ARGV[-1],
                               bench_pid=os.getpid(), interval_s=1.0 if nodes <= 64 else 2.0)

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} n={self.nodes}] {msg}", flush=True)

    def spent(self, part: str, since: float) -> float:
        """Adds the wall seconds since ``since`` (monotonic) to ``part`` of the size's time (``WALL``)."""
        took = time.monotonic() - since
        self.result.wall[part] = self.result.wall.get(part, 0.0) + took
        return took

    def up(self) -> None:
        recorded = self.cluster.recorded_spec()
        if recorded is not None and recorded != self.spec and any(self.cluster.running().values()):
            self.log("taking the previous cluster down")
            LocalCluster(Path(self.args.state_dir)).down()
        started = time.monotonic()
        self.cluster.up(wait_s=120)
        self.result.up_s = self.spent("up", started)
        self.log(f"cluster up in {self.result.up_s:.1f}s")
        started = time.monotonic()
        slurmds = [pid for name, pid in self.cluster.running().items() if name.startswith("slurmd:") and pid]
        before = {p: cpu_s(p) for p in slurmds}
        time.sleep(IDLE_S)
        cpu = [(c - b) / IDLE_S for p, b in before.items() if b is not None and (c := cpu_s(p)) is not None]
        mem = [m for p in slurmds if (m := private_mib(p)) is not None]
        self.result.memory["slurmd_mib"] = mean(mem) or 0.0
        self.result.memory["slurmd_idle_cpu_ms_per_s"] = 1000 * (mean(cpu) or 0.0)
        ctld = self.cluster.running().get("slurmctld")
        if ctld:
            self.result.memory["slurmctld_mib"] = private_mib(ctld) or 0.0
        if NODE_GROUP is not None:
            joined = sum(NODE_GROUP.join(pid) for pid in slurmds)
            if joined < len(slurmds):
                self.log(f"{len(slurmds) - joined} of {len(slurmds)} slurmd did not join {NODE_GROUP.path}")
        if CONTROL_GROUP is not None and ctld and not CONTROL_GROUP.join(ctld):
            self.log(f"slurmctld (pid {ctld}) did not join {CONTROL_GROUP.path}")
        # the control plane's munged (slurmctld's, srun's, scontrol's) in its group; the nodes' own munged
        # (spec.node_munged: one for every emulated node, a cluster has one per node on its own cores)
        # in a group of the same weight beside it: starved at load 2,500 its listen backlog filled and a
        # 512-node relaunch's tasks lost their credentials and launch replies (11:06: 'Munge encode
        # failed ... Resource temporarily unavailable'), and in the control plane's group its teardown
        # work would share that group's CPU with the supervisor's read
        running = self.cluster.running()
        for name, group in (("munged", CONTROL_GROUP), (NODE_MUNGED, MUNGE_GROUP)):
            pid = running.get(name)
            if group is not None and pid and not group.join(pid):
                self.log(f"{name} (pid {pid}) did not join {group.path}")
        if CONTROL_RT and CONTROL_GROUP is not None:
            for name in ("slurmctld", "munged"):
                pid = running.get(name)
                self.log(f"{name} (pid {pid}): {realtime(pid, CONTROL_RT) if pid else 0} thread(s) SCHED_RR {CONTROL_RT}")
        self.spent("idle", started)

    def run(self) -> Result:
        self.up()
        self.sampler.start()
        try:
            self._run_paths()
        finally:
            self.sampler.stop()
        return self.result

    def _run_paths(self) -> None:
        for path in self.args.paths:
            job = Job(self, path)
            try:
                job.run()
            except Exception as e:  # noqa: BLE001 (one path's failure is its n/a, not the end of the size)
                job.fail(f"{type(e).__name__}: {e}")
            finally:
                job.cleanup()


def node_victim(layout: Any) -> str:
    """The node a node fault sets DOWN: the first component's last node (never rank 0's)."""
    return str(layout.components[0][-1])


class Job:
    """One job of a size through one path (``inalloc``: sbatch, the supervisor in the batch script;
    ``alloc``: salloc --no-shell, the supervisor outside with --allocation), its faults in turn."""

    def __init__(self, size: Size, path: str) -> None:
        self.size, self.path, self.args = size, path, size.args
        self.nodes = size.nodes
        self.work = size.root / f"n{self.nodes}-{path}"
        self.job_id = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.down: list[str] = []
        self.ranks = size.result.ranks
        self.runs: list[Run] = []
        self.budget = self.args.max_steps or step_budget(self.args.step_delay)
        """The ranks' OMNI_MAX_STEPS: more than the job's time limit holds; the finish time ends the run."""
        self.finish_file = self.work / "finish"
        """OMNI_LIGHT_FINISH_FILE: the bench writes the finish time here after the last fault's recovery."""
        self.ended = ""
        """Why the wait for the run's end gave up (``wait_ended``), empty when the run ended."""
        self.kill_grace = 0.0
        """``omni supervise --kill-grace`` (``plan``): 0 unless two launches' ranks would not fit in memory."""
        self.lines = MetricsTail(self.work / "metrics")
        self.stepping: tuple[Run, int] | None = None
        """The last recovery and its launch's number, until ``said_stepping``."""
        self.fault_scontrol = ScontrolSession(size.runner)
        """A kept scontrol that sends a node fault's update (``warm_fault``, ``inject``)."""

    def plan(self) -> None:
        """Whether the next launch waits for the killed step's ranks (two launches' ranks do not fit
        in memory at once), and the budget said."""
        r = self.size.result
        why = (two_launches_fit(self.nodes, [*self.size.measured, r], self.args.reserve_gib * 1024)
               or one_host_relaunch(self.nodes))
        self.kill_grace = KILL_GRACE_S if why else 0.0
        if why:
            self.log(f"{why}: the supervisor waits up to {KILL_GRACE_S:g} s for the killed step's srun "
                     "(every old rank gone) before the next launch (--kill-grace)")
        self.log(f"step budget {self.budget}{' (--max-steps)' if self.args.max_steps else ''}; the bench ends the "
                 f"run after the last fault (a finish time in {self.finish_file})")

    def log(self, msg: str) -> None:
        self.size.log(f"{self.path}: {msg}")

    def fail(self, why: str) -> None:
        self.log(f"n/a: {why}")
        for run in self.runs:   # the faults recovered before this one keep their figures
            try:
                self.phases(run)
            except (IndexError, OSError, ValueError):
                pass
        for fault in self.args.faults:
            if not any(r.fault == fault for r in self.runs):
                self.runs.append(Run(self.path, fault, na=why))
        self.size.result.runs.extend(self.runs)

    # -- submission ---------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        w = self.work
        return {k: str(v) for k, v in {
            "OMNI_CKPT_DIR": w / "ckpt", "OMNI_HEARTBEAT_DIR": w / "hb", "OMNI_METRICS_DIR": w / "metrics",
            "OMNI_LOG_DIR": w / "logs", "OMNI_DP_SIZE": self.ranks, "OMNI_STAGES": "main",
            "OMNI_MAX_STEPS": self.budget, "OMNI_LIGHT_FINISH_FILE": self.finish_file,
            "OMNI_STEP_DELAY_S": self.args.step_delay,
            "OMNI_HEARTBEAT_INTERVAL": 1, "OMNI_JOB_NAME": f"scale-{self.nodes}-{self.path}", "OMNI_STANDBY": 0,
            "OMNI_LIGHT_CKPT_EVERY": self.args.ckpt_every, "OMNI_COLLECTIVE_TIMEOUT": self.args.timeout,
            "PYTHONPATH": REPO,
            # the supervisor logs every Slurm command it runs with its time: decide and launch split
            "OMNI_LOG_LEVEL": "DEBUG",
            **({"OMNI_LIGHT_CGROUP": RANK_GROUP.path} if RANK_GROUP is not None and RANK_GROUP.path else {}),
            # a heartbeat file per node is the default (/dev/shm), and with it the metrics lines through the
            # node (formats.metrics.per_node_setting; the bench reads them from the node files too); the
            # option names another folder or "off"
            **({"OMNI_HEARTBEAT_NODE_DIR": self.args.heartbeat_node_dir} if self.args.heartbeat_node_dir else {}),
        }.items()}

    def supervise_argv(self) -> list[str]:
        active = self.nodes - SPARES
        return [sys.executable, "-m", "slurm_omni.cli.main", "supervise",
                f"--stages=main:{active}:{TASKS_PER_NODE}:{SPARES}", "--heartbeat-interval=1",
                f"--confirmation-window={self.args.confirmation_window:g}", f"--hang-factor={self.args.hang_factor:g}",
                "--no-standby", *([f"--allocation={self.job_id}"] if self.path == "alloc" else []),
                *([f"--kill-grace={self.kill_grace:g}"] if self.kill_grace else []),
                "--", *RANK_ARGV]

    def wait_idle(self) -> None:
        """Every node idle (the job before may still be completing: its steps' teardown at 64 nodes
        took over 2 min once), so that the allocation of every node starts at once."""
        started = time.monotonic()
        busy: list[str] = []
        while time.monotonic() - started < self.args.timeout:
            try:
                out = self.size.poller.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], check=False).stdout
            except SlurmError as e:   # slurmctld at load 800+ after the last job's 2,044 tasks: ask again
                self.log(f"sinfo: {e}: asking again")
                continue
            rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
            busy = sorted({f"{n} {t}" for n, t, _ in rows if t != "idle"})
            # slurmd drains a node whose tasks outlived UnkillableStepTimeout: on this loaded host a
            # killed rank can take that long to go; the job that left it is over, so back to service
            stuck = sorted({n for n, t, why in rows if t in ("drained", "draining") and why == "Kill task failed"})
            if stuck:
                self.log(f"{','.join(stuck)} drained by slurmd ('Kill task failed': the last job's tasks died "
                         "slower than UnkillableStepTimeout): resumed")
                self.size.runner.run(["scontrol", "update", f"nodename={','.join(stuck)}", "state=RESUME"],
                                     check=False)
                self.size.result.checks.append(f"note: {self.path}: {len(stuck)} node(s) drained 'Kill task failed' "
                                               "before this job, resumed")
            if out.strip() and not busy:
                if time.monotonic() - started > 2:
                    self.log(f"every node idle after {time.monotonic() - started:.0f}s")
                return
            if self.args.stop_at and time.time() >= self.args.stop_at:
                break
            time.sleep(1.0)
        raise TimeoutError(f"nodes not idle after {time.monotonic() - started:.0f}s: {', '.join(busy[:5])}"
                           f"{' ...' if len(busy) > 5 else ''}")

    def submit(self) -> None:
        t0 = time.monotonic()
        self.wait_idle()
        self.size.spent("idle", t0)
        self.plan()
        w = self.work
        for d in ("ckpt", "hb", "metrics", "logs"):
            (w / d).mkdir(parents=True, exist_ok=True)
        (w / "hb").chmod(0o700)
        name = f"scale-{self.nodes}-{self.path}"
        if self.path == "inalloc":
            exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self.env().items())
            script = w / "job.sbatch"
            script.write_text(
                "#!/bin/bash\n"
                f"#SBATCH --job-name={name}\n#SBATCH --nodes={self.nodes}\n"
                f"#SBATCH --ntasks-per-node={TASKS_PER_NODE}\n#SBATCH --no-kill\n#SBATCH --time={JOB_TIME_S // 60}\n"
                f"#SBATCH --output={w / 'batch.out'}\n#SBATCH --chdir={REPO}\n"
                f"{exports}\nexec {shlex.join(self.supervise_argv())}\n")
            proc = self.size.runner.run(["sbatch", "--parsable", str(script)])
            self.job_id = proc.stdout.strip().split(";")[0]
            OWN_JOBS.add(self.job_id)
        else:
            proc = self.size.runner.run(["salloc", "--no-shell", "--no-kill", f"--nodes={self.nodes}",
                                         f"--ntasks-per-node={TASKS_PER_NODE}", f"--time={JOB_TIME_S // 60}",
                                         f"--job-name={name}"], timeout_s=max(120.0, self.args.timeout),
                                        retry_unreachable=False)
            words = (proc.stderr + proc.stdout).split()
            found = [words[i + 1] for i, x in enumerate(words[:-1]) if x == "allocation" and words[i + 1].isdigit()]
            if not found:
                raise SlurmError(f"salloc: couldn't read a job id from: {(proc.stderr + proc.stdout).strip()[:200]}")
            self.job_id = found[0]
            OWN_JOBS.add(self.job_id)
            env = {**os.environ, **self.size.cluster.env, **self.env()}
            with open(w / "supervisor.log", "ab") as out:
                self.proc = subprocess.Popen(self.supervise_argv(), env=env, cwd=REPO, stdout=out,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
        self.log(f"job {self.job_id}: {self.ranks} light ranks on {self.nodes - SPARES} nodes + "
                 f"{SPARES} spare")

    # -- reading ------------------------------------------------------------------------------
    def journal(self) -> SupervisorJournal:
        return SupervisorJournal(journal_path(self.work / "ckpt", self.job_id))

    def launches(self) -> list[Any]:
        return list(self.journal().state.launches)

    def wait(self, cond: Any, timeout: float) -> str:
        """Until ``cond()`` (empty), the job ends or ``timeout`` (what ended it: ``wait_ended``).
        ``cond`` is asked every POLL_S, or twice its own time when it takes longer (a read of 2,044
        ranks' beats at load 1,000+: the bench takes at most a third of a core); Slurm is asked for the job's state once
        the wait has lasted JOB_POLL_S, then every JOB_POLL_S, or at once when the journal has an
        outcome."""
        started = time.monotonic()
        deadline = started + timeout
        asked = time.monotonic()   # a wait shorter than JOB_POLL_S never blocks on slurmctld
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            if cond():
                return ""
            took = time.monotonic() - t0
            if t0 - asked >= JOB_POLL_S or self.journal().state.outcome is not None:
                asked = t0
                if (state := self.job_state()) in ENDED:
                    return "" if cond() else wait_ended(state, time.monotonic() - started, timeout)
            if self.args.stop_at and time.time() >= self.args.stop_at:
                raise TimeoutError(f"--stop-at {time.strftime('%H:%M:%S', time.gmtime(self.args.stop_at))} UTC "
                                   "reached: the cluster goes down now")
            time.sleep(max(POLL_S, 2 * took))
        return wait_ended("", time.monotonic() - started, timeout)

    def job_state(self) -> str:
        try:
            proc = self.size.poller.run(["scontrol", "show", "job", "-o", self.job_id], check=False)
        except SlurmError:
            return "?"
        for part in proc.stdout.split():
            if part.startswith("JobState="):
                return part.split("=", 1)[1]
        return "?"

    def job_finished(self) -> bool:
        return self.job_state() in ENDED

    def beats(self, incarnation: int) -> list[Any]:
        return [b for b in read_heartbeats(self.work / "hb") if b.incarnation == incarnation]

    def supervisor_pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid if self.proc.poll() is None else None
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

    def first_lines(self, incarnation: int) -> dict[int, dict[str, Any]]:
        """Each rank's first metrics line of ``incarnation`` (own files and node files, each line
        parsed once: bench/metrics_tail.py)."""
        return self.lines.first_lines(incarnation)

    def watch_files(self) -> Inotify | None:
        """inotify on the job's folders (heartbeat_bench.Inotify): the heartbeat folder, the checkpoint
        folder's own files and the supervisor's (journal, status, reports; each rank's checkpoint
        markers are in folders of their own, not watched: one durable create and rename per rank per
        checkpoint) and the metrics folder, reset now."""
        try:
            watch = Inotify()
            for sub, area in (("hb", "heartbeat"), ("ckpt", "checkpoint"), ("ckpt/supervisor", "checkpoint"),
                              ("ckpt/light", "checkpoint"), ("metrics", "metrics")):
                if (self.work / sub).is_dir():
                    watch.add(self.work / sub, area)
        except (OSError, SystemExit) as e:
            self.log(f"file-system operations not counted: {e}")
            return None
        watch.reset()
        return watch

    def steady_state(self, sup: int) -> None:
        """The supervisor's CPU per heartbeat poll and memory per process, before the first fault."""
        r, window = self.size.result, self.args.cpu_window
        steps, ranks = [], []
        tag = f"[{self.job_id}."
        for pid in pids():
            argv = cmdline(pid)
            if argv and argv[0].startswith("slurmstepd") and tag in " ".join(argv):
                steps.append(pid)
            elif is_light_rank(argv):   # not srun, not the supervisor
                ranks.append(pid)
        ctld = self.size.cluster.running().get("slurmctld")
        slurmds = [pid for name, pid in self.size.cluster.running().items() if name.startswith("slurmd:") and pid]
        groups = {"stepd": steps, "rank": ranks, "ctld": [ctld] if ctld else [], "slurmd": slurmds}
        before = {k: {p: cpu_s(p) for p in v} for k, v in groups.items()}
        watch = self.watch_files()
        b0, t0 = cpu_s(sup), time.monotonic()
        while (left := t0 + window - time.monotonic()) > 0:   # drained often: the queue holds 16,384 events
            time.sleep(min(0.25, left))
            if watch is not None:
                watch.drain()
        b1, took = cpu_s(sup), time.monotonic() - t0
        seconds, cpu, procs, busy = self.size.sampler.window(time.time() - took, time.time())
        if seconds:
            r.cpu_share[self.path] = {"seconds": seconds, "cpu": cpu, "procs": procs, "machine": busy,
                                      "others": self.size.sampler.others_window(time.time() - took, time.time())}
        if watch is not None:
            watch.drain()
            watch.close()
            if not watch.overflow:
                r.fs_ops[self.path] = {f"{area}_{kind}": sum(v for k, v in counts.items()
                                                              if (k == "write") == (kind == "data")) / took
                                       for area, counts in watch.by_area.items() for kind in ("meta", "data")}
        if b0 is not None and b1 is not None:
            r.cpu_per_poll[self.path] = (b1 - b0) / (window / HEARTBEAT_POLL_S)
        if not r.bare_cmds:
            nodes = compress([f"node{i}" for i in range(1, self.nodes + 1)])
            for name, argv in (("squeue", ["squeue", "--noheader", f"--jobs={self.job_id}", "--format=%T"]),
                               ("scontrol show node", ["scontrol", "show", "node", nodes])):
                walls = []
                for _ in range(3 if self.nodes <= 64 else 1):   # one at a loaded large size
                    t0 = time.monotonic()
                    try:
                        self.size.runner.run(argv, check=False, timeout_s=60, retry_unreachable=False)
                    except SlurmError:   # no answer within 60 s: that is the figure
                        pass
                    walls.append(time.monotonic() - t0)
                r.bare_cmds[name] = sorted(walls)[len(walls) // 2]
        if r.memory.get("rank_cpu_ms_per_s") is None:
            for k, v in before.items():
                used = [c - b for p, b in v.items() if b is not None and (c := cpu_s(p)) is not None]
                if used:
                    r.memory[f"{k}_cpu_ms_per_s"] = 1000 * sum(used) / len(used) / took
                    r.memory[f"{k}_all_cpu_ms_per_s"] = 1000 * sum(used) / took
        if r.memory.get("rank_mib"):
            return
        r.memory["slurmstepd_mib"] = mean([m for p in steps if (m := private_mib(p)) is not None]) or 0.0
        # a slurmstepd's CPU so far: its start (the launch's work per node) and a few seconds at ~0.2 ms/s
        r.memory["stepd_start_cpu_ms"] = 1000 * (mean([c for p in steps if (c := cpu_s(p)) is not None]) or 0.0)
        r.memory["rank_mib"] = mean([m for p in ranks[:256] if (m := private_mib(p)) is not None]) or 0.0
        r.memory["slurmstepd_count"] = len(steps)
        r.memory["rank_count"] = len(ranks)

    # -- faults -------------------------------------------------------------------------------
    def warm_fault(self, victim: str) -> None:
        """Before the fault's clock starts: the kept scontrol that sends a node fault, started (in the control
        plane's group: its process follows the thread that forks it) and past its first RPC (``show node
        VICTIM``: slurm.conf, the auth plugin, munged). The fault stands for slurmctld finding the node dead
        itself, not for a process start: sent by a new scontrol each time, the update reached slurmctld 60 ms
        after the clock started at 512 nodes (22:50, --trace-ctld), 15 ms at 8; by a session that had only
        started, 0.67 s (its first RPC at load 215, 23:11)."""
        with CONTROL_GROUP.this_thread() if CONTROL_GROUP is not None else contextlib.nullcontext():
            if self.fault_scontrol.warm():
                with contextlib.suppress(SlurmError):
                    self.fault_scontrol.show_node(victim, 60)

    def inject(self, fault: str, incarnation: int, layout: Any) -> str:
        """The fault, now; what it hit. A node fault is sent first: the ranks' beats (every node's file,
        0.3 s of the bench's thread at 512 nodes and load 470, 23:14) are read for a rank's fault only."""
        if fault in NODE_FAULTS:
            victim = node_victim(layout)
            # The fault stands for slurmctld finding the node dead itself: its command weighs with the control
            # plane, not behind the nodes' daemons (at 2048 shares it ended +0.90 s after it was sent, 14:10).
            words = [f"nodename={victim}", "state=DOWN", "reason=scale-bench"]
            with CONTROL_GROUP.this_thread() if CONTROL_GROUP is not None else contextlib.nullcontext():
                if self.fault_scontrol.update(words, 60) is None:   # no session: a command of its own
                    self.size.runner.run(["scontrol", "update", *words])
            self.down.append(victim)
            return f"{victim} set DOWN"
        beats = [b for b in self.beats(incarnation) if b.phase in ("training", "checkpointing")]
        target = max(beats, key=lambda b: b.rank)   # a rank of the last node, never rank 0 (its store)
        if fault == "crash":
            os.kill(target.pid, signal.SIGKILL)
            return f"rank {target.rank} (pid {target.pid} on {target.node}) SIGKILLed"
        os.kill(target.pid, signal.SIGSTOP)   # hang: it stops; its peers block in the collective it never joins
        for b in beats:
            if b.rank != target.rank:
                try:
                    os.kill(b.pid, BLOCK_SIGNAL)
                except ProcessLookupError:
                    pass
        return f"rank {target.rank} (pid {target.pid} on {target.node}) SIGSTOPped, {len(beats) - 1} peers blocked"

    def trace_ctld(self, victim: str) -> threading.Thread:
        """``--trace-ctld S``: from a second before the node fault to S seconds after it, slurmctld's log
        at debug2 (that window copied to ``ctld-trace-VICTIM.log`` in the job's folder), the control
        plane's munged's, slurmctld's and the nodes' munged's CPU and run-queue wait every 5 ms (``.cpu``) and ``perf record -a`` where perf is
        installed (``.perf``: who ran while the control plane waited); the thread returned (started
        after the fault) ends all three."""
        ctld_log = self.size.cluster.paths.ctld_dir / "slurmctld.log"
        start = ctld_log.stat().st_size if ctld_log.exists() else 0
        running = self.size.cluster.running()
        ctld, munged, node_munged = running.get("slurmctld"), running.get("munged"), running.get(NODE_MUNGED)
        out = self.work / f"ctld-trace-{victim}"
        perf = None
        if ctld and shutil.which("perf"):
            perf = subprocess.Popen(["perf", "record", "-a", "-F", "499", "-o", f"{out}.perf"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop = threading.Event()

        def sched(pid: int | None) -> str:
            # every thread's time on a CPU and waiting for one (ns, /proc/PID/task/TID/schedstat)
            run = wait = 0
            for t in Path(f"/proc/{pid}/task").glob("*/schedstat") if pid else ():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    f = t.read_text().split()
                    run, wait = run + int(f[0]), wait + int(f[1])
            return f"{run / 1e9:.4f}\t{wait / 1e9:.4f}"

        def sample() -> None:
            # munged's and slurmctld's CPU and run-queue wait every 5 ms: which of them is busy or
            # starved while a read waits
            with Path(f"{out}.cpu").open("w") as f:
                f.write("epoch\tmunged_run_s\tmunged_wait_s\tslurmctld_run_s\tslurmctld_wait_s"
                        "\tnodes_munged_run_s\tnodes_munged_wait_s\n")
                while not stop.wait(0.005):
                    f.write(f"{time.time():.4f}\t{sched(munged)}\t{sched(ctld)}\t{sched(node_munged)}\n")

        sampler = threading.Thread(target=sample, name="trace-ctld-cpu", daemon=True)
        sampler.start()
        self.size.runner.run(["scontrol", "setdebug", "debug2"], check=False)
        self.log(f"slurmctld at debug2 from {time.time():.3f} (epoch); the fault in 1 s")
        time.sleep(1.0)

        def end() -> None:
            time.sleep(self.args.trace_ctld)
            stop.set()
            sampler.join()
            self.size.runner.run(["scontrol", "setdebug", "error"], check=False)
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait(timeout=60)
            with ctld_log.open("rb") as f:
                f.seek(start)
                Path(f"{out}.log").write_bytes(f.read())
            self.log(f"slurmctld's log of the fault's window in {out}.log{' and perf.data in ' + str(out) + '.perf' if perf else ''}")

        return threading.Thread(target=end, name="trace-ctld", daemon=True)

    def run(self) -> None:
        args, size = self.args, self.size
        self.submit()
        t0 = time.monotonic()
        why = self.wait(lambda: (la := self.launches()) and la[0].first_step_at, args.timeout)
        size.spent("start", t0)
        if why:
            raise TimeoutError(f"launch 0 made no step: {why} ({self.work}/logs)")
        sup = self.supervisor_pid()
        if sup is not None and CONTROL_GROUP is not None:
            # the control plane's own weight (CONTROL_GROUP): in-allocation out of the nodes' group too
            moved = sum(CONTROL_GROUP.join(pid) for pid in (sup, *descendants(sup)))
            self.log(f"the supervisor (pid {sup}) and {moved - 1} process(es) below it joined the control plane's cgroup")
        elif sup is not None and self.path == "inalloc" and NODE_GROUP is not None:
            # on a cluster the batch host's cores are its own: out of the nodes' group (NODE_GROUP)
            left = sum(NODE_GROUP.join(pid, leave=True) for pid in (sup, *descendants(sup)))
            self.log(f"the supervisor (pid {sup}) and {left - 1} process(es) below it left the nodes' cgroup")
        self.log("launch 0 stepping: measuring the control plane in steady state")
        t0 = time.monotonic()
        if sup is not None:
            self.steady_state(sup)
        times = sorted(b.step_time_s for b in self.beats(self.launches()[0].incarnation) if b.step_time_s is not None)
        if times:
            size.result.step_s = max(size.result.step_s or 0.0, times[len(times) // 2])
        size.spent("steady", t0)
        for fault in args.faults:
            self.fault(fault, sup)
        self.finish()
        for run in self.runs:
            self.phases(run)
        self.check()
        size.result.runs.extend(self.runs)

    def restored(self, incarnation: int) -> int | None:
        """The step the ranks of ``incarnation`` restored (their first metrics lines; launch 0: 0),
        None before any line of it arrived."""
        if incarnation == 0:
            return 0
        steps = [s for x in self.first_lines(incarnation).values() if isinstance(s := x.get("restored_step"), int)]
        return max(steps, default=None)

    def checkpointed(self) -> bool:
        """Every rank of the newest launch checkpointed past the step it restored (a launch the
        supervisor made on its own is followed, not waited out)."""
        la = self.launches()[-1]
        base = self.restored(la.incarnation) if la.first_step_at else None
        if base is None:
            return False
        beats = self.beats(la.incarnation)
        return len(beats) == self.ranks_of(la) and min(b.last_checkpoint_step or 0 for b in beats) > base

    def fault(self, fault: str, sup: int | None) -> None:
        """One fault into the launch running once it checkpointed past its restore, then its recovery
        up to the next launch's first step."""
        args, size = self.args, self.size
        t0 = time.monotonic()
        why = self.wait(self.checkpointed, args.timeout)
        size.spent("to_fault", t0)
        self.said_stepping()
        la = self.launches()[-1]
        k, inc = la.number, la.incarnation
        if why:
            raise TimeoutError(f"launch {k}: the ranks did not all checkpoint past their restored step "
                               f"{self.restored(inc)}: {why}; "
                               f"{beats_said(self.beats(inc), self.ranks_of(la), k, self.budget)}")
        for j in unplanned(k + 1, [r.launch for r in self.runs if r.launch is not None]):
            self.log(f"launch {j} followed no fault of the bench: launch {j - 1} confirmed "
                     f"{self.launches()[j - 1].confirmed.cause if self.launches()[j - 1].confirmed else '?'}")
        at_fault = max(x.step for x in self.beats(inc))
        run = Run(self.path, fault, load=os.getloadavg()[0], step_at_fault=at_fault, launch=k)
        ctld = size.cluster.running().get("slurmctld")
        cpu0 = process_tree_cpu(sup) if sup else None
        ctld0 = cpu_s(ctld) if ctld else None
        trace = self.trace_ctld(node_victim(la.layout)) if args.trace_ctld and fault in NODE_FAULTS else None
        if fault in NODE_FAULTS:
            self.warm_fault(node_victim(la.layout))
        run.fault_at = time.time()
        t0 = time.monotonic()
        what = self.inject(fault, inc, la.layout)
        if trace is not None:
            trace.start()
        run.fault_cmd_s = time.monotonic() - t0 if fault in NODE_FAULTS else None
        self.log(f"launch {k}: {fault}: {what} (load {run.load:.1f})")
        why = self.wait(lambda: (la := self.launches())[-1].number > k and la[-1].first_step_at, args.timeout)
        size.spent("recovery", t0)
        cpu1 = process_tree_cpu(sup) if sup else None
        ctld1 = cpu_s(ctld) if ctld else None
        if cpu0 is not None and cpu1 is not None:
            run.cpu_recovery = cpu1 - cpu0
        if ctld0 is not None and ctld1 is not None:
            run.ctld_cpu = ctld1 - ctld0
        if why:
            st = self.journal().state
            raise TimeoutError(f"{fault}: no launch after launch {k} made a step: {why} (launches "
                               f"{len(st.launches)}, outcome {st.outcome or '-'})")
        self.runs.append(run)
        self.stepping = (run, k + 1)

    def said_stepping(self) -> None:
        """The last recovery's new launch, said once the next fault's wait (its ranks checkpointed
        past their restore: every first line read) or the finish comes, not in a wait of its own for
        the first lines (their node's next copy, once per 1 s interval; ~1.6 s a recovery at 512
        nodes): what the old ranks made after the fault is read then too (they step on until their
        step is killed)."""
        if self.stepping is None:
            return
        run, number = self.stepping
        self.stepping = None
        nxt = self.launches()[number]
        first = self.first_lines(nxt.incarnation)
        restored = sorted({s for x in first.values() if isinstance(s := x.get("restored_step"), int)})
        pace = max(self.size.result.step_s or 0.0, self.args.step_delay)
        made = self.lines.last_step.get(self.launches()[number - 1].incarnation)
        at_fault = run.step_at_fault or 0
        run.overrun_s = None if made is None else max(0, made - at_fault) * pace
        shrunk = "" if (n := self.ranks_of(nxt)) == self.ranks else f"; {ranks_said(n, self.ranks)} ranks"
        self.log(f"launch {nxt.number} stepping (restored {restored}; fault at step {at_fault}, the old ranks "
                 f"made {'?' if made is None else max(0, made - at_fault)} after it{shrunk})")

    def finish(self) -> None:
        """The run's end, set by the bench: a finish time every light rank turns into one last step,
        then the job's end."""
        t0 = time.monotonic()
        at = finish_time(time.time(), self.args.step_delay)
        write_atomic(self.finish_file, f"{at!r}\n", durable=False)
        self.log(f"finishing: every rank ends at the first step due at or after "
                 f"{time.strftime('%H:%M:%S', time.gmtime(at))}.{int(at % 1 * 100):02d} UTC")
        self.ended = self.wait(lambda: self.journal().state.outcome is not None, self.args.timeout)
        if not self.ended:
            self.ended = self.wait(self.job_finished, STUCK_STEP_S)
        if self.ended and self.journal().state.outcome is not None:
            self.end_stuck_steps(time.monotonic() - t0)
            self.ended = self.wait(self.job_finished, self.args.timeout)
        self.said_stepping()   # the job over: every line is in, the old ranks long gone
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self.size.spent("finish", t0)

    def end_stuck_steps(self, since_s: float) -> None:
        """The journal says done but the job has not ended STUCK_STEP_S later: SIGKILL the slurmstepd of
        this job's steps still there (``stuck_steps``), said in the checks. Slurm 22.05 on one host: a
        killed step's slurmstepd outlived its step by 8+ minutes after slurmctld logged "Step complete
        ... was already processed" (07:08, 10:31 at 64 nodes: the run done, the job's end held), which
        held the size's wait for its 600 s."""
        try:
            sockets = socket_inodes_under(Path("/proc/net/unix").read_text(), Path(self.args.state_dir).resolve())
        except OSError:
            sockets = set()
        found = stuck_steps({pid: cmdline(pid) for pid in pids()}, self.job_id,
                            lambda pid: holds_socket(pid, sockets))
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        what = ", ".join(f"{step} (pid {pid})" for pid, step in sorted(found.items(), key=lambda x: (x[1], x[0])))
        what = what or "none found"
        self.log(f"the run is done but job {self.job_id} has not ended {since_s:.0f} s after the finish was "
                 f"written: its steps' slurmstepd left: {what}; SIGKILLed")
        self.size.result.checks.append(f"note: {self.path}: job {self.job_id}'s end waited for its steps' "
                                       f"slurmstepd after the run was done: {what}, SIGKILLed by the bench")

    def supervisor_log(self) -> str:
        try:
            return (self.work / ("batch.out" if self.path == "inalloc" else "supervisor.log")).read_text(errors="replace")
        except OSError:
            return ""

    def store_line(self, launch: int) -> tuple[float, float] | None:
        """When launch ``launch``'s rank 0 had its store listening and every join (``STORE_LINE``, in
        the step's output under OMNI_LOG_DIR), None when it did not say."""
        try:
            text = (self.work / "logs" / f"{step_name(self.job_id, launch)}.log").read_text(errors="replace")
        except OSError:
            return None
        m = STORE_LINE.search(text)
        return (float(m["listening"]), float(m["joined"])) if m else None

    def decide_cpu(self, k: int, group: int = 2) -> float | None:
        """The supervisor's own CPU seconds from confirming launch ``k`` to journaling launch k + 1
        (``group`` 3: the seconds its threads waited for a core meanwhile, where its lines say)."""
        return decide_delta(self.supervisor_log(), k, group)

    def teardown(self, k: int) -> float | None:
        """Seconds from the supervisor's kill of launch ``k``'s step to its srun's end (``_TEARDOWN``)."""
        return teardown_s(self.supervisor_log(), k)

    def commands(self) -> list[tuple[float, float, str, bool]]:
        """The supervisor's Slurm commands from its debug log (slurm/runner.py): (when it started,
        seconds it ran (0 for one started and not waited for), its name and first word, started only)."""
        out = []
        for line in self.supervisor_log().splitlines():
            m = _CMD_LINE.match(line)
            if m is None or line.endswith(" in thread omni-node-read"):   # the watch's reads: no wait of decide
                continue
            at = time.mktime(time.strptime(m["at"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"]) / 1000
            words = [w.strip("' ") for w in m["argv"].split(",")]
            name = " ".join(w for w in words[:2] if w)
            took = float(m["took"]) if m["took"] else 0.0
            out.append((at - took, took, name, m["kind"] == "started"))
        return out

    def ranks_of(self, launch: Any) -> int:
        """The ranks ``launch`` runs, as the supervisor journaled its nodes (fewer than the job's when it
        shrank the launch)."""
        return launch_ranks(launch.layout.components, TASKS_PER_NODE)

    def split(self, run: Run, confirmed_at: float | None, journaled_at: float, tasks: list[float],
              ranks: int) -> None:
        """decide's commands and launch's parts (``SPLIT``)."""
        cmds = self.commands()
        if confirmed_at is not None:
            inside = [c for c in cmds if confirmed_at - 0.01 <= c[0] <= journaled_at]
            run.decide_cmds = [f"{name} +" if started else f"{name} {took:.2f}" for _, took, name, started in inside]
            run.split["decide_cmds"] = sum(took for _, took, _, started in inside if not started)
        sruns = [at for at, _, name, started in cmds if started and name.startswith("srun") and at >= journaled_at - 0.01]
        if sruns and len(tasks) == ranks:
            run.split["to_srun"] = sruns[0] - journaled_at
            run.split["srun_to_task"] = min(tasks) - sruns[0]
            run.split["task_spread"] = max(tasks) - min(tasks)

    def phases(self, run: Run) -> None:
        la = self.launches()
        k = run.launch if run.launch is not None else 0
        l0, l1 = la[k], la[k + 1]
        conf = l0.confirmed
        run.cause = conf.cause if conf else ""
        if conf is not None:
            run.confirmed_by = [*conf.reasons[:1], *(f"{x.source} {x.kind}{' ' + x.node if x.node else ''} "
                                                    f"+{x.at - run.fault_at:.2f}" for x in conf.signals)]
            if run.fault_cmd_s is not None:
                run.confirmed_by.append(f"the fault's own scontrol update ended +{run.fault_cmd_s:.2f}")
            for m in _ANSWERED.finditer(self.supervisor_log()):   # the read srun's report asked for
                at = time.mktime(time.strptime(m["at"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"]) / 1000
                if run.fault_at <= at <= (conf.confirmed_at or at) + 1.0:
                    run.confirmed_by.append(f"Slurm's state of {m['nodes']} answered {float(m['took']):.2f} s "
                                            "after it was asked")
                    break
            late: dict[str, list[float]] = {}
            for m in _LATE.finditer(self.supervisor_log()):   # the loop late between the fault and the confirmation
                at = time.mktime(time.strptime(m["at"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"]) / 1000
                if run.fault_at <= at <= (conf.confirmed_at or at) + 0.05:
                    late.setdefault(m["what"], []).append(float(m["took"]))
            run.confirmed_by.extend(f"the supervisor's loop: {what} {max(v):.2f} s (the longest of {len(v)})"
                                    for what, v in late.items())
        first = self.first_lines(l1.incarnation)
        ranks = self.ranks_of(l1)
        started = [float(x["task_started_at"]) for x in first.values() if x.get("task_started_at")]
        ready = [float(x["groups_ready_at"]) for x in first.values() if x.get("groups_ready_at")]
        stepped = [float(x["time"]) for x in first.values() if x.get("time")]   # each rank's first step's line
        marks: list[tuple[str, float | None]] = [
            ("detect", conf.detected_at if conf else None), ("confirm", conf.confirmed_at if conf else None),
            ("decide", l1.started_at),
            ("launch", max(started) if len(started) == ranks else None),
            ("rendezvous", max(ready) if len(ready) == ranks else None),
            ("first_step", max(stepped) if len(stepped) == ranks else None)]
        prev: float | None = run.fault_at
        for name, at in marks:
            if at is not None and prev is not None:
                run.phases[name] = float(at) - prev
            prev = float(at) if at is not None else None
        if run.phases.get("first_step") is not None:
            run.total = sum(run.phases.values())
        if l1.started_at is not None:
            self.split(run, conf.confirmed_at if conf else None, float(l1.started_at), started, ranks)
        store = first.get(0, {}).get("groups_ready_at")   # rank 0 is ready once every rank joined its store
        if store and len(started) == ranks and len(ready) == ranks:
            run.split["rdv_join"] = float(store) - max(started)
            run.split["rdv_answer"] = max(ready) - float(store)
            said = self.store_line(l1.number)
            if said is not None:
                run.split["rdv_listen"] = max(0.0, said[0] - max(started))
        cpu = self.decide_cpu(k)
        if cpu is not None:
            run.split["decide_cpu"] = cpu
        waited = self.decide_cpu(k, group=3)
        if waited is not None:
            run.split["decide_wait"] = waited
        gone = self.teardown(k)
        if gone is not None:
            run.split["teardown"] = gone
        if stepped and len(stepped) == ranks:
            seconds, used, procs, busy = self.size.sampler.window(run.fault_at, max(stepped))
            if seconds:
                run.cpu_share = {"seconds": seconds, "cpu": used, "procs": procs, "machine": busy,
                                 "others": self.size.sampler.others_window(run.fault_at, max(stepped))}

    def check(self) -> None:
        r, st = self.size.result, self.journal().state
        for la in st.launches[1:]:
            first = self.first_lines(la.incarnation)
            restored = {x.get("restored_step") for x in first.values()}
            ranks = self.ranks_of(la)
            ok = len(first) == ranks and len(restored) == 1 and next(iter(restored)) not in (None, 0)
            r.checks.append(f"{'PASS' if ok else 'FAIL'} {self.path}: every rank of launch {la.number} restored the "
                            f"same step: {len(first)}/{ranks_said(ranks, self.ranks)} ranks, restored steps "
                            f"{sorted(s for s in restored if s is not None)}")
        extra = unplanned(len(st.launches), [x.launch for x in self.runs if x.launch is not None])
        causes = [f"launch {j} after launch {j - 1} confirmed "
                  f"{(c.cause if (c := st.launches[j - 1].confirmed) else '?')!r} with no fault injected" for j in extra]
        r.checks.append(f"{'FAIL' if extra else 'PASS'} {self.path}: every relaunch followed a fault the bench "
                        f"injected: {len(st.launches) - 1 - len(extra)} of {len(st.launches) - 1}"
                        + (f" ({'; '.join(causes)})" if causes else ""))
        last = st.launches[-1]
        done_ok, done = finish_check(self.beats(last.incarnation), self.ranks_of(last), self.budget)
        state = self.job_state()
        # in-allocation the batch script ends the job; in allocation mode the supervisor releases it
        want = "COMPLETED" if self.path == "inalloc" else "CANCELLED"
        rc = "" if self.proc is None else f", supervisor exit {self.proc.poll()}"
        ok = (not self.ended and st.outcome == "done" and done_ok and state == want
              and (self.proc is None or self.proc.poll() == 0))
        r.checks.append(f"{'PASS' if ok else 'FAIL'} {self.path}: the run finished after {len(st.launches) - 1} "
                        f"relaunches at the bench's finish time: journal {st.outcome or '-'}, {done}, job {state}{rc}"
                        + (f" ({self.ended})" if self.ended else ""))

    def cleanup(self) -> None:
        self.fault_scontrol.close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            try:   # its srun and squeue, in the session it leads (start_new_session)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        if self.job_id and not self.job_finished():
            self.size.runner.run(["scancel", self.job_id], check=False)
        for node in self.down:
            self.size.runner.run(["scontrol", "update", f"nodename={node}", "state=RESUME"], check=False)
        self.down = []


# -- the table -----------------------------------------------------------------------------------
def fmt(v: float | None, unit: str = "s", digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def log_slope(a: tuple[int, float | None], b: tuple[int, float | None]) -> float | None:
    (n0, v0), (n1, v1) = a, b
    if v0 is None or v1 is None or v0 <= 0 or v1 <= 0 or n0 == n1:
        return None
    return math.log(v1 / v0) / math.log(n1 / n0)


def slope(a: tuple[int, float | None], b: tuple[int, float | None]) -> str:
    s = log_slope(a, b)
    return "n/a" if s is None else f"{s:+.2f}"


def run_value(r: Result, path: str, fault: str, p: str) -> float | None:
    run = r.run(path, fault)
    if run is None or run.na:
        return None
    if p == "total":
        return run.total
    if p == "cpu/recovery":
        return run.cpu_recovery
    if p in SPLIT:
        return run.split.get(p)
    if p == "detect+confirm":
        d, c = run.phases.get("detect"), run.phases.get("confirm")
        return None if d is None or c is None else d + c
    if p == "start":
        parts = [run.phases.get(x) for x in ("launch", "rendezvous", "first_step")]
        return None if any(x is None for x in parts) else sum(x for x in parts if x is not None)
    return run.phases.get(p)


def report(results: list[Result], args: argparse.Namespace) -> None:
    results = sorted(results, key=lambda r: r.nodes)
    setting = args.heartbeat_node_dir
    beats = ("a heartbeat file per node (the default: /dev/shm on each node)" if not setting
             else f"a heartbeat file per rank (OMNI_HEARTBEAT_NODE_DIR={setting})" if setting.lower() in NODE_DIR_OFF
             else f"a heartbeat file per node (OMNI_HEARTBEAT_NODE_DIR={setting})")
    print(f"\n{beats}")
    print_settings()
    print(f"recovery: {TASKS_PER_NODE} light ranks per active node, {SPARES} spare, the faults in turn, phases in "
          "seconds from the one before; cpu/rec: the supervisor's CPU (with its sruns) fault -> first step, "
          "ctld: slurmctld's")
    head = (f"{'nodes':>5} {'ranks':>5} {'path':>7} {'fault':>5} " + " ".join(f"{p:>10}" for p in (*PHASES, "total"))
            + f" {'cpu/rec':>8} {'ctld':>7} {'load':>6}")
    print(head)
    for r in results:
        if r.na:
            print(f"{r.nodes:>5} {r.ranks:>5}  n/a: {r.na}")
            continue
        for run in r.runs:
            lead = f"{r.nodes:>5} {r.ranks:>5} {run.path:>7} {run.fault:>5} "
            if run.na:
                print(lead + f" n/a: {run.na}")
                continue
            print(lead + " ".join(f"{fmt(run.phases.get(p)):>10}" for p in PHASES) + f" {fmt(run.total):>10}"
                  f" {fmt(run.cpu_recovery):>8} {fmt(run.ctld_cpu):>7} {run.load:>6.1f}")
    print("\ndecide and launch split (seconds): decide_cmds, the blocking Slurm commands inside decide (the "
          "rest is the supervisor's own work); launch = to_srun (journaled -> srun started) + srun_to_task "
          "(-> the first task running) + task_spread (-> the last); rendezvous = rdv_join (-> rank 0's store "
          "had every rank's join; rdv_listen: the part of it before rank 0's store listened) + rdv_answer (-> the "
          "last rank read its answer); the commands decide ran or started")
    print(f"{'nodes':>5} {'path':>7} {'fault':>5} " + " ".join(f"{p:>12}" for p in SPLIT) + "  commands in decide")
    for r in results:
        for run in r.runs if not r.na else []:
            if run.na or not (run.split or run.decide_cmds):
                continue
            print(f"{r.nodes:>5} {run.path:>7} {run.fault:>5} " + " ".join(f"{fmt(run.split.get(p)):>12}" for p in SPLIT)
                  + "  " + (", ".join(run.decide_cmds) or "none"))
    print("\nwhat confirmed each recovery: the rule's reason; each signal as the supervisor heard it (source, "
          "kind, node, seconds after the fault)")
    for r in results:
        for run in r.runs if not r.na else []:
            if run.confirmed_by:
                print(f"{r.nodes:>5} {run.path:>7} {run.fault:>5}  " + "; ".join(run.confirmed_by))
    print("\ncontrol plane in steady state: the supervisor's CPU per heartbeat poll "
          f"(every {HEARTBEAT_POLL_S} s, over {args.cpu_window:.0f} s)")
    for r in results:
        if r.cpu_per_poll:
            print(f"{r.nodes:>5} nodes, {r.ranks:>5} ranks: " + ", ".join(
                f"{path} {1000 * v:.1f} ms" for path, v in r.cpu_per_poll.items()))
    print("\nwhere the machine's CPU went, per process class (bench/cpu_share.py, /proc sampled every 1-2 s): "
          "in steady state, then each recovery fault -> first step; share of the CPU used, seconds, per process; "
          "under each, what the other class holds by name (kernel threads by kind, init with the orphans it reaped)")
    for r in results:
        for path, w in r.cpu_share.items():
            print(f"{r.nodes:>5} {path:>7} steady: " + share_line(w["seconds"], w["cpu"], w["procs"], w.get("machine", 0.0)))
            if w.get("others"):
                print(f"{'':>14} other: " + others_line(w["others"]))
        for run in r.runs if not r.na else []:
            if run.cpu_share:
                w = run.cpu_share
                print(f"{r.nodes:>5} {run.path:>7} {run.fault:>6}: "
                      + share_line(w["seconds"], w["cpu"], w["procs"], w.get("machine", 0.0)))
                if w.get("others"):
                    print(f"{'':>14} other: " + others_line(w["others"]))
    print("\nfile-system operations per second in steady state (inotify over the same window; metadata: create, "
          "rename, unlink; data: writes), per active node; the checkpoint folder's own files (each rank's "
          "checkpoint markers, one durable create and rename per rank every --ckpt-every steps, not watched)")
    for r in results:
        for path, ops in r.fs_ops.items():
            n = max(1, r.nodes - SPARES)
            print(f"{r.nodes:>5} nodes {path:>7}: " + ", ".join(
                f"{area} {ops.get(area + '_meta', 0) / n:.2f} meta + {ops.get(area + '_data', 0) / n:.2f} data"
                for area in ("heartbeat", "checkpoint", "metrics")))
    print("\nmemory (private MiB per process), cost of the cluster, wall time of each size")
    for r in results:
        m = r.memory
        if not m:
            continue
        print(f"{r.nodes:>5} nodes: up {fmt(r.up_s, 's', 0)}; size done in {wall_line(r)}; ranks step in "
              f"{fmt(r.step_s)}; slurmd {m.get('slurmd_mib', 0):.1f} MiB "
              f"(idle {m.get('slurmd_idle_cpu_ms_per_s', 0):.1f} ms CPU/s each), slurmctld "
              f"{m.get('slurmctld_mib', 0):.1f} MiB, slurmstepd {m.get('slurmstepd_mib', 0):.1f} MiB "
              f"x {int(m.get('slurmstepd_count', 0))}, light rank {m.get('rank_mib', 0):.1f} MiB "
              f"x {int(m.get('rank_count', 0))}")
        if m.get("rank_cpu_ms_per_s") is not None:
            print(f"{'':>5}        CPU in steady state, ms per second: " + "; ".join(
                f"{what} {m[k + '_cpu_ms_per_s']:.1f} each, {m[k + '_all_cpu_ms_per_s']:.0f} all"
                for k, what in (("slurmd", "slurmd"), ("stepd", "slurmstepd"), ("rank", "light rank"),
                                ("ctld", "slurmctld")) if m.get(k + "_cpu_ms_per_s") is not None)
                  + f" (of the machine's {1000 * (os.cpu_count() or 1)})")
    measured = [r for r in results if not r.na and any(not x.na for x in r.runs)]
    from64 = [r for r in measured if r.nodes >= 64]
    pair = (from64[0], from64[-1]) if len(from64) >= 2 else (measured[0], measured[-1]) if len(measured) >= 2 else None
    if pair is not None:
        a, b = pair
        print(f"\nlog-log slope {a.nodes} -> {b.nodes} nodes (1: linear in nodes; 0: flat)")
        cols = [(path, fault) for path in args.paths for fault in args.faults]
        print(f"  {'':<14} " + " ".join(f"{path + '/' + fault:>13}" for path, fault in cols))
        for p in (*PHASES, *SPLIT, "total", "cpu/recovery"):
            print(f"  {p:<14} " + " ".join(
                f"{slope((a.nodes, run_value(a, path, fault, p)), (b.nodes, run_value(b, path, fault, p))):>13}"
                for path, fault in cols))
        print(f"  {'cpu/poll':<14} " + " ".join(
            f"{slope((a.nodes, a.cpu_per_poll.get(path)), (b.nodes, b.cpu_per_poll.get(path))):>13}"
            for path, _ in cols))
        small, large = measured[0], measured[-1]
        for path in args.paths:
            v0, v1 = (run_value(small, path, "node", "detect+confirm"), run_value(large, path, "node", "detect+confirm"))
            if v0 and v1 is not None:
                print(f"  {path}: a node loss confirmed (fault -> confirmed) in {v1:.2f} s at {large.nodes} nodes, "
                      f"{v1 / v0:.1f} x the {v0:.2f} s at {small.nodes} nodes{after_applied(small, large, path)}")
        limit = machine_limit(a, b, args)
        if limit:
            print(f"  {limit}")
        start = start_cpu_s()
        print(f"  process start on this machine: one light rank's task (bash, then the rank) takes "
              f"{1000 * start:.0f} ms of CPU to start (median of 5, now), a slurmstepd what the size measured; the "
              f"launch's floor, every node's slurmstepd and every rank started on {os.cpu_count()} cores: "
              f"{launch_floor(a, start)}, {launch_floor(b, start)} (slope {slope((a.nodes, floor_s(a, start)), (b.nodes, floor_s(b, start)))}: "
              "the launch grows with the processes started on one machine whatever srun does; a cluster starts "
              "them on their own nodes' cores)")
        for r in measured:
            launches = sorted(v for x in r.runs if not x.na and (v := x.phases.get("launch")) is not None)
            if launches:
                print(f"  {r.nodes:>4} nodes: launch median {launches[len(launches) // 2]:.2f} s against the floor "
                      f"{launch_floor(r, start)} (x{launches[len(launches) // 2] / max(1e-9, floor_s(r, start)):.1f})")
        for r in measured:
            runs = [x for x in r.runs if not x.na and x.phases.get("decide") is not None]
            if not runs:
                continue
            counts = sorted(len(x.decide_cmds) for x in runs)
            cpu = median([x.split["decide_cpu"] for x in runs if "decide_cpu" in x.split])
            bare = ", ".join(f"{k} {v:.2f} s" for k, v in r.bare_cmds.items()) or "n/a"
            print(f"  {r.nodes:>4} nodes: decide ran {counts[0]}-{counts[-1]} Slurm commands (none per node): median "
                  f"{fmt(median([x.split.get('decide_cmds', 0.0) for x in runs]))} of them (the same two bare in steady "
                  f"state: {bare}) and {fmt(cpu)} of the supervisor's own CPU in a median decide of "
                  f"{fmt(median([float(x.phases['decide']) for x in runs]))}, at load "
                  f"{min(x.load for x in runs):.0f}-{max(x.load for x in runs):.0f}")
        for r in measured:
            rdv = median([v for x in r.runs if not x.na and (v := x.phases.get("rendezvous")) is not None])
            if rdv is not None:
                print(f"  {r.nodes:>4} nodes: rendezvous median {rdv:.2f} s against the machine's floor "
                      f"{fmt(r.join_floor)} ({r.ranks} running processes join one server and wake on its answer, "
                      f"nothing else: join_floor)")
        verdicts(a, b, args, start)
    print("\none heartbeat scan (read_heartbeats, the supervisor's and the manager's per poll) over synthetic "
          "files, CPU / wall, median of 5")
    for r in results:
        if r.scan is not None:
            print(f"  {r.ranks:>5} ranks: {1000 * r.scan[0]:.1f} ms / {1000 * r.scan[1]:.1f} ms "
                  f"({1e6 * r.scan[0] / max(1, r.ranks):.0f} us CPU per file)")
    print("\nchecks")
    for r in results:
        for line in r.checks or ([f"n/a: {r.na}"] if r.na else []):
            print(f"  {r.nodes:>4} nodes: {line}")


def median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def after_applied(small: Result, large: Result, path: str) -> str:
    """The node loss's confirmation counted from the fault's own ``scontrol update`` answered (the
    node DOWN in slurmctld by then) at both sizes, beside the bar's fault -> confirmed: at 512 nodes
    slurmctld answered the fault itself 0.08-0.50 s after it was sent (11:35), time no signal can
    beat. Information only: the bar stays fault -> confirmed."""
    got = []
    for r in (small, large):
        run, v = r.run(path, "node"), run_value(r, path, "node", "detect+confirm")
        if run is None or v is None or run.fault_cmd_s is None:
            return ""
        got.append((v - run.fault_cmd_s, run.fault_cmd_s))
    (s0, c0), (s1, c1) = got
    return (f" (the fault's own scontrol update answered +{c0:.2f} / +{c1:.2f} s; from then {s0:.2f} -> "
            f"{s1:.2f} s, information only)")


def split_median(r: Result, part: str) -> float | None:
    """The median of one ``SPLIT`` part over a size's measured runs."""
    return median([v for x in r.runs if not x.na and (v := x.split.get(part)) is not None])


def teardown_s(log_text: str, k: int) -> float | None:
    """The last ``its srun ended X s after the kill`` line of launch ``k`` in the supervisor's log."""
    found = [float(m[2]) for m in _TEARDOWN.finditer(log_text) if int(m[1]) == k]
    return found[-1] if found else None


def decide_delta(text: str, k: int, group: int) -> float | None:
    """From the supervisor's log: the change of a figure of its debug lines from confirming launch
    ``k`` to journaling launch k + 1 (``group`` 2: the process's CPU, from the first ``deciding``
    line, at the confirmation); or, ``group`` 3, the deciding thread's wait for a core from the last
    ``deciding`` line (after the killed step's srun ended: the wait inside the teardown is the
    teardown's, counted there) to the record. None where a line or the figure is missing; never below 0."""
    at: dict[int, float] = {}
    for m in _DECIDING.finditer(text):   # a step that ended on its own has one line, one confirmed while it ran two
        if m[group] is not None:
            if group == 3:
                at[int(m[1])] = float(m[group])
            else:
                at.setdefault(int(m[1]), float(m[group]))
    done = {int(m[1]): float(m[group]) for m in _JOURNALED.finditer(text) if m[group] is not None}
    return max(0.0, done[k + 1] - at[k]) if k in at and k + 1 in done else None


def without_wait(r: Result, path: str, fault: str) -> float | None:
    """decide less the killed step's teardown and the supervisor's wait for a core (``decide_wait``):
    what the control plane itself does; None when decide or that wait is unmeasured."""
    d, w = without_teardown(r, path, fault), run_value(r, path, fault, "decide_wait")
    return None if d is None or w is None else max(d - w, 1e-3)


def without_teardown(r: Result, path: str, fault: str) -> float | None:
    """decide less the killed step's teardown (``teardown``): what the supervisor itself waits on and
    does between the confirmation and the next launch's record; None when decide is unmeasured. The
    supervisor says when the killed step's srun ended only where the next launch waits for it (from
    512 nodes, ``--kill-grace``): below, decide holds no teardown."""
    d, t = run_value(r, path, fault, "decide"), run_value(r, path, fault, "teardown")
    return None if d is None else max(d - (t or 0.0), 1e-3)


def phase_slopes(a: Result, b: Result, args: argparse.Namespace, p: str) -> list[float]:
    return [v for path in args.paths for fault in args.faults
            if (v := log_slope((a.nodes, run_value(a, path, fault, p)), (b.nodes, run_value(b, path, fault, p))))
            is not None]


def verdicts(a: Result, b: Result, args: argparse.Namespace, start: float) -> None:
    """Issue 19's bar for every phase from the confirmation to the first step: a log-log slope of at
    most 0.5 from ``a`` to ``b`` nodes (the median over paths and faults), or the machine's own limit
    named with the figure that shows it: LIMIT when what the control plane itself does stays within
    the bar and a floor of this machine measured beside it grows as the phase does; else MISS."""
    print(f"\nphases from the confirmation to the first step, {a.nodes} -> {b.nodes} nodes (bar: slope <= 0.5, "
          "else the machine's limit named)")
    for p in ("decide", "launch", "rendezvous", "first_step"):
        got = median(phase_slopes(a, b, args, p))
        if got is None:
            print(f"  {p:<11} n/a: not measured at both sizes")
            continue
        if got <= 0.5:
            print(f"  {p:<11} PASS slope {got:+.2f}")
            continue
        why, own = "", None
        if p == "decide":
            cmds = median(phase_slopes(a, b, args, "decide_cmds"))
            rest = median([v for path in args.paths for fault in args.faults
                           if (v := log_slope((a.nodes, without_teardown(a, path, fault)),
                                              (b.nodes, without_teardown(b, path, fault)))) is not None])
            ta = split_median(a, "teardown")
            tb = split_median(b, "teardown")
            cpu = median(phase_slopes(a, b, args, "decide_cpu"))
            own_work = median([v for path in args.paths for fault in args.faults
                               if (v := log_slope((a.nodes, without_wait(a, path, fault)),
                                                  (b.nodes, without_wait(b, path, fault)))) is not None])
            # what the control plane itself does in decide: without Slurm's teardown of the killed step
            # and the supervisor's wait for a core when those were measured at both sizes, else without
            # the teardown, else the supervisor's own CPU
            own = own_work if own_work is not None else rest if rest is not None else cpu
            wa, wb = split_median(a, "decide_wait"), split_median(b, "decide_wait")
            why = (f"the killed step's teardown (Slurm's slurmstepd killing {b.ranks} tasks on one host, "
                   f"which the next launch waits for) {fmt(ta)} -> {fmt(tb)} (slope "
                   f"{fmt(median(phase_slopes(a, b, args, 'teardown')), '', 2)}); decide without it slope "
                   f"{fmt(rest, '', 2)}; the supervisor's threads runnable and waiting for a core in it {fmt(wa)} "
                   f"-> {fmt(wb)}; decide without both slope {fmt(own_work, '', 2)}; ")
            bare = {k: log_slope((a.nodes, a.bare_cmds.get(k)), (b.nodes, v)) for k, v in b.bare_cmds.items()}
            why += (f"the supervisor's own CPU in decide slope {fmt(cpu, '', 2)}; its Slurm commands (none per node) "
                   f"slope {fmt(cmds, '', 2)}, the same commands bare in steady state "
                   + ", ".join(f"{k} {fmt(a.bare_cmds.get(k))} -> {fmt(b.bare_cmds.get(k))} (slope {fmt(v, '', 2)})"
                               for k, v in bare.items())
                   + f"; the rest waits for one of {os.cpu_count()} cores at load {a.load:.0f} -> {b.load:.0f}")
        elif p == "launch":
            fa, fb = floor_s(a, start), floor_s(b, start)
            la = median([v for x in a.runs if not x.na and (v := x.phases.get("launch")) is not None])
            lb = median([v for x in b.runs if not x.na and (v := x.phases.get("launch")) is not None])
            own = log_slope((a.nodes, la / fa if la and fa else None), (b.nodes, lb / fb if lb and fb else None))
            why = (f"process start on {os.cpu_count()} cores: the floor {fa:.1f} -> {fb:.1f} s (slope "
                   f"{fmt(log_slope((a.nodes, fa), (b.nodes, fb)), '', 2)}), the launch over its floor x"
                   f"{fmt(la / fa if la and fa else None, '', 1)} -> x{fmt(lb / fb if lb and fb else None, '', 1)} "
                   f"(slope {fmt(own, '', 2)})")
            na, nb = node_side_s(a), node_side_s(b)
            if na and nb and la and lb:   # measured, not estimated: it decides
                own = log_slope((a.nodes, la / na), (b.nodes, lb / nb))
                why += (f"; measured: the node side's CPU per recovery ({', '.join(NODE_SIDE)}) over "
                        f"{os.cpu_count()} cores {na:.1f} -> {nb:.1f} s (slope {fmt(log_slope((a.nodes, na), (b.nodes, nb)), '', 2)}), "
                        f"the launch over it x{la / na:.1f} -> x{lb / nb:.1f} (slope {fmt(own, '', 2)})")
        elif p == "rendezvous":
            ra = median([v for x in a.runs if not x.na and (v := x.phases.get("rendezvous")) is not None])
            rb = median([v for x in b.runs if not x.na and (v := x.phases.get("rendezvous")) is not None])
            fa, fb = a.join_floor, b.join_floor
            own = log_slope((a.nodes, ra / fa if ra and fa else None), (b.nodes, rb / fb if rb and fb else None))
            why = (f"{b.ranks} processes joining one server on {os.cpu_count()} cores: the join's floor {fmt(fa)} -> "
                   f"{fmt(fb)} (slope {fmt(log_slope((a.nodes, fa), (b.nodes, fb)), '', 2)}), the rendezvous over "
                   f"its floor x{fmt(ra / fa if ra and fa else None, '', 1)} -> x{fmt(rb / fb if rb and fb else None, '', 1)}"
                   f" (slope {fmt(own, '', 2)})")
            for part, what in (("rdv_listen", "rank 0's store listening"), ("rdv_join", "every join at rank 0's store"),
                               ("rdv_answer", "the answer read by every rank")):
                va = split_median(a, part)
                vb = split_median(b, part)
                why += (f"; {what} {fmt(va)} -> {fmt(vb)} (slope "
                        f"{fmt(median(phase_slopes(a, b, args, part)), '', 2)})")
        verdict = "LIMIT" if own is not None and own <= 0.5 else "MISS"
        print(f"  {p:<11} {verdict} slope {got:+.2f}: {why or 'no floor measured for it'}")


PID_MAX = Path("/proc/sys/kernel/pid_max")
PID_MAX_WANTED = 4194304
"""The kernel's largest pid space on 64 bits, Debian 12's own default (systemd's 50-pid-max.conf); a
machine without systemd (this one) keeps the kernel's 32,768."""
PID_SPACE_NOTE = ""
"""What ``widen_pid_space`` did, printed among the lane's settings."""


def widen_pid_space(sizes: list[int], path: Path = PID_MAX) -> str:
    """kernel.pid_max raised to PID_MAX_WANTED for a size above 64 nodes (root only); what was done, or
    why not. proctrack/pgid (LARGE_SETTINGS) signals a killed step's tasks by their process group's id
    until the group is gone (1, 2, 4 ... s apart); with 32,768 ids the host's ~7,000 processes per
    512-node launch wrap them within that time, a task of the next launch that leads its node's group
    can take an old group's id, and the old step's slurmstepd SIGKILLs it. Seen: 07:37 UTC, 512 nodes,
    allocation path, the node loss's relaunch lost at its start ('node147: task 584: Killed' and 587,
    its srun's first lines, no fault injected, the old step still being killed; the 05:03 run's launch 1
    ended the same way), the one sender of SIGKILL to a new task at its start we found. An emulation's
    cost only: on a cluster each node has its own pid space and a few processes."""
    if max(sizes, default=0) <= 64:
        return ""
    try:
        now = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError) as e:
        return f"kernel.pid_max unread ({e}): a relaunch may lose tasks to an old step's proctrack/pgid"
    if now >= PID_MAX_WANTED:
        return f"kernel.pid_max={now}"
    try:
        path.write_text(f"{PID_MAX_WANTED}\n")
    except OSError as e:
        return (f"kernel.pid_max={now}, not raised ({e}): a relaunch may lose tasks to an old step's "
                f"proctrack/pgid (raise it: sysctl -w kernel.pid_max={PID_MAX_WANTED})")
    return f"kernel.pid_max {now} -> {PID_MAX_WANTED} (Debian 12's default)"


def print_settings() -> None:
    """What keeps each component's cost down in this lane (module doc), printed above the table."""
    print("the lane's settings (slurm.conf at every size, ClusterSpec.scale_lane; slurm_omni/cluster/spec.py):")
    for key, value, why in LARGE_SETTINGS:
        print(f"  slurm.conf {key}={value}: {why}")
    if RANK_GROUP is not None:
        print(f"  light ranks in the cgroup {RANK_GROUP.path or '-'} ({RANK_GROUP.how}): one host stands for 512 "
              "nodes; on a cluster the ranks have their own nodes' cores and never take slurmctld's or the "
              "supervisor's, here every slurmstepd's session weighs as much as slurmctld's (512 of them starved it), "
              "in the group all ranks weigh a quarter of one (their interpreter starts before they join; slurmd, "
              "slurmstepd, srun and the supervisor keep their weight)")
    if CONTROL_GROUP is not None:
        print(f"  slurmctld, its munged and the supervisor in the cgroup {CONTROL_GROUP.path or '-'} ({CONTROL_GROUP.how}): "
              "on a cluster the control plane runs on hosts of its own, not on the nodes' cores; here the nodes' daemons "
              "tearing down a 512-node step left the supervisor's loop seconds late (17:44: a node loss confirmed "
              "10.9 s after the fault, srun had reported it at +0.14 s); munged, one for every emulated node (a cluster "
              "has one per node), starved at load 2,500 and a 512-node relaunch lost its credentials (11:06, 'Munge "
              "encode failed ... Resource temporarily unavailable'); at two sessions' weight a node loss's teardown, which "
              "starts at the fault, kept the lost node's read 0.06-0.60 s on the run queue (20:21-20:27), at the most a cgroup "
              "may weigh 0.01-0.20 s (--control-shares, CONTROL_SHARES), used only while they have work (`--control-weight "
              "session`: each its own session's)")
        if CONTROL_RT:
            print(f"  slurmctld and the control plane's munged real-time (every thread SCHED_RR {CONTROL_RT}, at most "
                  f"{RT_RUNTIME_US / 1e6:.1f} s per second on each core; --control-rt, CONTROL_RT_DEFAULT): a weight is a "
                  "share over time, not a wake-up: at the largest weight the lost node's read, asked while 511 slurmstepd "
                  "tore the step down, still waited 0.00-0.09 s for them at 512 nodes (2026-12-04, three runs); "
                  "real-time they run when woken, as on a host of their own")
    if MUNGE_GROUP is not None:
        print(f"  the nodes' own munged in the cgroup {MUNGE_GROUP.path or '-'} ({MUNGE_GROUP.how}): on a cluster each "
              "host has its munged, and the control plane's credentials never queue behind the nodes'; with one munged "
              "for all, a 512-node step's teardown kept the lost node's read 0.12 s from slurmctld while munged's threads "
              "sat 0.4 s on the run queue (22:50, --trace-ctld)")
    if NODE_GROUP is not None:
        print(f"  slurmd and slurmstepd in the cgroup {NODE_GROUP.path or '-'} ({NODE_GROUP.how}): the emulated nodes' "
              "daemons weigh one session together, as on a cluster where they run on the nodes' cores, not "
              "slurmctld's (each slurmstepd's own session starved slurmctld while a 512-node step was torn down); "
              "the in-allocation supervisor leaves it once found (`--node-weight session`: as before)")
    if PID_SPACE_NOTE:
        print(f"  {PID_SPACE_NOTE}: proctrack/pgid kills a killed step's process group by its id until it is "
              "gone; with 32,768 ids a 512-node relaunch reused an old group's id for a new task, which the old "
              "step's slurmstepd SIGKILLed (07:37: the node loss's relaunch lost at its start); on a cluster each "
              "node has its own pid space")
    print(f"  light rank: {RANK_KIND}; sleeps between steps (--step-delay) and beats (1 s), one heartbeat file "
          "per node (a node-local folder, one rank copies it twice per interval), no collectives; warm standbys "
          "off; one srun per allocation")


def start_cpu_s() -> float:
    """CPU seconds one light rank's task takes to start (its bash wrapper, then the rank's process
    up to reading its environment: the C rank, or ``python -S`` with its C modules), the median of 5
    (the children's rusage): the work a launch of R ranks puts on the machine's cores before any
    rank runs."""
    # as the step starts each task: bash (the stage wrapper of slurm/steps.py), then the rank, which
    # a bad WORLD_SIZE ends (exit 78) once it has read its environment
    argv = ["bash", "-c", 'exec "$@"', "omni-task", *RANK_ARGV]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_"))}, "WORLD_SIZE": "x"}
    runs = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, env=env, stderr=subprocess.DEVNULL, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return sorted(runs)[2]


def floor_s(r: Result, start_s: float) -> float:
    """The launch's floor on this machine (seconds): every node's slurmstepd start (measured in the
    size's steady state) and every rank's start on the machine's cores, one after the other."""
    stepd = r.memory.get("stepd_start_cpu_ms", 0.0) / 1000
    return ((r.nodes - SPARES) * stepd + r.ranks * start_s) / (os.cpu_count() or 1)


NODE_SIDE = ("rank", "slurmstepd", "slurmd")
"""What runs on the nodes of a cluster (bench/cpu_share.py's classes): here on the one host's cores."""


def node_side_s(r: Result) -> float | None:
    """The median recovery's CPU seconds on the node side (the old ranks' end, every slurmstepd's and
    rank's start, the new ranks' rendezvous and first step, slurmd's forks) over the machine's cores:
    seconds that no control plane can shorten on this machine (bench/cpu_share.py)."""
    return median([sum(x.cpu_share["cpu"].get(c, 0.0) for c in NODE_SIDE) / (os.cpu_count() or 1)
                   for x in r.runs if not x.na and x.cpu_share])


def launch_floor(r: Result, start_s: float) -> str:
    """The launch's floor, said with its figures."""
    cores = os.cpu_count() or 1
    stepd = r.memory.get("stepd_start_cpu_ms", 0.0)
    return (f"({r.nodes - SPARES} slurmstepd x {stepd:.0f} ms + {r.ranks} ranks x {1000 * start_s:.0f} ms) / {cores} "
            f"cores = {floor_s(r, start_s):.1f} s at {r.nodes} nodes")


def machine_limit(a: Result, b: Result, args: argparse.Namespace) -> str:
    """Names the machine's own limit when it sets a slope: the ranks' steady step time against the
    paced one (process start and every rank's beats share the machine's cores)."""
    if a.step_s is None or b.step_s is None:
        return ""
    grew = b.step_s / a.step_s
    if b.step_s < 1.5 * args.step_delay and grew < 1.5:
        return ""
    return (f"the machine's own limit: the ranks' paced {args.step_delay:.2f} s step took {a.step_s:.2f} s at "
            f"{a.nodes} nodes and {b.step_s:.2f} s at {b.nodes} nodes (x{grew:.1f}, {b.ranks} processes on "
            f"{os.cpu_count()} cores): process start and the ranks' own work queue for the same cores, so "
            "launch and rendezvous grow with the ranks here whatever the control plane does")


RUN_FIELDS = {f.name for f in dataclasses.fields(Run)}
"""What a run's record holds now: an earlier run's results.json may hold keys since dropped (extra_s)."""


def load_results(path: Path) -> list[Result]:
    """The sizes of an earlier run's results.json (``--include``), its source in every size's checks."""
    doc = json.loads(path.read_text())
    out = []
    for size in doc["sizes"]:
        r = Result(nodes=size["nodes"], ranks=size["ranks"], na=size["na"], step_s=size.get("step_s"),
                   cpu_per_poll=dict(size.get("cpu_per_poll_s") or {}), elapsed_s=size.get("elapsed_s"),
                   runs=[Run(**{k: v for k, v in x.items() if k in RUN_FIELDS}) for x in size["runs"]],
                   checks=list(size.get("checks") or []),
                   memory=dict(size.get("memory") or {}), up_s=size.get("up_s"), load=size.get("load") or 0.0,
                   scan=tuple(size["scan"]) if size.get("scan") else None, fs_ops=dict(size.get("fs_ops") or {}),
                   bare_cmds=dict(size.get("bare_cmds") or {}), join_floor=size.get("join_floor"),
                   wall=dict(size.get("wall") or {}),
                   cpu_share=dict(size.get("cpu_share") or {}))
        r.checks.append(f"(from {path}: {doc.get('source', '?')}, measured {doc.get('measured', '?')})")
        r.included = True
        out.append(r)
    return out


def write_json(results: list[Result], path: Path, args: argparse.Namespace) -> None:
    """The figures for bench/goodput (``--scale-json``): per size, path and fault, the phases."""
    doc = {"source": "bench/scale_bench.py " + " ".join(sys.argv[1:]), "tasks_per_node": TASKS_PER_NODE,
           "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "step_delay_s": args.step_delay, "heartbeat_interval_s": 1.0,
           "sizes": [{"nodes": r.nodes, "ranks": r.ranks, "na": r.na, "step_s": r.step_s,
                      "cpu_per_poll_s": r.cpu_per_poll, "elapsed_s": r.elapsed_s, "checks": r.checks,
                      "memory": r.memory, "up_s": r.up_s, "scan": r.scan, "load": r.load, "fs_ops": r.fs_ops,
                      "bare_cmds": r.bare_cmds, "join_floor": r.join_floor, "cpu_share": r.cpu_share,
                      "wall": r.wall,
                      "runs": [dataclasses.asdict(x) for x in r.runs]} for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


JOIN_FLOOR = r"""
import _socket, os, sys, time
n = int(sys.argv[1])
srv = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
srv.bind(("127.0.0.1", 0))
srv.listen(4096)
port = srv.getsockname()[1]
gun_r, gun_w = os.pipe()
ts_r, ts_w = os.pipe()
for _ in range(n):
    if os.fork() == 0:
        os.close(gun_w)
        os.read(gun_r, 1)
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        s.connect(("127.0.0.1", port))
        s.sendall(b"1 3,6,9\n")
        s.recv(64)
        os.write(ts_w, repr(time.time()).encode() + b"\n")
        os._exit(0)
os.close(gun_r)
os.close(ts_w)
gun = time.time()
os.close(gun_w)
conns = []
for _ in range(n):
    fd, _addr = srv._accept()
    c = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM, 0, fd)
    data = b""
    while not data.endswith(b"\n"):
        data += c.recv(64)
    conns.append(c)
for c in conns:
    c.sendall(b"9 1.0\n")
out = b""
while chunk := os.read(ts_r, 65536):
    out += chunk
for _ in range(n):
    os.wait()
print(max(float(x) for x in out.split()) - gun)
"""
"""The rendezvous's work with nothing else: n processes already running (forked) connect to one
server, send their steps, and wake on its one answer; the server takes them one by one, as rank 0's
store does. Prints the seconds from the start to the last one awake."""


def join_floor(ranks: int) -> float | None:
    """JOIN_FLOOR for ``ranks`` processes, the median of 3 (None when it failed)."""
    runs = []
    for _ in range(3):
        try:
            out = subprocess.run([sys.executable, "-S", "-c", JOIN_FLOOR, str(ranks)], capture_output=True,
                                 text=True, timeout=120, check=True).stdout
            runs.append(float(out.split()[-1]))
        except (subprocess.SubprocessError, ValueError, IndexError, OSError):
            continue
    return sorted(runs)[len(runs) // 2] if runs else None


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


def saturated(nodes: int, measured: list[Result], paced_s: float, spares: int) -> str:
    """Empty unless a smaller size already saturated the machine (its ranks stepped SATURATED x slower
    than paced: every figure of a larger one would be the machine's, not the control plane's)."""
    prev = next((r for r in reversed(measured) if r.step_s is not None), None)
    if prev is None or prev.step_s is None or prev.step_s < SATURATED * paced_s:
        return ""
    return (f"the machine's own limit: at {prev.nodes} nodes the {prev.ranks} light ranks already stepped in "
            f"{prev.step_s:.1f} s instead of the paced {paced_s:.1f} s (load {prev.load:.0f} on "
            f"{os.cpu_count()} cores), and {TASKS_PER_NODE * (nodes - spares)} would need more CPU still")


STUCK_STEP_S = 60.0
"""How long the job may take to end after the journal said done before the bench looks for its steps'
slurmstepd left (``Job.end_stuck_steps``): the 512-node jobs' whole finish, done and the job's end, took
about 35 s a path (05:03)."""
KILL_GRACE_S = 120.0
"""What the supervisor waits at most for a killed step's srun when two launches do not fit in memory or on
one host's cores (``one_host_relaunch``): a 512-node step's ranks stepped on 55 s after its kill (11:05)."""


SERIAL_RELAUNCH_NODES = 512
"""From this size the next launch waits for the killed step (``--kill-grace``): one host does not tear a
2,044-rank step down and start the next at once. 11:05 (512 nodes, in-allocation, load 260-3,670):
the node loss's and the hang's relaunches, started beside the killed step (its ranks stepped on 55 s
after the fault), failed at their task launch (munged's backlog full: 'Munge encode failed', 'Invalid
job credential', 'Job credential replayed'), and the launch after each, with the old step gone,
started; the crash's (its step over at once) started; 08:02 the same on both paths. At 256 nodes
every relaunch beside the killed step started (08:02, 05:03)."""


def one_host_relaunch(nodes: int) -> str:
    """Why the next launch waits for the killed step at this size (``SERIAL_RELAUNCH_NODES``), or empty."""
    if nodes < SERIAL_RELAUNCH_NODES:
        return ""
    return (f"{nodes} nodes on one host: a relaunch beside a killed step of {TASKS_PER_NODE * (nodes - SPARES)} "
            "ranks failed at its task launch (munged overrun, 11:05 and 08:02)")


def two_launches_fit(nodes: int, measured: list[Result], reserve_mib: float) -> str:
    """Empty when the old launch's slurmstepd and ranks and the next one's fit in MemAvailable at once
    (the supervisor starts the next launch beside the SIGKILLed tasks: at 512 nodes with the Python
    rank both sets ran the host out of memory, 14:26); else why not. The cluster is up: its slurmd
    are in MemAvailable already."""
    got = [r.memory for r in measured if r.memory.get("rank_mib")]
    if not got:
        return ""
    m = got[-1]
    ranks = TASKS_PER_NODE * (nodes - SPARES)
    need = 2 * (nodes * m["slurmstepd_mib"] + ranks * m["rank_mib"])
    have = mem_available_mib() - reserve_mib
    if need <= have:
        return ""
    return (f"two launches need about {need / 1024:.1f} GiB (2 x ({nodes} slurmstepd x {m['slurmstepd_mib']:.1f} + "
            f"{ranks} ranks x {m['rank_mib']:.1f} MiB)), {have / 1024:.1f} GiB available after the reserve")


def fits(nodes: int, measured: list[Result], reserve_mib: float, spares: int) -> str:
    """Empty when the size fits in MemAvailable by the per-process figures measured so far."""
    got = [r.memory for r in measured if r.memory.get("rank_mib")]
    if not got:
        return ""
    m = got[-1]
    ranks = TASKS_PER_NODE * (nodes - spares)
    need = nodes * (m["slurmd_mib"] + m["slurmstepd_mib"]) + ranks * m["rank_mib"]
    have = mem_available_mib() - reserve_mib
    if need > have:
        return (f"needs about {need / 1024:.1f} GiB ({nodes} x slurmd {m['slurmd_mib']:.1f} + slurmstepd "
                f"{m['slurmstepd_mib']:.1f} MiB, {ranks} ranks x {m['rank_mib']:.1f} MiB), {have / 1024:.1f} GiB "
                f"available after a {reserve_mib / 1024:.0f} GiB reserve")
    return ""


def whole_run(seconds: float, results: list[Result], runs_per_size: int = len(FAULTS) * len(PATHS)) -> str:
    """The run's wall time against issue 19's bar (BAR_S with every one of BAR_SIZES in it): PASS
    only when this run measured every size of the bar with ``runs_per_size`` recoveries each; over
    the bar is a MISS whatever ran; under it with a size missing is not shown."""
    missing = [n for n in BAR_SIZES if not any(
        r.nodes == n and not r.na and len(r.runs) >= runs_per_size and not any(x.na for x in r.runs) for r in results)]
    head = f"the whole run: {seconds:.0f} s ({seconds / 60:.1f} min) against the bar of {BAR_S / 60:.0f} min"
    gaps = f"not measured whole here: {', '.join(map(str, missing))} nodes" if missing else ""
    if seconds > BAR_S:
        return f"{head}: MISS (x{seconds / BAR_S:.2f}{'; ' + gaps if gaps else ''})"
    if missing:
        return f"{head}: not shown ({gaps})"
    return f"{head}: PASS"


def wall_line(r: Result) -> str:
    """Where a size's wall time went (``WALL``), its parts and what no part names."""
    told = sum(r.wall.values())
    parts = [f"{k} {r.wall[k]:.0f}" for k in WALL if r.wall.get(k, 0.0) >= 0.5]
    if r.elapsed_s is not None and r.elapsed_s - told >= 0.5:
        parts.append(f"other {r.elapsed_s - told:.0f}")
    return f"{fmt(r.elapsed_s, 's', 0)}: " + ", ".join(parts)


def _stop(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    # SIGTERM, and SIGINT also where a background start ignored it: stop like Ctrl-C, through every
    # finally (the jobs cancelled, nodes resumed, the cluster down, the table printed)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, _stop)   # the terminal gone: the same way down
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,512", help="Node counts, comma-separated.")
    p.add_argument("--state-dir", default=str(REPO / ".omni" / "cluster-scale"))
    p.add_argument("--work", default=str(REPO / ".omni" / "scale-bench"), help="The job's files (the checkpoint folder).")
    p.add_argument("--ctld-port", type=int, default=16817)
    p.add_argument("--slurmd-base-port", type=int, default=16900)
    p.add_argument("--first-job-id", type=int, default=1)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"Faults, in this order, one job each path: {', '.join(FAULTS)}; "
                   "shrink too when named (after node).")
    p.add_argument("--paths", default=",".join(PATHS), help="inalloc (sbatch, the supervisor in the batch script), "
                   "alloc (salloc --no-shell, the supervisor outside with --allocation).")
    p.add_argument("--json", default="", help="Write the figures here (for python -m bench.goodput --scale-json); "
                   "default: results.json in the run's folder under --work.")
    p.add_argument("--run-saturated", action="store_true", help="Run a size even when the one before stepped "
                   f"{SATURATED:g}x slower than paced (the figures are then the machine's).")
    p.add_argument("--stop-at", default="", help="HH:MM (UTC): stop whatever runs then, take the cluster down "
                   "and print what was measured (a window the machine is lent in).")
    p.add_argument("--include", default="", help="A results.json of an earlier run: its sizes join the table and "
                   "the slopes (marked with that run's source), for sizes measured apart.")
    p.add_argument("--max-steps", type=int, default=0, help="The ranks' step budget (OMNI_MAX_STEPS); 0: more "
                   f"than the jobs' time limit ({JOB_TIME_S // 60} min) holds at --step-delay. The bench ends each run "
                   "itself after its last fault (a finish time the light ranks read); a budget that runs out first "
                   "says 'steps exhausted' in the checks.")
    p.add_argument("--step-delay", type=float, default=0.5, help="Seconds per light step.")
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--cpu-window", type=float, default=5.0, help="Seconds of steady state the CPU per poll is "
                   "measured over (in launch 0, before the first fault).")
    p.add_argument("--confirmation-window", type=float, default=10.0, help="The supervisor's hang confirmation "
                   "(omni supervise --confirmation-window; the site's default is 30 s): a hang confirms after "
                   "max(this, --hang-factor median steps), a policy constant, not a cost of scale.")
    p.add_argument("--hang-factor", type=float, default=10.0, help="omni supervise --hang-factor (the site's "
                   "default is 30).")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds each wait of a size may take.")
    p.add_argument("--reserve-gib", type=float, default=3.0, help="Memory left to the rest of the machine.")
    p.add_argument("--keep-cluster", action="store_true", help="Leave the last size's cluster up.")
    p.add_argument("--rank-weight", choices=("low", "normal"), default="low",
                   help="low: the light ranks join one cgroup weighing a quarter of a session (RankGroup; root "
                        "and the cpu controller); normal: each keeps its slurmstepd's session's weight")
    p.add_argument("--rank", choices=("c", "python"), default="c",
                   help="c: bench/light_rank.c, compiled with cc into build/light-rank (no compiler: the Python "
                        "rank, said in the output); python: bench/light_rank.py, its reference (python -S)")
    p.add_argument("--node-weight", choices=("one", "session"), default="one",
                   help="one: every slurmd and the slurmstepd it forks join one cgroup weighing one session "
                        "(NODE_GROUP; a cluster runs them on their nodes' cores); session: each slurmstepd "
                        "weighs as its own session, as much as slurmctld's")
    p.add_argument("--control-weight", choices=("own", "session"), default="own",
                   help="own: slurmctld and the supervisor (its sruns and reads of Slurm) join one cgroup weighing "
                        "the most a cgroup may (CONTROL_GROUP, --control-shares; a cluster runs its control plane on "
                        "hosts of its own); "
                        "session: each keeps its session's weight")
    p.add_argument("--control-shares", type=int, default=CONTROL_SHARES,
                   help=f"The control plane's cgroup weight with --control-weight own (cpu.shares; a session's 1024; "
                        f"default {CONTROL_SHARES})")
    p.add_argument("--control-rt", type=int, default=CONTROL_RT_DEFAULT, metavar="PRIO",
                   help=f"SCHED_RR priority of slurmctld and the control plane's munged, with --control-weight own "
                        f"(CONTROL_RT_DEFAULT; 0: none, as before 2026-12-04; default {CONTROL_RT_DEFAULT})")
    p.add_argument("--trace-ctld", type=float, default=0.0, metavar="S",
                   help="A diagnosis, not a figure: from 1 s before each node fault to S s after it, "
                        "slurmctld's log at debug2 (ctld-trace-NODE.log in the job's folder), munged's and "
                        "slurmctld's CPU and run-queue wait every 5 ms (.cpu) and perf record -a where perf is "
                        "installed (.perf); the faults' figures then carry the tracing's cost")
    p.add_argument("--heartbeat-node-dir", default="",
                   help="OMNI_HEARTBEAT_NODE_DIR for the ranks: a node-local folder (default: none set, the ranks' "
                        "default /dev/shm, one heartbeat file per node) or 'off' (one per rank; "
                        "bench/heartbeat_bench.py measures both)")
    args = p.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    args.paths = [x for x in args.paths.split(",") if x]
    bad = sorted(set(args.faults) - set(FAULTS + EXTRA_FAULTS)) + sorted(set(args.paths) - set(PATHS))
    if "shrink" in args.faults and ("node" not in args.faults or args.faults.index("node") > args.faults.index("shrink")):
        bad.append("shrink before node (node takes the spare)")
    if bad or not args.faults or not args.paths or len(set(args.faults)) != len(args.faults):
        p.error(f"--faults: some of {', '.join(FAULTS + EXTRA_FAULTS)} (each once, shrink after node); "
                f"--paths: some of {', '.join(PATHS)}; "
                f"got {', '.join(bad) or 'none'}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if any(n < SPARES + 2 for n in sizes):
        p.error(f"--sizes: every size needs at least {SPARES + 2} nodes")
    if args.max_steps < 0 or not args.step_delay > 0:
        p.error(f"--max-steps {args.max_steps}, --step-delay {args.step_delay:g}: a budget >= 0 (0: the jobs' time "
                "limit at the pace) and a pace > 0 (the finish time names the step due at it)")
    if args.stop_at:
        try:
            hh, mm = (int(x) for x in args.stop_at.split(":"))
            now = time.gmtime()
            args.stop_at = calendar.timegm((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, 0))
            if args.stop_at < time.time() - 12 * 3600:   # a window past midnight (23:55 -> 00:20): tomorrow's
                args.stop_at += 24 * 3600
        except ValueError:
            p.error(f"--stop-at {args.stop_at!r}: expected HH:MM (UTC)")
    root = Path(args.work).resolve() / time.strftime("%Y%m%d-%H%M%S")
    global RANK_GROUP, RANK_ARGV, RANK_KIND, PID_SPACE_NOTE
    PID_SPACE_NOTE = widen_pid_space(sizes)
    if PID_SPACE_NOTE:
        print(PID_SPACE_NOTE, flush=True)
    RANK_ARGV, RANK_KIND = rank_argv(args.rank, sys.executable)
    print(f"light rank: {RANK_KIND}", flush=True)
    if args.rank_weight == "low":
        RANK_GROUP = RankGroup(f"omni-scale-ranks-{os.getpid()}")
    global NODE_GROUP, CONTROL_GROUP, MUNGE_GROUP, CONTROL_RT
    if args.node_weight == "one":
        NODE_GROUP = RankGroup(f"omni-scale-nodes-{os.getpid()}", shares=NODE_SHARES)
    if args.control_weight == "own":
        CONTROL_GROUP = RankGroup(f"omni-scale-control-{os.getpid()}", shares=args.control_shares)
        if args.control_rt and CONTROL_GROUP.path is not None and (CONTROL_GROUP.path / "cpu.rt_runtime_us").exists():
            try:
                (CONTROL_GROUP.path / "cpu.rt_runtime_us").write_text(str(RT_RUNTIME_US))
                CONTROL_GROUP.how += f", cpu.rt_runtime_us={RT_RUNTIME_US}"
            except OSError as e:
                print(f"the control plane's cgroup may not run real-time ({e}): slurmctld and munged keep their policy",
                      flush=True)
        CONTROL_RT = args.control_rt
        MUNGE_GROUP = RankGroup(f"omni-scale-munge-{os.getpid()}", shares=args.control_shares)
    spares = SPARES
    results: list[Result] = load_results(Path(args.include)) if args.include else []
    started = time.monotonic()
    try:
        for n in sizes:
            if args.stop_at and time.time() >= args.stop_at:
                results.append(Result(nodes=n, ranks=TASKS_PER_NODE * (n - spares), na="not started: --stop-at"))
                continue
            t0 = time.monotonic()
            scan = scan_cost(TASKS_PER_NODE * (n - spares), root)
            floor = join_floor(TASKS_PER_NODE * (n - spares))
            why = fits(n, results, args.reserve_gib * 1024, spares) or (
                "" if args.run_saturated else saturated(n, results, args.step_delay, spares))
            if why:
                results.append(Result(nodes=n, ranks=TASKS_PER_NODE * (n - spares), na=why, scan=scan, join_floor=floor))
                print(f"[n={n}] n/a: {why}", flush=True)
                continue
            size = Size(args, n, root, measured=results)
            size.spent("floors", t0)
            size.result.scan = scan
            size.result.join_floor = floor
            try:
                results.append(size.run())
            except Exception as e:  # noqa: BLE001 (one size's failure is its n/a, not the end of the table)
                size.result.na = f"{type(e).__name__}: {e}"
                results.append(size.result)
            except KeyboardInterrupt:   # stopped: the paths measured so far still go to the table
                size.result.na = "stopped (SIGINT or SIGTERM)"
                results.append(size.result)
                raise
            finally:
                t1 = time.monotonic()
                if not (args.keep_cluster and n == sizes[-1]):
                    kill_slurmds(size.cluster)
                    size.cluster.down()
                    left = kill_leftovers(OWN_JOBS, Path(args.state_dir), root)
                    if left:
                        kinds = sorted({k: sum(v == k for v in left.values()) for k in left.values()}.items())
                        size.log(f"killed {len(left)} processes of this run left after the cluster went down: "
                                 + ", ".join(f"{k} {n}" for k, n in kinds))
                    base = node_dir_setting({"OMNI_HEARTBEAT_NODE_DIR": args.heartbeat_node_dir}
                                            if args.heartbeat_node_dir else {})
                    folders = remove_beat_folders(OWN_JOBS, base) if base is not None else 0
                    if folders:
                        size.log(f"removed {folders} node heartbeat folder(s) of this run's jobs")
                size.spent("down", t1)
                size.result.elapsed_s = time.monotonic() - t0
                loads = [x.load for x in size.result.runs if x.load]
                size.result.load = max(loads, default=0.0)
    finally:
        for group in (RANK_GROUP, NODE_GROUP, CONTROL_GROUP, MUNGE_GROUP):
            if group is not None:
                group.remove()
        report(results, args)
        out = Path(args.json) if args.json else root / "results.json"
        write_json(results, out, args)
        print(f"\n{whole_run(time.monotonic() - started, [r for r in results if not r.included])} "
              f"(1-minute load now {os.getloadavg()[0]:.1f}); figures in {out}")
    return 0 if all(not r.na and all(c.startswith("PASS") for c in r.checks) and not any(x.na for x in r.runs)
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
