"""The Slurm boundary against the real local Slurm 22.05 cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.slurm.allocation import AllocationView
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.types import Gres, JobState, NodeState

pytestmark = pytest.mark.cluster


def test_nodes_switches_and_gres(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    nodes = {n.name: n for n in backend.nodes()}
    assert set(nodes) >= set(slurm_cluster.nodes) and len(slurm_cluster.nodes) == 8
    assert all(n.gres == (Gres("gpu", "h100", 4),) for n in nodes.values())
    assert {n.leaf_switch for n in nodes.values()} == {"leaf1", "leaf2"}
    assert nodes["node1"].switch_path == ("root", "leaf1") and nodes["node8"].switch_path == ("root", "leaf2")
    assert {"vision", "text"} <= set(nodes["node3"].partitions)
    topo = backend.topology(refresh=True)
    assert topo.switches["root"].switches == ("leaf1", "leaf2")


def test_status_json(slurm_cluster) -> None:
    out = subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "cluster", "status", "--json",
                          "--state-dir", str(slurm_cluster.state_dir)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    doc = json.loads(out)
    assert doc["up"] is True
    assert len(doc["nodes"]) == 8 and all(n["gres"] == ["gpu:h100:4"] for n in doc["nodes"])
    assert {s["name"] for s in doc["switches"]} == {"leaf1", "leaf2", "root"}


def test_up_is_a_noop_when_running(slurm_cluster) -> None:
    before = slurm_cluster.cluster.running()
    assert slurm_cluster.cluster.up() is False
    assert slurm_cluster.cluster.running() == before


def test_het_job_lands_on_requested_nodes(slurm_cluster, tmp_path: Path) -> None:
    script = tmp_path / "het.sh"
    out = tmp_path / "het.out"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=omni-test-het
        #SBATCH --output={out}
        #SBATCH --partition=vision --nodes=1 --ntasks=1 --gres=gpu:h100:2 --nodelist=node2
        #SBATCH hetjob
        #SBATCH --partition=text --nodes=2 --ntasks=2 --ntasks-per-node=1 --gres=gpu:h100:4 --nodelist=node[6-7]
        srun --het-group=0,1 bash -c 'echo "ran $SLURM_HET_SIZE $SLURMD_NODENAME $SLURM_PROCID"'
        sleep 30
        """))
    backend = slurm_cluster.backend()
    job_id = backend.submit(str(script))
    try:
        job = wait_until(lambda: next((j for j in backend.jobs() if j.job_id == job_id
                                       and j.state is JobState.RUNNING), None), 60, "the het job to run")
        assert [c.het_offset for c in job.components] == [0, 1]
        assert job.components[0].job_id == job_id and job.components[1].job_id == job_id + 1
        assert job.components[0].nodes == ("node2",) and job.components[1].nodes == ("node6", "node7")
        assert [c.partition for c in job.components] == ["vision", "text"]
        lines = wait_until(lambda: out.exists() and out.read_text().count("ran ") == 3 and out.read_text(),
                           30, "srun output")
        ran = sorted(line.split()[2] for line in lines.splitlines() if line.startswith("ran "))
        assert ran == ["node2", "node6", "node7"]
    finally:
        backend.cancel(str(job_id))


def test_node_down_seen_with_reason(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    backend.set_node_state("node5", "DOWN", "omni-test: down with a reason")
    try:
        node = wait_until(lambda: next((n for n in backend.nodes() if n.name == "node5"
                                        and n.state is NodeState.DOWN), None), 20, "node5 DOWN")
        assert node.reason == "omni-test: down with a reason" and node.state.failed
    finally:
        backend.set_node_state("node5", "RESUME")
    wait_until(lambda: next((n for n in backend.nodes() if n.name == "node5" and n.state.usable), None),
               30, "node5 back in service")


def test_the_failed_among_a_jobs_nodes_are_read_after_a_fault(slurm_cluster) -> None:
    """What a relaunch must leave out, read after a task's exit: the down and the drained of the nodes
    asked, nothing of the others or of nodes not asked."""
    backend = slurm_cluster.backend()
    view = AllocationView(CommandRunner(slurm_cluster.env), "0")
    backend.set_node_state("node7", "DOWN", "omni-test: gone")
    backend.set_node_state("node8", "DRAIN", "omni-test: drained")
    try:
        failed = wait_until(lambda: (got := view.failed_among(["node2", "node7", "node8"]))
                            and len(got) == 2 and got, 20, "node7 and node8 failed")
        assert {(n.name, n.state) for n in failed} == {("node7", NodeState.DOWN), ("node8", NodeState.DRAINED)}
        assert all(n.state.failed for n in failed) and failed[0].reason.startswith("omni-test: ")
        assert view.failed_among(["node2", "node3"]) == [] and view.failed_among([]) == []
    finally:
        backend.set_node_state("node7", "RESUME")
        backend.set_node_state("node8", "RESUME")


def test_killed_slurmd_seen_as_not_responding(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    slurm_cluster.cluster.kill_daemon("slurmd:node8")
    try:
        node = wait_until(lambda: next((n for n in backend.nodes() if n.name == "node8"
                                        and "NOT_RESPONDING" in n.flags), None), 60, "node8 NOT_RESPONDING")
        assert node.state in (NodeState.NOT_RESPONDING, NodeState.DOWN) and node.state.failed
    finally:
        slurm_cluster.cluster.up()   # restarts only the missing slurmd
    wait_until(lambda: next((n for n in backend.nodes() if n.name == "node8" and n.state.usable), None),
               60, "node8 back after slurmd restart")
