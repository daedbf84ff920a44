"""The sinusoidal position term (Vaswani et al., 2017, section 3.5), computed once in float64.

    angle(pos, i) = pos / 10000^(2i / D)          for pair i = 0 .. D/2 - 1

    interleaved (the paper):   PE[pos, 2i] = sin(angle),  PE[pos, 2i + 1] = cos(angle)
    split (Marian):            PE[pos, i]  = sin(angle),  PE[pos, D/2 + i] = cos(angle)

    t2t (tensor2tensor; Flax examples/wmt `sinusoidal_init`): split, but with the timescales
        angle_t2t(pos, i) = pos * exp(-ln(10000) * i / (D/2 - 1))
    spaced over D/2 - 1 intervals (the last pair reaches 1/10000 exactly), and the table rounded
    to float32 after a float64 computation, because that is the table the system stores and adds.

fairseq (fairseq's and M2M100/NLLB's `get_embedding`): t2t's split and timescales, computed in
    float32 throughout as PyTorch computes it there (float32 positions times float32 timescales),
    with the row of the padding id set to zero.

relative (T5): no term is added to the embeddings. A learned bias per stack and head is added to
    the self-attention scores instead, looked up by the bucket of the key's offset from the query
    (`relative_position_buckets`, T5's `_relative_position_bucket`):

    n = j - i (key j, query i); bidirectional (encoder): N = buckets / 2, bucket = N [n > 0] + b(|n|);
    causal (decoder): N = buckets, bucket = b(max(-n, 0)); with E = N / 2 exact buckets,
        b(m) = m                                                           for m < E
        b(m) = min(E + trunc(log(m / E) / log(max_distance / E) * (N - E)), N - 1)   otherwise,
    the logarithm taken in float32, as transformers (and so the checkpoints' training) take it.

The table is a constant of the config, so every backend takes it from here and casts it to its
own dtype: computing it in float32 instead (as several tutorials do) moves angles by about
`pos * 6e-8`, which is a visible error at long positions.

This module is framework-free (NumPy only).
"""

from __future__ import annotations

import math

import numpy as np


def position_table(config, length: int | None = None) -> np.ndarray:
    """The `(length + position_offset, D)` float64 sinusoid a `ModelConfig` adds (position p
    reads row p + position_offset); not for position == "table", which is a parameter. `length`:
    the stack's longest sequence, max_len (the default) or, for a features source's encoder,
    `config.source_len`."""
    rows = (config.max_len if length is None else length) + config.position_offset
    return sinusoid_table(rows, config.d_model, config.position, pad_id=config.pad_id)


def sinusoid_table(max_len: int, d_model: int, form: str, *, pad_id: int | None = None) -> np.ndarray:
    """The `(max_len, d_model)` float64 sinusoid; `form` is "sinusoid-interleaved", "sinusoid-split",
    "sinusoid-t2t" or "sinusoid-fairseq" (whose values are float32 numbers, held in float64; the
    latter's row `pad_id` is zero when it is a row of the table)."""
    if form == "sinusoid-t2t":
        return _t2t_table(max_len, d_model)
    if form == "sinusoid-fairseq":
        return _fairseq_table(max_len, d_model, pad_id)
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


def _fairseq_table(max_len: int, d_model: int, pad_id: int | None) -> np.ndarray:
    """M2M100's `M2M100SinusoidalPositionalEmbedding.get_embedding(max_len, D, pad_id)` (fairseq's
    `SinusoidalPositionalEmbedding`), whose every step is float32 there. The products are float32
    products, bit for bit; exp, sin and cos are taken in float64 and rounded once to float32 (the
    nearest float32), where torch's float32 kernels are off by an ulp in about one value in ten, which
    a large position turns into ~1e-5 of angle: that is the float32 system's own noise."""
    half = d_model // 2
    step = np.float32(math.log(10000) / (half - 1))
    exponent = np.arange(half, dtype=np.float32) * -step  # (D/2,) float32
    timescale = np.exp(exponent.astype(np.float64)).astype(np.float32)  # (D/2,)
    angle = (np.arange(max_len, dtype=np.float32)[:, None] * timescale[None, :]).astype(np.float64)  # (L, D/2)
    table = np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)  # (L, D)
    if pad_id is not None and pad_id < max_len:
        table[pad_id, :] = 0
    return table.astype(np.float64)


def relative_position_bucket(offset: np.ndarray, *, bidirectional: bool, buckets: int, max_distance: int) -> np.ndarray:
    """The bucket of each key-minus-query offset n = j - i (an int array, any shape): T5's
    `_relative_position_bucket`, elementwise.

    The logarithmic part is computed in float32 as PyTorch computes it there (a float32 log, then a
    float32 division by log(max_distance / E) and product with N - E, truncated), because at
    offsets such as 16, 32 and 64 the real quotient is an integer and float32's rounding decides
    the bucket."""
    offset = np.asarray(offset, dtype=np.int64)
    n_buckets, bucket = buckets, np.zeros_like(offset)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + (offset > 0) * n_buckets
        distance = np.abs(offset)
    else:
        distance = -np.minimum(offset, 0)
    exact = n_buckets // 2
    with np.errstate(divide="ignore"):  # log(0) at distance 0, which is exact anyway
        log_ratio = np.log(distance.astype(np.float32) / np.float32(exact))
    scaled = log_ratio / np.float32(math.log(max_distance / exact)) * np.float32(n_buckets - exact)
    large = exact + np.where(distance < exact, 0, scaled).astype(np.int64)
    large = np.minimum(large, n_buckets - 1)
    return bucket + np.where(distance < exact, distance, large)


def offset_buckets(config, *, bidirectional: bool, length: int | None = None) -> np.ndarray:
    """(2 L - 1,) int64 for L = `length` (default max_len): the bucket of every offset n = j - i a
    stack of `config` can meet, at index n + L - 1, so that the bucket of query i and key j is
    `offset_buckets[j - i + L - 1]` in every backend (one gather, also for a cached step)."""
    length = config.max_len if length is None else length
    offsets = np.arange(-(length - 1), length)
    return relative_position_bucket(offsets, bidirectional=bidirectional, buckets=config.relative_buckets,
                                    max_distance=config.relative_max_distance)
