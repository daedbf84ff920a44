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
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from conformance.core.config import ModelConfig
from conformance.core.output import ModelOutput, record
from impl_torch.arrays import resolve_device, to_torch
from impl_torch import model as model_py
from impl_torch.model import DecoderLayer, EncoderLayer, Model


@dataclass
class Inputs:
    """What every layer of a stack reads besides its input: masks (B, 1|H, Tq, Tk) and the
    self-attention's score bias (T5's relative positions), or None."""

    src_ids: torch.Tensor
    tgt_ids: torch.Tensor
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


def array(value: np.ndarray, dtype: str, *, device=None) -> torch.Tensor:
    """A host array (another model's tensor) as this backend's input, in `dtype` on `device`."""
    return torch.from_numpy(np.ascontiguousarray(value)).to(device=resolve_device(device), dtype=getattr(torch, dtype))


def embeddings(stem: Model, inputs: Inputs) -> torch.Tensor:
    """`encoder.embeddings` (B, S, D), as `Model.encode` embeds."""
    return stem.embed(inputs.src_ids, stem.encoder.embedding, stem.encoder.position, stem.encoder.embedding_norm)


def _filled(layer: torch.nn.Module, params: Mapping[str, np.ndarray], prefix: str, param_dtype: str):
    """`layer` with the checkpoint's values copied in, key for key (`Model`'s strict copy)."""
    state = layer.state_dict()
    given = {name.removeprefix(prefix + "."): value for name, value in params.items()}
    if state.keys() != given.keys():
        raise RuntimeError(f"{prefix}'s parameters differ from the checkpoint's: {sorted(state.keys() ^ given.keys())}")
    for key, value in given.items():
        state[key].copy_(to_torch(value, param_dtype))
    return layer.eval()


def encoder_layer(config: ModelConfig, params: Mapping[str, np.ndarray], index: int, *, device=None,
                  param_dtype: str, code=model_py) -> EncoderLayer:
    """Encoder layer `index` from its own parameters (`encoder.layers.{index}.*`), stored in `param_dtype`."""
    with torch.device(resolve_device(device)):
        layer = code.EncoderLayer(config, getattr(torch, param_dtype))
    return _filled(layer, params, f"encoder.layers.{index}", param_dtype)


def decoder_layer(config: ModelConfig, params: Mapping[str, np.ndarray], index: int, *, device=None,
                  param_dtype: str, code=model_py) -> DecoderLayer:
    """Decoder layer `index` from its own parameters (`decoder.layers.{index}.*`), stored in `param_dtype`."""
    with torch.device(resolve_device(device)):
        layer = code.DecoderLayer(config, getattr(torch, param_dtype))
    return _filled(layer, params, f"decoder.layers.{index}", param_dtype)


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


def middle(stem: Model, x, inputs: Inputs):
    """(`encoder.output`, `decoder.embeddings`): `Encoder.finish` of x after the encoder's last
    layer, and the decoder's embeddings as `Model.decode` embeds."""
    memory = stem.encoder.finish(x)
    y = stem.embed(inputs.tgt_ids, stem.target_embedding, stem.decoder.position, stem.decoder.embedding_norm,
                   combine=stem.decoder.embedding_sum)
    return memory, y


def end(stem: Model, y, out=None):
    """(`decoder.output`, logits (B, T, V)): `Decoder.finish` of y after the decoder's last layer,
    and `Model.logits` of `out` (another model's `decoder.output`), or of that output."""
    finished = stem.decoder.finish(y)
    return finished, stem.logits(finished if out is None else out)


def _code(stem: Model):
    """The module whose classes built `stem` (`stem`'s `code`)."""
    return sys.modules[type(stem).__module__]
