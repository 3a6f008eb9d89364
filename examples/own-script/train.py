"""A small vision-language model trained on scikit-learn's handwritten digits, captioned from their
labels ("a handwritten seven"): a vision stage (patch encoder + projector) and a text stage (a causal
decoder over the image tokens and the caption), one pipeline stage per heterogeneous component.

Its own model, data pipeline (a torchdata StatefulDataLoader with worker processes), optimizer and LR
schedule. The lines marked ``# slurm-omni`` are all it takes to survive failures (README.md).

    torchrun --nproc-per-node 2 train.py --steps 40        # on a laptop: every rank runs both stages
    omni submit job.toml                                   # on Slurm: vision | text, 2 replicas each
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from slurm_omni import elastic  # slurm-omni

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a handwritten {}", "the digit {}", "this is a {}", "someone wrote {}"]
PAD, BOS, EOS = 0, 1, 2
VOCAB = ["<pad>", "<bos>", "<eos>"] + sorted({w for t in TEMPLATES for w in t.split() if w != "{}"} | set(WORDS))
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")   # torchdata 0.11 on torch 2.13
SEQ = 7        # <bos> + at most four words + <eos>, padded
WIDTH, PATCH = 48, 2


# -- data -------------------------------------------------------------------------------------------

class CaptionedDigits(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """8x8 digit images with a caption made from the label; the index is the sample id."""

    def __init__(self) -> None:
        digits = load_digits()
        self.images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)
        self.labels = digits.target.tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        words = TEMPLATES[i % len(TEMPLATES)].format(WORDS[self.labels[i]]).split()
        ids = [BOS, *(VOCAB.index(w) for w in words), EOS]
        tokens = torch.full((SEQ,), PAD, dtype=torch.long)
        tokens[:len(ids)] = torch.tensor(ids)
        return {"image": self.images[i][None], "tokens": tokens, "id": torch.tensor(i)}


class GlobalBatches:
    """Micro-batches of indices: every epoch a seeded permutation, cut into global batches, of which
    this replica takes its share in ``accum`` micro-batches. Its state (epoch, step, micro-batch) does
    not depend on the replica count, so a resized run goes on with the very next global batch."""

    def __init__(self, size: int, global_batch: int, micro: int, replica: int, replicas: int, seed: int) -> None:
        self.size, self.global_batch, self.micro, self.seed = size, global_batch, micro, seed
        self.share = global_batch // replicas
        self.first = replica * self.share
        self.epoch = self.step = self.done = 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            while (self.step + 1) * self.global_batch <= self.size:
                start = self.step * self.global_batch + self.first + self.done
                batch = order[start:start + self.micro].tolist()
                self.done += self.micro                  # advanced before the yield: the loader's
                if self.done == self.share:              # snapshot of this batch is "after it"
                    self.step, self.done = self.step + 1, 0
                yield batch
            self.epoch, self.step = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step, self.done = state["epoch"], state["step"], state["done"]


# -- model ------------------------------------------------------------------------------------------

class Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(PATCH * PATCH, WIDTH)
        self.pos = nn.Parameter(torch.randn((8 // PATCH) ** 2, WIDTH) * 0.02)
        self.block = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.project = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(image, PATCH, stride=PATCH).transpose(1, 2)      # (B, 16, 4)
        return self.project(self.block(self.embed(patches) + self.pos))


class Text(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), WIDTH)
        self.pos = nn.Parameter(torch.randn(16 + SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(WIDTH, len(VOCAB))

    def forward(self, image_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([image_tokens, self.embed(tokens)], dim=1) + self.pos
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(x[:, image_tokens.shape[1]:-1])                 # position t predicts token t+1
        target = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD, -100)
        return F.cross_entropy(logits.reshape(-1, len(VOCAB)), target.reshape(-1), ignore_index=-100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80, help="the job file's max_steps wins under slurm-omni")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    with elastic.init(stages=("vision", "text"), max_steps=args.steps) as run:    # slurm-omni
        layout, steps = run.layout, run.max_steps or args.steps                     # slurm-omni
        pipe, dp = run.groups.pipeline, run.groups.data_parallel                    # slurm-omni
        accum = layout.accumulation(args.global_batch, args.micro_batch)            # slurm-omni
        stages: dict[str, nn.Module] = {}
        for seed, (name, build) in enumerate((("vision", Vision), ("text", Text))):
            if layout.runs(name):                                                   # slurm-omni
                torch.manual_seed(seed)                 # the same initial weights in every layout
                stages[name] = build()
                run.timer.watch(stages[name])           # compute_s: forward and backward  # slurm-omni
        # the rank of the other stage of this replica (none when this rank runs both)
        peer = layout.peer("text" if "vision" in stages else "vision") if len(stages) == 1 else -1  # slurm-omni
        params = [p for m in stages.values() for p in m.parameters()]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, s / steps))))
        data = CaptionedDigits()
        sampler = GlobalBatches(len(data), args.global_batch, args.micro_batch, dist.get_rank(dp),
                                dist.get_world_size(dp), seed=1234)
        loader = StatefulDataLoader(data, batch_sampler=sampler, num_workers=args.workers)
        run.checkpointer(modules=stages, critical=[n for n in ("vision",) if n in stages],  # slurm-omni
                         optimizers={"adamw": opt}, state={"sched": sched, "loader": loader})
        start = run.restore()                                                       # slurm-omni
        batches = iter(loader)
        for step in range(start, steps):
            total, ids = torch.zeros(()), []
            for _ in range(accum):
                with run.timer.data():                                              # slurm-omni
                    batch = next(batches)
                ids += batch["id"].tolist()
                total += micro_step(stages, batch, accum, peer, pipe) / accum
            for p in params:
                dist.all_reduce(p.grad, group=dp)
                p.grad.div_(dist.get_world_size(dp))
            with run.timer.compute():                                               # slurm-omni
                opt.step()
            opt.zero_grad(set_to_none=False)
            sched.step()
            dist.all_reduce(total, group=dp)
            loss = total.item() / dist.get_world_size(dp) if "text" in stages else None
            run.trace(step + 1, ids)                                                # slurm-omni
            run.end_step(step + 1, checkpoint_every=10, loss=loss, lr=sched.get_last_lr()[0],  # slurm-omni
                         samples=args.global_batch)                                 # slurm-omni


def micro_step(stages: dict[str, nn.Module], batch: dict[str, torch.Tensor], accum: int, peer: int,
               pipe: dist.ProcessGroup) -> torch.Tensor:
    """Forward and backward of one micro-batch through this rank's stages (the backward of the mean
    over the step's micro-batches); its loss on the text stage, 0 on the vision stage. ``peer``: the
    rank running this replica's other stage."""
    if len(stages) == 2:                      # both stages on this rank (torchrun on a laptop)
        loss = stages["text"](stages["vision"](batch["image"]), batch["tokens"])
        (loss / accum).backward()
        return loss.detach()
    shape = (batch["id"].shape[0], 16, WIDTH)
    if "vision" in stages:
        out = stages["vision"](batch["image"])
        dist.send(batch["id"], peer, group=pipe)
        dist.send(out.detach(), peer, group=pipe)
        grad = torch.empty(shape)
        dist.recv(grad, peer, group=pipe)
        out.backward(grad)
        return torch.zeros(())
    sent_ids, image_tokens = torch.empty_like(batch["id"]), torch.empty(shape)
    dist.recv(sent_ids, peer, group=pipe)
    dist.recv(image_tokens, peer, group=pipe)
    if not torch.equal(sent_ids, batch["id"]):
        raise RuntimeError(f"text stage got images {sent_ids.tolist()} for captions {batch['id'].tolist()}")
    image_tokens.requires_grad_(True)
    loss = stages["text"](image_tokens, batch["tokens"])
    (loss / accum).backward()
    dist.send(image_tokens.grad, peer, group=pipe)
    return loss.detach()


if __name__ == "__main__":
    main()
