"""The output projection y W_out taken a block of vocabulary columns at a time (`Output`).

Why blocks: W_out (D, V) is the largest matrix of the model, and a W_out stored narrower than the
compute dtype (`param_dtype`) would otherwise be widened whole to multiply it (the base model's is
86 MB in float64 at vocabulary 21000, widened again at every decoding step). Each block of
OUTPUT_BLOCK columns is cast where it is used instead. The blocks are the same whatever the
dtypes, because a GEMM's rounding can depend on its width: float32 parameters computed in float64
give the float64 model's logits bit for bit.

The same function, with the same name, in every backend (impl_numpy/blocks.py, impl_jax/blocks.py);
each differs only in how its framework keeps the blocks apart.
"""

from __future__ import annotations

import torch

from conformance.core.params import OUTPUT_BLOCK


def product_in_blocks(y: torch.Tensor, weight: torch.Tensor, vocab_axis: int, cast) -> torch.Tensor:
    """y @ cast(W_out, y.dtype), OUTPUT_BLOCK vocabulary columns of W_out at a time (`Output`),
    each written in place. `weight` is W_out (D, V) (`vocab_axis` 1) or its transpose, the tied
    embedding (V, D) (`vocab_axis` 0); `cast` is the model's, which reads each block.

    Here the transpose is a view; XLA would copy it whole (`impl_jax`). With autograd recording,
    the product is one GEMM of the whole (widened) weight, whose backward is two more: autograd
    keeps the widened weight for the backward pass whether it is widened whole or a block at a
    time, so the blocks would save no memory there, and cost a (B, T, V) concatenation forward
    and backward. A model whose weight needs no cast does the same as one whose weight does, so
    float32 parameters computed in float64 still give the float64 model's numbers bit for bit,
    with autograd and without. (With autograd the logits are the one GEMM's, equal to the blocked
    product's to float rounding; bit for bit when V <= OUTPUT_BLOCK.)"""
    weight = weight if vocab_axis == 1 else weight.T  # (D, V)
    if torch.is_grad_enabled() and (y.requires_grad or weight.requires_grad):
        return y @ cast(weight, y.dtype)  # (B, T, V)
    logits = y.new_empty(*y.shape[:-1], weight.shape[1])  # (B, T, V)
    # Each block's GEMM writes its columns of the logits itself (`out=` a strided view, which BLAS
    # and cuBLAS take as the result's leading dimension): no block result to copy, one op a block
    # instead of three (a decoding step at V = 32000 has 16 blocks). The same numbers: measured
    # bit for bit against `logits[..., block] = y @ block` in float32 and float64 on the CPU.
    # The blocks as views by one `split` each, not one indexing per block.
    rows = y.reshape(-1, y.shape[-1])  # (B * T, D)
    columns = logits.view(-1, weight.shape[1])  # (B * T, V)
    for block, out in zip(weight.split(OUTPUT_BLOCK, dim=1), columns.split(OUTPUT_BLOCK, dim=1)):
        torch.mm(rows, cast(block, y.dtype), out=out)
    return logits
