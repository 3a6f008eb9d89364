"""Three pipeline stages with names of our own: ``speech`` (a spoken digit, here a synthetic tone
whose pitch is the digit, encoded into 8 tokens), ``image`` (scikit-learn's 8x8 handwritten digit,
encoded into 16 tokens and put after the speech tokens) and ``lm`` (a causal decoder that writes the
caption, "a handwritten seven", after those 24 tokens). Activations go forward and gradients back
between neighbouring stages with torch.distributed send/recv; each stage reads only its part of a
sample, and the sample ids travel along so that a misaligned pipeline stops at once.

The data order is a seeded permutation per epoch cut into global batches; the sampler's state is
(epoch, step), the same on every stage and for any replica count. The lines marked ``# slurm-omni``
are all it takes to survive failures (README.md).

    torchrun --nproc-per-node 2 train.py --steps 40        # on a laptop: every rank runs all three stages
    omni submit job.toml                                   # on Slurm: speech | image | lm, 2 replicas each
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from slurm_omni import elastic  # slurm-omni

STAGES = ("speech", "image", "lm")
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PAD, BOS, EOS = 0, 1, 2
VOCAB = ["<pad>", "<bos>", "<eos>", "a", "handwritten", *WORDS]
SEQ, WIDTH = 5, 32                           # <bos> a handwritten <digit> <eos>
SPEECH_TOKENS, IMAGE_TOKENS, SAMPLES = 8, 16, 64


class SpokenDigits:
    """Sample i: a tone (64 samples, pitch from the label, phase from i), the digit's image, its caption."""

    def __init__(self) -> None:
        digits = load_digits()
        self.images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)
        self.labels = torch.from_numpy(digits.target.astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def audio(self, ids: torch.Tensor) -> torch.Tensor:
        t = torch.arange(SAMPLES) / SAMPLES
        pitch = (2.0 + self.labels[ids].float())[:, None]
        return torch.sin(2 * math.pi * pitch * t + ids[:, None].float() * 0.1)

    def image(self, ids: torch.Tensor) -> torch.Tensor:
        return self.images[ids][:, None]

    def caption(self, ids: torch.Tensor) -> torch.Tensor:
        words = torch.tensor([VOCAB.index(w) for w in WORDS])[self.labels[ids]]
        n = len(ids)
        fixed = [torch.full((n,), BOS), torch.full((n,), VOCAB.index("a")), torch.full((n,), VOCAB.index("handwritten"))]
        return torch.stack([*fixed, words, torch.full((n,), EOS)], dim=1)


class EpochBatches:
    """Global batches of a seeded permutation per epoch; ``batch(step)`` is pure, the state is (epoch, step)."""

    def __init__(self, size: int, global_batch: int, seed: int) -> None:
        self.size, self.global_batch, self.seed = size, global_batch, seed
        self.epoch = self.step = 0

    def next(self) -> torch.Tensor:
        if (self.step + 1) * self.global_batch > self.size:
            self.epoch, self.step = self.epoch + 1, 0
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.step += 1
        return order[(self.step - 1) * self.global_batch:self.step * self.global_batch]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def block() -> nn.Module:
    return nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)


class Speech(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frames = nn.Linear(SAMPLES // SPEECH_TOKENS, WIDTH)
        self.block = block()

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.block(self.frames(audio.reshape(audio.shape[0], SPEECH_TOKENS, -1)))


class Image(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Linear(4, WIDTH)
        self.pos = nn.Parameter(torch.randn(IMAGE_TOKENS, WIDTH) * 0.02)
        self.block = block()

    def forward(self, speech: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(image, 2, stride=2).transpose(1, 2)              # (B, 16, 4)
        return torch.cat([speech, self.block(self.patches(patches) + self.pos)], dim=1)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), WIDTH)
        self.pos = nn.Parameter(torch.randn(SPEECH_TOKENS + IMAGE_TOKENS + SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(WIDTH, len(VOCAB))

    def forward(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([context, self.embed(tokens)], dim=1) + self.pos
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        logits = self.head(x[:, context.shape[1]:-1])                      # position t predicts token t+1
        return F.cross_entropy(logits.reshape(-1, len(VOCAB)), tokens[:, 1:].reshape(-1))


BUILD: dict[str, Callable[[], nn.Module]] = {"speech": Speech, "image": Image, "lm": LM}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60, help="the job file's max_steps wins under slurm-omni")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    with elastic.init(stages=STAGES, max_steps=args.steps) as run:                  # slurm-omni
        layout, steps = run.layout, run.max_steps or args.steps                     # slurm-omni
        pipe, dp = run.groups.pipeline, run.groups.data_parallel                    # slurm-omni
        accum = layout.accumulation(args.global_batch, args.micro_batch)            # slurm-omni
        mine = [name for name in STAGES if layout.runs(name)]                       # slurm-omni
        stages: dict[str, nn.Module] = {}
        for name in mine:
            torch.manual_seed(STAGES.index(name))     # the same initial weights in every layout
            stages[name] = BUILD[name]()
            run.timer.watch(stages[name])                                           # slurm-omni
        params = [p for m in stages.values() for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, s / steps))))
        data = SpokenDigits()
        sampler = EpochBatches(len(data), args.global_batch, seed=1234)
        run.checkpointer(modules=stages, optimizers={"adamw": opt},                 # slurm-omni
                         state={"sched": sched, "sampler": sampler}, data=("sampler",))  # slurm-omni
        start = run.restore()                                                       # slurm-omni
        replica, replicas = dist.get_rank(dp), dist.get_world_size(dp)
        share = args.global_batch // replicas
        # this replica's neighbours in the pipeline (-1: none, or this rank runs them too)
        before = layout.peer(STAGES[STAGES.index(mine[0]) - 1]) if len(mine) == 1 and mine[0] != "speech" else -1
        after = layout.peer(STAGES[STAGES.index(mine[0]) + 1]) if len(mine) == 1 and mine[0] != "lm" else -1
        for step in range(start, steps):
            with run.timer.data():                                                  # slurm-omni
                ids = sampler.next()[replica * share:(replica + 1) * share]
            total = torch.zeros(())
            for m in range(accum):
                micro = ids[m * args.micro_batch:(m + 1) * args.micro_batch]
                total += micro_step(stages, data, micro, accum, before, after, pipe) / accum
            for p in params:
                dist.all_reduce(p.grad, group=dp)
                p.grad.div_(replicas)
            with run.timer.compute():                                               # slurm-omni
                opt.step()
            opt.zero_grad(set_to_none=False)
            sched.step()
            dist.all_reduce(total, group=dp)
            loss = total.item() / replicas if "lm" in stages else None
            run.trace(step + 1, ids.tolist())                                       # slurm-omni
            run.end_step(step + 1, checkpoint_every=10, loss=loss, lr=sched.get_last_lr()[0],  # slurm-omni
                         samples=args.global_batch)                                 # slurm-omni


def micro_step(stages: dict[str, nn.Module], data: SpokenDigits, ids: torch.Tensor, accum: int, before: int,
               after: int, pipe: dist.ProcessGroup) -> torch.Tensor:
    """Forward and backward of one micro-batch through this rank's stages; the loss on the lm stage,
    0 elsewhere. ``before``/``after``: the ranks of this replica's previous and next stage."""
    if len(stages) == len(STAGES):           # every stage on this rank (torchrun on a laptop)
        context = stages["image"](stages["speech"](data.audio(ids)), data.image(ids))
        loss = stages["lm"](context, data.caption(ids))
        (loss / accum).backward()
        return loss.detach()
    n = len(ids)
    if "speech" in stages:
        out = stages["speech"](data.audio(ids))
        return _send_forward(ids, out, after, pipe)
    got_ids = torch.empty_like(ids)
    dist.recv(got_ids, before, group=pipe)
    if not torch.equal(got_ids, ids):
        raise RuntimeError(f"stage got activations of samples {got_ids.tolist()} for samples {ids.tolist()}")
    if "image" in stages:
        speech = torch.empty(n, SPEECH_TOKENS, WIDTH)
        dist.recv(speech, before, group=pipe)
        speech.requires_grad_(True)
        out = stages["image"](speech, data.image(ids))
        _send_forward(ids, out, after, pipe)
        dist.send(speech.grad, before, group=pipe)
        return torch.zeros(())
    context = torch.empty(n, SPEECH_TOKENS + IMAGE_TOKENS, WIDTH)
    dist.recv(context, before, group=pipe)
    context.requires_grad_(True)
    loss = stages["lm"](context, data.caption(ids))
    (loss / accum).backward()
    dist.send(context.grad, before, group=pipe)
    return loss.detach()


def _send_forward(ids: torch.Tensor, out: torch.Tensor, after: int, pipe: dist.ProcessGroup) -> torch.Tensor:
    """Send the ids and the activations on, take the gradient back, run this stage's backward."""
    dist.send(ids, after, group=pipe)
    dist.send(out.detach(), after, group=pipe)
    grad = torch.empty_like(out)
    dist.recv(grad, after, group=pipe)
    out.backward(grad)
    return torch.zeros(())


if __name__ == "__main__":
    main()
