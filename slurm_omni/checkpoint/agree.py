"""Restore agreement: every rank resumes from the same step.

A step counts only when every rank's shards of it verify. Each rank loads the newest step at or
below a bound that verifies for *its* units (a corrupt one is marked CORRUPT and the previous one is
tried, locally); then the ranks take the minimum over all of them. When the ranks differ, the bound
becomes that minimum and the ranks above it load again, until all hold the same step. A rank that
cannot restore anything makes every rank raise, so that no rank waits for a collective the others
left. ``reduce_min`` is the one collective (an ``all_reduce`` with ``MIN`` over the job's ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from slurm_omni.checkpoint.format import CheckpointCorrupt
from slurm_omni.errors import CheckpointError

log = logging.getLogger(__name__)

T = TypeVar("T")

NOTHING = -1
"""This rank found no complete checkpoint at or below the bound (a fresh start)."""
FAILED = -2
"""This rank could not restore any checkpoint it was offered."""
_NO_RANK = 1 << 62


class Loaded(Generic[T]):
    """What one rank restored: the step and the caller's result (None: nothing to restore)."""

    __slots__ = ("fallbacks", "result", "step")

    def __init__(self, step: int, result: T | None, fallbacks: tuple[str, ...] = ()) -> None:
        self.step = step
        self.result = result
        self.fallbacks = fallbacks
        """Why this rank passed over newer checkpoints (each names the step and the shard)."""


def load_newest_sound(load: Callable[[int | None], Loaded[T] | None], bound: int | None,
                      problems: list[str]) -> Loaded[T]:
    """``load(bound)`` again below each step whose streaming units turn out corrupt (the reader
    marked it CORRUPT); ``problems`` collects each reason, naming the shard."""
    while True:
        try:
            got = load(bound)
            if got is not None:
                problems += got.fallbacks
        except CheckpointCorrupt as e:
            problems.append(str(e))
            step = _step_of(str(e))
            if step is None:
                raise
            bound = step - 1
            continue
        return got if got is not None else Loaded(NOTHING, None)


def restore_agreed(load: Callable[[int | None], Loaded[T] | None], reduce_min: Callable[[int], int], *,
                   rank: int = 0) -> T | None:
    """The result of ``load`` at the step every rank restored (None: every rank starts fresh).

    ``load(bound)`` restores the newest complete checkpoint at or below ``bound`` (None: no bound)
    that verifies for this rank, falling back by itself on corruption it finds before returning."""
    problems: list[str] = []
    bound: int | None = None
    mine: Loaded[T] | None = None
    error: CheckpointError | None = None
    rounds = 0
    while True:
        if mine is None or (bound is not None and mine.step > bound):
            try:
                mine = load_newest_sound(load, bound, problems)
            except CheckpointError as e:
                error, mine = e, Loaded(FAILED, None)
        low = reduce_min(mine.step)
        high = -reduce_min(-mine.step)
        rounds += 1
        if low == FAILED:
            if error is not None:
                raise error
            raise CheckpointError(f"checkpoint: couldn't restore: another rank found no checkpoint that verifies "
                                  f"(this rank had step-{mine.step})")
        if low == high:
            break
        bound = low
    # One message for the job: the lowest rank that found damage says what and where every rank resumes.
    reporter = reduce_min(rank if problems else _NO_RANK)
    if problems and reporter == rank:
        log.warning("checkpoint: rank %d: %s; every rank restores %s", rank, problems[0],
                    f"step-{low}" if low >= 0 else "nothing (a fresh start)")
    elif rounds > 1:
        log.info("checkpoint: rank %d restores step-%d, the newest step every rank's shards verify", rank, low)
    return mine.result


def _step_of(message: str) -> int | None:
    """The step a reader's CheckpointCorrupt names (``checkpoint: step-N: ...``)."""
    head = message.removeprefix("checkpoint: ")
    if not head.startswith("step-"):
        return None
    digits = head[len("step-"):].split(":", 1)[0].split()[0]
    return int(digits) if digits.isdigit() else None
