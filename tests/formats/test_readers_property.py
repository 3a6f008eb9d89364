"""Every reader of a file another process wrote, fed generated malformed bytes: a record or the
reader's own one-line error, never another exception (RecursionError, ValueError, TypeError...)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from malformed_inputs import garbage, mutated

from slurm_omni.drill.history import HistoryError, load_history
from slurm_omni.formats import RecordRejected
from slurm_omni.formats.heartbeat import HeartbeatRecord
from slurm_omni.formats.registry import RegistryRecord
from slurm_omni.formats.spool import FaultRecord, NodeEvent
from slurm_omni.formats.start_failure import StartFailureRecord, decode_start_failure, encode_start_failure
from slurm_omni.manager import events
from slurm_omni.manager.events import EventRejected
from slurm_omni.manager.registry import parse_record
from slurm_omni.report.inputs import load_heartbeats, load_metrics
from slurm_omni.report.timeline import ReportInputError, load_timeline

NODE_EVENT = {"version": 1, "kind": "down", "nodes": "n[1-2]", "time": 5.0}
FAULT = {"version": 1, "kind": "task_exit", "job_id": 43, "het_job_id": 42, "het_offset": 1, "step_id": 0,
         "node": "n3", "stage": "text", "stage_index": 1, "stage_rank": 2, "task_id": 5, "local_task_id": 1,
         "pid": 77, "exit_code": None, "signal": 9, "core_dumped": False, "time": "2026-11-30T00:00:00.120Z",
         "time_unix": 1764460800.12}
BEAT = {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42", "step": 17,
        "phase": "training", "time": 1764460000.12, "step_time_s": 0.031, "last_checkpoint_step": 10, "beats": 9}
REGISTRY = {"format": 1, "job_id": 12, "kind": "het", "name": "omni-tiny", "cluster": "omni", "user": "alice",
            "submitted_at": "2026-11-30T00:40:00Z", "job_file": "/abs/job.toml", "job_sha256": "ab",
            "script": None, "ckpt_dir": "/ckpt/omni-tiny", "data_parallel_size": 1, "max_requeues": 3,
            "stages": [{"het_group": 0, "name": "vision", "partition": "vision", "nodes": 1, "tasks_per_node": 1,
                        "gres": "gpu:h100:4", "switches": 1}],
            "array_tasks": None, "incarnation_base": 0, "environment": {"PATH": "/usr/bin"}}
METRIC = {"time": 1764460000.0, "rank": 0, "stage": 1, "dp_rank": 0, "incarnation": 0, "step": 3, "loss": 2.5,
          "step_time_seconds": 0.2, "data_parallel_size": 1}
START_FAILURE = {"job_id": "42", "incarnation": 1, "launch": 1, "exit_code": 1,
                 "line": "ModuleNotFoundError: No module named 'x'", "log": "/c/supervisor/omni-42-launch-1.log",
                 "time": 1764460000.5, "stopped": ""}
SAMPLES = {"step": 3, "ids": [1, 2], "dp_rank": 0, "incarnation": 0}


@pytest.mark.parametrize("valid, parse, kind", [
    (NODE_EVENT, events.parse_node_event, NodeEvent), (FAULT, events.parse_fault_record, FaultRecord),
    (BEAT, events.parse_heartbeat, HeartbeatRecord)])
def test_the_valid_records_the_generators_start_from_parse(valid, parse, kind) -> None:
    assert isinstance(parse(json.dumps(valid).encode()), kind)
    assert isinstance(parse_record(json.dumps(REGISTRY).encode(), "12.json"), RegistryRecord)


@given(garbage(NODE_EVENT))
def test_node_event_reader(data: bytes) -> None:
    try:
        event = events.parse_node_event(data)
    except EventRejected as e:
        assert str(e).startswith("events: couldn't") and "\n" not in str(e)
    else:
        assert event.node_names and len(event.node_names) <= 1_000_000


@given(garbage(FAULT))
def test_fault_record_reader(data: bytes) -> None:
    try:
        record = events.parse_fault_record(data)
    except EventRejected as e:
        assert str(e).startswith("events: couldn't")
    else:
        assert isinstance(record.job_id, int) and (record.exit_code is None) != (record.signal is None)


@given(garbage(BEAT))
def test_heartbeat_reader(data: bytes) -> None:
    try:
        beat = events.parse_heartbeat(data)
    except EventRejected as e:
        assert str(e).startswith("events: couldn't")
    else:
        assert isinstance(beat.step, int) and beat.phase in events.HEARTBEAT_PHASES


@given(garbage(START_FAILURE))
def test_start_failure_reader(data: bytes) -> None:
    try:
        record = decode_start_failure(data, "failed-42-1.json")
    except RecordRejected as e:
        assert "failed-42-1.json" in str(e) and "\n" not in str(e)
    else:
        assert 0 <= record.exit_code <= 255 and record.incarnation >= 0
        assert decode_start_failure(encode_start_failure(record)) == record


def test_a_start_failure_round_trips() -> None:
    record = decode_start_failure(json.dumps(START_FAILURE).encode())
    assert isinstance(record, StartFailureRecord) and record.line.startswith("ModuleNotFoundError")
    assert decode_start_failure(encode_start_failure(record)) == record


@given(garbage(REGISTRY))
def test_registry_reader(data: bytes) -> None:
    try:
        job = parse_record(data, "12.json")
    except EventRejected as e:
        assert str(e).startswith("registry: couldn't")
    else:
        assert job.job_id >= 1 and job.stages


@given(st.lists(garbage(METRIC) | mutated(METRIC), min_size=1, max_size=3), garbage(BEAT))
def test_report_readers(tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], beat: bytes) -> None:
    folder = tmp_path_factory.mktemp("report")
    (folder / "metrics-text-0.jsonl").write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    (folder / "rank-0.json").write_bytes(beat)
    (folder / "timeline.json").write_bytes(lines[0])
    for read in (lambda: load_metrics([folder]), lambda: load_heartbeats(folder),
                 lambda: load_timeline(folder / "timeline.json")):
        try:
            read()
        except ReportInputError as e:
            assert str(e).startswith("report: couldn't")


@given(st.lists(garbage(METRIC), min_size=1, max_size=3), st.lists(garbage(SAMPLES), max_size=3))
def test_drill_history_reader(tmp_path_factory: pytest.TempPathFactory, lines: list[bytes],
                              traces: list[bytes]) -> None:
    folder = tmp_path_factory.mktemp("history")
    (folder / "metrics-text-0.jsonl").write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n")
    (folder / "samples-text-0.jsonl").write_bytes(b"\n".join(t.replace(b"\n", b" ") for t in traces) + b"\n")
    try:
        history = load_history(folder)
    except HistoryError as e:
        assert str(e).startswith("drill: couldn't")
    else:
        history.effective()
        history.ids("text")


@pytest.mark.parametrize("parse", [events.parse_node_event, events.parse_fault_record, events.parse_heartbeat])
def test_nested_3000_deep_is_one_clear_error(parse) -> None:
    deep = b"[" * 3000 + b"]" * 3000
    for data in (deep, b'{"version": 1, "kind": ' + deep + b"}", b'{"x": ' + deep + b"}"):
        with pytest.raises(EventRejected, match="couldn't"):
            parse(data)
