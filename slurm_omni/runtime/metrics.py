"""Training metrics as JSON lines and as a Prometheus textfile, one of each per rank.

Files are named by stage and replica (``<stage>-<dp_rank>``, e.g. ``text-0``), not by rank, so that
one replica's history stays in one file when a resized run renumbers the ranks:

``<OMNI_METRICS_DIR>/metrics-<stage>-<dp_rank>.jsonl``: one object per logged step (keys below).
``<OMNI_METRICS_DIR>/omni-<stage>-<dp_rank>.prom``: the latest values as gauges ``omni_<key>``
labelled with job, rank, stage and dp_rank, written to a temporary name and renamed (node_exporter's
textfile collector convention). Replica 0 removes the textfiles of replicas that no longer exist.
``<OMNI_METRICS_DIR>/samples-<stage>-<dp_rank>.jsonl`` (with OMNI_TRACE_SAMPLES=1): the sample ids of
every step, ``{"step", "ids", "dp_rank", "incarnation"}``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO

from slurm_omni.checkpoint.format import write_atomic
from slurm_omni.runtime.layout import Layout

GAUGES = {
    "step": "Last completed global step.",
    "loss": "Mean training loss of the step over all replicas (text stage only).",
    "lr": "Learning rate used for the step.",
    "grad_norm": "Global gradient norm before clipping.",
    "step_time_seconds": "Wall time of the step on this rank.",
    "pipeline_seconds": "Part of the step spent in the pipeline schedule (forward and backward).",
    "pipeline_cpu_seconds": "CPU time of this rank's main thread in the schedule: its own compute on CPU.",
    "samples_per_second": "Samples this rank's stage processed per second (this replica).",
    "tokens_per_second": "Tokens (image + text) this rank's stage processed per second (this replica).",
    "global_samples_per_second": "Samples per second of the whole job.",
    "ckpt_blocking_seconds": "Time the last checkpoint save blocked training.",
    "ckpt_persist_seconds": "Time the last finished checkpoint took to persist.",
    "data_parallel_size": "Replicas in this run.",
    "micro_batches": "Micro-batches per replica per step.",
}


class MetricsWriter:
    def __init__(self, layout: Layout) -> None:
        layout.metrics_dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        name = f"{layout.stage_name}-{layout.data_parallel_rank}"
        self.jsonl_path = layout.metrics_dir / f"metrics-{name}.jsonl"
        self.prom_path = layout.metrics_dir / f"omni-{name}.prom"
        self.trace_path = layout.metrics_dir / f"samples-{name}.jsonl"
        if layout.data_parallel_rank == 0:
            for old in layout.metrics_dir.glob(f"omni-{layout.stage_name}-*.prom"):
                if int(old.stem.rsplit("-", 1)[1]) >= layout.data_parallel_size:
                    old.unlink(missing_ok=True)
        self._jsonl: IO[str] = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        self._trace: IO[str] | None = (
            open(self.trace_path, "a", buffering=1) if layout.trace_samples else None)  # noqa: SIM115

    def log_step(self, values: dict[str, float | int | None]) -> None:
        l = self.layout
        record = {"time": time.time(), "rank": l.rank, "stage": l.stage, "dp_rank": l.data_parallel_rank,
                  "incarnation": l.incarnation, **values}
        self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self._write_prom(values)

    def trace(self, step: int, sample_ids: list[int]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps({"step": step, "ids": sample_ids, "dp_rank": self.layout.data_parallel_rank,
                                          "incarnation": self.layout.incarnation}) + "\n")

    def _write_prom(self, values: dict[str, float | int | None]) -> None:
        l = self.layout
        labels = (f'job="{l.job_id}",rank="{l.rank}",stage="{l.stage_name}",'
                  f'dp_rank="{l.data_parallel_rank}"')
        lines = []
        for key, help_text in GAUGES.items():
            value = values.get(key)
            if value is None:
                continue
            lines += [f"# HELP omni_{key} {help_text}", f"# TYPE omni_{key} gauge",
                      f"omni_{key}{{{labels}}} {float(value)!r}"]
        write_atomic(self.prom_path, ("\n".join(lines) + "\n").encode(), durable=False)

    def close(self) -> None:
        self._jsonl.close()
        if self._trace is not None:
            self._trace.close()


def read_jsonl(path: Path) -> list[dict[str, object]]:
    """All records of a metrics or trace file (tests and reports read them back)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
