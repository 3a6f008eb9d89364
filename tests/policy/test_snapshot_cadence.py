"""The snapshot cadence: the fewest steps between snapshots that keep their blocking under 1 %."""

from __future__ import annotations

import pytest

from slurm_omni.policy.snapshot_cadence import blocked_share, snapshot_every


@pytest.mark.parametrize(("blocking_s", "step_s", "every"), [
    (0.0, 6.0, 1),        # nothing blocks: every step
    (0.06, 6.0, 1),       # exactly 1 % of a step
    (0.061, 6.0, 2),      # just over: every other step
    (0.35, 6.0, 6),       # 0.35 s of 6 s: 5.8 % -> 6 steps
    (0.2, 0.5, 40),       # a short step: 0.2 s is 40 % of it
])
def test_every_k_steps_keeps_the_blocking_under_one_percent(blocking_s: float, step_s: float, every: int) -> None:
    assert snapshot_every(blocking_s, step_s) == every
    assert blocked_share(blocking_s, step_s, every) <= 0.01 + 1e-12
    if every > 1:   # and no fewer steps would
        assert blocked_share(blocking_s, step_s, every - 1) > 0.01


def test_another_budget() -> None:
    assert snapshot_every(0.35, 6.0, budget=0.05) == 2


@pytest.mark.parametrize(("blocking_s", "step_s", "budget"), [(0.1, 0.0, 0.01), (0.1, 1.0, 0.0), (-1.0, 1.0, 0.01),
                                                              (float("nan"), 1.0, 0.01)])
def test_nonsense_is_refused(blocking_s: float, step_s: float, budget: float) -> None:
    with pytest.raises(ValueError, match="snapshot cadence"):
        snapshot_every(blocking_s, step_s, budget=budget)
