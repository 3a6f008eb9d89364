"""How often the host snapshot may be taken: the fewest steps between two snapshots that keep the time
training waits for them under a budget (1 % of a step by default). Pure: the caller passes what it
measured (the snapshot's blocking time and the step time)."""

from __future__ import annotations

import math
from dataclasses import dataclass

BUDGET = 0.01
"""The share of training time the snapshots may block (issue 22: under 1 % of a step)."""


def snapshot_every(blocking_s: float, step_s: float, *, budget: float = BUDGET) -> int:
    """The smallest k >= 1 with ``blocking_s / (k * step_s) <= budget``: a snapshot every k steps then
    blocks at most ``budget`` of the training time. Raises ValueError for a step time or budget that is
    not positive, or a negative blocking time."""
    if not step_s > 0 or not budget > 0 or blocking_s < 0 or math.isnan(blocking_s):
        raise ValueError(f"snapshot cadence: blocking {blocking_s} s, step {step_s} s, budget {budget} "
                         f"(a positive step and budget, a blocking time of 0 or more)")
    k = math.ceil(blocking_s / (budget * step_s) - 1e-9)
    return max(1, k)


def blocked_share(blocking_s: float, step_s: float, every: int) -> float:
    """The share of training time a snapshot every ``every`` steps blocks."""
    if every < 1 or not step_s > 0:
        raise ValueError(f"snapshot cadence: every {every} steps of {step_s} s (positive)")
    return blocking_s / (every * step_s)


@dataclass(frozen=True, slots=True)
class Cadence:
    """With the memory tier: a snapshot into memory every ``memory_every`` steps, and every
    ``files_every``-th of them (every ``memory_every * files_every`` steps) to the file system too;
    ``files_every`` 0: the file system only on a stop signal and at the last step."""

    memory_every: int
    files_every: int
    why: str = ""
    """How ``files_every`` was chosen (printed once per life)."""

    @property
    def files_every_steps(self) -> int:
        return self.memory_every * self.files_every

    def kind(self, step: int) -> str | None:
        """What step ``step`` saves: ``"files"``, ``"memory"`` or None (nothing). Every rank gets the
        same answer from the step alone."""
        if self.files_every and step % self.files_every_steps == 0:
            return "files"
        return "memory" if step % self.memory_every == 0 else None


def plan_cadence(*, snapshot_s: float, step_s: float, files_persist_s: float, every_steps: int,
                 memory_every: int = 0, files_every: int = 0, files_every_s: float = 0.0,
                 budget: float = BUDGET, mtbf_s: float = 0.0) -> Cadence:
    """How often to snapshot into memory and how often to the file system, from what a run measured
    (``snapshot_s``: the host copy a snapshot blocks; ``step_s``: a step; ``files_persist_s``: a file
    system checkpoint's background write and commit) and the job's settings (0: not set).

    - memory every k steps: ``memory_every``, else the smallest k that keeps the snapshots' blocking
      under ``budget`` (:func:`snapshot_every`), but never fewer snapshots than the job takes without
      the tier (k <= ``every_steps`` where that is set: it accepted that blocking already); where the
      time between interruptions is known (``mtbf_s`` > 0), k is at least Young/Daly's optimum
      sqrt(2 x snapshot x mtbf) / step: snapshots more often than that block more than they save;
    - the file system every m-th of those: ``files_every``; else every ``files_every_s`` seconds
      (m = ceil(seconds / (k x step))); else every ``every_steps`` steps as without the tier (m =
      ceil(every_steps / k); ``every_steps`` 0: never but on a stop signal and at the end). Unless the
      job set m, m is raised until the wait a file system write causes and the snapshots together stay
      under ``budget``. Memory snapshots go on while a file system write is in flight (the engine's
      two lanes), so only the next file system step waits for it: ``files_persist_s - m x k x step``
      when positive, once per m snapshots. Where the snapshots alone use the budget up, m is left as set.

    Raises ValueError for a value out of range (the caller turns it into one line)."""
    for name, value in (("snapshot_s", snapshot_s), ("files_persist_s", files_persist_s),
                        ("files_every_s", files_every_s), ("mtbf_s", mtbf_s)):
        if not value >= 0 or math.isinf(value):
            raise ValueError(f"snapshot cadence: {name} = {value} (a finite number, 0 or more)")
    if not step_s > 0 or math.isinf(step_s) or not budget > 0:
        raise ValueError(f"snapshot cadence: step {step_s} s, budget {budget} (positive)")
    if every_steps < 0 or memory_every < 0 or files_every < 0:
        raise ValueError(f"snapshot cadence: every_steps {every_steps}, memory_every {memory_every}, "
                         f"files_every {files_every} (0 or more)")
    if files_every and files_every_s:
        raise ValueError(f"snapshot cadence: files_every {files_every} and files_every_s {files_every_s}: "
                         f"set one of them")
    k = memory_every or snapshot_every(snapshot_s, step_s, budget=budget)
    if not memory_every and mtbf_s:
        k = max(k, round(math.sqrt(2 * snapshot_s * mtbf_s) / step_s))
    if not memory_every and every_steps:
        k = min(k, every_steps)
    if files_every:
        return Cadence(k, files_every, "set by the job")
    if files_every_s:
        m, why = max(1, math.ceil(files_every_s / (k * step_s) - 1e-9)), f"every {files_every_s:g} s"
    elif every_steps:
        m, why = max(1, math.ceil(every_steps / k - 1e-9)), f"every_steps = {every_steps}"
    else:
        return Cadence(k, 0, "every_steps = 0")
    room = budget * k * step_s - snapshot_s   # what one memory snapshot leaves of its share of the budget
    if files_persist_s > m * k * step_s and room > 0:
        # m snapshots leave m x room for the wait files_persist_s - m x k x step
        need = math.ceil(files_persist_s / (k * step_s + room) - 1e-9)
        if need > m:
            m = need
            why = f"a {files_persist_s:.2f} s file system write every {need * k} steps stays under {budget:.0%} " \
                  "with the snapshots"
    return Cadence(k, m, why)
