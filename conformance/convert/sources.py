"""Importing live PyTorch models: what their modules and configs know beyond the tensors.

A state dict cannot tell norm placement, activation, LayerNorm epsilon or the head count; a
module can. These functions read those switches from the model itself, build the state dict in
the matching built-in layout, and hand both to the one layout engine. PyTorch is imported
only here, only when called.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.core.config import ModelConfig
from conformance.convert.engine import convert_arrays
from conformance.convert.planner import merge_switches
from conformance.convert.errors import TensorError
from conformance.convert.arrays import as_numpy
from conformance.convert.readers import as_arrays
from conformance.core.errors import ConfigError

# PyTorch's translation tutorial builds its PositionalEncoding with maxlen=5000.
TUTORIAL_MAX_LEN = 5000


def _activation_name(activation: Any, where: str) -> str:
    """The ModelConfig name of an nn.Transformer activation (a function or a module)."""
    import torch.nn.functional as F
    from torch import nn

    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu-tanh" if activation.approximate == "tanh" else "gelu"
    if activation is F.silu or isinstance(activation, nn.SiLU):
        return "silu"
    raise ConfigError("activation", f"{where} is {activation!r}; only ReLU, GELU (erf or tanh) and SiLU have a ModelConfig name")


def _embedding_weight(module: Any, what: str):
    """The (V, D) table of an nn.Embedding, of a module wrapping exactly one, or a tensor."""
    from torch import nn

    if isinstance(module, nn.Embedding):
        return module.weight
    if isinstance(module, nn.Module):
        found = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if len(found) != 1:
            raise ConfigError(what, f"expected an nn.Embedding or a module holding exactly one; {type(module).__name__} holds {len(found)}")
        return found[0].weight
    if hasattr(module, "shape") and len(module.shape) == 2:
        return module
    raise ConfigError(what, f"expected an nn.Embedding, a module holding one, or a (V, D) tensor; got {type(module).__name__}")


def _key(where: str) -> str:
    """`encoder.layers[0].norm1` -> `encoder.layers.0.norm1`, as the state dict spells it."""
    return where.replace("[", ".").replace("]", "")


def _agree(values: dict[str, Any], name: str, what: str) -> Any:
    """One value read from several places (every layer); a disagreement is an error."""
    if len({repr(v) for v in values.values()}) > 1:
        shown = ", ".join(f"{where}={v!r}" for where, v in list(values.items())[:4])
        raise ConfigError(name, f"differs between layers ({shown}); ModelConfig has one {what}")
    return next(iter(values.values()))


def from_torch_nn_transformer(transformer, src_embedding, tgt_embedding, generator, **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Import a user's model built around `torch.nn.Transformer`.

    Read from the modules: d_model, d_ff, the layer counts (tensor shapes), n_heads, norm_first,
    activation, LayerNorm epsilon, whether final norms exist and whether the generator has a
    bias. What `nn.Transformer` does not have defaults to PyTorch's own translation tutorial
    (`Seq2SeqTransformer`): token embeddings scaled by sqrt(d_model), the interleaved sinusoid up
    to max_len=5000, target padding masked on the keys, `-inf` for masked scores (what a boolean
    mask means inside nn.MultiheadAttention), padding id 1. Each of those is an override, e.g.
    `pad_id=0, scale_embedding=False`.

    `src_embedding`, `tgt_embedding`: `nn.Embedding`s (or modules holding exactly one, like the
    tutorial's `TokenEmbedding`); `generator`: the `nn.Linear` that gives the logits.
    """
    import torch
    from torch import nn

    if not isinstance(transformer, nn.Transformer):
        raise TypeError(f"expected a torch.nn.Transformer, got {type(transformer).__name__}")
    if not isinstance(generator, nn.Linear):
        raise TypeError(f"generator must be an nn.Linear, got {type(generator).__name__}")
    enc_layers = list(getattr(transformer.encoder, "layers", []))
    dec_layers = list(getattr(transformer.decoder, "layers", []))
    layers = {f"encoder.layers[{i}]": l for i, l in enumerate(enc_layers)}
    layers |= {f"decoder.layers[{i}]": l for i, l in enumerate(dec_layers)}
    norms = {f"{where}.{n}": getattr(layer, n) for where, layer in layers.items() for n in ("norm1", "norm2", "norm3") if hasattr(layer, n)}
    for stack in ("encoder", "decoder"):
        if getattr(transformer, stack).norm is not None:
            norms[f"{stack}.norm"] = getattr(transformer, stack).norm
    # nn.Transformer(bias=False) drops every bias, LayerNorm's included: ModelConfig's norms
    # always have one, so such a model is refused by name rather than padded with zeros.
    for where, norm in norms.items():
        if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
            raise TensorError(f"transformer.{_key(where)}.bias", "is missing: a LayerNorm without weight and bias "
                              "(nn.Transformer(bias=False)) cannot be expressed by ModelConfig")
    for where, layer in layers.items():
        for name in ("self_attn", "multihead_attn"):
            attn = getattr(layer, name, None)
            if attn is not None and (attn.in_proj_weight is None or attn.in_proj_bias is None or attn.out_proj.bias is None):
                raise TensorError(f"transformer.{_key(where)}.{name}.in_proj_bias", "is missing: attention without packed "
                                  "projections and biases is not what the torch-nn-transformer layout describes")

    read: dict[str, Any] = {}
    if layers:
        read["norm_placement"] = "pre" if _agree({w: l.norm_first for w, l in layers.items()}, "norm_placement", "norm placement") else "post"
        read["activation"] = _agree({w: _activation_name(l.activation, f"{w}.activation") for w, l in layers.items()}, "activation", "activation")
        read["n_heads"] = _agree({w: l.self_attn.num_heads for w, l in layers.items()}, "n_heads", "head count")
    else:
        read["norm_placement"] = "post"  # no layer to place a norm in: it changes nothing, and the layout requires it
    if norms:
        read["layer_norm_eps"] = _agree({w: float(n.eps) for w, n in norms.items()}, "layer_norm_eps", "epsilon")
    read["final_encoder_norm"] = transformer.encoder.norm is not None
    read["final_decoder_norm"] = transformer.decoder.norm is not None
    read["output_bias"] = generator.bias is not None
    batch_first = bool(layers and next(iter(layers.values())).self_attn.batch_first)

    state = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    state["src_tok_emb.embedding.weight"] = _embedding_weight(src_embedding, "src_embedding")
    state["tgt_tok_emb.embedding.weight"] = _embedding_weight(tgt_embedding, "tgt_embedding")
    state["generator.weight"] = generator.weight
    if generator.bias is not None:
        state["generator.bias"] = generator.bias
    with torch.no_grad():
        arrays = as_arrays(state)
    values = merge_switches(read, {"max_len": TUTORIAL_MAX_LEN}, overrides, "torch.nn.Transformer")
    notes = {"source": "torch.nn.Transformer", "batch_first": str(batch_first)}
    result = convert_arrays(arrays, "torch-nn-transformer", notes=notes, **values)
    return result.config, result.params


# What `rosetta generate` reads from a checkpoint's "generation" note (a JSON object), named as in
# Hugging Face's generation_config.json.
# Each transformers family's layout lists its own (`[hf] generation`); these are Marian's.
GENERATION_KEYS = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "forced_eos_token_id",
                   "num_beams", "length_penalty", "max_length", "max_new_tokens", "bad_words_ids", "min_length",
                   "min_new_tokens", "early_stopping")


def hf_generation_note(generation_config, keys=GENERATION_KEYS) -> str:
    """A transformers GenerationConfig's special ids and decoding defaults (`keys`) as the JSON
    text of the checkpoint note "generation" ("" when there is none)."""
    import json

    if generation_config is None:
        return ""
    values = {key: getattr(generation_config, key, None) for key in keys}
    # A setting that is no JSON value (constraints, a sequence_bias keyed by tuples: fields that
    # `generate` does not apply, named in the converter's warning) is kept as its repr.
    def as_json(value):
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return repr(value)
        return value

    return json.dumps({key: as_json(value) for key, value in values.items() if value is not None}, sort_keys=True)


def from_hf(model, **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Import a live transformers model of any family with a built-in `[hf]` layout (MarianMTModel,
    BartForConditionalGeneration, MBartForConditionalGeneration, M2M100ForConditionalGeneration,
    PegasusForConditionalGeneration, T5ForConditionalGeneration, MT5ForConditionalGeneration),
    every size and switch read from `model.config`.

    `model.config.model_type` picks the layout, whose `[hf]` table says which config field gives
    what (`conformance.convert.hf_config`), exactly as for a folder's config.json; its
    generation_config is recorded in the checkpoint's "generation" note. A config the layout
    cannot express (an untied lm_head, unequal encoder and decoder head counts) is a ConfigError
    naming the field; `overrides` may add switches but not contradict the config.
    """
    import json

    import torch

    from conformance.convert.hf_folder import hf_layout, record_generation

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(model, "state_dict"):
        raise TypeError(f"expected a transformers model, got {type(model).__name__}")
    hf = config.to_dict()
    where = f"{type(model).__name__}.config"
    layout = hf_layout(hf, where)
    if type(model).__name__ not in layout.hf.architectures:
        raise TypeError(f"the {layout.name} layout describes {', '.join(layout.hf.architectures)} (with its lm_head), "
                        f"not {type(model).__name__}")
    read = layout.hf.read(hf, where)
    with torch.no_grad():
        arrays = {k: as_numpy(v, k) for k, v in model.state_dict().items()}
    values = merge_switches(read, {}, overrides, "config")
    notes = {"source": f"transformers {type(model).__name__}",
             "name_or_path": str(getattr(config, "_name_or_path", "") or "")}
    generation = hf_generation_note(getattr(model, "generation_config", None), layout.hf.generation)
    result = convert_arrays(arrays, layout, notes=notes, **values)
    record_generation(result, layout, json.loads(generation) if generation else {}, type(model).__name__)
    return result.config, result.params


def from_hf_marian(model, **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Import a Hugging Face `MarianMTModel` (from transformers): `from_hf` for Marian only.

    From `model.config`: d_model, the head count (equal for encoder and decoder), the layer
    counts, the FFN width, max_position_embeddings, activation_function, scale_embedding and
    pad_token_id. Released Marian models share the source and target embedding and tie the
    output to it (`share_encoder_decoder_embeddings`, `tie_word_embeddings`); models that do not
    are refused with a ConfigError, since the hf-marian layout describes the shared form.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "marian" or not hasattr(model, "lm_head"):
        raise TypeError(f"expected a transformers MarianMTModel, got {type(model).__name__}")
    return from_hf(model, **overrides)
