"""What users see of each recovery: its path, the Slurm job before and after, the nodes removed and
added, the spares left (``omni status --json``, the text view, the timeline file ``omni report``
reads), and a journal written before paths were recorded."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from slurm_omni.drill.story import recovery_path
from slurm_omni.manager.journal import Journal
from slurm_omni.manager.status import format_status, status_view, write_timeline
from slurm_omni.policy.placement import Action, ComponentPlan, Plan
from slurm_omni.report.timeline import load_timeline

UID = 1000


def _journal(tmp_path: Path) -> Journal:
    j = Journal(tmp_path / "journal.sqlite")
    j.register_job("train-a", UID, {}, 0.0)
    for number, slurm_id in ((0, "41"), (1, "41"), (2, "57")):
        j.add_incarnation("train-a", number, {"nodes": {}})
        j.set_incarnation("train-a", number, slurm_job_id=slurm_id)
    # incarnation 0 lost node3: the step supervisor relaunched inside job 41 with spare node4
    j.open_recovery("train-a", 0, "down", ("node3",), fault_at=10.0, detected_at=11.0, confirmed_at=12.0,
                    path="in_allocation")
    j.mark_phase("train-a", 0, "resubmitted", 13.0, new_incarnation=1, path="in_allocation",
                 detail={"removed": {"1": ["node3"]}, "added": {"1": ["node4"]}, "spares_left": {"0": 1, "1": 0}})
    j.mark_phase("train-a", 0, "first_step", 15.0)
    # incarnation 1 lost node4 with no spare and below the minimum: the manager resubmitted as job 57
    plan = Plan(Action.RESUBMIT, 1, (ComponentPlan(0, ("node1",)), ComponentPlan(1, ("node6",), ("node6",), ("node4",))),
                exclude=("node3", "node4"))
    j.open_recovery("train-a", 1, "down", ("node4",), fault_at=20.0, detected_at=21.0, confirmed_at=22.0,
                    path="in_allocation")
    j.mark_phase("train-a", 1, "confirmed", 30.0, plan=plan, path="resubmitted")   # the manager took over
    j.mark_phase("train-a", 1, "resubmitted", 31.0, new_incarnation=2)
    return j


def test_status_lists_each_recovery_with_its_path_jobs_nodes_and_spares(tmp_path: Path) -> None:
    with _journal(tmp_path) as j:
        (job,) = status_view(j, UID, now=40.0)
    first, second = job["recoveries"]
    assert (first["path"], first["slurm_job_id_before"], first["slurm_job_id_after"]) == ("in_allocation", "41", "41")
    assert first["nodes_removed"] == {"1": ["node3"]} and first["nodes_added"] == {"1": ["node4"]}
    assert first["spares_left"] == {"0": 1, "1": 0} and first["complete"]
    assert (second["path"], second["slurm_job_id_before"], second["slurm_job_id_after"]) == ("resubmitted", "41", "57")
    assert second["nodes_removed"] == {"1": ["node4"]} and second["nodes_added"] == {"1": ["node6"]}
    assert second["spares_left"] is None and second["action"] == "resubmit"
    assert json.loads(json.dumps(job)) == job                    # what --json prints
    text = format_status([job])
    assert "path in_allocation: Slurm job 41 -> 41  nodes 1: -node3 +node4  spares left 0: 1, 1: 0" in text
    assert "path resubmitted: Slurm job 41 -> 57  nodes 1: -node4 +node6" in text


def test_the_timeline_file_carries_the_path_for_omni_report(tmp_path: Path) -> None:
    with _journal(tmp_path) as j:
        write_timeline(j, UID, tmp_path / "timeline.json")
    first, second = load_timeline(tmp_path / "timeline.json").recoveries
    assert (first.path, first.job_id, first.new_job_id) == ("in_allocation", "41", "41")
    assert (second.path, second.job_id, second.new_job_id, second.action) == ("resubmitted", "41", "57", "resubmit")


def test_a_journal_from_before_paths_is_read_and_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    with Journal(path) as j:
        j.register_job("train-a", UID, {}, 0.0)
        j.open_recovery("train-a", 0, "task_exit", ("node3",), fault_at=None, detected_at=1.0, confirmed_at=2.0)
        j.mark_phase("train-a", 0, "resubmitted", 3.0, new_incarnation=1)
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE recoveries DROP COLUMN path")
    con.execute("ALTER TABLE recoveries DROP COLUMN detail")
    con.commit()
    con.close()
    with Journal(path, readonly=True) as ro:             # omni status on an older journal
        (job,) = status_view(ro, UID, now=5.0)
        assert job["recoveries"][0]["path"] == "requeued"   # no plan: an array task's requeue
    with Journal(path) as j:                              # a newer manager adds the columns
        j.mark_phase("train-a", 0, "first_step", 4.0, path="requeued")
        assert j.recoveries("train-a")[0].path == "requeued"


def test_the_demo_prints_the_newest_recovery_path(tmp_path: Path) -> None:
    with _journal(tmp_path) as j:
        write_timeline(j, UID, tmp_path / "timeline.json")
    assert recovery_path(tmp_path / "timeline.json") == "path resubmitted: Slurm job 41 -> 57"
    assert recovery_path(tmp_path / "missing.json").startswith("path unknown (report: couldn't read timeline")


def test_status_shows_the_newest_launch_that_failed_before_its_first_heartbeat(tmp_path: Path) -> None:
    """``omni status`` (text and --json): its line, exit code and full log, and how many there were."""
    with _journal(tmp_path) as j:
        (job,) = status_view(j, UID, now=40.0)
        assert job["start_failure"] is None
        for inc, line in ((1, "KeyError: 'a'"), (2, "ModuleNotFoundError: No module named 'x'")):
            j.record_decision("train-a", inc, 30.0 + inc, "start_failure", "before_first_heartbeat",
                              {"job_id": "57", "incarnation": inc, "launch": 0, "exit_code": 1, "line": line,
                               "log": "/logs/train-a-57.out", "time": 30.0 + inc, "stopped": ""})
        (job,) = status_view(j, UID, now=40.0)
    assert job["start_failure"] == {"incarnation": 2, "time": 32.0, "slurm_job_id": "57", "launch": 0, "exit_code": 1,
                                    "line": "ModuleNotFoundError: No module named 'x'", "log": "/logs/train-a-57.out",
                                    "count": 2}
    assert json.loads(json.dumps(job)) == job
    assert ("  failed before its first heartbeat (incarnation 2, Slurm job 57, exit 1): ModuleNotFoundError: No "
            "module named 'x' (full log: /logs/train-a-57.out)") in format_status([job])


def test_status_shows_the_stages_by_their_own_names(tmp_path: Path) -> None:
    """One stage named gpt, three of the user's naming: the header and the het components say their
    names; an in-allocation job's one allocation keeps its number (it holds every stage)."""
    def spec(*names: str) -> dict[str, object]:
        return {"stages": [{"het_group": i, "name": n} for i, n in enumerate(names)]}

    with Journal(tmp_path / "journal.sqlite") as j:
        j.register_job("llm", UID, spec("gpt"), 0.0)
        j.add_incarnation("llm", 0, {"nodes": {"0": ["node1", "node2"]}})
        j.register_job("three", UID, spec("speech", "image", "lm"), 0.0)
        j.add_incarnation("three", 0, {"nodes": {"0": ["node1"], "1": ["node2"], "2": ["node3"]}})
        j.register_job("packed", UID, spec("enc", "dec"), 0.0)
        j.add_incarnation("packed", 0, {"nodes": {"0": ["node1", "node2", "node3"]}})
        jobs = {job["name"]: job for job in status_view(j, UID, now=1.0)}
    assert jobs["llm"]["stages"] == ["gpt"] and jobs["three"]["stages"] == ["speech", "image", "lm"]
    text = format_status(list(jobs.values()))
    assert "llm  active  gpt stage  incarnation" in text
    assert "nodes gpt: node1,node2" in text
    assert "three  active  speech | image | lm stages  incarnation" in text
    assert "nodes speech: node1 | image: node2 | lm: node3" in text
    assert "packed  active  enc | dec stages" in text and "nodes 0: node1,node2,node3" in text
