"""The encoder-decoder Transformer of "Attention Is All You Need", in plain NumPy.

This file is written to be read next to the paper (Vaswani et al., 2017): each equation sits above
the code that computes it. In float64 it is the oracle the PyTorch and Flax backends are judged
against, so it never promotes, approximates or fuses anything behind the reader's back.

Shape legend:
    B batch, S source length, T target length, D d_model, H heads, K head dim (D / H),
    F d_ff, V target vocabulary. Tq / Tk are query / key lengths inside attention.

Sections, in the same order in every backend: masks, positions, building blocks, attention,
feed-forward, encoder layer, decoder layer, encoder and decoder, model.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.generation.search import DecoderCache
from conformance.core.inputs import (
    check_device,
    check_label_smoothing,
    check_memory,
    check_same_batch,
    expected_mask_shapes,
    host_ids,
    check_labels_finite,
    host_features,
    host_labels,
    host_mask,
    source_real,
)
from conformance.core.dropout import Dropout, host_dropout
from conformance.core.output import Encoded, ModelOutput, record
from conformance.core.params import prepare_params
from conformance.core.positions import offset_buckets, position_table
from impl_numpy import backward as backprop
from impl_numpy import decode
from impl_numpy.blocks import product_in_blocks
from impl_numpy import frontend

SUPPORTED_DTYPES = ("float32", "float64")


# -- Masks -------------------------------------------------------------------------------------
# Masks are boolean, True = may attend, and broadcast against scores of shape (B, H, Tq, Tk).


def padding_mask(ids: np.ndarray, pad_id: int) -> np.ndarray:
    """(B, L) ids -> (B, 1, 1, L): every query may attend to every non-padding key."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int) -> np.ndarray:
    """(1, 1, T, T) lower triangle: position t may attend to positions <= t (section 3.2.3)."""
    return np.tril(np.ones((length, length), dtype=bool))[None, None, :, :]


def target_mask(config: ModelConfig, tgt_ids: np.ndarray) -> np.ndarray:
    """(B, 1, T, T): target padding AND causal.

    Target padding is masked on the keys (B, 1, 1, T), or, in the tutorials that do so, on the
    queries (B, 1, T, 1), or on both (B, 1, T, T), or not at all (Marian: its start token is the
    pad id).
    """
    tgt_pad = padding_mask(tgt_ids, config.pad_id)  # (B, 1, 1, T)
    if config.tgt_pad_mask == "queries":
        tgt_pad = tgt_pad.transpose(0, 1, 3, 2)  # (B, 1, T, 1)
    elif config.tgt_pad_mask == "both":
        tgt_pad = tgt_pad & tgt_pad.transpose(0, 1, 3, 2)  # (B, 1, T, T)
    elif config.tgt_pad_mask == "none":
        tgt_pad = tgt_pad | True  # causal only: the decoder's start token may be the pad id
    return tgt_pad & causal_mask(tgt_ids.shape[1])  # (B, 1, T, T)


def encoder_self_mask(config: ModelConfig, src_mask):
    """The encoder self-attention's mask from the source mask (B, H|1, 1, S): the source mask
    itself (padding on the keys), or with padding on the queries too (B, H|1, S, S), as Flax
    `examples/wmt` masks it. Cross-attention always takes the source mask on the keys only."""
    if config.src_pad_mask == "both" and src_mask is not None:
        return src_mask & src_mask.swapaxes(-1, -2)  # (B, H|1, S, S)
    return src_mask


def source_mask(config: ModelConfig, src_ids: np.ndarray, frontend=None) -> np.ndarray:
    """(B, 1, 1, S): source padding on the keys; a features source (B, n_mels, frames) has none,
    so every one of its S = frames / 2 positions may be attended.

    `frontend`: the model's front end, whose `positions(frames)` give S (None: frames / 2)."""
    if config.source == "features" and frontend is not None:
        return np.ones((src_ids.shape[0], 1, 1, frontend.positions(src_ids.shape[2])), dtype=bool)
    return np.asarray(source_real(config, np.asarray(src_ids)))[:, None, None, :]


def make_masks(config: ModelConfig, src_ids: np.ndarray, tgt_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The masks a model derives from its ids: src_mask (B, 1, 1, S) and tgt_mask (B, 1, T, T)."""
    return source_mask(config, src_ids), target_mask(config, tgt_ids)


# -- Positions ---------------------------------------------------------------------------------


class Positions:
    """The position term added to the scaled token embeddings (section 3.5).

    A sinusoid (a constant of the config, computed in float64) or a stored table, of
    `max_len + position_offset` rows: position p reads row p + position_offset (BART's learned
    table and M2M100's sinusoid skip 2 rows). With position_ids "non-pad" (M2M100/NLLB) only the
    tokens that are not the pad id are numbered, and a pad token gets no position term.
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str, dtype, *, length: int):
        # `length`: the stack's longest sequence (max_len; a features source's encoder: source_len)
        if config.position == "table":
            self.table = params[f"{prefix}.table"]
        else:
            self.table = position_table(config, length).astype(dtype)
        self.offset = config.position_offset
        self.pad_id = config.pad_id if config.position_ids == "non-pad" else None

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The table row each token reads (B, L), and where it adds one (B, L), or True: all do."""
        length = ids.shape[1]
        if self.pad_id is None:
            return np.arange(self.offset, self.offset + length)[None, :], True  # (1, L)
        real = ids != self.pad_id  # (B, L)
        counted = np.cumsum(real, axis=1) - 1  # (B, L): the real tokens before each one
        return self.offset + np.maximum(counted, 0), real

    def __call__(self, ids: np.ndarray, dtype) -> np.ndarray:
        """The terms of the tokens `ids` (B, L): (1, L, D), or (B, L, D) with "non-pad" ids."""
        rows, real = self.rows(ids)
        term = cast(self.table[rows], dtype)  # (1|B, L, D)
        return term if real is True else np.where(real[..., None], term, 0).astype(dtype)

    def at(self, position: int, ids: np.ndarray, dtype) -> np.ndarray:
        """The term of one position for the tokens `ids` (B, 1), for a cached decoding step: row
        position + offset, as transformers' cached step reads it (no pad token before it is counted)."""
        term = cast(self.table[None, self.offset + position:self.offset + position + 1, :], dtype)  # (1, 1, D)
        return term if self.pad_id is None else np.where((ids != self.pad_id)[..., None], term, 0).astype(dtype)

    def span(self, length: int, dtype) -> np.ndarray:
        """The terms of positions 0 .. length - 1 of a source with no padding (a features source):
        rows offset .. offset + length - 1, (1, L, D)."""
        return cast(self.table[None, self.offset:self.offset + length, :], dtype)  # (1, L, D)

    def score_bias(self, query_len: int, key_len: int, dtype, *, first_query: int = 0, tape=None):
        """An absolute position term adds nothing to the attention scores: None."""
        return None


class RelativeBuckets:
    """UMT5's relative positions: no term on the embeddings; the stack computes the bucket of every
    (query, key) once (T5's `_relative_position_bucket`), and each self-attention layer reads them in
    a table of its own (`relative_bias_per_layer`: `own_table_bias`); T5's `RelativePositionBias`
    reads them in the stack's one table."""

    def __init__(self, config: ModelConfig, *, bidirectional: bool, length: int):
        self.buckets = offset_buckets(config, bidirectional=bidirectional, length=length)  # (2 L - 1,): n at n + L - 1
        self.max_len = length

    def __call__(self, ids: np.ndarray, dtype):
        return 0  # nothing is added to the embeddings

    def at(self, position: int, ids: np.ndarray, dtype):
        return 0

    def span(self, length: int, dtype):
        return 0

    def score_bias(self, query_len: int, key_len: int, dtype, *, first_query: int = 0, tape=None) -> np.ndarray:
        """(Tq, Tk): the buckets of queries first_query .. + Tq - 1 against keys 0 .. Tk - 1."""
        query = first_query + np.arange(query_len)  # (Tq,)
        buckets = self.buckets[np.arange(key_len)[None, :] - query[:, None] + self.max_len - 1]  # (Tq, Tk)
        if tape is not None:
            tape[self] = buckets
        return buckets


class RelativePositionBias(RelativeBuckets):
    """T5's relative position bias: no term on the embeddings; a learned (buckets, H) table whose
    row bucket(j - i) is added to every self-attention score of query i and key j in the stack
    (bidirectional in the encoder, causal in the decoder; `conformance.core.positions`)."""

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str, *, bidirectional: bool,
                 length: int):
        super().__init__(config, bidirectional=bidirectional, length=length)
        self.relative_bias = params[f"{prefix}.relative_bias"]  # (buckets, H)

    def score_bias(self, query_len: int, key_len: int, dtype, *, first_query: int = 0, tape=None) -> np.ndarray:
        """(1, H, Tq, Tk): the bias of queries first_query .. + Tq - 1 against keys 0 .. Tk - 1."""
        buckets = super().score_bias(query_len, key_len, dtype, first_query=first_query, tape=tape)  # (Tq, Tk)
        return cast(self.relative_bias[buckets], dtype).transpose(2, 0, 1)[None]  # (1, H, Tq, Tk)


def positions(config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str, dtype, *, bidirectional: bool,
              length: int):
    """The stack's position term: `RelativePositionBias` for position "relative" (T5), `RelativeBuckets`
    with `relative_bias_per_layer` (UMT5), else `Positions`."""
    if config.position == "relative" and config.relative_bias_per_layer:
        return RelativeBuckets(config, bidirectional=bidirectional, length=length)
    if config.position == "relative":
        return RelativePositionBias(config, params, prefix, bidirectional=bidirectional, length=length)
    return Positions(config, params, prefix, dtype, length=length)


# -- Building blocks ---------------------------------------------------------------------------
# Parameters are stored in the model's `param_dtype` and computed in its `dtype` (Flax's
# `param_dtype` / `dtype` split): every read of a parameter goes through `cast`, which widens or
# rounds it to the dtype of the computation it enters (the activations' dtype), and is the array
# itself when the two agree (`param_dtype=None`, the default: no cast, no copy).


def cast(w: np.ndarray, dtype) -> np.ndarray:
    """w in `dtype`: w itself when it already is, else one rounding (exact when it widens)."""
    return w if w.dtype == dtype else w.astype(dtype)


class Linear:
    """y = x W + b, with W stored (d_in, d_out) as in the paper's notation."""

    def __init__(self, params: Mapping[str, np.ndarray], prefix: str):
        self.weight = params[f"{prefix}.weight"]
        self.bias = params.get(f"{prefix}.bias")

    def __call__(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        if tape is not None:  # what the backward pass reads (impl_numpy/backward.py), as below
            tape[self] = x
        y = x @ cast(self.weight, x.dtype)
        if self.bias is not None:
            y = y + cast(self.bias, x.dtype)
        return y


class LayerNorm:
    """LayerNorm over the last axis, in the form the config names.

    standard:       y = (x - mean) / sqrt(var + eps) * weight + bias   (biased variance)
    std-eps:        y = (x - mean) / (std + eps) * weight + bias       (unbiased std; the
                    Annotated Transformer's own LayerNorm)
    fast-variance:  as standard, with var = max(E[x^2] - E[x]^2, 0)    (Flax nn.LayerNorm)
    rms:            y = x / sqrt(mean(x^2) + eps) * weight             (T5LayerNorm: RMSNorm, no
                    mean, no bias)
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str):
        self.weight = params[f"{prefix}.weight"]
        self.bias = params.get(f"{prefix}.bias")  # None for rms
        self.eps = config.layer_norm_eps
        self.form = config.layer_norm_form

    def __call__(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        if tape is not None:
            tape[self] = x
        if self.form == "rms":
            return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * cast(self.weight, x.dtype)
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        if self.form == "standard":
            var = (centered * centered).mean(axis=-1, keepdims=True)
            normed = centered / np.sqrt(var + self.eps)
        elif self.form == "fast-variance":
            var = np.maximum((x * x).mean(axis=-1, keepdims=True) - mean * mean, 0)
            normed = centered / np.sqrt(var + self.eps)
        else:
            std = np.sqrt((centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))
            normed = centered / (std + self.eps)
        return normed * cast(self.weight, x.dtype) + cast(self.bias, x.dtype)


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """ReLU (the paper), GELU (erf form), GELU with the tanh approximation, SiLU/swish, or tanh."""
    if name == "relu":
        return np.maximum(x, 0)
    if name == "gelu":
        # 0.5 x (1 + erf(x / sqrt 2)); NumPy has no vectorised erf, so each value goes through
        # math.erf in float64 (exact to 1 ulp) and is cast back.
        erf = np.frompyfunc(math.erf, 1, 1)(x * (1 / math.sqrt(2))).astype(x.dtype)
        return 0.5 * x * (1 + erf)
    if name == "gelu-tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "tanh":  # AlgoPerf WMT's GLU variant
        return np.tanh(x)
    # silu(x) = x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2, which cannot overflow.
    return x * (0.5 * (1 + np.tanh(0.5 * x)))


def apply_dropout(x: np.ndarray, dropout, site: str) -> np.ndarray:
    """Inverted dropout (section 5.4): x / (1 - rate) where the site's mask keeps, 0 where it drops.

    `dropout` is None (off: x itself) or a `conformance.core.dropout.Dropout` whose masks, drawn
    from one NumPy seed, every backend receives, so a training step with dropout is the same
    computation everywhere. A select, not a product: a dropped NaN is 0 as in PyTorch's kernel."""
    if dropout is None:
        return x
    return np.where(dropout.masks[site], x / (1 - dropout.rate), 0).astype(x.dtype)  # (B, L, D)


# -- Attention ---------------------------------------------------------------------------------


def softmax(scores: np.ndarray) -> np.ndarray:
    """softmax over the last axis. A row whose every score is -inf gives NaN (0 / 0), on purpose."""
    with np.errstate(invalid="ignore"):
        shifted = scores - scores.max(axis=-1, keepdims=True)
        e = np.exp(shifted)
        return e / e.sum(axis=-1, keepdims=True)


def replace_masked(scores: np.ndarray, mask: np.ndarray, fill: float) -> np.ndarray:
    """s' = fill where masked, else s: a masked score becomes a constant (`masked_fill`, Flax)."""
    return np.where(mask, scores, fill)


def add_to_masked(scores: np.ndarray, mask: np.ndarray, fill: float) -> np.ndarray:
    """s' = s + fill where masked, else s: transformers' eager attention adds a mask of
    finfo(dtype).min. The fill swamps the score (config.ADDED_FILL_LIMIT), so the value is the
    fill's, but the score is still an input of the sum: the backward pass reaches it."""
    return scores + np.where(mask, 0, fill).astype(scores.dtype)


def masking(config: ModelConfig):
    """How masked scores meet the fill: `replace_masked` or `add_to_masked` (config.masked_scores)."""
    return add_to_masked if config.masked_scores == "added" else replace_masked


def scaled_dot_product_attention(q, k, v, mask, fill: float, *, scaled: bool = True, bias=None,
                                 masked=replace_masked, empty_rows: float | None = None):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(K) + bias) V  (section 3.2.1).

    q: (B, H, Tq, K); k, v: (B, H, Tk, K); mask: boolean, broadcastable to (B, H, Tq, Tk), or
    None. Masked scores are replaced by `fill` before the softmax. Returns the output
    (B, H, Tq, K) and the weights (B, H, Tq, Tk).

    `scaled=False` (keyword-only) drops the 1 / sqrt(K) (T5: scores = Q K^T); `bias` (keyword-only),
    broadcastable to (B, H, Tq, Tk), is added to the scores before the mask (T5's relative
    position bias, `score_bias`).

    `masked` (keyword-only): how a masked score meets the fill, `replace_masked` (the default) or
    `add_to_masked` (config.masked_scores). `empty_rows` (keyword-only; 0.0 for empty_rows "zeros"):
    the weights of a query with no key to attend to, instead of the softmax of its filled row.
    """
    scores = q @ k.swapaxes(-1, -2)  # (B, H, Tq, Tk)
    if scaled:
        scores = scores / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = masked(scores, mask, fill)
    weights = softmax(scores)  # (B, H, Tq, Tk)
    if empty_rows is not None and mask is not None:
        empty = ~np.broadcast_to(mask, scores.shape).any(axis=-1, keepdims=True)  # (B, H, Tq, 1): no key
        weights = np.where(empty, empty_rows, weights).astype(weights.dtype)
    return weights @ v, weights  # (B, H, Tq, K)


def passed_bias(attention, bias, dtype):
    """The score bias as the stack computed it: T5's shared table read at the buckets, or None."""
    return bias


def own_table_bias(attention, buckets, dtype):
    """UMT5: this attention's own (buckets, H) table read at the stack's buckets (Tq, Tk)."""
    return cast(attention.relative_bias[buckets], dtype).transpose(2, 0, 1)[None]  # (1, H, Tq, Tk)


class MultiHeadAttention:
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o, head_h = Attention(Q W_q^h, K W_k^h, V W_v^h)
    (section 3.2.2). Head h owns columns h*K .. (h+1)*K - 1 of W_q, W_k and W_v."""

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str, *,
                 own_bias: bool = False):
        self.q_proj = Linear(params, f"{prefix}.q_proj")
        self.k_proj = Linear(params, f"{prefix}.k_proj")
        self.v_proj = Linear(params, f"{prefix}.v_proj")
        self.o_proj = Linear(params, f"{prefix}.o_proj")
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.fill = config.mask_fill
        self.masked = masking(config)
        self.empty_rows = 0.0 if config.empty_rows == "zeros" else None  # None: the softmax of the filled row
        self.temperature = config.attention_temp
        self.scaled = config.scale_scores
        # `own_bias` (UMT5's self-attention): a relative position table of its own, read at the
        # stack's buckets; else the stack's score bias is used as passed.
        self.relative_bias = params[f"{prefix}.relative_bias"] if own_bias else None
        self.layer_bias = own_table_bias if own_bias else passed_bias

    def split_heads(self, x: np.ndarray) -> np.ndarray:
        batch, length, _ = x.shape
        x = x.reshape(batch, length, self.n_heads, self.head_dim)  # (B, L, H, K)
        return x.transpose(0, 2, 1, 3)  # (B, H, L, K)

    def queries(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        """The queries x W_q split into heads (B, H, Tq, K), times the attention temperature:
        AlgoPerf's `attention_temp` scales the queries, so scores = temp * Q K^T / sqrt(K)."""
        q = self.split_heads(self.q_proj(x, tape=tape))  # (B, H, Tq, K)
        return q if self.temperature == 1.0 else q * self.temperature

    def __call__(self, x: np.ndarray, memory: np.ndarray, mask, *, bias=None, tape=None, cache=None):
        """x: (B, Tq, D) queries; memory: (B, Tk, D) keys and values (x itself for self-attention).

        `bias` (keyword-only): added to the scores, (1, H, Tq, Tk) (T5's relative position bias).
        `cache` (keyword-only; a cached decoding step, impl_numpy/decode.py): where the keys and
        values come from instead, `cache.keys_values(self, memory)`."""
        q = self.queries(x, tape=tape)  # (B, H, Tq, K)
        if cache is None:
            k, v = self.keys_values(memory, tape=tape)  # (B, H, Tk, K) each
        else:
            k, v = cache.keys_values(self, memory)
        bias = self.layer_bias(self, bias, q.dtype)  # (1, H, Tq, Tk), or None
        heads, weights = scaled_dot_product_attention(q, k, v, mask, self.fill, scaled=self.scaled, bias=bias,
                                                      masked=self.masked, empty_rows=self.empty_rows)
        if tape is not None:
            tape[self] = (q, k, v, weights, mask, bias is not None)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)  # (B, Tq, H K)
        return self.o_proj(concat, tape=tape), weights

    def keys_values(self, memory: np.ndarray, *, tape=None) -> tuple[np.ndarray, np.ndarray]:
        """The projected keys and values of `memory` (B, Tk, D), each (B, H, Tk, K), for the cache."""
        return self.split_heads(self.k_proj(memory, tape=tape)), self.split_heads(self.v_proj(memory, tape=tape))


# -- Feed-forward ------------------------------------------------------------------------------


class FeedForward:
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2  (section 3.3; the paper's act is ReLU).

    With `ffn_glu` the activated units are multiplied by a linear gate (AlgoPerf's GLU, `MlpBlock`
    in algoperf/workloads/wmt/wmt_jax/models.py, `_ff_block` in wmt_pytorch/models.py):
        FFN(x) = (act(x W_1 + b_1) * (x W_gate + b_gate)) W_2 + b_2
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str):
        self.linear1 = Linear(params, f"{prefix}.linear1")
        self.gate = Linear(params, f"{prefix}.gate") if config.ffn_glu else None
        self.linear2 = Linear(params, f"{prefix}.linear2")
        self.activation = config.activation

    def __call__(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        hidden = self.linear1(x, tape=tape)  # (B, L, F), before the activation
        units = activation(self.activation, hidden)  # (B, L, F)
        gated = None if self.gate is None else self.gate(x, tape=tape)  # the linear gate branch (B, L, F)
        if tape is not None:
            tape[self] = (hidden, units, gated)
        return self.linear2(units if gated is None else units * gated, tape=tape)


# -- Encoder layer -----------------------------------------------------------------------------
# Each sublayer is wrapped with a residual connection and a LayerNorm (sections 3.1 and 5.4):
#     post-LN (the paper):  x = LN(x + Sublayer(x))
#     pre-LN:               x = x + Sublayer(LN(x))


def sublayer(x: np.ndarray, fn, norm: LayerNorm, pre_ln: bool, dropout=None, site: str = "", *, tape=None):
    """x = LN(x + Sublayer(x)) (post-LN, the paper) or x + Sublayer(LN(x)) (pre-LN), the
    sublayer's output dropped out at `site` before the sum (sections 3.1 and 5.4).

    `fn(h)` returns the sublayer's output and its attention weights (None for the feed-forward);
    returns the new x and those weights."""
    h, weights = fn(norm(x, tape=tape) if pre_ln else x)
    h = apply_dropout(h, dropout, site)
    return (x + h if pre_ln else norm(x + h, tape=tape)), weights


class EncoderLayer:
    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str):
        self.self_attn = MultiHeadAttention(config, params, f"{prefix}.self_attn", own_bias=config.relative_bias_per_layer)
        self.self_attn_norm = LayerNorm(config, params, f"{prefix}.self_attn_norm")
        self.ffn = FeedForward(config, params, f"{prefix}.ffn")
        self.ffn_norm = LayerNorm(config, params, f"{prefix}.ffn_norm")
        self.pre_ln = config.norm_placement == "pre"

    def __call__(self, x: np.ndarray, src_mask, name: str, out: ModelOutput | Encoded, *,
                 bias=None, dropout=None, tape=None) -> np.ndarray:
        # `bias`: the self-attention's score bias (T5's relative positions), or None.
        # Self-attention: each source position attends to every unmasked source position.
        x, out.attention[f"{name}.self"] = sublayer(
            x, lambda h: self.self_attn(h, h, src_mask, bias=bias, tape=tape), self.self_attn_norm, self.pre_ln,
            dropout, f"{name}.self_attn", tape=tape)
        out.intermediates[f"{name}.self_attn"] = x

        # Position-wise feed-forward.
        x, _ = sublayer(x, lambda h: (self.ffn(h, tape=tape), None), self.ffn_norm, self.pre_ln,
                        dropout, f"{name}.ffn", tape=tape)
        out.intermediates[f"{name}.ffn"] = x
        return x


# -- Decoder layer -----------------------------------------------------------------------------


class DecoderLayer:
    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str):
        self.self_attn = MultiHeadAttention(config, params, f"{prefix}.self_attn", own_bias=config.relative_bias_per_layer)
        self.self_attn_norm = LayerNorm(config, params, f"{prefix}.self_attn_norm")
        self.cross_attn = MultiHeadAttention(config, params, f"{prefix}.cross_attn")
        self.cross_attn_norm = LayerNorm(config, params, f"{prefix}.cross_attn_norm")
        self.ffn = FeedForward(config, params, f"{prefix}.ffn")
        self.ffn_norm = LayerNorm(config, params, f"{prefix}.ffn_norm")
        self.pre_ln = config.norm_placement == "pre"

    def __call__(self, x, memory, tgt_mask, cross_mask, name: str, out: ModelOutput, *,
                 bias=None, dropout=None, tape=None, cache=None) -> np.ndarray:
        # `bias`: the self-attention's score bias (T5's relative positions), or None.
        # `cache`: the (self, cross) attentions' key and value sources of a cached step (decode.py).
        self_cache, cross_cache = (None, None) if cache is None else cache
        # Masked self-attention: position t attends to target positions <= t.
        x, out.attention[f"{name}.self"] = sublayer(
            x, lambda h: self.self_attn(h, h, tgt_mask, bias=bias, tape=tape, cache=self_cache), self.self_attn_norm,
            self.pre_ln, dropout, f"{name}.self_attn", tape=tape)
        out.intermediates[f"{name}.self_attn"] = x

        # Cross-attention: queries from the decoder, keys and values from the encoder's memory.
        x, out.attention[f"{name}.cross"] = sublayer(
            x, lambda h: self.cross_attn(h, memory, cross_mask, tape=tape, cache=cross_cache), self.cross_attn_norm,
            self.pre_ln, dropout, f"{name}.cross_attn", tape=tape)
        out.intermediates[f"{name}.cross_attn"] = x

        # Position-wise feed-forward.
        x, _ = sublayer(x, lambda h: (self.ffn(h, tape=tape), None), self.ffn_norm, self.pre_ln,
                        dropout, f"{name}.ffn", tape=tape)
        out.intermediates[f"{name}.ffn"] = x
        return x


# -- Encoder and decoder -----------------------------------------------------------------------


def norm_of_sum(tokens: np.ndarray, positions, norm, *, tape=None) -> np.ndarray:
    """LN(E x s + P): the embedding norm on the scaled tokens plus the position term (BART's
    `layernorm_embedding`), or E x s + P without one (section 3.4)."""
    x = tokens + positions
    return x if norm is None else norm(x, tape=tape)


def sum_of_norm(tokens: np.ndarray, positions, norm, *, tape=None) -> np.ndarray:
    """LN(E x s) + P: the embedding norm on the scaled tokens alone, the position term added
    after it (BlenderbotSmall's decoder, `decoder_embedding_norm = "tokens"`)."""
    return norm(tokens, tape=tape) + positions


def embedding_sum(config: ModelConfig, stack: str):
    """How a stack combines its tokens, positions and embedding norm: `sum_of_norm` for a decoder
    with `decoder_embedding_norm = "tokens"`, else `norm_of_sum`."""
    return sum_of_norm if stack == "decoder" and config.decoder_embedding_norm == "tokens" else norm_of_sum


class Embedding:
    """A token lookup table (V, D). With `freeze_pad_embedding` the lookups of pad_id send its row
    no gradient (`nn.Embedding(padding_idx=pad_id)`); the forward is the same."""

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], prefix: str):
        self.weight = params[f"{prefix}.weight"]
        self.padding_idx = config.pad_id if config.freeze_pad_embedding else None  # read by backward.py

    def __call__(self, ids: np.ndarray, dtype) -> np.ndarray:
        return cast(self.weight[ids], dtype)  # (B, L, D): the looked-up rows cast, not the table


class Encoder:
    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], dtype):
        self.config = config
        # The source's input: a token table, or a features source's front end (impl_numpy/frontend.py).
        self.embedding = Embedding(config, params, "encoder.embedding") if config.source == "ids" else None
        self.frontend = frontend.FrontEnd(params, "encoder.frontend") if config.source == "features" else None
        self.position = positions(config, params, "encoder.position", dtype, bidirectional=True, length=config.source_len)
        self.embedding_norm = LayerNorm(config, params, "encoder.embedding_norm") if config.embedding_norm else None
        self.embedding_sum = embedding_sum(config, "encoder")
        self.layers = [EncoderLayer(config, params, f"encoder.layers.{i}") for i in range(config.n_encoder_layers)]
        self.norm = LayerNorm(config, params, "encoder.norm") if config.final_encoder_norm else None

    def __call__(self, x: np.ndarray, src_mask, out: Encoded, *, dropout=None, tape=None) -> np.ndarray:
        self_mask = encoder_self_mask(self.config, src_mask)  # (B, 1, 1, S) or (B, 1, S, S)
        bias = self.score_bias(x.shape[1], x.dtype, tape=tape)
        for i, layer in enumerate(self.layers):
            x = layer(x, self_mask, f"encoder.{i}", out, bias=bias, dropout=dropout, tape=tape)
        x = self.finish(x, tape=tape)
        out.intermediates["encoder.output"] = x
        return x

    # The stack's own steps around its layers, named so that a caller running one layer at a
    # time (impl_numpy/stream.py) takes these same steps.

    def score_bias(self, length: int, dtype, *, tape=None):
        """The score bias every layer's self-attention adds for x of `dtype`: T5's relative positions."""
        bias = self.position.score_bias(length, length, dtype, tape=tape)  # (1, H, S, S), or None
        return bias

    def finish(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        """`encoder.output`: x after the last layer through the final LayerNorm, when the config has one."""
        return x if self.norm is None else self.norm(x, tape=tape)


class Decoder:
    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray], dtype):
        # With shared embeddings the decoder reads the encoder's table (see Model.decode).
        self.embedding = None if config.share_embeddings else Embedding(config, params, "decoder.embedding")
        self.position = positions(config, params, "decoder.position", dtype, bidirectional=False, length=config.max_len)
        self.embedding_norm = LayerNorm(config, params, "decoder.embedding_norm") if config.embedding_norm else None
        self.embedding_sum = embedding_sum(config, "decoder")
        self.layers = [DecoderLayer(config, params, f"decoder.layers.{i}") for i in range(config.n_decoder_layers)]
        self.norm = LayerNorm(config, params, "decoder.norm") if config.final_decoder_norm else None

    def __call__(self, x, memory, tgt_mask, cross_mask, out: ModelOutput, *, bias=None, dropout=None, tape=None,
                 cache=None) -> np.ndarray:
        # `bias`: the self-attention's score bias (a cached step's row of it); None: the stack's own.
        if bias is None:
            bias = self.score_bias(x.shape[1], x.dtype, tape=tape)
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, tgt_mask, cross_mask, f"decoder.{i}", out, bias=bias, dropout=dropout, tape=tape,
                      cache=None if cache is None else cache[i])
        x = self.finish(x, tape=tape)
        out.intermediates["decoder.output"] = x
        return x

    # The stack's own steps around its layers, as in `Encoder`.

    def score_bias(self, length: int, dtype, *, tape=None):
        """The score bias every layer's self-attention adds for y of `dtype`: T5's relative positions."""
        bias = self.position.score_bias(length, length, dtype, tape=tape)  # (1, H, T, T), or None
        return bias

    def finish(self, x: np.ndarray, *, tape=None) -> np.ndarray:
        """`decoder.output`: y after the last layer through the final LayerNorm, when the config has one."""
        return x if self.norm is None else self.norm(x, tape=tape)


class Output:
    """logits = y W_out + b_out. W_out is `output.weight` (D, V), or the target embedding
    transposed when the output is tied to it (section 3.4). With `scale_logits`,
    logits = y W_out / sqrt(D) + b_out (Flax examples/wmt's `logits_via_embedding`).

    The product y W_out is taken a block of vocabulary columns at a time (impl_numpy/blocks.py):
    a W_out stored narrower than the compute dtype is never widened whole outside differentiation."""

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray]):
        self.weight = None if config.tie_output else params["output.weight"]
        self.bias = params.get("output.bias")
        self.scale_logits = config.scale_logits

    def __call__(self, y: np.ndarray, tied_embedding: Embedding, *, tape=None) -> np.ndarray:
        if tape is not None:
            tape[self] = y
        # W_out as stored: `output.weight` (D, V), or the tied embedding (V, D)
        weight, vocab_axis = (tied_embedding.weight, 0) if self.weight is None else (self.weight, 1)
        logits = product_in_blocks(y, weight, vocab_axis, cast)  # (B, T, V)
        if self.scale_logits:
            logits = logits / math.sqrt(y.shape[-1])
        if self.bias is not None:
            logits = logits + cast(self.bias, y.dtype)
        return logits


# -- Model -------------------------------------------------------------------------------------


def trained_bias(bias: np.ndarray) -> np.ndarray:
    """BART's final_logits_bias trained (freeze_final_logits_bias off): its values, and a gradient."""
    return bias


def frozen_bias(bias: np.ndarray) -> np.ndarray:
    """BART's final_logits_bias frozen, as transformers' buffer: its values, and no gradient.

    NumPy has no autograd: impl_numpy/backward.py gives it none, reading `Model.frozen_logits_bias`."""
    return bias


class Model:
    """The whole encoder-decoder (figure 1 of the paper), configured by a `ModelConfig`.

    `Model(config, params)` takes the canonical parameters (see `conformance.core.params`) as
    NumPy arrays (None: the seeded `init_params(config)`, float64); `dtype` casts them (float32 or
    float64; default: their own dtype); the cast values must be finite too. `device` is accepted
    for the same surface as the other backends: NumPy runs on the host, "cpu".

    `param_dtype` (keyword-only; float32 or float64; default None: `dtype`) stores the parameters
    in another dtype than the one the model computes in: `Model(config, params32, "float64",
    param_dtype="float32")` holds the float32 values as they are (half a float64 model's memory)
    and widens each where it is used (`cast`), which is exact, so every output equals the float64
    model's built from the same values, bit for bit. `dtype` stays the compute dtype (activations,
    logits, scores); `param_dtype` is the storage's, and `loss_and_grads` returns gradients in it
    (computed in `dtype`, each rounded once at the end), so an optimizer updates the stored values.
    """

    backend = "numpy"

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray] | None = None, dtype=None, *,
                 device: str | None = None, param_dtype=None):
        check_device(self.backend, "cpu" if device is None else device, ("cpu",))
        params, dtype_name = prepare_params(config, params, dtype, self.backend, SUPPORTED_DTYPES,
                                            param_dtype=param_dtype)
        self.dtype = np.dtype(dtype_name)
        self.config = config
        self.params = params
        self.encoder = Encoder(config, params, self.dtype)
        self.decoder = Decoder(config, params, self.dtype)
        self.output = Output(config, params)
        self.final_logits_bias = params.get("final_logits_bias")
        self.frozen_logits_bias = config.freeze_final_logits_bias  # a buffer in transformers: read by backward.py
        self.logits_bias = frozen_bias if config.freeze_final_logits_bias else trained_bias

    @property
    def param_dtype(self) -> np.dtype:
        """The dtype the parameters are stored in (`dtype` is the one they are computed in)."""
        return self.target_embedding.weight.dtype

    @property
    def device(self) -> str:
        """The device the parameters (and so every computation) live on.

        NumPy has only the host: "cpu"."""
        return "cpu"

    # Inputs ------------------------------------------------------------------------------------
    # Ids and masks are read and checked on the host by the core (`host_ids`, `host_mask`), the
    # same code and the same errors as every other backend.

    def ids(self, argument: str, ids, vocab_size: int) -> np.ndarray:
        """`ids` checked as a call checks `argument` (its shape, dtype, range), as this backend's ids."""
        return self._ids(argument, ids, vocab_size)

    def _ids(self, argument: str, ids, vocab_size: int) -> np.ndarray:
        return host_ids(argument, ids, vocab_size, self.config.max_len)

    def source(self, src_ids) -> np.ndarray:
        """The source checked as a call checks it: ids (B, S) (`ids`), or a features source's
        log-mel features (B, n_mels, frames) (`conformance.core.inputs.check_features`)."""
        if self.config.source == "features":
            return host_features("src_ids", src_ids, self.config)
        return self._ids("src_ids", src_ids, self.config.src_vocab_size)

    def _mask(self, argument: str, mask, expected, derived: np.ndarray) -> np.ndarray:
        return host_mask(argument, mask, expected, derived)

    def make_masks(self, src_ids, tgt_ids) -> tuple[np.ndarray, np.ndarray]:
        return make_masks(self.config, np.asarray(src_ids), np.asarray(tgt_ids))

    def cross_mask(self, src_mask):
        """The decoder's cross-attention mask: the source's (B, 1, 1, S), or None when the config attends every
        source position (`cross_attn_src_mask` off)."""
        return src_mask if self.config.cross_attn_src_mask else None

    # Forward -----------------------------------------------------------------------------------

    def embed(self, ids: np.ndarray, embedding: Embedding, position: Positions, norm=None, *, at=None,
              combine=norm_of_sum, tape=None) -> np.ndarray:
        """Token embedding, times sqrt(D) when the config says so (section 3.4), plus positions,
        then `norm` when the config has an embedding norm (BART's `layernorm_embedding`).

        The positions count from 0, or (`at`, a cached decoding step's one new token) from `at`.
        `combine` (keyword-only): the stack's `embedding_sum`, where its norm sits (`norm_of_sum`,
        or BlenderbotSmall's decoder's `sum_of_norm`)."""
        x = embedding(ids, self.dtype)  # (B, L, D)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.d_model)
        positions = position(ids, self.dtype) if at is None else position.at(at, ids, self.dtype)
        return combine(x, positions, norm, tape=tape)

    def embed_source(self, src_ids: np.ndarray, out: Encoded, *, tape=None) -> np.ndarray:
        """The encoder's input (B, S, D): the source tokens' embeddings (`embed`), or a features
        source through the front end (two convolutions, each followed by GELU; frontend.py)
        plus the positions 0 .. S - 1 (no embedding scale: there is no token table), then `norm`
        when the config has an embedding norm."""
        if self.encoder.frontend is None:
            return self.embed(src_ids, self.encoder.embedding, self.encoder.position, self.encoder.embedding_norm,
                              tape=tape)
        x = self.encoder.frontend(src_ids, self.dtype, out, tape=tape)  # (B, S, D)
        x = x + self.encoder.position.span(x.shape[1], self.dtype)
        norm = self.encoder.embedding_norm
        return x if norm is None else norm(x, tape=tape)

    @property
    def target_embedding(self) -> Embedding:
        """The decoder's token table: the encoder's when the embeddings are shared (section 3.4)."""
        return self.encoder.embedding if self.config.share_embeddings else self.decoder.embedding

    def logits(self, y: np.ndarray, *, tape=None) -> np.ndarray:
        """The logits (B, T, V) of `decoder.output` y: the output layer, plus BART's `final_logits_bias`."""
        logits = self.output(y, self.target_embedding, tape=tape)  # (B, T, V)
        if self.final_logits_bias is not None:
            logits = logits + self.logits_bias(cast(self.final_logits_bias, logits.dtype))
        return logits

    def encode(self, src_ids, src_mask=None, *, return_attention: bool = True, dropout=None, sink=None,
               tape=None) -> Encoded:
        """Run the encoder: the memory (B, S, D) plus its attention weights and intermediates
        (with a `sink`, handed to it one at a time instead).

        `tape` (keyword-only): an `impl_numpy.backward.Tape` that keeps what the backward pass
        reads (`loss_and_grads` passes one); None, the default, keeps nothing."""
        src_ids = self.source(src_ids)
        derived = source_mask(self.config, src_ids, self.encoder.frontend)  # (B, 1, 1, S)
        batch, src_len = derived.shape[0], derived.shape[-1]
        dropout = host_dropout(self.config, dropout, "encoder", batch, src_len)
        if src_mask is None:
            src_mask = derived
        else:
            shapes = expected_mask_shapes(self.config, batch, src_len, 1)
            src_mask = self._mask("src_mask", src_mask, shapes["src_mask"], derived)
        encoded = Encoded(memory=None, src_mask=src_mask, attention=record(sink if return_attention else None),
                          intermediates=record(sink))
        x = self.embed_source(src_ids, encoded, tape=tape)
        encoded.intermediates["encoder.embeddings"] = x
        x = apply_dropout(x, dropout, "encoder.embeddings")
        encoded.memory = self.encoder(x, src_mask, encoded, dropout=dropout, tape=tape)
        if not return_attention:  # None, not {}: "not asked for", never "no attention layers"
            encoded.attention = None
        return encoded

    def decode(self, tgt_ids, encoded: Encoded, tgt_mask=None, *, return_attention: bool = True,
               dropout=None, sink=None, tape=None) -> ModelOutput:
        """Run the decoder against `encode`'s result: logits (B, T, V) and everything recorded
        (with a `sink`, handed to it one at a time instead, the logits last).

        `tape`: as for `encode`."""
        tgt_ids = self._ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size)
        check_memory(self.config, encoded.memory.shape, encoded.memory.dtype.name, self.dtype.name)
        check_same_batch(encoded.memory.shape, tgt_ids.shape)
        batch, tgt_len = tgt_ids.shape
        dropout = host_dropout(self.config, dropout, "decoder", batch, tgt_len)
        derived = target_mask(self.config, tgt_ids)  # (B, 1, T, T)
        if tgt_mask is None:
            tgt_mask = derived
        else:
            shapes = expected_mask_shapes(self.config, batch, 1, tgt_len)
            tgt_mask = self._mask("tgt_mask", tgt_mask, shapes["tgt_mask"], derived)
        cross_mask = self.cross_mask(encoded.src_mask)
        out = ModelOutput(logits=None, attention=record(sink if return_attention else None, encoded.attention),
                          intermediates=record(sink, encoded.intermediates))

        y = self.embed(tgt_ids, self.target_embedding, self.decoder.position, self.decoder.embedding_norm,
                       combine=self.decoder.embedding_sum, tape=tape)
        out.intermediates["decoder.embeddings"] = y
        y = apply_dropout(y, dropout, "decoder.embeddings")
        y = self.decoder(y, encoded.memory, tgt_mask, cross_mask, out, dropout=dropout, tape=tape)
        logits = self.logits(y, tape=tape)
        assert logits.dtype == self.dtype, f"promoted to {logits.dtype}"
        if sink is not None:  # the sink has had every other tensor; the output keeps none of them
            sink("logits", logits)
            logits = None
        out.logits = logits
        if not return_attention:
            out.attention = None
        return out

    def __call__(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, *, return_attention: bool = True,
                 dropout=None, sink=None) -> ModelOutput:
        """logits (B, T, V) for source ids (B, S) and decoder input ids (B, T), plus the
        attention weights (`return_attention`) and the intermediates by name.

        `dropout` (keyword-only, training): a `conformance.core.dropout.Dropout` (masks drawn by
        `draw_dropout` from one NumPy seed); None, the default, is inference: no dropout.

        `sink` (keyword-only): `sink(name, tensor)` receives every attention map and intermediate
        as soon as it is computed, then the logits, in `forward_order`; the returned output then
        keeps none of them (conformance.core.output)."""
        encoded = self.encode(src_ids, src_mask, return_attention=return_attention, dropout=dropout, sink=sink)
        return self.decode(tgt_ids, encoded, tgt_mask, return_attention=return_attention, dropout=dropout, sink=sink)

    # Training ----------------------------------------------------------------------------------

    def loss_and_grads(self, src_ids, tgt_ids, labels, *, label_smoothing: float = 0.0, dropout=None):
        """The training loss of docs/training.md and its gradient for every parameter.

        Token-level cross-entropy against `labels` (B, T), with label smoothing, ignoring labels
        equal to pad_id and averaged over those that count; the same number as
        `torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
        ignore_index=pad_id, label_smoothing=label_smoothing)`. Returns `(loss, grads)`: a float
        and a dict keyed like `param_shapes(config)`, arrays of the model's dtype. The backward
        pass is written out by hand, layer by layer, in impl_numpy/backward.py. `dropout`: as for
        a call; the backward reads through the same masks.
        """
        src_ids = self.source(src_ids)
        tgt_ids = self._ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size)
        check_same_batch(src_ids.shape, tgt_ids.shape)
        labels = host_labels(self.config, labels, tgt_ids.shape)
        check_labels_finite(self.config, src_ids, tgt_ids, labels)
        check_label_smoothing(label_smoothing)
        batch, src_len = source_real(self.config, src_ids).shape
        encoder_drop = host_dropout(self.config, dropout, "encoder", batch, src_len)
        decoder_drop = host_dropout(self.config, dropout, "decoder", batch, tgt_ids.shape[1])
        if dropout is not None:  # one Dropout with every site's checked host mask
            dropout = Dropout(encoder_drop.rate, {**encoder_drop.masks, **decoder_drop.masks})
        # The forward pass, with a tape that keeps what the backward pass reads.
        tape = backprop.Tape()
        encoded = self.encode(src_ids, dropout=dropout, tape=tape)
        out = self.decode(tgt_ids, encoded, dropout=dropout, tape=tape)
        return backprop.loss_and_grads(self, src_ids, tgt_ids, labels, float(label_smoothing), out, tape, dropout)

    # Generation ------------------------------------------------------------------------------
    # The decoder with a KV cache: each layer keeps the keys and values of the positions so far,
    # and the memory's keys and values are projected once per source, so that a step costs O(T).
    # The cache, the cached step and the search driver live in impl_numpy/decode.py.

    def start_cache(self, encoded: Encoded, length: int) -> DecoderCache:
        """An empty cache for up to `length` positions against `encoded` (one row per decoder row)."""
        return decode.start_cache(self, encoded, length)

    def decode_step(self, tgt_ids, cache: DecoderCache) -> np.ndarray:
        """The next-token logits (B, V) after the newest tokens tgt_ids (B,), at position
        `cache.length`; the cache advances by one. Equals the last row of `decode` on the whole prefix.

        One exception, by design: with position_ids "non-pad" (M2M100) a pad token earlier in the
        prefix is counted by the step, as transformers' cached step counts it, and not by `decode`."""
        return decode.decode_step(self, tgt_ids, cache)

    def reorder_cache(self, cache: DecoderCache, rows) -> DecoderCache:
        """The cache of the rows `rows` (N,), in that order: beam search continues row rows[i] in row i."""
        return decode.reorder_cache(self, cache, rows)

    def generate(self, src_ids, max_len: int | None = None, bos_id: int | None = None, eos_id: int | None = None, *,
                 num_beams: int | None = None, length_penalty: float | None = None,
                 early_stopping: bool | str | None = None, use_cache: bool = True, length_penalty_form: str | None = None, forced_eos: bool | None = None,
                 banned_ids=None, bad_words_ids=None, no_repeat_ngram_size: int | None = None,
                 forced_bos_id: int | bool | None = None, min_length: int | None = None,
                 min_new_tokens: int | None = None, return_scores: bool = False, beam_rule: str = "hf",
                 num_return_sequences: int = 1, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 repetition_penalty: float | None = None, encoder_repetition_penalty: float | None = None,
                 encoder_no_repeat_ngram_size: int | None = None, exponential_decay_length_penalty=None,
                 suppress_tokens=None, begin_suppress_tokens=None, renormalize_logits: bool | None = None,
                 prefix=None, return_timestamps: bool | None = None, max_initial_timestamp_index: int | None = None,
                 return_no_speech_prob: bool = False, patience: float | None = None):
        """Greedy (num_beams=1), beam search or sampling: the best sequences per row after `bos_id`.

        Returns (B * num_return_sequences, n) ids with n <= max_len, `pad_id` after a row's `eos_id`
        (and their scores with `return_scores`). An argument left at None takes the checkpoint's
        "generation" note (as transformers applies generation_config), else its plain default;
        bos_id and eos_id must then be given. The choices are made by
        `conformance.core.generation.search.search` from this model's step logits: Hugging Face's beam rule,
        or Flax examples/wmt's with beam_rule="flax"; do_sample=True draws with temperature, top_k
        and top_p from uniforms of np.random.default_rng(seed) (docs/decoding.md). `use_cache=False`
        runs the decoder over the whole prefix at every step: the plain loop, O(T^2). Hugging Face's
        logits processors, in its order: `no_repeat_ngram_size`, `banned_ids` and `bad_words_ids`
        (lists of ids; a word of several tokens is banned where its start ends the sequence),
        `min_length` (the end token banned while the output plus the start token is shorter) and
        `min_new_tokens` (banned while the output is shorter; it replaces min_length, as in
        transformers), `forced_bos_id` (False: none, whatever the note says), `forced_eos`; and
        under transformers' names `repetition_penalty`, `encoder_repetition_penalty` and
        `encoder_no_repeat_ngram_size` (these two read src_ids as given, padding included),
        `exponential_decay_length_penalty` ((start, factor); False: none), `suppress_tokens`,
        `begin_suppress_tokens`, `renormalize_logits` (docs/decoding.md, "What is scored").
        `early_stopping` (beam_rule="hf"): the note's, else False.

        Whisper's decoding (docs/whisper.md): `prefix`, ids the decoder reads after bos_id before
        anything is chosen (a None: the detected language), which begin the returned rows (the
        note's forced prompt when None); `return_timestamps` and `max_initial_timestamp_index`,
        the timestamp rules; `return_no_speech_prob`, each source row's probability of the
        no-speech id at bos_id's position (B,), returned after the ids (and scores);
        beam_rule="openai" with `patience`, openai-whisper's beam search.
        """
        return decode.generate(self, src_ids, max_len, bos_id, eos_id, num_beams=num_beams,
                               length_penalty=length_penalty, early_stopping=early_stopping, use_cache=use_cache,
                               length_penalty_form=length_penalty_form, forced_eos=forced_eos,
                               banned_ids=banned_ids, bad_words_ids=bad_words_ids,
                               no_repeat_ngram_size=no_repeat_ngram_size, forced_bos_id=forced_bos_id,
                               min_length=min_length, min_new_tokens=min_new_tokens, return_scores=return_scores, beam_rule=beam_rule,
                               num_return_sequences=num_return_sequences, do_sample=do_sample,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                               repetition_penalty=repetition_penalty,
                               encoder_repetition_penalty=encoder_repetition_penalty,
                               encoder_no_repeat_ngram_size=encoder_no_repeat_ngram_size,
                               exponential_decay_length_penalty=exponential_decay_length_penalty,
                               suppress_tokens=suppress_tokens, begin_suppress_tokens=begin_suppress_tokens,
                               renormalize_logits=renormalize_logits, prefix=prefix,
                               return_timestamps=return_timestamps,
                               max_initial_timestamp_index=max_initial_timestamp_index,
                               return_no_speech_prob=return_no_speech_prob, patience=patience)
