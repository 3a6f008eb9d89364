"""The multimodal model, cut into its two pipeline stages.

Stage 0 (component 0's ranks): the vision encoder (patch embedding, transformer blocks) and the
projector into the text width. Stage 1 (component 1's ranks): a causal text decoder whose sequence is
the image tokens followed by the text tokens.

The sample ids travel with the image tokens from stage 0 to stage 1. Stage 1 reads its own text for
the same micro-batch from a feed (its own data reader) and refuses to go on when the ids differ: an
image paired with another sample's text trains silently wrong, so it is a hard error.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slurm_omni.config.training import BUILTIN_STAGES, ModelConfig
from slurm_omni.errors import OmniError

IGNORE_INDEX = -100
STAGE_NAMES = BUILTIN_STAGES
"""The pipeline's stages in order (the job file's ``[[stages]]`` names for the built-in trainer)."""
MODULES_BY_STAGE: dict[int, tuple[str, ...]] = {0: ("vision_encoder", "projector"), 1: ("text_decoder",)}
"""Checkpoint module names each stage owns (the vision tower is the critical module on restore)."""


class SampleMisalignedError(OmniError):
    """The text stage received image tokens of another sample than its text."""

    exit_code = 3


class Block(nn.Module):
    """Pre-norm transformer block (attention + MLP)."""

    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(),
                                 nn.Linear(mlp_ratio * width, width))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.ln2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.patch = cfg.patch_size
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch_size ** 2, cfg.vision_width)
        self.pos = nn.Parameter(torch.randn(cfg.num_patches, cfg.vision_width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.vision_width, cfg.vision_heads, cfg.mlp_ratio)
                                    for _ in range(cfg.vision_depth))
        self.ln = nn.LayerNorm(cfg.vision_width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: (B, H, W, C) floats in [0, 1] -> (B, patches, vision_width)."""
        b, h, w, c = images.shape
        p = self.patch
        patches = images.view(b, h // p, p, w // p, p, c).permute(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = self.patch_embed(patches) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


class VisionStage(nn.Module):
    """Pipeline stage 0: images and sample ids in, image tokens (text width) and sample ids out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.vision_encoder = VisionEncoder(cfg)
        self.projector = nn.Sequential(nn.Linear(cfg.vision_width, cfg.text_width), nn.GELU(),
                                       nn.Linear(cfg.text_width, cfg.text_width))

    def forward(self, images: torch.Tensor, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        image_tokens = self.projector(self.vision_encoder(images))
        return image_tokens, ids_as_activation(sample_ids, image_tokens)


def ids_as_activation(sample_ids: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Sample ids as a float64 activation tied to the graph with weight zero.

    torch.distributed.pipelining before 2.13 makes every received buffer require grad, which an
    integer tensor cannot; and a float input that gets no gradient breaks its backward sends. So the
    ids travel as float64 (exact below 2**53) and get an all-zero gradient: adding exact zeros
    changes no value and no parameter's gradient.
    """
    return sample_ids.to(torch.float64) + anchor.sum().to(torch.float64) * 0.0


def ids_from_activation(ids: torch.Tensor) -> torch.Tensor:
    return ids.detach().to(torch.int64)


@dataclass(frozen=True, slots=True)
class TextMicroBatch:
    """What the text stage reads itself for one micro-batch."""

    sample_ids: torch.Tensor   # (B,) int64
    tokens: torch.Tensor       # (B, L) int64, 0 = padding
    has_image: torch.Tensor    # (B,) bool; text-only samples get a blank image whose tokens are masked


class TextDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_image_tokens = cfg.num_patches
        self.tok = nn.Embedding(cfg.vocab_size, cfg.text_width)
        self.pos = nn.Parameter(torch.randn(cfg.num_patches + cfg.seq_len, cfg.text_width) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.text_width, cfg.text_heads, cfg.mlp_ratio)
                                    for _ in range(cfg.text_depth))
        self.ln = nn.LayerNorm(cfg.text_width)
        self.head = nn.Linear(cfg.text_width, cfg.vocab_size, bias=False)

    def forward(self, image_tokens: torch.Tensor, tokens: torch.Tensor, has_image: torch.Tensor) -> torch.Tensor:
        n_img = image_tokens.shape[1]
        x = torch.cat([image_tokens, self.tok(tokens)], dim=1) + self.pos
        s = x.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        # A text-only sample must not attend to the blank image's tokens (except each to itself,
        # so that no row of the mask is empty).
        key_ok = torch.ones(x.shape[0], s, dtype=torch.bool, device=x.device)
        key_ok[:, :n_img] = has_image[:, None]
        mask = (causal[None] & key_ok[:, None, :]) | torch.eye(s, dtype=torch.bool, device=x.device)[None]
        mask = mask[:, None]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x[:, n_img:]))


class TextStage(nn.Module):
    """Pipeline stage 1: image tokens and their sample ids in, logits over the text positions out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.text_decoder = TextDecoder(cfg)
        self.feed: collections.deque[TextMicroBatch] = collections.deque()

    def forward(self, image_tokens: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
        if not self.feed:
            raise SampleMisalignedError("text stage: couldn't pair image tokens: no text micro-batch queued")
        mb = self.feed.popleft()
        got = ids_from_activation(sample_ids)
        if not torch.equal(mb.sample_ids.to(got.device), got):
            raise SampleMisalignedError(
                f"text stage: couldn't pair image tokens with text: got sample ids "
                f"{got.tolist()}, text is for {mb.sample_ids.tolist()} (data positions out of step)")
        # The ids' zero-weight tie into the loss, so that they receive their (zero) gradient.
        image_tokens = image_tokens + (sample_ids.sum() * 0.0).to(image_tokens.dtype)
        return self.text_decoder(image_tokens, mb.tokens.to(image_tokens.device),
                                 mb.has_image.to(image_tokens.device))


def next_token_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Labels for the text positions: token t predicts token t+1; padding and the last slot are ignored."""
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    labels[labels == 0] = IGNORE_INDEX
    return labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the micro-batch's real tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def build_stage(cfg: ModelConfig, stage: int, *, seed: int) -> nn.Module:
    """Build one stage with its own seeded initialisation, so that every replica (and every layout)
    starts from the same parameters without building the other stage."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 2 + stage)
        module: nn.Module = VisionStage(cfg) if stage == 0 else TextStage(cfg)
    return module


def parameter_count(cfg: ModelConfig) -> int:
    return sum(p.numel() for s in (0, 1) for p in build_stage(cfg, s, seed=0).parameters())
