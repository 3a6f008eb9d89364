"""The snapshot cadence: the fewest steps between snapshots that keep their blocking under 1 %."""

from __future__ import annotations

import pytest

from slurm_omni.policy.snapshot_cadence import blocked_share, plan_cadence, snapshot_every


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


# -- the memory tier's two cadences (plan_cadence): memory every k steps, the file system every m-th --


def test_memory_every_k_and_the_file_system_about_as_often_as_without_the_tier() -> None:
    # 0.004 s of a 0.52 s step: memory every step; every_steps = 10 -> files every 10th snapshot
    c = plan_cadence(snapshot_s=0.004, step_s=0.52, files_persist_s=0.3, every_steps=10)
    assert (c.memory_every, c.files_every, c.files_every_steps) == (1, 10, 10)
    assert [c.kind(s) for s in (1, 9, 10, 20)] == ["memory", "memory", "files", "files"]
    # a costlier snapshot: memory every 4 steps; files every 3rd snapshot (12 steps >= every_steps 10)
    c = plan_cadence(snapshot_s=0.02, step_s=0.52, files_persist_s=0.3, every_steps=10)
    assert (c.memory_every, c.files_every) == (4, 3)
    assert [c.kind(s) for s in (1, 4, 8, 12, 13, 24)] == [None, "memory", "memory", "files", None, "files"]


def test_a_file_system_write_longer_than_its_interval_is_made_rarer() -> None:
    # memory snapshots go on while a file system write is in flight (the engine's two lanes): only the
    # next file system step waits for it. A 30 s write every 10 steps of 1 s makes it wait 20 s; with a
    # 0.002 s snapshot every step that stays under 1 % once m snapshots nearly cover the write
    c = plan_cadence(snapshot_s=0.002, step_s=1.0, files_persist_s=30.0, every_steps=10)
    assert c.memory_every == 1

    def share(m: int) -> float:
        return (m * 0.002 + max(0.0, 30.0 - m * 1.0)) / (m * 1.0)

    m = c.files_every
    assert share(m) <= 0.01 + 1e-12 < share(m - 1)
    assert m == 30 and "file system write" in c.why   # one persist at a time needed m = 3,625
    # a write that ends within the file system interval blocks nothing: every_steps stands
    assert plan_cadence(snapshot_s=0.002, step_s=1.0, files_persist_s=9.9, every_steps=10).files_every == 10


def test_the_jobs_settings_win() -> None:
    c = plan_cadence(snapshot_s=0.5, step_s=1.0, files_persist_s=30.0, every_steps=10, memory_every=2,
                     files_every=5)
    assert (c.memory_every, c.files_every, c.why) == (2, 5, "set by the job")
    # every N seconds: 60 s of 0.5 s steps, memory every 2 steps -> every 60th snapshot
    c = plan_cadence(snapshot_s=0.001, step_s=0.5, files_persist_s=0.1, every_steps=10, memory_every=2,
                     files_every_s=60)
    assert (c.memory_every, c.files_every, c.files_every_steps) == (2, 60, 120)
    # every_steps = 0: the file system only on a stop signal and at the end
    c = plan_cadence(snapshot_s=0.001, step_s=0.5, files_persist_s=0.1, every_steps=0)
    assert c.files_every == 0 and [c.kind(s) for s in (1, 100)] == ["memory", "memory"]


@pytest.mark.parametrize("bad", [{"snapshot_s": -1.0}, {"step_s": 0.0}, {"files_persist_s": float("nan")},
                                 {"every_steps": -1}, {"memory_every": -2}, {"files_every": 2, "files_every_s": 9.0},
                                 {"files_every_s": float("inf")}])
def test_nonsense_cadence_inputs_are_refused(bad: dict[str, float]) -> None:
    given = {"snapshot_s": 0.01, "step_s": 1.0, "files_persist_s": 1.0, "every_steps": 10} | bad
    with pytest.raises(ValueError, match="snapshot cadence"):
        plan_cadence(**given)  # type: ignore[arg-type]


def test_never_fewer_snapshots_than_without_the_tier() -> None:
    # a snapshot that blocks 40 % of a short step: 40 steps under 1 %, but the job checkpointed every 5
    # steps without the tier (it accepted that blocking): memory every 5, each also to the file system
    c = plan_cadence(snapshot_s=0.04, step_s=0.1, files_persist_s=0.8, every_steps=5)
    assert (c.memory_every, c.files_every, c.files_every_steps) == (5, 1, 5)
    # without a file system cadence (every_steps = 0) the budget alone decides
    assert plan_cadence(snapshot_s=0.04, step_s=0.1, files_persist_s=0.8, every_steps=0).memory_every == 40


def test_a_known_time_between_interruptions_takes_young_dalys_interval_at_least() -> None:
    # 0.014 s of a 6 s step fits the budget every step, but with an interruption every 3 h a snapshot
    # every sqrt(2 x 0.014 x 11124) = 17.6 s (3 steps) loses less to blocking than it costs in lost work
    c = plan_cadence(snapshot_s=0.014, step_s=6.0, files_persist_s=2.8, every_steps=10, mtbf_s=11124.0)
    assert c.memory_every == 3 and c.files_every == 4
    assert plan_cadence(snapshot_s=0.014, step_s=6.0, files_persist_s=2.8, every_steps=10).memory_every == 1
    # never past every_steps, and the job's own k wins
    assert plan_cadence(snapshot_s=0.5, step_s=1.0, files_persist_s=0.1, every_steps=10, mtbf_s=1e6).memory_every == 10
    assert plan_cadence(snapshot_s=0.014, step_s=6.0, files_persist_s=2.8, every_steps=10, mtbf_s=11124.0,
                        memory_every=1).memory_every == 1
