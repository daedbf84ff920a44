"""The output projection y W_out taken a block of vocabulary columns at a time (`Output`).

Why blocks: W_out (D, V) is the largest matrix of the model, and a W_out stored narrower than the
compute dtype (`param_dtype`) would otherwise be widened whole to multiply it (the base model's is
86 MB in float64 at vocabulary 21000, widened again at every decoding step). Each block of
OUTPUT_BLOCK columns is cast where it is used instead. The blocks are the same whatever the
dtypes, because a GEMM's rounding can depend on its width: float32 parameters computed in float64
give the float64 model's logits bit for bit.

The same function, with the same name, in every backend (impl_torch/blocks.py, impl_jax/blocks.py);
each differs only in how its framework keeps the blocks apart.
"""

from __future__ import annotations

import numpy as np

from conformance.core.params import OUTPUT_BLOCK


def product_in_blocks(y: np.ndarray, weight: np.ndarray, vocab_axis: int, cast) -> np.ndarray:
    """y @ cast(W_out, y.dtype), OUTPUT_BLOCK vocabulary columns of W_out at a time (`Output`),
    each written in place. `weight` is W_out (D, V) (`vocab_axis` 1) or its transpose, the tied
    embedding (V, D) (`vocab_axis` 0); `cast` is the model's, which reads each block.

    Here the transpose is a view; XLA would copy it whole (`impl_jax`)."""
    weight = weight if vocab_axis == 1 else weight.T  # (D, V)
    logits = np.empty((*y.shape[:-1], weight.shape[1]), y.dtype)  # (B, T, V)
    for start in range(0, weight.shape[1], OUTPUT_BLOCK):
        columns = weight[:, start:start + OUTPUT_BLOCK]  # (D, OUTPUT_BLOCK)
        np.matmul(y, cast(columns, y.dtype), out=logits[..., start:start + OUTPUT_BLOCK])
    return logits
