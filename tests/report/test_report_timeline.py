"""The recovery timeline format: both file shapes, derived spans, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_omni.report.timeline import ReportInputError, load_timeline

REC = {"job_id": "42", "incarnation": 1, "fault": 10.0, "detected": 11.0, "confirmed": 13.0,
       "resubmitted": 14.0, "running": 20.0, "first_step_after_restore": 23.5}


def test_object_and_lines_read_the_same(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"recoveries": [REC, {**REC, "incarnation": 2}]}))
    b.write_text(json.dumps(REC) + "\n\n" + json.dumps({**REC, "incarnation": 2}) + "\n")
    assert load_timeline(a) == load_timeline(b)
    r = load_timeline(a).recoveries[0]
    assert (r.detection_s, r.resubmit_s, r.start_s, r.restore_s, r.recovery_s) == (3.0, 1.0, 6.0, 3.5, 10.5)


def test_unfinished_recovery(tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"recoveries": [{"job_id": 7, "incarnation": 0, "confirmed": 5.0, "fault": None}]}))
    (r,) = load_timeline(f).recoveries
    assert r.job_id == "7" and r.detection_s is None and r.recovery_s is None


@pytest.mark.parametrize("obj, message", [
    ({**REC, "confirmd": 1.0}, "unknown key 'confirmd'"),
    ({k: v for k, v in REC.items() if k != "confirmed"}, "confirmed is required"),
    ({**REC, "incarnation": "1"}, "incarnation"),
    ({**REC, "running": "soon"}, "expected unix time"),
    ({**REC, "detected": 9.0}, "detected = 9.0 is before fault"),
])
def test_refused(tmp_path: Path, obj: dict[str, object], message: str) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(obj) + "\n")
    with pytest.raises(ReportInputError, match=message):
        load_timeline(f)


def test_malformed_line_names_it(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(REC) + "\n{oops\n")
    with pytest.raises(ReportInputError, match="line 2"):
        load_timeline(f)


def test_writer_round_trip(tmp_path: Path) -> None:
    from slurm_omni.report import Recovery, timeline_json

    recs = [Recovery(job_id="42+0", incarnation=0, confirmed=3.0, fault=1.0, kind="task_crash"),
            Recovery(**{**REC, "incarnation": 1})]  # type: ignore[arg-type]
    f = tmp_path / "t.json"
    f.write_text(timeline_json(recs))
    assert load_timeline(f).recoveries == tuple(recs)
