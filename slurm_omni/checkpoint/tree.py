"""Nested training state (state dicts, optimizer state) to a JSON skeleton plus named tensors, and back.

A skeleton is the nested structure with every tensor replaced by ``{"__tensor__": path}``. Dicts keep
their key types (an optimizer's ``state`` is keyed by int), tuples stay tuples. Paths are HDF5 names
below the unit's group: the keys joined by ``/``, each escaped so that a key holding ``/`` or ``%`` or
an empty key cannot collide with another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slurm_omni.errors import CheckpointError

TENSOR = "__tensor__"
DICT = "__dict__"
TUPLE = "__tuple__"


@dataclass(frozen=True, slots=True)
class DpSplit:
    """A tensor cut across the data-parallel ranks of its stage along ``dim`` (ZeRO-style state).

    Each rank saves its own piece. On restore with another data-parallel size the pieces are joined
    and cut again as ``torch.tensor_split(full, data_parallel_size, dim)[data_parallel_rank]``.
    Tensors not wrapped are replicas: identical on every data-parallel rank, saved once.
    """

    tensor: torch.Tensor
    dim: int = 0


@dataclass(frozen=True, slots=True)
class Leaf:
    path: str
    tensor: torch.Tensor
    split_dim: int | None
    numpy: bool = False


def escape(key: str) -> str:
    if key in ("", "."):
        return "%" + ("2E" if key else "")
    return key.replace("%", "%25").replace("/", "%2F")


def flatten(obj: Any, *, where: str) -> tuple[Any, list[Leaf]]:
    """Split ``obj`` into its skeleton and its tensors, in a stable order."""
    leaves: list[Leaf] = []
    skeleton = _flatten(obj, (), leaves, where)
    return skeleton, leaves


def _flatten(obj: Any, path: tuple[str, ...], leaves: list[Leaf], where: str) -> Any:
    if isinstance(obj, torch.Tensor):   # the common cases first: a restore flattens its targets too
        leaves.append(Leaf(_join(path, where), obj, None))
        return {TENSOR: leaves[-1].path}
    if type(obj) is dict:
        return _flatten_mapping(obj, path, leaves, where)
    if isinstance(obj, DpSplit):
        nd = obj.tensor.dim() if isinstance(obj.tensor, torch.Tensor) else 0
        if not -nd <= obj.dim < nd:
            raise CheckpointError(f"checkpoint: couldn't save {where}/{'/'.join(path)}: "
                                  f"DpSplit dim {obj.dim} does not fit a tensor of shape {_shape(obj.tensor)}")
        dim = obj.dim % nd
        leaves.append(Leaf(_join(path, where), obj.tensor, dim))
        return {TENSOR: leaves[-1].path}
    if isinstance(obj, np.ndarray):
        leaves.append(Leaf(_join(path, where), torch.from_numpy(np.ascontiguousarray(obj)), None, numpy=True))
        return {TENSOR: leaves[-1].path, "numpy": True}
    if isinstance(obj, Mapping):
        return _flatten_mapping(obj, path, leaves, where)
    if isinstance(obj, tuple):  # torch.Size too
        return {TUPLE: [_flatten(v, (*path, str(i)), leaves, where) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, (*path, str(i)), leaves, where) for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"checkpoint: couldn't save {where}/{'/'.join(path)}: a {type(obj).__name__} "
                          f"is neither a tensor nor plain data (convert it to a tensor, number or str)")


def tensors_of(obj: Any, *, where: str) -> dict[str, torch.Tensor]:
    """``flatten(obj)``'s tensors by path, without the skeleton and its leaves: what a restore needs of
    its targets (a model's and an optimizer's state dicts), at a fraction of the cost (no type ladder
    for every int of an optimizer's ``param_groups``). Anything but dicts of str or int keys, lists,
    tuples, tensors and plain values is left to ``flatten``."""
    found: dict[str, torch.Tensor] = {}
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, prefix = stack.pop()
        if type(node) is dict:
            items: Iterator[tuple[Any, Any]] = iter(node.items())
        elif type(node) is list or type(node) is tuple:
            items = enumerate(node)
        else:
            return {leaf.path: leaf.tensor for leaf in flatten(obj, where=where)[1]}
        for k, v in items:
            if type(k) is not str and type(k) is not int:
                return {leaf.path: leaf.tensor for leaf in flatten(obj, where=where)[1]}
            path = f"{prefix}{escape(k) if type(k) is str else k}"
            if isinstance(v, torch.Tensor):
                found[path] = v
            elif type(v) is dict or type(v) is list or type(v) is tuple:
                stack.append((v, path + "/"))
            elif not (v is None or type(v) in _PLAIN):
                return {leaf.path: leaf.tensor for leaf in flatten(obj, where=where)[1]}
    return found


_PLAIN = frozenset({bool, int, float, str})


def _flatten_mapping(obj: Mapping[Any, Any], path: tuple[str, ...], leaves: list[Leaf], where: str) -> Any:
    items = []
    for k, v in obj.items():
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise CheckpointError(f"checkpoint: couldn't save {where}/{'/'.join(path)}: "
                                  f"key {k!r} is a {type(k).__name__} (keys must be str or int)")
        items.append([k, _flatten(v, (*path, escape(str(k))), leaves, where)])
    return {DICT: items}


def _join(path: tuple[str, ...], where: str) -> str:
    if not path:
        raise CheckpointError(f"checkpoint: couldn't save {where}: a bare tensor (give a dict of tensors)")
    return "/".join(path)


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def unflatten(skeleton: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild the structure; ``tensor(path)`` supplies each tensor."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton:
            t = tensor(skeleton[TENSOR])
            return t.numpy() if skeleton.get("numpy") else t
        if DICT in skeleton:
            return {k: unflatten(v, tensor) for k, v in skeleton[DICT]}
        if TUPLE in skeleton:
            return tuple(unflatten(v, tensor) for v in skeleton[TUPLE])
        raise CheckpointError(f"checkpoint: malformed skeleton node {sorted(skeleton)}")
    if isinstance(skeleton, list):
        return [unflatten(v, tensor) for v in skeleton]
    return skeleton


def tensor_paths(skeleton: Any) -> Iterator[str]:
    """Every tensor path a skeleton refers to."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton:
            yield skeleton[TENSOR]
            return
        for v in skeleton.get(DICT, ()):
            yield from tensor_paths(v[1])
        for v in skeleton.get(TUPLE, ()):
            yield from tensor_paths(v)
    elif isinstance(skeleton, list):
        for v in skeleton:
            yield from tensor_paths(v)
