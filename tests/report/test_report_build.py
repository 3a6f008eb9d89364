"""``omni report`` on a small synthetic run: the summary figures, the files, and bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from report_synth import write_run

from slurm_omni.cli.main import main
from slurm_omni.errors import OmniError
from slurm_omni.fsio import PARTIAL
from slurm_omni.report.build import build_report
from slurm_omni.report.inputs import load_metrics
from slurm_omni.report.render import text_table
from slurm_omni.report.summary import summarize
from slurm_omni.report.timeline import load_timeline


@pytest.fixture
def run(tmp_path: Path) -> dict[str, Path]:
    return write_run(tmp_path / "run")


def test_summary_figures(run: dict[str, Path]) -> None:
    s = summarize(load_metrics([run["metrics"]]), reference=load_metrics([run["reference"]]),
                  recoveries=load_timeline(run["timeline"]).recoveries)
    (r,) = s.recoveries
    assert (r.job_id, r.incarnation, r.kind) == ("42", 0, "node_down")
    assert r.detection_s == pytest.approx(2.5)
    assert r.recovery_s == pytest.approx(9.0)
    assert r.steps_lost == 3
    assert (r.throughput_before, r.throughput_after) == pytest.approx((100.0, 90.0))
    assert r.throughput_ratio == pytest.approx(0.9)
    assert s.max_loss_deviation == pytest.approx(0.001)
    assert s.max_loss_deviation_step == 25
    assert s.loss_compared_steps == 40
    assert (s.first_step, s.last_step, s.incarnations) == (1, 40, (0, 1))


def test_without_timeline_recoveries_come_from_incarnations(run: dict[str, Path]) -> None:
    s = summarize(load_metrics([run["metrics"]]), job_id="42")
    (r,) = s.recoveries
    assert r.steps_lost == 3 and r.detection_s is None and r.recovery_s is None
    assert r.throughput_ratio == pytest.approx(0.9)


def test_never_failed_run_has_no_recovery(tmp_path: Path) -> None:
    paths = write_run(tmp_path / "ok", failed=False)
    s = summarize(load_metrics([paths["metrics"]]), reference=load_metrics([paths["reference"]]))
    assert s.recoveries == () and s.max_loss_deviation == 0.0
    assert "(no recovery" in text_table(s) and "0 at step" in text_table(s)


def test_cli_writes_everything(run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["report", "-m", str(run["metrics"]), "-r", str(run["reference"]), "--heartbeats",
                 str(run["heartbeats"]), "--timeline", str(run["timeline"]), "-o", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "detection_s" in text and "2.50" in text and "9.00" in text and "0.900" in text
    assert "0.001 at step 25" in text
    png = (out / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "<td>node_down</td>" in page
    prom = (out / "omni-report.prom").read_text()
    assert 'omni_report_detection_seconds{job="42",incarnation="0",kind="node_down"} 2.5' in prom
    assert "omni_report_max_loss_deviation" in prom
    line = json.loads((out / "summary.jsonl").read_text())
    assert line["recoveries"][0]["steps_lost"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["omni-report.prom", "report.html", "report.png",
                                                     "summary.jsonl", "summary.txt"]


def bad_metrics_line(run: dict[str, Path]) -> list[str]:
    f = run["metrics"] / "metrics-text-0.jsonl"
    f.write_text(f.read_text() + '{"time": 1, "rank": 2, "step": \n')
    return ["-m", str(run["metrics"])]


def bad_timeline(run: dict[str, Path]) -> list[str]:
    data = json.loads(run["timeline"].read_text())
    data["recoveries"][0]["running"] = data["recoveries"][0]["confirmed"] - 5
    run["timeline"].write_text(json.dumps(data))
    return ["-m", str(run["metrics"]), "--timeline", str(run["timeline"])]


@pytest.mark.parametrize("make_args, message", [
    (lambda run: ["-m", str(run["metrics"].parent / "nope")], "no such file or folder"),
    (bad_metrics_line, "metrics-text-0.jsonl line 44"),
    (lambda run: ["-m", str(run["metrics"]), "--timeline", str(run["metrics"] / "nope.json")], "no such file"),
    (bad_timeline, "is before"),
    (lambda run: ["-m", str(run["metrics"]), "--heartbeats", str(run["metrics"] / "none")], "no such folder"),
])
def test_bad_inputs_one_line_nothing_written(run: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str], make_args, message: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.png").write_bytes(b"old")
    code = main(["report", *make_args(run), "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert message in err and "\n" not in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["report.png"]
    assert (out / "report.png").read_bytes() == b"old"


def test_unwritable_output_leaves_no_temporaries(run: dict[str, Path], tmp_path: Path) -> None:
    from slurm_omni.report.build import report_files, write_all

    report = build_report([run["metrics"]])
    out = tmp_path / "out"
    files = report_files(report, out, prom=tmp_path / "blocked" / "x.prom")
    (tmp_path / "blocked").write_text("a file where a folder should be")
    with pytest.raises(OmniError, match="couldn't write"):
        write_all(files)
    assert not any(p.name.endswith(PARTIAL) for p in out.iterdir())
    assert not (out / "report.png").exists()


def test_colocated_ranks_and_heartbeat_history(run: dict[str, Path], tmp_path: Path) -> None:
    # One colocated rank (stage -1: vision+text in one process) and a manager's heartbeat history.
    metrics = tmp_path / "colo"
    metrics.mkdir()
    lines = [{"time": 100.0 + s, "rank": 0, "stage": -1, "dp_rank": 0, "incarnation": 0, "step": s,
              "loss": 3.0 - 0.1 * s, "global_samples_per_second": 50.0, "tokens_per_second": 900.0}
             for s in range(1, 6)]
    (metrics / "metrics-vision+text-0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    beats = tmp_path / "hb"
    beats.mkdir()
    (beats / "history.jsonl").write_text("".join(
        json.dumps({"rank": 0, "time": 100.0 + t, "step": int(t), "phase": "training"}) + "\n"
        for t in (0.0, 2.0, 4.0, 9.0)))
    report = build_report([metrics], heartbeats=beats, job_id="7")
    assert report.summary.recoveries == () and report.summary.last_step == 5
    assert report.png.startswith(b"\x89PNG")
    assert 'omni_report_last_step{job="7"} 5' in report.prom


def test_the_stages_go_by_their_own_names(tmp_path: Path) -> None:
    """The report names the stages as the job does (the metrics files' names): no name assumed."""
    paths = write_run(tmp_path / "two", names=("speech", "lm"))
    built = build_report([paths["metrics"]], reference=[paths["reference"]], job_id="42")
    assert built.summary.stages == ("speech", "lm")
    assert built.text.splitlines()[0].startswith("omni report: job 42 (speech | lm stages), steps 1..40")
    assert json.loads(built.json)["stages"] == ["speech", "lm"]
    one = tmp_path / "one"
    one.mkdir()
    for dp in (0, 1):
        (one / f"metrics-gpt-{dp}.jsonl").write_text("".join(json.dumps(
            {"time": 1000.0 + s, "rank": dp, "stage": 0, "dp_rank": dp, "incarnation": 0, "step": s,
             "loss": 3.0 - 0.01 * s, "tokens_per_second": 500.0, "global_samples_per_second": 8.0}) + "\n"
            for s in range(1, 11)))
    built = build_report([one], job_id="7")
    assert built.summary.stages == ("gpt",)
    assert "omni report: job 7 (gpt stage), steps 1..10" in built.text


def test_heartbeats_aggregated_per_node_are_read(tmp_path: Path) -> None:
    """A heartbeat folder of a job that aggregated per node (OMNI_HEARTBEAT_NODE_DIR): the node files'
    header lines are not beats, their beat lines are."""
    from slurm_omni.report.inputs import load_heartbeats
    folder = tmp_path / "hb"
    folder.mkdir()
    beat = {"stage": 0, "dp_rank": 0, "pid": 1, "incarnation": 0, "job_id": "4", "step": 7, "phase": "training"}
    (folder / "node-n1.jsonl").write_text("\n".join(json.dumps(o) for o in (
        {"node": "n1", "time": 100.5}, {**beat, "rank": 0, "time": 100.0}, {**beat, "rank": 1, "time": 100.2})) + "\n")
    (folder / "rank-1.json").write_text(json.dumps({**beat, "rank": 1, "time": 101.0, "phase": "done"}))
    got = [(b.rank, b.time, b.phase) for b in load_heartbeats(folder)]
    assert got == [(0, 100.0, "training"), (1, 100.2, "training"), (1, 101.0, "done")]
