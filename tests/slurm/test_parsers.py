"""Parsers against outputs recorded from the real local Slurm 22.05 cluster (tests/fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.gres import parse_gres
from slurm_omni.slurm.parse_json import parse_sinfo_json, parse_squeue_json
from slurm_omni.slurm.parse_text import nodes_from_sinfo, parse_nodes, parse_salloc_job_id, parse_topology
from slurm_omni.slurm.states import job_state, node_state, split_node_state
from slurm_omni.slurm.types import Gres, JobState, NodeState

REC = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05"


def read(name: str) -> str:
    return (REC / name).read_text()


def test_topology() -> None:
    topo = parse_topology(read("topology.txt"))
    assert set(topo.switches) == {"leaf1", "leaf2", "root"}
    assert topo.switches["leaf1"].nodes == ("node1", "node2", "node3", "node4")
    assert topo.switches["root"].switches == ("leaf1", "leaf2")
    assert topo.switches["root"].level == 1 and topo.switches["root"].nodes == ()
    assert topo.switch_path("node6") == ("root", "leaf2")
    assert topo.switch_path("elsewhere") == ()


def test_sinfo_idle() -> None:
    nodes = parse_sinfo_json(read("sinfo_idle.json"), parse_topology(read("topology.txt")))
    assert [n.name for n in nodes] == [f"node{i}" for i in range(1, 9)]
    assert all(n.state is NodeState.IDLE for n in nodes)
    assert all(n.gres == (Gres("gpu", "h100", 4),) for n in nodes)
    assert nodes[0].partitions == ("debug", "vision", "text")
    assert nodes[4].leaf_switch == "leaf2"


def test_sinfo_not_responding_and_drain() -> None:
    nodes = {n.name: n for n in parse_sinfo_json(read("sinfo_not_responding.json"))}
    assert nodes["node8"].state is NodeState.DOWN
    assert "NOT_RESPONDING" in nodes["node8"].flags and nodes["node8"].reason == "Not responding"
    assert nodes["node6"].state is NodeState.DRAINED and nodes["node6"].reason == "omni: quarantined"
    assert nodes["node4"].state is NodeState.MIXED


def test_squeue_het_and_array() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(read("squeue_het_array.json"))}
    het = jobs[1]
    assert het.is_het and [c.het_offset for c in het.components] == [0, 1]
    assert het.components[0].nodes == ("node1",) and het.components[1].nodes == ("node2", "node3")
    assert het.components[1].partition == "text" and het.state is JobState.RUNNING
    arrays = sorted((j.array_job_id, j.array_task_id, j.array_ref) for j in jobs.values() if j.array_job_id)
    assert arrays == [(3, 0, "3_0"), (3, 1, "3_1"), (3, 2, "3_2")]
    assert het.array_job_id is None and het.restart_count == 0


def test_squeue_requeued() -> None:
    (het,) = [j for j in parse_squeue_json(read("squeue_requeued.json")) if j.is_het]
    assert het.state is JobState.PENDING and het.restart_count == 1 and het.nodes == ()


def test_squeue_empty() -> None:
    assert parse_squeue_json(read("squeue_empty.json")) == []


def test_scontrol_nodes() -> None:
    topo = parse_topology(read("topology.txt"))
    nodes = {n.name: n for n in parse_nodes(read("nodes_idle.txt"), topo)}
    assert len(nodes) == 8 and nodes["node2"].cpus == 4 and nodes["node2"].switch_path == ("root", "leaf1")
    down = {n.name: n for n in parse_nodes(read("nodes_down_drain.txt"))}
    assert down["node6"].reason == "omni: quarantined" and down["node6"].state is NodeState.DRAINED
    (nr,) = parse_nodes(read("node_not_responding.txt"))
    assert nr.state is NodeState.DOWN and nr.flags == frozenset({"NOT_RESPONDING"})


@pytest.mark.parametrize("text, state", [
    ("IDLE", NodeState.IDLE), ("idle*", NodeState.NOT_RESPONDING), ("MIXED+DRAIN", NodeState.DRAINING),
    ("IDLE+DRAIN", NodeState.DRAINED), ("DOWN+NOT_RESPONDING", NodeState.DOWN), ("ALLOCATED", NodeState.ALLOCATED),
    ("IDLE+FAIL", NodeState.FAIL), ("PLANNED", NodeState.UNKNOWN), ("weird", NodeState.UNKNOWN),
])
def test_node_states(text: str, state: NodeState) -> None:
    assert node_state(*split_node_state(text)) is state


@pytest.mark.parametrize("text, state", [
    ("RUNNING", JobState.RUNNING), ("NODE_FAIL", JobState.NODE_FAIL), ("REQUEUE_HOLD", JobState.REQUEUED),
    ("something_new", JobState.UNKNOWN),
])
def test_job_states(text: str, state: JobState) -> None:
    assert job_state(text) is state


@pytest.mark.parametrize("text, gres", [
    ("gpu:h100:4", (Gres("gpu", "h100", 4),)),
    ("gpu:4", (Gres("gpu", None, 4),)),
    ("gpu:h100:4(S:0-1),mps:100", (Gres("gpu", "h100", 4), Gres("mps", None, 100))),
    ("(null)", ()),
])
def test_gres(text: str, gres: tuple[Gres, ...]) -> None:
    assert parse_gres(text) == gres


@pytest.mark.parametrize("text", ["not json", "[]", '{"errors": [{"error": "boom"}], "nodes": []}'])
def test_bad_json(text: str) -> None:
    with pytest.raises(SlurmError, match="sinfo"):
        parse_sinfo_json(text)


@pytest.mark.parametrize(("text", "job_id"), [
    ("salloc: Pending job allocation 2001\nsalloc: job 2001 queued and waiting for resources\n", 2001),
    ("salloc: Granted job allocation 8001\n", 8001),
    ("salloc: Required node not available (down, drained or reserved)\nsalloc: Pending job allocation 12\n", 12),
    ("salloc: error: Job submit/allocate failed: Invalid partition name specified\n", None),
    ("", None),
    ("salloc: Granted job allocation 12x\n", None),
])
def test_salloc_job_id(text: str, job_id: int | None) -> None:
    assert parse_salloc_job_id(text) == job_id


def test_sinfo_node_lines_recorded() -> None:
    """``sinfo --Node --nodes=NAMES --Format=SINFO_NODE_LINES`` of three nodes (22.05, recorded): a line per
    partition, merged; the reason may hold the separator; "none" is no reason."""
    nodes = {n.name: n for n in nodes_from_sinfo(read("sinfo_one_node.txt"))}
    assert list(nodes) == ["node60", "node61", "node2"]
    down, drained, busy = nodes["node60"], nodes["node61"], nodes["node2"]
    assert (down.state, down.slurm_state, down.reason) == (NodeState.DOWN, "DOWN", "lost | by drill")
    assert down.partitions == ("debug", "vision", "text") and down.cpus == 4 and down.gres == ()
    assert (drained.state, drained.flags, drained.reason) == (NodeState.DRAINED, frozenset({"DRAIN"}), "drained by admin")
    assert (busy.state, busy.reason) == (NodeState.MIXED, "")


@pytest.mark.parametrize(("line", "state", "gres"), [
    ("n1|allocated+drain|8|gpu:h100:4(S:0)|p|why", NodeState.DRAINING, (Gres("gpu", "h100", 4),)),
    ("n1|down+not_responding|8|(null)|p*|Not responding", NodeState.DOWN, ()),
    ("n1|idle*|8|(null)|p|none", NodeState.NOT_RESPONDING, ()),
    ("n1|idle+fail|8|(null)|p|bad gpu", NodeState.FAIL, ()),
])
def test_sinfo_one_node_states(line: str, state: NodeState, gres: tuple[Gres, ...]) -> None:
    (node,) = nodes_from_sinfo(line + "\n")
    assert (node.name, node.state, node.gres) == ("n1", state, gres)


def test_sinfo_one_node_switch_path_and_nothing() -> None:
    topo = parse_topology(read("topology.txt"))
    (node,) = nodes_from_sinfo("node6|idle|4|(null)|debug*|none\n", topo)
    assert node.switch_path == ("root", "leaf2")
    assert nodes_from_sinfo("") == []   # a node Slurm does not know: sinfo prints nothing


def test_a_node_whose_slurmd_was_killed_under_a_step_recorded() -> None:
    """22.05, recorded on the embedded cluster: node2's slurmd SIGKILLed under a step; 20 s later (the
    SlurmdTimeout) one-node ``sinfo`` printed the node ``mixed+not_responding`` with the DOWN's reason
    (sinfo's own ``mixed``, slurm/parse_text.py), ``scontrol show node`` 17 ms later DOWN+NOT_RESPONDING:
    neither reads as usable."""
    (line,) = nodes_from_sinfo(read("sinfo_one_node_slurmd_killed.txt"))
    (record,) = parse_nodes(read("node_slurmd_killed_down.txt"))
    assert (line.state, line.flags, line.reason) == (NodeState.NOT_RESPONDING, frozenset({"NOT_RESPONDING"}),
                                                     "Not responding")
    assert (record.state, record.reason) == (NodeState.DOWN, "Not responding")
    assert not line.state.usable and not record.state.usable


@pytest.mark.parametrize("text", ["node1|idle|4\n", "|idle|4|(null)|p|none\n", "node1||4|(null)|p|none\n"])
def test_sinfo_one_node_bad_line(text: str) -> None:
    with pytest.raises(SlurmError, match="sinfo: couldn't parse a node line"):
        nodes_from_sinfo(text)
