"""The built-in trainer's heartbeat: :class:`slurm_omni.elastic.heartbeat.Heartbeat` (the format is
documented there) for a runtime :class:`~slurm_omni.runtime.layout.Layout`."""

from __future__ import annotations

from slurm_omni.elastic.heartbeat import Heartbeat as _Heartbeat
from slurm_omni.runtime.layout import Layout


class Heartbeat(_Heartbeat):
    def __init__(self, layout: Layout, *, window: int = 5) -> None:
        super().__init__(layout.heartbeat_dir, rank=layout.rank, stage=layout.stage,
                         dp_rank=layout.data_parallel_rank, incarnation=layout.incarnation, job_id=layout.job_id,
                         interval_s=layout.heartbeat_interval_s, window=window, node=layout.node)
