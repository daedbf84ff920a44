"""Numerical settings of the JAX backend: matmul precision and 64-bit mode, explicit and on record.

Matmul precision, a choice of the model. On GPUs and TPUs, JAX's default float32 matmul may run in
TF32 or in bfloat16 passes, which changes results in the third significant digit. Every matmul and
einsum in `impl_jax.model` and `impl_jax.blocks` passes `precision=matmul_precision()` explicitly,
so the model's numbers never depend on `jax_default_matmul_precision`:
    - `Model(..., precision="highest")`, the default and what every conformance run uses: full
      float32 (HIGHEST), the same numbers on every device;
    - `Model(..., precision="default")`: the device's fast float32 passes (Precision.DEFAULT: TF32
      on an NVIDIA GPU since Ampere, bfloat16 passes on a TPU), for users who only run the model.
      On a CPU XLA computes float32 matmuls in full float32 either way, so the two agree bit for
      bit there (measured: docs/tolerances.md).
The model's choice is a static attribute, so each precision compiles its own executables;
`impl_jax.compiled` runs the compiled functions inside `model_precision(model.precision)`, which
is what `matmul_precision()` reads while tracing. `full_precision()` additionally pins the global
default for code outside the model (the conformance suite wraps each run in it), and
`precision_settings()` reports what is in force, for the pytest header and reports.

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
import threading
from typing import Any, Iterator

import jax
import numpy as np

from conformance.core.errors import InputError

# Full float32 (or float64) accumulation in every dot product: no TF32, no bfloat16 passes.
MATMUL_PRECISION = jax.lax.Precision.HIGHEST

# The model's choices (`Model(..., precision=...)`) and what each passes to the matmuls.
MATMUL_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}
_SCOPE = threading.local()


def check_precision(precision: Any) -> str:
    """A model's `precision` argument: "highest" or "default"; anything else is an InputError."""
    if not isinstance(precision, str) or precision not in MATMUL_PRECISIONS:
        raise InputError("precision", f"must be one of {sorted(MATMUL_PRECISIONS)}, got {precision!r}")
    return precision


def matmul_precision() -> jax.lax.Precision:
    """The precision the model's matmuls pass while being traced: the scope's, else HIGHEST."""
    return getattr(_SCOPE, "precision", MATMUL_PRECISION)


@contextlib.contextmanager
def model_precision(precision: str) -> Iterator[None]:
    """Trace the model's matmuls at `precision` ("highest" or "default") in this scope."""
    previous = getattr(_SCOPE, "precision", None)
    _SCOPE.precision = MATMUL_PRECISIONS[check_precision(precision)]
    try:
        yield
    finally:
        if previous is None:
            del _SCOPE.precision
        else:
            _SCOPE.precision = previous

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
        "model_matmul_precision": f"{MATMUL_PRECISION.name} unless a Model is built with precision='default' "
                                  "(passed to every matmul and einsum)",
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision or "default",
        "softmax_and_norm_dtype": f"at least {MIN_REDUCTION_DTYPE.name}",
        "jax_enable_x64": x64_enabled(),
        "default_device": str(jax.devices()[0]) if jax.config.jax_default_device is None
        else str(jax.config.jax_default_device),
    }
