"""The built-in trainer's metrics (format: :mod:`slurm_omni.elastic.metrics`) as JSON lines and as a Prometheus textfile, one of each per rank.

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

from slurm_omni.elastic.metrics import MetricsLog, read_jsonl
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


class MetricsWriter(MetricsLog):
    """The built-in trainer's metrics files (:class:`slurm_omni.elastic.metrics.MetricsLog`)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout.metrics_dir, stage_name=layout.stage_name, stage=layout.stage, rank=layout.rank,
                         dp_rank=layout.data_parallel_rank, dp_size=layout.data_parallel_size,
                         incarnation=layout.incarnation, job_id=layout.job_id, trace=layout.trace_samples,
                         help_text=GAUGES)


__all__ = ["GAUGES", "MetricsWriter", "read_jsonl"]
