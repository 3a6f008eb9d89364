"""Job steps inside an allocation: the heterogeneous (MPMD) ``srun`` of an in-allocation job.

``srun A : B`` in a homogeneous allocation runs the stages as one step: tasks are numbered across
the components (SLURM_PROCID 0..N-1, stage-major, as ``elastic/layout.py`` wants), and
``--kill-on-bad-exit`` on every component ends the whole step when one task fails or a node is
lost; the allocation (``--no-kill``) lives on and the next step runs at once (Slurm 22.05, probes
in ``shared/probes/no-kill/``). Building the argv is pure; ``start_step`` runs it through the one
command runner.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.runner import CommandRunner

# Each task: the torch-style names from Slurm's, and its stage and replica index; then the command,
# its stderr on its stdout: srun's own stderr then carries srun's words alone (a rank that prints
# "srun: error: Node failure on node3" is no report of srun's). Constant text: every value comes in
# as an argument, never inside the script.
TASK_SHIM = """\
stage=$1 first=$2
shift 2
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export OMNI_STAGE=$stage OMNI_DP_RANK=$(( SLURM_PROCID - first ))
exec "$@" 2>&1
"""


@dataclass(frozen=True, slots=True)
class StepComponent:
    """One component of the step: a stage on its nodes."""

    stage: int
    nodes: tuple[str, ...]
    tasks_per_node: int

    @property
    def ntasks(self) -> int:
        return len(self.nodes) * self.tasks_per_node


def step_name(job_id: str, launch: int) -> str:
    """The step's name (``srun --job-name``): how a restarted supervisor finds its srun again."""
    return f"omni-{job_id}-launch-{launch}"


def step_argv(components: Sequence[StepComponent], command: Sequence[str], *, name: str,
              spank_stage: str = "", spank_ckpt: str = "", overlap: bool = False, chdir: str = "",
              job_id: str = "") -> list[str]:
    """``srun OPTS0 shim cmd : OPTS1 shim cmd ...``; ``spank_stage``/``spank_ckpt``: the plugin's
    ``--omni-stage``/``--omni-ckpt`` (its fault records), given to every component; ``chdir``: the
    folder every task starts in (the job's workdir; empty: srun's own). ``job_id``: run in that
    allocation from outside it (``--jobid``, allocation mode); empty: the one srun runs in."""
    argv = ["srun"]
    first = 0
    for i, c in enumerate(components):
        if i:
            argv.append(":")
        if job_id:
            argv.append(f"--jobid={job_id}")
        argv += [f"--job-name={name}", "--kill-on-bad-exit=1", f"--nodes={len(c.nodes)}",
                 f"--ntasks={c.ntasks}", f"--ntasks-per-node={c.tasks_per_node}",
                 f"--nodelist={compress(c.nodes)}"]
        if chdir:
            argv.append(f"--chdir={chdir}")
        if overlap:   # share the survivors' CPUs with a step still dying (its tasks killed, srun not out yet)
            argv.append("--overlap")
        if spank_stage:
            argv += [f"--omni-stage={spank_stage}", f"--omni-ckpt={spank_ckpt}"]
        argv += ["bash", "-c", TASK_SHIM, "omni-task", str(c.stage), str(first), *command]
        first += c.ntasks
    return argv


# A launch that spans allocations (a pool's nodes beside the job's own): one srun per allocation, so
# SLURM_PROCID and SLURM_NTASKS are each srun's own. Each task's global rank is its node's first rank
# (NODE=RANK pairs, comma-separated, an argument) plus its local id; the world is the whole launch's.
SPAN_SHIM = """\
stage=$1 first=$2 world=$3 bases=$4
shift 4
base=-1
IFS=, read -ra pairs <<< "$bases"
for nb in "${pairs[@]}"; do
  if [[ ${nb%%=*} == "$SLURMD_NODENAME" ]]; then base=${nb#*=}; fi
done
if (( base < 0 )); then echo "omni-task: no rank for node $SLURMD_NODENAME in $bases" >&2; exit 78; fi
export RANK=$(( base + SLURM_LOCALID )) WORLD_SIZE=$world LOCAL_RANK=$SLURM_LOCALID
export OMNI_STAGE=$stage OMNI_DP_RANK=$(( base + SLURM_LOCALID - first ))
exec "$@" 2>&1
"""


def span_argvs(components: Sequence[StepComponent], alloc_of: Mapping[str, str], command: Sequence[str], *,
               name: str, stage_names: Sequence[str] = (), spank_ckpt: str = "", overlap: bool = False,
               chdir: str = "") -> list[tuple[str, list[str]]]:
    """One launch over several allocations: per allocation (``alloc_of``: node -> its job id; in the
    order they first appear in ``components``), ``(job id, srun argv)``, every srun named ``name``
    with a component per stage that has nodes there. One rendezvous: the ranks are numbered across
    the whole launch, stage-major, each node's tasks together (:data:`SPAN_SHIM`). ``stage_names``:
    with ``spank_ckpt``, the plugin's ``--omni-stage`` of each srun's own task counts."""
    world = sum(c.ntasks for c in components)
    firsts: list[int] = []
    bases: dict[str, int] = {}
    first = 0
    for c in components:
        firsts.append(first)
        for i, node in enumerate(c.nodes):
            bases[node] = first + i * c.tasks_per_node
        first += c.ntasks
    order: list[str] = []
    for c in components:
        for node in c.nodes:
            if alloc_of[node] not in order:
                order.append(alloc_of[node])
    out: list[tuple[str, list[str]]] = []
    for job in order:
        here = [(k, c, tuple(n for n in c.nodes if alloc_of[n] == job)) for k, c in enumerate(components)]
        here = [(k, c, nodes) for k, c, nodes in here if nodes]
        spank_stage = ",".join(f"{stage_names[c.stage]}:{len(nodes) * c.tasks_per_node}" for _, c, nodes in here) \
            if spank_ckpt and stage_names else ""
        argv = ["srun"]
        for i, (k, c, nodes) in enumerate(here):
            if i:
                argv.append(":")
            argv += [f"--jobid={job}", f"--job-name={name}", "--kill-on-bad-exit=1", f"--nodes={len(nodes)}",
                     f"--ntasks={len(nodes) * c.tasks_per_node}", f"--ntasks-per-node={c.tasks_per_node}",
                     f"--nodelist={compress(nodes)}"]
            if chdir:
                argv.append(f"--chdir={chdir}")
            if overlap:
                argv.append("--overlap")
            if spank_stage:
                argv += [f"--omni-stage={spank_stage}", f"--omni-ckpt={spank_ckpt}"]
            argv += ["bash", "-c", SPAN_SHIM, "omni-task", str(c.stage), str(firsts[k]), str(world),
                     ",".join(f"{n}={bases[n]}" for n in nodes), *command]
        out.append((job, argv))
    return out


SrunEventKind = Literal["node_failure", "task_exit", "terminating"]


@dataclass(frozen=True, slots=True)
class SrunEvent:
    """What srun says on stderr about its step (Slurm 22.05 wording, ``srun_node_failure.txt``)."""

    time: float
    kind: SrunEventKind
    node: str = ""
    task: int = -1
    detail: str = ""
    step_id: str = ""


_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<node>\S+)$")
_TASK_EXIT = re.compile(r"^srun: error: (?P<node>[^:\s]+): tasks? (?P<task>\d+)(?:-\d+)?: (?P<how>.+)$")
_TERMINATING = re.compile(r"^srun: (?:launch/slurm: _step_signal: )?Terminating StepId=(?P<step>\S+)$")


def parse_srun_line(line: str, at: float) -> SrunEvent | None:
    """One line of srun's stderr -> the event it reports, or None: a node of the step failed; a task
    ended badly ("Killed", "Exited with exit code 3"); srun is terminating the step (a task's bad exit
    with ``--kill-on-bad-exit``, or a node failure): no rank of the step is left to make progress."""
    line = line.rstrip("\n")
    m = _NODE_FAILURE.match(line)
    if m:
        return SrunEvent(at, "node_failure", node=m["node"])
    m = _TERMINATING.match(line)
    if m:
        return SrunEvent(at, "terminating", step_id=m["step"])
    m = _TASK_EXIT.match(line)
    if m:
        return SrunEvent(at, "task_exit", node=m["node"], task=int(m["task"]), detail=m["how"])
    return None


def _follow(path: str, start: int, log: StepLog) -> None:
    """Read the step's log from ``start`` as it grows and parse each complete line; each event is
    queued, then handed to ``log.on_event`` when one is set (in this thread, as srun says it). A log
    that cannot be opened is never read to its end (``StepLog.read_to_end`` stays False)."""
    try:
        f = open(path, "rb")   # noqa: SIM115 - closed below, in this thread
    except OSError:
        return
    with f:
        f.seek(start)
        pending = b""
        while True:
            chunk = f.read(65536)
            if not chunk:
                if log.stop.is_set():
                    log.read_to_end = True
                    return
                log.stop.wait(0.02)   # a close wakes it: it reads to the end once more and returns
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                event = parse_srun_line(raw.decode(errors="replace"), time.time())
                if event is not None:
                    log.events.put(event)
                    hook = log.on_event
                    if hook is not None:
                        hook(event)


@dataclass(kw_only=True)
class StepLog:
    """What a step's srun said on its own stderr, as it says it: read from the file that holds it
    alone (the ranks' output goes to srun's stdout, another file), not from a pipe, so that srun
    outlives a supervisor that dies: a closed pipe would kill srun with SIGPIPE."""

    events: queue.SimpleQueue[SrunEvent]
    stop: threading.Event
    on_event: Callable[[SrunEvent], None] | None = None
    """Called in the follower's thread with each event once queued (the supervisor asks Slurm for a
    node srun reported failed at once, and wakes its loop, instead of waiting for its next turn)."""
    thread: threading.Thread | None = None
    read_to_end: bool = False
    """Set by the follower once it read the file to its end after ``close``."""

    @classmethod
    def follow(cls, path: str, start: int = 0) -> StepLog:
        log = cls(events=queue.SimpleQueue(), stop=threading.Event())
        log.thread = threading.Thread(target=_follow, args=(path, start, log), name="omni-step-log", daemon=True)
        log.thread.start()
        return log

    def drain(self) -> list[SrunEvent]:
        return drain_queue(self.events)

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop following. ``wait_s``: wait that long for the follower to read the file to its end
        once more (every line srun wrote until now parsed and queued). True when it has."""
        self.stop.set()
        if self.thread is not None and wait_s > 0:
            self.thread.join(wait_s)
        return self.read_to_end


T = TypeVar("T")


def drain_queue(q: queue.SimpleQueue[T]) -> list[T]:
    """What a thread put in ``q`` since the last call, in the order it came, without waiting."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def start_step(runner: CommandRunner, argv: Sequence[str], env: Mapping[str, str], *,
               log_path: str, output_path: str) -> tuple[subprocess.Popen[bytes], StepLog]:
    """Start the step with srun's own stderr appended to ``log_path`` (followed: only srun writes
    there) and its stdout, every rank's output (``TASK_SHIM`` puts their stderr on it), to
    ``output_path``."""
    err = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        out = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            log = StepLog.follow(log_path, os.fstat(err).st_size)
            proc = runner.spawn(argv, env=env, stdout=out, stderr=err)
        finally:
            os.close(out)
    finally:
        os.close(err)
    return proc, log


def kill_step(runner: CommandRunner, job_id: str, name: str, step_id: str = "") -> list[subprocess.Popen[bytes]]:
    """SIGKILL every task of the step (``scancel --signal=KILL JOB.STEP``; ``step_id`` as srun named
    it, else found by ``name``): a step that Slurm is already terminating after a failure has nothing
    left to save (a peer is gone), and its ranks would otherwise spend KillWait in their SIGTERM
    checkpoint. The scancels are started, not waited for (slurmctld is busy with the failed node just
    then); the caller reaps them. Empty: no such step."""
    if step_id:
        steps = [step_id.split("+")[0]]
    else:
        out = runner.run(["squeue", "--steps", "--noheader", f"--jobs={job_id}", "--format=%i %j"], check=False,
                         timeout_s=10)
        steps = sorted({line.split()[0].split("+")[0] for line in out.stdout.splitlines()
                        if len(line.split()) == 2 and line.split()[1] == name})
    return [runner.spawn(["scancel", "--signal=KILL", step], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for step in steps]


def pick_port_on(runner: CommandRunner, node: str, candidates: Sequence[int], *, name: str, python: str,
                 job_id: str = "") -> str:
    """The rendezvous port check (``supervisor/ports.py``) run on ``node`` as a one-task step of the
    allocation (``--overlap``: beside a step still dying); what it printed, empty when it failed.
    ``job_id``: from outside the allocation (``--jobid``, allocation mode)."""
    argv = ["srun", *([f"--jobid={job_id}"] if job_id else []), f"--job-name={name}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            python, "-m", "slurm_omni.supervisor.ports", *map(str, candidates)]
    try:
        out = runner.run(argv, check=False, timeout_s=60)
    except SlurmError:   # no answer within the timeout, srun missing
        return ""
    return out.stdout if out.returncode == 0 else ""


def job_step_names(runner: CommandRunner, job_id: str) -> dict[str, str]:
    """Slurm's own list of the job's steps: step name -> step id (``squeue --steps``). Only the job's
    owner (or root) can start a step in it. Empty when Slurm does not answer."""
    try:
        out = runner.run(["squeue", "--steps", "--noheader", f"--jobs={job_id}", "--format=%i %j"], check=False,
                         timeout_s=10)
    except SlurmError:
        return {}
    steps: dict[str, str] = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else ():
        fields = line.split()
        if len(fields) == 2:
            steps.setdefault(fields[1], fields[0])
    return steps


@dataclass(frozen=True, slots=True)
class StepProcess:
    """One live process on this host: its pid and its start time (clock ticks after boot, field 22
    of ``/proc/PID/stat``). Together they name one process: a pid reused later starts later."""

    pid: int
    start: int


def process_start(pid: int, proc_root: str = "/proc") -> int | None:
    """When process ``pid`` started (clock ticks after boot), None when it is gone."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as f:
            stat = f.read(4096)
        # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses; the fields follow the last ")"
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner(pid: str, proc_root: str) -> int | None:
    """The process's uid when its real, effective, saved and filesystem uids are one, else None."""
    try:
        with open(os.path.join(proc_root, pid, "status"), "rb") as f:
            for line in f.read(65536).splitlines():
                if line.startswith(b"Uid:"):
                    uids = set(line.split()[1:])
                    return int(uids.pop()) if len(uids) == 1 else None
    except (OSError, ValueError):
        return None
    return None


def _named_sruns(name: str, proc_root: str) -> list[tuple[int, int | None]]:
    """Every live process on this host named ``srun`` with ``--job-name=NAME``: (pid, its uid)."""
    marker = f"--job-name={name}".encode()
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, entry, "cmdline"), "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and os.path.basename(args[0]) == b"srun" and marker in args:
            found.append((int(entry), _owner(entry, proc_root)))
    return found


def step_processes(name: str, *, uid: int, proc_root: str = "/proc") -> list[StepProcess]:
    """The live ``srun --job-name=NAME`` processes on this host that run as ``uid`` alone, oldest
    first. Anyone can name a process srun and give it any argument: another user's never counts."""
    found = []
    for pid, owner in _named_sruns(name, proc_root):
        start = process_start(pid, proc_root) if owner == uid else None
        if start is not None:
            found.append(StepProcess(pid, start))
    return sorted(found, key=lambda p: (p.start, p.pid))


def foreign_step_processes(name: str, *, uid: int, proc_root: str = "/proc") -> list[tuple[int, int | None]]:
    """(pid, uid) of the processes named like step ``name`` that do not run as ``uid`` alone."""
    return [(pid, owner) for pid, owner in _named_sruns(name, proc_root) if owner != uid]


def find_step_process(name: str, *, uid: int, journaled: StepProcess | None, slurm_steps: Callable[[], Collection[str]],
                      proc_root: str = "/proc") -> StepProcess | None:
    """The srun of step ``name`` that a restarted supervisor may adopt, or None: a live
    ``srun --job-name=NAME`` of ``uid``'s that is the one journaled (its pid and start time; a start
    of 0: a journal that did not record it), else, when none was journaled, one whose name Slurm
    lists among the job's steps (``slurm_steps``, asked only when such a process exists)."""
    found = step_processes(name, uid=uid, proc_root=proc_root)
    if not found:
        return None
    if journaled is not None:
        return next((p for p in found if p.pid == journaled.pid and journaled.start in (0, p.start)), None)
    return found[0] if name in slurm_steps() else None


def is_running(proc: StepProcess, proc_root: str = "/proc") -> bool:
    """``proc`` is still that process (not gone, not its pid reused)."""
    return process_start(proc.pid, proc_root) == proc.start
