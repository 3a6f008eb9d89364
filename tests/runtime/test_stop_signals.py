"""Real ranks (``omni train`` through the local launcher, gloo on CPU) asked to stop the way Slurm
does it: SIGUSR1 to every rank, then SIGTERM to a rank that has saved, as srun sends it
(--kill-on-bad-exit) once the first rank has exited 75. A rank that has saved exits 75."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_omni.checkpoint.format import latest_step
from slurm_omni.elastic import codes as exitcodes
from slurm_omni.elastic.metrics import read_jsonl
from slurm_omni.runtime.launch import launch_local
from slurm_omni.runtime.synth import SynthSpec, write_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

JOB = """\
[training]
max_steps = 1000
[training.model]
preset = "tiny"
[training.parallel]
global_batch_size = 4
micro_batch_size = 2
[training.data]
shard_dir = "{shards}"
[training.checkpoint]
every_steps = 0
"""


def _wait(probe: Callable[[], bool], what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    while not probe():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"ranks ended or 60 s passed before {what}")
        time.sleep(0.005)


def test_term_after_the_save_still_exits_checkpointed(tmp_path: Path) -> None:
    write_shards(SynthSpec(out_dir=tmp_path / "shards", pairs=16, text=8, shard_size=16))
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB.format(shards=tmp_path / "shards"))
    run_dir = tmp_path / "run"
    job = launch_local(job_file, data_parallel_size=1, run_dir=run_dir,
                       extra_env={"OMNI_STEP_DELAY_S": "0.05", "OMNI_HEARTBEAT_INTERVAL": "0.5"})
    target, log = job.procs[1], job.log_dir / "rank-1.log"
    try:
        beat = run_dir / "heartbeat" / "rank-1.json"

        def training() -> bool:
            records = read_jsonl(beat) if beat.exists() else []
            return bool(records) and int(records[0]["step"]) >= 1  # type: ignore[call-overload]
        _wait(training, "rank 1 trained a step", job.procs)
        job.send(signal.SIGUSR1)
        _wait(lambda: "saved (blocked" in log.read_text(), "rank 1 saved", job.procs)
        # One TERM right after the save lands while the handler still runs; the rank died of the
        # ones that reached it during interpreter teardown. Keep sending until it is gone.
        terms = 0
        while target.poll() is None:
            target.send_signal(signal.SIGTERM)
            terms += 1
            time.sleep(0.005)
        codes = job.wait(60)
    finally:
        job.kill()
    assert codes == [exitcodes.EXIT_CHECKPOINTED] * 2, f"{terms} TERMs\n{job.logs()}"
    assert latest_step(run_dir / "ckpt") is not None
