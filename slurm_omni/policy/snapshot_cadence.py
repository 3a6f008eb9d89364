"""How often the host snapshot may be taken: the fewest steps between two snapshots that keep the time
training waits for them under a budget (1 % of a step by default). Pure: the caller passes what it
measured (the snapshot's blocking time and the step time)."""

from __future__ import annotations

import math

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
