"""Moving parameters between NumPy and torch bit for bit, and the facts the shared checks read
(dtype names, parameter facts, id bounds) as they need them.

NumPy has no bfloat16 of its own (checkpoints use ml_dtypes'), and torch cannot read ml_dtypes
arrays, so bfloat16 crosses as its 16-bit patterns. Casts of NumPy input happen in NumPy, so
every backend starts from the same rounded weights.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch


def dtype_name(dtype: Any) -> str:
    """The plain name of a torch, NumPy or string dtype ("float32"), as the shared checks spell it."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def param_facts(value: Any) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, count of NaN/inf) of one parameter, torch tensor or array-like."""
    if isinstance(value, torch.Tensor):
        nonfinite = value.numel() - int(torch.isfinite(value).sum()) if value.is_floating_point() else 0
        return tuple(value.shape), dtype_name(value.dtype), nonfinite
    array = np.asarray(value)
    nonfinite = array.size - int(np.count_nonzero(np.isfinite(array))) if array.dtype.kind in "fV" else 0
    return array.shape, array.dtype.name, nonfinite


def id_bounds(ids: torch.Tensor) -> tuple[int, int]:
    """(smallest, largest) id of an integer tensor of any dtype, as Python ints, in one sync.

    torch has no min/max kernels for uint16, uint32 and uint64, so those reduce in int64. A plain
    uint64 -> int64 cast would wrap ids >= 2**63 to negatives (a huge id reported as negative);
    flipping the sign bit instead maps [0, 2**64) onto [-2**63, 2**63) in order.
    """
    if ids.dtype == torch.uint64:
        shifted = ids.view(torch.int64) ^ torch.iinfo(torch.int64).min
        low, high = torch.stack(torch.aminmax(shifted)).tolist()
        return low + 2**63, high + 2**63
    if ids.dtype in (torch.uint16, torch.uint32):
        ids = ids.to(torch.int64)
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    return low, high


def to_torch(value: Any, dtype: str) -> torch.Tensor:
    """A parameter as a CPU tensor of `dtype`, without copying where NumPy allows it.

    NumPy arrays are cast by NumPy (ml_dtypes for bfloat16), which rounds float64 straight to the
    target; torch rounds float64 -> float16 through float32, which differs in the last bit for
    about one value in 10^4. So a float16 model holds exactly the weights `astype(float16)` gives
    every other backend. Tensors are returned as they are, for `copy_` to cast.
    """
    if isinstance(value, torch.Tensor):
        return value.detach()
    array = np.asarray(value)
    if array.dtype.name != dtype:
        array = array.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    elif not array.flags.writeable:  # torch refuses to alias read-only memory
        array = array.copy()
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A parameter as a host NumPy array with the same bits; bfloat16 becomes ml_dtypes'."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
