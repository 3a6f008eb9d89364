"""decide: from the rule's confirmation to the next launch journaled (issue 19). The supervisor's own
work over a synthetic job (bench/decide_bench.py: its journal, heartbeat files, rule and plan, over a
runner that answers Slurm's commands at once), the states the watch's reads answered, and what a
launch's observer keeps as the beats come. No wall clock asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.decide_bench import one_decide
from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import HeartbeatRecord, NodeHeader, node_file_name
from slurm_omni.fsio import write_atomic
from slurm_omni.policy.confirm import NodeObservation, Verdict
from slurm_omni.policy.in_allocation import StepLayout
from slurm_omni.slurm.types import Node, NodeState
from slurm_omni.supervisor.journal import Launch
from slurm_omni.supervisor.node_reads import KnownStates, NodeAnswer, NodeReads
from slurm_omni.supervisor.observe import LaunchObserver


def _node(name: str, state: NodeState = NodeState.ALLOCATED) -> Node:
    return Node(name, state, state.name)


def test_known_states_keep_the_newest_asked_and_answer_only_when_every_one_is_recent() -> None:
    known = KnownStates()
    assert known.recent(["n1"], 100.0, 30.0) is None   # nothing read yet
    known.take(NodeAnswer((_node("n1"), _node("n2")), 90.0, 95.0, True, "RUNNING"))
    known.take(NodeAnswer((_node("n2", NodeState.DOWN),), 96.0, 97.0, False))   # srun named n2: read alone
    # a full read asked before the named one, answered after it: its n2 is older and does not replace it
    known.take(NodeAnswer((_node("n1"), _node("n2")), 93.0, 99.0, True, "RUNNING"))
    got = known.recent(["n1", "n2"], 100.0, 30.0)
    assert got is not None and got[0] == "RUNNING"
    assert [(n.name, n.state) for n in got[1]] == [("n1", NodeState.ALLOCATED), ("n2", NodeState.DOWN)]
    assert known.recent(["n1", "n3"], 100.0, 30.0) is None       # a node no read covered
    assert known.recent(["n1", "n2"], 124.0, 30.0) is None       # n1 and the job asked 31 s before
    only_nodes = KnownStates()
    only_nodes.take(NodeAnswer((_node("n1"),), 99.0, 99.5, False))
    assert only_nodes.recent(["n1"], 100.0, 30.0) is None        # the job's state unknown


def test_a_full_read_carries_the_jobs_state_and_a_named_read_does_not_ask_it() -> None:
    asked: list[str] = []

    def job_state() -> str:
        asked.append("squeue")
        return "RUNNING"

    reads = NodeReads(lambda names: [_node(n) for n in names], lambda: 5.0, job_state=job_state)
    assert reads.ask(["n1", "n2"], full=True) and reads.ask(["n2"], full=False)
    got: list[NodeAnswer] = []
    for _ in range(500):
        got += reads.answers()
        if len(got) == 2:
            break
        import threading
        threading.Event().wait(0.01)
    by_kind = {a.full: a for a in got}
    assert by_kind[True].job_state == "RUNNING" and by_kind[False].job_state == ""
    assert asked == ["squeue"]
    reads.close()


@pytest.mark.parametrize("nodes", [8, 64])
def test_a_node_loss_decides_on_the_watched_states_without_asking_slurm(tmp_path: Path, nodes: int) -> None:
    got = one_decide(nodes, tmp_path)
    assert got["commands"] == ["scancel --signal=KILL (started)"]
    nxt = got["next"]
    assert f"node{nodes}" not in nxt.layout.nodes and f"node{nodes + 1}" in nxt.layout.nodes
    assert nxt.removed == (f"node{nodes}",) and nxt.added == (f"node{nodes + 1}",)


def test_a_crash_asks_only_the_jobs_state_and_the_failed_nodes_and_relaunches_in_place(tmp_path: Path) -> None:
    """A step that ends with a task's exit may end because the job was cancelled, or because a peer's
    node went down before srun says so: the job's state (one squeue) and the failed nodes (one sinfo
    of the few, side by side) are read after it; the other nodes' states come from the watch's reads."""
    got = one_decide(8, tmp_path, fault="crash")
    assert sorted(got["commands"][:2]) == ["sinfo --noheader --Node", "squeue --noheader --jobs=4242"]
    assert got["commands"][2:] == ["scancel --signal=KILL (started)"]
    assert "node8" in got["next"].layout.nodes and got["next"].removed == ()


def test_a_crash_reads_no_beat_for_a_refusal_srun_did_not_report(tmp_path: Path) -> None:
    """Every node beat once more before the kill; srun ended with the step and its whole report names
    no task that exited 78: decide opens no heartbeat file (issue 19: 78 ms at 512 nodes)."""
    got = one_decide(8, tmp_path, fault="crash")
    assert got["opened"] == 0 and got["code"] is None and got["next"].number == 1


def test_a_crash_with_no_srun_report_known_reads_the_beats_for_a_refusal(tmp_path: Path) -> None:
    got = one_decide(8, tmp_path, fault="crash", srun_log=False)   # an adopted step: srun's report unknown
    assert got["opened"] == 8 and got["code"] is None and got["next"].number == 1


def test_a_task_that_exited_78_in_srun_s_report_stops_the_job_with_its_rank_s_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    got = one_decide(8, tmp_path, fault="crash", exit_code=78)
    assert got["code"] == 78 and got["next"].number == 0   # no relaunch
    assert "rank 31 refused its input: bad --lr" in caplog.text


def test_a_hang_decides_on_the_watched_states_without_asking_slurm(tmp_path: Path) -> None:
    """A hang rests on the ranks' beats alone (no task's exit, no step's end): no cancellation of the
    job can be its cause, the watched job state serves; srun named no step, so the kill looks it up."""
    got = one_decide(8, tmp_path, fault="hang")
    assert got["commands"] == ["squeue --steps --noheader", "scancel --signal=KILL (started)"]
    assert "node8" in got["next"].layout.nodes and got["next"].cause == "hang"


def test_without_a_recent_read_decide_asks_slurm_as_before(tmp_path: Path) -> None:
    got = one_decide(8, tmp_path, watched=False)
    assert got["commands"][:2] in (["squeue --noheader --jobs=4242", "scontrol show node"],
                                   ["scontrol show node", "squeue --noheader --jobs=4242"])
    assert "node8" not in got["next"].layout.nodes


def _beat(rank: int, t: float, **kw: object) -> HeartbeatRecord:
    return HeartbeatRecord(**{"rank": rank, "stage": 0, "dp_rank": rank, "pid": 100 + rank, "incarnation": 0,
                              "job_id": "42", "step": 3, "phase": "training", "time": t, "node": "n0",
                              "beats": int(t), **kw})   # type: ignore[arg-type]


def test_the_observer_keeps_last_words_as_they_come_and_a_latched_rule_takes_no_more_states(tmp_path: Path) -> None:
    layout = StepLayout((("n0", "n1"),), (), (), 1, {})
    obs = LaunchObserver(Launch(number=0, layout=layout, data_parallel_size=2, port=0, incarnation=0, started_at=1.0),
                         job_id="42", heartbeat_dir=tmp_path, heartbeat_interval_s=1.0)

    def publish(beats: list[HeartbeatRecord], t: float) -> None:
        write_atomic(tmp_path / node_file_name("n0"),
                     b"".join([encode(NodeHeader(node="n0", time=t)), *map(encode, beats)]), durable=False)

    publish([_beat(0, 10.0), _beat(1, 10.0)], 10.0)
    obs.beats()
    assert obs.last_words == {}
    publish([_beat(0, 11.0, phase="failed", exit_code=78, error="bad --lr"), _beat(1, 11.0)], 11.0)
    obs.beats()
    assert list(obs.last_words) == [0] and obs.last_words[0].error == "bad --lr"
    obs.confirmer.observe(NodeObservation(12.0, "n1", NodeState.DOWN, source="srun"))
    obs.nodes([_node("n1", NodeState.DOWN)], 12.0)
    assert obs.confirmer.evaluate(12.0).verdict is Verdict.CONFIRMED and obs.lost == {"n1"}
    obs.nodes([_node("n0", NodeState.DOWN), _node("elsewhere", NodeState.DOWN)], 13.0)
    assert obs.lost == {"n0", "n1"}
    assert obs.confirmer.evaluate(13.0).nodes == ("n1",)   # latched: the later state changes nothing


def test_a_scan_of_every_beat_keeps_the_last_words_it_reads_first(tmp_path: Path) -> None:
    """The start-failure check scans every beat (``heartbeats``) before the refusal check reads the
    last words: a rank's refusal read first there is kept (the cluster test saw launch 0 relaunched
    when that scan took the rank's last beat from the refusal check)."""
    layout = StepLayout((("n0",),), (), (), 1, {})
    obs = LaunchObserver(Launch(number=0, layout=layout, data_parallel_size=1, port=0, incarnation=0, started_at=1.0),
                         job_id="42", heartbeat_dir=tmp_path, heartbeat_interval_s=1.0)
    write_atomic(tmp_path / "rank-0.json", encode(_beat(0, 5.0, phase="failed", exit_code=78, error="bad")),
                 durable=False)
    assert [hb.exit_code for hb in obs.heartbeats()] == [78]
    obs.beats()   # nothing fresh any more
    assert obs.last_words[0].exit_code == 78


def test_a_readers_scan_the_loop_did_not_take_still_brings_its_last_words(tmp_path: Path) -> None:
    """The beats are read beside the loop (``BeatReader``); the launch can end before the loop takes
    the reader's last scan. The scanner's cache holds those files as read, so the refusal check's own
    scan takes the ended scans first: a rank's refusal read there is kept."""
    layout = StepLayout((("n0",),), (), (), 1, {})
    obs = LaunchObserver(Launch(number=0, layout=layout, data_parallel_size=1, port=0, incarnation=0, started_at=1.0),
                         job_id="42", heartbeat_dir=tmp_path, heartbeat_interval_s=1.0)
    write_atomic(tmp_path / "rank-0.json", encode(_beat(0, 5.0, phase="failed", exit_code=78, error="bad")),
                 durable=False)
    obs.scan(5.5, lambda: 5.6)   # the reader's scan, never taken by the loop
    assert obs.beats(6.0) is None and obs.last_words[0].exit_code == 78
    assert obs.pending() == []
