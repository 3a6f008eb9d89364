"""The memory tier in the goodput model (issue 22): its cadence is the runtime's policy, a relaunch
loses only the work since the last memory snapshot and restores from memory, a new allocation goes back
to the file system's newest checkpoint; the command prints every pool row with and without it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bench.goodput.failures import Interruption
from bench.goodput.inputs import AllocConfig, MemoryConfig, RunConfig, SimConfig
from bench.goodput.models import PolicyCosts, in_allocation, memory_tier, scale
from bench.goodput.run import main, run_spares, traces
from bench.goodput.sim import simulate
from slurm_omni.errors import OmniError
from slurm_omni.policy.snapshot_cadence import plan_cadence

KINDS = ("node_down", "task_crash", "hang")
SMALL = RunConfig(gpus=32, gpus_per_node=8, tensor_parallel=8, pipeline_parallel=1, days=1 / 24,
                  interruptions=1, spare_nodes=0, repair_s=1e9)


def policy(**kw: object) -> PolicyCosts:
    """Detection 100 s, relaunch 20 s, a checkpoint (here: into memory) every 100 s at no cost, no spare,
    no shrink below 4 replicas: a lost node means a new allocation (queue 600 s)."""
    base: dict[str, object] = {
        "name": "m", "detect_base": dict.fromkeys(KINDS, 100.0), "resubmit_s": 10.0, "start_s": 40.0,
        "restore_s": 40.0, "first_step_s": 10.0, "ckpt_interval_s": 100.0, "ckpt_blocking_s": 0.0,
        "queue_median_s": 600.0, "spares": 0, "relaunch_s": 20.0, "min_replicas": 4, "pools": True}
    base.update(kw)
    return PolicyCosts(**base)  # type: ignore[arg-type]


def test_a_relaunch_loses_the_work_since_the_memory_snapshot_a_new_allocation_since_the_files() -> None:
    crash = Interruption(1050, "Faulty GPU", "task_crash", False, 0.5, 0.5, 0.5, 0.5)   # same nodes: relaunch
    lost = Interruption(1050, "Faulty GPU", "task_crash", True, 0.5, 0.5, 0.5, 0.5)     # no spare: resubmit
    # memory every 100 s, files every 500 s: a relaunch loses 50 s; a new allocation has no memory
    # of the job and goes back to the file system's checkpoint at 1000 s of training... which is also
    # a memory one here; at 1250 it goes back to 1000 (250 s lost), not to 1200
    tier = policy(files_interval_s=500.0)
    assert simulate(tier, SMALL, [crash]).seconds["recompute"] == pytest.approx(50)
    assert simulate(tier, SMALL, [lost]).seconds["recompute"] == pytest.approx(50)
    late = dataclasses.replace(lost, time_s=1250)
    assert simulate(policy(), SMALL, [late]).seconds["recompute"] == pytest.approx(50)
    out = simulate(tier, SMALL, [late])
    assert out.resubmits == 1 and out.seconds["recompute"] == pytest.approx(250)
    assert sum(out.seconds.values()) == pytest.approx(3600)
    # across relaunches: the file system's cadence counts training, not the time since the relaunch
    crash_then_lost = [dataclasses.replace(crash, time_s=1250), dataclasses.replace(lost, time_s=1650)]
    out = simulate(tier, SMALL, crash_then_lost)
    # 1250: back to 1200 (50 lost), down 120 s; trains from 1370: at 1650 it holds 1200 + 200 = 1400 in
    # memory, 1000 on the file system: the new allocation loses 400 + the 80 s since the last snapshot
    assert out.relaunches == 1 and out.resubmits == 1
    assert out.seconds["recompute"] == pytest.approx(50 + 80 + 400)


def test_the_cadence_is_the_runtimes_policy_and_the_tier_beats_the_same_pools_without_it() -> None:
    cfg = dataclasses.replace(SimConfig(), alloc=AllocConfig(spares_per_100=(0.5, 1.0)))
    scaled = scale(cfg)
    tier = memory_tier(cfg, scaled.omni)
    f = scaled.figures
    want = plan_cadence(snapshot_s=f["blocking_s"], step_s=cfg.run.step_time_s, files_persist_s=f["persist_s"],
                        every_steps=-(-f["omni_ckpt_interval_s"] // cfg.run.step_time_s).__int__(),
                        mtbf_s=f["mtbf_s"])
    assert tier.cadence == want
    # Young/Daly on the memory snapshot: fewer snapshots than the 1 % budget alone would allow
    assert want.memory_every == round(math.sqrt(2 * f["blocking_s"] * f["mtbf_s"]) / cfg.run.step_time_s) > 1
    assert tier.interval_s == pytest.approx(max(want.memory_every * cfg.run.step_time_s, tier.persist_s))
    assert tier.files_interval_s == pytest.approx(want.files_every_steps * cfg.run.step_time_s)
    p = in_allocation(cfg, scaled.omni, 1.0, pools=True, memory=True)
    assert "memory tier" in p.name and p.files_interval_s == tier.files_interval_s
    assert p.relaunch_restore_s == tier.restore_s < in_allocation(cfg, scaled.omni, 1.0, pools=True,
                                                                 memory=False).relaunch_restore_s
    events = traces(cfg, runs=2, seed=5)
    without = run_spares(cfg, scaled, runs=2, seed=5, events=events, pools=True, memory=False)
    with_tier = run_spares(cfg, scaled, runs=2, seed=5, events=events, pools=True, memory=True)
    for a, b in zip(without, with_tier, strict=True):
        assert b.memory and not a.memory
        assert b.summary.hours["recompute"] < a.summary.hours["recompute"] / 2
        assert b.summary.hours["restore"] < a.summary.hours["restore"]
        assert b.summary.ettr_mean > a.summary.ettr_mean
    # the job's own settings win over the policy, as in the job file
    set_by_job = dataclasses.replace(cfg, memory=MemoryConfig(memory_every=4, files_every=3))
    assert memory_tier(set_by_job, scaled.omni).cadence.files_every_steps == 12


def test_the_command_prints_with_and_without_the_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "sim.toml"
    cfg.write_text("[alloc]\nspares_per_100 = [0.5]\n[memory]\npeer_bw = 25e9\n")
    out_json = tmp_path / "out.json"
    assert main(["--runs", "2", "--config", str(cfg), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "(e) pools, 0.5 spares/100 nodes" in text and "(e) pools + memory tier, 0.5 spares/100 nodes" in text
    assert "memory tier (models.memory_tier" in text and "work lost per interruption" in text
    assert f"memory.peer_bw               = 2.5e+10        config {cfg}" in text
    assert "memory.read_bw" in text and "measured: 2.8 GB/s" in text
    payload = json.loads(out_json.read_text())
    assert {(r["pools"], r["memory_tier"]) for r in payload["in_allocation"]} == {(False, False), (True, False),
                                                                                 (True, True)}


def test_bad_memory_settings_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(OmniError, match="memory"):
        MemoryConfig(peer_bw=0)
    cfg = tmp_path / "sim.toml"
    cfg.write_text("[memory]\nfiles_every = -1\n")
    assert main(["--runs", "1", "--config", str(cfg)]) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "files_every = -1" in err
