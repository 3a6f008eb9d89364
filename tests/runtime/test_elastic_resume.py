"""Real processes, torchrun-style environment, gloo on CPU: kill, resume, resize.

2 vision ranks + 2 text ranks (dp=2) with the tiny model. Losses and sample ids come from the ranks'
metrics and trace files; parameters from the checkpoints the runs leave behind. When a run is
killed and resumed, steps after the last checkpoint run twice; the later incarnation's record is the
one that counts (it is what the model was trained on).
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slurm_omni.checkpoint.engine import CheckpointConfig, CheckpointEngine
from slurm_omni.checkpoint.format import latest_step
from slurm_omni.checkpoint.snapshot import ShardLayout
from slurm_omni.config.training import DataConfig, SourceConfig
from slurm_omni.elastic import codes as exitcodes
from slurm_omni.elastic.metrics import read_jsonl
from slurm_omni.runtime.data import DataPlan, open_sources
from slurm_omni.runtime.launch import LocalJob, launch_local
from slurm_omni.runtime.model import MODULES_BY_STAGE
from slurm_omni.runtime.synth import SynthSpec, write_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MAX_STEPS = 40
JOB = """\
[training]
max_steps = {max_steps}
[training.model]
preset = "tiny"
[training.parallel]
schedule = "{schedule}"
global_batch_size = 8
micro_batch_size = 2
[training.optim]
warmup_steps = 5
[training.data]
shard_dir = "{shards}"
[[training.data.sources]]
name = "pairs"
weight = 3
[[training.data.sources]]
name = "text"
weight = 1
[training.checkpoint]
every_steps = {every}
keep_last = 10
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    write_shards(SynthSpec(out_dir=root / "shards", pairs=48, text=16, shard_size=16))
    return root


def job_file(work: Path, name: str, *, max_steps: int = MAX_STEPS, every: int = 10,
             schedule: str = "1f1b") -> Path:
    path = work / f"{name}.toml"
    path.write_text(JOB.format(max_steps=max_steps, every=every, schedule=schedule, shards=work / "shards"))
    return path


def run(job: Path, run_dir: Path, *, dp: int = 2, incarnation: int = 0, delay_s: float = 0.0,
        stop_when: Callable[[], bool] | None = None, stop_signal: signal.Signals = signal.SIGKILL,
        timeout_s: float = 150) -> list[int]:
    """Launch the ranks; if ``stop_when`` turns true, send ``stop_signal`` to all of them."""
    env = {"OMNI_TRACE_SAMPLES": "1", "OMNI_STEP_DELAY_S": str(delay_s), "OMNI_HEARTBEAT_INTERVAL": "0.5"}
    job_ = launch_local(job, data_parallel_size=dp, run_dir=run_dir, incarnation=incarnation, extra_env=env)
    if stop_when is not None:
        _stop_when(job_, stop_when, stop_signal, timeout_s)
    codes = job_.wait(timeout_s)
    if stop_signal != signal.SIGKILL or stop_when is None:
        assert all(c in (exitcodes.EXIT_DONE, exitcodes.EXIT_CHECKPOINTED) for c in codes), job_.logs()
    return codes


def _stop_when(job: LocalJob, cond: Callable[[], bool], sig: signal.Signals, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            job.kill()
            pytest.fail("run ended before the stop condition\n" + job.logs())
        time.sleep(0.05)
    job.send(sig)


def latest_ckpt(run_dir: Path) -> int:
    step = latest_step(run_dir / "ckpt")
    return -1 if step is None else step


def heartbeat_step(run_dir: Path, incarnation: int, rank: int = 0) -> int:
    """Last step rank ``rank`` of ``incarnation`` reported (-1 before its first beat)."""
    records = read_jsonl(run_dir / "heartbeat" / f"rank-{rank}.json")
    if not records or records[0]["incarnation"] != incarnation:
        return -1
    return int(records[0]["step"])  # type: ignore[call-overload]


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss logged by text replica 0 (already averaged over replicas); the latest run of a step wins."""
    out: dict[int, float] = {}
    for rec in read_jsonl(run_dir / "metrics" / "metrics-text-0.jsonl"):
        out[int(rec["step"])] = float(rec["loss"])  # type: ignore[arg-type]
    return out


def sample_ids(run_dir: Path, stage: str) -> dict[int, list[int]]:
    """Step -> ids of its global batch as ``stage`` read them: the latest incarnation that ran the step,
    its replicas' ids concatenated in replica order."""
    runs: dict[int, dict[int, dict[int, list[int]]]] = {}   # step -> incarnation -> dp_rank -> ids
    for path in sorted((run_dir / "metrics").glob(f"samples-{stage}-*.jsonl")):
        for rec in read_jsonl(path):
            runs.setdefault(int(rec["step"]), {}).setdefault(int(rec["incarnation"]), {})[  # type: ignore[call-overload]
                int(rec["dp_rank"])] = list(rec["ids"])  # type: ignore[call-overload]
    out = {}
    for step, by_inc in runs.items():
        replicas = by_inc[max(by_inc)]
        out[step] = [i for r in sorted(replicas) for i in replicas[r]]
    return out


def final_params(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage, names in MODULES_BY_STAGE.items():
        layout = ShardLayout(stage="vision" if stage == 0 else "text")
        with CheckpointEngine(CheckpointConfig(root=run_dir / "ckpt", incarnation="reader"), layout) as eng:
            session = eng.restore(step=step, apply_rng=False)
            assert session is not None
            for name in names:
                out.update({f"{name}.{k}": v for k, v in session.module(name).items()})
            session.close()
    return out


@pytest.fixture(scope="module")
def reference(work: Path) -> Path:
    run_dir = work / "reference"
    run(job_file(work, "ref"), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def killed_at_20(work: Path) -> Path:
    """dp=2, SIGKILL on every rank once checkpoint 20 is complete (steps paced so the kill lands
    before 30)."""
    run_dir = work / "killed"
    codes = run(job_file(work, "ref"), run_dir, delay_s=0.1, stop_when=lambda: latest_ckpt(run_dir) >= 20)
    assert all(c == -signal.SIGKILL for c in codes)
    assert latest_ckpt(run_dir) == 20
    return run_dir


def test_same_layout_resume_is_bitwise_identical(work: Path, reference: Path, killed_at_20: Path) -> None:
    run_dir = work / "resumed-dp2"
    shutil.copytree(killed_at_20, run_dir)
    run(job_file(work, "ref"), run_dir, incarnation=1)
    ref, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert got == ref  # float equality, step by step
    a, b = final_params(reference, MAX_STEPS), final_params(run_dir, MAX_STEPS)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_shrink_to_one_replica_keeps_samples_and_losses(work: Path, reference: Path, killed_at_20: Path) -> None:
    run_dir = work / "resumed-dp1"
    shutil.copytree(killed_at_20, run_dir)
    run(job_file(work, "ref"), run_dir, dp=1, incarnation=1)
    ref, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step in range(21, MAX_STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    metrics = read_jsonl(run_dir / "metrics" / "metrics-text-0.jsonl")
    resumed = [r for r in metrics if r["incarnation"] == 1]
    assert [r["step"] for r in resumed] == list(range(21, MAX_STEPS + 1))
    assert {(r["data_parallel_size"], r["micro_batches"]) for r in resumed} == {(1, 4)}
    ref_ids = sample_ids(reference, "text")
    got_ids = sample_ids(run_dir, "text")
    assert got_ids == ref_ids
    assert sample_ids(run_dir, "vision") == got_ids  # vision and text read the same samples


def _steps_for_one_epoch(work: Path) -> int:
    cfg = DataConfig(shard_dir=work / "shards",
                     sources=[SourceConfig(name="pairs", weight=3), SourceConfig(name="text", weight=1)])
    plan = DataPlan(cfg, open_sources(cfg))
    step = 0
    while min(epoch for epoch, _ in plan.positions) < 1:
        plan.next_global_batch(step, 8)
        step += 1
    return max(step, 8)


def test_epoch_interrupted_three_times_uses_every_sample_once(work: Path) -> None:
    """One epoch of both sources (48 pairs, 16 text) with stops after steps 2 (SIGUSR1), 4 (SIGKILL)
    and 6 (SIGTERM); checkpoints every 2 steps."""
    steps = _steps_for_one_epoch(work)
    job = job_file(work, "epoch", max_steps=steps, every=2, schedule="gpipe")
    run_dir = work / "epoch"
    stops = [(2, signal.SIGUSR1), (4, signal.SIGKILL), (6, signal.SIGTERM)]
    for incarnation, (at, sig) in enumerate(stops):
        codes = run(job, run_dir, incarnation=incarnation, delay_s=0.3, stop_signal=sig,
                    stop_when=lambda at=at, inc=incarnation: heartbeat_step(run_dir, inc) >= at)
        if sig == signal.SIGKILL:
            assert all(c == -signal.SIGKILL for c in codes)
        else:
            assert codes == [exitcodes.EXIT_CHECKPOINTED] * 4
    run(job, run_dir, incarnation=len(stops))
    text_ids = sample_ids(run_dir, "text")
    assert sorted(text_ids) == list(range(1, steps + 1))
    assert sample_ids(run_dir, "vision") == text_ids
    consumed = [i for s in range(1, steps + 1) for i in text_ids[s]]
    pairs = [i for i in consumed if i < 48]
    text = [i for i in consumed if i >= 48]
    assert sorted(pairs[:48]) == list(range(48))   # 48 pairs: each exactly once in the first epoch
    assert sorted(text[:16]) == list(range(48, 64))
    assert len(pairs) >= 48 and len(text) >= 16, (len(pairs), len(text))


def test_colocated_rank_trains_like_the_split_pipeline(work: Path) -> None:
    """Both stages on one rank (the single-GPU layout) against one vision rank + one text rank."""
    job = job_file(work, "short", max_steps=6, every=0)
    split, colocated = work / "split-dp1", work / "colocated-dp1"
    run(job, split, dp=1)
    env = {"OMNI_TRACE_SAMPLES": "1"}
    codes = launch_local(job, data_parallel_size=1, run_dir=colocated, colocated=True, extra_env=env).wait(120)
    assert codes == [exitcodes.EXIT_DONE]
    a = losses(split)
    b = {int(r["step"]): float(r["loss"])  # type: ignore[arg-type]
         for r in read_jsonl(colocated / "metrics" / "metrics-vision+text-0.jsonl")}
    assert sorted(b) == list(range(1, 7))
    assert all(b[s] == pytest.approx(a[s], rel=1e-5) for s in a)
    assert sample_ids(colocated, "vision+text") == sample_ids(split, "text")


def test_misaligned_pair_stops_the_job(work: Path) -> None:
    """Drill hook: at step 3 the text rank reads its samples shifted by one; the id check stops it."""
    job = job_file(work, "short", max_steps=6, every=0)
    run_dir = work / "misaligned"
    handle = launch_local(job, data_parallel_size=1, run_dir=run_dir,
                          extra_env={"OMNI_FAULT_MISALIGN_AT_STEP": "3", "OMNI_COLLECTIVE_TIMEOUT": "30"})
    codes = handle.wait(120)
    assert codes[1] == exitcodes.EXIT_MISALIGNED, handle.logs()
    assert codes[0] != exitcodes.EXIT_DONE
    assert "couldn't pair image tokens with text" in (handle.log_dir / "rank-1.log").read_text()
    assert read_jsonl(run_dir / "heartbeat" / "rank-1.json")[0]["phase"] == "failed"
    assert max(losses(run_dir)) == 2
