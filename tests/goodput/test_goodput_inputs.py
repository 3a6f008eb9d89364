"""Measured input files override the defaults, say so in the output, and bad files fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput.inputs import SimConfig, apply_ckpt, apply_drill, apply_scale, apply_timeline, load_config
from bench.goodput.models import in_allocation, scale
from bench.goodput.run import main
from slurm_omni.errors import OmniError


def write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


def test_drill_file_sets_detection_and_start(tmp_path: Path) -> None:
    f = write(tmp_path / "drill.json", {"detection_s": 3.0, "detection_by_kind": {"hang": 40.0},
                                        "resubmit_s": 1.0, "start_s": 6.0, "restore_s": 2.5, "nodes": 4})
    cfg, prov = apply_drill(SimConfig(), f)
    assert (cfg.omni.detect_node_down_s, cfg.omni.detect_task_crash_s, cfg.omni.detect_hang_s) == (3.0, 3.0, 40.0)
    assert cfg.start.start_small_s == 6.0 and cfg.omni.restore_small_s == 2.5
    assert {p.name for p in prov} >= {"omni.detect_hang_s", "start.start_small_s"}
    assert all(p.source == f"measured {f}" for p in prov)
    scan = 2e-4 * 16384
    # a small run's 40 s stall confirmation is below the hang rule at 6 s steps (30 x 6 s)...
    assert scale(cfg).omni.detection_s("hang", 0.5) == pytest.approx(180.0 + scan)
    # ...a longer measured one is kept
    cfg, _ = apply_drill(SimConfig(), write(tmp_path / "d2.json", {"detection_by_kind": {"hang": 400.0}}))
    assert scale(cfg).omni.detection_s("hang", 0.5) == pytest.approx(400.0 + scan)
    assert scale(cfg).omni.detection_s("node_down", 0.5) == pytest.approx(5.0 + scan)


def test_drill_total_only_is_a_fixed_overhead(tmp_path: Path) -> None:
    cfg, _ = apply_drill(SimConfig(), write(tmp_path / "d.json", {"recovery_s": 9.0}))
    assert (cfg.omni.resubmit_s, cfg.start.start_small_s, cfg.omni.restore_small_s) == (9.0, 0.0, 0.0)


def test_ckpt_file_sets_bandwidths(tmp_path: Path) -> None:
    f = write(tmp_path / "ckpt.json", {"bytes": 1e9, "blocking_s": 0.1, "persist_s": 2.0, "restore_full_s": 0.5,
                                       "restore_critical_s": 0.2, "critical_bytes": 3e8})
    cfg, prov = apply_ckpt(SimConfig(), f)
    st = cfg.storage
    assert (st.host_copy_bw, st.node_write_bw, st.node_read_bw) == pytest.approx((1e10, 5e8, 2e9))
    assert st.critical_read_bw == pytest.approx(1.5e9)
    assert len(prov) == 4
    # the slower measured write rate (0.5 GB/s < 2 TB/s / 2048 nodes) now sets the persist time
    assert scale(cfg).figures["persist_s"] == pytest.approx(405e9 * 14 / 2048 / 5e8)


def test_ckpt_file_with_the_memory_tier_restores_survivors_from_memory(tmp_path: Path) -> None:
    f = write(tmp_path / "mem.json", {"bytes": 1e9, "blocking_s": 0.1, "memory_bytes": 1.1e9,
                                      "memory_restore_s": 0.5, "source": "bench/ckpt_bench.py --memory"})
    cfg, prov = apply_ckpt(SimConfig(), f)
    assert cfg.storage.memory_read_bw == pytest.approx(2.2e9)
    assert {p.name: p.source for p in prov}["storage.memory_read_bw"] == f"measured {f}"
    without = in_allocation(SimConfig(), scale(SimConfig()).omni, 1.0)
    with_tier = in_allocation(cfg, scale(cfg).omni, 1.0)
    assert "memory tier" in with_tier.name and "memory tier" not in without.name
    # the survivors read 8 GPUs' weight shards from memory, the replacement alone from the file system at
    # its own client's rate: both far below the whole job's share of the aggregate
    weights = 8 * 405e9 * 2 / 128
    assert with_tier.relaunch_restore_s == pytest.approx(2.0 + max(weights / 2.2e9, weights / 5e9))
    assert with_tier.relaunch_restore_s < without.relaunch_restore_s / 2
    with pytest.raises(OmniError, match="memory_bytes"):
        apply_ckpt(SimConfig(), write(tmp_path / "bad.json", {"bytes": 1, "memory_bytes": 0, "memory_restore_s": 1}))


def test_ckpt_file_with_a_peer_restore_restores_the_replacement_from_its_peer(tmp_path: Path) -> None:
    f = write(tmp_path / "peer.json", {"bytes": 1e9, "memory_bytes": 1.1e9, "memory_restore_s": 0.5,
                                       "peer_bytes": 5e8, "peer_restore_s": 0.5})
    cfg, prov = apply_ckpt(SimConfig(), f)
    assert cfg.storage.peer_read_bw == pytest.approx(1e9)
    assert {p.name: p.source for p in prov}["storage.peer_read_bw"] == f"measured {f}"
    # the replacement reads its weight shards from its peer at 1 GB/s (slower than the file system's 5 GB/s
    # default here: the measured rate is used, not the better one)
    weights = 8 * 405e9 * 2 / 128
    assert in_allocation(cfg, scale(cfg).omni, 1.0).relaunch_restore_s == pytest.approx(
        2.0 + max(weights / 2.2e9, weights / 1e9))
    with pytest.raises(OmniError, match="peer_bytes"):
        apply_ckpt(SimConfig(), write(tmp_path / "bad.json", {"bytes": 1, "peer_bytes": -1, "peer_restore_s": 1}))


def test_timeline_medians(tmp_path: Path) -> None:
    rec = {"job_id": "7", "incarnation": 0, "fault": 100.0, "detected": 101.0, "confirmed": 104.0,
           "resubmitted": 105.0, "running": 111.0, "first_step_after_restore": 113.0}
    f = write(tmp_path / "t.json", {"recoveries": [rec, {**rec, "confirmed": 106.0, "resubmitted": 106.5}]})
    cfg, _ = apply_timeline(SimConfig(), f)
    assert cfg.omni.detect_node_down_s == pytest.approx(5.0)
    assert cfg.start.start_small_s == pytest.approx(5.25)
    assert cfg.omni.restore_small_s == pytest.approx(2.0)


@pytest.mark.parametrize("content, message", [
    ("{", "couldn't parse"),
    ('{"detection_s": -1}', "expected seconds"),
    ('{"detect_s": 1}', "unknown key 'detect_s'"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_drill_file(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "d.json"
    f.write_text(content)
    with pytest.raises(OmniError, match=message):
        apply_drill(SimConfig(), f)


def test_bad_ckpt_file(tmp_path: Path) -> None:
    with pytest.raises(OmniError, match="bytes"):
        apply_ckpt(SimConfig(), write(tmp_path / "c.json", {"blocking_s": 1.0}))
    with pytest.raises(OmniError, match="exceeds"):
        apply_ckpt(SimConfig(), write(tmp_path / "c.json", {"bytes": 1, "restore_full_s": 1.0,
                                                            "restore_critical_s": 2.0}))


def test_toml_config(tmp_path: Path) -> None:
    f = tmp_path / "sim.toml"
    f.write_text("[run]\ninterruptions = 100\n[slurm]\nckpt_interval_s = 900\n")
    cfg, prov = load_config(f)
    assert cfg.run.interruptions == 100 and cfg.slurm.ckpt_interval_s == 900
    assert [p.name for p in prov] == ["run.interruptions", "slurm.ckpt_interval_s"]
    f.write_text("[run]\ninterruptons = 100\n")
    with pytest.raises(OmniError, match="interruptons"):
        load_config(f)


def test_cli_prints_sources_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    drill = write(tmp_path / "drill.json", {"detection_s": 2.0})
    out_json = tmp_path / "out.json"
    assert main(["--runs", "2", "--drill-json", str(drill), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "(c) slurm-omni" in text and "97% target" in text
    assert f"measured {drill}" in text
    payload = json.loads(out_json.read_text())
    assert [p["policy"][:3] for p in payload["policies"]] == ["(a)", "(b)", "(c)"]


def test_cli_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--runs", "1", "--ckpt-json", str(tmp_path / "nope.json")]) != 0
    err = capsys.readouterr().err.strip()
    assert "no such file" in err and "\n" not in err


def test_printed_config_loads_back_to_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--print-config"]) == 0
    f = tmp_path / "all.toml"
    f.write_text(capsys.readouterr().out)
    cfg, _ = load_config(f)
    assert cfg == SimConfig()


def _scale_file(tmp_path: Path, detect: dict[int, float], start: dict[int, float], *, na_at: int = 0) -> Path:
    """A scale bench result: per size, the three faults through the in-allocation path."""
    sizes = []
    for n in sorted(detect):
        runs = [{"path": "inalloc", "fault": fault, "na": "timeout" if n == na_at else "",
                 "phases": {"detect": detect[n] * 0.25, "confirm": detect[n] * 0.75 + (30.0 if fault == "hang" else 0.0),
                            "decide": 0.1, "launch": start[n] * 0.5, "rendezvous": start[n] * 0.25,
                            "first_step": start[n] * 0.25}} for fault in ("node", "crash", "hang")]
        sizes.append({"nodes": n, "ranks": 4 * (n - 3), "na": "", "runs": runs})
    return write(tmp_path / "scale.json", {"source": "bench/scale_bench.py", "sizes": sizes})


def test_scale_file_extrapolates_detection_and_start_from_the_fitted_growth(tmp_path: Path) -> None:
    # detection grows as nodes^0.5 from 64 nodes on, the start as nodes^1 (8 nodes is off the line
    # and left out: the fit uses the sizes from 64 up when two were measured)
    detect = {8: 9.0, 64: 1.0, 256: 2.0, 512: 512 ** 0.5 / 8}
    start = {8: 0.1, 64: 2.0, 256: 8.0, 512: 16.0}
    f = _scale_file(tmp_path, detect, start)
    cfg, prov = apply_scale(SimConfig(), f)
    nodes = SimConfig().run.nodes   # 2,048
    assert nodes == 2048
    assert cfg.omni.detect_node_down_s == pytest.approx(2048 ** 0.5 / 8)
    assert cfg.omni.detect_task_crash_s == pytest.approx(2048 ** 0.5 / 8)
    # the hang: the rule's 30 s plus a growing part, so it grows slower than the part alone
    assert 30.0 + 512 ** 0.5 / 8 < cfg.omni.detect_hang_s < 30.0 + 2048 ** 0.5 / 8
    assert cfg.start.start_at_scale_s == pytest.approx(64.0)
    assert cfg.omni.heartbeat_read_s == 0.0
    by_name = {p.name: p.source for p in prov}
    assert by_name["omni.detect_node_down_s"].startswith("measured, extrapolated from 512 nodes (log-log slope +0.50 "
                                                         "over 64, 256, 512 nodes")
    assert by_name["start.start_at_scale_s"].startswith("measured, extrapolated from 512 nodes (log-log slope +1.00")
    scaled = scale(cfg)
    assert scaled.figures["start_s"] == pytest.approx(64.0 + 4.0 * 16384 / 1000)   # + the communicator set-up
    assert scaled.figures["heartbeat_scan_s"] == 0.0


def test_scale_file_sizes_that_did_not_run_are_left_out_and_one_size_is_no_fit(tmp_path: Path) -> None:
    detect = {64: 1.0, 256: 2.0, 512: 50.0}
    start = {64: 2.0, 256: 8.0, 512: 99.0}
    cfg, prov = apply_scale(SimConfig(), _scale_file(tmp_path, detect, start, na_at=512))
    assert cfg.omni.detect_node_down_s == pytest.approx(2.0 * 8 ** 0.5)   # 64 and 256 only
    assert all("extrapolated from 256 nodes" in p.source for p in prov if p.name != "omni.heartbeat_read_s")
    with pytest.raises(OmniError, match="no two sizes"):
        apply_scale(SimConfig(), _scale_file(tmp_path, {64: 1.0}, {64: 2.0}))
    with pytest.raises(OmniError, match="no sizes"):
        apply_scale(SimConfig(), write(tmp_path / "x.json", {"runs": []}))


def test_goodput_prints_the_scale_provenance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _scale_file(tmp_path, {64: 1.0, 512: 2.0}, {64: 2.0, 512: 8.0})
    assert main(["--runs", "1", "--scale-json", str(f)]) == 0
    out = capsys.readouterr().out
    assert "measured, extrapolated from 512 nodes" in out
    assert "omni.detect_node_down_s" in out and "start.start_at_scale_s" in out
    assert "(inside the measured detection)" in out
