"""Node states read beside the supervisor's watch (issue 19): a slurmctld that answers late holds up
nothing, the 3 s poll does not pile up behind it, a read of the nodes srun named starts beside it,
and answers come dated in the supervisor's clock (threads and events, no wall clock asserted)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.types import Node, NodeState
from slurm_omni.supervisor.node_reads import NodeReads, read_job_and_failed


class _Slurmctld:
    """Answers each read when the test lets it (``release``)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []
        self.gates: dict[tuple[str, ...], threading.Event] = {}
        self.fail: set[tuple[str, ...]] = set()

    def read(self, names: Sequence[str]) -> list[Node]:
        key = tuple(names)
        self.asked.append(key)
        self.gates.setdefault(key, threading.Event()).wait(10)
        if key in self.fail:
            raise SlurmError("scontrol show node: timed out")
        return [Node(n, NodeState.DOWN if n == "n3" else NodeState.IDLE, "x") for n in names]

    def release(self, names: Sequence[str]) -> None:
        self.gates.setdefault(tuple(names), threading.Event()).set()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait(reads: NodeReads, count: int) -> list:
    got: list = []
    for _ in range(500):
        got += reads.answers()
        if len(got) >= count:
            return got
        threading.Event().wait(0.01)
    raise AssertionError(f"{len(got)} answers, expected {count}")


def test_a_slow_full_read_holds_up_neither_the_caller_nor_the_read_of_the_named_node() -> None:
    ctld, clock = _Slurmctld(), _Clock()
    reads = NodeReads(ctld.read, clock)
    assert reads.ask(["n1", "n2", "n3"], full=True)
    assert not reads.ask(["n1", "n2", "n3"], full=True)   # the poll's next turn: still in flight, not asked twice
    assert reads.answers() == []
    clock.now = 101.0
    assert reads.ask(["n3"], full=False)   # srun named n3: asked at once, beside the slow one
    clock.now = 101.5
    ctld.release(["n3"])
    (named,) = _wait(reads, 1)
    assert [n.name for n in named.nodes] == ["n3"] and named.nodes[0].state is NodeState.DOWN
    assert (named.asked_at, named.answered_at, named.full) == (101.0, 101.5, False)
    clock.now = 103.0
    ctld.release(["n1", "n2", "n3"])
    (full,) = _wait(reads, 1)
    assert full.full and full.asked_at == 100.0 and len(full.nodes) == 3
    assert reads.ask(["n1", "n2", "n3"], full=True)   # answered: the next poll asks again
    reads.close()


def test_a_read_that_fails_answers_nothing_and_frees_the_poll_and_close_drops_late_answers() -> None:
    ctld, clock = _Slurmctld(), _Clock()
    reads = NodeReads(ctld.read, clock)
    ctld.fail.add(("n1",))
    ctld.release(["n1"])
    assert reads.ask(["n1"], full=True)
    for _ in range(500):   # the failed read frees the poll's turn
        if reads.ask(["n1"], full=True):
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("the poll's turn was not freed")
    assert reads.answers() == []
    assert not reads.ask([], full=False)
    ctld2 = _Slurmctld()
    reads = NodeReads(ctld2.read, clock)
    assert reads.ask(["n2"], full=False)
    reads.close()
    ctld2.release(["n2"])
    threading.Event().wait(0.1)
    assert reads.answers() == [] and not reads.ask(["n2"], full=False)


def test_the_step_id_is_asked_with_the_full_reads_until_it_is_known() -> None:
    ctld, clock = _Slurmctld(), _Clock()
    ctld.release(["n1"])
    answers = iter(["", "4001.3"])
    asked: list[int] = []

    def step_id() -> str:
        asked.append(1)
        return next(answers)

    reads = NodeReads(ctld.read, clock, step_id=step_id)
    got = []
    for _ in range(3):
        assert reads.ask(["n1"], full=True)
        got += _wait(reads, 1)
    assert [a.step_id for a in got] == ["", "4001.3", ""]   # the step not listed yet, then its id, then not asked
    assert len(asked) == 2
    assert reads.ask(["n1"], full=False)
    assert _wait(reads, 1)[0].step_id == ""   # a named read does not ask it
    reads.close()


def test_the_job_read_asked_at_a_report_answers_only_for_reports_before_it() -> None:
    ctld, clock = _Slurmctld(), _Clock()
    gate = threading.Event()
    ctld.release(["n1", "n3"])

    def job_state() -> str:
        gate.wait(10)
        return "RUNNING"

    reads = NodeReads(ctld.read, clock, job_state=job_state)
    assert reads.job_since(99.0, timeout_s=0) is None   # none asked
    clock.now = 101.0
    def failed(names: Sequence[str]) -> list[Node]:
        return [n for n in ctld.read(names) if n.state.failed]

    assert reads.ask_job(["n1", "n3"], failed)
    assert not reads.ask_job(["n1", "n3"], failed)   # one in flight
    assert reads.job_since(101.0, timeout_s=0) is None   # not answered yet, not waited for
    gate.set()
    got = reads.job_since(100.5, timeout_s=10)   # asked after the report at 100.5
    assert got is not None and got[0] == "RUNNING"
    assert [(n.name, n.state) for n in got[1]] == [("n3", NodeState.DOWN)]
    assert reads.job_since(101.5, timeout_s=10) is None   # a report after it: the caller asks anew
    assert reads.answers() == []   # not the poll's answer
    assert NodeReads(ctld.read, clock).ask_job(["n1"], failed) is False   # no job_state to read with
    reads.close()


def test_a_job_read_that_fails_answers_none() -> None:
    ctld, clock = _Slurmctld(), _Clock()
    ctld.fail.add(("n1",))
    ctld.release(["n1"])
    reads = NodeReads(ctld.read, clock, job_state=lambda: "RUNNING")
    assert reads.ask_job(["n1"], ctld.read)
    assert reads.job_since(100.0, timeout_s=10) is None
    assert reads.ask_job(["n1"], ctld.read)   # done: another may start
    reads.close()


def test_the_job_and_its_failed_nodes_are_read_side_by_side_each_failure_alone() -> None:
    """What the read at srun's report and the supervisor's read at the decision both run: the two
    commands at once (each waits for the other to have started), None for the one that failed."""
    both = threading.Barrier(2, timeout=10)

    def job_state() -> str:
        both.wait()
        return "RUNNING"

    def failed(names: Sequence[str]) -> list[Node]:
        both.wait()
        return [Node(n, NodeState.DOWN, "DOWN") for n in names if n == "n2"]

    state, nodes = read_job_and_failed(job_state, failed, ["n1", "n2"])
    assert state == "RUNNING" and nodes is not None and [n.name for n in nodes] == ["n2"]

    def refused(names: Sequence[str]) -> list[Node]:
        raise SlurmError("sinfo: couldn't reach slurmctld")

    def timed_out() -> str:
        raise SlurmError("squeue: timed out")

    assert read_job_and_failed(lambda: "", refused, ["n1"]) == ("", None)   # squeue: job unknown; sinfo failed
    assert read_job_and_failed(timed_out, lambda names: [], ["n1"]) == (None, [])
