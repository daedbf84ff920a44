"""The model a piece at a time, each piece built from its own parameters (`rosetta check --stream`).

    stem = stream.stem(config, params_without_layers, "float32")   # embeddings, positions, norms, output
    inputs = stream.inputs(stem, src_ids, tgt_ids)                  # masks and score biases, once
    x = stream.embeddings(stem, inputs, "encoder")
    layer = stream.encoder_layer(config, params_of_layer_0, 0, param_dtype="float32")
    x = stream.run_encoder_layer(layer, x, inputs, 0, sink)

Every piece is model.py's own module, called as `Model.encode` and `Model.decode` call it (no
second copy of the math), so a caller that reads each layer's weights just before it runs holds
one layer at a time. The stem is `Model` on the config with no layers: the parameters outside the
layers. The three backends' stream modules have the same functions in the same order.

Each piece runs compiled (`compiled.call`, at the model's full float32 matmul precision). A layer
records under a placeholder name and is renamed after the call, so every layer of a stack is one
executable: a stack costs one compile per (dtype, shape), not one per layer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.output import ModelOutput
from impl_jax import compiled, host
from impl_jax import model as model_py
from impl_jax.model import DecoderLayer, EncoderLayer, Model
from impl_jax.precision import reduction_dtype

# The name a layer records under inside its executable; the caller's sink hears `encoder.{i}` instead.
PLACEHOLDER = "layer"


@dataclass
class Inputs:
    """What every layer of a stack reads besides its input: masks (B, 1|H, Tq, Tk) and the
    self-attention's score bias (T5's relative positions), or None."""

    src_ids: np.ndarray
    tgt_ids: np.ndarray
    encoder_mask: Any
    encoder_bias: Any
    decoder_mask: Any
    cross_mask: Any
    decoder_bias: Any


def stem(config: ModelConfig, params: Mapping[str, np.ndarray], dtype, *, device=None, param_dtype=None,
         code=model_py) -> Model:
    """`Model` on `config` without its layers (n_encoder_layers = n_decoder_layers = 0), built
    from the parameters outside the layers. `code`: the module whose classes run (this backend's
    model.py; the tests pass a copy with a planted bug, tests/breaks.py), for every piece."""
    return code.Model(config.replace(n_encoder_layers=0, n_decoder_layers=0), params, dtype, device=device,
                 param_dtype=param_dtype)


def inputs(stem: Model, src_ids: np.ndarray, tgt_ids: np.ndarray) -> Inputs:
    """The masks and score biases `Model.encode`, `Model.decode` and the stacks build once."""
    config, code = stem.config, _code(stem)
    src_ids = stem._ids("src_ids", src_ids, config.src_vocab_size)
    tgt_ids = stem._ids("tgt_ids", tgt_ids, config.tgt_vocab_size)
    src_mask = code.padding_mask(src_ids, config.pad_id)  # (B, 1, 1, S)
    src_len, tgt_len = src_ids.shape[1], tgt_ids.shape[1]
    scores = reduction_dtype(stem.dtype)  # the dtype attention forms its scores in
    return Inputs(src_ids, tgt_ids, code.encoder_self_mask(config, src_mask),
                  stem.encoder.position.score_bias(src_len, src_len, scores),
                  code.target_mask(config, tgt_ids), src_mask if config.cross_attn_src_mask else None,
                  stem.decoder.position.score_bias(tgt_len, tgt_len, scores))


def array(value: np.ndarray, dtype: str, *, device=None) -> jax.Array:
    """A host array (another model's tensor) as this backend's input, in `dtype` on `device`."""
    return jax.device_put(np.asarray(value).astype(dtype, copy=False), host.resolve_device(device))


def embeddings(stem: Model, inputs: Inputs, side: str) -> jax.Array:
    """`{side}.embeddings` (B, L, D), as `Model.encode` / `Model.decode` embed."""
    ids = inputs.src_ids if side == "encoder" else inputs.tgt_ids
    (x,) = compiled.call(stem, _embed, (ids,), stem.device, side=side)
    return x


def _embed(stem: Model, ids, *, side: str):
    if side == "encoder":
        return (stem.embed(ids, stem.encoder.embedding, stem.encoder.position, stem.encoder.embedding_norm),)
    return (stem.embed(ids, _target_embedding(stem), stem.decoder.position, stem.decoder.embedding_norm),)


def _layer_params(params: Mapping[str, np.ndarray], param_dtype: str, device) -> dict[str, jax.Array]:
    where = host.resolve_device(device)
    return {name: jax.device_put(np.asarray(value).astype(param_dtype, copy=False), where)
            for name, value in params.items()}


def encoder_layer(config: ModelConfig, params: Mapping[str, np.ndarray], index: int, *, device=None,
                  param_dtype: str, code=model_py) -> EncoderLayer:
    """Encoder layer `index` from its own parameters (`encoder.layers.{index}.*`), stored in `param_dtype`."""
    return code.EncoderLayer(config, _layer_params(params, param_dtype, device), f"encoder.layers.{index}")


def decoder_layer(config: ModelConfig, params: Mapping[str, np.ndarray], index: int, *, device=None,
                  param_dtype: str, code=model_py) -> DecoderLayer:
    """Decoder layer `index` from its own parameters (`decoder.layers.{index}.*`), stored in `param_dtype`."""
    return code.DecoderLayer(config, _layer_params(params, param_dtype, device), f"decoder.layers.{index}")


def run_encoder_layer(layer: EncoderLayer, x, inputs: Inputs, index: int, sink: Callable[[str, Any], None]):
    """The layer on x (B, S, D), as `Encoder` runs it; its tensors go to `sink` as `encoder.{index}.*`."""
    x, records = compiled.call(layer, _encoder_layer, (x, inputs.encoder_mask, inputs.encoder_bias),
                               _device_of(x), compute_dtype=x.dtype)
    _send(records, f"encoder.{index}", sink)
    return x


def run_decoder_layer(layer: DecoderLayer, y, memory, inputs: Inputs, index: int, sink: Callable[[str, Any], None]):
    """The layer on y (B, T, D) against `memory` (B, S, D), as `Decoder` runs it."""
    y, records = compiled.call(layer, _decoder_layer, (y, memory, inputs.decoder_mask, inputs.cross_mask,
                                                       inputs.decoder_bias), _device_of(y), compute_dtype=y.dtype)
    _send(records, f"decoder.{index}", sink)
    return y


def _encoder_layer(layer: EncoderLayer, x, mask, bias):
    out = _out()
    return layer(x, mask, PLACEHOLDER, out, bias=bias), out.intermediates


def _decoder_layer(layer: DecoderLayer, y, memory, mask, cross_mask, bias):
    out = _out()
    return layer(y, memory, mask, cross_mask, PLACEHOLDER, out, bias=bias), out.intermediates


def _out() -> ModelOutput:
    """A layer's `out` whose attention weights and intermediates go to one dict, in the order recorded."""
    recorded = {}
    return ModelOutput(logits=None, attention=recorded, intermediates=recorded)


def _send(records: dict[str, Any], name: str, sink: Callable[[str, Any], None]) -> None:
    for key in list(records):  # each handed over, then dropped
        sink(name + key.removeprefix(PLACEHOLDER), records.pop(key))


def _device_of(x: jax.Array) -> jax.Device:
    return next(iter(x.devices()))


def final_norm(stem: Model, x, side: str):
    """`{side}.output`: the stack's final LayerNorm when the config has one, else x itself."""
    norm = stem.encoder.norm if side == "encoder" else stem.decoder.norm
    if norm is None:
        return x
    (x,) = compiled.call(stem, _final_norm, (x,), stem.device, side=side)
    return x


def _final_norm(stem: Model, x, *, side: str):
    return ((stem.encoder.norm if side == "encoder" else stem.decoder.norm)(x),)


def logits(stem: Model, y):
    """The logits (B, T, V) of `decoder.output` y, as `Model.decode` projects it."""
    (out,) = compiled.call(stem, _logits, (y,), stem.device)
    return out


def _logits(stem: Model, y):
    out = stem.output(y, _target_embedding(stem))
    if stem.final_logits_bias is not None:
        out = out + _code(stem).cast(stem.final_logits_bias[...], out.dtype)
    return (out,)


def _target_embedding(stem: Model):
    return stem.encoder.embedding if stem.config.share_embeddings else stem.decoder.embedding


def _code(stem: Model):
    """The module whose classes built `stem` (`stem`'s `code`)."""
    return sys.modules[type(stem).__module__]
