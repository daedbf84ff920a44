"""Token ids: padded batches, every row with a padding pattern of its own (`PADDING_PATTERNS`), and
batches padded wider than their longest row; and a features source's log-mel batches
(`features`), which have no padding.

Real batches are padded every way: at the end (most tokenizers' collators), at the start (fairseq's
`left_pad_source=True`, decoder inputs that start with the pad id as Marian's and BART's do), in
the middle (packed or concatenated segments), and to a width the batch does not need (a fixed
length, a bucket, a longer batch's width). A port that builds its mask from the row lengths only
gets the first of these right (OpenNMT-py: its encoder mask is as wide as the longest row).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

# Lengths a batch may have. Few values keep JAX compiles bounded; 1 is the edge case of a
# single token; max_len itself is always reachable.
LENGTHS = (1, 2, 3, 5, 8)
# A row's padding: none; after its real tokens; after its first token only; before its real
# tokens; between two runs of real tokens; the whole row. The whole row comes last: a strategy
# that leaves it out takes PADDING_PATTERNS[:-1].
PADDING_PATTERNS = ("none", "trailing", "all-but-one", "leading", "interior", "whole-row")
# How wide a batch is: as wide as its longest row, or wider (every row padded at its end).
WIDTHS = ("longest row", "wider")


def padded_row(draw, real: list[int], pad_id: int, pattern: str, width: int) -> list[int]:
    """`real` (at least `width` real ids) laid out over `width` positions with `pattern`'s
    padding; a pattern the width cannot hold (interior below 3 positions, leading or trailing
    below 2) falls back to the next that it can."""
    row = list(real[:width])
    if pattern == "interior" and width < 3:
        pattern = "leading"
    if pattern in ("trailing", "leading") and width < 2:
        pattern = "none"
    if pattern == "trailing":
        keep = draw(st.integers(1, width - 1))
        row[keep:] = [pad_id] * (width - keep)
    elif pattern == "all-but-one":
        row[1:] = [pad_id] * (width - 1)
    elif pattern == "leading":
        skip = draw(st.integers(1, width - 1))
        row[:skip] = [pad_id] * skip
    elif pattern == "interior":
        start = draw(st.integers(1, width - 2))
        stop = draw(st.integers(start, width - 2))
        row[start:stop + 1] = [pad_id] * (stop + 1 - start)
    elif pattern == "whole-row":
        row = [pad_id] * width
    return row


@st.composite
def token_ids(draw, vocab: int, pad_id: int, batch: int, length: int, allow_empty_rows: bool) -> np.ndarray:
    """(batch, length) ids; each row gets a padding pattern, and the batch may be padded wider than
    its longest row (one more pad at the end of every row). Real tokens never equal pad_id."""
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad_id)
    patterns = PADDING_PATTERNS if allow_empty_rows else PADDING_PATTERNS[:-1]
    width = length - 1 if length > 1 and draw(st.sampled_from(WIDTHS)) == "wider" else length
    rows = []
    for _ in range(batch):
        pattern = draw(st.sampled_from(patterns))
        tokens = [draw(real) for _ in range(width)]
        rows.append(padded_row(draw, tokens, pad_id, pattern, width) + [pad_id] * (length - width))
    return np.array(rows, dtype=np.int64)


def padding_kinds(row: np.ndarray, pad_id: int) -> set[str]:
    """The padding kinds of one row, as `PADDING_PATTERNS` names them: "none", "whole-row",
    "all-but-one" (one real token, first), or any of "leading", "interior" and "trailing" (padding
    before, between or after its real tokens; a row of a wider batch has trailing padding too)."""
    is_pad = np.asarray(row) == pad_id
    if not is_pad.any():
        return {"none"}
    if is_pad.all():
        return {"whole-row"}
    real = np.flatnonzero(~is_pad)
    first, last = int(real[0]), int(real[-1])
    if len(real) == 1 and first == 0:
        return {"all-but-one"}
    kinds = set()
    if first > 0:
        kinds.add("leading")
    if is_pad[first:last + 1].any():
        kinds.add("interior")
    if last < len(row) - 1:
        kinds.add("trailing")
    return kinds


def batch_width(ids: np.ndarray, pad_id: int) -> str:
    """"wider" when no row of the batch has a real token in its last position, else "longest row"."""
    return "wider" if ids.shape[1] > 1 and (np.asarray(ids)[:, -1] == pad_id).all() else "longest row"


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
