"""Phase one of a save, the only one that blocks training: copy tensors into reused host buffers.

The host buffers are one arena (page-locked where CUDA exists) that lives as long as the engine and is
re-planned only when the set of tensors changes. Replicated tensors (identical on every data-parallel
rank of a stage) are spread over those ranks by size, so each rank copies and writes about 1/dp of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slurm_omni.checkpoint import rng
from slurm_omni.checkpoint.dtypes import name_of
from slurm_omni.checkpoint.tree import Leaf, flatten
from slurm_omni.errors import CheckpointError

log = logging.getLogger(__name__)

ALIGN = 4096
# Host copies scale with memory channels up to a handful of threads (the H200 host: 2 threads gave
# 9 GB/s against torch's 28 GB/s memcpy); beyond 8 they only contend.
COPIERS = max(2, min(8, torch.get_num_threads()))
MODEL, OPTIM = "model", "optim"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardLayout:
    """Where this process sits in the job; the runtime builds it from its environment."""

    rank: int = 0
    """Global rank; rank 0 commits each checkpoint once every rank's shard is durable."""
    world_size: int = 1
    stage: str = "main"
    """Pipeline stage this rank runs (e.g. "vision", "text"); its modules restore onto the same stage."""
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    """Replicas of this stage."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise CheckpointError(f"checkpoint: rank {self.rank} is outside world_size {self.world_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise CheckpointError(f"checkpoint: data_parallel_rank {self.data_parallel_rank} is outside "
                                  f"data_parallel_size {self.data_parallel_size}")
        if not self.stage or "/" in self.stage:
            raise CheckpointError(f"checkpoint: stage name {self.stage!r} must be non-empty without '/'")


@dataclass(kw_only=True)
class ShardState:
    """What one rank saves. Every field but ``modules`` may stay empty."""

    modules: Mapping[str, Mapping[str, Any]]
    """Module name -> its ``state_dict()`` (vision_encoder, projector, text_decoder, ...)."""
    optimizer: Mapping[str, Any] = field(default_factory=dict)
    """Module name -> that module's optimizer state (any nesting of dicts, lists, tensors, numbers)."""
    state: Any = None
    """JSON-able: each data source's iterator position, scheduler counters, anything small."""
    rng: Any = None
    """The process random streams to save (``rng.capture()`` output); None captures them now."""


@dataclass(frozen=True, slots=True)
class Item:
    unit: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    split_dim: int | None
    owned: bool
    offset: int = -1          # in the arena; -1 when another rank writes it


@dataclass(slots=True)
class Snapshot:
    step: int
    items: list[Item]
    arena: torch.Tensor
    skeletons: dict[str, Any]
    stages: dict[str, str]
    spec_digest: dict[str, str]
    load_order: tuple[str, ...]
    state_json: str
    rng: Any
    blocking_s: float = 0.0

    def view(self, item: Item) -> memoryview:
        return self.arena[item.offset:item.offset + item.nbytes].numpy().data.cast("B")

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items if i.owned)


class HostArena:
    """Host memory reused from save to save; page-locked when CUDA is there and ``pin`` asks."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._plan_key: tuple[Any, ...] | None = None
        self._items: list[Item] = []
        self._copiers = ThreadPoolExecutor(COPIERS, thread_name_prefix="omni-ckpt-snapshot")

    def copy_in(self, pairs: list[tuple[torch.Tensor, Item]]) -> None:
        """Copy each tensor to its place; return when every byte is in host memory.

        Device tensors go by ``copy_`` (asynchronous into page-locked memory, one synchronize at the
        end). Plain host tensors are split by size over a few threads that each memcpy their share
        through numpy (GIL released): one join in all, where torch's own parallel copy would meet at a
        barrier per tensor, and a few hundred barriers cost seconds on a busy node.
        """
        shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(COPIERS)]
        load = [0] * COPIERS
        cuda = False
        for src, item in sorted(pairs, key=lambda p: -p[1].nbytes):
            src = src.detach()
            dst = self.buffer[item.offset:item.offset + item.nbytes]
            if src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg():
                k = load.index(min(load))
                shares[k].append((dst.numpy(), src.reshape(-1).view(torch.uint8).numpy()))
                load[k] += item.nbytes
            else:
                cuda |= src.is_cuda
                dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=src.is_cuda and self.pin)
        for done in [self._copiers.submit(_memcpy, share) for share in shares if share]:
            done.result()
        if cuda:
            torch.cuda.synchronize()

    def plan(self, key: tuple[Any, ...], items: list[Item]) -> list[Item]:
        """Give each owned item an offset; reuse the previous plan when the tensors are the same."""
        if key == self._plan_key:
            return self._items
        placed, offset = [], 0
        for it in items:
            if it.owned:
                placed.append(Item(it.unit, it.path, it.dtype, it.shape, it.nbytes, it.split_dim, True, offset))
                offset += -(-it.nbytes // ALIGN) * ALIGN
            else:
                placed.append(it)
        if offset > self.buffer.numel():
            started = time.monotonic()
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one before taking the new
            self.buffer = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pin)
            self.buffer.fill_(0)  # fault every page in now, not during the first blocking copy
            log.info("checkpoint: host buffer of %.1f MiB ready in %.2f s (pinned: %s)",
                     offset / 2**20, time.monotonic() - started, self.pin)
        self._plan_key, self._items = key, placed
        return placed


def take(arena: HostArena, step: int, shard: ShardState, layout: ShardLayout,
         load_order: tuple[str, ...] | None, *, copy: bool = True) -> Snapshot:
    """Copy this rank's share of ``shard`` into the arena; return once the copies are done.

    ``copy=False`` only plans and allocates the arena (``CheckpointEngine.prepare``)."""
    started = time.monotonic()
    skeletons: dict[str, Any] = {}
    leaves: list[tuple[str, Leaf]] = []
    for part, tree in ((MODEL, shard.modules), (OPTIM, shard.optimizer)):
        for module, obj in tree.items():
            if not module or "/" in module:
                raise CheckpointError(f"checkpoint: module name {module!r} must be non-empty without '/'")
            unit = f"{module}/{part}"
            skeletons[unit], unit_leaves = flatten(obj, where=unit)
            leaves.extend((unit, leaf) for leaf in unit_leaves)
    items = [Item(unit, leaf.path, leaf.tensor.dtype, tuple(leaf.tensor.shape),
                  leaf.tensor.numel() * leaf.tensor.element_size(), leaf.split_dim, True)
             for unit, leaf in leaves]
    items = _assign(items, layout)
    key = tuple((i.unit, i.path, i.dtype, i.shape, i.split_dim, i.owned) for i in items)
    placed = arena.plan(key, items)
    if copy:
        arena.copy_in([(leaf.tensor, item) for (_, leaf), item in zip(leaves, placed, strict=True)
                       if item.owned and item.nbytes])
    try:
        state_json = json.dumps(shard.state, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint: couldn't save the runtime state: {e} (it must be JSON-able)") from e
    modules = list(shard.modules)
    order = tuple(load_order) if load_order else tuple(modules)
    order += tuple(m for m in modules if m not in order)
    snap = Snapshot(step=step, items=placed, arena=arena.buffer, skeletons=skeletons,
                    stages={u: layout.stage for u in skeletons}, spec_digest=_digests(items),
                    load_order=order, state_json=state_json,
                    rng=shard.rng if shard.rng is not None else rng.capture())
    snap.blocking_s = time.monotonic() - started
    return snap


def _memcpy(share: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in share:
        np.copyto(dst, src)


def _assign(items: list[Item], layout: ShardLayout) -> list[Item]:
    """Which rank writes each replicated tensor: largest first onto the least loaded replica.

    Every rank of a stage computes the same answer from the same state, without talking to the others.
    """
    n = layout.data_parallel_size
    if n == 1:
        return items
    load = [0] * n
    owner: dict[tuple[str, str], int] = {}
    for it in sorted((i for i in items if i.split_dim is None), key=lambda i: (-i.nbytes, i.unit, i.path)):
        r = min(range(n), key=lambda k: (load[k], k))
        owner[(it.unit, it.path)] = r
        load[r] += it.nbytes
    return [Item(i.unit, i.path, i.dtype, i.shape, i.nbytes, i.split_dim,
                 i.split_dim is not None or owner[(i.unit, i.path)] == layout.data_parallel_rank)
            for i in items]


def _digests(items: list[Item]) -> dict[str, str]:
    """Per unit, a digest of its tensor list, so the committer can tell replicas that disagree."""
    by_unit: dict[str, list[str]] = {}
    for i in items:
        shape = "?" if i.split_dim is not None else i.shape  # pieces of a split tensor may differ
        by_unit.setdefault(i.unit, []).append(f"{i.path}|{name_of(i.dtype)}|{shape}|{i.split_dim}")
    return {u: hashlib.sha1("\n".join(v).encode()).hexdigest()[:16] for u, v in by_unit.items()}
