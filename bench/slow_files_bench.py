"""A slow shared file system against the memory tier's cadence (issue 22), side by side in one run.

    .venv/bin/python bench/slow_files_bench.py [--mib 64] [--steps 60] [--step-s 0.5] [--files-every 10]
                                               [--hold-s 3.0] [--repeat 3]

One engine with the memory tier saves every step, memory-only but every ``--files-every``-th, whose
file system write is held ``--hold-s`` seconds at the file boundary (``persist._write_file``: a shared
file system that takes that long), longer than the steps between two steps with files when the hold
is large. Beside it the same run with no file system step (memory only): the floor, what the memory
snapshots alone block. Bar: the per-step blocking with the slow file system <= 1.5 x the floor (mean
over the run, median of ``--repeat``): the file system write must not hold the memory snapshots back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from slurm_omni.checkpoint import CheckpointConfig, CheckpointEngine, ShardState, persist

BAR = 1.5


def one_run(state: ShardState, *, steps: int, step_s: float, files_every: int, hold_s: float) -> list[float]:
    """Per-step blocking of ``save`` (seconds); ``files_every`` 0: memory-only throughout."""
    root = Path(tempfile.mkdtemp(prefix="omni-slowfiles-"))
    shm = Path("/dev/shm") / f"omni-slowfiles-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    real = persist._write_file

    def held(path: Path, *args: object) -> int:
        if path.is_relative_to(root):
            time.sleep(hold_s)
        return real(path, *args)  # type: ignore[arg-type]

    persist._write_file = held  # type: ignore[assignment]
    try:
        eng = CheckpointEngine(CheckpointConfig(root=root, memory_tier=True, memory_job="bench", memory_dir=shm,
                                                pin_memory=False, keep_last=2))
        eng.prepare(state)
        blocked = []
        for step in range(1, steps + 1):
            time.sleep(step_s)   # the step's compute
            started = time.monotonic()
            eng.save(step, state, files=bool(files_every) and step % files_every == 0)
            blocked.append(time.monotonic() - started)
        eng.close()
        return blocked
    finally:
        persist._write_file = real  # type: ignore[assignment]
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.5)
    p.add_argument("--files-every", type=int, default=10)
    p.add_argument("--hold-s", type=float, default=3.0)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    if a.mib < 1 or a.steps < 1 or a.step_s < 0 or a.files_every < 1 or a.hold_s < 0 or a.repeat < 1:
        print("slow_files_bench: --mib, --steps, --files-every and --repeat at least 1; --step-s and --hold-s "
              "0 or more")
        return 2
    if not Path("/dev/shm").is_dir():
        print("slow_files_bench: no /dev/shm on this machine (the memory tier's folder)")
        return 2
    g = torch.Generator().manual_seed(0)
    n = max(1, a.mib // 4)   # 4 MiB per 1024 x 1024 fp32 tensor
    state = ShardState(modules={"m": {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(n)}})
    slow, floor = [], []
    for rep in range(a.repeat):   # taking turns: the load falls on both
        s = one_run(state, steps=a.steps, step_s=a.step_s, files_every=a.files_every, hold_s=a.hold_s)
        f = one_run(state, steps=a.steps, step_s=a.step_s, files_every=0, hold_s=a.hold_s)
        slow.append(s)
        floor.append(f)
        print(f"repeat {rep + 1}: slow file system mean {statistics.mean(s) * 1e3:.1f} ms max {max(s):.2f} s; "
              f"memory only mean {statistics.mean(f) * 1e3:.1f} ms max {max(f):.2f} s; load {os.getloadavg()[0]:.1f}",
              flush=True)
    mean_slow = statistics.median(statistics.mean(s) for s in slow)
    mean_floor = statistics.median(statistics.mean(f) for f in floor)
    ratio = mean_slow / mean_floor if mean_floor > 0 else float("inf")
    print(f"{a.mib} MiB shard, {a.steps} steps of {a.step_s} s, the file system every {a.files_every}th step held "
          f"{a.hold_s} s ({a.hold_s / a.step_s:.1f} steps: memory snapshots every step), median of {a.repeat}")
    print(f"  blocking per step: slow file system {mean_slow * 1e3:.1f} ms, memory only {mean_floor * 1e3:.1f} ms: "
          f"x{ratio:.2f}  {'PASS' if ratio <= BAR else 'MISS'} (bar <= {BAR}x the memory-only run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
