"""Multimodal data from HDF5 shards: several sources mixed by weight, deterministically.

The sample order is a pure function of the data seed and the global step: the source of every slot of
global step ``s`` is drawn from ``rng(seed, s)``; inside a source, samples follow a per-epoch
permutation and the source's position (epoch, offset) advances. The positions are saved with every
checkpoint (:meth:`DataPlan.state`), so a resumed run, with any number of replicas, continues with the
very next sample. A global batch is cut into micro-batches in one fixed order; replica ``r`` takes the
``r``-th run of them, so changing the replica count changes who reads a sample, never which samples
make up a step. The format of a shard is in docs/data-format.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from slurm_omni.config.training import DataConfig, ModelConfig
from slurm_omni.errors import ConfigError, OmniError

log = logging.getLogger(__name__)

SHARD_FORMAT = "omni-shard"
SHARD_VERSION = 1
KINDS = ("pairs", "text")


class DataError(OmniError):
    """Shards are missing, malformed, or do not match the saved data positions."""


@dataclass(frozen=True, slots=True)
class Shard:
    path: Path
    source: str
    kind: str
    rows: int


@dataclass(frozen=True, slots=True)
class SampleRef:
    """One slot of a global batch: which source and which row of that source."""

    source: int
    row: int


def scan_shards(shard_dir: Path) -> list[Shard]:
    """Read the header of every ``*.h5`` in ``shard_dir`` (sorted by name: the order is part of the data)."""
    paths = sorted(shard_dir.glob("*.h5"))
    if not paths:
        raise DataError(f"data: couldn't find shards: no *.h5 in {shard_dir} (omni data synth writes some)")
    shards = []
    for path in paths:
        try:
            with h5py.File(path, "r") as f:
                if f.attrs.get("format") != SHARD_FORMAT or int(f.attrs.get("version", -1)) != SHARD_VERSION:
                    raise DataError(f"data: couldn't read {path}: not an {SHARD_FORMAT} v{SHARD_VERSION} file")
                kind = str(f.attrs["kind"])
                if kind not in KINDS or ("image" in f) != (kind == "pairs"):
                    raise DataError(f"data: couldn't read {path}: kind {kind!r} and its datasets disagree")
                shards.append(Shard(path, str(f.attrs["source"]), kind, int(f["sample_id"].shape[0])))
        except (OSError, KeyError) as e:
            raise DataError(f"data: couldn't read {path}: {e}") from e
    return shards


class SourceIndex:
    """All rows of one source, over its shards in name order."""

    def __init__(self, name: str, shards: list[Shard]) -> None:
        self.name = name
        self.shards = shards
        self.kind = shards[0].kind
        if any(s.kind != self.kind for s in shards):
            raise DataError(f"data: couldn't index source {name!r}: its shards mix kinds")
        self.starts = np.cumsum([0] + [s.rows for s in shards])
        self.size = int(self.starts[-1])

    def locate(self, row: int) -> tuple[Shard, int]:
        i = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.shards[i], row - int(self.starts[i])


class DataPlan:
    """Which samples make up each global step; the only mutable state is each source's position."""

    def __init__(self, cfg: DataConfig, sources: list[SourceIndex]) -> None:
        self.seed = cfg.seed
        self.sources = sources
        w = np.array([s.weight for s in cfg.sources], dtype=np.float64)
        self.weights = w / w.sum()
        self.positions = [(0, 0) for _ in sources]   # (epoch, offset) per source
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perm_cache:
            rng = np.random.default_rng([self.seed, 7, source, epoch])
            self._perm_cache = {k: v for k, v in self._perm_cache.items() if k[0] != source}
            self._perm_cache[key] = rng.permutation(self.sources[source].size)
        return self._perm_cache[key]

    def next_global_batch(self, global_step: int, size: int) -> list[SampleRef]:
        """The samples of ``global_step`` (advances the positions)."""
        choice = np.random.default_rng([self.seed, 11, global_step]).choice(len(self.sources), size=size,
                                                                              p=self.weights)
        refs = []
        for src in choice.tolist():
            epoch, offset = self.positions[src]
            refs.append(SampleRef(src, int(self._perm(src, epoch)[offset])))
            offset += 1
            if offset == self.sources[src].size:
                epoch, offset = epoch + 1, 0
            self.positions[src] = (epoch, offset)
        return refs

    def state(self) -> dict[str, Any]:
        """JSON-able positions for the checkpoint's meta."""
        return {s.name: {"epoch": e, "offset": o, "size": s.size}
                for s, (e, o) in zip(self.sources, self.positions, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """:meth:`state` under the name a checkpointer's ``state={...}`` objects answer to."""
        return self.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_state(state)

    def load_state(self, state: dict[str, Any]) -> None:
        for i, s in enumerate(self.sources):
            saved = state.get(s.name)
            if saved is None or int(saved["size"]) != s.size:
                raise DataError(f"data: couldn't restore position of source {s.name!r}: checkpoint has "
                                f"{saved!r}, shards hold {s.size} samples (data changed since the checkpoint)")
            self.positions[i] = (int(saved["epoch"]), int(saved["offset"]))


class ShardReader:
    """Reads the rows a rank needs; keeps its shard files open."""

    def __init__(self, model: ModelConfig, sources: list[SourceIndex]) -> None:
        self.model = model
        self.sources = sources
        self._files: dict[Path, h5py.File] = {}

    def _file(self, path: Path) -> h5py.File:
        if path not in self._files:
            self._files[path] = h5py.File(path, "r")
        return self._files[path]

    def sample_ids(self, refs: list[SampleRef]) -> torch.Tensor:
        out = np.empty(len(refs), dtype=np.int64)
        for i, ref in enumerate(refs):
            shard, row = self.sources[ref.source].locate(ref.row)
            out[i] = self._file(shard.path)["sample_id"][row]
        return torch.from_numpy(out)

    def images(self, refs: list[SampleRef]) -> torch.Tensor:
        """(B, H, W, C) float32 in [0, 1]; text-only samples get a blank image."""
        m = self.model
        out = np.zeros((len(refs), m.image_size, m.image_size, m.channels), dtype=np.uint8)
        for i, ref in enumerate(refs):
            shard, row = self.sources[ref.source].locate(ref.row)
            if shard.kind == "pairs":
                img = self._file(shard.path)["image"][row]
                if img.shape != out.shape[1:]:
                    raise DataError(f"data: couldn't read image of {shard.path} row {row}: shape {img.shape}, "
                                    f"model expects {out.shape[1:]}")
                out[i] = img
        return torch.from_numpy(out).float().div_(255.0)

    def tokens(self, refs: list[SampleRef]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, seq_len) int64 token ids (0-padded, truncated) and (B,) bool has_image."""
        m = self.model
        out = np.zeros((len(refs), m.seq_len), dtype=np.int64)
        has_image = np.zeros(len(refs), dtype=bool)
        for i, ref in enumerate(refs):
            shard, row = self.sources[ref.source].locate(ref.row)
            f = self._file(shard.path)
            length = min(int(f["length"][row]), m.seq_len)
            out[i, :length] = f["tokens"][row, :length]
            has_image[i] = shard.kind == "pairs"
        if out.max(initial=0) >= m.vocab_size:
            raise DataError(f"data: couldn't use tokens: id {int(out.max())} >= vocab_size {m.vocab_size}")
        return torch.from_numpy(out), torch.from_numpy(has_image)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def open_sources(cfg: DataConfig) -> list[SourceIndex]:
    """Index the shards of every configured source, in the order of the config."""
    by_source: dict[str, list[Shard]] = {}
    for shard in scan_shards(cfg.shard_dir):
        by_source.setdefault(shard.source, []).append(shard)
    missing = [s.name for s in cfg.sources if s.name not in by_source]
    if missing:
        raise ConfigError(f"data: couldn't find source {missing[0]!r} in {cfg.shard_dir} "
                          f"(shards hold: {', '.join(sorted(by_source))})")
    unused = sorted(set(by_source) - {s.name for s in cfg.sources})
    if unused:
        log.info("data: shards of sources %s are not in the mix", unused)
    return [SourceIndex(s.name, by_source[s.name]) for s in cfg.sources]
