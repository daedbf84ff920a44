"""The result types every backend returns, with the same field and key names.

Attention keys: `encoder.{i}.self`, `decoder.{i}.self`, `decoder.{i}.cross`, each `(B, H, Tq, Tk)`.
Intermediate keys, in forward order:
    encoder.embeddings, encoder.{i}.self_attn, encoder.{i}.ffn, encoder.output,
    decoder.embeddings, decoder.{i}.self_attn, decoder.{i}.cross_attn, decoder.{i}.ffn,
    decoder.output
where `*.self_attn`, `*.cross_attn` and `*.ffn` are the residual stream after that sublayer (and
its LayerNorm in a post-LN model); `encoder.output` is the memory the decoder attends to.

This module is framework-free (standard library only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Encoded:
    """What `model.encode` returns and `model.decode` consumes. `attention` is None when the
    call was made with `return_attention=False` (an empty dict would read as "no attention layers")."""

    memory: Any  # (B, S, D)
    src_mask: Any  # (B, 1|H, 1, S) boolean, True = may attend
    attention: dict[str, Any] | None = field(default_factory=dict)
    intermediates: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelOutput:
    """What a model call returns: logits, attention weights and intermediates by name.
    `attention` is None when the call was made with `return_attention=False`."""

    logits: Any  # (B, T, V)
    attention: dict[str, Any] | None = field(default_factory=dict)
    intermediates: dict[str, Any] = field(default_factory=dict)


def forward_order(config) -> list[str]:
    """Every tensor a model call records, in the order the forward pass computes them."""
    names = ["encoder.embeddings"]
    for i in range(config.n_encoder_layers):
        names += [f"encoder.{i}.self", f"encoder.{i}.self_attn", f"encoder.{i}.ffn"]
    names += ["encoder.output", "decoder.embeddings"]
    for i in range(config.n_decoder_layers):
        names += [f"decoder.{i}.self", f"decoder.{i}.self_attn", f"decoder.{i}.cross",
                  f"decoder.{i}.cross_attn", f"decoder.{i}.ffn"]
    names += ["decoder.output", "logits"]
    return names


def tensors_of(output) -> dict[str, Any]:
    """A model output as one flat name -> tensor mapping (attention, intermediates, logits)."""
    return {**(output.attention or {}), **output.intermediates, "logits": output.logits}
