"""The step supervisor: launches the heterogeneous step inside the allocation and relaunches it.

It runs on the batch host of an in-allocation job (``sbatch_templates/inalloc.sbatch.j2`` starts
it with ``omni supervise``). One loop: start (or adopt) the current launch's srun; watch it (its
exit within a tick, the ranks' heartbeats, the nodes' states every few seconds); feed everything to
the one confirmation rule (``policy.confirm``); on a confirmed failure plan the next launch with the
one placement policy (``policy.in_allocation.plan_relaunch``) and start it inside the same Slurm
job, on the road of the one recovery state machine (``policy.recovery.step`` with role supervisor,
through ``policy.supervision.recovery_road``: confirmed, planned, stopped, launched; or handed over). Every decision is journaled before it is carried out (``supervisor/journal.py``), so a
supervisor SIGKILLed anywhere and started again by the batch script makes each launch exactly once.

In allocation mode a job running shrunk also asks for a pool allocation of the nodes it misses and,
when it starts, grows back with a launch that spans the allocations (``policy/pools.py`` decides;
one srun per allocation, ``slurm.steps.span_argvs``).

This module decides nothing itself: its phases and what follows each observation are one pure
transition table (``policy.supervisor_lifecycle``: waiting, launching, running, stopping,
confirming, ended, relaunching, shrinking; done, stopped, fallback), fed through :meth:`Supervisor._feed`,
which carries out the effects it returns; what a launch's end means, when to kill a step, a
request's outcome (``policy.supervision``), the rule and the plan are pure code too; what a launch
shows is gathered by ``supervisor/observe.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
from slurm_omni.errors import OmniError, SlurmError
from slurm_omni.formats.supervisor import ReportKind, SupervisorPhase, allocation_run
from slurm_omni.ownership import NotOwnedError, ensure_own_dir
from slurm_omni.policy.bad_input import RankEnd, refused_by_rank
from slurm_omni.policy.confirm import (
    HARD_KINDS,
    SILENT_CAUSES,
    Decision,
    StepEnded,
    Verdict,
)
from slurm_omni.policy.in_allocation import (
    REQUEUE_INCARNATION_STRIDE,
    Fallback,
    Relaunch,
    StageSpec,
    StepLayout,
    first_layout,
    plan_relaunch,
    units_of,
)
from slurm_omni.policy.placement import SpareScope
from slurm_omni.policy.pools import (
    GROW,
    SUCCESSOR,
    Pool,
    PoolAsk,
    grow_now,
    grow_plan,
    pool_ask,
    pool_constraint,
    pool_kinds,
    pool_warm,
    span_end,
    successor_lead_for,
)
from slurm_omni.policy.recovery_events import FailureConfirmed, MigrationRequested
from slurm_omni.policy.replica_ring import encode_ring, replica_ring
from slurm_omni.policy.start_failure import StartFailure, first_line, repeated_failure, stop_line
from slurm_omni.policy.supervision import (
    PLANNED,
    LaunchEnd,
    SupervisionLimits,
    adopted_rc,
    as_plan,
    fruitless_launches,
    rendezvous_ports,
    request_outcome,
)
from slurm_omni.policy.supervisor_lifecycle import (
    AllocationPolled,
    AskSuccessor,
    DropSuccessor,
    Exit,
    FirstLaunch,
    ForwardStop,
    GiveUp,
    IntendLaunch,
    JournalDone,
    KillStep,
    LaunchEnded,
    LaunchJournaled,
    LaunchRunning,
    LeaveStep,
    LifecycleConfig,
    MoveToSuccessor,
    Phase,
    Plan,
    Planned,
    ReleaseAllocation,
    Replayed,
    SignalStep,
    StartStandbys,
    SuccessorPolled,
    TakeAllocation,
    Watched,
    initial,
)
from slurm_omni.policy.supervisor_lifecycle import Effect as LifecycleEffect
from slurm_omni.policy.supervisor_lifecycle import Event as LifecycleEvent
from slurm_omni.policy.supervisor_lifecycle import step as lifecycle_step
from slurm_omni.slurm.allocation import AllocationView, jobs_named
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.runner import CommandRunner, ScontrolSession
from slurm_omni.slurm.salloc import pool_salloc_argv, request_allocation, successor_salloc_argv, switch_wait
from slurm_omni.slurm.steps import (
    SrunEvent,
    StepComponent,
    StepLog,
    StepProcess,
    find_step_process,
    foreign_step_processes,
    is_running,
    job_step_names,
    kill_step,
    pick_port_on,
    process_start,
    span_argvs,
    start_step,
    step_argv,
    step_name,
)
from slurm_omni.slurm.types import Node, NodeState
from slurm_omni.standby import through_standby
from slurm_omni.standby.server import WARM_LINE, open_standby_dir
from slurm_omni.supervisor import outside, ports
from slurm_omni.supervisor.journal import (
    Launch,
    Successor,
    SupervisorJournal,
    journal_path,
    layout_to_json,
    read_request,
    report_document,
    report_path,
    request_path,
    status_document,
    status_path,
    write_report,
    write_status,
)
from slurm_omni.supervisor.launch_failure import read_failure, write_record
from slurm_omni.supervisor.node_reads import KnownStates, NodeReads, read_job_and_failed
from slurm_omni.supervisor.observe import BeatReader, LaunchObserver

log = logging.getLogger(__name__)

CRASH_ENV = "OMNI_SUPERVISOR_CRASH_AT"
"""Drills only: the supervisor SIGKILLs itself at this point (``relaunch:after_intent``,
``relaunch:after_start``), once per journal (a marker file beside it says it happened)."""
LATE_S = 0.5
"""The loop's lateness worth a debug line (a heartbeat poll this long, a report taken this late)."""
SLOW_SLURM_S = 60.0
"""The second, longer wait for slurmctld's answer before a relaunch (``_job_state_and_nodes``)."""
STEP_LOG_END_S = 0.5
"""At a launch's end, the longest wait for srun's log to be read to its end (its tasks' last exits)."""
START_FAILURE_SRUN_S = 2.0
"""A launch that failed before any heartbeat and was killed at its confirmation: the longest wait for
its srun to end before its ranks' output is read for the failure's line. srun writes what the tasks
printed as it arrives, and the exit that confirmed can come before it: a kill that starts at the
confirmation's millisecond (no wait for the next launch) read the output of a crash at import before
srun had written the traceback into it ("no error line in its output", CI 2026-12-03 21:14)."""
KNOWN_FRESH_S = 30.0
"""The relaunch plans on the job's and nodes' states the watch read when each was asked this recently
(the 3 s poll; at 512 emulated nodes slurmctld answered it in 11-15 s): a node that failed since is no
newer in an answer read at the confirmation, and a launch that meets it is recovered like any."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SupervisorOptions:
    stages: tuple[StageSpec, ...]
    command: tuple[str, ...]
    job_id: str
    allocation: tuple[str, ...]
    """The allocation's nodes as Slurm listed them when the job started (SLURM_JOB_NODELIST)."""
    data_parallel_size: int
    """Replicas at the first launch (OMNI_DP_SIZE)."""
    ckpt_dir: Path
    heartbeat_dir: Path
    incarnation: int
    """OMNI_INCARNATION of the allocation; launch n runs as incarnation + n."""
    min_data_parallel_size: int = 1
    units_divide: int = 0
    spare_policy: SpareScope = "any_switch"
    max_relaunches: int = 20
    heartbeat_interval_s: float = 1.0
    confirmation_window_s: float = 30.0
    """Heartbeats alone (stale, no progress) confirm a hang after this long (the site's
    ``detection.confirmation_window_s``, the confirmer's ``hang_floor_s``), as the manager's rule does..."""
    hang_factor: float = 30.0
    """...and after this many median step times (the site's ``detection.confirm.hang_factor``)."""
    spank_ckpt: str = ""
    log_dir: Path | None = None
    tick_s: float = 0.05
    kill_grace_s: float = 0.0
    """After killing a confirmed failed step's tasks, wait this long for its srun before relaunching
    anyway (its exit code adds nothing to a latched confirmation; the srun is reaped later). 0: the
    next launch starts at once beside the dying tasks (``--overlap``). srun ends once every task it
    reached is gone, but with ``proctrack/pgid`` slurmstepd rechecks a killed process group after 1,
    2, 4 s...: waiting costs 1.4-1.6 s at 8 nodes and 2-6 s at 64 (issue 19), so it is the site's choice
    (``omni supervise --kill-grace``) where a dying rank's memory must not be given twice (512
    emulated nodes on one host: the new ranks beside 2,044 SIGKILLed ones ran the host out of memory)."""
    max_fruitless: int = 3
    """Launches in a row that end before their first step (a crash at start-up) before handing over."""
    node_poll_s: float = 3.0
    heartbeat_poll_s: float = 0.5
    crash_at: str = ""
    restart_count: int = 0
    """SLURM_RESTART_COUNT: a requeued allocation (same job id) starts a journal of its own."""
    standby: bool = True
    """Keep a warm standby server on every node of the allocation and run the ranks through it."""
    batch_host: str = ""
    """SLURMD_NODENAME: the node this supervisor runs on, with the batch script."""
    workdir: Path | None = None
    """The job's working folder (OMNI_WORKDIR): every launch's tasks start there (``srun --chdir``)."""
    job_name: str = ""
    """OMNI_JOB_NAME, for the lines the user reads."""
    outside: bool = False
    """Allocation mode: this supervisor runs outside its allocation (``salloc --no-shell``, no batch
    script): every srun names ``--jobid``, no node is its host, it waits for the allocation to start,
    stops the step ``stop_before_s`` before the time limit, and ends the allocation once training is
    done (docs/allocation-mode.md)."""
    stop_before_s: float = 0.0
    stop_signal: int = signal.SIGUSR1
    """Allocation mode: what the ranks get ``stop_before_s`` before the time limit (the job's
    requeue signal: they checkpoint and exit 75)."""
    wait_poll_s: float = 2.0
    wait_poll_max_s: float = 20.0
    """Below the manager's staleness limit (30 s): each poll rewrites the status file."""
    pool_salloc: tuple[str, ...] = ()
    """Allocation mode: the job's own ``salloc`` (OMNI_POOL_SALLOC). Set: a job running shrunk asks
    for a pool allocation of the nodes it misses and grows back when it starts (``policy/pools.py``);
    empty: it runs shrunk to its end, as before."""
    pool_minutes: int = 60
    """A pool's time limit when the allocation's own end is unknown."""
    pool_warm_s: float = 60.0
    """The grow-back waits at most this long for the warm standbys on a pool's nodes."""
    successor_queue_wait_s: float = 0.0
    """Allocation mode with ``pool_salloc``: the queue wait a new allocation expects (the site's
    figure); a successor allocation of the job's whole shape is asked for ``policy.pools.
    successor_lead_for`` ahead of the time limit and the job moves to it when it starts. 0: none (the
    time limit stops the step and the manager resubmits)."""

    @property
    def replicas_per_unit(self) -> int:
        return self.data_parallel_size // units_of(self.stages)

    @property
    def min_units(self) -> int:
        per = self.replicas_per_unit
        units = max(1, -(-self.min_data_parallel_size // per))
        while self.units_divide and self.units_divide % units and units < units_of(self.stages):
            units += 1
        return units


class Supervisor:
    def __init__(self, opts: SupervisorOptions, runner: CommandRunner, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.opts = opts
        self.runner = runner
        self.clock = clock
        # the allocation's run names its files: its job id, and Slurm's restart count after a requeue
        # (a requeued allocation starts a journal of its own; its incarnations are REQUEUE_INCARNATION_STRIDE on)
        run = allocation_run(opts.job_id, opts.restart_count)
        # the journal's folder (<ckpt>/supervisor) through the one ownership check before it is written
        ensure_own_dir(journal_path(opts.ckpt_dir, run).parent, what="supervisor: journal folder", private=True)
        self.journal = SupervisorJournal(journal_path(opts.ckpt_dir, run))
        self.status_file = status_path(opts.ckpt_dir, run)
        self.request_file = request_path(opts.ckpt_dir, opts.job_id)
        self.lifecycle = LifecycleConfig(
            limits=SupervisionLimits(max_fruitless=opts.max_fruitless, max_relaunches=opts.max_relaunches),
            kill_grace_s=opts.kill_grace_s, stop_before_s=opts.stop_before_s, stop_signal=opts.stop_signal,
            outside=opts.outside)
        self.state = initial(outside=opts.outside)
        """Where the lifecycle stands (``policy.supervisor_lifecycle``): only :meth:`_feed` changes it."""
        self.stop_signal: int | None = None
        self._alloc_id = self.journal.state.allocation_job or opts.job_id
        """The allocation the job runs in: its first, or the successor it moved to (journaled)."""
        # one kept scontrol for the reads of the nodes srun reports failed (the second signal of a node
        # loss), a node alone through the one-node reader (slurm/node_read.py: one record, one RPC)
        self._session = ScontrolSession(runner, node_reader=True) \
            if isinstance(runner, CommandRunner) else None
        self.slurm = AllocationView(runner, self._alloc_id, self._session)
        self._proc: subprocess.Popen[bytes] | None = None
        self._step_log: StepLog | None = None
        self._dying: list[subprocess.Popen[bytes]] = []
        self._standbys: list[subprocess.Popen[bytes]] = []
        self._observer: LaunchObserver | None = None
        """What the current launch shows (fresh for every launch)."""
        self._ephemeral = ports.ephemeral_range()
        self._ended: _Ended | None = None
        self._known = KnownStates()
        """The job's and nodes' states the current launch's watch read (for the relaunch)."""
        self._reads: NodeReads | None = None
        self._report_at: float | None = None
        """When srun last reported a task's exit (the supervisor's clock), its job read asked then."""
        self._prefetched: tuple[int, tuple[str, list[Node]]] | None = None
        """(launch, its job's and nodes' states) read at the confirmation, before the kill."""
        """What the current launch's end left (for its plan and its hand-over)."""
        self._standby = opts.standby
        """Ranks start through warm standbys (off when their folder is not ours)."""
        self._extra: list[_Srun] = []
        """A launch that spans allocations: its sruns in the pools (``self._proc`` runs the first)."""
        self._proc_job = self._alloc_id
        """The allocation ``self._proc``'s srun runs in."""
        self._pool_seen: dict[str, float] = {}
        """Pool name -> when this supervisor first saw it granted (the standbys' warm-up bound)."""
        self._limit_s: float | None = None
        """Allocation mode: the allocation's time limit (its EndTime - StartTime), for the successor's lead."""
        self._intended: set[int] = set()
        """Launches this process journaled (a restarted supervisor adopts only what it did not)."""
        self._walked = False
        """This process has looked for a running srun of its launch once (``_own_step``)."""
        self._leaf_of: dict[str, str] = {}
        """Leaf switch of each node a launch ran on (the memory tier's replica ring)."""

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> int:
        if self._session is not None:   # started now: the first read of a lost node pays no process start
            threading.Thread(target=self._session.warm, daemon=True, name="omni-scontrol-warm").start()
        try:
            return self._supervise()
        finally:
            if self._session is not None:
                self._session.close()

    def _supervise(self) -> int:
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        if self.opts.outside:
            if outside.hold_lock(self.opts.ckpt_dir, self.opts.job_id) is None:
                log.warning("supervisor: job %s already has a supervisor (its lock is held): leaving",
                            self.opts.job_id)
                return EXIT_DONE
            outside.write_process(self.opts.ckpt_dir, self.opts.job_id)
            code = self._await_allocation()
            if code is not None:
                return code
        st = self.journal.state
        self._release_predecessors()
        code = self._feed(Replayed(self.clock(), st.outcome, st.current.number if st.current else None))
        if code is not None:
            self._release_pools()   # done or handed over before: its predecessor may have left a pool open
            return code
        while True:
            cur = self.journal.state.current
            if cur is None:   # mypy: _intend always leaves one
                return EXIT_FAILED
            rc = self._run_launch(cur)
            code = self._after(cur, rc)
            if code is not None:
                self._release_pools()   # the job leaves (done, stopped, handed over): nothing grows it back
                self._drop_successor("the job leaves this allocation")
                self._write_status()
                self._stop_standbys()
                return code

    def _await_allocation(self) -> int | None:
        """Allocation mode: wait until the allocation runs, and take its nodes as Slurm lists them now
        (a lost node is already excised: a restarted supervisor starts no standby there). An exit
        code: it ended, or is not this user's. While it waits in the queue (hours at a centre) the
        polls space out to ``wait_poll_max_s``: polling slurmctld in a loop hurts it."""
        poll = self.opts.wait_poll_s
        while True:
            self._write_status()   # alive while it waits: the manager tells a gone supervisor by its age
            rec = self.slurm.job_record()
            code = self._feed(AllocationPolled(self.clock(), rec.state, user_id=rec.user_id, my_uid=os.geteuid(),
                                               has_nodes=bool(rec.nodes), end_time=rec.end_time,
                                               signalled=self.stop_signal is not None),
                              allocation=rec.nodes)
            if rec.end_time is not None and rec.start_time is not None and rec.state == "RUNNING":
                self._limit_s = rec.end_time - rec.start_time   # the allocation's time limit
            if code is not None or self.state.phase is not Phase.WAITING:
                return code
            time.sleep(poll)
            poll = min(poll * 1.5, max(self.opts.wait_poll_max_s, self.opts.wait_poll_s))

    def _forward(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum
        for proc in (self._proc, *(x.proc for x in self._extra)):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def _intend(self, number: int, layout: StepLayout, *, cause: str, removed: Sequence[str],
                added: Sequence[str], end_time: float | None = None) -> Launch:
        dp = layout.units * self.opts.replicas_per_unit
        # the rendezvous port: one that nothing on the master's host listens on (rank 0 fails at once
        # on a taken one); journaled with the intent, so a restarted supervisor uses the same
        master = layout.components[0][0]
        port, taken = self._rendezvous_port(number, master)
        if taken:
            log.warning("supervisor: launch %d: port(s) %s in use on %s; MASTER_PORT %d", number,
                        ",".join(map(str, taken)), master, port)
        self.journal.append("launch", launch=number, layout=layout_to_json(layout), data_parallel_size=dp,
                            port=port, ports_taken=taken, incarnation=self.opts.incarnation + number, cause=cause,
                            removed=list(removed), added=list(added),
                            **({"allocation": self._alloc_id} if self._alloc_id != self.opts.job_id else {}),
                            **({"end_time": end_time} if end_time is not None else {}))
        cur = self.journal.state.current
        if cur is None:
            raise OmniError("supervisor: couldn't journal the launch")
        self._intended.add(number)
        # the scale bench reads the supervisor's own CPU in decide from these two lines
        log.debug("supervisor: launch %d journaled (%s)", number, _cpu_and_wait())
        self._feed(LaunchJournaled(self.clock(), number, end_time=end_time))
        self._write_status()
        return cur

    def _rendezvous_port(self, number: int, master: str) -> tuple[int, list[int]]:
        """The launch's first free candidate on the master's host, else a port the OS picks there
        (``supervisor/ports.py``): checked here when the master is this host, else by a one-task
        step on the master; unchecked (the first candidate) when that step fails."""
        candidates = rendezvous_ports(self.opts.job_id, number, avoid=self._ephemeral)
        if ports.is_local(self.slurm.address(master)):
            return ports.pick(candidates)
        name = f"omni-{self.opts.job_id}-port-{number + REQUEUE_INCARNATION_STRIDE * self.opts.restart_count}"
        picked = ports.parse_pick(pick_port_on(self.runner, master, candidates, name=name, python=sys.executable,
                                               job_id=self._alloc_of(master) if self.opts.outside else ""))
        if picked is None:
            log.warning("supervisor: launch %d: couldn't check the rendezvous ports on %s: MASTER_PORT %d "
                        "unchecked", number, master, candidates[0])
            return candidates[0], []
        return picked

    def _run_launch(self, cur: Launch) -> int | None:
        """Start the launch (or find it running), watch it to its end; its srun's exit code, None when
        it is unknown (a restarted supervisor adopted it by pid)."""
        self._observer = self._observe(cur)
        if cur.ended is not None:
            return cur.ended
        name = self._step_name(cur)
        # a relaunch this process journaled and has not started has no srun to adopt: no walk of
        # /proc (every process of the host, twice; 2,044 ranks dying on one host at 512 emulated
        # nodes, issue 19); the first launch this process runs is looked for (and another user's
        # process named like it said) as before
        fresh = cur.pid is None and cur.number in self._intended and self._walked
        adopted = None if fresh else self._own_step(name, StepProcess(cur.pid, cur.pid_start)
                                                    if cur.pid is not None else None)
        self._walked = True
        if adopted is None and cur.pid is None:
            self._crash("relaunch:after_intent", cur)
            self._proc, self._step_log = self._start(cur, name)
            extra = [{"job": x.job, "pid": x.proc.pid, "pid_start": process_start(x.proc.pid) or 0}
                     for x in self._extra if x.proc is not None]
            self.journal.append("launched", launch=cur.number, pid=self._proc.pid,
                                pid_start=process_start(self._proc.pid) or 0, **({"extra": extra} if extra else {}))
            self._crash("relaunch:after_start", cur)
        elif adopted is not None:
            log.warning("supervisor: launch %d (%s) is running as pid %d: adopted", cur.number, name, adopted.pid)
            self._proc = None
            self._step_log = StepLog.follow(self._log_path(name, srun=True))
            self._extra = [_Srun(job, None, StepProcess(pid, start),
                                 StepLog.follow(self._log_path(f"{name}.{job}", srun=True)))
                           for job, pid, start in cur.extra if is_running(StepProcess(pid, start))]
        else:   # journaled as launched, its srun gone while no supervisor watched it
            log.warning("supervisor: launch %d ended while no supervisor watched it", cur.number)
        self._feed(LaunchRunning(self.clock()))
        self._write_status()
        return self._watch(cur, adopted)

    def _own_step(self, name: str, journaled: StepProcess | None, job: str = "") -> StepProcess | None:
        """The srun of step ``name`` this supervisor may adopt: our own uid's, and the journaled
        process or a step Slurm lists in this job (``slurm.steps.find_step_process``); another
        user's process of that name is named in one line and left alone."""
        for pid, owner in foreign_step_processes(name, uid=os.getuid()):
            log.warning("supervisor: pid %d, named like step %s, runs as uid %s, not this job's (%d): not adopted",
                        pid, name, "?" if owner is None else owner, os.getuid())
        return find_step_process(name, uid=os.getuid(), journaled=journaled,
                                 slurm_steps=lambda: job_step_names(self.runner, job or self._alloc_id))

    def _standby_folder_is_ours(self) -> bool:
        """The standbys' folder on this node is made (or found) ours and private; one that another user
        made first turns the standbys off for the whole job, in one line: the ranks start cold."""
        try:
            open_standby_dir(self.opts.job_id, "supervisor: standby folder").close()
        except NotOwnedError as e:
            log.warning("%s; the ranks start cold, without warm standbys", e)
            return False
        return True

    def _start_standbys(self, nodes: Sequence[str] = (), job: str = "") -> None:
        """One ``omni standby serve`` step per node (its own srun, so that a lost node ends only its
        own) of the allocation, or of ``nodes`` in allocation ``job`` (a pool's); a restarted
        supervisor starts only those it does not find running."""
        job = job or self._alloc_id
        for node in nodes or self.opts.allocation:
            name = _standby_name(job, node)
            if self._own_step(name, None, job) is not None:
                continue
            jobid = [f"--jobid={job}"] if self.opts.outside else []
            argv = ["srun", *jobid, f"--job-name={name}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                    sys.executable, "-m", "slurm_omni.cli.main", "standby", "serve"]   # no PATH needed
            fd = os.open(self._log_path(name), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                self._standbys.append(self.runner.spawn(argv, stdout=fd, stderr=fd))
            finally:
                os.close(fd)

    def _replica_ring(self, cur: Launch) -> dict[str, str]:
        """The memory tier's ring for this launch (which node keeps whose replica, ``policy/replica_ring``),
        only where the job keeps one (``OMNI_MEMORY_TIER``) and its ranks run through the standbys,
        whose keepers hold the replicas."""
        if os.environ.get("OMNI_MEMORY_TIER") != "1" or not self._standby:
            return {}
        nodes = list(cur.layout.nodes)
        missing = [n for n in nodes if n not in self._leaf_of]
        if missing:
            try:
                found, _, _ = self.slurm.node_info(missing)
            except SlurmError as e:   # a speed-up only: no ring, no replicas this launch
                log.warning("supervisor: no memory-tier replicas this launch: %s", e)
                return {}
            self._leaf_of.update({n.name: n.leaf_switch or "" for n in found})
        ring = replica_ring(nodes, self._leaf_of)
        return {"OMNI_MEMTIER_RING": encode_ring(ring)} if ring else {}

    def _stop_standbys(self) -> None:
        """SIGUSR2 first (srun forwards it to the task; its SIGTERM kills the step with SIGKILL): each
        standby frees its node's memory tier of the job and exits; whatever still runs after a few
        seconds is terminated."""
        for proc in self._standbys:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10.0
        for proc in self._standbys:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()

    def _log_path(self, name: str, *, srun: bool = False) -> str:
        """``NAME.log``: the step's output (its ranks'); ``NAME.srun.log``: srun's own stderr."""
        folder = self.opts.log_dir or self.journal.path.parent
        ensure_own_dir(folder, what="supervisor: log folder")
        return str(folder / f"{name}{'.srun' if srun else ''}.log")

    def _start(self, cur: Launch, name: str) -> tuple[subprocess.Popen[bytes], StepLog]:
        comps = [StepComponent(k, nodes, self.opts.stages[k].tasks_per_node)
                 for k, nodes in enumerate(cur.layout.components)]
        spank_stage = ",".join(f"{s.name}:{c.ntasks}" for s, c in zip(self.opts.stages, comps, strict=True))
        command = through_standby(self.opts.command) if self._standby else self.opts.command
        argv = step_argv(comps, command, name=name, overlap=True, job_id=self._alloc_id if self.opts.outside else "",
                         spank_stage=spank_stage if self.opts.spank_ckpt else "", spank_ckpt=self.opts.spank_ckpt,
                         chdir=str(self.opts.workdir) if self.opts.workdir is not None else "")
        env = {
            "MASTER_ADDR": self.slurm.address(cur.layout.components[0][0]),
            "MASTER_PORT": str(cur.port), "OMNI_DP_SIZE": str(cur.data_parallel_size),
            "OMNI_INCARNATION": str(cur.incarnation), "OMNI_LAUNCH": str(cur.number),
            "OMNI_STAGE_TASKS": ",".join(str(c.ntasks) for c in comps),
            **self._replica_ring(cur),
        }
        log.warning("supervisor: launch %d: %s, dp %d, incarnation %d", cur.number,
                    " + ".join(f"{s.name} on {compress(c.nodes)}" for s, c in zip(self.opts.stages, comps, strict=True)),
                    cur.data_parallel_size, cur.incarnation)
        self._extra, self._proc_job = [], self._alloc_id
        alloc_of = {n: self._alloc_of(n) for n in cur.layout.nodes}
        if self._alloc_id != self.opts.job_id:   # in a successor: every rank's heartbeat names this job
            env["OMNI_JOB_ID"] = self.opts.job_id
        if self.opts.outside and set(alloc_of.values()) != {self._alloc_id}:
            # across allocations: one srun each, one rendezvous; every rank's heartbeat names this job
            env["OMNI_JOB_ID"] = self.opts.job_id
            sruns = span_argvs(comps, alloc_of, command, name=name, stage_names=[st.name for st in self.opts.stages],
                               spank_ckpt=self.opts.spank_ckpt, overlap=True,
                               chdir=str(self.opts.workdir) if self.opts.workdir is not None else "")
            log.warning("supervisor: launch %d spans allocations %s", cur.number, ", ".join(j for j, _ in sruns))
            first: tuple[subprocess.Popen[bytes], StepLog] | None = None
            for job, span in sruns:
                started = start_step(self.runner, span, env,
                                     log_path=self._log_path(name if first is None else f"{name}.{job}", srun=True),
                                     output_path=self._log_path(name))
                if first is None:
                    first, self._proc_job = started, job
                else:
                    self._extra.append(_Srun(job, started[0], None, started[1]))
            if first is not None:
                return first
        return start_step(self.runner, argv, env, log_path=self._log_path(name, srun=True),
                          output_path=self._log_path(name))

    def _watch(self, cur: Launch, adopted: StepProcess | None) -> int | None:
        """Until the step ends: its exit code (None when adopted). What srun reports on stderr (a
        node failure, a task's bad exit, the step terminating) goes to the confirmation rule at once;
        once it confirms, the step is killed outright (nothing of it can still save: a peer is gone)."""
        # Slurm's node states are read beside the loop (supervisor/node_reads.py): a slow slurmctld
        # holds up neither srun's other reports nor the heartbeats, and the rule confirms on whichever
        # second signal comes first. Beside the loop a late answer holds nothing up: each read waits
        # SLOW_SLURM_S (512 nodes at load 450+: the named node's read did not finish within 10 s)
        # The step's id is learned beside the loop, so the kill after a confirmation asks Slurm nothing
        # first (issue 19). A node srun named is read with ``scontrol show node`` (``sinfo`` of it alone,
        # tried, reached the rule as usable at srun's report: docs/in-allocation.md)
        known_id = self._observer.step_id if self._observer is not None else ""
        job, name = self._proc_job, self._step_name(cur)
        self._report_at = None
        reads = NodeReads(lambda names: self.slurm.node_info(names, timeout_s=SLOW_SLURM_S)[0], self.clock,
                          job_state=lambda: self.slurm.job_state(timeout_s=SLOW_SLURM_S),
                          step_id=None if known_id or job != self._alloc_id
                          else lambda: job_step_names(self.runner, job).get(name, ""))
        self._known, self._reads = KnownStates(), reads
        launch_nodes = frozenset(cur.layout.nodes)
        asked: set[str] = set()

        def on_event(event: SrunEvent) -> None:
            # in the step log's thread, as srun says it: a node srun reported failed is read from Slurm
            # now, not when the loop next drains the log (512 nodes at load 500: the loop came seconds
            # late, issue 19). The loop is not woken for it: it takes the report and the answer at its next
            # tick (woken at once, the node loss's kill came ~50 ms sooner and 3 of 22 runs of
            # test_node_loss_and_rank_crash_relaunch_inside_the_same_job left a slurmstepd of the killed
            # step with no task and the job COMPLETING; 0 of 16 without, 22:49-23:02 UTC)
            if event.kind == "node_failure" and event.node in launch_nodes and event.node not in asked \
                    and self.state.phase is not Phase.CONFIRMING:
                asked.add(event.node)
                reads.ask([event.node], full=False)
            elif event.kind == "task_exit" and not asked and self.state.phase is not Phase.CONFIRMING:
                # the job's and nodes' states for the relaunch, asked after this report
                # (``_prefetch_states``); not beside a node's loss, whose own read stands
                self._report_at = self.clock()
                reads.ask_job((*cur.layout.nodes, *cur.layout.spares), self.slurm.failed_among)

        logs = [lg for lg in (self._step_log, *(x.log for x in self._extra)) if lg is not None]
        for lg in logs:
            lg.on_event = on_event
        try:
            return self._watch_loop(cur, adopted, reads, asked)
        finally:
            for lg in logs:
                lg.on_event = None
            reads.close()

    def _watch_loop(self, cur: Launch, adopted: StepProcess | None, reads: NodeReads, asked: set[str]) -> int | None:
        observer = self._observer or self._observe(cur)
        # the ranks' beats are read beside the loop (a scan stuck in the kernel holds up nothing else)
        beats = BeatReader(observer, self.opts.heartbeat_poll_s, self.clock)
        try:
            return self._watch_beats(cur, adopted, reads, asked, observer, beats)
        finally:
            beats.close()

    def _watch_beats(self, cur: Launch, adopted: StepProcess | None, reads: NodeReads, asked: set[str],
                     observer: LaunchObserver, beats: BeatReader) -> int | None:
        confirmer = observer.confirmer
        next_nodes = 0.0
        # nodes srun just reported failed: their Slurm state is read at once, theirs alone (one record
        # from slurmctld whatever the job's size, issue 19); the full poll keeps its pace. The step
        # log's own thread asks first (``on_event``); these are the reports it did not ask for
        named: set[str] = set()
        while True:
            now = self.clock()
            rc = self._poll(adopted)
            if rc is not False:
                if self.state.phase is Phase.CONFIRMING and self.state.killed_at is not None:
                    log.debug("supervisor: launch %d: its srun ended %.3f s after the kill", cur.number,
                              now - self.state.killed_at)
                return rc if isinstance(rc, int) else None
            heard = False
            for event in self._step_log.drain() if self._step_log is not None else ():
                heard = True
                self._late(cur, "srun's report", event.time, time.time())
                observer.srun(event, ending_on_request=self._ending_on_request())
                if event.kind == "node_failure" and self.state.phase is not Phase.CONFIRMING:
                    named.add(event.node)   # Slurm's node state now: with srun's report, two signals confirm
            for x in self._extra:
                for event in x.log.drain() if x.log is not None else ():
                    heard = True
                    self._late(cur, "srun's report", event.time, time.time())
                    observer.srun(event, ending_on_request=self._ending_on_request())
                    if event.kind == "node_failure" and self.state.phase is not Phase.CONFIRMING:
                        named.add(event.node)
            named -= asked
            if named and self.state.phase is not Phase.CONFIRMING:
                reads.ask(sorted(named & set(cur.layout.nodes)), full=False)
                named.clear()
            for answer in reads.answers():
                heard = True
                self._late(cur, "Slurm's answer", answer.answered_at, self.clock())
                self._known.take(answer)
                observer.step_id = observer.step_id or answer.step_id
                if not answer.full:
                    log.debug("supervisor: Slurm's state of %s answered %.3f s after it was asked",
                              compress([n.name for n in answer.nodes]), answer.answered_at - answer.asked_at)
                observer.nodes(answer.nodes, answer.answered_at, asked_at=answer.asked_at)
            if heard and self.state.phase is not Phase.CONFIRMING:
                # what srun or Slurm just said goes to the rule at once, whatever the heartbeat scan
                # beside the loop is doing: on a machine at load 450+ a scan of 2,048 ranks' beats took
                # seconds (512 nodes: the step's end waited 8 s for two polls when the loop scanned;
                # a scan stuck 17 s held a node loss srun and Slurm had reported, issue 19)
                now = self.clock()
                self._feed(Watched(at=now, decision=confirmer.evaluate(now), signalled=self.stop_signal is not None),
                           cur=cur)
            if self.state.phase is Phase.CONFIRMING:
                # its tasks are killed; srun itself may wait seconds for a lost node to answer: the
                # lifecycle relaunches without it after the grace (the next step overlaps its CPUs).
                # The rule has latched: no more scans of the beats
                beats.close()
                left = self._feed(Watched(at=self.clock()), cur=cur)
                if left is not None:
                    return left
                time.sleep(self.opts.tick_s)
                continue
            polled = False
            accepted = False
            for scan in beats.scans():
                if scan.took_s >= LATE_S:
                    log.debug("supervisor: launch %d: the heartbeat poll took %.2f s (%.3f s of CPU)", cur.number,
                              scan.took_s, scan.cpu_s)
                first = observer.take(scan)
                if first is not None:
                    self.journal.append("first_step", launch=cur.number, at=first[0], step=first[1])
            now = self.clock()
            if now >= next_nodes:
                next_nodes = now + self.opts.node_poll_s
                polled = True
                reads.ask((*cur.layout.nodes, *cur.layout.spares), full=True)   # the spares' for the relaunch
                self._write_status()
                accepted = self._take_request(cur)
                if not accepted and not self.state.stopping and self._tend_pools(cur) and self.stop_signal is None:
                    log.warning("supervisor: launch %d: a pool allocation started: SIGUSR1 to the step (the ranks "
                                "checkpoint; the next launch grows back)", cur.number)
                    accepted = True   # as a planned replacement: the ranks checkpoint, the next launch grows
                polled_successor = self._successor_polled(cur)
                if polled_successor is not None:
                    self._feed(polled_successor, cur=cur)
            self._feed(Watched(at=now, decision=confirmer.evaluate(now), signalled=self.stop_signal is not None,
                               request_accepted=accepted, check_time_limit=polled), cur=cur)
            if self.state.phase is Phase.CONFIRMING:
                continue   # straight to the grace check: with no grace, relaunch on this tick
            time.sleep(self.opts.tick_s)

    def _ending_on_request(self) -> bool:
        """The step was asked to stop (a planned replacement, a forwarded signal): its terminating is no failure."""
        return self.state.stopping or self.stop_signal is not None

    @staticmethod
    def _late(cur: Launch, what: str, came_at: float, now: float) -> None:
        """A debug line when the loop takes what came (srun's report, Slurm's answer) ``LATE_S`` or more
        after it came (``now``, in the clock ``came_at`` is in): the loop's own lateness, which the bench
        reads beside the confirmation."""
        late = now - came_at
        if late >= LATE_S:
            log.debug("supervisor: launch %d: %s taken %.2f s after it came", cur.number, what, late)

    def _poll(self, adopted: StepProcess | None) -> int | None | bool:
        """False while running; the exit code, or None for an adopted step that is gone. A launch
        that spans allocations ends when its every srun has; one that fails first (not done, not
        checkpointed) ends it: the others' tasks are killed (a peer is gone, they would hang in a
        collective) and its code is the launch's."""
        rc = self._poll_one(adopted)
        if not self._extra:
            return rc
        ended, code, kill_others = span_end([rc, *(self._poll_extra(x) for x in self._extra)])
        if not ended:
            return False
        if kill_others:
            for x in self._extra:
                self._dying.extend(kill_step(self.runner, x.job, self._step_name_now()))
            self._dying.extend(kill_step(self.runner, self._proc_job, self._step_name_now()))
            if self._proc is not None:
                self._dying.append(self._proc)
            self._dying.extend(x.proc for x in self._extra if x.proc is not None)
        self._close_extra()
        return code

    def _poll_one(self, adopted: StepProcess | None) -> int | None | bool:
        if self._proc is not None:
            rc = self._proc.poll()
            return False if rc is None else (128 - rc if rc < 0 else rc)
        if adopted is not None and is_running(adopted):
            return False
        return None

    @staticmethod
    def _poll_extra(x: _Srun) -> int | None | bool:
        if x.proc is not None:
            rc = x.proc.poll()
            return False if rc is None else (128 - rc if rc < 0 else rc)
        return False if x.adopted is not None and is_running(x.adopted) else None

    def _step_name_now(self) -> str:
        cur = self.journal.state.current
        return self._step_name(cur) if cur is not None else ""

    def _close_extra(self) -> None:
        for x in self._extra:
            if x.log is not None:
                x.log.close()
        self._extra = []

    def _stop_step(self, sig: int) -> None:
        procs = [p for p in (self._proc, *(x.proc for x in self._extra)) if p is not None and p.poll() is None]
        for proc in procs:
            proc.send_signal(sig)
        if sig == signal.SIGINT and procs:
            time.sleep(0.2)
            for proc in procs:
                proc.send_signal(sig)

    # -- after a launch ended ---------------------------------------------------------------------
    def _after(self, cur: Launch, rc: int | None) -> int | None:
        """Carry out what the end of ``cur`` means (``policy.supervision.after_launch``): an exit code
        for the batch script, or None after the next launch was journaled."""
        now = self.clock()
        if cur.ended is None:
            self.journal.append("ended", launch=cur.number, rc=-1 if rc is None else rc)
        # srun ended on its own (not a launch left to end after the kill's grace, nor adopted, nor spanning
        # allocations): its report of the tasks' exits is whole once its log is read to the end
        code = self._proc.returncode if self._proc is not None else None
        srun_ended = code is not None and code >= 0 and not cur.extra
        srun, self._proc = self._proc, None
        observer = self._observer or self._observe(cur)
        if rc is None:
            rc = adopted_rc([hb.phase for hb in observer.heartbeats()])
        if self._step_log is not None:
            whole = self._step_log.close(wait_s=STEP_LOG_END_S)
            for event in self._step_log.drain():   # its last lines, which the loop had not taken
                observer.srun(event, ending_on_request=self._ending_on_request())
            observer.srun_told_all = whole and srun_ended
            self._step_log = None
        self._reap()
        ending = rc == EXIT_DONE or self.stop_signal is not None   # no relaunch follows: nothing to read
        prefetched, self._prefetched = self._prefetched, None
        state, nodes = "", list[Node]()
        if prefetched is not None and prefetched[0] == cur.number and not ending:
            state, nodes = prefetched[1]
        elif not ending:
            state, nodes = self._job_state_and_nodes((*cur.layout.nodes, *cur.layout.spares))
        lost_here = (self._observer.lost if self._observer is not None else set()) | \
            {n.name for n in nodes if n.state.failed}
        repeated = "" if ending else self._start_failure(cur, rc, lost_here, state, srun)
        refused = "" if ending or rc == EXIT_CHECKPOINTED else self._refused(cur)
        end = LaunchEnd(number=cur.number, rc=rc, asked_to_stop=self.stop_signal is not None, job_state=state,
                        fruitless=fruitless_launches([(la.first_step_at, la.cause)
                                                      for la in self.journal.state.launches]),
                        batch_host_lost=self.opts.batch_host if self.opts.batch_host in lost_here else "",
                        repeated=repeated, refused=refused)
        self._ended = _Ended(rc, now, nodes, lost_here)
        return self._feed(LaunchEnded(now, end), cur=cur)

    def _prefetch_states(self, cur: Launch) -> None:
        """The job's and its nodes' states for the relaunch, read once the failure is confirmed and
        before the step is killed: slurmctld answers before it has the kill of every task to handle
        (after it, at 512 emulated nodes, the same two commands took 7 s: issue 19). Nothing changes a
        node's state in between (a lost node is already seen failed, or the rule had not confirmed);
        a slurmctld that does not answer leaves it to :meth:`_after`, without holding up the kill.
        The watch's reads of the last :data:`KNOWN_FRESH_S` give the nodes' states when they cover
        every node (the lost node: srun's report or its own read decides); the job's state too when
        the rule confirmed a node lost, or a hang (its ranks' beats alone). Else the job's state and
        which nodes failed are read after the failure's first report (a task that exits because the job
        was cancelled, or because a peer's node went down before srun says so, must not be relaunched
        on states read before it; at 8 nodes srun reported the loss 40+ ms after the peer's exit): by
        the read started at srun's report of a task's exit, waited for if it is still under way (then
        after the kill started: slurmctld has the read already), else now; two short answers either
        way (``squeue`` of the job, ``sinfo`` of the failed nodes)."""
        names = (*cur.layout.nodes, *cur.layout.spares)
        known = self._known.recent(names, self.clock(), KNOWN_FRESH_S)
        latched = (self._observer or self._observe(cur)).confirmer.latched
        mine = latched is not None and (latched.cause in HARD_KINDS or not latched.signals)
        if known is not None:
            try:
                state, failed = (known[0], []) if mine else self._states_since_fault(names)
            except SlurmError as e:
                log.warning("supervisor: launch %d: couldn't read the job's state before the kill (%s): after it",
                            cur.number, e)
                return
            now_failed = {n.name: n for n in failed}
            self._prefetched = (cur.number, (state, [now_failed.get(n.name, n) for n in known[1]]))
            log.debug("supervisor: launch %d: the nodes' states for the relaunch as the watch read them%s", cur.number,
                      "" if mine else f", {len(failed)} failed since the fault")
            return
        try:
            self._prefetched = (cur.number, self.slurm.job_state_and_nodes(names))
        except SlurmError as e:
            log.warning("supervisor: launch %d: couldn't read the states before the kill (%s): after it", cur.number, e)

    def _states_since_fault(self, names: Sequence[str]) -> tuple[str, list[Node]]:
        """The job's state and which of ``names`` failed, read after the failure's first report: from
        the read started at srun's last report of a task's exit (under way since before the rule
        confirmed), else asked now (the first signal was a rank's beat)."""
        reads, at = self._reads, self._report_at
        got = reads.job_since(at, timeout_s=10.0) if reads is not None and at is not None else None
        if got is not None:
            return got
        state, failed = read_job_and_failed(self.slurm.job_state, self.slurm.failed_among, names)
        if state is None or failed is None:
            raise SlurmError("supervisor: couldn't read the job's state or which nodes failed (said above)")
        return state, failed

    def _job_state_and_nodes(self, names: Sequence[str]) -> tuple[str, list[Node]]:
        """The job's state and its nodes' for the relaunch; a slurmctld that does not answer within
        10 s (hundreds of nodes on a loaded host, right after a failure) is asked once more, with
        SLOW_SLURM_S, before the supervisor gives up on it (issue 19: the 512-node lane)."""
        try:
            return self.slurm.job_state_and_nodes(names)
        except SlurmError as e:
            log.warning("supervisor: slurmctld did not answer (%s): asking again, %.0f s", e, SLOW_SLURM_S)
            return self.slurm.job_state_and_nodes(names, timeout_s=SLOW_SLURM_S)

    def _make_plan(self, cur: Launch) -> Planned:
        """The recovery's opening and the next launch's plan: a replacement that was asked for, else
        the rule's confirmation of what the launch left and the one placement policy's plan."""
        ended = self._ended
        if ended is None:
            raise OmniError("supervisor: couldn't plan: the launch's end was not recorded")
        planned, cause = self._planned(cur), PLANNED
        succ = self.journal.state.successor_of(self._alloc_id)
        if succ is not None and succ.state == "granted" and (
                self.state.moving or (planned is None and ended.rc == EXIT_CHECKPOINTED)):
            planned, cause = self._move_plan(cur, succ), SUCCESSOR
        if planned is None and ended.rc == EXIT_CHECKPOINTED:   # checkpointed: grow back if a pool started
            planned, cause = grow_plan(self.opts.stages, cur.layout, self.journal.state.pools.values(),
                                       units_divide=self.opts.units_divide), GROW
        first: FailureConfirmed | MigrationRequested
        if planned is not None:
            plan: Relaunch | Fallback = planned
            first = MigrationRequested(at=ended.at, plan=as_plan(planned, cur.layout),
                                       nodes=planned.removed, cause=cause)
        else:
            decision = self._confirm(cur, ended.rc, ended.at, ended.nodes)
            plan = self._plan(cur, decision, ended.at, ended.nodes)
            first = FailureConfirmed(decision=decision, lost={n: "down" for n in sorted(ended.lost)})
        return Planned(at=ended.at, first=first, plan=plan, before=cur.layout, incarnation=cur.incarnation,
                       slurm_job_id=int(self.opts.job_id) if self.opts.job_id.isdigit() else 0)

    # -- the lifecycle: feed it, carry out what it says ------------------------------------------------
    def _feed(self, event: LifecycleEvent, *, cur: Launch | None = None,
              allocation: tuple[str, ...] = ()) -> int | None:
        """One event through the lifecycle table (``policy.supervisor_lifecycle.step``); its effects
        carried out in order. Returns an exit code when an effect ends the supervisor (or leaves a
        killed step: its code), else None."""
        self.state, effects = lifecycle_step(self.state, event, self.lifecycle)
        out: int | None = None
        for effect in effects:
            code = self._carry_out(effect, cur, allocation)
            if code is not None:
                out = code
        return out

    def _carry_out(self, effect: LifecycleEffect, cur: Launch | None, allocation: tuple[str, ...]) -> int | None:
        if isinstance(effect, TakeAllocation):
            self.opts = replace(self.opts, allocation=allocation)
        elif isinstance(effect, StartStandbys):
            self._standby = self.opts.standby and self._standby_folder_is_ours()
            if self._standby:
                self._start_standbys()
                for pool in self.journal.state.pools.values():   # a restarted supervisor: its granted pools' too
                    if pool.state == "granted":
                        self._start_standbys(pool.nodes, pool.job_id)
        elif isinstance(effect, FirstLaunch):
            nodes, feats, _ = self.slurm.node_info(self.opts.allocation)
            leaf_of = {n.name: n.leaf_switch or "" for n in nodes}
            self._leaf_of.update(leaf_of)
            layout = first_layout(self.opts.stages, self.opts.allocation, features=feats, leaf_of=leaf_of)
            self.journal.append("allocation", nodes=list(self.opts.allocation))
            self._intend(0, layout, cause="", removed=(), added=())
        elif isinstance(effect, ReleaseAllocation):   # its predecessor may have died before giving it back
            self.slurm.release()
        elif isinstance(effect, ForwardStop):
            end = self.state.end_time or self.clock()
            log.warning("supervisor: the allocation ends in %.0f s: %s to the step (the ranks checkpoint)",
                        end - self.clock(), signal.Signals(effect.signum).name)
            self._forward(effect.signum, None)
        elif isinstance(effect, SignalStep):
            self._stop_step(effect.signum)
        elif isinstance(effect, KillStep) and cur is not None:
            observer = self._observer or self._observe(cur)
            log.warning("supervisor: launch %d: confirmed while the step runs: %s; killing the step",
                        cur.number, "; ".join(observer.confirmer.evaluate(self.clock()).reasons))
            log.debug("supervisor: launch %d: deciding (%s)", cur.number, _cpu_and_wait())
            # a read of the states asked at srun's report of a task's exit is under way: the kill starts
            # first and the read is waited for while the step is torn down (512 nodes: 0.2 s of
            # slurmctld's answer held the kill); a read not asked yet goes before the kill's load
            asked = self._reads is not None and self._report_at is not None
            if not asked:
                self._prefetch_states(cur)
            scancels = kill_step(self.runner, self._proc_job, self._step_name(cur),
                                 observer.step_id if self._proc_job == self._alloc_id else "")
            for x in self._extra:
                scancels += kill_step(self.runner, x.job, self._step_name(cur))
            self._dying.extend(scancels)
            if not scancels:
                self._stop_step(signal.SIGINT)
            if asked:
                self._prefetch_states(cur)
        elif isinstance(effect, LeaveStep):
            if cur is not None and self.opts.kill_grace_s > 0:
                log.warning("supervisor: launch %d: its srun still runs %.0f s after the kill: the next launch "
                            "starts beside it", cur.number, self.opts.kill_grace_s)
            if self._proc is not None:
                self._dying.append(self._proc)
            self._dying.extend(x.proc for x in self._extra if x.proc is not None)
            self._close_extra()
            return effect.rc
        elif isinstance(effect, JournalDone) and cur is not None:
            self.journal.append("done", launch=cur.number)
            if effect.release:   # no batch script ends this allocation
                self.slurm.release()
        elif isinstance(effect, Plan) and cur is not None:
            return self._feed(self._make_plan(cur), cur=cur)
        elif isinstance(effect, AskSuccessor):
            self._ask_successor(effect.reason)
        elif isinstance(effect, MoveToSuccessor):
            log.warning("supervisor: successor allocation %s started: the ranks checkpoint (a planned save); the "
                        "next launch runs there and allocation %s is released", effect.job_id, self._alloc_id)
        elif isinstance(effect, DropSuccessor):
            self._drop_successor(effect.reason)
        elif isinstance(effect, IntendLaunch) and cur is not None:
            relaunch = effect.relaunch
            cause = effect.cause
            succ = self.journal.state.successor_of(self._alloc_id) if cause == SUCCESSOR else None
            if succ is not None:
                old = self._alloc_id
                log.warning("supervisor: launch %d -> %d moves from allocation %s to its successor %s (%s)",
                            cur.number, effect.number, old, succ.job_id, compress(succ.nodes))
                self._switch_allocation(succ.job_id, succ.nodes)
                nxt = self._intend(effect.number, relaunch.layout, cause=cause, removed=relaunch.removed,
                                   added=relaunch.added, end_time=succ.end_time or self.clock())
                AllocationView(self.runner, old).release()
                log.warning("supervisor: allocation %s released (the job runs in %s now)", old, succ.job_id)
                self._release_pools()   # the launch on the successor is the job's whole shape
                self._report("relaunched", cur, nxt.incarnation, cause, relaunch.layout, relaunch.removed,
                             relaunch.added, "; ".join(relaunch.reasons), relaunched_at=nxt.started_at)
                return None
            log.warning("supervisor: launch %d -> %d: %s removed, %s added, units %d -> %d, %d spare(s) left (%s; "
                        "recovery %s)", cur.number, effect.number, ",".join(relaunch.removed) or "nothing",
                        ",".join(relaunch.added) or "nothing", relaunch.units_before, relaunch.layout.units,
                        len(relaunch.layout.spares), "; ".join(relaunch.reasons), effect.road)
            nxt = self._intend(effect.number, relaunch.layout, cause=cause, removed=relaunch.removed,
                               added=relaunch.added)
            self._report("relaunched", cur, nxt.incarnation, cause, relaunch.layout, relaunch.removed,
                         relaunch.added, "; ".join(relaunch.reasons), relaunched_at=nxt.started_at)
        elif isinstance(effect, GiveUp) and cur is not None:
            if effect.failed is not None:
                failed = set(effect.failed)
            else:
                failed = set(cur.layout.failed)
                ended = self._ended
                if effect.lost_batch_host and ended is not None:   # journal what the launch left, exclude its lost nodes
                    self._confirm(cur, ended.rc, ended.at, ended.nodes)
                    failed |= ended.lost & set(cur.layout.nodes)
            self._fallback(cur, sorted(failed), effect.reasons)
        elif isinstance(effect, Exit):
            if effect.reason and self.state.phase is Phase.STOPPED and cur is not None:
                log.warning("supervisor: launch %d ended (%s): no relaunch", cur.number, effect.reason)
            elif effect.reason:
                log.error("supervisor: couldn't supervise job %s: %s", self.opts.job_id, effect.reason)
            return effect.code
        return None

    def _refused(self, cur: Launch) -> str:
        """The one line of a rank of ``cur`` that exited 78 (bad input), from its last heartbeat; empty
        when none did. The ranks' last words come with the beats read; the beats written since the
        last poll are read first, unless the rule confirmed while the step ran a node lost or ranks
        silent (a hang, a stuck job: no rank had exited, the supervisor killed them; no rank's refusal
        is the cause): decide reads no rank's beat again (issue 19: at 512 nodes that scan of 2,044
        beats was 44 ms of a hang's decide); nor where srun ended on its own and its whole report
        names no task that exited 78 (a crash at 512 nodes: 78 ms of the beats every node wrote until
        its ranks were killed)."""
        observer = self._observer or self._observe(cur)
        latched = observer.confirmer.latched
        if latched is None or latched.cause not in HARD_KINDS | SILENT_CAUSES:
            if observer.may_have_refused():
                self._heartbeats(cur, observer)
            else:
                log.debug("supervisor: launch %d: srun reported no task's exit code %d: no beat read for a "
                          "refusal", cur.number, EXIT_BAD_INPUT)
        ranks = [RankEnd(rank=hb.rank, phase=hb.phase, step=hb.step, exit_code=hb.exit_code, error=hb.error)
                 for hb in observer.last_words.values()]
        found = refused_by_rank(f"job {self.opts.job_id} ({self.opts.job_name or '?'})", ranks)
        return "" if found is None else found.line

    def _start_failure(self, cur: Launch, rc: int, lost: set[str], job_state: str,
                       srun: subprocess.Popen[bytes] | None = None) -> str:
        """A launch that ended before any rank wrote a heartbeat, on its own (no node of it lost, no
        stop asked, the job still running): its failure's line to the job's output (this process's
        stderr) with where the whole log is, journaled and recorded for the manager
        (``failed-<job>-<incarnation>.json``). Returns the stop line when the launch before it failed
        the same way (``policy.start_failure``), else empty. ``srun``: the launch's srun, waited for
        up to :data:`START_FAILURE_SRUN_S` before its output is read when it still runs (killed at the
        confirmation and left to end)."""
        if (rc in (EXIT_DONE, EXIT_CHECKPOINTED) or self.state.stopping or cur.cause in (PLANNED, GROW)
                or job_state not in ("RUNNING", "") or lost & set(cur.layout.nodes)):
            return ""
        if cur.start_failure is None:
            observer = self._observer or self._observe(cur)
            if cur.first_step_at is not None or observer.heartbeats():
                return ""
            if srun is not None and srun.poll() is None:
                try:
                    srun.wait(START_FAILURE_SRUN_S)
                except subprocess.TimeoutExpired:
                    log.debug("supervisor: launch %d: its srun still runs %.1f s after the kill; its output "
                              "is read as it is", cur.number, START_FAILURE_SRUN_S)
            name = self._step_name(cur)
            failure = read_failure(Path(self._log_path(name)), start=0, rc=rc, launch=cur.number,
                                   srun_log=Path(self._log_path(name, srun=True)))
            if failure is None:   # srun lost a node: the recovery's
                return ""
            self.journal.append("start_failure", launch=cur.number, exit_code=failure.exit_code, line=failure.line,
                                log=failure.log)
        rec = cur.start_failure
        failure = StartFailure(launch=cur.number, exit_code=rec.exit_code if rec else rc, line=rec.line if rec else "",
                               log=rec.log if rec else "")
        label = f"job {self.opts.job_id} ({self.opts.job_name or '?'})"
        history = [None if la.start_failure is None else StartFailure(
            launch=la.number, exit_code=la.start_failure.exit_code, line=la.start_failure.line,
            log=la.start_failure.log) for la in self.journal.state.launches]
        repeated = repeated_failure(history)
        stop = stop_line(label, repeated) if repeated is not None else ""
        log.error("supervisor: %s", stop or first_line(label, failure))
        try:
            write_record(self.opts.heartbeat_dir, job_id=self.opts.job_id, incarnation=cur.incarnation,
                         failure=failure, stopped=stop)
        except OSError as e:
            log.warning("supervisor: couldn't record the launch's failure in %s: %s", self.opts.heartbeat_dir, e)
        return stop

    def _report(self, kind: ReportKind, cur: Launch, incarnation_after: int, cause: str, layout: StepLayout,
                removed: Sequence[str], added: Sequence[str], reason: str, *, relaunched_at: float | None) -> None:
        """The manager's view of this recovery (notes/recovery-fsm.md): one file per event. A hand-over
        that no confirmation preceded is dated when it happened (its ``detected_at``)."""
        conf = cur.confirmed
        detected_at = conf.detected_at if conf else None
        if relaunched_at is None and detected_at is None and (conf is None or conf.confirmed_at is None):
            detected_at = self.clock()
        def by_component(names: Sequence[str], where: StepLayout) -> dict[str, list[str]]:
            return {str(k): [n for n in names if n in comp] for k, comp in enumerate(where.components)
                    if any(n in comp for n in names)}
        doc = report_document(
            kind, job_id=self.opts.job_id, incarnation_before=cur.incarnation, incarnation_after=incarnation_after,
            cause=cause, nodes=list((conf.nodes if conf else None) or removed), removed=by_component(removed, cur.layout),
            added=by_component(added, layout),
            spares_left={str(k): len(layout.spares_for(stage)) for k, stage in enumerate(self.opts.stages)},
            data_parallel_size=layout.units * self.opts.replicas_per_unit, fault_at=conf.fault_at if conf else None,
            detected_at=detected_at, confirmed_at=conf.confirmed_at if conf else None, relaunched_at=relaunched_at,
            reason=reason, failed_nodes=list(layout.failed))
        try:
            write_report(report_path(self.opts.ckpt_dir, kind, incarnation_after), doc)
        except OSError as e:
            log.warning("supervisor: couldn't write the %s report: %s", kind, e)

    def _confirm(self, cur: Launch, rc: int, now: float, nodes: Sequence[Node]) -> Decision:
        """The one rule over what this launch left: the step's end, the nodes' states now (``nodes``,
        read after the step ended), the last heartbeats. Journaled once per launch (a restarted
        supervisor reuses it)."""
        if cur.confirmed is not None:
            c = cur.confirmed
            return Decision(Verdict.CONFIRMED, now, cause=c.cause, nodes=tuple(c.nodes), fault_at=c.fault_at,
                            confirmed_at=c.confirmed_at)
        observer = self._observer or self._observe(cur)
        if observer.confirmer.latched is None or cur.first_step_at is None:
            # a decision latched while the step ran is final: another poll of every rank's beat
            # (2,048 at 512 nodes) could only find the launch's first step, journaled already
            self._heartbeats(cur, observer)
        confirmer = observer.confirmer
        confirmer.observe(StepEnded(now, rc if rc else 1))
        observer.nodes(nodes, now)
        d = confirmer.evaluate(now)
        self.journal.append("confirmed", launch=cur.number, cause=d.cause, nodes=list(d.nodes), rc=rc,
                            fault_at=d.fault_at, detected_at=d.first_signal_at, confirmed_at=d.confirmed_at,
                            reasons=list(d.reasons),
                            signals=[{"kind": x.kind, "node": x.node, "source": x.source, "at": x.time}
                                     for x in d.signals[:16]])
        log.warning("supervisor: launch %d failed (rc %d): %s", cur.number, rc, "; ".join(d.reasons))
        log.debug("supervisor: launch %d: deciding (%s)", cur.number, _cpu_and_wait())
        return d

    def _plan(self, cur: Launch, decision: Decision, now: float, nodes: Sequence[Node] | None = None
              ) -> Relaunch | Fallback:
        """The next launch. The nodes to replace are those Slurm reported failed (srun's node
        failure, or a node state), not every node where a task died: a peer of a lost rank dies too.
        ``nodes``: the allocation's nodes as just read (else read now)."""
        layout = self._with_pools(cur.layout)
        if nodes is None:
            nodes, _, _ = self.slurm.node_info((*layout.nodes, *layout.spares))
        lost = self._observer.lost if self._observer is not None else set()
        # a pool that ended took its nodes with it: the job lost them as it loses a failed node
        gone = {n for p in self.journal.state.pools.values() if p.state in ("ended", "released") for n in p.nodes}
        gone &= set(cur.layout.nodes)
        nodes = [*(n for n in nodes if n.name not in gone),
                 *(Node(n, NodeState.DOWN, "DOWN", frozenset({"FAIL"}), reason="its pool allocation ended")
                   for n in sorted(gone))]
        failed = lost | {n.name for n in nodes if n.state.failed and n.name in cur.layout.nodes}

        decision = Decision(decision.verdict, decision.at, cause=decision.cause,
                            nodes=tuple(sorted(failed | (set(decision.nodes) if decision.cause == "drain" else set()))))
        return plan_relaunch(self.opts.stages, layout, decision, nodes={n.name: n for n in nodes},
                             topology=self.slurm.topology(), now=now, min_units=self.opts.min_units,
                             units_divide=self.opts.units_divide, spare_scope=self.opts.spare_policy)

    # -- pool allocations (capacity comes back: policy/pools.py) -----------------------------------------
    def _alloc_of(self, node: str) -> str:
        """The job id of the allocation ``node`` belongs to: a granted pool's, else the job's own."""
        for pool in self.journal.state.pools.values():
            if pool.state == "granted" and node in pool.nodes:
                return pool.job_id
        return self._alloc_id

    def _with_pools(self, layout: StepLayout) -> StepLayout:
        """``layout`` with the granted pools' nodes it does not use among its spares (a replacement
        after a failure may take them)."""
        extra = [(n, p.kind_of.get(n, "")) for p in self.journal.state.pools.values() if p.state == "granted"
                 for n in p.nodes if n not in layout.nodes and n not in layout.spares and n not in layout.failed]
        if not extra:
            return layout
        return replace(layout, spares=(*layout.spares, *(n for n, _ in extra)),
                       kind_of={**layout.kind_of, **{n: k for n, k in extra if n not in layout.kind_of}})

    def _tend_pools(self, cur: Launch) -> bool:
        """Every node poll of a launch in allocation mode: follow the pools asked for (their job id
        for one a dead predecessor started, their start, their end), ask for one when the policy says
        so (``policy.pools.pool_ask``: running shrunk, none open). True when a pool's nodes make a
        larger launch possible and this one trains (then the ranks checkpoint for the grow-back)."""
        if not self.opts.outside or not self.opts.pool_salloc:
            return False
        for pool in list(self.journal.state.pools.values()):
            try:
                self._follow_pool(pool)
            except SlurmError as e:
                log.warning("supervisor: couldn't follow pool %s: %s", pool.name, e)
        pools = self.journal.state.pools.values()
        now = self.clock()
        ask = pool_ask(self.opts.stages, cur.layout, pools, end_time=self.state.end_time, now=now,
                       default_minutes=self.opts.pool_minutes, spare_scope=self.opts.spare_policy)
        if ask is not None:
            self._ask_pool(ask)
        return grow_now(stepped=cur.first_step_at is not None, stopping=self.state.stopping,
                        warm=[pool_warm(standby=self._standby, warm_nodes=self._warm_nodes(p), nodes=p.nodes,
                                        seen_at=self._pool_seen.setdefault(p.name, now), now=now,
                                        bound_s=self.opts.pool_warm_s) for p in pools if p.state == "granted"],
                        plan=grow_plan(self.opts.stages, cur.layout, pools, units_divide=self.opts.units_divide))

    def _warm_nodes(self, pool: Pool) -> list[str]:
        """The pool's nodes whose standby said it is warm (its log on this host)."""
        warm = []
        for node in pool.nodes if self._standby else ():
            try:
                with open(self._log_path(_standby_name(pool.job_id, node)), "rb") as f:
                    if WARM_LINE.encode() in f.read(1 << 20):
                        warm.append(node)
            except OSError:
                continue
        return warm

    def _follow_pool(self, pool: Pool) -> None:
        if pool.state == "asking":   # a predecessor died between its salloc and the job id
            ids = jobs_named(self.runner, pool.name)
            self.journal.append("pool", event="requested" if ids else "ended", name=pool.name,
                                job=ids[0] if ids else "")
        elif pool.state in ("requested", "granted"):
            rec = AllocationView(self.runner, pool.job_id).job_record()
            if rec.user_id is not None and rec.user_id != os.geteuid():
                self.journal.append("pool", event="ended", name=pool.name, job=pool.job_id)
            elif pool.state == "requested" and rec.state == "RUNNING" and rec.nodes:
                _, feats, _ = self.slurm.node_info(rec.nodes)
                self.journal.append("pool", event="granted", name=pool.name, job=pool.job_id, nodes=list(rec.nodes),
                                    kind_of=pool_kinds(self.opts.stages, rec.nodes, feats))
                log.warning("supervisor: pool allocation %s (%s) started on %s", pool.job_id, pool.name,
                            compress(rec.nodes))
                if self._standby:   # warm before the grow-back's launch: it waits for them (_pool_warm)
                    self._start_standbys(rec.nodes, pool.job_id)
            elif rec.state not in ("PENDING", "CONFIGURING", "RUNNING"):
                self.journal.append("pool", event="ended", name=pool.name, job=pool.job_id, state=rec.state)
                log.warning("supervisor: pool allocation %s (%s) is %s", pool.job_id, pool.name, rec.state or "gone")

    def _ask_pool(self, ask: PoolAsk) -> None:
        name = f"omni-{self.opts.job_id}-pool-{len(self.journal.state.pools)}"
        wait = switch_wait(self.opts.pool_salloc)
        argv = pool_salloc_argv(self.opts.pool_salloc, name=name, nodes=ask.nodes, minutes=ask.minutes,
                                constraint=pool_constraint(ask),
                                switches=(f"{ask.switches}@{wait}" if wait else str(ask.switches)) if ask.switches else "",
                                exclude=ask.exclude)
        self.journal.append("pool", event="asking", name=name, nodes_asked=ask.nodes, reason=ask.reason)
        try:
            job = request_allocation(self.runner, argv, Path(self._log_path(name)).with_suffix(".salloc.out"),
                                     timeout_s=60)
        except SlurmError as e:
            log.warning("supervisor: couldn't ask for a pool allocation: %s", e)
            self.journal.append("pool", event="ended", name=name, job="")
            return
        self.journal.append("pool", event="requested", name=name, job=str(job))
        log.warning("supervisor: asked for pool allocation %s (%s): %s", job, name, ask.reason)

    def _release_pools(self) -> None:
        """Give back every pool still open (the job ends, or leaves these allocations)."""
        for pool in list(self.journal.state.pools.values()):
            if not pool.open:
                continue
            ids = [pool.job_id] if pool.job_id else jobs_named(self.runner, pool.name)
            for job in ids:
                AllocationView(self.runner, job).release()
            self.journal.append("pool", event="released", name=pool.name, job=pool.job_id or ",".join(ids))
            log.warning("supervisor: pool allocation %s (%s) released", pool.job_id or "-", pool.name)

    # -- the time limit's successor allocation (policy/pools.py, docs/allocation-mode.md) -------------
    def _successor_polled(self, cur: Launch) -> SuccessorPolled | None:
        """Every node poll of a launch in allocation mode: follow the successor asked for while this
        allocation runs (its job id, its start, its end) and say where it stands."""
        if not self.opts.outside or not self.opts.pool_salloc or self.opts.successor_queue_wait_s <= 0:
            return None
        succ = self.journal.state.successor_of(self._alloc_id)
        if succ is not None and succ.state in ("asking", "requested", "granted"):
            try:
                self._follow_successor(succ.name)
            except SlurmError as e:
                log.warning("supervisor: couldn't follow successor %s: %s", succ.name, e)
            succ = self.journal.state.successor_of(self._alloc_id)
        lead = successor_lead_for(self.opts.successor_queue_wait_s,
                                  [(la.started_at, la.first_step_at) for la in self.journal.state.launches],
                                  limit_s=self._limit_s)
        return SuccessorPolled(at=self.clock(), state=succ.state if succ else "", lead_s=lead,
                               job_id=succ.job_id if succ else "")

    def _follow_successor(self, name: str) -> None:
        succ = self.journal.state.successors[name]
        if succ.state == "asking":   # a predecessor died between its salloc and the job id
            ids = jobs_named(self.runner, name)
            self.journal.append("successor", event="requested" if ids else "ended", name=name, after=succ.after,
                                job=",".join(ids))
            return
        rec = AllocationView(self.runner, succ.job_id).job_record()
        if rec.state in ("PENDING", "CONFIGURING") or (rec.state == "RUNNING" and not rec.nodes):
            return
        if rec.state == "RUNNING":
            if succ.state == "requested":
                self.journal.append("successor", event="granted", name=name, after=succ.after, job=succ.job_id,
                                    nodes=list(rec.nodes), **({"end_time": rec.end_time} if rec.end_time else {}))
                log.warning("supervisor: successor allocation %s (%s) started on %s", succ.job_id, name,
                            compress(rec.nodes))
                if self._standby:   # warm before the launch on it
                    self._start_standbys(rec.nodes, succ.job_id)
            return
        self.journal.append("successor", event="ended", name=name, after=succ.after, job=succ.job_id,
                            state=rec.state[:64])
        log.warning("supervisor: successor allocation %s (%s) is %s", succ.job_id, name, rec.state or "gone")

    def _ask_successor(self, reason: str) -> None:
        name = f"omni-{self.opts.job_id}-successor-{len(self.journal.state.successors)}"
        cur = self.journal.state.current
        failed = sorted(cur.layout.failed) if cur is not None else []
        argv = successor_salloc_argv(self.opts.pool_salloc, name=name, exclude=failed)
        self.journal.append("successor", event="asking", name=name, after=self._alloc_id, reason=reason)
        try:
            job = request_allocation(self.runner, argv, Path(self._log_path(name)))
        except SlurmError as e:
            log.warning("supervisor: couldn't ask for a successor allocation: %s (the time limit's stop and the "
                        "manager's resubmission follow)", e)
            self.journal.append("successor", event="ended", name=name, after=self._alloc_id)
            return
        self.journal.append("successor", event="requested", name=name, after=self._alloc_id, job=str(job))
        log.warning("supervisor: asked for successor allocation %s (%s): %s", job, name, reason)

    def _drop_successor(self, reason: str) -> None:
        """No move onto the successor: give it back if it is still open; one line."""
        succ = self.journal.state.successor_of(self._alloc_id)
        if succ is None or succ.state in ("ended", "released") and reason == "the job leaves this allocation":
            return
        if succ.state in ("asking", "requested", "granted"):
            for job in [succ.job_id] if succ.job_id else jobs_named(self.runner, succ.name):
                AllocationView(self.runner, job).release()
            self.journal.append("successor", event="released", name=succ.name, after=succ.after, job=succ.job_id)
        if reason != "the job leaves this allocation":
            log.warning("supervisor: successor allocation %s (%s): %s: the time limit's stop and the manager's "
                        "resubmission follow, as without one", succ.job_id or "-", succ.name, reason)

    def _move_plan(self, cur: Launch, succ: Successor) -> Relaunch:
        """The launch on the successor allocation: the job's whole shape on its nodes."""
        nodes, feats, _ = AllocationView(self.runner, succ.job_id).node_info(succ.nodes)
        leaf_of = {n.name: n.leaf_switch or "" for n in nodes}
        self._leaf_of.update(leaf_of)
        layout = first_layout(self.opts.stages, succ.nodes, features=feats, leaf_of=leaf_of)
        return Relaunch(layout, tuple(cur.layout.nodes), tuple(layout.nodes), cur.layout.units,
                        (f"successor allocation {succ.job_id} started before the time limit of {self._alloc_id}",))

    def _switch_allocation(self, job_id: str, nodes: Sequence[str]) -> None:
        """From now on the job runs in allocation ``job_id`` (journaled with the next launch)."""
        self._alloc_id = job_id
        self.slurm = AllocationView(self.runner, job_id, self._session)
        self.opts = replace(self.opts, allocation=tuple(nodes))
        os.environ["SLURM_JOB_ID"] = os.environ["SLURM_JOBID"] = job_id   # an srun without --jobid runs there

    def _release_predecessors(self) -> None:
        """A restarted supervisor whose job moved to a successor: the allocations before it are given
        back (its predecessor may have died between the launch on the successor and the release)."""
        if self._alloc_id == self.opts.job_id:
            return
        os.environ["SLURM_JOB_ID"] = os.environ["SLURM_JOBID"] = self._alloc_id
        olds = [self.opts.job_id, *(s.job_id for s in self.journal.state.successors.values()
                                    if s.job_id and s.job_id != self._alloc_id and s.state == "granted")]
        for job in olds:
            if AllocationView(self.runner, job).job_state() in ("RUNNING", "PENDING", "CONFIGURING"):
                AllocationView(self.runner, job).release()
                log.warning("supervisor: allocation %s released (the job runs in %s now)", job, self._alloc_id)

    def _fallback(self, cur: Launch, failed: Sequence[str], reasons: Sequence[str]) -> int:
        self.journal.append("fallback", launch=cur.number, failed_nodes=sorted(failed), reasons=list(reasons))
        gone = StepLayout(cur.layout.components, cur.layout.spares, tuple(sorted(failed)), cur.layout.units,
                          cur.layout.kind_of)
        self._report("gave_up", cur, cur.incarnation + 1, cur.confirmed.cause if cur.confirmed else "", gone,
                     (), (), "; ".join(reasons), relaunched_at=None)
        log.error("supervisor: no launch fits the allocation (%s): handing over to the manager's resubmission "
                  "(exclude %s)", "; ".join(reasons), ",".join(sorted(failed)) or "-")
        return EXIT_FAILED

    # -- planned replacements (fail-slow migrations) -------------------------------------------------
    def _take_request(self, cur: Launch) -> bool:
        """A request file names nodes to leave at the next checkpoint: accept it once (journaled)
        when every named node runs this launch and has a spare of its kind, or, when the request
        allows a shrink, when a launch with fewer replicas without them fits."""
        req = read_request(self.request_file)
        if req is None or req.id in self.journal.state.requests:
            return False
        shrink = req.shrink
        leaving = [n for n in req.replace if n in cur.layout.nodes]
        plan = self._replacement(cur, leaving, shrink=shrink) if len(leaving) == len(req.replace) else None
        outcome = request_outcome(req.replace, cur.layout.nodes, plan, shrink=shrink)
        self.journal.append("request", id=req.id, replace=list(req.replace), shrink=shrink, outcome=outcome,
                            launch=cur.number)
        log.warning("supervisor: request %s to %s %s: %s", req.id, "leave (a shrink allowed)" if shrink else "replace",
                    ",".join(req.replace), outcome)
        return outcome == "accepted"

    def _replacement(self, cur: Launch, leaving: Sequence[str], *, shrink: bool) -> Relaunch | None:
        decision = Decision(Verdict.CONFIRMED, self.clock(), cause="drain", nodes=tuple(leaving))
        plan = self._plan(cur, decision, self.clock())
        if isinstance(plan, Fallback) or (plan.shrunk and not shrink):
            return None
        return plan

    def _planned(self, cur: Launch) -> Relaunch | None:
        accepted = [rid for rid, outcome in self.journal.state.requests.items() if outcome == "accepted"]
        req = read_request(self.request_file)
        if req is None or req.id not in accepted or self._request_done(req.id):
            return None
        leaving = [n for n in req.replace if n in cur.layout.nodes]
        plan = self._replacement(cur, leaving, shrink=req.shrink) if leaving else None
        if plan is not None:
            self.journal.append("request", id=req.id, replace=list(req.replace), outcome="carried_out",
                                launch=cur.number + 1)
        return plan

    def _request_done(self, rid: str) -> bool:
        return self.journal.state.requests.get(rid) == "carried_out"

    # -- observations -------------------------------------------------------------------------------
    def _observe(self, cur: Launch) -> LaunchObserver:
        return LaunchObserver(cur, job_id=self.opts.job_id, heartbeat_dir=self.opts.heartbeat_dir,
                              heartbeat_interval_s=self.opts.heartbeat_interval_s,
                              confirmation_window_s=self.opts.confirmation_window_s, hang_factor=self.opts.hang_factor)

    def _step_name(self, cur: Launch) -> str:
        return step_name(self.opts.job_id, cur.number + REQUEUE_INCARNATION_STRIDE * self.opts.restart_count)

    def _heartbeats(self, cur: Launch, observer: LaunchObserver) -> None:
        first = observer.beats(self.clock())
        if first is not None:
            self.journal.append("first_step", launch=cur.number, at=first[0], step=first[1])

    def _reap(self) -> None:
        """Old sruns that were left to finish on their own (their tasks already killed)."""
        self._dying = _reap_all(self._dying)

    def _write_status(self) -> None:
        try:
            write_status(self.status_file, status_document(self.journal.state, job_id=self.opts.job_id,
                                                           phase=cast(SupervisorPhase, self.state.phase.value),
                                                           now=self.clock()))
        except OSError as e:
            log.warning("supervisor: couldn't write %s: %s", self.status_file, e)

    def _crash(self, point: str, cur: Launch) -> None:
        if self.opts.crash_at != point or cur.number == 0:
            return
        marker = self.journal.path.with_suffix(".crashed")
        if marker.exists():
            return
        marker.write_text(point)
        log.warning("supervisor: drill: SIGKILL at %s", point)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class _Ended:
    rc: int
    at: float
    nodes: Sequence[Node]
    """The allocation's nodes as read after the launch ended (empty when nothing followed)."""
    lost: set[str]


@dataclass(slots=True)
class _Srun:
    """One more srun of a launch that spans allocations: its allocation, its process (ours, or one a
    restarted supervisor adopted by its journaled pid), what it says on stderr."""

    job: str
    proc: subprocess.Popen[bytes] | None
    adopted: StepProcess | None
    log: StepLog | None


def _standby_name(job: str, node: str) -> str:
    return f"omni-{job}-standby-{node}"


def _reap_all(procs: list[subprocess.Popen[bytes]]) -> list[subprocess.Popen[bytes]]:
    return [p for p in procs if p.poll() is None]



def _cpu_and_wait() -> str:
    """The debug lines around decide (the scale bench reads them): this process's CPU seconds, and the
    seconds the calling thread (the loop's, which decides) was runnable but waited for a core (the
    kernel's schedstat; left out where the kernel keeps none)."""
    cpu = f"process CPU {time.process_time():.3f} s"
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            waited = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return cpu
    return f"{cpu}, waited for a core {waited / 1e9:.3f} s"
