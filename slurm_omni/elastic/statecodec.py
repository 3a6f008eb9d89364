"""Small ``state_dict()`` objects (a data loader's, a sampler's, a scheduler's, an RNG holder's) as
JSON and back, losslessly: tensors and numpy arrays (base64 bytes with dtype and shape), tuples,
dicts with non-string keys, bytes. Large tensors belong in modules and optimizers (HDF5 datasets with
checksums), not here.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from slurm_omni.errors import CheckpointError

MAX_TENSOR_BYTES = 1 << 20
_T, _N, _TUP, _MAP, _B = "__torch__", "__numpy__", "__tuple__", "__map__", "__bytes__"


def encode(obj: Any, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        _check_size(len(raw), where)
        return {_T: [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(raw).decode()]}
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        _check_size(a.nbytes, where)
        return {_N: [a.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode()]}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes):
        return {_B: base64.b64encode(obj).decode()}
    if isinstance(obj, tuple):
        return {_TUP: [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, f"{where}.{k}") for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                raise CheckpointError(f"checkpoint: couldn't save {where}: key {k!r} is a {type(k).__name__}")
            pairs.append([encode(k, where), encode(v, f"{where}[{k!r}]")])
        return {_MAP: pairs}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"checkpoint: couldn't save {where}: its state holds a {type(obj).__name__} "
                          "(state_dict() must hold tensors, arrays, numbers, strings, lists and dicts)")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, value), = obj.items()
        if key == _T:
            dtype, shape, data = value
            raw = bytearray(base64.b64decode(data))
            t = torch.frombuffer(raw, dtype=getattr(torch, dtype)) if raw else torch.empty(0, dtype=getattr(torch, dtype))
            return t.reshape(shape).clone()
        if key == _N:
            dtype, shape, data = value
            return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
        if key == _B:
            return base64.b64decode(value)
        if key == _TUP:
            return tuple(decode(v) for v in value)
        if key == _MAP:
            return {_hashable(decode(k)): decode(v) for k, v in value}
    return {k: decode(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _check_size(nbytes: int, where: str) -> None:
    if nbytes > MAX_TENSOR_BYTES:
        raise CheckpointError(f"checkpoint: couldn't save {where}: a tensor of {nbytes} bytes in a small "
                              f"state (limit {MAX_TENSOR_BYTES}; pass it as a module or optimizer instead)")
