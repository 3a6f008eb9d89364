"""The manager's loop against Slurm in memory, on a fake clock: confirmation from the journal's own
timestamps, topology-aware replacement, exactly-once resubmission across a crash, shrink and grow,
array tasks requeued alone, exit codes that are not failures, and whose jobs it touches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from manager_fakes import NODES, Setup, beat, fault, make_setup

from slurm_omni.manager.daemon import Manager
from slurm_omni.manager.journal import Journal, incarnation_tag
from slurm_omni.report.timeline import load_timeline
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.types import JobState, NodeState

LEADER = 42


def train(s: Setup, m: Manager, *, job_id: int, until: float, ranks: dict[int, int], step_s: float = 0.5,
          start_step: int = 0, tick_s: float = 0.25, incarnation: int = 0) -> int:
    """Beat every rank (rank -> stage) each second and advance the global step every ``step_s``."""
    step = start_step
    next_step = s.clock.t + step_s
    next_beat = s.clock.t
    while s.clock.t < until:
        if s.clock.t >= next_step:
            step += 1
            next_step += step_s
        if s.clock.t >= next_beat:
            for rank, stage in ranks.items():
                beat(s.heartbeat_dir, rank, stage=stage, job_id=job_id, step=step, at=s.clock.t,
                     incarnation=incarnation)
            next_beat += 1.0
        m.tick()
        s.clock.t += tick_s
    return step


def idle(s: Setup, m: Manager, seconds: float, tick_s: float = 0.25) -> None:
    end = s.clock.t + seconds
    while s.clock.t < end:
        m.tick()
        s.clock.t += tick_s


def started(s: Setup, tmp_path: Path, dp: int = 1, **kw: object) -> tuple[Setup, Manager]:
    s.register(LEADER, dp)
    s.slurm.add_job(LEADER, [NODES[:dp], NODES[dp:2 * dp]])
    m = s.manager()
    return s, m


def test_node_down_confirms_within_5s_replaces_on_the_same_switch_and_completes_the_timeline(tmp_path: Path) -> None:
    s, m = started(make_setup(tmp_path), tmp_path)
    step = train(s, m, job_id=LEADER, until=s.clock.t + 10, ranks={0: 0, 1: 1})
    s.slurm.states["node2"] = NodeState.DOWN            # the text stage's node; its ranks die with it
    idle(s, m, 8)
    with Journal(s.config.journal_path, readonly=True) as j:
        (rec,) = j.recoveries("tiny-42")
        assert rec.cause == "down" and rec.nodes == ("node2",)
        assert rec.times["confirmed"] - rec.times["detected"] <= 5.0
        assert rec.times["resubmitted"] is not None and rec.new_incarnation == 1
    assert (str(LEADER), None) in s.slurm.cancelled
    (new_id, script, args) = s.slurm.submitted[0]
    assert args == [f"--comment={incarnation_tag('tiny-42', 1)}", "--nodelist=node1", "--exclude=node2", ":",
                    "--nodelist=node3", "--exclude=node2"]    # node3: free on node2's leaf switch
    assert "export OMNI_DP_SIZE=1" in script and f"export OMNI_CKPT_DIR={tmp_path}/ckpt/tiny" in script
    s.slurm.set_job(new_id, JobState.RUNNING, [["node1"], ["node3"]])
    train(s, m, job_id=new_id, until=s.clock.t + 3, ranks={0: 0, 1: 1}, start_step=step)
    with Journal(s.config.journal_path, readonly=True) as j:
        (rec,) = j.recoveries("tiny-42")
        assert rec.complete and all(rec.times[p] is not None for p in ("running", "first_step"))
        assert [i["slurm_job_id"] for i in j.incarnations("tiny-42")] == [str(LEADER), str(new_id)]
    (entry,) = load_timeline(s.config.timeline_path).recoveries
    assert (entry.job_id, entry.incarnation, entry.kind, entry.action) == (str(LEADER), 0, "node_down", "resubmit")
    assert entry.first_step_after_restore is not None and entry.detection_s is not None


def test_killed_rank_recovers_without_waiting_for_slurm_and_keeps_its_healthy_node(tmp_path: Path) -> None:
    s, m = started(make_setup(tmp_path), tmp_path)
    train(s, m, job_id=LEADER, until=s.clock.t + 8, ranks={0: 0, 1: 1})
    fault(s.root / "spool", job_id=LEADER, het_offset=1, node="node2", task_id=1, at=s.clock.t)
    idle(s, m, 6)                                            # Slurm still says RUNNING, node2 IDLE/ALLOCATED
    with Journal(s.config.journal_path, readonly=True) as j:
        (rec,) = j.recoveries("tiny-42")
        assert rec.cause == "task_exit" and rec.times["confirmed"] - rec.times["detected"] <= 5.0
    assert s.slurm.submitted[0][2] == [f"--comment={incarnation_tag('tiny-42', 1)}", "--nodelist=node1", ":",
                                       "--nodelist=node2"]
    assert not list((s.root / "spool").glob("fault-*"))      # journaled, then consumed


def test_stopped_rank_for_5x_the_median_step_is_not_recovered(tmp_path: Path) -> None:
    s, m = started(make_setup(tmp_path), tmp_path)
    step = train(s, m, job_id=LEADER, until=s.clock.t + 10, ranks={0: 0, 1: 1})
    # SIGSTOP of rank 1 for 5 x 0.5 s (its heartbeat thread stops with it); the pipeline waits on it
    stopped_until = s.clock.t + 5 * 0.5
    while s.clock.t < stopped_until:
        beat(s.heartbeat_dir, 0, stage=0, job_id=LEADER, step=step, at=s.clock.t)
        m.tick()
        s.clock.t += 0.25
    train(s, m, job_id=LEADER, until=s.clock.t + 6, ranks={0: 0, 1: 1}, start_step=step)
    assert not s.slurm.submitted and not s.slurm.cancelled
    with Journal(s.config.journal_path, readonly=True) as j:
        assert j.recoveries("tiny-42") == []


def test_manager_killed_after_sbatch_submits_exactly_once_after_restart(tmp_path: Path) -> None:
    class Crashed(BaseException):
        pass

    s, m = started(make_setup(tmp_path), tmp_path)
    train(s, m, job_id=LEADER, until=s.clock.t + 8, ranks={0: 0, 1: 1})

    def crash(point: str) -> None:
        if point == "resubmit:after_submit":
            raise Crashed(point)

    m.crash = crash  # type: ignore[method-assign]
    s.slurm.states["node2"] = NodeState.DOWN
    with pytest.raises(Crashed):
        idle(s, m, 8)
    m.close()
    assert len(s.slurm.submitted) == 1                       # sbatch ran; the journal did not hear back
    m2 = s.manager()
    idle(s, m2, 3)
    tag = incarnation_tag("tiny-42", 1)
    assert len(s.slurm.submitted) == 1 and s.slurm.tagged(tag) == [s.slurm.submitted[0][0]]
    with Journal(s.config.journal_path, readonly=True) as j:
        assert j.incarnations("tiny-42")[1]["slurm_job_id"] == str(s.slurm.submitted[0][0])
        assert j.action("resubmit:tiny-42:1").state == "done"   # type: ignore[union-attr]


def test_no_spare_shrinks_then_grows_back_when_nodes_return(tmp_path: Path) -> None:
    s, m = started(make_setup(tmp_path, dp=2), tmp_path, dp=2)
    for name in NODES[4:]:                                   # no spare anywhere
        s.slurm.states[name] = NodeState.DRAINED
    ranks = {0: 0, 1: 0, 2: 1, 3: 1}
    step = train(s, m, job_id=LEADER, until=s.clock.t + 8, ranks=ranks)
    s.slurm.states["node4"] = NodeState.DOWN                # a text node
    idle(s, m, 8)
    shrunk_id, script, args = s.slurm.submitted[0]
    assert "export OMNI_DP_SIZE=1" in script and "#SBATCH --nodes=1" in script
    assert args[1:] == ["--nodelist=node1", "--exclude=node4", ":", "--nodelist=node3", "--exclude=node4"]
    s.slurm.set_job(shrunk_id, JobState.RUNNING, [["node1"], ["node3"]])
    step = train(s, m, job_id=shrunk_id, until=s.clock.t + 4, ranks={0: 0, 1: 1}, start_step=step)
    assert len(s.slurm.submitted) == 1
    for name in NODES[4:]:                                   # the nodes come back
        s.slurm.states[name] = NodeState.IDLE
    train(s, m, job_id=shrunk_id, until=s.clock.t + 2, ranks={0: 0, 1: 1}, start_step=step)
    assert (str(shrunk_id), "USR1") in s.slurm.cancelled      # checkpoint first
    for rank, stage in {0: 0, 1: 1}.items():
        beat(s.heartbeat_dir, rank, stage=stage, job_id=shrunk_id, step=step + 5, at=s.clock.t, phase="stopping")
    idle(s, m, 2)
    _, script, args = s.slurm.submitted[1]
    assert "export OMNI_DP_SIZE=2" in script and "#SBATCH --nodes=2" in script
    lists = [expand(a.split("=", 1)[1]) for a in args if a.startswith("--nodelist=")]
    assert [len(x) for x in lists] == [2, 2] and "node1" in lists[0] and "node3" in lists[1]
    assert "node4" not in lists[0] + lists[1]                # still quarantined
    with Journal(s.config.journal_path, readonly=True) as j:
        causes = [r.cause for r in j.recoveries("tiny-42")]
        assert causes == ["down", "grow"]
        layouts = [i["layout"]["data_parallel_size"] for i in j.incarnations("tiny-42")]
        assert layouts == [2, 1, 2]


def test_failed_array_task_is_requeued_alone(tmp_path: Path) -> None:
    s = make_setup(tmp_path)
    s.register(70, kind="array", tasks=2)
    s.slurm.add_job(71, [["node1", "node2"]], array=(70, 0))
    s.slurm.add_job(72, [["node3", "node4"]], array=(70, 1))
    m = s.manager()
    hb = s.root / "ckpt" / "tiny1" / "heartbeat"
    hb.mkdir(mode=0o700, parents=True)
    for t in range(12):
        for rank in (0, 1):
            beat(hb, rank, stage=rank, job_id=72, step=t, at=s.clock.t)
        m.tick()
        s.clock.t += 0.5
    s.slurm.states["node4"] = NodeState.DOWN
    idle(s, m, 8)
    assert s.slurm.requeued == ["70_1"] and not s.slurm.submitted


def test_done_and_checkpointed_exits_are_not_failures(tmp_path: Path) -> None:
    s, m = started(make_setup(tmp_path), tmp_path)
    step = train(s, m, job_id=LEADER, until=s.clock.t + 5, ranks={0: 0, 1: 1})
    for rank in (0, 1):   # exit 75 after a USR1 checkpoint: the SPANK record and the last beat say so
        fault(s.root / "spool", job_id=LEADER, het_offset=rank, node=f"node{rank + 1}", task_id=rank,
              at=s.clock.t, signal=None, exit_code=75)
        beat(s.heartbeat_dir, rank, stage=rank, job_id=LEADER, step=step, at=s.clock.t, phase="stopping")
    idle(s, m, 10)
    assert not s.slurm.submitted and not s.slurm.cancelled
    for rank in (0, 1):
        beat(s.heartbeat_dir, rank, stage=rank, job_id=LEADER, step=100, at=s.clock.t, phase="done")
    s.slurm.set_job(LEADER, JobState.COMPLETED)
    idle(s, m, 2)
    with Journal(s.config.journal_path, readonly=True) as j:
        assert j.jobs(os.geteuid(), states=("done",))[0]["name"] == "tiny-42"
        assert j.recoveries("tiny-42") == []


def test_acts_only_on_its_own_users_jobs_and_records(tmp_path: Path) -> None:
    s = make_setup(tmp_path)
    foreign = s.register(50)
    os.chown(foreign, 12345, 12345)                          # registered by someone else
    s.register(LEADER)
    s.slurm.add_job(LEADER, [["node1"], ["node2"]], user="mallory")   # Slurm says the job is not ours
    m = s.manager()
    idle(s, m, 1)
    assert (s.root / "registry" / "rejected" / "50.json").exists()
    s.slurm.states["node2"] = NodeState.DOWN
    idle(s, m, 8)
    assert not s.slurm.submitted and not s.slurm.cancelled
    with Journal(s.config.journal_path, readonly=True) as j:
        assert [r["name"] for r in j.jobs(os.geteuid(), states=("active", "failed"))] == ["tiny-42"]


def test_status_json_shows_incarnations_progress_and_timelines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurm_omni.cli.manager import status

    s, m = started(make_setup(tmp_path), tmp_path)
    train(s, m, job_id=LEADER, until=s.clock.t + 6, ranks={0: 0, 1: 1})
    s.slurm.states["node2"] = NodeState.DOWN
    idle(s, m, 8)
    m.close()
    result = CliRunner().invoke(status, ["--site-config", str(s.root / "site.toml"), "--state-dir",
                                         str(s.config.state_dir), "--json"])
    assert result.exit_code == 0, result.output
    (job,) = json.loads(result.output)["jobs"]
    assert job["name"] == "tiny-42" and job["current_incarnation"] == 1 and job["global_step"] >= 10
    assert job["incarnations"][0]["layout"]["nodes"] == {"0": ["node1"], "1": ["node2"]}
    assert job["incarnations"][1]["layout"]["nodes"] == \
        {"0": ["node1"], "1": ["node3"]}
    (rec,) = job["recoveries"]
    assert rec["cause"] == "down" and rec["durations"]["confirmed"] <= 5.0
    text = CliRunner().invoke(status, ["--site-config", str(s.root / "site.toml"), "--state-dir",
                                       str(s.config.state_dir)])
    assert "recovery of incarnation 0 (down on node2)" in text.output


def test_failed_node_drained_with_an_omni_reason_when_the_site_says_so(tmp_path: Path) -> None:
    s, m = started(make_setup(tmp_path, drain=True), tmp_path)
    train(s, m, job_id=LEADER, until=s.clock.t + 6, ranks={0: 0, 1: 1})
    s.slurm.states["node2"] = NodeState.DOWN
    idle(s, m, 6)
    assert [(n, st) for n, st, _ in s.slurm.drained] == [("node2", "DRAIN")]
    assert s.slurm.drained[0][2].startswith("omni:")
    idle(s, m, 3)
    assert len(s.slurm.drained) == 1                          # once, journaled


def test_malformed_records_are_set_aside_and_an_open_spool_is_refused(tmp_path: Path) -> None:
    s = make_setup(tmp_path)
    (s.root / "registry" / "77.json").write_text('{"format": 1, "job_id": "77"}')
    s.register(LEADER)
    s.slurm.add_job(LEADER, [["node1"], ["node2"]])
    m = s.manager()
    idle(s, m, 1)
    assert (s.root / "registry" / "rejected" / "77.json").exists() and list(m.watches) == ["tiny-42"]
    (s.root / "spool").chmod(0o755)                           # anyone could inject a failure
    fault(s.root / "spool", job_id=LEADER, het_offset=1, node="node2", task_id=1, at=s.clock.t)
    idle(s, m, 2)
    assert list((s.root / "spool").glob("fault-*"))            # not read, not consumed
