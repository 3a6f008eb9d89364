"""The kept ``scontrol`` (``runner.ScontrolSession``) against the real cluster: the same records as a
command of its own, one answer per read however many came before, Slurm's error as one line, and the
command as before wherever the session cannot serve."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.allocation import AllocationView
from slurm_omni.slurm.parse_text import parse_records
from slurm_omni.slurm.runner import CommandRunner, ScontrolSession

pytestmark = pytest.mark.cluster


def test_a_session_answers_each_read_as_scontrol_does_and_survives_slurm_s_error(slurm_cluster) -> None:
    runner = CommandRunner(slurm_cluster.env)
    session = ScontrolSession(runner)
    try:
        assert session.warm()   # started and answering before the first read
        for _ in range(3):   # each answer its own: nothing of one read is left for the next
            text = session.show_node("node2", 30)
            assert text is not None
            assert [r["NodeName"] for r in parse_records(text, "NodeName")] == ["node2"]
        several = session.show_node("node[1-3]", 30)
        assert several is not None
        alone = runner.run(["scontrol", "show", "node", "node[1-3]"]).stdout
        assert [r["NodeName"] for r in parse_records(several, "NodeName")] == \
            [r["NodeName"] for r in parse_records(alone, "NodeName")] == ["node1", "node2", "node3"]
        with pytest.raises(SlurmError, match="couldn't show node: .*node99"):
            session.show_node("node99", 30)
        again = session.show_node("node1", 30)   # the same process goes on after Slurm's error
        assert again is not None and parse_records(again, "NodeName")[0]["NodeName"] == "node1"
        # what could end the line or start another command is never written to it: the caller runs it
        assert session.show_node("node1\nshow config", 30) is None
        assert session.show_node("node1 node2", 30) is None
    finally:
        session.close()
    assert session.show_node("node4", 30) is not None   # after close, the next read starts a new one
    session.close()


def test_the_allocation_reads_few_nodes_through_its_session_and_the_rest_as_commands(slurm_cluster) -> None:
    runner = CommandRunner(slurm_cluster.env)
    session = ScontrolSession(runner)
    view = AllocationView(runner, "0", session)
    try:
        view.topology()   # read once, as a command
        calls = runner.calls
        nodes, _, addrs = view.node_info(["node5"])
        assert [n.name for n in nodes] == ["node5"] and addrs["node5"]
        assert runner.calls == calls + 1   # the session's one read
        nodes, _, _ = view.node_info([f"node{k}" for k in range(1, 9)])
        assert [n.name for n in nodes] == [f"node{k}" for k in range(1, 9)]
    finally:
        session.close()


def test_without_stdbuf_the_session_steps_aside() -> None:
    session = ScontrolSession(CommandRunner({"PATH": "/nonexistent"}), node_reader=False)
    assert session.show_node("node1", 5) is None and not session.usable


def test_a_session_whose_slurmctld_never_answers_steps_aside_for_the_command(slurm_cluster, tmp_path: Path) -> None:
    """A controller that takes the connection and never answers (hung): the session's read gives up
    after its wait and the caller runs the command (with its own timeout); the session is not tried
    again. Slurm's own error (no controller listening) is the command's error, one line."""
    etc = Path(slurm_cluster.env["SLURM_CONF"]).parent
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    for name, port in (("hung", hung.getsockname()[1]), ("gone", 1)):
        (tmp_path / name).mkdir()
        for f in etc.iterdir():
            if f.is_file():
                shutil.copy(f, tmp_path / name / f.name)
        conf = tmp_path / name / "slurm.conf"
        conf.write_text(re.sub(r"(?m)^SlurmctldPort=\S+", f"SlurmctldPort={port}", conf.read_text()))
    try:
        session = ScontrolSession(CommandRunner({"SLURM_CONF": str(tmp_path / "hung" / "slurm.conf")}))
        assert session.show_node("node1", 1.0) is None and not session.usable
        gone = ScontrolSession(CommandRunner({"SLURM_CONF": str(tmp_path / "gone" / "slurm.conf")}))
        try:   # 22.05 and 24.11 say it at once; 26.05 tries to connect for 5 s, past the session's wait
            got = gone.show_node("node1", 30)
        except SlurmError as e:
            assert "couldn't show node: " in str(e) and "Unable to contact slurm controller" in str(e)
        else:
            assert got is None   # the caller runs the command, which says it
        gone.close()
    finally:
        hung.close()


def test_a_session_sends_an_update_as_one_command_and_says_slurm_s_refusal(slurm_cluster) -> None:
    """``update`` (the scale bench's node fault, sent at a known instant): what it changed is what a
    command of its own reads; Slurm's refusal is one line; a word that could end the line is never sent."""
    runner = CommandRunner(slurm_cluster.env)
    session = ScontrolSession(runner)
    try:
        assert session.warm()
        assert session.update(["nodename=node8", "comment=omni-session-test"], 30) == ""
        alone = runner.run(["scontrol", "show", "node", "node8"]).stdout
        assert parse_records(alone, "NodeName")[0].get("Comment") == "omni-session-test"
        with pytest.raises(SlurmError, match=r"couldn't update nodename=node99 .*: .*"):
            session.update(["nodename=node99", "comment=x"], 30)
        assert session.update(["nodename=node8", "comment=two words"], 30) is None
        assert session.update(["nodename=node8\nshutdown"], 30) is None
        assert session.update([], 30) is None
        assert session.update(["nodename=node8", "comment="], 30) == ""   # the same process after the refusal
        alone = runner.run(["scontrol", "show", "node", "node8"]).stdout
        assert parse_records(alone, "NodeName")[0].get("Comment") in (None, "(null)", "")
    finally:
        session.close()


def _reader_program(slurm_cluster, tmp_path: Path) -> Path:
    """omni-node-read built here against the host's libslurm, or the test skipped with why: not
    buildable, or a version lane's cluster (24.11, 26.05) that this libslurm's protocol does not reach
    (the supervisor's session then reads through that Slurm's scontrol: the reader steps aside)."""
    from slurm_omni.cluster.versions import HOST_VERSION
    from slurm_omni.native import BuildError
    from slurm_omni.slurm import node_read

    version = slurm_cluster.cluster.spec.slurm_version
    if version != HOST_VERSION:
        pytest.skip(f"the node reader links the host's libslurm {HOST_VERSION}; this cluster runs Slurm {version}")
    try:
        return node_read.build(tmp_path)
    except BuildError as e:
        pytest.skip(f"the node reader cannot be built here: {e}")


def test_the_node_reader_answers_one_node_as_scontrol_does_and_steps_aside_when_it_cannot(slurm_cluster, tmp_path) -> None:
    """One node's record in one RPC (omni-node-read): the same text as ``scontrol show node``, Slurm's
    "not found" as scontrol's; where it is not built, or Slurm's answer through it is an error, the
    session's scontrol reads instead."""
    from slurm_omni.slurm import node_read

    program = _reader_program(slurm_cluster, tmp_path)
    runner = CommandRunner(slurm_cluster.env)
    reader = node_read.NodeReader(runner.environment(), program)
    try:
        assert reader.warm(30)
        text = reader.show("node3", 30)
        alone = runner.run(["scontrol", "show", "node", "node3"]).stdout
        drop = ("CPULoad", "FreeMem", "LastBusyTime", "AllocTRES", "CurrentWatts", "AveWatts")   # change between reads
        same = lambda t: [{k: v for k, v in r.items() if k not in drop} for r in parse_records(t, "NodeName")]
        assert text is not None and same(text) == same(alone) and "Partitions" in parse_records(text, "NodeName")[0]
        assert reader.show("node99", 30) == "Node node99 not found\n"
        assert reader.show("node[1-2]", 30) is None and reader.unusable and "not one node's name" in reader.why
    finally:
        reader.close()
    missing = node_read.NodeReader(runner.environment(), tmp_path / "absent")
    assert missing.show("node1", 5) is None and "not built" in missing.why
    wrong = node_read.NodeReader({**runner.environment(), "SLURM_CONF": str(tmp_path / "absent.conf")}, program)
    assert wrong.show("node1", 10) is None and wrong.unusable   # libslurm's own failure: the process ended

    session = ScontrolSession(runner, node_reader=True)
    try:
        assert session.warm()
        calls = runner.calls
        one = session.show_node("node4", 30)
        assert one is not None and parse_records(one, "NodeName")[0]["NodeName"] == "node4"
        assert runner.calls == calls + 1
        with pytest.raises(SlurmError, match="couldn't show node: Node node99 not found"):
            session.show_node("node99", 30)
    finally:
        session.close()


def test_the_node_reader_shows_a_node_set_down_under_a_job_down(slurm_cluster, tmp_path) -> None:
    """slurmctld answers the one-node read without recounting the nodes' allocated CPUs (only a whole
    read recounts them), and Slurm's print turns a node with some CPUs allocated into MIXED whatever
    its base state: a node set DOWN under a ``--no-kill`` job read MIXED through the reader until
    the next whole read (the 8-node demo's loss waited 0.8-1.4 s for the next poll). The reader's
    answer says DOWN at once, as scontrol's does."""
    import os
    import subprocess
    import sys

    from support import wait_until

    from slurm_omni.slurm import node_read
    from slurm_omni.slurm.parse_text import parse_nodes
    from slurm_omni.slurm.types import NodeState

    program = _reader_program(slurm_cluster, tmp_path)
    backend = slurm_cluster.backend()
    runner = CommandRunner(slurm_cluster.env)
    pair = wait_until(lambda: (idle := sorted(n.name for n in backend.nodes() if n.state is NodeState.IDLE))
                      and len(idle) >= 2 and idle[-2:], 120, "2 idle nodes", interval_s=1.0)
    held, lost = pair
    name = f"omni-reader-down-{tmp_path.name}"[:60]
    runner.run(["salloc", "--no-shell", "--no-kill", f"--job-name={name}", "--nodes=2",
                f"--nodelist={held},{lost}", "--time=5"])
    job = runner.run(["squeue", "--noheader", f"--name={name}", "--format=%i"]).stdout.strip()
    step = subprocess.Popen(["srun", f"--jobid={job}", "--overlap", "--nodes=2", "--ntasks=2", "--cpus-per-task=1",
                             sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, **slurm_cluster.env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    reader = node_read.NodeReader(runner.environment(), program)
    try:
        def busy() -> bool:   # a whole read: slurmctld recounts, the count the one-node read keeps
            node = parse_nodes(runner.run(["scontrol", "show", "node", lost]).stdout)[0]
            return node.state is NodeState.MIXED
        wait_until(busy, 60, f"the step's CPUs allocated on {lost}", interval_s=0.5)
        runner.run(["scontrol", "update", f"nodename={lost}", "state=DOWN", "reason=omni-test"])
        text = reader.show(lost, 30)
        assert text is not None
        node = parse_nodes(text)[0]
        assert (node.state, node.reason) == (NodeState.DOWN, "omni-test"), text
    finally:
        reader.close()
        step.kill()
        step.wait()
        runner.run(["scancel", job], check=False)
        runner.run(["scontrol", "update", f"nodename={lost}", "state=RESUME"], check=False)
