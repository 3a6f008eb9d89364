"""The step's draws: a checkpoint holds the random streams and the data position as of the step's
own draw, also for a script that draws ahead.

A script marks each draw of a batch with ``with run.timer.data():``; the run counts the draws of each
step. A script that prefetches (it draws the next step's first batch before ``end_step``, or draws
once before its loop) shows it in the first two steps of each life: the first step's count, the draw
before the loop included, exceeds the second's by the lookahead ``L``. The state at ``end_step`` is
then ``L`` draws ahead of the step: saved as it is, a resume (which draws its ``L`` batches again
before its first step) silently skips ``L`` batches. So while ``L`` may be above 0 every draw first
records the process random streams and the data objects' state (the ``state=`` objects that are
iterables: loaders, samplers), and a checkpoint takes the record of the ``L``-th last draw: exactly
what the resumed script needs before it draws again. The lookahead is saved with the checkpoint, so
a life that saves at its first step knows it too.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from slurm_omni.checkpoint import rng
from slurm_omni.elastic import statecodec

log = logging.getLogger(__name__)

MAX_AHEAD = 8
"""Draws ahead a checkpoint can still take back."""


class Draws:
    """Counts the draws of each step and records the state at the start of each draw."""

    def __init__(self) -> None:
        self.lookahead: int | None = None
        """Draws the state at ``end_step`` is ahead of the step (None: not known yet)."""
        self.data_objects: Callable[[], Mapping[str, Any]] = dict
        """The checkpointer's data objects (name -> object with ``state_dict()``)."""
        self.counts: list[int] = []
        """Draws of this life's first steps (two are enough)."""
        self.total = 0
        self.in_step = 0
        self.rng_moved = False
        """A draw moved torch's random stream: the data position is in the saved random streams."""
        self._records: deque[tuple[dict[str, Any], dict[str, Any]]] = deque(maxlen=MAX_AHEAD)
        self._torch_before: torch.Tensor | None = None

    def __call__(self, entering: bool) -> None:
        """The timer's ``on_draw``."""
        if entering:
            self.total += 1
            self.in_step += 1
            if self.lookahead is None or self.lookahead > 0:
                objects = {name: statecodec.encode(obj.state_dict(), name) for name, obj in self.data_objects().items()}
                self._records.append((rng.capture(), objects))
            if not self.rng_moved:
                self._torch_before = torch.get_rng_state()
        elif self._torch_before is not None:
            self.rng_moved = not torch.equal(self._torch_before, torch.get_rng_state())
            self._torch_before = None

    def step_done(self) -> int | None:
        """A step ended; the lookahead when this step made it known (to say so once), else None."""
        count, self.in_step = self.in_step, 0
        if self.lookahead is not None or len(self.counts) >= 2:
            return None
        self.counts.append(count)
        if len(self.counts) < 2 or self.counts[1] == 0:
            if len(self.counts) == 2:
                self.lookahead = 0
            return None
        self.lookahead = max(0, self.counts[0] - self.counts[1])
        if not self.lookahead:
            self._records.clear()
        return self.lookahead

    def resumed(self, lookahead: Any) -> None:
        """The lookahead the checkpoint recorded (None when it had none)."""
        if isinstance(lookahead, int) and 0 <= lookahead <= MAX_AHEAD and self.lookahead is None:
            self.lookahead = lookahead

    def for_save(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(random streams, encoded data objects) as of the step's own draw; (None, {}) when the state
        at ``end_step`` is the step's own (no lookahead, or not known)."""
        ahead = self.lookahead or 0
        if ahead <= 0 or len(self._records) < ahead:
            return None, {}
        return self._records[-ahead]
