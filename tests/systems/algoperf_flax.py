"""MLCommons AlgoPerf's WMT Transformer in Flax linen (`algoperf/workloads/wmt/wmt_jax/models.py`),
re-created for inference with its workload variants.

The structure, parameter names and numerics of that `Transformer`, written again from its
published description (no dropout, no packed examples, no decoding cache):

- Flax `examples/wmt` (see `flax_wmt.py`) with `TransformerConfig.pre_ln`, `glu`, `activation`
  and `attention_temp`; always one `shared_embedding`, always logits through its `attend` on the
  decoder output cast to float32, divided by sqrt(D) (no `logitdense`);
- pre-LN blocks with final norms `encoder_layernorm` / `encoderdecoder_layernorm`, or post-LN
  blocks (`LN(x + sublayer(x))`, the same `LayerNorm_0..2` names) without final norms;
- `nn.MultiHeadDotProductAttention(use_bias=False)` called as `(attention_temp * x, x)`: the
  temperature scales the query input only;
- `MlpBlock`: `Dense_0` activated; with `glu`, `Dense_1` the linear gate multiplied in and
  `Dense_2` the output; otherwise `Dense_1` the output;
- masks and `shift_right` as in examples/wmt; the t2t sinusoid computed by NumPy in float64 and
  stored in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from flax import linen as nn

from systems.flax_wmt import shift_right, sinusoid_table

ACTIVATIONS = {"relu": nn.relu, "tanh": nn.tanh}


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 32
    dtype: Any = jnp.float32
    emb_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 32
    mlp_dim: int = 48
    max_len: int = 256
    activation: str = "relu"
    glu: bool = False
    attention_temp: float = 1.0
    pre_ln: bool = True


class AddPositionEmbs(nn.Module):
    config: TransformerConfig

    def __call__(self, x):
        table = jnp.asarray(sinusoid_table(self.config.max_len, x.shape[-1]))
        return x + table[:, : x.shape[1], :]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        c = self.config
        x = ACTIVATIONS[c.activation](nn.Dense(c.mlp_dim, dtype=c.dtype)(inputs))
        if c.glu:
            x = x * nn.Dense(c.mlp_dim, dtype=c.dtype)(inputs)
        return nn.Dense(inputs.shape[-1], dtype=c.dtype)(x)


def attention(c: TransformerConfig):
    return nn.MultiHeadDotProductAttention(num_heads=c.num_heads, dtype=c.dtype, qkv_features=c.qkv_dim,
                                           use_bias=False, broadcast_dropout=False, dropout_rate=0.0,
                                           deterministic=True)


class Encoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, encoder_mask):
        c = self.config
        x = nn.LayerNorm(dtype=c.dtype)(inputs) if c.pre_ln else inputs
        x = attention(c)(c.attention_temp * x, x, mask=encoder_mask)
        x = x + inputs
        if not c.pre_ln:
            x = nn.LayerNorm(dtype=c.dtype)(x)
        y = nn.LayerNorm(dtype=c.dtype)(x) if c.pre_ln else x
        y = MlpBlock(c)(y)
        return x + y if c.pre_ln else nn.LayerNorm(dtype=c.dtype)(x + y)


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, targets, encoded, decoder_mask, encoder_decoder_mask):
        c = self.config
        x = nn.LayerNorm(dtype=c.dtype)(targets) if c.pre_ln else targets
        x = attention(c)(c.attention_temp * x, x, mask=decoder_mask)
        x = x + targets
        if not c.pre_ln:
            x = nn.LayerNorm(dtype=c.dtype)(x)
        y = nn.LayerNorm(dtype=c.dtype)(x) if c.pre_ln else x
        y = attention(c)(c.attention_temp * y, encoded, mask=encoder_decoder_mask)
        y = y + x
        if not c.pre_ln:
            y = nn.LayerNorm(dtype=c.dtype)(y)
        z = nn.LayerNorm(dtype=c.dtype)(y) if c.pre_ln else y
        z = MlpBlock(c)(z)
        return y + z if c.pre_ln else nn.LayerNorm(dtype=c.dtype)(y + z)


class Encoder(nn.Module):
    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, inputs, encoder_mask):
        c = self.config
        x = self.shared_embedding(inputs.astype("int32"))
        x = AddPositionEmbs(c, name="posembed_input")(x).astype(c.dtype)
        for i in range(c.num_layers):
            x = Encoder1DBlock(c, name=f"encoderblock_{i}")(x, encoder_mask)
        return nn.LayerNorm(dtype=c.dtype, name="encoder_layernorm")(x) if c.pre_ln else x


class Decoder(nn.Module):
    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, encoded, targets, decoder_mask, encoder_decoder_mask):
        c = self.config
        y = self.shared_embedding(shift_right(targets.astype("int32")))
        y = AddPositionEmbs(c, name="posembed_output")(y).astype(c.dtype)
        for i in range(c.num_layers):
            y = EncoderDecoder1DBlock(c, name=f"encoderdecoderblock_{i}")(y, encoded, decoder_mask, encoder_decoder_mask)
        y = nn.LayerNorm(dtype=c.dtype, name="encoderdecoder_layernorm")(y) if c.pre_ln else y
        logits = self.shared_embedding.attend(y.astype(jnp.float32))
        return logits / jnp.sqrt(y.shape[-1])


class Transformer(nn.Module):
    config: TransformerConfig

    def setup(self):
        c = self.config
        self.shared_embedding = nn.Embed(num_embeddings=c.vocab_size, features=c.emb_dim,
                                         embedding_init=nn.initializers.normal(stddev=1.0))
        self.encoder = Encoder(c, shared_embedding=self.shared_embedding)
        self.decoder = Decoder(c, shared_embedding=self.shared_embedding)

    def encode(self, inputs):
        return self.encoder(inputs, nn.make_attention_mask(inputs > 0, inputs > 0, dtype=self.config.dtype))

    def decode(self, encoded, inputs, targets):
        dtype = self.config.dtype
        decoder_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0, dtype=dtype),
                                        nn.make_causal_mask(targets, dtype=dtype))
        encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0, dtype=dtype)
        return self.decoder(encoded, targets, decoder_mask, encoder_decoder_mask).astype(dtype)

    def __call__(self, inputs, targets):
        return self.decode(self.encode(inputs), inputs, targets)


# The workload variants (algoperf/workloads/wmt/wmt_jax/workload.py), as TransformerConfig fields.
VARIANTS = {
    "base": dict(),
    "post-ln": dict(pre_ln=False),
    "glu-tanh": dict(glu=True, activation="tanh"),
    "attention-temp": dict(attention_temp=4.0),
}


def config(variant: str = "base", **sizes) -> TransformerConfig:
    return TransformerConfig(**{**sizes, **VARIANTS[variant]})


def init(c: TransformerConfig, seed: int = 0, length: int = 4) -> dict:
    """Random `variables["params"]` (nested NumPy arrays), biases and LayerNorm scales randomised
    too, so that a wrong mapping of any of them shows in the logits."""
    dummy = jnp.ones((1, length), jnp.int32)
    params = Transformer(c).init(jax.random.PRNGKey(seed), dummy, dummy)["params"]
    rng = np.random.default_rng(seed)

    def randomise(path, x):
        x = np.asarray(x)
        name = path[-1].key
        if name == "bias":
            return rng.normal(0, 0.1, x.shape).astype(x.dtype)
        if name == "scale":
            return (1 + rng.normal(0, 0.1, x.shape)).astype(x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(randomise, jax.tree_util.tree_map(np.asarray, params))


def apply(c: TransformerConfig, params: dict, inputs, targets) -> np.ndarray:
    """`Transformer(c).apply({"params": params}, inputs, targets)` as a NumPy array."""
    return np.asarray(Transformer(c).apply({"params": params}, jnp.asarray(inputs), jnp.asarray(targets)))
