"""Restore agreement on real ranks (gloo, 2 vision + 2 text ranks, the tiny model): a few flipped
bytes in one shard of the newest checkpoint send every rank to the previous step, with one message
naming the shard, and the run finishes. Before the agreement, the damaged rank's stage went back
alone and the run died with "data positions out of step" (5 of 6 tries).

The default suite flips one text rank's weights; ``OMNI_AGREE_REPEATS=1`` adds five more cases (each
rank, weights and optimizer state)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from slurm_omni.checkpoint import format as fmt
from slurm_omni.elastic import codes as exitcodes
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
[training.checkpoint]
every_steps = 2
keep_last = 10
"""


def _job(work: Path, max_steps: int) -> Path:
    path = work / f"job-{max_steps}.toml"
    path.write_text(JOB.format(max_steps=max_steps, shards=work / "shards"))
    return path


def _run(job: Path, run_dir: Path, incarnation: int) -> str:
    launched = launch_local(job, data_parallel_size=2, run_dir=run_dir, incarnation=incarnation)
    codes = launched.wait(200)
    assert codes == [exitcodes.EXIT_DONE] * 4, launched.logs()
    return "\n".join((launched.log_dir / f"rank-{r}.log").read_text(errors="replace") for r in range(4))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run: checkpoints 2, 4 and 6."""
    work = tmp_path_factory.mktemp("agree")
    write_shards(SynthSpec(out_dir=work / "shards", pairs=32, text=16, shard_size=16))
    _run(_job(work, 6), work / "run", 0)
    assert fmt.latest_step(work / "run" / "ckpt") == 6
    return work


CASES = [(3, "model")]
if os.environ.get("OMNI_AGREE_REPEATS"):
    CASES += [(0, "model"), (1, "optim"), (2, "optim"), (2, "model"), (0, "optim")]


@pytest.mark.parametrize("rank, unit", CASES)
def test_a_flipped_shard_sends_every_rank_to_the_previous_step(trained: Path, tmp_path: Path, rank: int,
                                                                unit: str) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained / "run", run_dir)
    step = fmt.step_dir(run_dir / "ckpt", 6)
    manifest = fmt.read_manifest(step)
    shard = fmt.shard_name(rank)
    piece = next(p for u in manifest.units.values() if u.part == unit for t in u.tensors.values()
                 for p in t.pieces if p.shard == shard and p.nbytes >= 16)
    with open(step / f"{shard}.h5", "r+b") as f:          # a few bytes, the file's size unchanged
        f.seek(piece.offset + 4)
        data = f.read(4)
        f.seek(piece.offset + 4)
        f.write(bytes(b ^ 0x5A for b in data))

    logs = _run(_job(trained, 8), run_dir, 1)

    resumed = sorted(int(s) for s in re.findall(r"rank \d+ resumed at step (\d+)", logs))
    assert resumed == [4, 4, 4, 4], logs[-4000:]
    messages = [line for line in logs.splitlines() if "every rank restores" in line]
    assert len(messages) == 1, logs[-4000:]
    assert f"{shard}.h5" in messages[0] and "step-6" in messages[0] and "every rank restores step-4" in messages[0]
    assert fmt.latest_step(run_dir / "ckpt") == 8
