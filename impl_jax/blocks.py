"""The output projection y W_out taken a block of vocabulary columns at a time (`Output`).

Why blocks: W_out (D, V) is the largest matrix of the model, and a W_out stored narrower than the
compute dtype (`param_dtype`) would otherwise be widened whole to multiply it (the base model's is
86 MB in float64 at vocabulary 21000, widened again at every decoding step). Each block of
OUTPUT_BLOCK columns is cast where it is used instead. The blocks are the same whatever the
dtypes, because a GEMM's rounding can depend on its width: float32 parameters computed in float64
give the float64 model's logits bit for bit.

The same function, with the same name, in every backend (impl_numpy/blocks.py,
impl_torch/blocks.py); each differs only in how its framework keeps the blocks apart. Here a
`jax.custom_jvp` also gives the blocked product the derivative of the one product it is, and
under differentiation computes it as that one product (as impl_torch does under autograd).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from conformance.core.params import OUTPUT_BLOCK
from impl_jax.precision import matmul_precision


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def product_in_blocks(y: jax.Array, weight: jax.Array, vocab_axis: int, cast) -> jax.Array:
    """y @ cast(W_out, y.dtype), OUTPUT_BLOCK vocabulary columns of W_out at a time (`Output`),
    each written in place. `weight` is W_out (D, V) (`vocab_axis` 1) or its transpose, the tied
    embedding (V, D) (`vocab_axis` 0); `cast` is the model's, which reads each block.

    The full blocks in a loop, then the rest. In a loop XLA widens one block at a time, next to
    its product; unrolled, it fuses each slice into its product's operand (15x slower for one row
    at vocabulary 32000), and concatenated blocks it widens all at once, as it would the whole
    weight. The tied embedding is sliced by rows and each block transposed: a transpose of the
    whole table, XLA copies whole before the loop (74 MB of temporaries at V = 32000, against
    8 MB)."""
    vocab = weight.shape[vocab_axis]

    def part(start, width: int) -> jax.Array:  # (B, T, width): the vocabulary entries from `start`
        entries = jax.lax.dynamic_slice_in_dim(weight, start, width, axis=vocab_axis)
        columns = entries if vocab_axis == 1 else entries.T  # (D, width)
        return jnp.matmul(y, cast(columns, y.dtype), precision=matmul_precision())

    full = vocab // OUTPUT_BLOCK
    logits = jnp.zeros((*y.shape[:-1], vocab), y.dtype)  # (B, T, V)
    if full:
        logits = jax.lax.fori_loop(0, full, lambda k, logits: jax.lax.dynamic_update_slice_in_dim(
            logits, part(k * OUTPUT_BLOCK, OUTPUT_BLOCK), k * OUTPUT_BLOCK, axis=-1), logits)
    if vocab % OUTPUT_BLOCK:
        logits = logits.at[..., full * OUTPUT_BLOCK:].set(part(full * OUTPUT_BLOCK, vocab % OUTPUT_BLOCK))
    return logits


@product_in_blocks.defjvp
def _product_in_blocks_jvp(vocab_axis, cast, primals, tangents):
    """Differentiated, and when differentiated computed, as the one product it is (impl_torch
    does the same under autograd): reverse mode keeps the widened weight for the backward pass
    whether it is widened whole or a block at a time, so the blocks would save no memory there.
    Through the loop, each block's weight gradient would be a zero (D, V) array added to the
    running sum (the base model's projection at vocabulary 32000 took 1.45x as long to
    differentiate), and the loop's forward costs its (B, T, V) zeros and block writes: in the
    profile of the base model's `loss_and_grads` (batch 8, length 64), its kernels took 1.98-2.04
    s with one product against 2.19-2.28 s with the loop.

    Each product is taken on rows flattened to (B * T, D): reverse mode then transposes
    `y @ dW` into `y^T @ dlogits`, a GEMM of the two arrays as they lie; left 3-D, XLA:CPU first
    copied the (B * T, V) gradient of the logits transposed (about 60 ms at that size).
    The logits are then the one GEMM's, equal to the blocked product's to float rounding (as in
    impl_torch), and float32 parameters computed in float64 still give the float64 model's
    gradients bit for bit (tests/backends/test_param_dtype.py, at XLA's own settings)."""
    (y, weight), (dy, dweight) = primals, tangents
    if vocab_axis == 0:  # the tied embedding (V, D)
        weight, dweight = weight.T, dweight.T  # (D, V)
    columns = cast(weight, y.dtype)
    rows, drows = y.reshape(-1, y.shape[-1]), dy.reshape(-1, y.shape[-1])  # (B * T, D)
    shape = (*y.shape[:-1], weight.shape[1])
    product = jnp.matmul(rows, columns, precision=matmul_precision())
    tangent = (jnp.matmul(drows, columns, precision=matmul_precision())
               + jnp.matmul(rows, cast(dweight, y.dtype), precision=matmul_precision()))
    return product.reshape(shape), tangent.reshape(shape)
