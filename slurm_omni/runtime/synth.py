"""Synthetic shards for demos, tests and benchmarks (format: docs/data-format.md).

Pairs: an image of one of ``classes`` colour/stripe patterns with noise, and a caption that starts
with the class's token followed by a class-specific token pattern, so that the loss can fall only by
reading the image. Text only: sequences of a noisy counting pattern. Sample ids are unique over all
sources written by one call (pairs first, then text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from slurm_omni.runtime.data import SHARD_FORMAT, SHARD_VERSION


@dataclass(frozen=True, kw_only=True, slots=True)
class SynthSpec:
    out_dir: Path
    pairs: int = 256
    text: int = 128
    shard_size: int = 64
    image_size: int = 16
    channels: int = 3
    seq_len: int = 16
    vocab_size: int = 256
    classes: int = 8
    seed: int = 0
    pairs_source: str = "pairs"
    text_source: str = "text"


def write_shards(spec: SynthSpec) -> list[Path]:
    """Write the shards; returns their paths. Existing files of the same names are replaced."""
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    written: list[Path] = []
    next_id = 0
    for source, kind, count in ((spec.pairs_source, "pairs", spec.pairs), (spec.text_source, "text", spec.text)):
        for first in range(0, count, spec.shard_size):
            n = min(spec.shard_size, count - first)
            ids = np.arange(next_id, next_id + n, dtype=np.int64)
            next_id += n
            tokens, lengths, images = _samples(spec, rng, kind, n)
            path = spec.out_dir / f"{source}-{first // spec.shard_size:05d}.h5"
            tmp = path.with_suffix(".h5.tmp")
            with h5py.File(tmp, "w") as f:
                f.attrs.update(format=SHARD_FORMAT, version=SHARD_VERSION, source=source, kind=kind)
                f.create_dataset("sample_id", data=ids)
                f.create_dataset("tokens", data=tokens)
                f.create_dataset("length", data=lengths)
                if images is not None:
                    f.create_dataset("image", data=images, chunks=(1, *images.shape[1:]))
            tmp.replace(path)
            written.append(path)
    return written


def _samples(spec: SynthSpec, rng: np.random.Generator, kind: str,
             n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    v, L = spec.vocab_size, spec.seq_len
    lengths = rng.integers(L // 2, L + 1, size=n).astype(np.int32)
    tokens = np.zeros((n, L), dtype=np.int32)
    if kind == "text":
        for i in range(n):
            start, stride = rng.integers(1, v), rng.integers(1, 4)
            seq = (start + stride * np.arange(lengths[i])) % (v - 1) + 1
            noise = rng.random(lengths[i]) < 0.1
            seq[noise] = rng.integers(1, v, size=int(noise.sum()))
            tokens[i, :lengths[i]] = seq
        return tokens, lengths, None
    s, c = spec.image_size, spec.channels
    cls = rng.integers(0, spec.classes, size=n)
    yy, xx = np.mgrid[0:s, 0:s]
    images = np.empty((n, s, s, c), dtype=np.uint8)
    for i in range(n):
        k = int(cls[i])
        stripes = ((xx * (k % 4 + 1) + yy * (k // 4 + 1)) % 4 < 2).astype(np.float64)
        colour = np.array([(k * 37) % 256, (k * 91) % 256, (k * 151) % 256][:c] + [128] * max(0, c - 3))
        img = stripes[..., None] * colour[None, None, :] + rng.normal(0, 16, size=(s, s, c))
        images[i] = np.clip(img, 0, 255).astype(np.uint8)
        seq = (1 + k * 17 + (k + 1) * np.arange(lengths[i])) % (v - 1) + 1
        tokens[i, :lengths[i]] = seq
    return tokens, lengths, images
