"""The same parsers on outputs recorded from the real daemons of every version the embedded cluster
runs (tests/fixtures/slurm-<version>/, made by scripts/record-slurm-fixtures.sh), plus the shapes
that changed after 22.05: job_state lists, {set, infinite, number} numbers, sinfo rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.parse_json import (
    number,
    parse_sinfo_json,
    parse_squeue_json,
    read_sinfo_json,
    read_squeue_json,
)
from slurm_omni.slurm.parse_text import parse_nodes, parse_topology
from slurm_omni.slurm.states import job_state_of, node_state, split_state_list
from slurm_omni.slurm.types import Gres, Job, JobState, NodeState

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NEWER = ["24.11", "26.05"]


def read(version: str, name: str) -> str:
    return (FIXTURES / f"slurm-{version}" / name).read_text()


@pytest.mark.parametrize("version", NEWER)
def test_recorded_by_that_version(version: str) -> None:
    assert read(version, "VERSION").split()[1].startswith(version + ".")
    meta = json.loads(read(version, "sinfo_idle.json"))["meta"]
    assert meta["slurm"]["release"].startswith(version + ".")


@pytest.mark.parametrize("version", ["22.05", *NEWER])
def test_topology_every_version(version: str) -> None:
    topo = parse_topology(read(version, "topology.txt"))
    assert topo.switches["leaf1"].nodes == ("node1", "node2", "node3", "node4")
    assert topo.switches["root"].switches == ("leaf1", "leaf2") and topo.switches["root"].nodes == ()
    assert topo.switch_path("node6") == ("root", "leaf2")


@pytest.mark.parametrize("version", NEWER)
@pytest.mark.parametrize("name", ["sinfo_idle.json", "scontrol_nodes_idle.json"])
def test_nodes_idle(version: str, name: str) -> None:
    nodes = parse_sinfo_json(read(version, name), parse_topology(read(version, "topology.txt")))
    assert sorted(n.name for n in nodes) == [f"node{i}" for i in range(1, 9)]
    assert all(n.state is NodeState.IDLE and n.flags == frozenset() for n in nodes)
    assert all(n.gres == (Gres("gpu", "h100", 4),) and n.cpus == 4 for n in nodes)
    assert all(n.partitions == ("debug", "vision", "text") for n in nodes)
    assert {n.name: n.leaf_switch for n in nodes}["node5"] == "leaf2"


@pytest.mark.parametrize("version", NEWER)
@pytest.mark.parametrize("name", ["sinfo_down_drain.json", "scontrol_nodes_down_drain.json"])
def test_nodes_down_and_drain(version: str, name: str) -> None:
    nodes = {n.name: n for n in parse_sinfo_json(read(version, name))}
    assert nodes["node2"].state is NodeState.DOWN and nodes["node2"].reason == "omni: drill"
    assert nodes["node6"].state is NodeState.DRAINED and nodes["node6"].reason == "omni: quarantined"
    assert nodes["node5"].state is NodeState.DRAINING and nodes["node5"].slurm_state == "MIXED+DRAIN"
    assert nodes["node1"].state is NodeState.IDLE and len(nodes) == 8


@pytest.mark.parametrize("version", NEWER)
def test_node_not_responding(version: str) -> None:
    nodes = {n.name: n for n in parse_sinfo_json(read(version, "sinfo_not_responding.json"))}
    assert nodes["node8"].state is NodeState.DOWN and "NOT_RESPONDING" in nodes["node8"].flags
    assert nodes["node8"].reason == "Not responding" and nodes["node8"].state.failed
    (text,) = parse_nodes(read(version, "node_not_responding.txt"))
    assert text.state is NodeState.DOWN and text.flags == frozenset({"NOT_RESPONDING"})


@pytest.mark.parametrize("version", NEWER)
def test_allocated_nodes(version: str) -> None:
    nodes = {n.name: n for n in parse_sinfo_json(read(version, "sinfo_allocated.json"))}
    # Backfill marks the het job's nodes PLANNED on 24.11+: a flag that changes nothing here.
    assert {nodes[n].state for n in ("node1", "node2", "node3", "node4")} == {NodeState.MIXED}
    assert nodes["node8"].state is NodeState.IDLE
    (node4,) = parse_nodes(read(version, "node_allocated.txt"))
    assert node4.state is NodeState.MIXED


@pytest.mark.parametrize("version", NEWER)
def test_scontrol_node_text(version: str) -> None:
    topo = parse_topology(read(version, "topology.txt"))
    nodes = {n.name: n for n in parse_nodes(read(version, "nodes_idle.txt"), topo)}
    assert len(nodes) == 8 and nodes["node2"].cpus == 4 and nodes["node2"].switch_path == ("root", "leaf1")
    assert nodes["node2"].gres == (Gres("gpu", "h100", 4),)
    down = {n.name: n for n in parse_nodes(read(version, "nodes_down_drain.txt"))}
    assert down["node6"].reason == "omni: quarantined" and down["node6"].state is NodeState.DRAINED
    assert down["node2"].state is NodeState.DOWN


@pytest.mark.parametrize("version", NEWER)
def test_squeue_het_and_array(version: str) -> None:
    jobs = parse_squeue_json(read(version, "squeue_het_array.json"))
    (het,) = [j for j in jobs if j.is_het]
    assert [c.het_offset for c in het.components] == [0, 1] and het.state is JobState.RUNNING
    assert het.components[0].nodes == ("node1",) and het.components[1].nodes == ("node2", "node3")
    assert [c.partition for c in het.components] == ["vision", "text"]
    assert het.components[1].job_id == het.job_id + 1 and het.components[1].het_job_id == het.job_id
    assert het.array_job_id is None and het.restart_count == 0 and het.slurm_state == "RUNNING"
    tasks = sorted((j.array_task_id, j.nodes) for j in jobs if j.array_job_id)
    assert tasks == [(0, ("node4",)), (1, ("node4",)), (2, ("node4",))]
    assert len({j.array_job_id for j in jobs if j.array_job_id}) == 1


@pytest.mark.parametrize("version", ["22.05", *NEWER])
def test_squeue_batch_host(version: str) -> None:
    # where the batch script (and an in-allocation job's step supervisor) runs
    jobs = parse_squeue_json(read(version, "squeue_het_array.json"))
    (het,) = [j for j in jobs if j.is_het]
    assert het.batch_host == "node1" == het.components[0].nodes[0]
    assert {j.batch_host for j in jobs if j.array_job_id} == {"node4"}


@pytest.mark.parametrize("version", NEWER)
def test_squeue_requeued(version: str) -> None:
    (het,) = [j for j in parse_squeue_json(read(version, "squeue_requeued.json")) if j.is_het]
    assert het.state is JobState.PENDING and het.restart_count == 1 and het.nodes == ()


@pytest.mark.parametrize("version", NEWER)
def test_squeue_empty(version: str) -> None:
    assert parse_squeue_json(read(version, "squeue_empty.json")) == []


def _cancel_fixture(version: str, name: str) -> Job | None:
    return next((j for j in parse_squeue_json(read(version, name)) if j.name == "fixture-cancel"), None)


@pytest.mark.parametrize("version", ["22.05", *NEWER])
def test_a_het_job_its_user_cancelled(version: str) -> None:
    # scancel of a het job whose batch shell takes a while to stop: the leader COMPLETING (24.11+:
    # ["CANCELLED", "COMPLETING"]) while the other component is CANCELLED already; the job as a
    # unit is CANCELLED (its worst component), which is what the manager reads as "cancelled in Slurm".
    stopping = _cancel_fixture(version, "squeue_cancelling.json")
    assert stopping is not None and stopping.is_het
    assert [c.state for c in stopping.components] == [JobState.COMPLETING, JobState.CANCELLED]
    assert stopping.slurm_state == ("COMPLETING" if version == "22.05" else "CANCELLED+COMPLETING")
    assert stopping.state is JobState.CANCELLED and stopping.state.finished
    ended = _cancel_fixture(version, "squeue_cancelled.json")   # squeue --json --states=all
    assert ended is not None and ended.state is JobState.CANCELLED
    assert {c.state for c in ended.components} == {JobState.CANCELLED} and ended.restart_count == 0


@pytest.mark.parametrize("version", ["22.05", *NEWER])
def test_plain_squeue_json_drops_ended_jobs_after_22_05(version: str) -> None:
    # Why CliBackend.jobs() asks for --states=all: without it 24.11+ list no ended job at all, and a
    # cancelled job looked as if it had left the queue without a word.
    default = _cancel_fixture(version, "squeue_cancelled_default_filter.json")
    assert (default is not None) is (version == "22.05")


@pytest.mark.parametrize("version", NEWER)
def test_unreachable_exits_nonzero(version: str) -> None:
    # 22.05 printed an error document and exited 0; 24.11 and 26.05 exit 1 and print nothing on stdout.
    assert read(version, "sinfo_unreachable.rc").strip() == "1"
    assert "Unable to contact slurm controller" in read(version, "sinfo_unreachable.stderr")


@pytest.mark.parametrize("words, state", [
    (["RUNNING"], JobState.RUNNING), (["PENDING", "REQUEUED"], JobState.REQUEUED),
    (["PENDING", "REQUEUE_HOLD"], JobState.REQUEUED), (["RUNNING", "COMPLETING"], JobState.COMPLETING),
    (["NODE_FAIL", "COMPLETING"], JobState.COMPLETING), (["CANCELLED"], JobState.CANCELLED),
    (["RUNNING", "UPDATE_DB"], JobState.RUNNING), (["PENDING", "CONFIGURING"], JobState.PENDING),
    (["RUNNING", "STOPPED"], JobState.SUSPENDED), (["SOMETHING_NEW"], JobState.UNKNOWN),
    (["NODE_FAIL"], JobState.NODE_FAIL), (["OUT_OF_MEMORY"], JobState.OUT_OF_MEMORY),
])
def test_job_state_lists(words: list[str], state: JobState) -> None:
    assert job_state_of(words) is state


@pytest.mark.parametrize("words, state", [
    (["IDLE"], NodeState.IDLE), (["IDLE", "DRAIN"], NodeState.DRAINED), (["MIXED", "DRAIN"], NodeState.DRAINING),
    (["DOWN", "NOT_RESPONDING"], NodeState.DOWN), (["IDLE", "NOT_RESPONDING"], NodeState.NOT_RESPONDING),
    (["MIXED", "PLANNED"], NodeState.MIXED), (["ALLOCATED", "COMPLETING"], NodeState.ALLOCATED),
    (["IDLE", "FAIL"], NodeState.FAIL), (["PLANNED"], NodeState.UNKNOWN),
])
def test_node_state_lists(words: list[str], state: NodeState) -> None:
    assert node_state(*split_state_list(words, node=True)) is state


@pytest.mark.parametrize("value, expected", [
    (5, 5), ("7", 7), ({"set": True, "infinite": False, "number": 3}, 3),
    ({"set": False, "infinite": False, "number": 0}, None), ({"set": True, "infinite": True, "number": 0}, None),
    (None, None), ("", None),
])
def test_numbers(value: object, expected: int | None) -> None:
    assert number(value) == expected


@pytest.mark.parametrize("doc, match", [
    ({"jobs": [{"job_id": {"set": True, "number": 4}, "job_state": {"current": "RUNNING"}}]},
     "job 4: couldn't read job 4 job_state"),
    ({"jobs": [{"job_id": [1]}]}, "a job record: couldn't read job_id"),
    ({"jobs": [{"job_id": 4, "het_job_id": {"set": True, "infinite": False, "number": "x"}}]}, "het_job_id"),
    ({"jobs": [{"job_id": 4, "job_state": ["RUNNING"], "nodes": 17}]}, "nodes"),
])
def test_a_job_record_of_unknown_shape_is_skipped_with_one_line(doc: object, match: str) -> None:
    read = read_squeue_json(json.dumps(doc))
    assert read.jobs == [] and parse_squeue_json(json.dumps(doc)) == []
    (skipped,) = read.skipped
    line = skipped.line("squeue")
    assert line.startswith("squeue: skipped ") and match in line and "\n" not in line


def test_jobs_of_unknown_shape_are_one_error() -> None:
    with pytest.raises(SlurmError, match="\"jobs\" is dict") as e:
        parse_squeue_json(json.dumps({"jobs": {"4": {}}}))
    assert str(e.value).startswith("squeue: couldn't") and "\n" not in str(e.value)


@pytest.mark.parametrize("doc, match", [
    ({"meta": {}, "sinfo_rows": []}, "neither"),
    ({"sinfo": [{"nodes": {"nodes": ["node1"]}, "node": {"state": "IDLE?"}}]}, None),
    ({"sinfo": [{"nodes": ["node1"]}]}, "nodes.nodes"),
    ({"sinfo": [{"nodes": {"nodes": ["node1"]}, "node": {"state": [3]}}]}, "state"),
    ({"nodes": [{"name": "node1", "state": {"base": "IDLE"}}]}, "node node1 state"),
    ({"nodes": [{"state": ["IDLE"]}]}, "name"),
])
def test_unknown_node_shapes_are_one_line(doc: object, match: str | None) -> None:
    if match is None:   # a state word nobody knows is UNKNOWN, not an error
        (node,) = parse_sinfo_json(json.dumps(doc))
        assert node.state is NodeState.UNKNOWN
        return
    if match == "neither":   # no known shape at all: one error
        with pytest.raises(SlurmError, match=match) as e:
            parse_sinfo_json(json.dumps(doc))
        assert str(e.value).startswith("sinfo: couldn't") and "\n" not in str(e.value)
        return
    read = read_sinfo_json(json.dumps(doc))      # one record: skipped, the others still read
    assert read.nodes == []
    (skipped,) = read.skipped
    assert match in skipped.line("sinfo") and "\n" not in skipped.line("sinfo")


@pytest.mark.parametrize("text", ["gres:gpu:h100:4", "gres/gpu:h100:4"])
def test_tres_gres_both_spellings(text: str) -> None:
    # scontrol show job TresPerNode: gres:gpu:... on 22.05, gres/gpu:... on 24.11 and 26.05
    from slurm_omni.slurm.gres import parse_gres
    assert parse_gres(text) == (Gres("gpu", "h100", 4),)


@pytest.mark.parametrize("node", [["IDLE"], "idle", 3])
def test_a_row_whose_node_is_not_an_object_is_skipped(node: object) -> None:
    # Found by the property test: a v0.0.40+ row's "node" given as a list was an AttributeError.
    doc = {"meta": {}, "sinfo": [{"nodes": {"nodes": ["node1"]}, "node": node},
                                 {"nodes": {"nodes": ["node2"]}, "node": {"state": ["IDLE"]}}]}
    read = read_sinfo_json(json.dumps(doc))
    assert [n.name for n in read.nodes] == ["node2"]
    (skipped,) = read.skipped
    assert "expected an object" in skipped.error
