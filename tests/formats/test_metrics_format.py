"""The metrics line (slurm_omni.formats.metrics): what its writer writes, both readers read with their
own policies (drill: a torn last line is skipped; report: strict), and every fault is one line naming
the file, the line and the key."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from malformed_inputs import garbage, mutated

from slurm_omni.drill.history import HistoryError, load_history
from slurm_omni.elastic.metrics import MetricsLog
from slurm_omni.errors import RuntimeLayoutError
from slurm_omni.formats import RecordRejected
from slurm_omni.formats.metrics import MetricsLine, check_line, dumps, parse_line
from slurm_omni.report.inputs import load_metrics
from slurm_omni.report.timeline import ReportInputError

LINE = {"time": 1764460000.5, "rank": 0, "stage": 1, "dp_rank": 0, "incarnation": 0, "step": 3, "loss": 2.5,
        "step_time_seconds": 0.2, "global_samples_per_second": 40.0, "data_parallel_size": 2}


def _log(folder: Path, steps: list[dict[str, object]]) -> Path:
    log = MetricsLog(folder, stage_name="text", stage=1, rank=0, dp_rank=0, dp_size=1, incarnation=0, job_id="42")
    for values in steps:
        log.log_step(values)
    log.close()
    return folder / "metrics-text-0.jsonl"


def test_the_writers_lines_with_a_diverged_loss_are_what_both_readers_read(tmp_path: Path) -> None:
    path = _log(tmp_path, [{"step": 1, "loss": 2.5, "step_time_seconds": 0.1, "data_parallel_size": 1,
                            "ckpt_blocking_seconds": None, "my_own_value": [1, 2]},
                           {"step": 2, "loss": float("nan"), "step_time_seconds": 0.1},
                           {"step": 3, "loss": float("inf")}])
    assert "NaN" in path.read_text() and "Infinity" in path.read_text()   # the on-disk format is unchanged
    report = load_metrics([tmp_path])
    assert [(r.step, r.loss, r.data_parallel_size) for r in report] == [(1, 2.5, 1), (2, None, None), (3, None, None)]
    history = load_history(tmp_path)
    assert history.losses() == {1: 2.5} and [r.step for r in history.records] == [1, 2, 3]
    line = parse_line(path.read_text().splitlines()[1], "x")
    assert line.loss is not None and math.isnan(line.loss) and line.rank == 0 and line.stage == 1


@pytest.mark.parametrize("values, key", [({"step": 1, "loss": "low"}, "loss"), ({"step": -1}, "step"),
                                         ({"step": 1, "step_time_seconds": -0.5}, "step_time_seconds"),
                                         ({"step": True}, "step"), ({"step": 1, "data_parallel_size": 0},
                                                                    "data_parallel_size")])
def test_the_writer_refuses_a_line_the_readers_would_refuse(tmp_path: Path, values: dict[str, object],
                                                            key: str) -> None:
    with pytest.raises(RuntimeLayoutError) as e:
        _log(tmp_path, [values])
    message = str(e.value)
    assert message.startswith("elastic: couldn't log step") and f"{key}: expected" in message and "\n" not in message
    assert (tmp_path / "metrics-text-0.jsonl").read_text() == ""    # nothing half-written


@pytest.mark.parametrize("change, needle", [
    ({"step": "3"}, "step: expected `int`, got `str`"), ({"rank": -2}, "rank: expected `int` >= 0"),
    ({"time": float("nan")}, "time: expected `float` > 0.0"), ({"stage": -2}, "stage: expected `int` >= -1"),
    ({"tokens_per_second": float("inf")}, "tokens_per_second: expected `float`"),
    ({"incarnation": 1.5}, "incarnation: expected `int`, got `float`")])
def test_a_bad_line_names_file_line_key_and_what_is_allowed(tmp_path: Path, change: dict[str, object],
                                                           needle: str) -> None:
    path = tmp_path / "metrics-text-0.jsonl"
    path.write_text(dumps(LINE) + dumps({**LINE, **change}) + dumps(LINE))
    for read, error, prefix in ((lambda: load_metrics([tmp_path]), ReportInputError, "report: "),
                                (lambda: load_history(tmp_path), HistoryError, "drill: ")):
        with pytest.raises(error) as e:
            read()
        assert str(e.value).startswith(f"{prefix}couldn't read {path} line 2: {needle}"), str(e.value)
        assert "\n" not in str(e.value)


def test_missing_required_key_duplicate_key_and_deep_nesting_are_one_line(tmp_path: Path) -> None:
    line = json.dumps({k: v for k, v in LINE.items() if k != "rank"})
    with pytest.raises(RecordRejected, match=r"^couldn't read f line 1: missing required key `rank`"):
        parse_line(line, "f line 1")
    with pytest.raises(RecordRejected, match="duplicate key 'step'"):
        parse_line('{"time": 1.0, "rank": 0, "step": 1, "step": 2}', "f")
    with pytest.raises(RecordRejected, match="nested too deep"):
        parse_line('{"time": 1.0, "rank": 0, "step": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "f")
    with pytest.raises(RecordRejected, match="expected a JSON object, not list"):
        parse_line("[1]", "f")


def test_drill_skips_a_torn_last_line_and_report_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics-text-0.jsonl"
    path.write_text(dumps(LINE) + dumps({**LINE, "step": 4}) + '{"time": 1764460002.0, "rank": 0, "st')
    assert [r.step for r in load_history(tmp_path).records] == [3, 4]
    with pytest.raises(ReportInputError, match=f"^report: couldn't parse {path} line 3: "):
        load_metrics([tmp_path])
    # a last line that is whole JSON but wrong is not torn: both refuse it
    path.write_text(dumps(LINE) + json.dumps({**LINE, "step": "4"}))
    with pytest.raises(HistoryError, match="line 2: step: expected `int`"):
        load_history(tmp_path)


_seconds = st.none() | st.floats(min_value=0, max_value=1e9)
_lines = st.fixed_dictionaries(
    {"time": st.floats(min_value=1e-3, max_value=1e10), "rank": st.integers(0, 1 << 20),
     "step": st.integers(0, 1 << 40)},
    optional={"stage": st.integers(-1, 8), "dp_rank": st.integers(0, 64), "incarnation": st.integers(0, 99),
              "loss": st.none() | st.floats(allow_nan=True, allow_infinity=True),
              "step_time_seconds": _seconds, "ckpt_persist_seconds": _seconds, "tokens_per_second": _seconds,
              "data_parallel_size": st.none() | st.integers(1, 64),
              "script_value": st.text(max_size=5) | st.integers() | st.lists(st.integers(), max_size=3)})


@given(_lines)
def test_every_line_the_schema_allows_round_trips_through_the_writers_encoding(obj: dict[str, object]) -> None:
    line = parse_line(dumps(obj).rstrip("\n"), "f")
    expected = check_line(obj, "f")
    assert isinstance(line, MetricsLine) and (line.step, line.rank, line.time) == (obj["step"], obj["rank"], obj["time"])
    if line.loss is None or not math.isnan(line.loss):
        assert line == expected


@given(garbage(LINE) | mutated(LINE))
def test_any_bytes_are_a_line_or_one_error_line(data: bytes) -> None:
    text = data.decode("utf-8", "replace").replace("\n", " ").replace("\r", " ")
    try:
        line = parse_line(text, "f line 1")
    except RecordRejected as e:
        assert str(e).startswith(("couldn't read f line 1", "couldn't parse f line 1")) and "\n" not in str(e)
    else:
        assert line.time > 0 and line.step >= 0 and line.rank >= 0


def test_the_textfile_is_written_at_the_first_step_then_at_most_every_interval_and_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A create and a rename per rank per step cost a parallel file system's metadata server per rank
    (issue 19): between the first step and the end, at most one rewrite per PROM_EVERY_S."""
    from slurm_omni.elastic import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "PROM_EVERY_S", 1e9)   # no interval passes within this test
    log = MetricsLog(tmp_path, stage_name="text", stage=1, rank=0, dp_rank=0, dp_size=1, incarnation=0, job_id="42")
    prom = tmp_path / "omni-text-0.prom"
    log.log_step({"step": 1, "loss": 2.5})
    first = prom.stat().st_ino
    for step in range(2, 6):
        log.log_step({"step": step, "loss": 2.5 - step / 10})
    assert prom.stat().st_ino == first and 'omni_step{job="42",rank="0",stage="text",dp_rank="0"} 1.0' in prom.read_text()
    log.close()
    assert 'omni_step{job="42",rank="0",stage="text",dp_rank="0"} 5.0' in prom.read_text()   # the last step's
    assert len((tmp_path / "metrics-text-0.jsonl").read_text().splitlines()) == 5   # every line, as before
