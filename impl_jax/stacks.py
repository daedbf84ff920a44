"""The layers of each stack under `jax.lax.scan`, inside the compiled functions.

`impl_jax/model.py` runs the encoder's and the decoder's layers in a Python loop, as the paper
draws them and as the other two backends do. Traced as written, a 6-layer stack is six copies of
the layer in the program, and XLA compiles each copy: compile time grows with depth. Here the same
layer code (`EncoderLayer.__call__`, `DecoderLayer.__call__`, unchanged) runs once under
`jax.lax.scan`, over the layers' parameters stacked along a new leading axis, so a 6-layer stack
traces and compiles one layer.

Only the compiled functions see this: `impl_jax.compiled` hands a traced model to
`scanned(model)`, which gives its `Encoder` and `Decoder` the scanned `__call__` below (each is
its model.py loop with the loop replaced by the scan). The model the user holds is untouched: its
`nnx.Param`s keep their canonical per-layer names (`encoder.layers.3.ffn.linear1.weight`), the
stacking is a copy made inside the executable, and gradients come back per layer. What the
layers record keeps its per-layer names too: each scanned step writes under a placeholder name,
the scan stacks the records along the layer axis, and they are handed out as `encoder.0.self`,
`encoder.1.self`, ... in the loop's order. Dropout masks are stacked per layer the same way, and
a cached decoding step's per-layer keys and values (impl_jax/decode.py) go through the scan as
its per-layer inputs and outputs.

The numbers are the loop's: each layer's operations are the same, in the same order, on the same
values (tests/backends/jax/test_jax_compile.py compares float64 and float32 results bit for bit).

With `remat`, each layer's step is rematerialised (`jax.checkpoint`): the backward pass recomputes
a layer's activations instead of keeping them, which trades compute for memory in training.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from conformance.core.generation.search import DecoderCache
from conformance.core.dropout import Dropout
from impl_jax import compiled, decode
from impl_jax.model import Decoder, Encoder, encoder_self_mask
from impl_jax.precision import reduction_dtype

PLACEHOLDER = "layer"  # the name a scanned layer records under, before it gets its index


class _Records:
    """What one scanned layer records (its `out`): attention weights and intermediates by name."""

    def __init__(self):
        self.attention: dict[str, Any] = {}
        self.intermediates: dict[str, Any] = {}


def _layer_masks(dropout: Dropout | None, stack: str, count: int):
    """The stack's per-layer dropout masks, {"layer.<site>": (N, B, L, D)}, or None."""
    if dropout is None:
        return None
    sites = [name[len(f"{stack}.0."):] for name in dropout.masks if name.startswith(f"{stack}.0.")]
    return {f"{PLACEHOLDER}.{site}": jnp.stack([dropout.masks[f"{stack}.{i}.{site}"] for i in range(count)])
            for site in sites}


def scan_layers(layers, x: jax.Array, body: Callable, stack: str, out, per_layer=None, *, remat: bool = False):
    """x through every layer of `layers` (an nnx.List of same-shaped layers) by one `lax.scan`.

    `body(layer, x, records, inputs)` runs one layer, recording into `records` under the name
    PLACEHOLDER, and returns (x, outputs); `per_layer` is a pytree of arrays with a leading layer
    axis, sliced for each step as `inputs`. Returns x and the stacked `outputs`; the records go to
    `out` as f"{stack}.{i}...", in the loop's order."""
    if not len(layers):
        return x, None
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]
    stacked = jax.tree.map(lambda *values: jnp.stack(values), *states)  # each leaf (N, ...)
    order: dict[str, list[str]] = {}  # the record names in the order the layer wrote them

    def step(x, xs):
        state, inputs = xs
        records = _Records()
        x, outputs = body(nnx.merge(graphdef, state), x, records, inputs)
        order["attention"], order["intermediates"] = list(records.attention), list(records.intermediates)
        return x, (records.attention, records.intermediates, outputs)

    if remat:
        step = jax.checkpoint(step, prevent_cse=False)
    x, (attention, intermediates, outputs) = jax.lax.scan(step, x, (stacked, per_layer))
    for i in range(len(layers)):
        for kind, records in (("attention", attention), ("intermediates", intermediates)):
            target = getattr(out, kind)
            for name in order[kind]:
                target[f"{stack}.{i}{name[len(PLACEHOLDER):]}"] = records[name][i]
    return x, outputs


class ScannedEncoder(Encoder):
    """`Encoder` with its layers under one `lax.scan` (see the module docstring)."""

    remat = False

    def __call__(self, x: jax.Array, src_mask, out, *, src_real=None, dropout=None, empty_rows=None) -> jax.Array:
        self_mask = encoder_self_mask(self.config, src_mask)  # (B, 1, 1, S) or (B, 1, S, S)
        bias = self.position.score_bias(x.shape[1], x.shape[1], reduction_dtype(x.dtype))  # (1, H, S, S), or None

        def body(layer, x, records, masks):
            drop = None if dropout is None else Dropout(dropout.rate, masks)
            return layer(x, self_mask, PLACEHOLDER, records, bias=bias, src_real=src_real, dropout=drop,
                         empty_rows=empty_rows), None

        x, _ = scan_layers(self.layers, x, body, "encoder", out, _layer_masks(dropout, "encoder", len(self.layers)),
                           remat=self.remat)
        if self.norm is not None:
            x = self.norm(x)
        out.intermediates["encoder.output"] = x
        return x


class ScannedDecoder(Decoder):
    """`Decoder` with its layers under one `lax.scan`; a cached step's per-layer keys and values
    are the scan's per-layer inputs and outputs."""

    remat = False

    def __call__(self, x, memory, tgt_mask, cross_mask, out, *, bias=None, tgt_real=None, src_real=None,
                 dropout=None, empty_rows=None, cache=None) -> jax.Array:
        count = len(self.layers)
        if bias is None:
            bias = self.position.score_bias(x.shape[1], x.shape[1], reduction_dtype(x.dtype))  # (1, H, T, T), or None
        full = None if cache is None else cache[0][0].cache  # decode.layer_caches' DecoderCache
        per_layer = {"masks": _layer_masks(dropout, "decoder", count)}
        if full is not None:
            per_layer["cache"] = tuple(jnp.stack(parts) for parts in
                                       (full.keys, full.values, full.cross_keys, full.cross_values))

        def body(layer, x, records, inputs):
            drop = None if dropout is None else Dropout(dropout.rate, inputs["masks"])
            step_cache, written = None, None
            if full is not None:  # one layer's cache, as decode.layer_caches gives it for layer 0
                keys, values, cross_keys, cross_values = inputs["cache"]
                written = DecoderCache(keys=[keys], values=[values], cross_keys=[cross_keys],
                                       cross_values=[cross_values], tgt_ids=full.tgt_ids,
                                       cross_mask=full.cross_mask, length=full.length)
                step_cache = decode.layer_caches(written)[0]
            x = layer(x, memory, tgt_mask, cross_mask, PLACEHOLDER, records, bias=bias, tgt_real=tgt_real,
                      src_real=src_real, dropout=drop, empty_rows=empty_rows, cache=step_cache)
            return x, None if written is None else (written.keys[0], written.values[0])

        x, written = scan_layers(self.layers, x, body, "decoder", out, per_layer, remat=self.remat)
        if full is not None:  # the keys and values each layer wrote, back into the caller's cache
            full.keys[:] = list(written[0])
            full.values[:] = list(written[1])
        if self.norm is not None:
            x = self.norm(x)
        out.intermediates["decoder.output"] = x
        return x


class RematEncoder(ScannedEncoder):
    remat = True


class RematDecoder(ScannedDecoder):
    remat = True


def scanned(model, *, remat: bool = False):
    """The traced `model` (a copy jit made) with its stacks scanned; None passes through."""
    if model is None or not isinstance(getattr(model, "encoder", None), Encoder):
        return model
    object.__setattr__(model.encoder, "__class__", RematEncoder if remat else ScannedEncoder)
    object.__setattr__(model.decoder, "__class__", RematDecoder if remat else ScannedDecoder)
    return model


compiled.register_scanner(scanned)
