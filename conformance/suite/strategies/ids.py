"""Token ids: padded batches, every row with a padding pattern of its own (`PADDING_PATTERNS`);
and a features source's log-mel batches (`features`), which have no padding."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

# Lengths a batch may have. Few values keep JAX compiles bounded; 1 is the edge case of a
# single token; max_len itself is always reachable.
LENGTHS = (1, 2, 3, 5, 8)
PADDING_PATTERNS = ("none", "trailing", "all-but-one", "whole-row")


@st.composite
def token_ids(draw, vocab: int, pad_id: int, batch: int, length: int, allow_empty_rows: bool) -> np.ndarray:
    """(batch, length) ids; each row gets a padding pattern. Real tokens never equal pad_id."""
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad_id)
    rows = []
    patterns = PADDING_PATTERNS if allow_empty_rows else PADDING_PATTERNS[:-1]
    for _ in range(batch):
        pattern = draw(st.sampled_from(patterns))
        row = [draw(real) for _ in range(length)]
        if pattern == "trailing" and length > 1:
            keep = draw(st.integers(1, length - 1))
            row[keep:] = [pad_id] * (length - keep)
        elif pattern == "all-but-one":
            row[1:] = [pad_id] * (length - 1)
        elif pattern == "whole-row":
            row = [pad_id] * length
        rows.append(row)
    return np.array(rows, dtype=np.int64)


def long_row(rng: np.random.Generator, vocab: int, pad_id: int, length: int, real: int) -> np.ndarray:
    """(1, length) ids: `real` real tokens (never pad_id), then trailing padding."""
    ids = rng.integers(0, vocab - 1, size=length)
    ids = ids + (ids >= pad_id)  # skip pad_id
    ids[real:] = pad_id
    return ids[None, :].astype(np.int64)


def anchor_ids(rng: np.random.Generator, vocab: int, pad_id: int, length: int, reals) -> np.ndarray:
    return np.concatenate([long_row(rng, vocab, pad_id, length, real) for real in reals])  # (len(reals), length)


def features(rng: np.random.Generator, batch: int, n_mels: int, length: int) -> np.ndarray:
    """(batch, n_mels, 2 length) float64 log-mel features for a features source of `length` encoder
    positions: standard normal, about the spread of Whisper's normalised log-mel ((log10 + 4) / 4)."""
    return rng.standard_normal((batch, n_mels, 2 * length))


@st.composite
def sources(draw, config, batch: int, length: int, allow_empty_rows: bool) -> np.ndarray:
    """The source batch of a case: padded token ids (`token_ids`), or a features source's log-mel
    features (B, n_mels, 2 length) from a drawn seed (`features`), whose rows have no padding."""
    if config.source == "features":
        return features(np.random.default_rng(draw(st.integers(0, 2**16))), batch, config.n_mels, length)
    return draw(token_ids(config.src_vocab_size, config.pad_id, batch, length, allow_empty_rows))
