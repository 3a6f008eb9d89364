"""The files between the step supervisor and the manager (slurm_omni/formats/supervisor.py): the
recorded examples decode and round-trip, every reader turns a bad file into one line and goes on,
the journal's writer refuses a record that does not match before writing anything."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from malformed_inputs import garbage

from slurm_omni.formats import RecordRejected, encode
from slurm_omni.formats.supervisor import (
    JOURNAL_KINDS,
    ConfirmedRecord,
    FallbackRecord,
    LaunchRecord,
    RequestRecord,
    SupervisorReport,
    SupervisorRequest,
    SupervisorStatus,
    decode_journal_line,
    decode_report,
    decode_request,
    decode_status,
    journal_path,
    request_path,
    status_path,
)
from slurm_omni.manager.supervisor_reports import (
    read_reports,
    read_status_view,
    request_outcome,
    write_request,
)
from slurm_omni.manager.supervisor_reports import read_status as managers_status
from slurm_omni.supervisor.journal import SupervisorJournal, read_journal, read_request, read_status

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "supervisor"
JOURNALS = sorted(FIXTURES.glob("*.jsonl"))
STATUSES = sorted(FIXTURES.glob("*.status.json"))
REPORTS = sorted(p for p in FIXTURES.glob("*.json") if "relaunched-" in p.name or "gave_up-" in p.name)


def test_every_kind_of_file_has_recorded_examples() -> None:
    assert len(JOURNALS) >= 3 and len(STATUSES) >= 3 and len(REPORTS) >= 4
    kinds = {json.loads(line)["kind"] for p in JOURNALS for line in p.read_text().splitlines()}
    assert kinds == set(JOURNAL_KINDS)
    assert {json.loads(p.read_text())["kind"] for p in REPORTS} == {"relaunched", "gave_up"}


@pytest.mark.parametrize("path", JOURNALS, ids=lambda p: p.name)
def test_recorded_journals_decode_line_by_line_and_round_trip(path: Path) -> None:
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    records = [decode_journal_line(line, path.name) for line in lines]
    assert [r.time for r in records] == sorted(r.time for r in records)
    for line, rec in zip(lines, records, strict=True):
        assert decode_journal_line(encode(rec), "again") == rec
        assert type(rec).__struct_config__.tag == json.loads(line)["kind"]
    # a supervisor started again replays it: the same launches, and a finished journal stays finished
    state = SupervisorJournal(path).state
    launches = [r for r in records if isinstance(r, LaunchRecord)]
    assert [la.number for la in state.launches] == [r.launch for r in launches]
    assert [la.incarnation for la in state.launches] == [r.incarnation for r in launches]
    assert state.outcome in ("done", "fallback", "")
    confirmed = [r for r in records if isinstance(r, ConfirmedRecord)]
    assert [la.confirmed for la in state.launches if la.confirmed] == confirmed


@pytest.mark.parametrize("path", STATUSES, ids=lambda p: p.name)
def test_recorded_status_files_decode_and_round_trip(path: Path, tmp_path: Path) -> None:
    status = decode_status(path.read_bytes(), path.name)
    assert status.path == "in_allocation" and status.slurm_job_id.isdigit()
    folder = tmp_path / "supervisor"
    folder.mkdir()
    shutil.copy(path, folder / f"{status.slurm_job_id}.status.json")
    assert managers_status(tmp_path, int(status.slurm_job_id)) == status   # the manager's reader, the same schema
    assert decode_status(encode(status), "again") == status
    assert read_status(path) == status
    assert status.spares_left == len(status.spares)


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.name)
def test_recorded_reports_decode_and_round_trip(path: Path) -> None:
    report = decode_report(path.read_bytes(), path.name)
    assert report.at is not None and report.incarnation_after > (report.incarnation_before or 0) - 1
    assert decode_report(encode(report), "again") == report
    assert json.loads(encode(report))["life_after"] == report.incarnation_after   # the file's key


def test_the_recorded_request_decodes() -> None:
    path = FIXTURES / "previous-writer.42.request.json"
    assert decode_request(path.read_bytes(), path.name) == SupervisorRequest(id="failslow-1", replace=["n4"])


def test_a_journal_of_the_previous_writer_replays_as_it_did() -> None:
    state = SupervisorJournal(FIXTURES / "previous-writer.42.jsonl").state
    assert state.outcome == "fallback" and state.requests == {"failslow-1": "carried_out"}
    first, second = state.launches
    assert (first.pid, first.ended, first.first_step_at) == (123, 75, 1764460003.0)
    assert second.cause == "planned" and second.removed == ("n4",) and second.incarnation == 4
    assert second.start_failure is not None and second.start_failure.exit_code == 1
    assert state.fallback is not None and state.fallback.failed_nodes == ["n4"]
    status = read_status(FIXTURES / "previous-writer.42.status.json")
    assert status is not None and status.phase == "fallback" and status.fallback == state.fallback


# -- bad files: one line, skipped ---------------------------------------------------------------------
def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "supervisor"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_a_bad_journal_line_is_one_line_of_log_and_the_rest_replays(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = journal_path(tmp_path, "5001")
    lines = (FIXTURES / "node-loss-crash.jsonl").read_bytes().splitlines()
    bad = [b'{"kind": "launched", "time": 1, "launch": 1, "pid": "6559"}',   # a wrong type
           b'{"kind": "exploded", "time": 1}', b"[1, 2", b"\xff\xfe", b"[" * 5000 + b"]" * 5000]
    _folder(tmp_path)
    path.write_bytes(b"\n".join([*lines[:3], *bad, *lines[3:]]) + b'\n{"kind": "launched", "launch": 2, "pi')
    with caplog.at_level(logging.WARNING):
        records = read_journal(path)
        state = SupervisorJournal(path).state
    assert len(records) == len(lines)
    assert [la.number for la in state.launches] == [0, 1, 2] and state.outcome == "done"
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2 * (len(bad) + 1) and all("\n" not in m for m in skipped)
    assert any("line 4" in m and "$.pid" in m for m in skipped)


def test_the_journal_writer_refuses_a_record_that_does_not_match_and_writes_nothing(tmp_path: Path) -> None:
    journal = SupervisorJournal(journal_path(tmp_path, "7"))
    journal.append("allocation", nodes=["n1"])
    before = journal.path.read_bytes()
    for kind, fields in [("launched", {"launch": 0, "pid": "123"}), ("ended", {"launch": 0}),
                         ("pool_requested", {"nodes": ["n2"]}), ("allocation", {"nodes": ["bad name"]}),
                         ("launched", {"launch": 0, "pid": 5, "spans": []})]:
        with pytest.raises(RecordRejected, match=r"couldn't journal .* in .*7\.jsonl") as refused:
            journal.append(kind, **fields)
        assert "\n" not in str(refused.value)
    assert journal.path.read_bytes() == before and journal.state.allocation == ["n1"]


@pytest.mark.parametrize("content", [b"{", b'{"path": "in_allocation"}', b"[]", b"\xff",
                                     (b'{"path": "in_allocation", "slurm_job_id": "7", "phase": "exploded", '
                                     b'"updated_at": 1.0}'),
                                     (b'{"path": "in_allocation", "slurm_job_id": "7", "phase": "running", '
                                     b'"updated_at": 1.0, "spares_left": -1}')])
def test_a_bad_status_file_is_none_for_every_reader(tmp_path: Path, content: bytes,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = status_path(tmp_path, "7")
    _folder(tmp_path)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert read_status(path) is None
        assert read_status_view(tmp_path, 7) is None and managers_status(tmp_path, 7) is None
    assert caplog.records and all("\n" not in r.getMessage() for r in caplog.records)


def test_a_status_from_a_newer_writer_keeps_its_known_keys(tmp_path: Path) -> None:
    doc = json.loads((FIXTURES / "shrink.status.json").read_text())
    path = status_path(tmp_path, doc["slurm_job_id"])
    _folder(tmp_path)
    path.write_text(json.dumps({**doc, "grown": [{"job": "9"}]}))
    status = read_status(path)
    assert status is not None and status.phase == doc["phase"] and status.components == doc["components"]


def test_a_status_that_is_a_link_or_too_big_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    target = tmp_path / "elsewhere.json"
    shutil.copy(FIXTURES / "shrink.status.json", target)
    status_path(tmp_path, "8").symlink_to(target)
    assert read_status(status_path(tmp_path, "8")) is None and read_status_view(tmp_path, 8) is None
    (folder / "9.status.json").write_bytes(b" " * (2 << 20))
    assert read_status(status_path(tmp_path, "9")) is None


def test_requests_are_written_and_read_with_one_schema(tmp_path: Path) -> None:
    _folder(tmp_path)   # the supervisor's folder: it made it
    path = write_request(tmp_path, 42, "failslow-a", ["node1", "node2"], shrink=True)
    assert path == request_path(tmp_path, "42")
    assert read_request(path) == SupervisorRequest(id="failslow-a", replace=["node1", "node2"], shrink=True)
    for bad in ('{"id": "x", "replace": ["n1"], "at": "now"}', '{"id": "x y", "replace": ["n1"]}',
                '{"id": "x", "replace": ["n1"], "extra": 1}', '{"id": "x", "replace": ["n1;rm"], "shrink": 1}'):
        path.write_text(bad)
        assert read_request(path) is None


def test_a_bad_report_is_skipped_and_the_good_ones_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    for p in REPORTS:
        if p.name.startswith("node-loss-crash."):
            shutil.copy(p, folder / p.name.removeprefix("node-loss-crash."))
    (folder / "relaunched-3.json").write_text('{"version": 1, "kind": "relaunched", "slurm_job_id": "5001"}')
    (folder / "gave_up-4.json").write_text("{")
    assert [r.observation.incarnation_after for r in read_reports(tmp_path, 5001)] == [1, 2]


def test_the_managers_request_outcome_reads_the_journals_request_records(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    shutil.copy(FIXTURES / "previous-writer.42.jsonl", folder / "42.jsonl")
    assert request_outcome(tmp_path, 42, "failslow-1") == "carried_out"
    with open(folder / "42.jsonl", "ab") as f:
        f.write(b'{"kind":"request","time":2,"id":"failslow-2","replace":["n1"],"outcome":"maybe","launch":1}\n')
        f.write(encode(RequestRecord(time=3.0, id="failslow-3", replace=["n2"], outcome="no_spare", launch=1)))
    assert request_outcome(tmp_path, 42, "failslow-2") is None
    assert request_outcome(tmp_path, 42, "failslow-3") == "no_spare"


# -- generated malformed bytes: a record or one line, never another exception -----------------------
def _one_line(e: RecordRejected) -> None:
    assert str(e).startswith("couldn't") and "\n" not in str(e)


_STATUS = json.loads((FIXTURES / "shrink.status.json").read_text())
_REPORT = json.loads((FIXTURES / "shrink.relaunched-1.json").read_text())
_LAUNCH = json.loads((FIXTURES / "shrink.jsonl").read_text().splitlines()[1])


@given(garbage(_STATUS))
def test_status_reader(data: bytes) -> None:
    try:
        assert isinstance(decode_status(data, "s"), SupervisorStatus)
    except RecordRejected as e:
        _one_line(e)


@given(garbage(_REPORT))
def test_report_reader(data: bytes) -> None:
    try:
        assert decode_report(data, "r").at is not None
    except RecordRejected as e:
        _one_line(e)


@given(garbage({"id": "failslow-1", "replace": ["n4"], "at": "checkpoint", "shrink": False}))
def test_request_reader(data: bytes) -> None:
    try:
        assert decode_request(data, "q").replace
    except RecordRejected as e:
        _one_line(e)


@given(garbage(_LAUNCH))
def test_journal_line_reader(data: bytes) -> None:
    try:
        rec = decode_journal_line(data, "j")
    except RecordRejected as e:
        _one_line(e)
    else:
        assert type(rec).__struct_config__.tag in JOURNAL_KINDS


def test_the_hand_over_record_is_the_same_in_the_journal_and_the_status() -> None:
    assert SupervisorStatus.__annotations__["fallback"] == "FallbackRecord | None"
    assert FallbackRecord.__struct_config__.tag == "fallback"
    assert SupervisorReport.__struct_config__.forbid_unknown_fields
