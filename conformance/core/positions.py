"""The sinusoidal position term (Vaswani et al., 2017, section 3.5), computed once in float64.

    angle(pos, i) = pos / 10000^(2i / D)          for pair i = 0 .. D/2 - 1

    interleaved (the paper):   PE[pos, 2i] = sin(angle),  PE[pos, 2i + 1] = cos(angle)
    split (Marian):            PE[pos, i]  = sin(angle),  PE[pos, D/2 + i] = cos(angle)

    t2t (tensor2tensor; Flax examples/wmt `sinusoidal_init`): split, but with the timescales
        angle_t2t(pos, i) = pos * exp(-ln(10000) * i / (D/2 - 1))
    spaced over D/2 - 1 intervals (the last pair reaches 1/10000 exactly), and the table rounded
    to float32 after a float64 computation, because that is the table the system stores and adds.

The table is a constant of the config, so every backend takes it from here and casts it to its
own dtype: computing it in float32 instead (as several tutorials do) moves angles by about
`pos * 6e-8`, which is a visible error at long positions.

This module is framework-free (NumPy only).
"""

from __future__ import annotations

import numpy as np


def sinusoid_table(max_len: int, d_model: int, form: str) -> np.ndarray:
    """The `(max_len, d_model)` float64 sinusoid; `form` is "sinusoid-interleaved", "sinusoid-split"
    or "sinusoid-t2t" (whose values are float32 numbers, held in float64)."""
    if form == "sinusoid-t2t":
        return _t2t_table(max_len, d_model)
    pos = np.arange(max_len, dtype=np.float64)[:, None]  # (L, 1)
    pair = np.arange(d_model // 2, dtype=np.float64)[None, :]  # (1, D/2)
    angle = pos / np.power(10000.0, 2.0 * pair / d_model)  # (L, D/2)
    table = np.empty((max_len, d_model), dtype=np.float64)
    if form == "sinusoid-interleaved":
        table[:, 0::2] = np.sin(angle)
        table[:, 1::2] = np.cos(angle)
    elif form == "sinusoid-split":
        table[:, : d_model // 2] = np.sin(angle)
        table[:, d_model // 2 :] = np.cos(angle)
    else:
        raise ValueError(f"not a sinusoid position form: {form!r}")
    return table


def _t2t_table(max_len: int, d_model: int) -> np.ndarray:
    """Flax `examples/wmt`'s `sinusoidal_init(max_len)` table, (max_len, D), bit for bit: NumPy
    computes the angles in float64 (an int64 position times float64 timescales) and stores sin
    and cos into a float32 array; those float32 values are the position term."""
    half = d_model // 2
    pos = np.arange(max_len)[:, None]  # (L, 1) int64, as there
    timescale = np.exp(np.arange(half) * (-np.log(10000.0) / (half - 1)))  # (D/2,) float64
    table = np.zeros((max_len, d_model), dtype=np.float32)
    table[:, :half] = np.sin(pos * timescale)
    table[:, half : 2 * half] = np.cos(pos * timescale)
    return table.astype(np.float64)
