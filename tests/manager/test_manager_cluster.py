"""The manager against the embedded cluster with real training processes (tiny model, CPU gloo):
the issue's bars. Slow by nature; each test restores the node states it changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from manager_cluster_support import BIN, REPO, ManagerRun, list_jobs, make_shards, manager_run, step_time
from support import wait_until

from slurm_omni.manager.journal import action_key, incarnation_tag
from slurm_omni.manager.status import KINDS
from slurm_omni.ownership import current_user
from slurm_omni.report.timeline import load_timeline

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("manager-data"))


def assert_old_stopped_before_resubmit(run: ManagerRun, incarnation: int) -> None:
    """The recovery submitted the next incarnation only once the poll showed the cancelled one no
    longer RUNNING or COMPLETING (its ranks checkpoint on SIGTERM)."""
    ((payload, at),) = run.rows("SELECT payload, time FROM observations WHERE job = ? AND incarnation = ? AND "
                                "kind = 'old_incarnation_end'", run.key, incarnation)
    assert json.loads(payload)["outcome"] == "stopped", payload
    ((intended_at,),) = run.rows("SELECT intended_at FROM actions WHERE key = ?",
                                 action_key("resubmit", run.key, incarnation + 1))
    assert at <= intended_at


def test_text_node_down_confirmed_within_5s_replaced_on_its_switch_and_resumed(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-down",
                     drain_failed=True) as run:
        job_id = run.submit()
        run.start_manager()
        run.wait_watching(job_id)
        run.wait_steps(job_id, 2, 8)
        # A rank stopped for 5 x the median step time, then continued: no recovery.
        per_step = step_time(run, job_id, 1)
        text_pid = run.beats(job_id)[1]["pid"]
        os.kill(text_pid, signal.SIGSTOP)
        time.sleep(5 * per_step)
        os.kill(text_pid, signal.SIGCONT)
        before = run.beats(job_id)[1]["step"]
        run.wait_steps(job_id, 2, before + 5)
        assert run.recoveries() == []

        old_vision, old_text = run.components(job_id)
        topology = slurm_cluster.backend().topology()
        leaf = topology.switch_path(old_text[0])[-1]
        free_on_leaf = [n.name for n in slurm_cluster.backend().nodes() if n.state.value == "idle"
                        and n.leaf_switch == leaf and n.name not in old_vision + old_text]
        run.set_node(old_text[0], "DOWN")
        (rec,) = run.wait_recovery(1, "resubmitted")
        # the first agreeing level-1 signal wins: the node's DOWN from the poll, or the SPANK records
        # of the tasks Slurm killed with it, whichever the manager saw first
        assert rec.cause in ("down", "task_exit") and old_text[0] in rec.nodes
        assert rec.times["confirmed"] - rec.times["detected"] <= 5.0, rec.times   # the journal's clock
        (rec,) = run.wait_recovery(1, "first_step")
        new = run.incarnations()[1]
        new_id = int(new["slurm_job_id"])
        new_vision, new_text = run.components(new_id)
        assert new_vision == old_vision and new_text != old_text
        if free_on_leaf:   # other jobs may hold the leaf on a shared cluster: then the next switch up
            assert topology.switch_path(new_text[0])[-1] == leaf, (free_on_leaf, rec.plan)
        else:
            assert "lowest common switch" in " ".join(rec.plan["reasons"]), rec.plan   # type: ignore[index]
        restore_step = new["layout"]["restore_step"]
        assert restore_step is not None and f"resumed at step {restore_step}" in run.job_log(new_id)
        # the new incarnation's ranks say so: its first step was judged on their heartbeats (life 1)
        assert new["number"] == 1 and {b["incarnation"] for b in run.beats(new_id).values()} == {1}

        def status_json() -> dict[str, Any] | None:
            out = subprocess.run([str(BIN / "omni"), "status", "--json", "--site-config", str(run.site),
                                  "--state-dir", str(run.state_dir)], env=run.env, capture_output=True, text=True,
                                 timeout=30, check=True).stdout
            (job,) = json.loads(out)["jobs"]
            # the progress row follows the heartbeats at most once per poll interval
            return job if (job["global_step"] or -1) > restore_step else None
        job = wait_until(status_json, 30, "omni status to show the new incarnation's progress", interval_s=1.0)
        assert job["name"] == run.key and job["current_incarnation"] == 1
        assert [i["layout"]["nodes"] for i in job["incarnations"]] == [{"0": old_vision, "1": old_text},
                                                                     {"0": new_vision, "1": new_text}]
        (timeline,) = job["recoveries"]
        assert timeline["complete"] and all(timeline["times"][p] is not None for p in
                                            ("detected", "confirmed", "resubmitted", "running", "first_step"))
        assert timeline["cause"] == rec.cause and timeline["durations"]["confirmed"] <= 5.0
        assert timeline["path"] == "resubmitted" and rec.path == "resubmitted"
        assert (timeline["slurm_job_id_before"], timeline["slurm_job_id_after"]) == (str(job_id), str(new_id))
        assert timeline["nodes_removed"] == {"1": [old_text[0]]} and timeline["nodes_added"] == {"1": new_text}
        text = subprocess.run([str(BIN / "omni"), "status", "--site-config", str(run.site), "--state-dir",
                               str(run.state_dir)], env=run.env, capture_output=True, text=True, timeout=30,
                              check=True).stdout
        assert f"recovery of incarnation 0 ({rec.cause} on {','.join(rec.nodes)})" in text, text
        (entry,) = load_timeline(run.state_dir / "timeline.json").recoveries
        assert (entry.job_id, entry.incarnation, entry.action, entry.path, entry.new_job_id) == \
            (str(job_id), 0, "resubmit", "resubmitted", str(new_id))
        assert entry.kind == KINDS.get(rec.cause, rec.cause), entry
        assert entry.confirmed is not None and entry.first_step_after_restore is not None
        script = (run.state_dir / "scripts" / f"{incarnation_tag(run.key, 1)}.sbatch").read_text()
        assert "export OMNI_DP_SIZE=1" in script and f"export OMNI_CKPT_DIR={tmp_path}/ckpt/{current_user()}/mgr-down" in script
        # The failed node, drained once by the manager (drain_failed = true), its reason saying so.
        node = {n.name: n for n in slurm_cluster.backend().nodes()}[old_text[0]]
        assert "DRAIN" in node.flags and node.reason.startswith("omni:"), node
        assert [k for (k,) in run.rows("SELECT key FROM actions WHERE kind = 'drain'")] == \
            [f"drain:{run.key}:0:{old_text[0]}"]
        assert_old_stopped_before_resubmit(run, 0)


def test_killed_rank_recovers_without_slurm_and_a_killed_manager_submits_once(
        slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-kill") as run:
        job_id = run.submit()
        run.start_manager(OMNI_MANAGER_CRASH_AT="resubmit:after_submit")
        run.wait_watching(job_id)
        run.wait_steps(job_id, 2, 6)
        _, text_nodes = run.components(job_id)
        os.kill(run.beats(job_id)[1]["pid"], signal.SIGKILL)      # its node stays up
        assert run.proc is not None
        assert run.proc.wait(timeout=60) == -signal.SIGKILL, run.manager_log()   # died mid-recovery
        tag = incarnation_tag(run.key, 1)
        assert [j.job_id for j in list_jobs(run.env) if j.comment == tag], "sbatch ran before the crash"
        run.start_manager()
        (rec,) = run.wait_recovery(1, "first_step")
        assert rec.cause == "task_exit" and rec.times["confirmed"] - rec.times["detected"] <= 5.0
        leaders = {j.job_id for j in list_jobs(run.env) if j.comment == tag}   # a het job's leader id
        assert len(leaders) == 1                                    # exactly one resubmission
        new_id = int(run.incarnations()[1]["slurm_job_id"])
        assert leaders == {new_id} and run.components(new_id)[1] == text_nodes   # the healthy node is kept
        nodes = {n.name: n for n in slurm_cluster.backend().nodes()}
        assert not nodes[text_nodes[0]].state.failed
        assert_old_stopped_before_resubmit(run, 0)


def test_no_spare_on_the_switch_shrinks_then_grows_back(slurm_cluster, shards: Path, tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="mgr-shrink", dp=2,
                     spare_policy="same_switch", quarantine_s=5) as run:
        job_id = run.submit()
        run.wait_steps(job_id, 4, 1, timeout_s=150)
        vision, text = run.components(job_id)
        topology = slurm_cluster.backend().topology()
        leaf = topology.switches[topology.switch_path(text[0])[-1]]
        spares = [n for n in leaf.nodes if n not in vision + text]
        for node in spares:                                        # no spare left on the text switch
            run.set_node(node, "DRAIN", "omni-test-hold")
        run.start_manager()
        run.wait_watching(job_id)
        run.wait_steps(job_id, 4, 6)
        run.set_node(text[1], "DOWN")
        (rec,) = run.wait_recovery(1, "first_step", timeout_s=150)
        assert rec.cause in ("down", "task_exit") and text[1] in rec.nodes
        shrunk = run.incarnations()[1]
        assert shrunk["layout"]["data_parallel_size"] == 1
        shrunk_id = int(shrunk["slurm_job_id"])
        assert len(run.beats(shrunk_id)) == 2                      # one replica per stage
        for node in [*spares, text[1]]:                            # the node returns (quarantine over)
            run.set_node(node, "RESUME")
        recs = run.wait_recovery(2, "first_step", timeout_s=150)
        assert recs[1].cause == "grow"
        grown = run.incarnations()[2]
        assert grown["layout"]["data_parallel_size"] == 2
        grown_id = int(grown["slurm_job_id"])
        run.wait_steps(grown_id, 4, grown["layout"]["restore_step"] + 1)
        assert [len(c) for c in run.components(grown_id)] == [2, 2]
