"""Pool allocations that grow a shrunk job back, the first node recovered inside, and successor
allocations ahead of a time limit (issue 20): hand-computed scenarios on a small run with fixed
waits (sigma 0), and the command's sweep."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.goodput.failures import Interruption, interruption_trace, limit_draws
from bench.goodput.inputs import AllocConfig, RunConfig, SimConfig, load_config
from bench.goodput.models import PolicyCosts, in_allocation, scale, successor_lead
from bench.goodput.run import Summary, main, run_spares, target_gap, traces
from bench.goodput.sim import BUCKETS, simulate
from slurm_omni.errors import OmniError
from slurm_omni.policy.pools import successor_lead_s

KINDS = ("node_down", "task_crash", "hang")
# 4 nodes, dp 4 (one node per replica), one hour
SMALL = RunConfig(gpus=32, gpus_per_node=8, tensor_parallel=8, pipeline_parallel=1, days=1 / 24,
                  interruptions=1, spare_nodes=0, repair_s=1e9)


def pooled(spares: int = 0, **kw: object) -> PolicyCosts:
    """Detection 100 s, relaunch 20 s (restore inside it), a checkpoint every 300 s at no cost, every
    wait in the queue 600 s, the first node recovered inside, pools on."""
    base: dict[str, object] = {
        "name": "p", "detect_base": dict.fromkeys(KINDS, 100.0), "resubmit_s": 10.0, "start_s": 40.0,
        "restore_s": 40.0, "first_step_s": 10.0, "ckpt_interval_s": 300.0, "ckpt_blocking_s": 0.0,
        "queue_median_s": 600.0, "spares": spares, "relaunch_s": 20.0, "min_replicas": 2, "pools": True}
    base.update(kw)
    return PolicyCosts(**base)  # type: ignore[arg-type]


def lost_node(t: float, *, pool_draw: float = 0.5, host_draw: float = 0.5) -> Interruption:
    return Interruption(t, "Faulty GPU", "task_crash", True, 0.5, 0.5, pool_draw, host_draw)


def test_a_pool_grows_the_shrunk_job_back_with_one_relaunch() -> None:
    # no spare: the loss at 1000 (100 s since the checkpoint at 900 lost) drops a replica, the pool
    # of the one missing node is asked for at 1100 and starts at 1700; the job trains at 3/4 from 1120,
    # grows back by a 20 s relaunch, and trains full from 1720. The pool's node waits idle for 20 s.
    out = simulate(pooled(), SMALL, [lost_node(1000)])
    assert (out.shrinks, out.pools, out.grows, out.resubmits, out.relaunches) == (1, 1, 1, 0, 1)
    assert out.seconds["shrunk"] == pytest.approx((1700 - 1120) / 4)
    assert out.seconds["grow"] == pytest.approx(20)
    assert out.seconds["recompute"] == pytest.approx(100) and out.seconds["queue"] == 0
    assert out.seconds["productive"] == pytest.approx(900 + (1700 - 1120) * 3 / 4 + (3600 - 1720))
    assert out.spare_s == pytest.approx(20 / 4)
    assert sum(out.seconds.values()) == pytest.approx(3600)


def test_without_pools_the_job_stays_shrunk() -> None:
    out = simulate(pooled(pools=False), SMALL, [lost_node(1000)])
    assert (out.shrinks, out.pools, out.grows) == (1, 0, 0)
    assert out.seconds["shrunk"] == pytest.approx((3600 - 1120) / 4)


def test_a_pool_slower_than_the_next_failure_asks_again_and_grows_when_it_starts() -> None:
    # the pool asked for at 1100 starts at 3100; the loss at 1500 (80 s after the checkpoint at
    # 1420) shrinks again to 2 and asks for one more node, whose pool would start at 3600 (never).
    out = simulate(pooled(queue_median_s=2000.0), SMALL, [lost_node(1000), lost_node(1500)])
    assert (out.shrinks, out.pools, out.grows, out.resubmits) == (2, 2, 1, 0)
    # 1120-1500 at 3/4 (380 s), 1620-3100 at 2/4, 3120-3600 at 3/4 again
    assert out.seconds["shrunk"] == pytest.approx(380 / 4 + 1480 / 2 + 480 / 4)
    assert out.seconds["recompute"] == pytest.approx(100 + 80 * 3 / 4)
    assert out.seconds["grow"] == pytest.approx(20)
    assert sum(out.seconds.values()) == pytest.approx(3600)


def test_a_pool_waits_no_longer_than_the_failed_node_takes_to_come_back() -> None:
    p = pooled(queue_median_s=5000.0, repair_s=700.0)
    assert p.pool_wait_s(0.5) == pytest.approx(700) and pooled().pool_wait_s(0.5) == pytest.approx(600)
    out = simulate(p, SMALL, [lost_node(1000)])
    assert out.grows == 1 and out.seconds["shrunk"] == pytest.approx((1800 - 1120) / 4)


def test_a_pool_brings_the_spares_back_too() -> None:
    # one spare: the first loss takes it (no pool: the job is not shrunk); the second drops a
    # replica and asks for 2 nodes at 2100 (one for the replica, one spare), which start at 2700.
    # Idle: the spare 0-1100, both pool nodes during the 20 s grow, the new spare 2720-3600.
    out = simulate(pooled(1), SMALL, [lost_node(1000), lost_node(2000)])
    assert (out.shrinks, out.pools, out.grows) == (1, 1, 1)
    assert out.spare_s == pytest.approx((1100 + 2 * 20 + 880) / 4)
    assert out.seconds["shrunk"] == pytest.approx((2700 - 2120) / 4)


def test_the_first_node_ends_the_allocation_only_with_a_batch_host() -> None:
    # 4 nodes held: a lost node is the batch host when host_draw x 4 < 1
    host = lost_node(1000, host_draw=0.1)
    today = simulate(pooled(pools=False, batch_host=True), SMALL, [host])
    assert (today.host_losses, today.resubmits, today.relaunches) == (1, 1, 0)
    assert today.seconds["queue"] == pytest.approx(600)
    outside = simulate(pooled(), SMALL, [host])
    assert (outside.host_losses, outside.resubmits, outside.relaunches) == (0, 0, 1)
    other = simulate(pooled(pools=False, batch_host=True), SMALL, [lost_node(1000, host_draw=0.9)])
    assert (other.host_losses, other.resubmits) == (0, 0)


def test_zero_spares_without_events_is_the_whole_hour() -> None:
    out = simulate(pooled(), SMALL, [])
    assert out.seconds["productive"] == pytest.approx(3600) and out.ettr == pytest.approx(1.0)
    assert (out.pools, out.grows, out.spare_s) == (0, 0, 0)


def test_at_the_time_limit_the_job_is_resubmitted_and_waits_in_the_queue() -> None:
    # limit 1000 s: at 1000 resubmit (10) and wait (600), the new allocation begins at 1610 and the
    # job trains from 1700 (start + restore + step 90); the same at 2610; the third limit is past the end.
    out = simulate(pooled(time_limit_s=1000.0), SMALL, [])
    assert out.handovers == 2
    assert out.seconds["queue"] == pytest.approx(1200) and out.seconds["handover"] == pytest.approx(200)
    assert out.seconds["productive"] == pytest.approx(1000 + 910 + 290)


def test_a_successor_asked_for_ahead_hides_its_queue_wait() -> None:
    # lead 700: asked for at 300, it starts at 900 and the job hands over at once (90 s); then every
    # 900 s. No queue wait.
    out = simulate(pooled(time_limit_s=1000.0, successor_lead_s=700.0), SMALL, [])
    assert out.handovers == 3 and out.seconds["queue"] == 0
    assert out.seconds["handover"] == pytest.approx(270)
    assert out.seconds["productive"] == pytest.approx(900 + 810 * 3)


def test_a_successor_that_starts_after_the_limit_costs_the_rest_of_its_wait() -> None:
    # lead 300: asked for at 700, it starts at 1300; the job stops at 1000 and waits 300 s
    out = simulate(pooled(time_limit_s=1000.0, successor_lead_s=300.0), SMALL, [])
    assert out.handovers == 2
    assert out.seconds["queue"] == pytest.approx(600) and out.seconds["handover"] == pytest.approx(180)
    assert out.seconds["productive"] == pytest.approx(1000 + 910 + 910)


def test_the_time_limit_draws_are_used_in_order() -> None:
    p = pooled(time_limit_s=1000.0, queue_sigma=1.0)
    short, long_ = p.queue_s(0.1), p.queue_s(0.9)
    out = simulate(p, dataclasses.replace(SMALL, days=3 / 24), [], limit_draws=[0.1, 0.9])
    assert out.handovers > 2   # the draws run out: the median (600 s) after them
    assert out.seconds["queue"] == pytest.approx(short + long_ + 600 * (out.handovers - 2))


def test_a_lead_as_long_as_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="successor_lead_s"):
        pooled(time_limit_s=1000.0, successor_lead_s=1000.0)


def test_the_new_draws_have_streams_of_their_own() -> None:
    trace = interruption_trace(wall_s=86400, expected=20, seed=5)
    for field in ("pool_draw", "host_draw"):
        draws = [getattr(e, field) for e in trace]
        assert all(0 <= d < 1 for d in draws) and len(set(draws)) == len(draws)
        assert draws != [e.draw for e in trace] and draws != [e.queue_draw for e in trace]
    assert limit_draws(5, 4) == limit_draws(5, 4) != limit_draws(6, 4)


def test_pools_beat_the_same_spares_without_them_and_results_repeat() -> None:
    cfg = dataclasses.replace(SimConfig(), alloc=AllocConfig(spares_per_100=(0.0, 1.0)))
    scaled = scale(cfg)
    events = traces(cfg, runs=2, seed=11)
    today = run_spares(cfg, scaled, runs=2, seed=11, events=events)
    pools = run_spares(cfg, scaled, runs=2, seed=11, events=events, pools=True)
    again = run_spares(cfg, scaled, runs=2, seed=11, events=events, pools=True)
    assert [r.summary for r in pools] == [r.summary for r in again]
    for d, e in zip(today, pools, strict=True):
        assert e.summary.ettr_mean > d.summary.ettr_mean
        assert e.summary.hours["shrunk"] < d.summary.hours["shrunk"]
        assert e.summary.host_losses == 0 and e.summary.resubmits == 0
    assert in_allocation(cfg, scaled.omni, 1.0, pools=True).batch_host is False
    assert in_allocation(cfg, scaled.omni, 1.0).batch_host is True
    relaunch = scaled.figures["relaunch_s"]                              # the supervisor's own lead policy
    assert successor_lead(cfg, relaunch) == pytest.approx(successor_lead_s(3600.0, relaunch))
    assert successor_lead(cfg, relaunch) == pytest.approx(1.5 * 3600 + relaunch)
    assert in_allocation(cfg, scaled.omni, 1.0, pools=True, time_limit=True).successor_lead_s == \
        pytest.approx(successor_lead(cfg, relaunch))


def test_cli_prints_pools_badput_time_limit_and_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "sim.toml"
    cfg.write_text("[alloc]\nspares_per_100 = [0.0, 1.0]\ntime_limit_h = 12.0\n")
    out_json = tmp_path / "out.json"
    assert main(["--runs", "2", "--config", str(cfg), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "a model" in text and "(e) pools, 1 spares/100 nodes" in text
    assert "where the remaining time goes" in text and "WASTED_PROGRESS_FROM_DISRUPTION" in text
    assert "at a time limit of 12 h" in text and "successor requested" in text
    assert f"alloc.time_limit_h           = 12             config {cfg}" in text
    assert "run.repair_s" in text and "assumption" in text
    payload = json.loads(out_json.read_text())
    assert {r["pools"] for r in payload["in_allocation"]} == {False, True}
    assert payload["time_limit"][0]["next_allocation"] == "resubmit at the limit (today)"
    assert "queue wait (not in the library: outside any allocation)" in payload["in_allocation"][0]["badput_hours"]


def test_a_negative_time_limit_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "sim.toml"
    f.write_text("[alloc]\ntime_limit_h = -1\n")
    with pytest.raises(OmniError, match="time_limit_h = -1"):
        load_config(f)


def test_the_gap_to_the_target_names_the_largest_causes() -> None:
    hours = dict.fromkeys(BUCKETS, 0.0)
    hours.update(productive=90.0, queue=6.0, restore=2.0, shrunk=1.0, checkpoint=0.5)
    s = Summary("p", 0.9, 0.9, 0.9, hours, 1, 0, 0, 0, spare_hours=0.5)
    # paid 100 h, lost 10 h, 3 h allowed
    assert target_gap(s) == ("misses the 97% target by 7.0 h (10.0 h lost of 100 h paid): it would take cutting "
                             "queue wait (6.0 h), checkpoint restore (2.0 h), running shrunk (1.0 h) by that much together")
    hours.update(productive=98.0, queue=0.0, restore=0.0, shrunk=1.0)
    assert target_gap(dataclasses.replace(s, hours=hours)).startswith("meets the 97% target: 2.0 h lost")
