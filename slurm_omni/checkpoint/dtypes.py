"""torch dtypes on disk: each tensor is stored as its raw bytes under an HDF5 type that h5ls can show.

The dataset attribute ``dtype`` (the torch name) is what restore trusts; the HDF5 type is for people and
tools. bfloat16 gets a real HDF5 float description (sign 15, exponent 7-14 with bias 127, mantissa 0-6),
so ``h5dump`` prints its values; types numpy lacks otherwise (float8 variants) are stored as unsigned
integers of the same width.
"""

from __future__ import annotations

import h5py
import numpy as np
import torch

from slurm_omni.errors import CheckpointError

_NUMPY = {
    torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
    torch.uint8: np.uint8, torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64,
    torch.complex64: np.complex64, torch.complex128: np.complex128, torch.bool: np.bool_,
}


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"checkpoint: unknown tensor dtype {name!r} (written by a newer torch?)")
    return dtype


def h5_type(dtype: torch.dtype) -> h5py.h5t.TypeID:
    if dtype is torch.bfloat16:
        tid = h5py.h5t.IEEE_F32LE.copy()
        tid.set_fields(15, 7, 8, 0, 7)
        tid.set_offset(0)
        tid.set_precision(16)
        tid.set_size(2)
        tid.set_ebias(127)
        return tid
    np_type = _NUMPY.get(dtype)
    if np_type is None:
        np_type = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(dtype.itemsize)
        if np_type is None:
            raise CheckpointError(f"checkpoint: couldn't store dtype {name_of(dtype)} ({dtype.itemsize} bytes)")
    return h5py.h5t.py_create(np.dtype(np_type), logical=True)
