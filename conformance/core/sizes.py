"""The shape of every canonical parameter (the key space `params` describes), how large a config's
parameters are, counted from the config alone, and the refusal of a config whose parameters
could never be held (`TooLargeError`), made before anything is allocated.

Every layer of a stack has the same parameters, so a total is linear in the layer counts and
needs no name built per layer: a hostile file, or a typo, may claim 10**9 layers, and this
answers at once.

This module is framework-free (NumPy, ml_dtypes). `params` imports it (and exports its
`param_shapes`, `param_count` and `param_bytes`), never the other way.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import ml_dtypes  # noqa: F401 (registers the name "bfloat16" with NumPy)
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import TooLargeError
from conformance.core.memory import memory_limit, size_words

Shape = tuple[int, ...]


def _attention_shapes(prefix: str, config: ModelConfig) -> dict[str, Shape]:
    d, inner = config.d_model, config.inner_dim
    shapes: dict[str, Shape] = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
        shapes[f"{prefix}.{proj}.weight"] = (d, inner)
        if config.qkv_bias and (proj != "k_proj" or config.key_bias):
            shapes[f"{prefix}.{proj}.bias"] = (inner,)
    shapes[f"{prefix}.o_proj.weight"] = (inner, d)
    if config.out_proj_bias:
        shapes[f"{prefix}.o_proj.bias"] = (d,)
    return shapes


def _norm_shapes(prefix: str, config: ModelConfig) -> dict[str, Shape]:
    if config.layer_norm_form == "rms":  # T5's RMSNorm: a scale, no bias
        return {f"{prefix}.weight": (config.d_model,)}
    return {f"{prefix}.weight": (config.d_model,), f"{prefix}.bias": (config.d_model,)}


def _linear_shapes(prefix: str, d_in: int, d_out: int, bias: bool) -> dict[str, Shape]:
    return {f"{prefix}.weight": (d_in, d_out), **({f"{prefix}.bias": (d_out,)} if bias else {})}


def _ffn_shapes(prefix: str, config: ModelConfig) -> dict[str, Shape]:
    d, f, bias = config.d_model, config.d_ff, config.ffn_bias
    shapes = _linear_shapes(f"{prefix}.linear1", d, f, bias)
    if config.ffn_glu:
        shapes |= _linear_shapes(f"{prefix}.gate", d, f, bias)
    return shapes | _linear_shapes(f"{prefix}.linear2", f, d, bias)


def param_shapes(config: ModelConfig) -> dict[str, Shape]:
    """Every parameter name of `config` with its shape, in forward order."""
    d = config.d_model
    if config.source == "features":  # Whisper's front end: two convolutions, kernels (3, C_in, C_out)
        shapes: dict[str, Shape] = {"encoder.frontend.conv1.weight": (3, config.n_mels, d),
                                    "encoder.frontend.conv1.bias": (d,),
                                    "encoder.frontend.conv2.weight": (3, d, d),
                                    "encoder.frontend.conv2.bias": (d,)}
    else:
        shapes = {"encoder.embedding.weight": (config.src_vocab_size, d)}
    if config.position == "table":
        shapes["encoder.position.table"] = (config.source_len + config.position_offset, d)
    elif config.position == "relative" and not config.relative_bias_per_layer:
        shapes["encoder.position.relative_bias"] = (config.relative_buckets, config.n_heads)
    if config.embedding_norm:
        shapes |= _norm_shapes("encoder.embedding_norm", config)
    for i in range(config.n_encoder_layers):
        layer = f"encoder.layers.{i}"
        shapes |= _attention_shapes(f"{layer}.self_attn", config)
        if config.relative_bias_per_layer:  # UMT5: a table in every self-attention
            shapes[f"{layer}.self_attn.relative_bias"] = (config.relative_buckets, config.n_heads)
        shapes |= _norm_shapes(f"{layer}.self_attn_norm", config)
        shapes |= _ffn_shapes(f"{layer}.ffn", config)
        shapes |= _norm_shapes(f"{layer}.ffn_norm", config)
    if config.final_encoder_norm:
        shapes |= _norm_shapes("encoder.norm", config)

    if not config.share_embeddings:
        shapes["decoder.embedding.weight"] = (config.tgt_vocab_size, d)
    if config.position == "table":
        shapes["decoder.position.table"] = (config.max_len + config.position_offset, d)
    elif config.position == "relative" and not config.relative_bias_per_layer:
        shapes["decoder.position.relative_bias"] = (config.relative_buckets, config.n_heads)
    if config.embedding_norm:
        shapes |= _norm_shapes("decoder.embedding_norm", config)
    for i in range(config.n_decoder_layers):
        layer = f"decoder.layers.{i}"
        shapes |= _attention_shapes(f"{layer}.self_attn", config)
        if config.relative_bias_per_layer:  # UMT5: a table in every self-attention
            shapes[f"{layer}.self_attn.relative_bias"] = (config.relative_buckets, config.n_heads)
        shapes |= _norm_shapes(f"{layer}.self_attn_norm", config)
        shapes |= _attention_shapes(f"{layer}.cross_attn", config)
        shapes |= _norm_shapes(f"{layer}.cross_attn_norm", config)
        shapes |= _ffn_shapes(f"{layer}.ffn", config)
        shapes |= _norm_shapes(f"{layer}.ffn_norm", config)
    if config.final_decoder_norm:
        shapes |= _norm_shapes("decoder.norm", config)

    if not config.tie_output:
        shapes["output.weight"] = (d, config.tgt_vocab_size)
    if config.output_bias:
        shapes["output.bias"] = (config.tgt_vocab_size,)
    if config.final_logits_bias:
        shapes["final_logits_bias"] = (config.tgt_vocab_size,)
    return shapes

# The fields a parameter's shape is made of. Each is measured against ModelConfig's default to
# find the one that makes a config large (`blamed_field`).
SIZE_FIELDS = ("n_encoder_layers", "n_decoder_layers", "d_model", "d_ff", "d_head", "src_vocab_size",
               "tgt_vocab_size", "max_len", "relative_buckets", "n_mels", "max_source_len")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _values(shape: Shape) -> int:
    """The number of values of a shape, as a Python int (no int64 overflow for hostile sizes)."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _counted(config: ModelConfig, **changes: int) -> ModelConfig:
    """`config` with some sizes changed, to be counted only: never built, so not validated (a
    d_model of 32 need not divide by this config's n_heads to say how large its weights are)."""
    changed = copy.copy(config)
    for name, value in changes.items():
        object.__setattr__(changed, name, value)
    return changed


def _by_stack(config: ModelConfig, size: Callable[[Shape], int]) -> tuple[int, int, int]:
    """(outside the layers, per encoder layer, per decoder layer), each summed by `size`."""
    def total(counted: ModelConfig) -> int:
        return sum(size(shape) for shape in param_shapes(counted).values())

    bare = _counted(config, n_encoder_layers=0, n_decoder_layers=0)
    base = total(bare)
    per_encoder_layer = total(_counted(bare, n_encoder_layers=1)) - base
    per_decoder_layer = total(_counted(bare, n_decoder_layers=1)) - base
    return base, per_encoder_layer, per_decoder_layer


def _total(config: ModelConfig, size: Callable[[Shape], int]) -> int:
    base, encoder, decoder = _by_stack(config, size)
    return base + encoder * config.n_encoder_layers + decoder * config.n_decoder_layers


def param_count(config: ModelConfig) -> int:
    """len(param_shapes(config)), without building it."""
    return _total(config, lambda shape: 1)


def param_bytes(config: ModelConfig, dtype: Any) -> int:
    """The bytes `config`'s parameters take in `dtype` (a NumPy dtype or a name: "bfloat16"),
    counted without building them or their names."""
    return _total(config, _values) * np.dtype(dtype).itemsize


def blamed_field(config: ModelConfig) -> str:
    """The size field that makes `config`'s parameters large: the one whose return to
    ModelConfig's default (where that is smaller) removes the most values. A product is blamed
    on its large factor: d_ff=10**9 in a paper-sized model, not its six layers."""
    values = _total(config, _values)

    def removed(name: str) -> int:
        small = min(getattr(config, name), _DEFAULTS[name])
        return values - _total(_counted(config, **{name: small}), _values)

    return max(SIZE_FIELDS, key=removed)


def check_fits(config: ModelConfig, dtype: Any) -> None:
    """Raise `TooLargeError` when `config`'s parameters in `dtype` could never be held here
    (`memory_limit`), before any is allocated, naming the field that makes them large."""
    limit, source = memory_limit()
    needed = param_bytes(config, dtype)
    if limit is None or needed <= limit:
        return
    field = blamed_field(config)
    raise TooLargeError(field, f"{field}={getattr(config, field)} gives parameters that cannot fit in the memory "
                        f"this process can hold: {param_count(config):,} tensors, {size_words(needed)} in "
                        f"{np.dtype(dtype).name}, more than the {size_words(limit)} of {source}", needed, limit)
