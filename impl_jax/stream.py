"""The model a piece at a time, each piece built from its own parameters (`rosetta check --stream`).

    stem = stream.stem(config, params_without_layers, "float32")   # embeddings, positions, norms, output
    inputs = stream.inputs(stem, src_ids, tgt_ids)                  # masks and score biases, once
    x = stream.embeddings(stem, inputs)                             # encoder.embeddings
    layer = stream.encoder_layer(config, params_of_layer_0, 0, param_dtype="float32")
    x = stream.run_encoder_layer(layer, x, inputs, 0, sink)
    memory, y = stream.middle(stem, x, inputs)                      # encoder.output, decoder.embeddings
    ...                                                             # each decoder layer likewise
    out, logits = stream.end(stem, y)                               # decoder.output, logits

Every piece is model.py's own module, called as `Model.encode` and `Model.decode` call it, and
the steps around the layers are model.py's named steps that those call too (`Model.ids`,
`Model.make_masks`, `encoder_self_mask`, `Model.cross_mask`, `Encoder.score_bias` /
`Decoder.score_bias`, `Model.target_embedding`, `Encoder.finish` / `Decoder.finish`,
`Model.logits`): this module only orders them, so a caller that reads each layer's weights just
before it runs holds one layer at a time and runs no second copy of the model. The stem is
`Model` on the config with no layers: the parameters outside the layers. The three backends'
stream modules have the same functions in the same order.

Each piece runs compiled (`compiled.call`, at the model's full float32 matmul precision). A layer
records under a placeholder name and is renamed after the call, so every layer of a stack is one
executable: a stack costs one compile per (dtype, shape), not one per layer. The stem's steps
between the stacks are one executable each (`middle`: the encoder's final norm and the decoder's
embeddings; `end`: the decoder's final norm and the logits), so a model costs five compiles per
(dtype, shapes): the embeddings, an encoder layer, the middle, a decoder layer, the end.
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
    config = stem.config
    src_ids = stem.ids("src_ids", src_ids, config.src_vocab_size)
    tgt_ids = stem.ids("tgt_ids", tgt_ids, config.tgt_vocab_size)
    src_mask, tgt_mask = stem.make_masks(src_ids, tgt_ids)  # (B, 1, 1, S), (B, 1, T, T)
    return Inputs(src_ids, tgt_ids, _code(stem).encoder_self_mask(config, src_mask),
                  stem.encoder.score_bias(src_ids.shape[1], stem.dtype), tgt_mask, stem.cross_mask(src_mask),
                  stem.decoder.score_bias(tgt_ids.shape[1], stem.dtype))


def array(value: np.ndarray, dtype: str, *, device=None) -> jax.Array:
    """A host array (another model's tensor) as this backend's input, in `dtype` on `device`."""
    return jax.device_put(np.asarray(value).astype(dtype, copy=False), host.resolve_device(device))


def embeddings(stem: Model, inputs: Inputs) -> jax.Array:
    """`encoder.embeddings` (B, S, D), as `Model.encode` embeds."""
    (x,) = compiled.call(stem, _embed, (inputs.src_ids,), stem.device)
    return x


def _embed(stem: Model, ids):
    return (stem.embed(ids, stem.encoder.embedding, stem.encoder.position, stem.encoder.embedding_norm),)


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


def middle(stem: Model, x, inputs: Inputs):
    """(`encoder.output`, `decoder.embeddings`): `Encoder.finish` of x after the encoder's last
    layer, and the decoder's embeddings as `Model.decode` embeds; one executable."""
    return compiled.call(stem, _middle, (x, inputs.tgt_ids), stem.device)


def _middle(stem: Model, x, tgt_ids):
    y = stem.embed(tgt_ids, stem.target_embedding, stem.decoder.position, stem.decoder.embedding_norm,
                   combine=stem.decoder.embedding_sum)
    return stem.encoder.finish(x), y


def end(stem: Model, y, out=None):
    """(`decoder.output`, logits (B, T, V)): `Decoder.finish` of y after the decoder's last layer,
    and `Model.logits` of `out` (another model's `decoder.output`), or of that output; one executable."""
    return compiled.call(stem, _end, (y,) if out is None else (y, out), stem.device)


def _end(stem: Model, y, out=None):
    finished = stem.decoder.finish(y)
    return finished, stem.logits(finished if out is None else out)


def _code(stem: Model):
    """The module whose classes built `stem` (`stem`'s `code`)."""
    return sys.modules[type(stem).__module__]
