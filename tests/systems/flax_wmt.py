"""P3, Flax `examples/wmt` (variants.md): the linen encoder-decoder, re-created for inference.

The structure, parameter names and numerics of `examples/wmt/models.py`, written again from its
description (no dropout, no packed examples, no decoding cache):

- pre-LN blocks with `nn.LayerNorm` at its defaults (eps 1e-6, fast variance), final norms
  `encoder_norm` and `encoderdecoder_norm`;
- `nn.MultiHeadDotProductAttention(use_bias=False)`: `query|key|value.kernel` (D, H, K) and
  `out.kernel` (H, K, D); masked scores at `finfo(dtype).min`;
- `MlpBlock`: `Dense_0` (D, F) + bias, ReLU, `Dense_1` (F, D) + bias;
- token embeddings `nn.Embed` (unscaled), or one `shared_embedding` for both stacks; the t2t
  sinusoid `sinusoidal_init`, a float32 NumPy table added as is;
- the decoder embeds `shift_right(targets)` and builds its masks from the unshifted targets
  (`targets > 0` on both sides, AND causal); cross-attention masks targets (queries) and inputs
  (keys); the encoder masks inputs on both sides;
- logits from `logitdense` (Dense with bias), or, with `logits_via_embedding`, through the
  embedding's `attend` on the decoder output cast to float32, divided by sqrt(D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from flax import linen as nn


@dataclass(frozen=True)
class WmtConfig:
    vocab_size: int
    output_vocab_size: int
    share_embeddings: bool = False
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 32
    mlp_dim: int = 64
    max_len: int = 64


def shift_right(x):
    """Prepend a 0 on the length axis and drop the last id: the decoder's input for `targets`."""
    return jnp.pad(x, ((0, 0), (1, 0)), constant_values=0)[:, :-1]


def sinusoid_table(max_len: int, d: int) -> np.ndarray:
    """(1, max_len, d) float32: sin over the first half, cos over the second, timescales spaced
    over d/2 - 1 intervals; computed in float64 by NumPy and stored into float32."""
    half = d // 2
    table = np.zeros((max_len, d), dtype=np.float32)
    position = np.arange(max_len)[:, None]
    freq = np.exp(np.arange(half) * (-np.log(10000.0) / (half - 1)))
    table[:, :half] = np.sin(position * freq)
    table[:, half : 2 * half] = np.cos(position * freq)
    return table[None]


class AddPositionEmbs(nn.Module):
    config: WmtConfig

    def __call__(self, x):
        table = jnp.asarray(sinusoid_table(self.config.max_len, x.shape[-1]))
        return x + table[:, : x.shape[1], :]


class MlpBlock(nn.Module):
    config: WmtConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        y = nn.relu(nn.Dense(c.mlp_dim, dtype=c.dtype)(x))
        return nn.Dense(x.shape[-1], dtype=c.dtype)(y)


def attention(c: WmtConfig):
    return nn.MultiHeadDotProductAttention(num_heads=c.num_heads, dtype=c.dtype, qkv_features=c.qkv_dim,
                                           use_bias=False, deterministic=True)


class Encoder1DBlock(nn.Module):
    config: WmtConfig

    @nn.compact
    def __call__(self, inputs, mask):
        c = self.config
        x = attention(c)(nn.LayerNorm(dtype=c.dtype)(inputs), mask=mask) + inputs
        return x + MlpBlock(c)(nn.LayerNorm(dtype=c.dtype)(x))


class EncoderDecoder1DBlock(nn.Module):
    config: WmtConfig

    @nn.compact
    def __call__(self, targets, encoded, decoder_mask, encoder_decoder_mask):
        c = self.config
        x = attention(c)(nn.LayerNorm(dtype=c.dtype)(targets), mask=decoder_mask) + targets
        y = attention(c)(nn.LayerNorm(dtype=c.dtype)(x), encoded, mask=encoder_decoder_mask) + x
        return y + MlpBlock(c)(nn.LayerNorm(dtype=c.dtype)(y))


def embed(vocab: int, c: WmtConfig, name: str | None = None):
    return nn.Embed(num_embeddings=vocab, features=c.emb_dim, embedding_init=nn.initializers.normal(stddev=1.0),
                    name=name)


class Encoder(nn.Module):
    config: WmtConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, inputs, mask):
        c = self.config
        table = self.shared_embedding if self.shared_embedding is not None else embed(c.vocab_size, c)
        x = AddPositionEmbs(c, name="posembed_input")(table(inputs.astype("int32"))).astype(c.dtype)
        for i in range(c.num_layers):
            x = Encoder1DBlock(c, name=f"encoderblock_{i}")(x, mask)
        return nn.LayerNorm(dtype=c.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
    config: WmtConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, encoded, targets, decoder_mask, encoder_decoder_mask):
        c = self.config
        table = self.shared_embedding if self.shared_embedding is not None else embed(c.output_vocab_size, c)
        y = table(shift_right(targets.astype("int32")))
        y = AddPositionEmbs(c, name="posembed_output")(y).astype(c.dtype)
        for i in range(c.num_layers):
            y = EncoderDecoder1DBlock(c, name=f"encoderdecoderblock_{i}")(y, encoded, decoder_mask, encoder_decoder_mask)
        y = nn.LayerNorm(dtype=c.dtype, name="encoderdecoder_norm")(y)
        if c.logits_via_embedding:
            return table.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
        return nn.Dense(c.output_vocab_size, dtype=c.dtype, name="logitdense")(y)


class Transformer(nn.Module):
    config: WmtConfig

    def setup(self):
        c = self.config
        self.shared_embedding = embed(c.vocab_size, c) if c.share_embeddings else None
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


def init(config: WmtConfig, seed: int = 0, length: int = 4) -> dict:
    """Random parameters, `variables["params"]` as a nested dict of NumPy arrays. The biases
    (zeros or 1e-6 noise at init in wmt) and LayerNorm scales are randomised too, so that a
    wrong mapping of any of them shows in the logits."""
    dummy = jnp.ones((1, length), jnp.int32)
    params = Transformer(config).init(jax.random.PRNGKey(seed), dummy, dummy)["params"]
    rng = np.random.default_rng(seed)

    def randomise(path, x):
        x = np.asarray(x)
        name = path[-1].key
        if name in ("bias",):
            return rng.normal(0, 0.1, x.shape).astype(x.dtype)
        if name == "scale":
            return (1 + rng.normal(0, 0.1, x.shape)).astype(x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(randomise, jax.tree_util.tree_map(np.asarray, params))


def apply(config: WmtConfig, params: dict, inputs, targets) -> np.ndarray:
    """`Transformer(config).apply({"params": params}, inputs, targets)` as a NumPy array."""
    return np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(inputs), jnp.asarray(targets)))
