"""A character-level GPT (decoder only, one pipeline stage that the job file names ``gpt``) trained
on randomly sampled windows of a small text corpus: the source of a few modules of Python's own
standard library, so it needs no download.

Every step draws its global batch afresh: window offsets from a seeded ``torch.Generator`` (with
replacement, like most LLM pre-training loops). Every replica draws the same offsets and takes its
share, so the sampler's whole state is the generator's, the same for any replica count; it is drawn
inside the step, after ``run.restore()``, so the state a checkpoint saves is the one the next step
starts from. The lines marked ``# slurm-omni`` are all it takes to survive failures (README.md).

    torchrun --nproc-per-node 2 train.py --steps 40        # on a laptop
    omni submit job.toml                                   # on Slurm: stage gpt, 2 replicas
"""

from __future__ import annotations

import argparse
import inspect
import math
import shlex
import string
import textwrap

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slurm_omni import elastic  # slurm-omni

CONTEXT, WIDTH, LAYERS, HEADS = 32, 64, 2, 4


def corpus() -> tuple[torch.Tensor, int]:
    """The training text as character ids, and the vocabulary size."""
    text = "".join(inspect.getsource(m) for m in (textwrap, string, shlex))
    vocab = sorted(set(text))
    return torch.tensor([vocab.index(c) for c in text], dtype=torch.long), len(vocab)


class RandomWindows:
    """Each call draws one global batch of window offsets at random, with replacement."""

    def __init__(self, tokens: int, global_batch: int, seed: int) -> None:
        self.high, self.global_batch = tokens - CONTEXT - 1, global_batch
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self) -> torch.Tensor:
        return torch.randint(0, self.high, (self.global_batch,), generator=self.generator)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


class GPT(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, WIDTH)
        self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.pos
        mask = nn.Transformer.generate_square_subsequent_mask(CONTEXT)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60, help="the job file's max_steps wins under slurm-omni")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    data, vocab = corpus()
    with elastic.init(stages=("gpt",), max_steps=args.steps) as run:                 # slurm-omni
        steps, dp = run.max_steps or args.steps, run.groups.data_parallel          # slurm-omni
        accum = run.layout.accumulation(args.global_batch, args.micro_batch)       # slurm-omni
        torch.manual_seed(0)
        model = GPT(vocab)
        run.timer.watch(model)                                                     # slurm-omni
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, s / steps))))
        sampler = RandomWindows(len(data), args.global_batch, seed=1234)
        run.checkpointer(modules={"gpt": model}, optimizers={"adamw": opt},       # slurm-omni
                         state={"sched": sched, "sampler": sampler}, data=("sampler",))  # slurm-omni
        start = run.restore()                                                      # slurm-omni
        replica, replicas = dist.get_rank(dp), dist.get_world_size(dp)
        share = args.global_batch // replicas
        for step in range(start, steps):
            with run.timer.data():                                                 # slurm-omni
                offsets = sampler.draw()[replica * share:(replica + 1) * share]   # this replica's share
            total = torch.zeros(())
            for m in range(accum):
                starts = offsets[m * args.micro_batch:(m + 1) * args.micro_batch]
                x = torch.stack([data[i:i + CONTEXT] for i in starts])
                y = torch.stack([data[i + 1:i + 1 + CONTEXT] for i in starts])
                loss = model(x, y)
                (loss / accum).backward()
                total += loss.detach() / accum
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp)
                p.grad.div_(replicas)
            with run.timer.compute():                                              # slurm-omni
                opt.step()
            opt.zero_grad(set_to_none=False)
            sched.step()
            dist.all_reduce(total, group=dp)
            run.trace(step + 1, offsets.tolist())                                  # slurm-omni
            run.end_step(step + 1, checkpoint_every=10, loss=total.item() / replicas,  # slurm-omni
                         lr=sched.get_last_lr()[0], samples=args.global_batch)     # slurm-omni


if __name__ == "__main__":
    main()
