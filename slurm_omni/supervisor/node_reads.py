"""Slurm's node states read beside the supervisor's watch, not inside it (issue 19).

A ``scontrol show node`` of a loaded slurmctld answered in 8-12 s at 512 emulated nodes (load
540-980): read in the watch loop, it held srun's reports, the heartbeats and the confirmation rule
for that long, and the node loss was confirmed when the answer came, whatever else had arrived in the
meantime. Here each read runs in a thread of its own; the loop asks, goes on, and takes the answers
as they come (:meth:`NodeReads.answers`). At most one read of every node of the launch is in flight
(the 3 s poll does not pile up behind a slow slurmctld); a read of the nodes srun just reported
failed starts at once, beside it.

What the reads answered is kept (:class:`KnownStates`): the relaunch takes the job's and its nodes'
states from there when they are recent, instead of asking slurmctld again between the confirmation and
the next launch (512 nodes at load 500+: the two commands took 1-9 s there, and parsing 513 nodes'
records 17 ms of the supervisor's CPU; issue 19)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.steps import drain_queue
from slurm_omni.slurm.types import Node

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeAnswer:
    """What one read returned: the nodes' states, when it was asked and when the answer came."""

    nodes: tuple[Node, ...]
    asked_at: float
    answered_at: float
    full: bool
    """A read of every node of the launch (the poll), not of the nodes srun named."""
    job_state: str = ""
    """A full read's: the job's state as Slurm showed it (``squeue``), empty when unknown."""
    step_id: str = ""
    """A full read's, until one found it: the launch's step id (``JOB.STEP``), empty when not known."""


class KnownStates:
    """The newest state of each node and of the job that the reads answered, dated by when each was
    asked (the state is at least that recent). Pure: it is handed the answers."""

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[float, Node]] = {}
        self._job: tuple[float, str] | None = None

    def take(self, answer: NodeAnswer) -> None:
        at = answer.asked_at
        for n in answer.nodes:
            known = self._nodes.get(n.name)
            if known is None or known[0] <= at:   # an answer asked earlier never replaces a later one
                self._nodes[n.name] = (at, n)
        if answer.job_state and (self._job is None or self._job[0] <= at):
            self._job = (at, answer.job_state)

    def recent(self, names: Sequence[str], now: float, max_age_s: float) -> tuple[str, list[Node]] | None:
        """The job's state and the states of ``names``, each asked at most ``max_age_s`` before
        ``now``; None when one of them is older or unknown (the caller asks Slurm)."""
        if self._job is None or now - self._job[0] > max_age_s:
            return None
        out = []
        for name in names:
            known = self._nodes.get(name)
            if known is None or now - known[0] > max_age_s:
                return None
            out.append(known[1])
        return self._job[1], out


class NodeReads:
    """Reads of node states in daemon threads (a supervisor that exits does not wait for a slurmctld
    that does not answer). ``read`` runs the command (``AllocationView.node_info``'s nodes); ``clock``
    dates the answers in the supervisor's clock; ``job_state`` (``AllocationView.job_state``), when
    given, is read with every full read, before the nodes; the nodes srun named are read with
    ``read`` too (``scontrol show node``: a one-node ``sinfo`` says ``mixed`` for a node set DOWN a
    moment ago, ``slurm/parse_text.py`` SINFO_NODE_LINES). ``step_id``,
    when given, is asked with the full reads until it names the launch's step: the kill that follows a
    confirmation then needs no ``squeue`` of the job's steps (srun names its step only once it ends;
    at 512 nodes that query was decide's longest wait, 0.57 s at load 1,260)."""

    def __init__(self, read: Callable[[Sequence[str]], Sequence[Node]], clock: Callable[[], float], *,
                 job_state: Callable[[], str] | None = None,
                 step_id: Callable[[], str] | None = None) -> None:
        self._read = read
        self._step_id = step_id
        self._clock = clock
        self._job_state = job_state
        self._answers: queue.SimpleQueue[NodeAnswer] = queue.SimpleQueue()
        self._job_read: _JobRead | None = None
        self._full_in_flight = False
        self._lock = threading.Lock()
        self.closed = False

    def ask(self, names: Sequence[str], *, full: bool) -> bool:
        """Start a read of ``names``; False when not started (nothing to read, or a full read is
        still in flight and this one is full too)."""
        if not names or self.closed:
            return False
        with self._lock:
            if full and self._full_in_flight:
                return False
            if full:
                self._full_in_flight = True
        threading.Thread(target=self._run, args=(tuple(names), full, self._clock()), daemon=True,
                         name="omni-node-read").start()
        return True

    def _run(self, names: tuple[str, ...], full: bool, asked_at: float) -> None:
        state = step = ""
        try:
            if full and self._step_id is not None:
                step = self._step_id()
                if step:
                    self._step_id = None   # a step keeps its id
            if full and self._job_state is not None:
                state = self._job_state()
            nodes = tuple(self._read(names))
        except (SlurmError, OSError) as e:
            log.warning("supervisor: couldn't read node states: %s", e)
            nodes = None
        finally:
            if full:
                with self._lock:
                    self._full_in_flight = False
        if nodes is not None and not self.closed:
            self._answers.put(NodeAnswer(nodes, asked_at, self._clock(), full, state, step))

    def ask_job(self, names: Sequence[str], failed: Callable[[Sequence[str]], Sequence[Node]]) -> bool:
        """Start a read of the job's state and of which of ``names`` failed (``failed``:
        ``AllocationView.failed_among``), asked now: at srun's report of a
        task's exit, so that what the relaunch needs (the job still running: a task may exit because
        the job was cancelled; a node lost: a task may exit because a peer's node went down before
        srun says so) is answered or under way when the rule confirms, instead of asked then (issue
        19: decide's ``squeue`` at 512 nodes). False when there is no ``job_state``, or one is still
        in flight."""
        if self._job_state is None or self.closed:
            return False
        with self._lock:
            if self._job_read is not None and not self._job_read.done.is_set():
                return False
            read = self._job_read = _JobRead(self._clock())
        threading.Thread(target=read.run, args=(self._job_state, failed, tuple(names)), daemon=True,
                         name="omni-job-read").start()
        return True

    def job_since(self, at: float, timeout_s: float) -> tuple[str, list[Node]] | None:
        """The job's state and the failed nodes from the read :meth:`ask_job` started at or after ``at``,
        waiting up to ``timeout_s`` for it to answer; None when none was asked since, it failed, or it
        is late."""
        read = self._job_read
        if read is None or read.asked_at < at or not read.done.wait(timeout_s) or read.answer is None:
            return None
        return read.answer

    def answers(self) -> list[NodeAnswer]:
        """The answers that came since the last call, in the order they came."""
        return drain_queue(self._answers)

    def close(self) -> None:
        """Answers still to come are dropped (the launch they were asked for is over)."""
        self.closed = True


class _JobRead:
    """One read of the job's state and its failed nodes, the two commands side by side, and its
    answer once both came."""

    def __init__(self, asked_at: float) -> None:
        self.asked_at = asked_at
        self.answer: tuple[str, list[Node]] | None = None
        self.done = threading.Event()

    def run(self, job_state: Callable[[], str], read: Callable[[Sequence[str]], Sequence[Node]],
            names: tuple[str, ...]) -> None:
        state, failed = read_job_and_failed(job_state, read, names)
        if state and failed is not None:
            self.answer = state, failed
        self.done.set()


def read_job_and_failed(job_state: Callable[[], str], read: Callable[[Sequence[str]], Sequence[Node]],
                        names: Sequence[str]) -> tuple[str | None, list[Node] | None]:
    """The job's state (``job_state``) and which of ``names`` failed (``read``), the two commands side
    by side (right after a failure slurmctld answers slowly); None for a command that failed, which
    says why in a warning."""
    failed: list[Node] | None = None

    def read_failed() -> None:
        nonlocal failed
        try:
            failed = list(read(names))
        except (SlurmError, OSError) as e:
            log.warning("supervisor: couldn't read which nodes failed: %s", e)

    beside = threading.Thread(target=read_failed, daemon=True, name="omni-job-read")
    beside.start()
    state: str | None
    try:
        state = job_state()
    except (SlurmError, OSError) as e:
        log.warning("supervisor: couldn't read the job's state: %s", e)
        state = None
    beside.join()
    return state, failed
