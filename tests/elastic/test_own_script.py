"""examples/own-script/train.py in real processes (gloo on CPU, StatefulDataLoader workers): under
plain torchrun with no Slurm at all; and, as the batch script starts it (vision | text, OMNI_*), asked
to stop by SIGUSR1 (saves, exits 75) and resumed on half the replicas, and SIGKILLed and resumed, each
checked against a run that never failed (the demo's equivalence check: loss, every sample once)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from own_script_support import EXAMPLE

from slurm_omni.checkpoint.format import latest_step
from slurm_omni.drill.equivalence import check_equivalence
from slurm_omni.drill.history import load_history
from slurm_omni.drill.reference import JOB_ENV, launch_job
from slurm_omni.elastic.codes import EXIT_CHECKPOINTED
from slurm_omni.runtime.launch import LocalJob

LOCAL_LANE = pytest.mark.skipif(
    os.environ.get("OMNI_OWN_SCRIPT_LOCAL") != "1",
    reason="the local-launcher versions of tests/elastic/test_own_script_cluster.py (about 4 min): "
           "OMNI_OWN_SCRIPT_LOCAL=1")
"""The cluster tests run the same faults through omni submit, the batch script and the manager; these
run the ranks with the local launcher (no Slurm), for debugging the script's side alone."""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMNI_", "SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(300)
def test_trains_under_torchrun_without_slurm(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(_free_port()), str(EXAMPLE / "train.py"), "--steps", "4", "--workers", "1"]
    proc = subprocess.run(argv, cwd=tmp_path, env=_clean_env(PATH="/usr/bin:/bin"), capture_output=True,
                          text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "omni-run"
    steps = [json.loads(line)["step"] for line in (run / "metrics" / "metrics-vision+text-0.jsonl").open()]
    beat = json.loads((run / "heartbeat" / "rank-1.json").read_text())
    assert steps == [1, 2, 3, 4] and beat["phase"] == "done" and beat["last_checkpoint_step"] == 4
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step-")) == ["step-4"]


# -- as the batch script starts it --------------------------------------------------------------------

@pytest.fixture
def job_file(own_job_file: Path) -> Path:
    return own_job_file


def _launch(job_file: Path, run_dir: Path, dp: int, incarnation: int, delay: str = "0") -> LocalJob:
    return launch_job(job_file, data_parallel_size=dp, run_dir=run_dir, incarnation=incarnation,
                      extra_env={**JOB_ENV, "OMNI_STEP_DELAY_S": delay, "OMNI_HEARTBEAT_INTERVAL": "0.5"})


def _wait_step(run_dir: Path, job: LocalJob, step: int) -> None:
    beat = run_dir / "heartbeat" / "rank-3.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in job.procs):
            raise AssertionError(f"a rank ended before step {step}:\n{job.logs()[-3000:]}")
        try:
            if json.loads(beat.read_text())["step"] >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 240 s")


@pytest.fixture
def reference(own_reference: Path) -> Path:
    return own_reference


@LOCAL_LANE
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_usr1_saves_exits_75_and_a_shrink_to_one_replica_keeps_every_sample(job_file: Path,
                                                                              reference: Path) -> None:
    run_dir = job_file.parent / "shrink"
    job = _launch(job_file, run_dir, 2, 0, delay="0.3")
    _wait_step(run_dir, job, 6)
    job.send(signal.SIGUSR1)
    codes = job.wait(300)
    assert codes == [EXIT_CHECKPOINTED] * 4, job.logs()[-3000:]
    beats = [json.loads((run_dir / "heartbeat" / f"rank-{r}.json").read_text()) for r in range(4)]
    saved = beats[0]["last_checkpoint_step"]
    assert {b["phase"] for b in beats} == {"stopping"} and {b["last_checkpoint_step"] for b in beats} == {saved}
    assert saved is not None and latest_step(run_dir / "ckpt") == saved
    resumed = _launch(job_file, run_dir, 1, 1)
    assert resumed.wait(600) == [0, 0], resumed.logs()[-3000:]
    history = load_history(run_dir / "metrics")
    eq = check_equivalence(history, load_history(reference))
    assert eq.ok, eq.summary()
    assert eq.loss.mode == "tolerance" and eq.data is not None and eq.data.paired
    layouts = {r.data_parallel_size for r in history.incarnation_records(1)}
    assert layouts == {1} and min(r.step for r in history.incarnation_records(1)) == saved + 1


@LOCAL_LANE
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sigkilled_rank_resumes_bitwise(job_file: Path, reference: Path) -> None:
    run_dir = job_file.parent / "killed"
    job = _launch(job_file, run_dir, 2, 0, delay="0.3")
    _wait_step(run_dir, job, 11)                # step 10 is checkpointed
    job.procs[3].send_signal(signal.SIGKILL)
    job.kill()                                  # what srun --kill-on-bad-exit does to the others
    resumed = _launch(job_file, run_dir, 2, 1)
    assert resumed.wait(600) == [0, 0, 0, 0], resumed.logs()[-3000:]
    eq = check_equivalence(load_history(run_dir / "metrics"), load_history(reference))
    assert eq.ok and eq.loss.mode == "bitwise", eq.summary()
