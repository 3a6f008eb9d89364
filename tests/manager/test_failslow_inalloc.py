"""A fail-slow node replaced inside the allocation: the job runs in ``in_allocation`` mode (one
allocation with a spare per stage, the step supervisor relaunches it); ``omni drill slow-node``
makes a vision node 3x slower; the manager flags it and, the supervisor having a spare, writes the
request file (``<ckpt>/supervisor/<job>.request.json``) instead of resubmitting. The supervisor
accepts it, the ranks checkpoint on USR1 and exit 75, the next launch runs in the same Slurm job
without the slow node and restores exactly the step the last one reached; the manager neither
cancels nor submits, and the loss is bitwise the one of a reference run that never migrated.
About 2-3 minutes: OMNI_FAILSLOW_CLUSTER=1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from manager_cluster_support import BIN, REPO, make_shards, manager_run
from omni_configs import site_toml
from support import wait_until

from slurm_omni.drill.equivalence import check_equivalence
from slurm_omni.drill.history import load_history
from slurm_omni.drill.reference import JOB_ENV as REFERENCE_ENV
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path, read_status, status_path

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(os.environ.get("OMNI_FAILSLOW_CLUSTER") != "1",
                                 reason="in-allocation fail-slow lane (2-3 min): OMNI_FAILSLOW_CLUSTER=1")]

TABLES = ('[elasticity]\nrecovery = "in_allocation"\ndefault_spares = 1\n'
          "[failslow]\nmargin = 0.5\nclear_margin = 0.3\nwindow_s = 10\nsustain_s = 5\nclear_s = 10\nrestart_cost_s = 1\nmin_gain = 1.0\n"
          '[drills]\nallowed_nodes = "node[1-8]"\n[detection]\nheartbeat_interval_s = 0.5\n')
MAX_STEPS = 260


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    return make_shards(tmp_path_factory.mktemp("failslow-inalloc-data"))


def test_a_slow_node_is_replaced_by_a_spare_of_the_allocation_at_a_checkpoint(slurm_cluster, shards: Path,
                                                                              tmp_path: Path) -> None:
    with manager_run(tmp_path, slurm_cluster.env, slurm_cluster.spool, shards, name="fs-inalloc", dp=2,
                     max_steps=MAX_STEPS) as run:
        run.site.write_text(site_toml(tmp_path, spool_dir=slurm_cluster.spool, tables=TABLES)
                            .replace('partition = "vision"', 'partition = "debug"')
                            .replace('partition = "text"', 'partition = "debug"'))
        run.env.update(REFERENCE_ENV)
        job_id = run.submit()
        reference = start_reference(tmp_path / "job.toml", tmp_path / "reference")
        reached: dict[tuple[str, int], int] = {}   # (Slurm job, incarnation) -> highest step its ranks showed
        done = threading.Event()

        def watch_beats() -> None:
            while not done.wait(0.2):
                for path in run.heartbeat_dir.glob("rank-*.json"):
                    try:
                        b = json.loads(path.read_text())
                    except (OSError, ValueError):
                        continue
                    key = (b["job_id"], b["incarnation"])
                    reached[key] = max(reached.get(key, -1), b["step"])

        recorder = threading.Thread(target=watch_beats, daemon=True)
        recorder.start()
        ckpt = run.heartbeat_dir.parent
        beats = run.wait_steps(job_id, 4, 2, timeout_s=180)
        run.start_manager()
        run.wait_watching(job_id)
        status = wait_until(lambda: read_status(status_path(ckpt, str(job_id))), 120,
                            f"the step supervisor's status file\n{run.job_log(job_id)}", interval_s=0.5)
        assert status["spares_left"] == 2
        slow = next(b["node"] for b in beats.values() if b["stage"] == 0)
        watched = run.wait_steps(job_id, 4, 1, timeout_s=60)
        run.wait_steps(job_id, 4, max(b["step"] for b in watched.values()) + 70, timeout_s=180)
        drill = subprocess.Popen([str(BIN / "omni"), "drill", "slow-node", "--job", "fs-inalloc", "--node", slow,
                                  "--factor", "3", "--site", str(run.site)], env=run.env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            (rec,) = run.wait_recovery(1, "first_step", timeout_s=240)
        finally:
            drill.send_signal(signal.SIGTERM)
            out = drill.communicate(timeout=30)[0].decode()
        assert drill.returncode == 0, out
        assert rec.path == "in_allocation" and slow in rec.nodes
        decisions = [(c, json.loads(p)) for c, p in run.rows(
            "SELECT cause, payload FROM decisions WHERE job = ? AND verdict = 'failslow' ORDER BY id", run.key)]
        flagged = next(p for c, p in decisions if c == "flagged")
        assert flagged["node"] == slow
        replace = next(p for c, p in decisions if c == "replace")
        assert replace["path"] == "in_allocation" and replace["node"] == slow
        assert "request_refused" not in [c for c, _ in decisions]
        # the supervisor's answer, once accepted and then carried out
        answers = SupervisorJournal(journal_path(ckpt, str(job_id))).state.requests
        assert answers == {replace["request"]: "carried_out"}
        # no cancel, no sbatch: the same Slurm job trains on, without the slow node
        assert not run.rows("SELECT key FROM actions")
        inc0, inc1 = run.incarnations()[:2]
        assert inc0["slurm_job_id"] == inc1["slurm_job_id"] == str(job_id)
        status = read_status(status_path(ckpt, str(job_id)))
        assert status is not None and slow not in {n for c in status["components"] for n in c}
        # no step lost: the next launch restored the step the last one reached
        beats = run.wait_steps(job_id, 4, 1, timeout_s=120)
        new_life = {b["incarnation"] for b in beats.values()}
        assert len(new_life) == 1 and new_life != {0}
        done.set()
        recorder.join()
        stopped = reached[(str(job_id), 0)]
        restored = SupervisorJournal(journal_path(ckpt, str(job_id))).state.current
        assert restored is not None and restored.number == 1
        assert inc1["layout"]["restore_step"] == stopped
        wait_until(lambda: run.beats(job_id) and all(b["phase"] == "done" for b in run.beats(job_id).values()),
                   240, "the job to finish")
        ref_metrics = finish_reference(reference, tmp_path / "reference", 300)
        eq = check_equivalence(load_history(tmp_path / "metrics" / "fs-inalloc"), load_history(ref_metrics))
        assert eq.ok, eq.summary()
        assert eq.loss.steps_compared == MAX_STEPS and eq.loss.mode == "bitwise"
