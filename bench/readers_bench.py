"""The strict readers of untrusted files against plain json.loads, and the hostlist bound.

    .venv/bin/python bench/readers_bench.py [--repeat 7] [--count 5000]

A heartbeat and a SPANK fault record are decoded through their schemas (formats/, msgspec, strict,
with the duplicate-key pass) and, side by side, by json.loads alone (no check at all): the ratio is
what strictness costs. The hostlist node[0-999999,0-999999,0-999999] is refused before any name is
made: its peak memory is printed against a 1 MiB limit (before the bound was counted first it
allocated about 215 MiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from slurm_omni.errors import SlurmError
from slurm_omni.manager.events import parse_fault_record, parse_heartbeat
from slurm_omni.slurm.hostlist import expand

BEAT = {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42", "step": 17,
        "phase": "training", "time": 1764460000.12, "step_time_s": 0.031, "compute_s": 0.021, "data_s": 0.002,
        "node": "node3", "last_checkpoint_step": 10, "beats": 9, "metrics": {"loss": 2.31, "samples": 8}}
FAULT = {"version": 1, "kind": "task_exit", "job_id": 43, "het_job_id": 42, "het_offset": 1, "step_id": 0,
         "node": "n3", "stage": "text", "stage_index": 1, "stage_rank": 2, "task_id": 5, "local_task_id": 1,
         "pid": 77, "exit_code": None, "signal": 9, "core_dumped": False, "time": "2026-11-30T00:00:00.120Z",
         "time_unix": 1764460800.12}


def per_call(f: Callable[[bytes], Any], data: bytes, count: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(count):
            f(data)
        times.append((time.perf_counter() - t) / count)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--count", type=int, default=5000)
    args = ap.parse_args()
    print(f"median of {args.repeat} runs of {args.count} decodes each:")
    for what, doc, parse in (("heartbeat", BEAT, parse_heartbeat), ("fault record", FAULT, parse_fault_record)):
        data = json.dumps(doc).encode()
        strict = per_call(lambda d, p=parse: p(d, "x"), data, args.count, args.repeat)
        plain = per_call(json.loads, data, args.count, args.repeat)
        print(f"  {what:13s} strict {strict * 1e6:6.1f} us, json.loads {plain * 1e6:6.1f} us: "
              f"{strict / plain:.2f} x json.loads")
    expr = "node[0-999999,0-999999,0-999999]"
    tracemalloc.start()
    try:
        expand(expr)
        refused = False
    except SlurmError:
        refused = True
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"hostlist {expr}: {'refused' if refused else 'EXPANDED'}, peak {peak / 2**20:.3f} MiB = "
          f"{peak / 2**20:.3f} x the 1 MiB limit")


if __name__ == "__main__":
    main()
