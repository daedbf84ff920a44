"""The NumPy backend: the forward pass written to be read, and in float64 the oracle.

    model = impl_numpy.load("model.safetensors")          # or impl_numpy.Model(config, params)
    out = model(src_ids, tgt_ids)                         # .logits, .attention, .intermediates
"""

from __future__ import annotations

import os

from conformance.core import checkpoint
from conformance.core.surface import BACKEND_API
from impl_numpy.model import (
    SUPPORTED_DTYPES,
    Model,
    causal_mask,
    make_masks,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    target_mask,
)
from impl_numpy.precision import full_precision, precision_settings, to_numpy


def load(path: str | os.PathLike, dtype=None, *, device=None, param_dtype=None) -> Model:
    """A `Model` from a checkpoint file; `dtype` casts the parameters (float32 or float64).
    `device` is the host, "cpu" (the same surface as the other backends). `param_dtype` stores
    them in another dtype than `dtype`, as in `Model`."""
    config, params = checkpoint.load(path)
    return Model(config, params, dtype, device=device, param_dtype=param_dtype)


def save(model: Model, path: str | os.PathLike) -> None:
    """Write the model's config and parameters as a canonical checkpoint, in the dtype they are
    stored in (`model.param_dtype`)."""
    checkpoint.save(path, model.config, model.params)

from impl_numpy.train import Adam, train_step  # the paper's optimizer (docs/training.md)

# The public surface, the same in every backend (conformance.core.surface; tests/backends/test_backend_surface.py).
from impl_numpy import stream  # noqa: E402  a piece at a time, from each piece's own weights (rosetta check --stream)
__all__ = list(BACKEND_API)
# What only this backend has, importable by name but not part of the shared surface.
BACKEND_EXTRAS = ("Adam", "stream", "train_step")
