"""What one launch of the step shows the supervisor, fed to the one confirmation rule
(``policy.confirm``): srun's own reports on its stderr (a node failure, a task's exit, the step
terminating), the ranks' heartbeats, the nodes' states in Slurm. It also finds the launch's first
step after its restore. It reads files and takes what it is given; it runs no command."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from slurm_omni.elastic.codes import EXIT_BAD_INPUT
from slurm_omni.formats.heartbeat import HeartbeatRecord, newer
from slurm_omni.manager.events import HeartbeatScanner
from slurm_omni.policy.confirm import ConfirmConfig, Confirmer, NodeObservation, StepEnded, TaskExit
from slurm_omni.slurm.steps import SrunEvent
from slurm_omni.slurm.types import Node, NodeState
from slurm_omni.supervisor.journal import Launch

TRAINING_PHASES = ("training", "checkpointing")


class LaunchObserver:
    def __init__(self, launch: Launch, *, job_id: str, heartbeat_dir: Path, heartbeat_interval_s: float,
                 confirmation_window_s: float = 30.0, hang_factor: float = 30.0) -> None:
        self.launch = launch
        self.job_id = job_id
        self.heartbeat_dir = heartbeat_dir
        self.confirmer = Confirmer(ConfirmConfig(initial_heartbeat_s=heartbeat_interval_s,
                                                 hang_floor_s=confirmation_window_s, hang_factor=hang_factor),
                                   {k: list(nodes) for k, nodes in enumerate(launch.layout.components)})
        self.lost: set[str] = set()
        """Nodes of the launch that Slurm reported failed (srun, or their node state)."""
        self._nodes = frozenset(launch.layout.nodes)
        """The launch's nodes, once (``StepLayout.nodes`` builds its tuple at every call: a read of 512
        nodes' states asked it once per node, 2/3 of decide's CPU at 512 nodes, issue 19)."""
        self.last_words: dict[int, HeartbeatRecord] = {}
        """Rank -> its newest beat of this launch that carries an exit code (its last word: done,
        failed, refused), kept as the beats are read, so that the launch's end needs no scan of every
        rank's beat (``_refused``)."""
        self.step_id = ""
        """The step's id as srun named it (``JOB.STEP``), once it said."""
        self.srun_codes: set[int] = set()
        """The exit codes srun reported for the launch's tasks (a task killed by a signal: none)."""
        self.srun_told_all = False
        """Set by the supervisor once srun ended on its own and its whole report was read (``srun``)."""
        self._start_step: int | None = None
        self.scanner = HeartbeatScanner()
        """Reads only the heartbeat files that changed since the last poll (per node where the ranks
        aggregate: formats/heartbeat.py). Used under ``scan_lock``: the loop's scans and a ``BeatReader``'s."""
        self.scan_lock = threading.Lock()
        self._ended_scans: list[Scan] = []
        """Scans a ``BeatReader`` ended that the loop has not taken yet (``pending``); a scan of the
        loop's own takes them first, so no beat a reader read is lost to the scanner's cache."""
        self._ended_lock = threading.Lock()

    def srun(self, event: SrunEvent, *, ending_on_request: bool) -> None:
        """One srun report. ``ending_on_request``: the step was asked to stop (a forwarded signal, a
        planned replacement), so its terminating is no failure."""
        self.step_id = event.step_id or self.step_id
        if event.kind == "node_failure":
            self.lost.add(event.node)
            self.confirmer.observe(NodeObservation(event.time, event.node, NodeState.DOWN, "srun: node failure",
                                                   source="srun"))
        elif event.kind == "task_exit":
            code = event.detail.rsplit(" ", 1)[-1]
            killed = event.detail.startswith("Killed")
            if not killed and code.isdigit():
                self.srun_codes.add(int(code))
            self.confirmer.observe(TaskExit(event.time, event.node, None, event.task, signal=9 if killed else None,
                                            exit_code=None if killed else int(code) if code.isdigit() else 1))
        elif not ending_on_request:   # terminating: the step is over
            self.confirmer.observe(StepEnded(event.time, 128 + signal.SIGTERM))

    def may_have_refused(self) -> bool:
        """Whether a rank of this launch may have exited with the bad-input code (its refusal is its
        last beat's line): unless srun ended on its own and its whole report was read, it may; then
        only where srun reported a task's exit with that code (every task's bad exit is one line of
        srun's, ``srun: error: NODE: task N: Exited with exit code 78``)."""
        return not self.srun_told_all or EXIT_BAD_INPUT in self.srun_codes

    def heartbeats(self) -> list[HeartbeatRecord]:
        """This launch's ranks' newest heartbeats (its incarnation, this job), unreadable: none. The
        beats read fresh go to the rule and the last words as :meth:`beats`'s do (a scan here takes
        them from the next poll's fresh ones)."""
        with self.scan_lock:
            self._take_ended()
            try:
                self._take(self.scanner.scan_fresh(self.heartbeat_dir))
            except OSError:
                return []
            return [hb for hb in self.scanner.newest()
                    if hb.job_id == self.job_id and hb.incarnation == self.launch.incarnation]

    def scan(self, started: float, clock: Callable[[], float]) -> None:
        """One scan of the folder (a ``BeatReader``'s, beside the loop), left for :meth:`pending`: the
        beats read fresh and, until the launch's first step is known, the newest beats in training."""
        cpu = time.thread_time()
        with self.scan_lock:
            try:
                fresh: list[HeartbeatRecord] | None = self.scanner.scan_fresh(self.heartbeat_dir)
            except OSError:
                fresh = None
            training = self._training() if fresh is not None and self.launch.first_step_at is None else []
            done = Scan(started, fresh, training, cpu_s=time.thread_time() - cpu, took_s=clock() - started)
            with self._ended_lock:   # before the scan lock goes: a scan of the loop's own takes it first
                self._ended_scans.append(done)

    def pending(self) -> list[Scan]:
        """The scans a ``BeatReader`` ended since the last call, oldest first (never waits for one under way)."""
        with self._ended_lock:
            out, self._ended_scans = self._ended_scans, []
        return out

    def _take_ended(self) -> None:
        """Under ``scan_lock``: what the reader's scans read and the loop did not take, to the rule."""
        for scan in self.pending():
            self._take_scan(scan)

    def take(self, scan: Scan) -> tuple[float, int] | None:
        """A ``BeatReader``'s scan, in the loop: its fresh beats to the rule, which judges the ranks'
        silence as of the scan's start from now on (``Confirmer.beats_seen``); the launch's first step
        as :meth:`beats` finds it."""
        if not self._take_scan(scan) or self.launch.first_step_at is not None:
            return None
        return self._first_step(scan.training)

    def _take_scan(self, scan: Scan) -> bool:
        """A reader's scan's fresh beats to the rule, its silence judged as of the scan's start; False
        for a scan of an unreadable folder."""
        if scan.fresh is None:
            return False
        self._take(scan.fresh)
        self.confirmer.beats_seen(scan.started)
        return True

    def _training(self) -> list[HeartbeatRecord]:
        incarnation = self.launch.incarnation
        return [hb for hb in self.scanner.newest() if hb.phase in TRAINING_PHASES
                and hb.job_id == self.job_id and hb.incarnation == incarnation]

    def _take(self, fresh: list[HeartbeatRecord]) -> None:
        incarnation = self.launch.incarnation
        for hb in fresh:
            if hb.incarnation == incarnation and hb.job_id == self.job_id:
                self.confirmer.observe(hb.observation())
                if hb.exit_code is not None:
                    known = self.last_words.get(hb.rank)
                    if known is None or newer(hb, known):
                        self.last_words[hb.rank] = hb

    def beats(self, started: float | None = None) -> tuple[float, int] | None:
        """Read and observe the heartbeats; the launch's first step after its restore (time, step),
        once a rank reports a step past the one it restored (None before, or when known already).
        Only the beats that changed since the last poll go to the rule (it has the others).
        ``started``: the clock as this scan was asked, where a ``BeatReader`` also read for the rule
        (``Confirmer.beats_seen``)."""
        with self.scan_lock:
            self._take_ended()
            try:
                fresh = self.scanner.scan_fresh(self.heartbeat_dir)
            except OSError:
                return None
            self._take(fresh)
            if started is not None:
                self.confirmer.beats_seen(started)
            if self.launch.first_step_at is not None:
                return None
            training = self._training()
        return self._first_step(training)

    def _first_step(self, training: list[HeartbeatRecord]) -> tuple[float, int] | None:
        if not training:
            return None
        # the first beat in training reports the restored step; a higher one is the first new step
        if self._start_step is None:
            self._start_step = min(hb.step for hb in training)
        ahead = [hb for hb in training if hb.step > self._start_step]
        if not ahead:
            return None
        first = min(ahead, key=lambda hb: hb.time)
        return first.time, first.step

    def nodes(self, nodes: Sequence[Node], now: float, *, asked_at: float | None = None) -> None:
        """The nodes' states as Slurm shows them (those of this launch count), answered at ``now`` to
        a read asked at ``asked_at``; once the rule has latched a decision only the failed nodes are
        kept (nothing changes its verdict)."""
        feed = self.confirmer.latched is None
        for n in nodes:
            if n.name not in self._nodes:
                continue
            if feed:
                self.confirmer.observe(NodeObservation(now, n.name, n.state, n.reason, asked_at=asked_at))
            if n.state.failed:
                self.lost.add(n.name)


@dataclass(slots=True)
class Scan:
    """One scan of the heartbeat folder: when it started, the beats it read fresh (None: the folder
    unreadable), the newest beats in training while the first step is not known, its CPU seconds."""

    started: float
    fresh: list[HeartbeatRecord] | None
    training: list[HeartbeatRecord] = field(default_factory=list)
    cpu_s: float = 0.0
    took_s: float = 0.0


class BeatReader:
    """The launch's heartbeats read beside the supervisor's loop, every ``pace_s`` from the end of the
    last scan, so that a scan stuck in the kernel holds up nothing else: srun's reports and Slurm's
    answers reach the rule meanwhile, and the rule judges the ranks' silence only as of the newest
    scan that ended (``LaunchObserver.take``). Seen at 512 emulated nodes (issue 19): a scan of the
    loop took 14.85 and 17.41 s with 0.015 / 0.033 s of CPU, and the node loss srun and Slurm had
    reported within 0.1-1.1 s was confirmed after it. It reads files; it runs no command."""

    def __init__(self, observer: LaunchObserver, pace_s: float, clock: Callable[[], float]) -> None:
        self.observer = observer
        self._pace_s = pace_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-beats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.observer.scan(self._clock(), self._clock)
            self._stop.wait(self._pace_s)

    def scans(self) -> list[Scan]:
        """The scans that ended since the last call, oldest first (the observer keeps them: one the
        loop does not take reaches the rule with the loop's next scan of its own)."""
        return self.observer.pending()

    def close(self) -> None:
        """No scan after the one under way (a stuck one ends on its own; the thread is a daemon)."""
        self._stop.set()
