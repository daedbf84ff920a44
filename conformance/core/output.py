"""The result types every backend returns, with the same field and key names.

Attention keys: `encoder.{i}.self`, `decoder.{i}.self`, `decoder.{i}.cross`, each `(B, H, Tq, Tk)`.
Intermediate keys, in forward order:
    (a features source: encoder.conv1, encoder.conv2,) encoder.embeddings, encoder.{i}.self_attn, encoder.{i}.ffn, encoder.output,
    decoder.embeddings, decoder.{i}.self_attn, decoder.{i}.cross_attn, decoder.{i}.ffn,
    decoder.output
where `*.self_attn`, `*.cross_attn` and `*.ffn` are the residual stream after that sublayer (and
its LayerNorm in a post-LN model); `encoder.output` is the memory the decoder attends to.

With a sink (`model(src_ids, tgt_ids, sink=sink)` in every backend), each of those tensors and
then the logits go to `sink(name, tensor)` in `forward_order`, and the returned output keeps none
of them (`logits` is None, `attention` and `intermediates` are empty). NumPy and torch hand each
over as soon as it is computed; JAX as each compiled half (encoder, then decoder) returns, one at a
time, dropping each. So a caller that lets go of each one holds about one tensor at a time instead
of a whole call's (`rosetta check` at length 512, docs/check.md).

This module is framework-free (standard library only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# sink(name, tensor): takes each recorded tensor as soon as it is computed.
TensorSink = Callable[[str, Any], None]


def _shape(value: Any) -> str:
    """`(2, 7, 32) float32` for an array of any framework; the repr of anything else."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return repr(value)
    dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
    return f"({', '.join(str(int(n)) for n in shape)}) {dtype}".rstrip()


def _short_repr(output: Any) -> str:
    """A model output as its tensors' shapes, one line each, as Hugging Face outputs print: the
    values of a tiny model's output alone run to tens of thousands of characters."""
    lines = [f"{type(output).__name__}("]
    for name, value in vars(output).items():
        if isinstance(value, dict):
            inner = "".join(f"\n    {key!r}: {_shape(item)}," for key, item in value.items())
            lines.append(f"  {name}={{{inner}\n  }}," if value else f"  {name}={{}},")
        else:
            lines.append(f"  {name}={_shape(value)},")
    return "\n".join(lines + [")"])


@dataclass(repr=False)
class Encoded:
    """What `model.encode` returns and `model.decode` consumes. `attention` is None when the
    call was made with `return_attention=False` (an empty dict would read as "no attention layers")."""

    memory: Any  # (B, S, D)
    src_mask: Any  # (B, 1|H, 1, S) boolean, True = may attend
    attention: dict[str, Any] | None = field(default_factory=dict)
    intermediates: dict[str, Any] = field(default_factory=dict)

    __repr__ = _short_repr


@dataclass(repr=False)
class ModelOutput:
    """What a model call returns: logits, attention weights and intermediates by name.
    `attention` is None when the call was made with `return_attention=False`.
    Its `repr` shows shapes and dtypes, not values."""

    logits: Any  # (B, T, V)
    attention: dict[str, Any] | None = field(default_factory=dict)
    intermediates: dict[str, Any] = field(default_factory=dict)

    __repr__ = _short_repr


def forward_order(config) -> list[str]:
    """Every tensor a model call records, in the order the forward pass computes them: a features
    source's front end first (each convolution after its GELU, `encoder.conv1` (B, F, D) and
    `encoder.conv2` (B, S, D)), then the embeddings (after the position term)."""
    names = ["encoder.conv1", "encoder.conv2"] if getattr(config, "source", "ids") == "features" else []
    names += ["encoder.embeddings"]
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


class Sink(dict):
    """A record that keeps nothing: `record[name] = tensor` hands the tensor to `sink(name, tensor)`
    at once. Always empty, so a model writes into it exactly as into the dict it replaces."""

    def __init__(self, sink: TensorSink):
        super().__init__()
        self.sink = sink

    def __setitem__(self, name: str, tensor: Any) -> None:
        self.sink(name, tensor)


def record(sink: TensorSink | None = None, carried: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a call records its tensors: a new dict (with a copy of `carried`, what `encode`
    recorded, when `decode` continues it), or, with a sink, a `Sink` that passes each one on."""
    return Sink(sink) if sink is not None else dict(carried or {})


def send_in_order(config, sink: TensorSink, *records: dict[str, Any]) -> None:
    """Hand every tensor of `records` to `sink` in `forward_order`, removing each from its record
    first, so that each is freed once the sink lets go of it (for a backend whose compiled call
    returns its tensors all at once)."""
    where = {name: held for held in records for name in held}
    for name in forward_order(config):
        if name in where:
            sink(name, where[name].pop(name))
