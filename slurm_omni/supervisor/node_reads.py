"""Slurm's node states read beside the supervisor's watch, not inside it (issue 19).

A ``scontrol show node`` of a loaded slurmctld answered in 8-12 s at 512 emulated nodes (load
540-980): read in the watch loop, it held srun's reports, the heartbeats and the confirmation rule
for that long, and the node loss was confirmed when the answer came, whatever else had arrived in the
meantime. Here each read runs in a thread of its own; the loop asks, goes on, and takes the answers
as they come (:meth:`NodeReads.answers`). At most one read of every node of the launch is in flight
(the 3 s poll does not pile up behind a slow slurmctld); a read of the nodes srun just reported
failed starts at once, beside it."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slurm_omni.errors import SlurmError
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


class NodeReads:
    """Reads of node states in daemon threads (a supervisor that exits does not wait for a slurmctld
    that does not answer). ``read`` runs the command (``AllocationView.node_info``'s nodes); ``clock``
    dates the answers in the supervisor's clock."""

    def __init__(self, read: Callable[[Sequence[str]], Sequence[Node]], clock: Callable[[], float]) -> None:
        self._read = read
        self._clock = clock
        self._answers: queue.SimpleQueue[NodeAnswer] = queue.SimpleQueue()
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
        try:
            nodes = tuple(self._read(names))
        except (SlurmError, OSError) as e:
            log.warning("supervisor: couldn't read node states: %s", e)
            nodes = None
        finally:
            if full:
                with self._lock:
                    self._full_in_flight = False
        if nodes is not None and not self.closed:
            self._answers.put(NodeAnswer(nodes, asked_at, self._clock(), full))

    def answers(self) -> list[NodeAnswer]:
        """The answers that came since the last call, in the order they came."""
        out = []
        while True:
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Answers still to come are dropped (the launch they were asked for is over)."""
        self.closed = True
