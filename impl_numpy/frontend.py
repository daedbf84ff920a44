"""The features source's front end (Whisper's), in plain NumPy: the float64 oracle of the two
convolutions that turn log-mel frames into the encoder's input.

Read it next to openai-whisper's `AudioEncoder` (whisper/model.py) and transformers'
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

import numpy as np

# Both convolutions have kernel 3 and padding 1 (Whisper's); the second has stride 2.
KERNEL = 3
PADDING = 1


def cast(w: np.ndarray, dtype) -> np.ndarray:
    """w in `dtype`: w itself when it already is, else one rounding (exact when it widens)."""
    return w if w.dtype == dtype else w.astype(dtype)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact form (as model.activation's "gelu")."""
    erf = np.frompyfunc(math.erf, 1, 1)(x * (1 / math.sqrt(2))).astype(x.dtype)
    return 0.5 * x * (1 + erf)


def out_length(length: int, stride: int) -> int:
    """The frames a convolution of kernel 3 and padding 1 leaves of `length`: (L + 2 - 3) // s + 1."""
    return (length + 2 * PADDING - KERNEL) // stride + 1


def conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int) -> np.ndarray:
    """conv(x, W, b, s)[t] = sum_k x[s t + k - 1] W[k] + b: x (B, L, C_in) time-major, W (3, C_in, C_out),
    zero padding of one frame each side; returns (B, L_out, C_out), L_out = (L - 1) // s + 1."""
    out_len = out_length(x.shape[1], stride)
    padded = np.pad(x, ((0, 0), (PADDING, PADDING), (0, 0)))  # (B, L + 2, C_in)
    y = sum(padded[:, k:k + stride * (out_len - 1) + 1:stride] @ cast(weight[k], x.dtype)  # x[s t + k - 1] W[k]
            for k in range(KERNEL))  # (B, L_out, C_out)
    return y + cast(bias, x.dtype)


class Conv1d:
    """One convolution of the front end: its kernel (3, C_in, C_out), bias (C_out,) and stride."""

    def __init__(self, params: Mapping[str, np.ndarray], prefix: str, stride: int):
        self.weight = params[f"{prefix}.weight"]
        self.bias = params[f"{prefix}.bias"]
        self.stride = stride

    def __call__(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        if tape is not None:  # what the backward pass reads (impl_numpy/backward.py)
            tape[self] = x
        return conv1d(x, self.weight, self.bias, self.stride)


class FrontEnd:
    """The features source's front end: (B, n_mels, F) log-mel features -> (B, F / 2, D), each
    convolution followed by exact GELU (openai-whisper's `AudioEncoder`, transformers' `WhisperEncoder`)."""

    def __init__(self, params: Mapping[str, np.ndarray], prefix: str):
        self.conv1 = Conv1d(params, f"{prefix}.conv1", stride=1)
        self.conv2 = Conv1d(params, f"{prefix}.conv2", stride=2)

    def positions(self, frames: int) -> int:
        """S, the encoder positions the front end gives for `frames` frames: frames / 2 for an even count."""
        return out_length(out_length(frames, self.conv1.stride), self.conv2.stride)

    def __call__(self, features: np.ndarray, dtype, out, *, tape=None) -> np.ndarray:
        """The front end's output (B, S, D) in `dtype`; `out.intermediates` gets each convolution's
        (after its GELU) as `encoder.conv1` (B, F, D) and `encoder.conv2` (B, S, D)."""
        x = cast(features, dtype).transpose(0, 2, 1)  # (B, F, n_mels): time-major, as the model
        hidden = self.conv1(x, tape=tape)  # (B, F, D), before the GELU
        x = gelu(hidden)
        if tape is not None:
            tape[(self, "conv1")] = hidden
        out.intermediates["encoder.conv1"] = x
        hidden = self.conv2(x, tape=tape)  # (B, S, D)
        x = gelu(hidden)
        if tape is not None:
            tape[(self, "conv2")] = hidden
        out.intermediates["encoder.conv2"] = x
        return x
