"""Numerical settings of the JAX backend: matmul precision and 64-bit mode, explicit and on record.

Matmul precision. On GPUs and TPUs, JAX's default float32 matmul may run in TF32 or in bfloat16
passes, which changes results in the third significant digit. Every matmul and einsum in
`impl_jax.model` passes `precision=MATMUL_PRECISION` (HIGHEST: full float32) explicitly, so the
model's numbers never depend on `jax_default_matmul_precision` or on the device. `full_precision()`
additionally pins the global default for code outside the model (the conformance suite wraps each
run in it), and `precision_settings()` reports what is in force, for the pytest header and reports.

64-bit mode. JAX silently truncates float64 to float32 unless `jax_enable_x64` is on. This
backend never turns it on by itself:
    - `Model(..., dtype=float64)` (or float64 params) with x64 off raises `InputError("dtype")`
      saying how to enable it, instead of computing in float32;
    - `enable_x64()` is a context manager that turns it on for its scope only (it wraps JAX's
      own `jax.enable_x64` config context) and restores the previous value on exit;
    - setting `JAX_ENABLE_X64=1` before importing JAX turns it on for the whole process.
A float64 model is built and called inside the scope; calling it after the scope has closed raises
`InputError("dtype")` too, rather than running with truncated inputs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
import numpy as np

# Full float32 (or float64) accumulation in every dot product: no TF32, no bfloat16 passes.
MATMUL_PRECISION = jax.lax.Precision.HIGHEST

# The softmax and the LayerNorm statistics run in at least this dtype (float16 and bfloat16 are
# upcast): a float16 fill of -1e9 would be -inf, and a float16 sum of 512 squares overflows once
# |x| reaches about 11.
MIN_REDUCTION_DTYPE = np.dtype(np.float32)


def reduction_dtype(dtype) -> np.dtype:
    """The dtype softmax and LayerNorm statistics use for a model computing in `dtype`."""
    return np.promote_types(np.dtype(dtype), MIN_REDUCTION_DTYPE)


def x64_enabled() -> bool:
    """Whether JAX currently keeps float64 (`jax_enable_x64`, including any enclosing scope)."""
    return bool(jax.config.jax_enable_x64)


@contextlib.contextmanager
def enable_x64() -> Iterator[None]:
    """Turn on 64-bit JAX for this scope only; the previous setting is restored on exit.

        with impl_jax.enable_x64():
            model = impl_jax.Model(config, params, dtype="float64")
            out = model(src_ids, tgt_ids)
    """
    with jax.enable_x64(True):
        yield


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Pin JAX's default matmul precision to "highest" for this scope.

    The model does not need it (its matmuls pass `precision` explicitly); it covers any JAX code
    a caller runs around the model, and makes the setting visible in `precision_settings()`.
    """
    with jax.default_matmul_precision("highest"):
        yield


def precision_settings() -> dict[str, Any]:
    """What decides the numbers right now, as printable values (the suite records them)."""
    return {
        "model_matmul_precision": f"{MATMUL_PRECISION.name} (passed to every matmul and einsum)",
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision or "default",
        "softmax_and_norm_dtype": f"at least {MIN_REDUCTION_DTYPE.name}",
        "jax_enable_x64": x64_enabled(),
        "default_device": str(jax.devices()[0]) if jax.config.jax_default_device is None
        else str(jax.config.jax_default_device),
    }
