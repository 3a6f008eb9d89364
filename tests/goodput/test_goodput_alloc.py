"""The queue wait every trip through the queue pays, and the in-allocation mode that pays for its
idle spares instead: hand-computed scenarios, the sweep over spares per 100 nodes, the best choice."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from bench.goodput.failures import Interruption, interruption_trace
from bench.goodput.inputs import AllocConfig, QueueConfig, RunConfig, SimConfig, load_config
from bench.goodput.models import PolicyCosts, in_allocation, scale
from bench.goodput.run import best, main, run_many, run_spares, summarize, traces
from bench.goodput.sim import simulate
from slurm_omni.errors import OmniError

KINDS = ("node_down", "task_crash", "hang")
# 4 nodes, dp 4 (one node per replica), one hour
SMALL = RunConfig(gpus=32, gpus_per_node=8, tensor_parallel=8, pipeline_parallel=1, days=1 / 24,
                  interruptions=1, spare_nodes=0, repair_s=1e9)


def policy(**kw: object) -> PolicyCosts:
    base: dict[str, object] = {"name": "p", "detect_base": dict.fromkeys(KINDS, 100.0), "resubmit_s": 10.0,
                               "start_s": 40.0, "restore_s": 40.0, "first_step_s": 10.0,
                               "ckpt_interval_s": 300.0, "ckpt_blocking_s": 0.0}
    base.update(kw)
    return PolicyCosts(**base)  # type: ignore[arg-type]


def lost_node(t: float, queue_draw: float = 0.5) -> Interruption:
    return Interruption(t, "Faulty GPU", "task_crash", True, 0.5, queue_draw)


def test_queue_wait_is_lognormal_with_the_given_median() -> None:
    p = policy(queue_median_s=600.0, queue_sigma=1.0)
    assert p.queue_s(0.5) == pytest.approx(600.0)
    z90 = 1.2815515655446004                            # the standard normal's 90th percentile
    assert p.queue_s(0.9) == pytest.approx(600.0 * math.exp(z90))
    assert p.queue_s(0.1) == pytest.approx(600.0 * math.exp(-z90))
    assert policy(queue_median_s=600.0).queue_s(0.99) == pytest.approx(600.0)   # sigma 0: always the median
    assert policy().queue_s(0.7) == 0.0


def test_a_resubmission_waits_in_the_queue() -> None:
    # down at 1000: 100 s lost work, detect 100, resubmit 10, queue 600, start + restore + step 90.
    out = simulate(policy(queue_median_s=600.0), dataclasses.replace(SMALL, spare_nodes=1), [lost_node(1000)])
    assert out.seconds["queue"] == pytest.approx(600)
    assert out.seconds["restart"] == pytest.approx(60) and out.seconds["restore"] == pytest.approx(40)
    assert out.seconds["productive"] == pytest.approx(900 + 3600 - 1000 - 800)
    assert sum(out.seconds.values()) == pytest.approx(3600)
    assert out.resubmits == 1 and out.spare_s == 0


def alloc(spares: int, **kw: object) -> PolicyCosts:
    return policy(queue_median_s=600.0, spares=spares, relaunch_s=20.0, min_replicas=3, **kw)


def test_a_spare_in_the_allocation_takes_no_trip_through_the_queue() -> None:
    # one spare idle until the loss at 1000 (detect 100, relaunch 20), none after: paid 1000 + 100
    # node-seconds, 1100 / 4 job nodes = 275 s of the job's wall
    out = simulate(alloc(1), SMALL, [lost_node(1000)])
    assert (out.relaunches, out.resubmits, out.shrinks) == (1, 0, 0)
    assert out.seconds["queue"] == 0 and out.seconds["restart"] == pytest.approx(20)
    assert out.spare_s == pytest.approx((1000 + 100) / 4)
    productive = 900 + 3600 - 1000 - 120
    assert out.seconds["productive"] == pytest.approx(productive)
    assert out.ettr == pytest.approx(productive / (3600 + 275))


def test_out_of_spares_it_shrinks_then_resubmits_full_size() -> None:
    # no spare: the first loss drops a replica (4 -> 3, min 3) inside the allocation, the second
    # goes back through the queue and comes back with all 4 replicas
    out = simulate(alloc(0), SMALL, [lost_node(1000), lost_node(2000)])
    assert (out.relaunches, out.shrinks, out.resubmits) == (1, 1, 1)
    assert out.seconds["queue"] == pytest.approx(600)
    # shrunk from 1120 to 2000: 880 s at 3/4; the lost work since the checkpoint at 1800 too
    assert out.seconds["shrunk"] == pytest.approx(880 / 4)
    assert sum(out.seconds.values()) == pytest.approx(3600)


def test_a_software_fault_relaunches_on_the_same_nodes() -> None:
    bug = Interruption(1000, "Software Bug", "task_crash", False, 0.5, 0.5)
    out = simulate(alloc(2), SMALL, [bug])
    assert (out.relaunches, out.shrinks, out.resubmits) == (1, 0, 0)
    assert out.spare_s == pytest.approx(2 * 3600 / 4)   # both spares idle the whole hour


def test_the_trace_keeps_its_events_and_draws_its_queue_waits_apart() -> None:
    trace = interruption_trace(wall_s=86400, expected=10, seed=4)
    rng = random.Random(4)
    assert trace[0].time_s == pytest.approx(rng.expovariate(10 / 86400))   # the event stream as before
    draws = [e.queue_draw for e in trace]
    assert all(0 <= d < 1 for d in draws) and len(set(draws)) == len(draws)
    assert draws != [e.draw for e in trace]


def test_spares_per_100_nodes_and_the_best_choice() -> None:
    cfg = dataclasses.replace(SimConfig(), alloc=AllocConfig(spares_per_100=(0.0, 2.0, 50.0)))
    scaled = scale(cfg)
    assert [in_allocation(cfg, scaled.omni, s).spares for s in (0.0, 2.0, 50.0)] == [0, 41, 1024]
    events = traces(cfg, runs=2, seed=7)
    rows = run_spares(cfg, scaled, runs=2, seed=7, events=events)
    summaries = [summarize(o) for o in run_many(cfg, scaled, runs=2, seed=7, events=events)]
    assert [r.per_100 for r in rows] == [0.0, 2.0, 50.0]
    by = {r.per_100: r.summary for r in rows}
    # half the job idle as spares costs more than any loss it saves; an hour's queue per loss
    # costs more than a few idle spares
    assert by[50.0].ettr_mean < by[2.0].ettr_mean
    assert by[2.0].ettr_mean > summaries[-1].ettr_mean
    # with no spare the healthy rest of a dropped replica still sits idle until it replaces a node
    assert by[50.0].spare_hours > by[2.0].spare_hours > by[0.0].spare_hours > 0
    name, top = best(summaries, rows)
    assert top.ettr_mean == max(s.ettr_mean for s in [*summaries, *by.values()]) and name == top.policy


def test_without_a_queue_the_resubmission_is_as_before() -> None:
    no_queue = dataclasses.replace(SimConfig(), queue=QueueConfig(median_s=0.0))
    events = traces(no_queue, runs=2, seed=3)
    out = run_many(no_queue, scale(no_queue), runs=2, seed=3, events=events)
    assert all(o.seconds["queue"] == 0 for per_policy in out for o in per_policy)
    queued = run_many(SimConfig(), scale(SimConfig()), runs=2, seed=3, events=events)
    for before, after in zip(out, queued, strict=True):
        assert summarize(after).ettr_mean < summarize(before).ettr_mean


def test_cli_prints_the_sweep_and_the_best_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "out.json"
    assert main(["--runs", "2", "--queue-median-s", "7200", "--queue-sigma", "0.5", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "lognormal, median 7200 s, sigma 0.5" in text
    assert "ETTR against spares per 100 nodes" in text and "best choice: " in text
    assert "queue.median_s" in text and "command line" in text
    payload = json.loads(out_json.read_text())
    assert [r["spares_per_100"] for r in payload["in_allocation"] if not r["pools"]] == list(AllocConfig().spares_per_100)
    for memory in (False, True):   # pools without and with the memory tier (issue 22)
        assert [r["spares_per_100"] for r in payload["in_allocation"]
                if r["pools"] and r["memory_tier"] == memory] == list(AllocConfig().spares_per_100)
    assert payload["best"] in {p["policy"] for p in payload["policies"] + payload["in_allocation"]}


@pytest.mark.parametrize(("table", "match"), [
    ("[queue]\nmedian_s = -1\n", "median_s = -1"),
    ("[alloc]\nspares_per_100 = [1, -2]\n", "spares_per_100"),
    ("[alloc]\nmin_dp_fraction = 0\n", "min_dp_fraction"),
])
def test_bad_queue_and_alloc_tables_are_one_line(tmp_path: Path, table: str, match: str) -> None:
    f = tmp_path / "sim.toml"
    f.write_text(table)
    with pytest.raises(OmniError, match=match):
        load_config(f)
