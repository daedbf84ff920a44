"""The small config and the padded batch that the backend tests share."""

from __future__ import annotations

import numpy as np

from conformance import ModelConfig, preset


def small(name: str = "default", **changes) -> ModelConfig:
    """Preset `name` at a size that runs in milliseconds (2+2 layers, d_model 16, max_len 8)."""
    sizes = dict(src_vocab_size=16, tgt_vocab_size=16, d_model=16, n_heads=2, d_ff=24,
                 n_encoder_layers=2, n_decoder_layers=2, max_len=8)
    return preset(name, **{**sizes, **changes})


# Tokens 0 and 1 both appear, so that pad_id 0 and 1 mask different positions; the last source row
# is entirely padding for pad_id 0, so a -inf fill gives NaN rows that must propagate as in the oracle.
SRC = np.array([[3, 4, 5, 1, 0, 0], [6, 7, 8, 9, 10, 1], [0, 0, 0, 0, 0, 0]])
TGT = np.array([[2, 3, 4, 0, 0], [2, 1, 6, 7, 8], [2, 3, 0, 0, 0]])


def features_like(config: ModelConfig, rows: int = 3, length: int = 6) -> np.ndarray:
    """A features source's batch in place of SRC: (rows, n_mels, 2 length) seeded log-mel-like
    values (a features source has no padding), `length` encoder positions."""
    return np.random.default_rng(54).uniform(-1.0, 1.5, size=(rows, config.n_mels, 2 * length))
