"""The runtime applies the memory tier's cadence (issue 22): real processes, gloo on CPU, 2 + 2 ranks.

The job sets memory every step and the file system every 5th snapshot: once the life's second file
system checkpoint is measured, rank 0 prints the cadence, the steps between go to memory only (no
shard file on the file system), a killed run resumes from the newest memory-only step, read from
memory, and trains on bitwise like a run that never stopped."""

from __future__ import annotations

import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_omni.checkpoint import format as fmt
from slurm_omni.elastic.metrics import read_jsonl
from slurm_omni.runtime.launch import launch_local
from slurm_omni.runtime.synth import SynthSpec, write_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = """\
[training]
max_steps = {max_steps}
[training.model]
preset = "tiny"
[training.parallel]
global_batch_size = 8
micro_batch_size = 2
[training.data]
shard_dir = "{shards}"
[[training.data.sources]]
name = "pairs"
weight = 3
[[training.data.sources]]
name = "text"
weight = 1
[training.checkpoint]
every_steps = 2
keep_last = 2
memory_tier = true
memory_every_steps = 1
files_every = 5
"""


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"omni-cadence-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(shm: Path) -> dict[str, str]:
    # what the render and the standby client set on a cluster (OMNI_MEMORY_KEEPER: a process frees it)
    return {"OMNI_MEMORY_TIER": "1", "OMNI_MEMORY_KEEPER": "1", "OMNI_MEMORY_DIR": str(shm),
            "OMNI_MEMORY_EVERY_STEPS": "1", "OMNI_FILES_EVERY": "5", "SLURM_JOB_ID": "4242",
            "OMNI_HEARTBEAT_INTERVAL": "0.5"}


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_jsonl(run_dir / "metrics" / "metrics-text-0.jsonl")  # type: ignore[arg-type]
            if r.get("loss") is not None}


def test_memory_every_step_files_every_fifth_and_a_kill_resumes_from_memory(tmp_path: Path, shm: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    write_shards(SynthSpec(out_dir=tmp_path / "shards", pairs=48, text=16, shard_size=16))
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(max_steps=24, shards=tmp_path / "shards"))
    reference = tmp_path / "reference"
    ref = launch_local(job, data_parallel_size=2, run_dir=reference, extra_env=_env(shm / "ref"))
    assert ref.wait(240) == [0, 0, 0, 0], ref.logs()
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((reference / "logs").rglob("*")) if p.is_file())
    line = next(x for x in logs.splitlines() if "memory tier: a snapshot blocks" in x)
    assert "into memory every 1 step" in line and "the file system every 5 steps" in line and "from step 4" in line
    ckpt = reference / "ckpt"
    # files at 2 and 4 (before the cadence), then 5, 10, 15, 20 and 24 (the last); memory-only between
    assert [e.step for e in fmt.complete(ckpt)] == [24, 20]          # keep_last = 2 counts steps with files
    assert not list(ckpt.glob("step-*/rank-*.h5.*"))

    killed = tmp_path / "killed"
    run = launch_local(job, data_parallel_size=2, run_dir=killed, extra_env={**_env(shm / "job"), "OMNI_STEP_DELAY_S": "0.3"})
    try:
        import time
        deadline = time.monotonic() + 200

        def newest() -> tuple[int, bool]:
            done = fmt.complete(killed / "ckpt")
            return (done[0].step, fmt.memory_only(done[0].path)) if done else (-1, False)

        while not (newest()[0] >= 12 and newest()[1]):
            assert time.monotonic() < deadline and all(p.poll() is None for p in run.procs), run.logs()
            time.sleep(0.05)
        run.send(signal.SIGKILL)
        run.wait(60)
    finally:
        run.kill()
    step, memory_only = newest()
    assert memory_only and step % 5 != 0 and not (fmt.step_dir(killed / "ckpt", step) / "rank-00000.h5").exists()
    # the next life, on the same "node" (its memory kept): resumes from that step, read from memory
    again = launch_local(job, data_parallel_size=2, run_dir=killed, incarnation=1, extra_env=_env(shm / "job"))
    assert again.wait(240) == [0, 0, 0, 0], again.logs()
    firsts = {}
    for path in (killed / "metrics").glob("metrics-*.jsonl"):
        for r in read_jsonl(path):
            if r["incarnation"] == 1:
                firsts.setdefault(path.name, r)
    assert firsts and all(r["step"] == step + 1 and r["restore_source"] == "memory" for r in firsts.values()), firsts
    assert _losses(killed) == _losses(reference)   # float equality, step by step
