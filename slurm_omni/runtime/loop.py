"""The training loop of one rank: resume, step, checkpoint, stop on a signal, report.

Every rank derives the global batch of each step from the data plan, takes its replica's run of
micro-batches and reads only what its stage needs (images on the vision stage, text on the text
stage). Gradient accumulation is done by running more micro-batches through the pipeline, so the
global batch and the loss normalisation are the same for every replica count.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _PipelineSchedule

from slurm_omni.config.training import TrainingConfig
from slurm_omni.elastic.run import init_process_groups
from slurm_omni.elastic.timing import cpu_wait_s
from slurm_omni.errors import OmniError, RuntimeLayoutError
from slurm_omni.runtime import exitcodes
from slurm_omni.runtime.checkpointing import StageCheckpointer, public_layout
from slurm_omni.runtime.data import DataPlan, SampleRef, ShardReader, open_sources
from slurm_omni.runtime.heartbeat import Heartbeat
from slurm_omni.runtime.layout import Layout
from slurm_omni.runtime.metrics import MetricsWriter
from slurm_omni.runtime.model import (
    MODULES_BY_STAGE,
    SampleMisalignedError,
    TextMicroBatch,
    TextStage,
    build_stage,
    next_token_labels,
)
from slurm_omni.runtime.pipeline import (
    StageClock,
    any_rank,
    average_gradients,
    backend_for,
    build_schedule,
    clip_global_norm,
    device_for,
    lr_at,
    min_over_ranks,
)
from slurm_omni.runtime.signals import StopRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Batch:
    """One replica's samples of a step, as this rank's stages need them."""

    ids: torch.Tensor
    images: torch.Tensor | None        # vision stage
    tokens: torch.Tensor | None        # text stage
    has_image: torch.Tensor | None     # text stage


def _env_time(name: str) -> float | None:
    """A Unix time the launcher put in the environment (the standby client's start), None if absent."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


class Trainer:
    def __init__(self, cfg: TrainingConfig, layout: Layout, stop: StopRequest | None = None) -> None:
        self.cfg = cfg
        self.layout = layout
        self.stop = stop or StopRequest()
        self.heartbeat = Heartbeat(layout)
        self.metrics = MetricsWriter(layout)
        mb = cfg.parallel.micro_batches_for(layout.data_parallel_size)
        if layout.micro_batches and layout.micro_batches != mb:
            raise RuntimeLayoutError(f"runtime: couldn't use OMNI_MICRO_BATCHES={layout.micro_batches}: global batch "
                            f"{cfg.parallel.global_batch_size} over {layout.data_parallel_size} replicas "
                            f"of {cfg.parallel.micro_batch_size} needs {mb}")
        self.micro_batches = mb
        self._startup: dict[str, float | None] = {}
        """The life's startup times, written once into its first metrics line."""

    def run(self) -> int:
        """Train to ``max_steps``; returns an exit code from :mod:`exitcodes`."""
        self.stop.install()
        self.heartbeat.start()
        try:
            code = self._run()
        except BaseException as e:
            self.heartbeat.stop("failed")
            self.metrics.close()
            # torch.distributed.pipelining wraps a stage's exception in RuntimeError; surface ours so
            # that the exit code says what happened.
            cause: BaseException | None = e
            while cause is not None and not isinstance(cause, OmniError):
                cause = cause.__cause__
            if cause is not None and cause is not e:
                raise cause from e
            raise
        self.heartbeat.stop("done" if code == exitcodes.EXIT_DONE else "stopping")
        self.metrics.close()
        return code

    def _run(self) -> int:
        cfg, layout = self.cfg, self.layout
        device = device_for(layout)
        if device.type == "cuda":
            torch.set_float32_matmul_precision(cfg.matmul_precision)
        groups = init_process_groups(public_layout(layout), backend_for(cfg.parallel, device), device)
        groups_ready_at = time.time()
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
        ckpt = StageCheckpointer(cfg, layout, parts, optimizers, plan)
        # every rank resumes from the same step: the newest one all ranks' shards verify
        restored = ckpt.restore_latest(lambda step: min_over_ranks(step, device))
        start = restored.global_step if restored else 0
        self._startup = {"task_started_at": _env_time("OMNI_TASK_STARTED_AT"), "groups_ready_at": groups_ready_at,
                         "restored_at": time.time()}
        if restored:
            log.info("runtime: rank %d resumed at step %d (saved with %s) in %.2fs", layout.rank, start,
                     restored.state.get("layout"), restored.load_s)
        ckpt.prepare(self.micro_batches)
        self.heartbeat.update(step=start, phase="training", last_checkpoint_step=ckpt.last_persisted_step)
        clock = StageClock()   # the stages' own chunk time: compute without waits for peers
        schedule = build_schedule(cfg.model, cfg.parallel, stages, self.micro_batches, device, groups.pipeline,
                                  clock)
        text_stage = stages.get(1)
        per_replica = self.micro_batches * cfg.parallel.micro_batch_size
        first = layout.data_parallel_rank * per_replica
        code = exitcodes.EXIT_DONE
        try:
            for step in range(start, cfg.max_steps):
                t0, w0 = time.monotonic(), cpu_wait_s()
                refs = plan.next_global_batch(step, cfg.parallel.global_batch_size)[first:first + per_replica]
                lr = lr_at(cfg.optim, step, cfg.max_steps)
                batch = self._read(reader, refs, device, misalign=step + 1 == layout.fault_misalign_at_step)
                if layout.data_delay_s and step >= layout.data_delay_from_step:
                    time.sleep(layout.data_delay_s)
                data_s = time.monotonic() - t0
                data_wait_s = cpu_wait_s() - w0
                clock.busy_s = clock.cpu_wait_s = 0.0
                t_pipe, cpu_pipe = time.monotonic(), time.thread_time()
                loss = self._forward_backward(schedule, text_stage, batch)
                pipeline_s, pipeline_cpu_s = time.monotonic() - t_pipe, time.thread_time() - cpu_pipe
                average_gradients(params, groups.data_parallel, layout.data_parallel_size)
                grad_norm = clip_global_norm(params, groups.pipeline, cfg.optim.grad_clip)
                t_opt, w_opt = time.monotonic(), cpu_wait_s()
                for optimizer in optimizers.values():
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                compute_s = clock.busy_s + time.monotonic() - t_opt
                # of compute_s + data_s: waiting for a CPU another process held (shared cores)
                wait_s = data_wait_s + clock.cpu_wait_s + cpu_wait_s() - w_opt
                if loss is not None and layout.data_parallel_size > 1:
                    dist.all_reduce(loss, group=groups.data_parallel)
                    loss.div_(layout.data_parallel_size)
                global_step = step + 1
                step_s = time.monotonic() - t0
                self.heartbeat.update(step=global_step, step_time_s=step_s, compute_s=compute_s, data_s=data_s,
                                      cpu_wait_s=max(0.0, wait_s), metrics={"samples": len(refs), **({"loss": float(loss.item())}
                                                                        if loss is not None else {})})
                self.metrics.trace(global_step, batch.ids.tolist())
                if layout.step_delay_s:
                    time.sleep(layout.step_delay_s)
                stop = any_rank(self.stop.requested, device)
                last = global_step == cfg.max_steps
                every = cfg.checkpoint.every_steps
                if stop or last or (every and global_step % every == 0):
                    self.heartbeat.update(phase="checkpointing")
                    ckpt.save(global_step, sync=stop or last)
                    self.heartbeat.update(phase="training")
                ckpt.poll()
                self.heartbeat.update(last_checkpoint_step=ckpt.last_persisted_step)
                if global_step % cfg.log_every == 0 or last or stop:
                    self._log(global_step, loss, lr, grad_norm, step_s, (pipeline_s, pipeline_cpu_s), len(refs), ckpt)
                if stop:
                    code = exitcodes.EXIT_CHECKPOINTED
                    break
        finally:
            ckpt.close()
            reader.close()
        dist.barrier()
        dist.destroy_process_group()
        return code

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

    def _log(self, global_step: int, loss: torch.Tensor | None, lr: float, grad_norm: float, step_s: float,
             pipeline: tuple[float, float], samples: int, ckpt: StageCheckpointer) -> None:
        m = self.cfg.model
        tokens_per_sample = m.num_patches if self.layout.stages == (0,) else m.num_patches + m.seq_len
        self.metrics.log_step({
            "step": global_step, "loss": float(loss.item()) if loss is not None else None, "lr": lr,
            "grad_norm": grad_norm, "step_time_seconds": step_s, "pipeline_seconds": pipeline[0],
            "pipeline_cpu_seconds": pipeline[1], "samples_per_second": samples / step_s,
            "tokens_per_second": samples * tokens_per_sample / step_s,
            "global_samples_per_second": self.cfg.parallel.global_batch_size / step_s,
            "ckpt_blocking_seconds": ckpt.last_blocking_s, "ckpt_persist_seconds": ckpt.last_persist_s,
            "data_parallel_size": self.layout.data_parallel_size, "micro_batches": self.micro_batches,
        }, line_only=self._startup)
        self._startup = {}
