"""The supervisor's journal (replay, torn lines) and the status file it derives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_omni.formats import RecordRejected
from slurm_omni.policy.in_allocation import StepLayout
from slurm_omni.supervisor.journal import (
    SupervisorJournal,
    layout_to_json,
    read_request,
    read_status,
    status_document,
    write_status,
)

L0 = StepLayout((("n1", "n2"), ("n3", "n4")), ("n5", "n6"), (), 2, {})
L1 = StepLayout((("n1", "n2"), ("n3", "n5")), ("n6",), ("n4",), 2, {})


def _journal(path: Path) -> SupervisorJournal:
    j = SupervisorJournal(path)
    j.append("allocation", nodes=["n1", "n2", "n3", "n4", "n5", "n6"])
    j.append("launch", launch=0, layout=layout_to_json(L0), data_parallel_size=2, port=20000, incarnation=0,
             cause="", removed=[], added=[], time=100.0)
    j.append("launched", launch=0, pid=123)
    j.append("ended", launch=0, rc=137)
    j.append("confirmed", launch=0, cause="down", nodes=["n4"], fault_at=101.0, confirmed_at=101.5)
    j.append("launch", launch=1, layout=layout_to_json(L1), data_parallel_size=2, port=20001, incarnation=1,
             cause="down", removed=["n4"], added=["n5"], time=101.6)
    return j


def test_replay_gives_the_same_state_and_ignores_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "sup" / "7.jsonl"
    j = _journal(path)
    with open(path, "ab") as f:
        f.write(b'{"kind": "launched", "launch": 1, "pi')     # a crash mid-write
    again = SupervisorJournal(path)
    assert again.state.allocation == j.state.allocation
    assert [la.number for la in again.state.launches] == [0, 1]
    cur = again.state.current
    assert cur is not None and cur.layout == L1 and cur.pid is None and cur.ended is None
    assert again.state.launches[0].ended == 137 and again.state.launches[0].confirmed is not None


def test_a_launchs_start_failure_is_replayed_for_a_restarted_supervisor(tmp_path: Path) -> None:
    """The launch before is what the next failure is compared with (policy/start_failure.py)."""
    path = tmp_path / "sup" / "8.jsonl"
    j = _journal(path)
    j.append("start_failure", launch=0, exit_code=1, line="ModuleNotFoundError: No module named 'x'", log="/l0.log")
    again = SupervisorJournal(path)
    first, second = again.state.launches
    assert first.start_failure is not None and first.start_failure.line == "ModuleNotFoundError: No module named 'x'"
    assert first.start_failure.exit_code == 1 and second.start_failure is None


def test_status_lists_each_in_allocation_recovery(tmp_path: Path) -> None:
    j = _journal(tmp_path / "7.jsonl")
    j.append("first_step", launch=1, at=103.0, step=21)
    doc = status_document(j.state, job_id="7", phase="running", now=104.0)
    assert doc.path == "in_allocation" and doc.spares_left == 1 and doc.failed_nodes == ["n4"]
    (rec,) = doc.recoveries
    assert rec.slurm_job_id == rec.slurm_job_id_after == "7"
    assert (rec.removed, rec.added, rec.cause) == (["n4"], ["n5"], "down")
    assert rec.fault_at == 101.0 and rec.first_step_at == 103.0
    write_status(tmp_path / "7.status.json", doc)
    assert read_status(tmp_path / "7.status.json") == doc
    assert json.loads((tmp_path / "7.status.json").read_text())["recoveries"][0]["data_parallel_size_after"] == 2
    assert read_status(tmp_path / "missing.json") is None


def test_requests_must_name_an_id_and_nodes(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"id": "slow-1", "replace": ["n3"]}')
    req = read_request(path)
    assert req is not None and (req.id, req.replace, req.shrink) == ("slow-1", ["n3"], False)
    for bad in ('{"replace": ["n3"]}', '{"id": "", "replace": ["n3"]}', '{"id": "x", "replace": "n3"}', "[", "",
                '{"id": "x", "replace": []}', '{"id": "x", "replace": ["n3"], "shrink": "yes"}',
                '{"id": "x", "replace": ["n3"], "now": true}', '{"id": "x", "id": "y", "replace": ["n3"]}'):
        path.write_text(bad)
        assert read_request(path) is None


def test_a_restarted_supervisor_knows_its_pools_and_a_spanning_launchs_sruns(tmp_path: Path) -> None:
    path = tmp_path / "7.jsonl"
    j = SupervisorJournal(path)
    j.append("pool", event="asking", name="omni-7-pool-0", nodes_asked=1)
    j.append("pool", event="requested", name="omni-7-pool-0", job="8")
    j.append("pool", event="granted", name="omni-7-pool-0", job="8", nodes=["node5"], kind_of={"node5": ""})
    j.append("pool", event="asking", name="omni-7-pool-1")
    layout = StepLayout((("node1", "node5"),), (), ())
    j.append("launch", launch=0, layout=layout_to_json(layout), data_parallel_size=2, port=1, incarnation=0)
    j.append("launched", launch=0, pid=11, pid_start=5, extra=[{"job": "8", "pid": 12, "pid_start": 6}])
    again = SupervisorJournal(path).state
    pool = again.pools["omni-7-pool-0"]
    assert (pool.job_id, pool.state, pool.nodes, pool.open) == ("8", "granted", ("node5",), True)
    assert again.pools["omni-7-pool-1"].state == "asking" and list(again.pools) == ["omni-7-pool-0", "omni-7-pool-1"]
    assert again.current is not None and again.current.extra == (("8", 12, 6),)
    doc = status_document(again, job_id="7", phase="running", now=1.0)
    assert [(p.name, p.slurm_job_id, p.state, p.nodes) for p in doc.pools] == [
        ("omni-7-pool-0", "8", "granted", ["node5"]), ("omni-7-pool-1", "", "asking", [])]
    with pytest.raises(RecordRejected, match="pool"):      # an event the schema does not have
        j.append("pool", event="bogus", name="omni-7-pool-1")
