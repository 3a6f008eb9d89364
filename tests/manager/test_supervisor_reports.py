"""The step supervisor's report files as the manager reads them: strict, bounded, one bad file
skipped, only the Slurm job asked for, oldest life first."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from slurm_omni.formats.supervisor import StatusPool, SupervisorStatus
from slurm_omni.manager.events import EventRejected
from slurm_omni.manager.supervisor_reports import (
    MAX_REPORT_BYTES,
    allocations_now,
    parse_report,
    read_reports,
    supervised,
)
from slurm_omni.supervisor.journal import status_path, write_status

REPORT: dict[str, Any] = {
    "version": 1, "kind": "relaunched", "slurm_job_id": "42", "life_before": 0, "life_after": 1, "cause": "down",
    "nodes": ["node3"], "removed": {"1": ["node3"]}, "added": {"1": ["node4"]}, "spares_left": {"0": 1, "1": 0},
    "data_parallel_size": 2, "fault_at": 100.0, "detected_at": 101.0, "confirmed_at": 102.0,
    "relaunched_at": 103.5, "reason": "spare node4 on leaf1", "failed_nodes": ["node3"]}


def _write(folder: Path, name: str, obj: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_a_relaunch_report_becomes_the_state_machines_observation() -> None:
    report = parse_report(json.dumps(REPORT).encode(), "relaunched-1.json")
    o = report.observation
    assert (report.slurm_job_id, report.failed_nodes) == ("42", ("node3",))
    assert (o.kind, o.at, o.incarnation_before, o.incarnation_after, o.cause, o.nodes) == ("relaunched", 103.5, 0, 1, "down",
                                                                             ("node3",))
    assert o.removed == {"1": ("node3",)} and o.added == {"1": ("node4",)} and o.spares_left == {"0": 1, "1": 0}
    assert (o.fault_at, o.detected_at, o.confirmed_at, o.data_parallel_size) == (100.0, 101.0, 102.0, 2)


def test_a_minimal_gave_up_report() -> None:
    o = parse_report(json.dumps({"version": 1, "kind": "gave_up", "slurm_job_id": "42", "life_after": 3,
                                 "confirmed_at": 50.0, "reason": "below min dp"}).encode(), "g").observation
    assert (o.kind, o.at, o.incarnation_after, o.reason, o.nodes) == ("gave_up", 50.0, 3, "below min dp", ())


@pytest.mark.parametrize(("change", "message"), [
    ({"version": 2}, r"Invalid enum value 2 - at `\$.version`"),
    ({"kind": "exploded"}, r"Invalid enum value 'exploded' - at `\$.kind`"),
    ({"surprise": 1}, "unknown field `surprise`"),
    ({"slurm_job_id": "42; rm -rf /"}, r"\$.slurm_job_id"),
    ({"slurm_job_id": 42}, r"\$.slurm_job_id"),
    ({"life_after": -1}, r"Expected `int` >= 0 - at `\$.life_after`"),
    ({"life_after": True}, r"Expected `int`, got `bool` - at `\$.life_after`"),
    ({"relaunched_at": "soon"}, r"got `str` - at `\$.relaunched_at`"),
    ({"nodes": "node3"}, r"Expected `array \| null`, got `str` - at `\$.nodes`"),
    ({"nodes": ["node\n3"]}, r"\$.nodes\[0\]"),
    ({"removed": ["node3"]}, r"Expected `object \| null`, got `array` - at `\$.removed`"),
    ({"spares_left": {"0": -1}}, r"\$.spares_left"),
    ({"relaunched_at": None, "confirmed_at": None, "detected_at": None}, "no time"),
])
def test_a_bad_report_is_refused_naming_what_is_wrong(change: dict[str, Any], message: str) -> None:
    with pytest.raises(EventRejected, match=message) as refused:
        parse_report(json.dumps({**REPORT, **change}).encode(), "relaunched-1.json")
    assert str(refused.value).startswith("manager: couldn't accept supervisor report relaunched-1.json: ")
    assert "\n" not in str(refused.value)


def test_not_json_and_nan_are_refused() -> None:
    with pytest.raises(EventRejected, match="couldn't parse"):
        parse_report(b"{", "r")
    with pytest.raises(EventRejected, match="couldn't parse supervisor report r: JSON is malformed"):
        parse_report(json.dumps(REPORT).replace("103.5", "NaN").encode(), "r")


def test_reports_of_the_job_oldest_first_and_a_bad_one_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "supervisor"
    assert read_reports(tmp_path, 42) == [] and not supervised(tmp_path, 42)
    _write(folder, "42.status.json", {"path": "in_allocation"})
    _write(folder, "relaunched-2.json", {**REPORT, "life_before": 1, "life_after": 2})
    _write(folder, "relaunched-1.json", REPORT)
    _write(folder, "relaunched-9.json", {**REPORT, "slurm_job_id": "43", "life_after": 9})   # another job's
    _write(folder, "gave_up-3.json", "{not json")
    _write(folder, "42.jsonl", "not a report")
    big = _write(folder, "relaunched-4.json", " " * (MAX_REPORT_BYTES + 1))
    os.symlink(folder / "relaunched-1.json", folder / "relaunched-5.json")
    reports = read_reports(tmp_path, 42)
    assert [r.observation.incarnation_after for r in reports] == [1, 2]
    assert supervised(tmp_path, 42) and not supervised(tmp_path, 43)
    assert big.exists()                       # skipped, not removed: the supervisor's file


def test_a_replacement_request_is_what_the_supervisor_reads_and_its_answer_comes_from_its_journal(
        tmp_path: Path) -> None:
    """The manager's side of a fail-slow replacement inside the allocation, against the supervisor's
    own reader and journal writer (slurm_omni/supervisor/journal.py)."""
    from slurm_omni.formats.supervisor import SupervisorRequest
    from slurm_omni.manager.supervisor_reports import read_status_view, request_outcome, write_request
    from slurm_omni.policy.in_allocation import StepLayout
    from slurm_omni.supervisor.journal import (
        SupervisorJournal,
        journal_path,
        layout_to_json,
        read_request,
        request_path,
        status_document,
        status_path,
        write_status,
    )

    journal = SupervisorJournal(journal_path(tmp_path, "42"))
    layout = StepLayout((("node1", "node2"), ("node3", "node4")), ("node5", "node6"))
    journal.append("launch", launch=0, layout=layout_to_json(layout), data_parallel_size=2, port=1, incarnation=0)
    write_status(status_path(tmp_path, "42"), status_document(journal.state, job_id="42", phase="running", now=500.0))
    view = read_status_view(tmp_path, 42)
    assert view is not None and view.phase == "running" and view.spares_left == 2 and view.updated_at == 500.0
    assert view.nodes == {"node1", "node2", "node3", "node4"}
    assert read_status_view(tmp_path, 43) is None

    path = write_request(tmp_path, 42, "failslow-a", ["node1"])
    assert path == request_path(tmp_path, "42")
    assert read_request(path) == SupervisorRequest(id="failslow-a", replace=["node1"], at="checkpoint", shrink=False)
    # a shrink by request (no spare left, and k-1 healthy replicas beat k with the slow one)
    shrink = read_request(write_request(tmp_path, 43, "failslow-b", ["node3"], shrink=True))
    assert shrink is not None and shrink.shrink is True
    (tmp_path / "supervisor" / "44.request.json").write_text('{"id": "x", "replace": ["node1"], "shrink": "yes"}')
    assert read_request(request_path(tmp_path, "44")) is None          # shrink must be a bool: ignored, logged
    assert request_outcome(tmp_path, 42, "failslow-a") is None          # not answered yet
    journal.append("request", id="failslow-a", replace=["node1"], outcome="accepted", launch=0)
    journal.append("request", id="other", replace=["node2"], outcome="no_spare", launch=0)
    assert request_outcome(tmp_path, 42, "failslow-a") == "accepted"
    journal.append("request", id="failslow-a", replace=["node1"], outcome="carried_out", launch=1)
    journal.append("request", id="shrink-a", replace=["node3"], shrink=True, outcome="below_minimum", launch=1)
    assert request_outcome(tmp_path, 42, "shrink-a") == "below_minimum"
    with open(journal.path, "ab") as f:
        f.write(b'{"kind": "request", "id": "failslow-a", "outc')     # a torn last line
    assert request_outcome(tmp_path, 42, "failslow-a") == "carried_out"
    assert request_outcome(tmp_path, 42, "other") == "no_spare" and request_outcome(tmp_path, 4, "other") is None
    (tmp_path / "supervisor" / "42.status.json").write_text('{"path": "in_allocation"}')
    assert read_status_view(tmp_path, 42) is None                      # malformed: none, logged once


def test_the_manager_learns_the_allocations_a_job_holds_from_the_supervisors_status(tmp_path: Path) -> None:
    assert allocations_now(tmp_path, 42) == (42,)                        # no status file: its own job
    path = status_path(tmp_path, "42")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_status(path, SupervisorStatus(slurm_job_id="42", phase="running", updated_at=1.0))
    assert allocations_now(tmp_path, 42) == (42,)
    write_status(path, SupervisorStatus(
        slurm_job_id="42", phase="running", updated_at=2.0, allocation="44",
        pools=[StatusPool(name="p", slurm_job_id="45", state="granted"), StatusPool(name="q", state="asking")],
        successor=StatusPool(name="omni-42-successor-1", slurm_job_id="46", state="requested")))
    assert allocations_now(tmp_path, 42) == (44, 45, 46)                 # the one it runs in first
    write_status(path, SupervisorStatus(
        slurm_job_id="42", phase="running", updated_at=3.0, allocation="44",
        successor=StatusPool(name="omni-42-successor-1", slurm_job_id="46", state="released")))
    assert allocations_now(tmp_path, 42) == (44,)
