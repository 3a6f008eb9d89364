"""The journal: WAL, idempotent two-phase actions, recovery timelines, crash at every point."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_omni.manager.journal import (
    Journal,
    JournalError,
    action_key,
    incarnation_tag,
    perform_once,
    to_json,
)
from slurm_omni.manager.watch import plan_from_json
from slurm_omni.policy.confirm import Decision, Verdict
from slurm_omni.policy.placement import Action, ComponentPlan, Plan, Quarantine

JOB = "train-a"


class Crash(Exception):
    """Stands for the manager being killed at this point."""


class SubmissionLog:
    """What perform_once's callbacks submitted and can find again by tag (no Slurm: the journal's
    exactly-once rule is about the order of its own writes around the callbacks), kept in a file so
    that a second process sees the first's submissions."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def jobs(self) -> list[dict[str, str]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def submit(self, tag: str) -> str:
        job_id = str(1000 + len(self.jobs()))
        with open(self.path, "a") as f:
            f.write(json.dumps({"id": job_id, "tag": tag}) + "\n")
        return job_id

    def find(self, tag: str) -> str | None:
        return next((j["id"] for j in self.jobs() if j["tag"] == tag), None)


def recover(journal: Journal, slurm: SubmissionLog, hit: Callable[[str], None], clock: Callable[[], float]) -> str:
    """What the manager does for the confirmed failure of incarnation 0: the order under test."""
    hit("before_confirm")
    journal.open_recovery(JOB, 0, "down", ("t1",), fault_at=1.0, detected_at=2.0, confirmed_at=3.0)
    hit("after_confirm")
    tag = journal.add_incarnation(JOB, 1, {"nodes": ["v1", "t9"]})
    hit("after_incarnation")

    def submit() -> str:
        hit("before_submit")
        job_id = slurm.submit(tag)
        hit("after_submit")
        return job_id

    job_id = perform_once(journal, key=action_key("resubmit", JOB, 1), job=JOB, incarnation=1, kind="resubmit",
                          payload={"tag": tag}, now=clock, act=submit, find_existing=lambda _: slurm.find(tag))
    hit("after_done")
    journal.set_incarnation(JOB, 1, slurm_job_id=job_id, submitted_at=clock())
    journal.mark_phase(JOB, 0, "resubmitted", clock(), new_incarnation=1)
    hit("after_phase")
    return job_id


def restart_and_finish(db: Path, slurm: SubmissionLog) -> Journal:
    """A new manager process: carry on every open recovery not yet resubmitted."""
    journal = Journal(db)
    open_ = [r for r in journal.open_recoveries() if r.times["resubmitted"] is None]
    if open_ or journal.recovery(JOB, 0) is None:   # not even confirmed: the spool events are re-read
        recover(journal, slurm, lambda point: None, lambda: 10.0)
    return journal


POINTS = ["before_confirm", "after_confirm", "after_incarnation", "before_submit", "after_submit",
          "after_done", "after_phase"]


def fresh(tmp_path: Path) -> Path:
    db = tmp_path / "state" / "journal.sqlite"
    with Journal(db) as j:
        j.register_job(JOB, 1000, {"stages": 2}, now=0.0)
        j.add_incarnation(JOB, 0, {"nodes": ["v1", "t1"]})
    return db


@pytest.mark.parametrize("point", POINTS)
def test_crash_at_every_point_submits_exactly_once(tmp_path: Path, point: str) -> None:
    db, slurm = fresh(tmp_path), SubmissionLog(tmp_path / "slurm.jsonl")

    def hit(p: str) -> None:
        if p == point:
            raise Crash(p)

    journal = Journal(db)
    with pytest.raises(Crash):
        recover(journal, slurm, hit, lambda: 5.0)
    journal.close()   # what the kernel does for a killed process; nothing uncommitted survives
    journal = restart_and_finish(db, slurm)
    assert [j["tag"] for j in slurm.jobs()] == [incarnation_tag(JOB, 1)]
    action = journal.action(action_key("resubmit", JOB, 1))
    assert action is not None and action.state == "done" and action.result == "1000"
    assert journal.pending_actions() == []
    rec = journal.recovery(JOB, 0)
    assert rec is not None and rec.new_incarnation == 1 and rec.times["resubmitted"] is not None
    assert journal.incarnations(JOB)[1]["slurm_job_id"] == "1000"
    # and a third start does nothing more
    journal.close()
    restart_and_finish(db, slurm).close()
    assert len(slurm.jobs()) == 1


KILLED = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from slurm_omni.manager.journal import Journal, action_key, perform_once
    db, slurm_file, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    def hit(p):
        if p == point:
            os._exit(137)   # as SIGKILL: no cleanup, no rollback, no flush
    j = Journal(db)
    hit("before_confirm")
    j.open_recovery("train-a", 0, "down", ("t1",), fault_at=1.0, detected_at=2.0, confirmed_at=3.0)
    tag = j.add_incarnation("train-a", 1, {"nodes": ["v1", "t9"]})
    def submit():
        hit("before_submit")
        with open(slurm_file, "a") as f:
            f.write(json.dumps({"id": "1000", "tag": tag}) + "\\n")
            f.flush(); os.fsync(f.fileno())
        hit("after_submit")
        return "1000"
    jid = perform_once(j, key=action_key("resubmit", "train-a", 1), job="train-a", incarnation=1,
                       kind="resubmit", payload={}, now=lambda: 5.0, act=submit, find_existing=lambda _: None)
    hit("after_done")
    j.mark_phase("train-a", 0, "resubmitted", 6.0, new_incarnation=1)
""")


@pytest.mark.parametrize("point", ["before_confirm", "before_submit", "after_submit", "after_done"])
def test_killed_process_then_restart(tmp_path: Path, point: str) -> None:
    db, slurm = fresh(tmp_path), SubmissionLog(tmp_path / "slurm.jsonl")
    proc = subprocess.run([sys.executable, "-c", KILLED, str(db), str(slurm.path), point], check=False,
                          timeout=60, capture_output=True, text=True)
    assert proc.returncode == 137, proc.stderr
    restart_and_finish(db, slurm).close()
    assert len(slurm.jobs()) == 1


def test_failed_action_is_looked_for_before_retry(tmp_path: Path) -> None:
    db, slurm = fresh(tmp_path), SubmissionLog(tmp_path / "slurm.jsonl")
    j = Journal(db)
    key = action_key("resubmit", JOB, 1)

    def timeout_after_submit() -> str:   # sbatch timed out, but slurmctld had taken the job
        slurm.submit("omni.train-a.1")
        raise TimeoutError("sbatch: timed out")

    with pytest.raises(TimeoutError):
        perform_once(j, key=key, job=JOB, incarnation=1, kind="resubmit", payload={}, now=lambda: 1.0,
                     act=timeout_after_submit, find_existing=lambda _: slurm.find("omni.train-a.1"))
    assert [a.state for a in j.pending_actions()] == ["failed"]
    got = perform_once(j, key=key, job=JOB, incarnation=1, kind="resubmit", payload={}, now=lambda: 2.0,
                       act=lambda: slurm.submit("omni.train-a.1"), find_existing=lambda _: slurm.find("omni.train-a.1"))
    assert got == "1000" and len(slurm.jobs()) == 1
    action = j.action(key)
    assert action is not None and action.attempts == 2 and action.state == "done"
    with pytest.raises(JournalError, match="not intended"):
        j.mark_done(key, "x", 3.0)


def test_wal_and_readonly_status_while_writing(tmp_path: Path) -> None:
    db = fresh(tmp_path)
    writer = Journal(db)
    assert writer._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    writer.open_recovery(JOB, 0, "down", ("t1",), fault_at=10.0, detected_at=11.0, confirmed_at=12.5)
    for phase, at in [("resubmitted", 13.0), ("running", 20.0), ("first_step", 31.0), ("running", 99.0)]:
        writer.mark_phase(JOB, 0, phase, at, new_incarnation=1 if phase == "resubmitted" else None)
    writer.update_progress(JOB, global_step=120, last_checkpoint_step=100, heartbeat_at=40.0, progress_at=39.0)
    reader = Journal(db, readonly=True)
    (view,) = reader.status(1000, now=42.0)
    assert view["heartbeat_lag_s"] == 2.0 and view["last_checkpoint_step"] == 100
    (rec,) = view["recoveries"]
    assert rec["complete"] and rec["times"]["running"] == 20.0          # the first report wins
    assert rec["durations"] == {"detected": 1.0, "confirmed": 1.5, "resubmitted": 0.5, "running": 7.0,
                                "first_step": 11.0, "total": 21.0}
    json.dumps(view)   # what omni status --json prints
    assert reader.status(2000, now=42.0) == []                          # another user's view is empty
    assert reader.open_recoveries() == []
    with pytest.raises(sqlite3.OperationalError):
        reader._db.execute("INSERT INTO meta VALUES ('x', 'y')")
    reader.close()
    writer.close()


def test_jobs_belong_to_their_owner(tmp_path: Path) -> None:
    j = Journal(fresh(tmp_path))
    with pytest.raises(JournalError, match="owned by uid 1000"):
        j.register_job(JOB, 2000, {}, now=1.0)
    j.register_job(JOB, 1000, {"stages": 3}, now=1.0)
    assert [x["spec"] for x in j.jobs(1000)] == [{"stages": 3}]
    assert j.jobs(2000) == []
    j.set_job_state(JOB, "done")
    assert j.jobs(1000) == []


def test_observations_dedupe_by_key_and_decisions_record_dataclasses(tmp_path: Path) -> None:
    j = Journal(fresh(tmp_path))
    assert j.record_observation(JOB, 0, "node", 1.0, {"node": "t1", "state": "down"}, key="node-down-1.json")
    assert not j.record_observation(JOB, 0, "node", 1.0, {"node": "t1"}, key="node-down-1.json")
    assert j.record_observation(JOB, 0, "heartbeat_lag", 1.0, {"lag": 2.0})
    d = Decision(Verdict.CONFIRMED, 5.0, cause="down", het_offsets=(1,), nodes=("t1",), confirmed_at=5.0)
    j.record_decision(JOB, 0, 5.0, d.verdict.value, d.cause, d)
    plan = Plan(Action.RESUBMIT, 2, (ComponentPlan(1, ("t9",), ("t9",), ("t1",)),), exclude=("t1",),
                quarantine=Quarantine({"t1": 3605.0}))
    j.open_recovery(JOB, 0, "down", ("t1",), fault_at=None, detected_at=4.0, confirmed_at=5.0)
    j.mark_phase(JOB, 0, "confirmed", 6.0, plan=plan)
    assert j.count("observations", JOB) == 2 and j.count("decisions", JOB) == 1
    rec = j.recovery(JOB, 0)
    assert rec is not None and rec.plan is not None and rec.plan["action"] == "resubmit"
    assert rec.plan["quarantine"] == {"until": {"t1": 3605.0}} and rec.times["confirmed"] == 5.0
    assert json.loads(to_json(d))["verdict"] == "confirmed"
    # the plan comes back as it was (a manager restarted mid-recovery resumes with it), and a journal
    # written before placement units were named units (data_parallel_size, the same count) still reads
    assert rec.plan["units"] == 2 and plan_from_json(rec.plan) == plan
    old = {("data_parallel_size" if k == "units" else k): v for k, v in rec.plan.items()}
    assert plan_from_json(old) == plan
    with pytest.raises(JournalError):
        j.mark_phase(JOB, 0, "celebrated", 7.0)
    with pytest.raises(JournalError):
        j.set_incarnation(JOB, 0, tag="x")


def test_schema_version_checked(tmp_path: Path) -> None:
    db = fresh(tmp_path)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(JournalError, match="schema version 99"):
        Journal(db)
    assert oct(db.stat().st_mode & 0o777) == oct(0o600)
