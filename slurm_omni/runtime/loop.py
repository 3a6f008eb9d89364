"""The built-in multimodal trainer (``omni train``): one rank, on the public API alone.

It is a user of :mod:`slurm_omni.elastic` like any training script (``examples/own-script/``): its
layout, process groups, device, heartbeat, step timer, stop protocol, checkpointer and resume come
from the :class:`~slurm_omni.elastic.Run` that ``omni train`` makes with ``elastic.init``. What is its
own is the model (:mod:`model`), the data (:mod:`data`) and the pipeline schedule (:mod:`pipeline`).

Every rank derives the global batch of each step from the data plan, takes its replica's run of
micro-batches and reads only what its stage needs (images on the vision stage, text on the text
stage). Gradient accumulation is done by running more micro-batches through the pipeline, so the
global batch and the loss normalisation are the same for every replica count. The data plan's
positions are global (the same on every rank), so after a change of the replica count every rank
takes them from any old replica (the checkpointer's default re-cut) and cuts the batch itself.

Drill knobs of this trainer (environment):

============================  ======================================================================
OMNI_DATA_DELAY_S             SECONDS[@STEP]: each step's data loading (from global step STEP on)
                              takes this much longer, as a slow shared data source would make it
OMNI_FAULT_MISALIGN_AT_STEP   at this global step the text stage reads its micro-batches shifted by
                              one sample, which the sample-id check must stop (exit code 3)
============================  ======================================================================
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _PipelineSchedule

from slurm_omni import elastic
from slurm_omni.config.training import TrainingConfig
from slurm_omni.errors import RuntimeLayoutError
from slurm_omni.runtime.data import DataPlan, SampleRef, ShardReader, open_sources
from slurm_omni.runtime.model import (
    MODULES_BY_STAGE,
    SampleMisalignedError,
    TextMicroBatch,
    TextStage,
    build_stage,
    next_token_labels,
)
from slurm_omni.runtime.pipeline import average_gradients, build_schedule, clip_global_norm, lr_at

log = logging.getLogger(__name__)

SCRIPT = "omni train"
"""The script identity saved with every checkpoint (another script's checkpoint is refused, 78)."""
LOAD_ORDER = ("vision_encoder", "projector", "text_decoder")
"""The order the first step needs the modules; each stage's first one is its critical module."""

GAUGES = {
    "step": "Last completed global step.",
    "loss": "Mean training loss of the step over all replicas (text stage only).",
    "lr": "Learning rate used for the step.",
    "grad_norm": "Global gradient norm before clipping.",
    "step_time_seconds": "Wall time of the step on this rank.",
    "compute_seconds": "This rank's own compute in the step (its pipeline chunks and optimizer), without waits.",
    "data_seconds": "Time the step spent reading its samples.",
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
"""Help texts of the Prometheus gauges (``elastic.init(metric_help=GAUGES)``)."""


@dataclass(frozen=True, slots=True)
class DrillKnobs:
    """The trainer's fault and slowness hooks (module docstring); all off by default."""

    misalign_at_step: int = 0
    data_delay_s: float = 0.0
    data_delay_from_step: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DrillKnobs:
        env = os.environ if env is None else env
        raw_misalign = env.get("OMNI_FAULT_MISALIGN_AT_STEP", "")
        text = env.get("OMNI_DATA_DELAY_S", "")
        seconds, _, step = text.partition("@")
        try:
            misalign = int(raw_misalign) if raw_misalign else 0
        except ValueError as e:
            raise RuntimeLayoutError(f"runtime: couldn't read OMNI_FAULT_MISALIGN_AT_STEP={raw_misalign!r} (expected "
                                     "a global step)") from e
        try:
            delay, since = (float(seconds) if seconds else 0.0, int(step) if step else 0)
        except ValueError:
            delay, since = -1.0, -1
        if delay < 0 or since < 0:
            raise RuntimeLayoutError(f"runtime: couldn't read OMNI_DATA_DELAY_S={text!r} (expected SECONDS[@STEP], "
                                     "both >= 0)")
        return cls(misalign_at_step=misalign, data_delay_s=delay, data_delay_from_step=since)


@dataclass(frozen=True, slots=True)
class Batch:
    """One replica's samples of a step, as this rank's stages need them."""

    ids: torch.Tensor
    images: torch.Tensor | None        # vision stage
    tokens: torch.Tensor | None        # text stage
    has_image: torch.Tensor | None     # text stage


class Trainer:
    """Trains this rank of the run to ``max_steps`` and exits 0; a stop signal saves and exits 75
    (``run.exit``: the process ends there)."""

    def __init__(self, cfg: TrainingConfig, run: elastic.Run, knobs: DrillKnobs | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.layout = run.layout
        self.knobs = knobs or DrillKnobs.from_env()
        p = cfg.parallel
        # the accumulation that keeps the global batch at this data-parallel size
        self.micro_batches = run.layout.accumulation(p.global_batch_size, p.micro_batch_size)
        if p.micro_batches:
            p.micro_batches_for(run.layout.data_parallel_size)   # a fixed micro_batches must agree: one line

    def _extra(self) -> dict[str, Any]:
        """Saved with every checkpoint: what the layout was."""
        return {"samples_seen": self.run.step * self.cfg.parallel.global_batch_size,
                "layout": {"data_parallel_size": self.layout.data_parallel_size,
                           "micro_batches": self.micro_batches, "schedule": self.cfg.parallel.schedule,
                           "incarnation": self.layout.incarnation}}

    def train(self) -> NoReturn:
        """Resume, then train to ``max_steps`` and exit 0; on a stop signal save and exit 75."""
        cfg, run, layout = self.cfg, self.run, self.layout
        device, groups = run.device, run.groups
        if device.type == "cuda":
            torch.set_float32_matmul_precision(cfg.matmul_precision)
        stages = {s: build_stage(cfg.model, s, seed=cfg.optim.seed).to(device) for s in layout.stages}
        parts = {name: getattr(stages[s], name) for s in layout.stages for name in MODULES_BY_STAGE[s]}
        params = [p for m in stages.values() for p in m.parameters()]
        # One optimiser per module, so that each module's state is saved and restored with it.
        optimizers = {name: torch.optim.AdamW(part.parameters(), lr=cfg.optim.lr,
                                              weight_decay=cfg.optim.weight_decay,
                                              betas=(cfg.optim.beta1, cfg.optim.beta2), foreach=False)
                      for name, part in parts.items()}
        sources = open_sources(cfg.shards)
        plan = DataPlan(cfg.shards, sources)
        reader = ShardReader(cfg.model, sources)
        names = sorted(parts, key=LOAD_ORDER.index)
        ckpt = run.checkpointer(modules={n: parts[n] for n in names}, critical=names[:1], optimizers=optimizers,
                                state={"data": plan}, data=("data",), extra=self._extra,
                                keep_last=cfg.checkpoint.keep_last, script=SCRIPT)
        # every rank resumes from the same step: the newest one all ranks' shards verify
        start = run.restore()
        if run.resume is not None:
            saved = run.resume.extra if isinstance(run.resume.extra, dict) else {}
            log.info("runtime: rank %d resumed at step %d (saved with %s) in %.2fs", layout.rank, start,
                     saved.get("layout"), run.resume.load_s)
        ckpt.prepare()   # the host buffers now: the first save blocks no longer than later ones
        schedule = build_schedule(cfg.model, cfg.parallel, stages, self.micro_batches, device, groups.pipeline,
                                  run.timer)
        text_stage = stages.get(1)
        per_replica = self.micro_batches * cfg.parallel.micro_batch_size
        first = layout.data_parallel_rank * per_replica
        stop = False
        try:
            for step in range(start, cfg.max_steps):
                with run.timer.data():
                    refs = plan.next_global_batch(step, cfg.parallel.global_batch_size)[first:first + per_replica]
                    lr = lr_at(cfg.optim, step, cfg.max_steps)
                    batch = self._read(reader, refs, device, misalign=step + 1 == self.knobs.misalign_at_step)
                    if self.knobs.data_delay_s and step >= self.knobs.data_delay_from_step:
                        time.sleep(self.knobs.data_delay_s)
                t_pipe, cpu_pipe = time.monotonic(), time.thread_time()
                loss = self._forward_backward(schedule, text_stage, batch)   # the stages' chunks: compute
                pipeline = (time.monotonic() - t_pipe, time.thread_time() - cpu_pipe)
                average_gradients(params, groups.data_parallel, layout.data_parallel_size)
                grad_norm = clip_global_norm(params, groups.pipeline, cfg.optim.grad_clip)
                with run.timer.compute():
                    for optimizer in optimizers.values():
                        for group in optimizer.param_groups:
                            group["lr"] = lr
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                if loss is not None and layout.data_parallel_size > 1:
                    dist.all_reduce(loss, group=groups.data_parallel)
                    loss.div_(layout.data_parallel_size)
                global_step = step + 1
                run.step_done(global_step, log_metrics=False, samples=len(refs),
                              **({"loss": float(loss.item())} if loss is not None else {}))
                run.trace(global_step, batch.ids.tolist())
                stop = run.should_stop()
                last = global_step == cfg.max_steps
                kind = "files" if last else run.checkpoint_due(global_step, cfg.checkpoint.every_steps)
                if stop or kind:
                    run.save(global_step, sync=stop or last, files=kind != "memory")
                ckpt.poll()
                if global_step % cfg.log_every == 0 or last or stop:
                    self._log(global_step, loss, lr, grad_norm, pipeline, len(refs))
                if stop:
                    break
        finally:
            reader.close()
        dist.barrier(group=groups.world)   # leave together: no rank tears down a group a peer still uses
        # saved, closed and out of the process group: leave without the interpreter's teardown
        run.exit(elastic.EXIT_CHECKPOINTED if stop else elastic.EXIT_DONE, fast=True)

    def _read(self, reader: ShardReader, refs: list[SampleRef], device: torch.device, *,
              misalign: bool = False) -> Batch:
        """What this rank's stages read of its replica's samples."""
        if misalign and self.layout.stages == (1,):
            log.warning("runtime: drill: text stage reads its samples shifted by one at this step")
            refs = refs[1:] + refs[:1]
        ids = reader.sample_ids(refs)
        images = reader.images(refs).to(device) if 0 in self.layout.stages else None
        tokens, has_image = reader.tokens(refs) if 1 in self.layout.stages else (None, None)
        return Batch(ids, images, tokens, has_image)

    def _forward_backward(self, schedule: _PipelineSchedule, text_stage: torch.nn.Module | None,
                          batch: Batch) -> torch.Tensor | None:
        """One pass of the replica's micro-batches through the schedule; the text stage's mean loss."""
        device = batch.ids.device if batch.images is None else batch.images.device
        args = (batch.images, batch.ids.to(device)) if batch.images is not None else ()
        if text_stage is None or batch.tokens is None or batch.has_image is None:
            schedule.step(*args)
            return None
        if not isinstance(text_stage, TextStage):
            raise TypeError(f"stage 1 runs a TextStage, not {type(text_stage).__name__}")
        device = next(text_stage.parameters()).device
        b = self.cfg.parallel.micro_batch_size
        for m in range(self.micro_batches):
            sl = slice(m * b, (m + 1) * b)
            text_stage.feed.append(TextMicroBatch(batch.ids[sl].to(device), batch.tokens[sl].to(device),
                                                  batch.has_image[sl].to(device)))
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=next_token_labels(batch.tokens).to(device), losses=losses)
        if text_stage.feed:
            left = len(text_stage.feed)
            text_stage.feed.clear()
            raise SampleMisalignedError(f"text stage: couldn't pair micro-batches: {left} text "
                                        "micro-batches left unconsumed after the step")
        return torch.stack([x.detach().float() for x in losses]).mean().reshape(1)

    def _log(self, global_step: int, loss: torch.Tensor | None, lr: float, grad_norm: float,
             pipeline: tuple[float, float], samples: int) -> None:
        m = self.cfg.model
        tokens_per_sample = m.num_patches if self.layout.stages == (0,) else m.num_patches + m.seq_len
        step_s = max(self.run.last_step_time_s or 0.0, 1e-9)
        self.run.log_metrics(
            global_step, loss=float(loss.item()) if loss is not None else None, lr=lr, grad_norm=grad_norm,
            pipeline_seconds=pipeline[0], pipeline_cpu_seconds=pipeline[1], samples_per_second=samples / step_s,
            tokens_per_second=samples * tokens_per_sample / step_s,
            global_samples_per_second=self.cfg.parallel.global_batch_size / step_s,
            micro_batches=self.micro_batches)
