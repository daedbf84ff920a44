"""The sinusoidal position term (Vaswani et al., 2017, section 3.5), computed once in float64.

    angle(pos, i) = pos / 10000^(2i / D)          for pair i = 0 .. D/2 - 1

    interleaved (the paper):   PE[pos, 2i] = sin(angle),  PE[pos, 2i + 1] = cos(angle)
    split (Marian, t2t):       PE[pos, i]  = sin(angle),  PE[pos, D/2 + i] = cos(angle)

The table is a constant of the config, so every backend takes it from here and casts it to its
own dtype: computing it in float32 instead (as several tutorials do) moves angles by about
`pos * 6e-8`, which is a visible error at long positions.

This module is framework-free (NumPy only).
"""

from __future__ import annotations

import numpy as np


def sinusoid_table(max_len: int, d_model: int, form: str) -> np.ndarray:
    """The `(max_len, d_model)` float64 sinusoid; `form` is "sinusoid-interleaved" or "sinusoid-split"."""
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
