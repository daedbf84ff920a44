"""Moving parameters between NumPy and torch bit for bit, and the facts the shared checks read
(dtype names, id bounds, which device) as they need them.

NumPy has no bfloat16 of its own (checkpoints use ml_dtypes'), and torch cannot read ml_dtypes
arrays, so bfloat16 crosses as its 16-bit patterns. Casts of NumPy input happen in NumPy, so
every backend starts from the same rounded weights.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch

from conformance.core.errors import InputError
from conformance.core.inputs import check_device


def dtype_name(dtype: Any) -> str:
    """The plain name of a torch, NumPy or string dtype ("float32"), as the shared checks spell it."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


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


def to_numpy(tensor: Any) -> np.ndarray:
    """A tensor as a host NumPy array with the same bits (bfloat16 becomes ml_dtypes'); anything
    else as `np.asarray` reads it."""
    if not isinstance(tensor, torch.Tensor):
        return np.asarray(tensor)
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def resolve_device(device: Any) -> torch.device:
    """`device` ("cpu", "cuda", "cuda:1", a torch.device; None: the CPU) as a torch.device that is
    present here; anything else is an `InputError` naming it."""
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError("device", f"{device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    absent = None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            absent = "no CUDA device: torch.cuda.is_available() is False"
        elif resolved.index is not None and resolved.index >= count:
            absent = f"there are {count} CUDA device(s), so index {resolved.index} does not exist"
    check_device("torch", resolved.type, ("cpu", "cuda"), absent)
    return resolved
