"""Dropout masks, defined once, drawn from one NumPy seed, passed to every backend explicitly.

The paper (section 5.4) applies dropout, P_drop = 0.1, "to the output of each sub-layer, before it
is added to the sub-layer input and normalized", and "to the sums of the embeddings and the
positional encodings in both the encoder and decoder stacks". The sites carry the names of the
intermediates they precede (docs/training.md):

    encoder.embeddings                    (B, S, D)   embeddings + positions
    encoder.{i}.self_attn, encoder.{i}.ffn                (B, S, D)   sublayer outputs
    decoder.embeddings                    (B, T, D)
    decoder.{i}.self_attn, decoder.{i}.cross_attn, decoder.{i}.ffn   (B, T, D)

A mask is boolean, True = keep, of shape (B, L, D). Dropout is inverted, as in PyTorch:

    dropout(x) = x / (1 - rate)   where the mask keeps,   0 where it drops   (a select, not a product)

so a step with dropout is the same computation in every backend. Off by default: a model call
without `dropout=` is bit-identical to one from before dropout existed. Framework-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError

P_DROP = 0.1  # the paper's rate for the base model


@dataclass(frozen=True)
class Dropout:
    """The masks of one training step: `rate` and {site: (B, L, D) boolean, True = keep}."""

    rate: float
    masks: Mapping[str, Any]


def dropout_sites(config: ModelConfig, side: str | None = None) -> list[str]:
    """The site names in forward order; `side` "encoder" or "decoder" selects one stack."""
    encoder = ["encoder.embeddings"] + [f"encoder.{i}.{s}" for i in range(config.n_encoder_layers)
                                        for s in ("self_attn", "ffn")]
    decoder = ["decoder.embeddings"] + [f"decoder.{i}.{s}" for i in range(config.n_decoder_layers)
                                        for s in ("self_attn", "cross_attn", "ffn")]
    return {"encoder": encoder, "decoder": decoder, None: encoder + decoder}[side]


def draw_dropout(config: ModelConfig, batch: int, src_len: int, tgt_len: int, *, rate: float = P_DROP,
                 seed: int = 0) -> Dropout:
    """Every site's mask for a (B, S) source and (B, T) target, from `np.random.default_rng(seed)`
    in site order: keep = uniform[0, 1) >= rate."""
    rate = check_rate(rate)
    rng = np.random.default_rng(seed)
    masks = {}
    for site in dropout_sites(config):
        length = src_len if site.startswith("encoder") else tgt_len
        masks[site] = rng.random((batch, length, config.d_model)) >= rate
    return Dropout(rate, masks)


def check_rate(rate: Any) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating)) or not 0.0 <= float(rate) < 1.0:
        raise InputError("dropout", f"rate must be a float in [0, 1), got {rate!r}")
    return float(rate)


def host_dropout(config: ModelConfig, dropout: Any, side: str, batch: int, length: int) -> Dropout | None:
    """`dropout` checked for one stack's call: a `Dropout` whose masks include every site of
    `side`, each a boolean (B, L, D) array; returned with those masks as host NumPy arrays.
    None stays None (dropout off)."""
    if dropout is None:
        return None
    if not isinstance(dropout, Dropout):
        raise InputError("dropout", f"expected a conformance.core.dropout.Dropout (see draw_dropout), "
                                    f"got {type(dropout).__name__}")
    rate = check_rate(dropout.rate)
    masks = {}
    for site in dropout_sites(config, side):
        if site not in dropout.masks:
            raise InputError("dropout", f"no mask for site {site!r}; expected the sites of dropout_sites(config)")
        mask = dropout.masks[site]
        mask = np.asarray(mask.cpu() if hasattr(mask, "cpu") else mask)
        if mask.dtype != np.bool_:
            raise InputError("dropout", f"mask {site!r} must be boolean (True = keep), got dtype {mask.dtype}")
        if mask.shape != (batch, length, config.d_model):
            raise InputError("dropout", f"mask {site!r} has shape {mask.shape}, expected "
                                        f"(B, L, D) = {(batch, length, config.d_model)}")
        masks[site] = mask
    return Dropout(rate, masks)
