"""A tensor of any framework as a NumPy array, and back to torch, with the same bits: the two
conversions every reader and writer of `conformance.convert` shares (bfloat16, which NumPy lacks,
is carried as `ml_dtypes.bfloat16`)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from conformance.convert.errors import TensorError, a_type


def as_numpy(value: Any, key: str) -> np.ndarray:
    """A torch tensor, JAX array or NumPy array as a NumPy array (a view where possible)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        import torch

        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            # NumPy has no bfloat16; the bits are reinterpreted, not rounded.
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    if hasattr(value, "__array__") and hasattr(value, "shape"):
        return np.asarray(value)
    raise TensorError(str(key), f"is {a_type(value)}, not a tensor or array")


def as_torch(array: np.ndarray):
    """A NumPy array as a CPU torch tensor of the same dtype and bits (bfloat16 reinterpreted, not
    rounded: NumPy has none of its own); it shares the array's memory where the array is C-ordered
    and writable, and is a copy otherwise."""
    import torch

    array = np.asarray(array)
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = array.copy()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
