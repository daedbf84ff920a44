"""The model a piece at a time, each piece built from its own parameters (`rosetta check --stream`).

    stem = stream.stem(config, params_without_layers, "float64")   # embeddings, positions, norms, output
    inputs = stream.inputs(stem, src_ids, tgt_ids)                  # masks and score biases, once
    x = stream.embeddings(stem, inputs, "encoder")
    layer = stream.encoder_layer(config, params_of_layer_0, 0, param_dtype="float32")
    x = stream.run_encoder_layer(layer, x, inputs, 0, sink)

Every piece is model.py's own module, called as `Model.encode` and `Model.decode` call it (no
second copy of the math), so a caller that reads each layer's weights just before it runs holds
one layer at a time. The stem is `Model` on the config with no layers: the parameters outside the
layers. The three backends' stream modules have the same functions in the same order.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.output import ModelOutput, record
from impl_numpy import model as model_py
from impl_numpy.model import DecoderLayer, EncoderLayer, Model

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
    return Inputs(src_ids, tgt_ids, code.encoder_self_mask(config, src_mask),
                  stem.encoder.position.score_bias(src_len, src_len, stem.dtype),
                  code.target_mask(config, tgt_ids), src_mask if config.cross_attn_src_mask else None,
                  stem.decoder.position.score_bias(tgt_len, tgt_len, stem.dtype))


def array(value: np.ndarray, dtype: str, *, device=None) -> np.ndarray:
    """A host array (another model's tensor) as this backend's input, in `dtype` on `device`."""
    return np.asarray(value).astype(dtype, copy=False)


def embeddings(stem: Model, inputs: Inputs, side: str) -> np.ndarray:
    """`{side}.embeddings` (B, L, D), as `Model.encode` / `Model.decode` embed."""
    if side == "encoder":
        return stem.embed(inputs.src_ids, stem.encoder.embedding, stem.encoder.position, stem.encoder.embedding_norm)
    return stem.embed(inputs.tgt_ids, _target_embedding(stem), stem.decoder.position, stem.decoder.embedding_norm)


def _layer_params(params: Mapping[str, np.ndarray], param_dtype: str) -> dict[str, np.ndarray]:
    return {name: np.asarray(value).astype(param_dtype, copy=False) for name, value in params.items()}


def encoder_layer(config: ModelConfig, params: Mapping[str, np.ndarray], index: int, *, device=None,
                  param_dtype: str, code=model_py) -> EncoderLayer:
    """Encoder layer `index` from its own parameters (`encoder.layers.{index}.*`), stored in `param_dtype`."""
    return code.EncoderLayer(config, _layer_params(params, param_dtype), f"encoder.layers.{index}")


def decoder_layer(config: ModelConfig, params: Mapping[str, np.ndarray], index: int, *, device=None,
                  param_dtype: str, code=model_py) -> DecoderLayer:
    """Decoder layer `index` from its own parameters (`decoder.layers.{index}.*`), stored in `param_dtype`."""
    return code.DecoderLayer(config, _layer_params(params, param_dtype), f"decoder.layers.{index}")


def run_encoder_layer(layer: EncoderLayer, x, inputs: Inputs, index: int, sink: Callable[[str, Any], None]):
    """The layer on x (B, S, D), as `Encoder` runs it; its tensors go to `sink` as `encoder.{index}.*`."""
    return layer(x, inputs.encoder_mask, f"encoder.{index}", _out(sink), bias=inputs.encoder_bias)


def run_decoder_layer(layer: DecoderLayer, y, memory, inputs: Inputs, index: int, sink: Callable[[str, Any], None]):
    """The layer on y (B, T, D) against `memory` (B, S, D), as `Decoder` runs it."""
    return layer(y, memory, inputs.decoder_mask, inputs.cross_mask, f"decoder.{index}", _out(sink),
                 bias=inputs.decoder_bias)


def _out(sink: Callable[[str, Any], None]) -> ModelOutput:
    """A layer's `out` that hands each tensor to `sink` as the layer records it."""
    return ModelOutput(logits=None, attention=record(sink), intermediates=record(sink))


def final_norm(stem: Model, x, side: str):
    """`{side}.output`: the stack's final LayerNorm when the config has one, else x itself."""
    norm = stem.encoder.norm if side == "encoder" else stem.decoder.norm
    return x if norm is None else norm(x)


def logits(stem: Model, y):
    """The logits (B, T, V) of `decoder.output` y, as `Model.decode` projects it."""
    out = stem.output(y, _target_embedding(stem))
    if stem.final_logits_bias is not None:
        out = out + _code(stem).cast(stem.final_logits_bias, out.dtype)
    return out


def _target_embedding(stem: Model):
    return stem.encoder.embedding if stem.config.share_embeddings else stem.decoder.embedding


def _code(stem: Model):
    """The module whose classes built `stem` (`stem`'s `code`)."""
    return sys.modules[type(stem).__module__]
