"""Compute time of ``torch.distributed.pipelining`` stages, for the heartbeat's ``compute_s``.

A pipeline schedule interleaves a stage's own forward and backward chunks with waits for its peers'
activations and gradients. Hooks on the module (:meth:`StepTimer.watch`) would do for a hand-written
pipeline; under a schedule the plain way is a stage that times its own chunks::

    from slurm_omni import elastic

    stage = elastic.TimedStage(module, index, num_stages, run.device, input_args=..., output_args=...,
                               group=run.groups.pipeline, timer=run.timer)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)

The schedules (torch 2.13) wait for the peers' tensors before they call a chunk, so a stage that
waits for a slow peer does not look slow itself: the fail-slow detector compares ``compute_s``
between the replicas of a stage. On CUDA every chunk ends with a device synchronize, else the
kernels' time would land in the next wait.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage

from slurm_omni.elastic.timing import StepTimer


class TimedStage(PipelineStage):
    """A ``PipelineStage`` whose forward, backward and weight-gradient chunks count as compute in
    ``timer`` (usually ``run.timer``); every other argument is ``PipelineStage``'s."""

    def __init__(self, *args: Any, timer: StepTimer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timer = timer

    def _timed(self, chunk: Any, *args: Any, **kwargs: Any) -> Any:
        with self.timer.compute(synchronize=self.device.type == "cuda"):
            return chunk(*args, **kwargs)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)
