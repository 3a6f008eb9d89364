"""ETTR arithmetic on hand-computed scenarios, monotonicity, and the policy ordering."""

from __future__ import annotations

import dataclasses

import pytest

from bench.goodput.failures import Interruption, interruption_trace
from bench.goodput.inputs import RunConfig, SimConfig, SlurmConfig
from bench.goodput.models import PolicyCosts, scale
from bench.goodput.run import run_many, summarize
from bench.goodput.sim import BUCKETS, segment, simulate

HOUR = RunConfig(gpus=8, gpus_per_node=8, tensor_parallel=8, pipeline_parallel=1, days=1 / 24,
                 interruptions=1, spare_nodes=1, repair_s=1000.0)
KINDS = ("node_down", "task_crash", "hang")


def policy(**kw: object) -> PolicyCosts:
    base: dict[str, object] = {"name": "p", "detect_base": dict.fromkeys(KINDS, 100.0), "resubmit_s": 10.0,
                               "start_s": 40.0, "restore_s": 40.0, "first_step_s": 10.0,
                               "ckpt_interval_s": 300.0, "ckpt_blocking_s": 0.0}
    base.update(kw)
    return PolicyCosts(**base)  # type: ignore[arg-type]


def crash(t: float, *, replace: bool = False) -> Interruption:
    return Interruption(t, "Software Bug", "task_crash", replace, 0.5)


def test_one_crash_without_checkpoint_cost() -> None:
    # 0..1000 trains, checkpoints at 300/600/900 -> 100 s lost; down 100 + 100; 1200..3600 trains.
    out = simulate(policy(), HOUR, [crash(1000)])
    assert out.seconds["productive"] == pytest.approx(900 + 2400)
    assert out.seconds["recompute"] == pytest.approx(100)
    assert out.seconds["detection"] == pytest.approx(100)
    assert out.seconds["restart"] == pytest.approx(60)
    assert out.seconds["restore"] == pytest.approx(40)
    assert out.ettr == pytest.approx(3300 / 3600)
    assert sum(out.seconds.values()) == pytest.approx(3600)


def test_synchronous_checkpoint_blocks_and_counts_when_done() -> None:
    # cycle 310 s: before the crash 3 saves (30 s), 70 s lost; after it 2400 s = 7 cycles + 230 s.
    out = simulate(policy(ckpt_blocking_s=10.0), HOUR, [crash(1000)])
    assert out.seconds["checkpoint"] == pytest.approx(30 + 70)
    assert out.seconds["recompute"] == pytest.approx(70)
    assert out.seconds["productive"] == pytest.approx(900 + 2330)
    assert out.ettr == pytest.approx(3230 / 3600)


def test_async_checkpoint_counts_only_once_persisted() -> None:
    # Saves start at 300, 601, 902; the third is durable at 953: a crash at 920 loses 317 s.
    p = policy(ckpt_blocking_s=1.0, ckpt_persist_s=50.0, ckpt_async=True)
    assert segment(p, 920.0) == pytest.approx((917.0, 3.0, 600.0))
    assert segment(p, 960.0) == pytest.approx((957.0, 3.0, 900.0))
    out = simulate(p, HOUR, [crash(920)])
    assert out.seconds["recompute"] == pytest.approx(317)


def test_detection_spread() -> None:
    p = policy(detect_spread={"node_down": 90.0}, spread="uniform")
    assert p.detection_s("node_down", 0.5) == pytest.approx(145.0)
    assert p.detection_s("hang", 0.5) == pytest.approx(100.0)
    e = policy(detect_base=dict.fromkeys(KINDS, 0.0), detect_spread=dict.fromkeys(KINDS, 60.0),
               spread="exponential")
    assert e.detection_s("hang", 1 - 2.718281828459045 ** -1) == pytest.approx(60.0)


TWO_REPLICAS = dataclasses.replace(HOUR, gpus=16, spare_nodes=0)


def test_shrink_then_grow_when_the_node_returns() -> None:
    # dp 2, one node per replica, no spare: shrink to 1 replica at 1200, the node returns at
    # 2000 (repair 1000 s after the fault), grow through a planned 100 s restart, full from 2100.
    out = simulate(policy(ckpt_interval_s=500.0, shrink=True), TWO_REPLICAS, [crash(1000, replace=True)])
    assert (out.shrinks, out.grows, out.waits) == (1, 1, 0)
    assert out.seconds["shrunk"] == pytest.approx(400)
    assert out.seconds["productive"] == pytest.approx(1000 + 400 + 1500)
    assert out.seconds["restart"] + out.seconds["restore"] == pytest.approx(200)
    assert out.seconds["restore"] == pytest.approx(40)     # the fault's restart; the planned grow is all "restart"


def test_without_shrink_the_job_waits_for_the_repaired_node() -> None:
    out = simulate(policy(ckpt_interval_s=500.0), TWO_REPLICAS, [crash(1000, replace=True)])
    assert (out.shrinks, out.waits) == (0, 1)
    assert out.seconds["waiting"] == pytest.approx(900)
    assert out.seconds["productive"] == pytest.approx(1000 + 1500)
    assert sum(out.seconds.values()) == pytest.approx(3600)


def test_events_during_recovery_are_absorbed() -> None:
    out = simulate(policy(), HOUR, [crash(1000), crash(1050), crash(5000)])
    assert (out.interruptions, out.absorbed) == (1, 1)


def test_trace_is_seeded_and_poisson_like() -> None:
    a = interruption_trace(wall_s=54 * 86400, expected=419, seed=3)
    assert a == interruption_trace(wall_s=54 * 86400, expected=419, seed=3)
    counts = [len(interruption_trace(wall_s=54 * 86400, expected=419, seed=s)) for s in range(20)]
    assert 380 < sum(counts) / len(counts) < 460
    assert {e.kind for e in a} == set(KINDS)


def mean_ettr(cfg: SimConfig, runs: int = 3) -> list[float]:
    return [summarize(o).ettr_mean for o in run_many(cfg, scale(cfg), runs=runs, seed=11)]


def test_more_failures_lower_ettr() -> None:
    ettrs = [mean_ettr(dataclasses.replace(SimConfig(), run=dataclasses.replace(RunConfig(), interruptions=n)))
             for n in (100, 419, 1000)]
    for policy_index in range(3):
        column = [e[policy_index] for e in ettrs]
        assert column == sorted(column, reverse=True), column


def test_no_failures_costs_only_checkpoints() -> None:
    cfg = dataclasses.replace(SimConfig(), run=dataclasses.replace(RunConfig(), interruptions=0))
    scaled = scale(cfg)
    for p in scaled.policies:
        out = simulate(p, cfg.run, [])
        assert out.ettr == pytest.approx(p.ckpt_interval_s / (p.ckpt_interval_s + p.ckpt_blocking_s), rel=1e-3)


def test_shorter_checkpoint_interval_less_lost_work() -> None:
    lost = []
    for interval in (3600.0, 1800.0, 600.0):
        cfg = dataclasses.replace(SimConfig(), slurm=SlurmConfig(ckpt_interval_s=interval))
        outs = run_many(cfg, scale(cfg), runs=3, seed=5)[1]
        lost.append(sum(o.seconds["recompute"] for o in outs))
    assert lost == sorted(lost, reverse=True), lost
    assert lost[-1] < lost[0] / 3


def test_policy_ordering_on_defaults() -> None:
    manual, slurm, omni = mean_ettr(SimConfig(), runs=5)
    assert manual < slurm < omni
    assert set(BUCKETS) >= {"productive", "detection", "restart", "recompute", "checkpoint", "shrunk"}
