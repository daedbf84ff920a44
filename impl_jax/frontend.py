"""The features source's front end (Whisper's), in Flax NNX: the same names, shapes and equations as
`impl_numpy/frontend.py`, the oracle, read next to openai-whisper's `AudioEncoder` (whisper/model.py) and transformers'
`WhisperEncoder` (modeling_whisper.py), which compute

    x  = features                                   (B, n_mels, F), channels first as both take them
    h1 = GELU(Conv1d(n_mels -> D, kernel 3, padding 1)(x))             (B, F, D)
    h2 = GELU(Conv1d(D -> D, kernel 3, stride 2, padding 1)(h1))       (B, F / 2, D)

with GELU exact (erf form). One convolution, time-major, its kernel W stored (3, C_in, C_out) as
Flax's `nn.Conv` stores it (PyTorch's `Conv1d.weight` is (C_out, C_in, 3), the transpose of all
three axes):

    conv(x, W, b, s)[t] = sum over k = 0, 1, 2 of  x[s t + k - 1] W[k]  +  b,   x[-1] = x[F] = 0

a sum of three matmuls of shifted frames (the zero frames are the padding). With F even, the
second convolution gives S = F / 2 positions, to which the encoder adds its position term.

Shape legend: B batch, F frames, S = F / 2 encoder positions, C_in / C_out channels, D d_model.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from impl_jax.precision import matmul_precision

# Both convolutions have kernel 3 and padding 1 (Whisper's); the second has stride 2.
KERNEL = 3
PADDING = 1


def cast(w: jax.Array, dtype) -> jax.Array:
    """w in `dtype`: w itself when it already is, else one rounding (exact when it widens)."""
    return w if w.dtype == dtype else w.astype(dtype)


def gelu(x: jax.Array) -> jax.Array:
    """GELU(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact form (as model.activation's "gelu")."""
    return 0.5 * x * (1 + jax.lax.erf(x * (1 / math.sqrt(2))))


def out_length(length: int, stride: int) -> int:
    """The frames a convolution of kernel 3 and padding 1 leaves of `length`: (L + 2 - 3) // s + 1."""
    return (length + 2 * PADDING - KERNEL) // stride + 1


def conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array, stride: int) -> jax.Array:
    """conv(x, W, b, s)[t] = sum_k x[s t + k - 1] W[k] + b: x (B, L, C_in) time-major, W (3, C_in, C_out),
    zero padding of one frame each side; returns (B, L_out, C_out), L_out = (L - 1) // s + 1."""
    # XLA's convolution in Flax's layout: x "NWC", the kernel "WIO" (exactly W), at the model's precision.
    y = jax.lax.conv_general_dilated(x, cast(weight, x.dtype), window_strides=(stride,), padding=[(PADDING, PADDING)],
                                     dimension_numbers=("NWC", "WIO", "NWC"), precision=matmul_precision())
    return y + cast(bias, x.dtype)  # (B, L_out, C_out)


class Conv1d(nnx.Module):
    """One convolution of the front end: its kernel (3, C_in, C_out), bias (C_out,) and stride."""

    def __init__(self, params: Mapping[str, jax.Array], prefix: str, stride: int):
        self.weight = nnx.Param(params[f"{prefix}.weight"])
        self.bias = nnx.Param(params[f"{prefix}.bias"])
        self.stride = stride

    def __call__(self, x: jax.Array) -> jax.Array:
        return conv1d(x, self.weight[...], self.bias[...], self.stride)


class FrontEnd(nnx.Module):
    """The features source's front end: (B, n_mels, F) log-mel features -> (B, F / 2, D), each
    convolution followed by exact GELU (openai-whisper's `AudioEncoder`, transformers' `WhisperEncoder`)."""

    def __init__(self, params: Mapping[str, jax.Array], prefix: str):
        self.conv1 = Conv1d(params, f"{prefix}.conv1", stride=1)
        self.conv2 = Conv1d(params, f"{prefix}.conv2", stride=2)

    def positions(self, frames: int) -> int:
        """S, the encoder positions the front end gives for `frames` frames: frames / 2 for an even count."""
        return out_length(out_length(frames, self.conv1.stride), self.conv2.stride)

    def __call__(self, features: jax.Array, dtype, out) -> jax.Array:
        """The front end's output (B, S, D) in `dtype`; `out.intermediates` gets each convolution's
        (after its GELU) as `encoder.conv1` (B, F, D) and `encoder.conv2` (B, S, D)."""
        x = cast(features, dtype).transpose(0, 2, 1)  # (B, F, n_mels): time-major, as the model
        x = gelu(self.conv1(x))  # (B, F, D)
        out.intermediates["encoder.conv1"] = x
        x = gelu(self.conv2(x))  # (B, S, D)
        out.intermediates["encoder.conv2"] = x
        return x
