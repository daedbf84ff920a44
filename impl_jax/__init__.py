"""The JAX backend: the same model in Flax NNX, jit-compiled, checked against the NumPy oracle.

    model = impl_jax.load("model.safetensors")            # or impl_jax.Model(config, params)
    out = model(src_ids, tgt_ids)                         # .logits, .attention, .intermediates
    impl_jax.save(model, "copy.safetensors")              # the canonical checkpoint, bit for bit
    impl_jax.save_state(model, "ckpt/")                   # an Orbax directory; impl_jax.load_state("ckpt/")

    with impl_jax.enable_x64():                           # float64 only inside this scope
        out64 = impl_jax.load("model.safetensors", dtype="float64")(src_ids, tgt_ids)

    model = impl_jax.Model(config, params, buckets=(8, 16, 32))   # bounded recompilation
    impl_jax.compile_stats()                              # compiles, seconds, calls, cache size
    impl_jax.enable_persistent_cache()                    # compiled executables kept on disk (or ROSETTA_JAX_CACHE=1)
    sharded = impl_jax.shard(model, mesh, "fsdp+tp")      # on a ("data", "model") jax.sharding.Mesh (impl_jax.shard)

The model is an `nnx.Module`: `nnx.state(model, nnx.Param)` flattened with dots gives exactly the
checkpoint's names, so it can be jitted, vmapped and sharded like any Flax model. Each call checks
its inputs on the host (the same `InputError`s as NumPy), then runs executables compiled per shape
(see `impl_jax.compiled` for the cost of a new shape and `impl_jax.precision` for what is pinned).
"""

from __future__ import annotations

import os

import numpy as np

from conformance.core import checkpoint
from conformance.core.surface import BACKEND_API
from impl_jax.cache import (clear_persistent_cache, disable_persistent_cache, enable_from_environment,
                            enable_persistent_cache, persistent_cache_dir)
from impl_jax.compiled import clear_cache, compile_stats, one_executable_forward, reset_stats
from impl_jax.host import bucket_length, to_numpy
from impl_jax.model import (
    SUPPORTED_DTYPES,
    Model,
    causal_mask,
    make_masks,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    target_mask,
)
from impl_jax.precision import enable_x64, full_precision, precision_settings, x64_enabled
from impl_jax.shard import shard
from impl_jax.sharded_checkpoint import load_sharded, save_sharded  # docs/sharded-checkpoints.md
from impl_jax.state import load_state, save_state
from impl_jax import stacks as _stacks  # noqa: F401  (registers the scanned layer stacks with impl_jax.compiled)


def load(path: str | os.PathLike, dtype=None, *, device=None, param_dtype=None, buckets=None,
         precision: str = "highest") -> Model:
    """A `Model` from a checkpoint file on `device` (default: JAX's default device); `dtype`
    casts the parameters (default: their own dtype; a float64 checkpoint needs `enable_x64()`,
    or `dtype="float32"`); `param_dtype` stores them in another dtype than `dtype`, and
    `precision` is the matmul precision ("highest" or "default"), as in `Model`."""
    config, params = checkpoint.load(path)
    return Model(config, params, dtype, device=device, param_dtype=param_dtype, buckets=buckets, precision=precision)


def save(model: Model, path: str | os.PathLike) -> None:
    """Write the model's config and parameters as a canonical checkpoint (NumPy arrays of the
    dtype they are stored in, `model.param_dtype`; bfloat16 through ml_dtypes), bit for bit what
    was loaded."""
    params = {name: np.asarray(value) for name, value in model.params.items()}
    checkpoint.save(path, model.config, params)


# The public surface, the same in every backend (conformance.core.surface; tests/backends/test_backend_surface.py).
from impl_jax import stream  # noqa: E402  a piece at a time, from each piece's own weights (rosetta check --stream)
__all__ = list(BACKEND_API)
# What only this backend has, importable by name but not part of the shared surface.
BACKEND_EXTRAS = ("Adam", "bucket_length", "clear_cache", "clear_persistent_cache", "compile_stats",
                  "disable_persistent_cache", "enable_persistent_cache", "enable_x64", "load_state",
                  "load_sharded", "one_executable_forward", "persistent_cache_dir", "reset_stats", "save_sharded", "save_state", "shard", "stream",
                  "train_step", "x64_enabled")

enable_from_environment()  # ROSETTA_JAX_CACHE (impl_jax.cache)


def __getattr__(name: str):
    # The optimizer needs optax (the `jax` extra): imported on first use, not with the model.
    if name in ("Adam", "train_step"):
        from impl_jax import train

        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
