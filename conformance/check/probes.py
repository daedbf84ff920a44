"""The batches a check of another system's copy of a model runs it on (`probes`), beside the
float64 oracle: `conformance.check.report.fixed_batch`'s three rows, padded three ways (none,
trailing, all but one token; a features source: a whole window, `window_batch`), and one row as
long as the model takes (min(max_len, source_len), at most LONGEST tokens), which reads the
positions a short row never reaches: a position table's later rows, the relative buckets of
distant positions. Verify-on-write (`conformance.formats.verify`) and the runtime rooms
(`conformance.check.ctranslate2.target.verified`) run them.

May import what `conformance.check` may.
"""

from __future__ import annotations

import numpy as np

from conformance.check.report import ids_of, window_batch
from conformance.core.config import ModelConfig

PROBE = "3 padded rows"
# The long probe's cap, in tokens: a row of max_len tokens costs the oracle (float64) and the
# runtime that much more on a model of 1024 positions; 128 reach every row of the tables the
# tests' and most small models have, and a base-size model's first 128.
LONGEST = 128


def probe(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The padded batch: `fixed_batch`'s three rows. A features source (Whisper's) gets a whole
    window of standard-normal features, 2 x max_source_len frames (`window_batch`): openai-whisper's
    and transformers' encoders take no other length."""
    return window_batch(config)


def long_row(config: ModelConfig, source: int | None = None, target: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One row with no padding, `source` and `target` tokens long (default: as long as the model
    takes, min(max_len, source_len), at most LONGEST): every position a runtime computes up to
    there is read. A features source gets its whole window, as in `probe`."""
    longest = min(config.max_len, config.source_len, LONGEST)
    source, target = source or longest, target or longest
    rng = np.random.default_rng(1)
    tgt = ids_of(rng, config, config.tgt_vocab_size, target)[:1]
    if config.source == "features":
        return rng.standard_normal((1, config.n_mels, 2 * config.source_len)), tgt
    return ids_of(rng, config, config.src_vocab_size, source)[:1], tgt


def probes(config: ModelConfig, source: int | None = None,
           target: int | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The batches every runtime check runs, as (what to call it, src, tgt): `probe`'s padded rows,
    and `long_row` (with its lengths; lower them for a runtime that adds tokens of its own) when it
    reaches further than they do. Two batches, not one padded to the long row: the three short rows
    would cost as much as three long ones."""
    src, tgt = probe(config)
    rows = long_row(config, source, target)
    out = [(PROBE, src, tgt)]
    if rows[1].shape[1] > tgt.shape[1] or (config.source != "features" and rows[0].shape[1] > src.shape[1]):
        out.append((f"a row of {long_words(config, *rows)}", *rows))
    return out


def long_words(config: ModelConfig, src, tgt) -> str:
    if config.source == "features":
        return f"{tgt.shape[1]} target tokens"
    same = src.shape[1] == tgt.shape[1]
    return f"{src.shape[1]} tokens" if same else f"{src.shape[1]} source and {tgt.shape[1]} target tokens"


def probe_names(batches) -> str:
    return " and ".join(what for what, _, _ in batches)
