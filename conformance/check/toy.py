"""The toy task behind the built-in default model: reverse a string of digits.

    source  "3 1 4 1 5"   ->   target  "5 1 4 1 3"

Reversal makes attention easy to read: to write output position t, the decoder's
cross-attention must look at source position L - 1 - t, an anti-diagonal in every picture. The
data is generated in code from a seed; nothing is downloaded.

Vocabulary (shared by source and target):  0 <pad>, 1 <bos>, 2 <eos>, 3..12 the digits 0..9.
The decoder input is `<bos> y_1 .. y_n` and the label is `y_1 .. y_n <eos>`.
"""

from __future__ import annotations

import numpy as np

PAD, BOS, EOS = 0, 1, 2
TOKENS = ["<pad>", "<bos>", "<eos>"] + [str(d) for d in range(10)]
VOCAB_SIZE = len(TOKENS)
MIN_DIGITS, MAX_DIGITS = 3, 12
TASK = "reverse-digits"


def range_warning(src) -> str | None:
    """What to tell a user whose toy source rows (ids, padding not counted) lie outside the
    lengths the model was trained on (MIN_DIGITS to MAX_DIGITS digits): its answer there is not
    reversal it has learned, and it gives one all the same (`7` gives `7 7`). None when every row
    is in range."""
    lengths = [int(np.count_nonzero(np.asarray(row) != PAD)) for row in np.atleast_2d(src)]
    outside = [(row, n) for row, n in enumerate(lengths) if not MIN_DIGITS <= n <= MAX_DIGITS]
    if not outside:
        return None
    listed = ", ".join(f"row {row} has {n} digit{'s' if n != 1 else ''}" for row, n in outside[:3])
    more = f" (and {len(outside) - 3} more rows)" if len(outside) > 3 else ""
    return (f"the built-in toy model was trained on sources of {MIN_DIGITS} to {MAX_DIGITS} digits, and "
            f"{listed}{more}: its output there is not a reversal it has learned")


def encode_text(text: str) -> list[int]:
    """'3 1 4' or '314' -> token ids (digits only; spaces are ignored)."""
    digits = [c for c in text if not c.isspace()]
    bad = [c for c in digits if not c.isdigit()]
    if bad:
        raise ValueError(f"the {TASK} task reads digits only, got {bad[0]!r}")
    return [3 + int(c) for c in digits]


def decode_ids(ids) -> str:
    """Token ids -> '5 1 4' (stops at <eos>, skips <bos> and <pad>)."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i >= 3:  # <pad> and <bos> are not text
            out.append(TOKENS[i])
    return " ".join(out)


def token_labels(ids) -> list[str]:
    return [TOKENS[int(i)] if 0 <= int(i) < VOCAB_SIZE else str(int(i)) for i in ids]


def batch(rng: np.random.Generator, size: int, min_digits: int = MIN_DIGITS, max_digits: int = MAX_DIGITS):
    """(src (B, S), decoder input (B, T), labels (B, T)), padded with <pad> to the longest row."""
    lengths = rng.integers(min_digits, max_digits + 1, size=size)
    width = int(lengths.max())
    src = np.full((size, width), PAD, dtype=np.int64)
    tgt_in = np.full((size, width + 1), PAD, dtype=np.int64)
    labels = np.full((size, width + 1), PAD, dtype=np.int64)
    for row, n in enumerate(lengths):
        digits = 3 + rng.integers(0, 10, size=n)
        src[row, :n] = digits
        reversed_digits = digits[::-1]
        tgt_in[row, 0] = BOS
        tgt_in[row, 1 : n + 1] = reversed_digits
        labels[row, :n] = reversed_digits
        labels[row, n] = EOS
    return src, tgt_in, labels


def expected_output(src_row) -> list[int]:
    digits = [int(i) for i in src_row if int(i) != PAD]
    return digits[::-1] + [EOS]


def held_out(seed: int = 12345, size: int = 500):
    """The evaluation set: sources drawn from a seed the training script never uses."""
    src, _, _ = batch(np.random.default_rng(seed), size)
    return src


def exact_match(generated, src) -> float:
    """Fraction of rows whose generated ids (up to and including <eos>) equal the reversal."""
    hits = 0
    for out_row, src_row in zip(generated, src):
        want = expected_output(src_row)
        got = [int(i) for i in out_row][: len(want)]
        hits += got == want
    return hits / len(src)
