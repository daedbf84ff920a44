"""The NumPy backend: the forward pass written to be read, and in float64 the oracle.

    model = impl_numpy.load("model.safetensors")          # or impl_numpy.Model(config, params)
    out = model(src_ids, tgt_ids)                         # .logits, .attention, .intermediates
"""

from __future__ import annotations

import os

from conformance.core import checkpoint
from impl_numpy.model import (
    Model,
    causal_mask,
    make_masks,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    target_mask,
)


def load(path: str | os.PathLike, dtype=None) -> Model:
    """A `Model` from a checkpoint file; `dtype` casts the parameters (float32 or float64)."""
    config, params = checkpoint.load(path)
    return Model(config, params, dtype=dtype)


def save(model: Model, path: str | os.PathLike) -> None:
    """Write the model's config and parameters as a canonical checkpoint."""
    checkpoint.save(path, model.config, model.params)


__all__ = [
    "Model",
    "causal_mask",
    "load",
    "make_masks",
    "padding_mask",
    "save",
    "scaled_dot_product_attention",
    "softmax",
    "target_mask",
]
