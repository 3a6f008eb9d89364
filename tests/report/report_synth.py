"""A small synthetic run on disk: 2 stages x 2 replicas, a fault after step 18 with the last
checkpoint at step 15, a restart that resumes at step 16 and runs at 90 % throughput, a reference
run that never failed, heartbeats and the manager's recovery timeline.

Figures the report must find: detection 2.5 s, recovery 9.0 s, 3 steps lost, throughput 100 -> 90
samples/s (ratio 0.9), max |loss - reference| 0.001 at step 25.
"""

from __future__ import annotations

import json
from pathlib import Path

T0 = 1_764_460_000.0
FAULT, DETECTED, CONFIRMED, RESUBMITTED, RUNNING, FIRST_STEP = (T0 + x for x in (18.5, 19.5, 21.0, 22.0,
                                                                              26.0, 30.0))


def ref_loss(step: int) -> float:
    return 2.0 * 0.97 ** step


def record(rank: int, step: int, t: float, inc: int, samples_s: float, loss: float) -> dict[str, object]:
    stage = rank // 2
    return {"time": t, "rank": rank, "stage": stage, "dp_rank": rank % 2, "incarnation": inc, "step": step,
            "loss": loss if stage == 1 else None, "lr": 1e-3, "grad_norm": 1.0,
            "step_time_seconds": 16 / samples_s, "samples_per_second": samples_s / 2,
            "tokens_per_second": samples_s * (8 if stage == 0 else 40) / 2,
            "global_samples_per_second": samples_s, "ckpt_blocking_seconds": 0.05 if step >= 5 else None,
            "ckpt_persist_seconds": 0.3 if step >= 5 else None, "data_parallel_size": 2, "micro_batches": 2}


def write_run(root: Path, *, failed: bool = True, names: tuple[str, str] = ("vision", "text")) -> dict[str, Path]:
    metrics, ref, beats = root / "metrics", root / "reference", root / "heartbeats"
    for d in (metrics, ref, beats):
        d.mkdir(parents=True)
    for rank in range(4):
        lines = []
        if failed:
            lines += [record(rank, s, T0 + s, 0, 100.0, ref_loss(s)) for s in range(1, 19)]
            for s in range(16, 41):
                t = FIRST_STEP + (s - 16)
                lines.append(record(rank, s, t, 1, 50.0 if s == 16 else 90.0,
                                    ref_loss(s) + (0.001 if s == 25 else 0.0)))
        else:
            lines += [record(rank, s, T0 + s, 0, 100.0, ref_loss(s)) for s in range(1, 41)]
        name = f"metrics-{names[rank // 2]}-{rank % 2}.jsonl"  # the runtime's file names
        (metrics / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
        (ref / name).write_text("".join(
            json.dumps(record(rank, s, T0 + s, 0, 100.0, ref_loss(s))) + "\n" for s in range(1, 41)))
        (beats / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "stage": rank // 2, "dp_rank": rank % 2, "pid": 100 + rank, "incarnation": 1,
             "job_id": "42", "step": 40, "phase": "done", "time": FIRST_STEP + 24.5 - rank * 0.3,
             "step_time_s": 0.2, "last_checkpoint_step": 40, "beats": 20}))
    timeline = root / "timeline.json"
    timeline.write_text(json.dumps({"recoveries": [
        {"job_id": "42", "incarnation": 0, "fault": FAULT, "detected": DETECTED, "confirmed": CONFIRMED,
         "resubmitted": RESUBMITTED, "running": RUNNING, "first_step_after_restore": FIRST_STEP,
         "kind": "node_down", "action": "replace"}]}))
    return {"metrics": metrics, "reference": ref, "heartbeats": beats, "timeline": timeline}
