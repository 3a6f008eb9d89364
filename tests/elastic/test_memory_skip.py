"""A memory snapshot whose buffer is still being written is skipped, not waited for (issue 22): with
the memory tier's writes made slow (each held in ``persist._write_file``), one process of
``elastic.init`` with memory every step goes on training; the steps whose memory lane was busy are
skipped with one counted line each, the others are committed memory-only steps, and the run resumes
from the newest of them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_omni.checkpoint import format as fmt

SCRIPT = """
import os, sys, time
from torch import nn
from slurm_omni import elastic
from slurm_omni.checkpoint import persist

real = persist._write_file


def slow_tier(path, *args):   # the memory tier's writes take a while; the file system's do not
    if str(path).startswith(os.environ["OMNI_MEMORY_DIR"]):
        time.sleep(float(os.environ["SLOW_TIER_S"]))
    return real(path, *args)


persist._write_file = slow_tier
model = nn.Linear(2, 2)
with elastic.init(max_steps=int(sys.argv[1])) as run:
    run.checkpointer(modules={"model": model})
    start = run.restore()
    print("resumed", start, flush=True)
    for step in range(start, int(sys.argv[2])):
        time.sleep(0.02)
        run.end_step(step + 1, checkpoint_every=2, loss=0.5)
"""


@pytest.fixture
def shm() -> Iterator[Path]:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = Path("/dev/shm") / f"omni-skip-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _script(tmp_path: Path, shm: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "loop.py"
    path.write_text(textwrap.dedent(SCRIPT))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_", "RANK", "WORLD_SIZE"))}
    tier = {"OMNI_MEMORY_TIER": "1", "OMNI_MEMORY_KEEPER": "1", "OMNI_MEMORY_DIR": str(shm),
            "OMNI_MEMORY_EVERY_STEPS": "1", "OMNI_FILES_EVERY": "100", "SLURM_JOB_ID": "4243"}
    return subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, env={**clean, **tier, **env},
                          capture_output=True, text=True, timeout=180, check=False)


def test_a_memory_snapshot_whose_buffer_is_busy_is_skipped_with_a_counted_line(tmp_path: Path, shm: Path) -> None:
    first = _script(tmp_path, shm, "40", "30", SLOW_TIER_S="0.4", OMNI_INCARNATION="0")
    assert first.returncode != 0 and "finished at step 30 before max_steps=40" in first.stderr, first.stderr[-3000:]
    assert "memory tier: a snapshot blocks" in first.stderr, first.stderr[-3000:]
    skips = [int(m.group(1)) for m in re.finditer(r"step (\d+) not snapshotted into memory: rank 0's previous "
                                                  r"memory snapshot is still being written \((\d+) skipped", first.stderr)]
    counts = [int(m) for m in re.findall(r"\((\d+) skipped this life\)", first.stderr)]
    assert skips and counts == list(range(1, len(skips) + 1)), first.stderr[-3000:]
    root = tmp_path / "omni-run" / "ckpt"
    memory_only = [e.step for e in fmt.complete(root) if fmt.memory_only(e.path)]
    assert memory_only and not set(memory_only) & set(skips)
    # the file system steps (2, 4) and the memory-only ones after them: every saved step is one not skipped
    newest = max(memory_only)
    second = _script(tmp_path, shm, "40", "40", SLOW_TIER_S="0", OMNI_INCARNATION="1")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed {newest}" in second.stdout, (second.stdout, newest)
