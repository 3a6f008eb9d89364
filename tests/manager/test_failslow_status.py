"""What ``omni status`` shows of the fail-slow watch, from the journal's ``failslow`` decisions: the
warning while a node is flagged, the decision with its estimate, the outcome, the whole job."""

from __future__ import annotations

from pathlib import Path

from slurm_omni.manager.journal import Journal
from slurm_omni.manager.status import failslow_view, format_status, status_view
from slurm_omni.policy.failslow import Estimate

JOB = "train-fs"


def _journal(tmp_path: Path) -> Journal:
    j = Journal(tmp_path / "journal.sqlite")
    j.register_job(JOB, 1000, {"stages": 2}, now=0.0)
    j.add_incarnation(JOB, 0, {"units": 2, "data_parallel_size": 2, "nodes": {"0": ["n1", "n2"], "1": ["n3", "n4"]}})
    j.set_incarnation(JOB, 0, slurm_job_id="41", started_at=1.0)
    return j


def test_a_flagged_node_is_a_warning_until_it_clears(tmp_path: Path) -> None:
    with _journal(tmp_path) as j:
        j.record_decision(JOB, 0, 10.0, "failslow", "flagged", {"node": "n2", "stage": 0, "ratio": 1.62,
                                                                "kind": "compute"})
        text = format_status(status_view(j, 1000, 20.0))
        assert "fail-slow WARNING: n2 (stage 0) runs 1.62x its peers (compute)" in text
        j.record_decision(JOB, 0, 30.0, "failslow", "cleared", {"node": "n2", "stage": 0, "ratio": 1.02})
        assert "WARNING" not in format_status(status_view(j, 1000, 40.0))


def test_the_decision_its_estimate_and_its_outcome_are_shown(tmp_path: Path) -> None:
    est = Estimate(step_now_s=0.4, step_replace_s=0.3, step_shrink_s=0.6, remaining_steps=1000, gain_replace_s=70.0,
                   gain_shrink_s=-230.0, restart_cost_s=30.0)
    with _journal(tmp_path) as j:
        j.record_decision(JOB, 0, 10.0, "failslow", "flagged", {"node": "n2", "stage": 0, "ratio": 1.4,
                                                                "kind": "compute"})
        j.record_decision(JOB, 0, 11.0, "failslow", "replace", {"node": "n2", "reasons": ["a spare wins 70s"],
                                                                "estimate": est, "plan": None})
        j.record_decision(JOB, 1, 60.0, "failslow", "outcome", {"step_before_s": 0.4, "step_estimated_s": 0.3,
                                                                "step_measured_s": 0.31})
        view = failslow_view(j.decisions(JOB, "failslow"))
        assert view["flagged"] == []          # the flag was of incarnation 0; incarnation 1 runs elsewhere
        assert view["migration"]["action"] == "replace" and view["migration"]["estimate"]["step_replace_s"] == 0.3
        text = format_status(status_view(j, 1000, 70.0))
    assert "fail-slow decision (replace n2, incarnation 0): a spare wins 70s  estimate 0.400 -> 0.300s/step" in text
    assert "fail-slow outcome: 0.310s/step after the migration (estimated 0.300, before 0.400)" in text


def test_a_whole_job_slowdown_is_shown_without_a_node(tmp_path: Path) -> None:
    with _journal(tmp_path) as j:
        j.record_decision(JOB, 0, 10.0, "failslow", "job_slow", {"ratio": 1.45, "cause": "data"})
        text = format_status(status_view(j, 1000, 20.0))
        assert "whole job 1.45x slower than its best window (data); no node stands out" in text
        j.record_decision(JOB, 0, 50.0, "failslow", "job_ok", {"ratio": 1.0, "cause": ""})
        assert "whole job" not in format_status(status_view(j, 1000, 60.0))
