"""Synthetic run folders in the runtime's metrics format, for the drill checks."""

from __future__ import annotations

import json
from pathlib import Path

Step = tuple[int, int, float, list[int]]   # (step, incarnation, loss, ids of the global batch)


def write_run(folder: Path, steps: list[Step], *, dp: int = 2, vision_ids: dict[tuple[int, int], list[int]] | None = None,
              t0: float = 1000.0, step_s: float = 1.0, layout: dict[int, int] | None = None,
              stages: tuple[str, ...] = ("vision", "text")) -> Path:
    """Write metrics-<last stage>-*, samples-<stage>-* for every stage like ``dp`` replicas of a pipeline of
    ``stages`` would; ``vision_ids`` overrides what the stages before the last read at (step, incarnation);
    ``layout`` maps step -> dp size logged."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    last = stages[-1]
    for n, (step, inc, loss, ids) in enumerate(steps):
        t = t0 + n * step_s
        size = (layout or {}).get(step, dp)
        files.setdefault(f"metrics-{last}-0.jsonl", []).append(json.dumps({
            "time": t, "rank": dp * (len(stages) - 1), "stage": len(stages) - 1, "dp_rank": 0, "incarnation": inc,
            "step": step, "loss": loss, "global_samples_per_second": 8 / step_s, "data_parallel_size": size}))
        per = len(ids) // size
        for stage in stages:
            got = ids if stage == last else (vision_ids or {}).get((step, inc), ids)
            for r in range(size):
                files.setdefault(f"samples-{stage}-{r}.jsonl", []).append(json.dumps(
                    {"step": step, "ids": got[r * per:(r + 1) * per], "dp_rank": r, "incarnation": inc}))
    for name, lines in files.items():
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


def batches(n_steps: int, per_step: int = 4) -> list[list[int]]:
    """Ids of a run that walks through its samples in order: step s holds s*per_step .. +per_step-1."""
    return [list(range(s * per_step, (s + 1) * per_step)) for s in range(n_steps)]


def losses(n_steps: int) -> list[float]:
    return [5.0 / (1 + 0.1 * s) for s in range(n_steps)]
