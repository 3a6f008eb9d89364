"""Drill figures from a run's files, the goodput simulator's --drill-json document, the table, and
the pure pieces of targeting (listpids rows, node choice, rank choice)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from drill_support import batches, losses, write_run

from slurm_omni.drill.history import load_history
from slurm_omni.drill.inject import DrillRefused, TaskPid, check_allowed, parse_listpids
from slurm_omni.drill.job import JobHandle, latest_incarnation_step, pick_node, pick_task
from slurm_omni.drill.measure import DrillResult, DrillTimes, goodput_document, progress, render_table
from slurm_omni.slurm.types import HetComponent, Job, JobState

REPO = Path(__file__).resolve().parents[2]

# scontrol listpids 93 node7 on the embedded 22.05 cluster (a het job's second component).
LISTPIDS = """\
PID      JOBID    STEPID   LOCALID GLOBALID
4471     93       0        0       0
4472     93       0        1       1
4437     93       batch    0       0
4442     93       batch    -       -
"""


def two_lives(tmp_path: Path, last_old: int, first_new: int) -> Path:
    """Incarnation 0 at 1 step/s for steps 1..last_old (from t=1000), incarnation 1 for steps
    first_new..12 from t=1020, twice as fast; both lives' files concatenated in one folder."""
    ids, loss = batches(12), losses(12)
    write_run(tmp_path / "a", [(s, 0, loss[s - 1], ids[s - 1]) for s in range(1, last_old + 1)],
              t0=1000.0, step_s=1.0)
    write_run(tmp_path / "b", [(s, 1, loss[s - 1], ids[s - 1]) for s in range(first_new, 13)],
              t0=1020.0, step_s=0.5)
    run = tmp_path / "run"
    run.mkdir()
    for f in (tmp_path / "a").iterdir():
        (run / f.name).write_text(f.read_text() + (tmp_path / "b" / f.name).read_text())
    return run


def run_with_fault(tmp_path: Path) -> tuple[Path, float]:
    """Incarnation 0 at 1 step/s for steps 1..8 (t=1000..1007), fault at t=1007.5, incarnation 1
    resumes from step 5 at t=1020 and runs twice as fast."""
    return two_lives(tmp_path, 8, 6), 1007.5


def test_progress_around_a_fault(tmp_path: Path) -> None:
    run, fault = run_with_fault(tmp_path)
    p = progress(load_history(run), fault)
    assert (p.failed_incarnation, p.resumed_incarnation) == (0, 1)
    assert (p.last_step_before, p.resumed_from, p.steps_lost) == (8, 5, 3)
    assert p.first_step_at == 1020.0
    assert p.throughput_before == 8.0 and p.throughput_after == 16.0


def result(kind: str = "node-down", **times: float) -> DrillResult:
    t = {"fault": 100.0, "detected": 101.0, "confirmed": 103.0, "resubmitted": 104.0, "running": 110.0,
         "first_step": 112.0, **times}
    return DrillResult(kind=kind, job="j", job_id="7", node="node5", times=DrillTimes(**t), restored=True)


def test_goodput_document_is_what_the_simulator_reads(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO))
    from bench.goodput.inputs import SimConfig, apply_drill

    doc = goodput_document([result(), result("kill-rank", confirmed=102.0), result("node-down", confirmed=105.0)],
                           source="test")
    assert doc["detection_by_kind"] == {"node_down": 4.0, "task_crash": 2.0}
    assert doc["detection_s"] == 3.0 and doc["resubmit_s"] == 1.0 and doc["start_s"] == 6.0
    assert doc["restore_s"] == 2.0 and len(doc["runs"]) == 3
    path = tmp_path / "drills.json"
    path.write_text(json.dumps(doc))
    cfg, prov = apply_drill(SimConfig(), path)
    assert cfg.omni.detect_node_down_s == 4.0 and cfg.omni.detect_task_crash_s == 2.0
    assert cfg.start.start_small_s == 6.0 and cfg.omni.restore_small_s == 2.0
    assert all(p.source == f"measured {path}" for p in prov)


def test_a_stall_nobody_confirmed_is_a_pass_and_stays_out_of_the_medians() -> None:
    stall = DrillResult(kind="stall-rank", job="j", job_id="7", node="node5", rank=2,
                        times=DrillTimes(fault=100.0), expect_recovery=False, restored=True)
    assert stall.ok and stall.detection_s is None
    doc = goodput_document([stall, result()], source="test")
    assert "hang" not in doc["detection_by_kind"] and doc["recovery_s"] == 9.0
    table = render_table([stall, result()])
    assert "ok: no false alarm" in table and "node5 rank 2" in table


def test_not_restored_or_not_equivalent_fails() -> None:
    assert not DrillResult(kind="node-down", job="j", job_id="7", times=DrillTimes(fault=1.0, confirmed=2.0,
                                                                                   first_step=3.0)).ok
    bad = result().with_equivalence({"ok": False, "problems": ["2 sample ids skipped: 4, 5"]})
    assert not bad.ok and "NOT equivalent: 2 sample ids skipped" in render_table([bad])


def test_listpids_rows() -> None:
    assert parse_listpids(LISTPIDS) == [TaskPid(4471, 93, "0", 0, 0), TaskPid(4472, 93, "0", 1, 1)]
    assert parse_listpids("JobId=93 does not exist on node (null).\nPID JOBID STEPID LOCALID GLOBALID\n") == []


def job(nodes0: tuple[str, ...], nodes1: tuple[str, ...]) -> Job:
    comps = (HetComponent(92, 92, 0, JobState.RUNNING, nodes0), HetComponent(93, 92, 1, JobState.RUNNING, nodes1))
    return Job(92, "j", "root", JobState.RUNNING, "RUNNING", comps)


def handle() -> JobHandle:
    p = Path("/x")
    return JobHandle(name="j", job_id=92, stage_tasks=(2, 2), ckpt_dir=p, metrics_dir=p, heartbeat_dir=p,
                     max_steps=10)


def test_pick_node_and_rank() -> None:
    j = job(("node6",), ("node7",))
    comp, node = pick_node(j, ("node5", "node6", "node7"), "", "site.toml")
    assert (comp.het_offset, node) == (1, "node7")                # the text stage's node
    assert pick_node(j, ("node6",), "", "site.toml")[1] == "node6"
    tasks = parse_listpids(LISTPIDS)
    assert pick_task(tasks, comp, handle(), None) == (2, tasks[0])   # component 1's first task is rank 2
    assert pick_task(tasks, comp, handle(), 3) == (3, tasks[1])
    with pytest.raises(Exception, match="holds ranks 2, 3"):
        pick_task(tasks, comp, handle(), 0)


def _beat(folder: Path, rank: int, node: str, incarnation: int, job_id: int = 92) -> None:
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps({
        "rank": rank, "stage": 0, "dp_rank": rank, "pid": 100 + rank, "incarnation": incarnation,
        "job_id": str(job_id), "step": 5, "phase": "training", "time": 1764460000.0, "node": node}))


def test_an_in_allocation_jobs_spare_is_never_the_default_target(tmp_path: Path) -> None:
    """One allocation of node1..node3, ranks on node1 and node2 (node3 a spare): the drill takes the last
    node that runs ranks. Before, it took node3 and the run ended "without a recovery"."""
    alloc = Job(92, "j", "u", JobState.RUNNING, "RUNNING",
                (HetComponent(92, 92, 0, JobState.RUNNING, ("node1", "node2", "node3")),))
    hb = tmp_path / "heartbeat"
    _beat(hb, 0, "node1", 4)
    _beat(hb, 1, "node3", 3)            # an earlier life's rank, since moved: not counted
    _beat(hb, 1, "node2", 4)
    _beat(hb, 2, "node3", 1, job_id=91)  # another Slurm job's
    h = JobHandle(name="j", job_id=92, stage_tasks=(2,), stages=("gpt",), ckpt_dir=tmp_path, metrics_dir=tmp_path,
                  heartbeat_dir=hb, max_steps=10)
    assert h.rank_nodes(alloc) == ("node1", "node2")
    allowed = ("node1", "node2", "node3")
    assert pick_node(alloc, allowed, "", "site.toml")[1] == "node3"          # what it chose before
    assert pick_node(alloc, allowed, "", "site.toml", ranked=h.rank_nodes(alloc))[1] == "node2"
    assert pick_node(alloc, allowed, "node3", "site.toml", ranked=h.rank_nodes(alloc))[1] == "node3"  # --node wins
    with pytest.raises(DrillRefused, match="its ranks run on node1, node2, none in drills.allowed_nodes"):
        pick_node(alloc, ("node3",), "", "site.toml", ranked=("node1", "node2"))
    # the batch host only when no other node runs ranks: losing it ends the allocation's batch script
    on_host = replace(alloc, batch_host="node2")
    assert pick_node(on_host, allowed, "", "site.toml", ranked=("node1", "node2"))[1] == "node1"
    assert pick_node(on_host, allowed, "", "site.toml", ranked=("node2",))[1] == "node2"


@pytest.mark.parametrize(("allowed", "wanted", "message"), [
    ((), "", "drills.allowed_nodes is empty"),
    (("node1",), "", "it runs on node6, node7, none in drills.allowed_nodes"),
    (("node6",), "node7", "couldn't touch node7: not in drills.allowed_nodes"),
])
def test_refusals(allowed: tuple[str, ...], wanted: str, message: str) -> None:
    with pytest.raises(DrillRefused, match=message) as e:
        check_allowed([wanted] if wanted else [], allowed, "site.toml")
        pick_node(job(("node6",), ("node7",)), allowed, wanted, "site.toml")
    assert e.value.exit_code == 2


def test_latest_step_reads_the_tail(tmp_path: Path) -> None:
    run, _ = run_with_fault(tmp_path)
    assert latest_incarnation_step(run) == (1, 12)
    assert latest_incarnation_step(tmp_path / "none") is None


def test_progress_when_the_old_life_logs_a_step_after_the_fault(tmp_path: Path) -> None:
    """The old life finished one more step on Slurm's SIGTERM after the fault; the resubmitted job's
    ranks log the next incarnation (1), which tells the lives apart without any clock."""
    p = progress(load_history(two_lives(tmp_path, 9, 10)), 1007.5)
    assert (p.failed_incarnation, p.resumed_incarnation) == (0, 1)
    assert (p.last_step_before, p.resumed_from, p.steps_lost, p.first_step_at) == (9, 9, 0, 1020.0)


def test_current_job_is_the_newest_live_one_of_its_name_and_user() -> None:
    h = JobHandle(name="j", job_id=92, stage_tasks=(2, 2), ckpt_dir=Path("/x"), metrics_dir=Path("/x"),
                  heartbeat_dir=Path("/x"), max_steps=10, user="alice")
    old, new, foreign = job(("node6",), ("node7",)), job(("node5",), ("node7",)), job(("node1",), ("node2",))
    new = Job(97, "j", "alice", JobState.RUNNING, "RUNNING", new.components)
    old = Job(92, "j", "alice", JobState.CANCELLED, "CANCELLED", old.components)
    foreign = Job(99, "j", "bob", JobState.RUNNING, "RUNNING", foreign.components)
    assert h.current([old, new, foreign]) == new
    assert h.current([old]) is None


def test_latest_step_reads_the_node_files_that_carry_the_loss_ranks_lines(tmp_path: Path) -> None:
    """Under Slurm a node's heartbeat leader copies its ranks' lines to node-<NODE>.jsonl and the
    rank's own file stays empty while it runs (formats/metrics): the drill's progress (the demo's
    'waiting for 30 steps') comes from the node files, the newest line by (incarnation, time), and a
    line of another rank or a torn one is passed over."""
    def line(file: str, inc: int, step: int, t: float, rank: int = 0) -> str:
        return json.dumps({"file": file, "time": t, "rank": rank, "stage": 0, "dp_rank": rank,
                           "incarnation": inc, "step": step, "loss": 1.0}) + "\n"

    (tmp_path / "metrics-main-0.jsonl").write_text("")
    (tmp_path / "node-node1.jsonl").write_text(
        line("metrics-main-0.jsonl", 0, 7, 10.0) + line("metrics-main-0.jsonl", 1, 5, 20.0)
        + '{"file": "metrics-main-0.jsonl", "incarn')
    (tmp_path / "node-node2.jsonl").write_text(
        line("metrics-main-0.jsonl", 0, 9, 15.0) + line("metrics-main-1.jsonl", 1, 40, 30.0, rank=1))
    assert latest_incarnation_step(tmp_path, ("main",)) == (1, 5)
    # a rank that ended appended what no leader copied to its own file: newer, so it counts
    (tmp_path / "metrics-main-0.jsonl").write_text(line("metrics-main-0.jsonl", 1, 6, 21.0))
    assert latest_incarnation_step(tmp_path, ("main",)) == (1, 6)
