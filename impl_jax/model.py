"""The encoder-decoder Transformer of "Attention Is All You Need", in Flax NNX.

This file is written to be read next to the paper (Vaswani et al., 2017) and next to
`impl_numpy/model.py`, the float64 oracle it is judged against: same sections, classes, functions
and local names, so that a diff of the two shows only framework idioms. Parameters are
`nnx.Param`s whose `.`-joined state paths are exactly the checkpoint's canonical names.

What differs from the NumPy file, and why:
    - every matmul passes `precision=matmul_precision()`: HIGHEST (full float32, no TF32 on any
      device) unless the model was built with `precision="default"` (impl_jax/precision.py);
    - the softmax and the LayerNorm statistics run in at least float32 (`reduction_dtype`);
    - ids, masks and params are validated on the host before compiled code runs: JAX would
      clamp an out-of-range id instead of failing;
    - `encode` and `decode` check their inputs on the host, then run a compiled `_encode` /
      `_decode` (one XLA executable per shape, see `impl_jax.compiled`);
    - lengths may be padded up to a bucket (`buckets`) to bound recompilation; attention then
      receives `real_keys`, which gives the added keys exactly zero weight (see
      `scaled_dot_product_attention`).

Shape legend:
    B batch, S source length, T target length, D d_model, H heads, K head dim (D / H),
    F d_ff, V target vocabulary. Tq / Tk are query / key lengths inside attention.

Sections, in the same order in every backend: masks, positions, building blocks, attention,
feed-forward, encoder layer, decoder layer, encoder and decoder, model.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conformance.core.config import ModelConfig
from conformance.core.generation.search import DecoderCache
from conformance.core.errors import InputError
from conformance.core.inputs import (
    check_label_smoothing,
    check_labels_finite,
    check_memory,
    check_same_batch,
    expected_mask_shapes,
    host_features,
    host_ids,
    host_labels,
    host_mask,
    source_real,
)
from conformance.core.dropout import Dropout, host_dropout
from conformance.core.output import Encoded, ModelOutput, send_in_order
from conformance.core.params import param_shapes
from conformance.core.positions import offset_buckets, position_table
from impl_jax import compiled, decode, host
from impl_jax.blocks import product_in_blocks
from impl_jax.frontend import FrontEnd
from impl_jax.loss import cross_entropy
from impl_jax.precision import check_precision, matmul_precision, model_precision, reduction_dtype

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")

# The result types are pytrees, so that `Model.traceable_forward` can return them from jit, vmap and friends.
for _result, _fields in ((ModelOutput, ["logits", "attention", "intermediates"]),
                         (Encoded, ["memory", "src_mask", "attention", "intermediates"]),
                         (DecoderCache, ["keys", "values", "cross_keys", "cross_values", "tgt_ids", "cross_mask",
                                         "length", "cross_fix_ups", "output_weight", "step_decoder"])):
    try:
        jax.tree_util.register_dataclass(_result, data_fields=_fields, meta_fields=[])
    except ValueError:  # already registered (by another JAX user of conformance.core.output)
        pass


# -- Masks -------------------------------------------------------------------------------------
# Masks are boolean, True = may attend, and broadcast against scores of shape (B, H, Tq, Tk).
# The model builds them on the host from checked ids, so these functions keep their input's kind:
# NumPy ids give NumPy masks (no device work, no compilation), JAX arrays give JAX arrays.


def padding_mask(ids: np.ndarray | jax.Array, pad_id: int) -> np.ndarray | jax.Array:
    """(B, L) ids -> (B, 1, 1, L): every query may attend to every non-padding key."""
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int) -> np.ndarray:
    """(1, 1, T, T) lower triangle: position t may attend to positions <= t (section 3.2.3)."""
    return np.tril(np.ones((length, length), dtype=bool))[None, None, :, :]


def target_mask(config: ModelConfig, tgt_ids: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
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


def source_mask(config: ModelConfig, src_ids, frontend=None) -> np.ndarray | jax.Array:
    """(B, 1, 1, S): source padding on the keys; a features source (B, n_mels, frames) has none,
    so every one of its S = frames / 2 positions may be attended.

    `frontend`: the model's front end, whose `positions(frames)` give S (None: frames / 2)."""
    if config.source == "features":
        frames = src_ids.shape[2]
        length = frames // 2 if frontend is None else frontend.positions(frames)
        return np.ones((src_ids.shape[0], 1, 1, length), dtype=bool)
    return padding_mask(src_ids, config.pad_id)


def make_masks(config: ModelConfig, src_ids, tgt_ids) -> tuple[np.ndarray | jax.Array, np.ndarray | jax.Array]:
    """The masks a model derives from its ids: src_mask (B, 1, 1, S) and tgt_mask (B, 1, T, T)."""
    return source_mask(config, src_ids), target_mask(config, tgt_ids)


# -- Positions ---------------------------------------------------------------------------------


class Sinusoid(nnx.Variable):
    """A constant of the config held on the model's device (a sinusoid table, T5's buckets per
    offset): neither a parameter nor saved."""


class Positions(nnx.Module):
    """The position term added to the scaled token embeddings (section 3.5).

    A sinusoid (a constant of the config, computed in float64) or a stored table, of
    `max_len + position_offset` rows: position p reads row p + position_offset (BART's learned
    table and M2M100's sinusoid skip 2 rows). With position_ids "non-pad" (M2M100/NLLB) only the
    tokens that are not the pad id are numbered, and a pad token gets no position term.
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str, dtype, *, length: int):
        # `length`: the stack's longest sequence (max_len; a features source's encoder: source_len)
        if config.position == "table":
            self.table = nnx.Param(params[f"{prefix}.table"])
        else:
            # Cast on the host from float64, once: the same rounding as the NumPy backend's table.
            table = position_table(config, length)  # (length + offset, D) float64
            self.table = Sinusoid(jnp.asarray(table.astype(dtype)))
        self.offset = config.position_offset
        self.pad_id = config.pad_id if config.position_ids == "non-pad" else None

    def rows(self, ids: jax.Array):
        """The table row each token reads (B, L), and where it adds one (B, L), or True: all do."""
        length = ids.shape[1]
        if self.pad_id is None:
            return jnp.arange(self.offset, self.offset + length)[None, :], True  # (1, L)
        real = ids != self.pad_id  # (B, L)
        counted = jnp.cumsum(real, axis=1) - 1  # (B, L): the real tokens before each one
        return self.offset + jnp.maximum(counted, 0), real

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        """The terms of the tokens `ids` (B, L): (1, L, D), or (B, L, D) with "non-pad" ids."""
        if self.pad_id is None:  # a slice, not a gather: (1, L, D)
            return cast(self.table[...][None, self.offset:self.offset + ids.shape[1], :], dtype)
        rows, real = self.rows(ids)
        return jnp.where(real[..., None], cast(self.table[...][rows], dtype), 0).astype(dtype)  # (B, L, D)

    def at(self, position, ids: jax.Array, dtype) -> jax.Array:
        """The term of one position for the tokens `ids` (B, 1), for a cached decoding step: row
        position + offset, as transformers' cached step reads it (no pad token before it is counted)."""
        term = cast(jax.lax.dynamic_slice_in_dim(self.table[...], self.offset + position, 1)[None, :, :], dtype)  # (1, 1, D)
        return term if self.pad_id is None else jnp.where((ids != self.pad_id)[..., None], term, 0).astype(dtype)

    def span(self, length: int, dtype) -> jax.Array:
        """The terms of positions 0 .. length - 1 of a source with no padding (a features source):
        rows offset .. offset + length - 1, (1, L, D)."""
        return cast(self.table[...][None, self.offset:self.offset + length, :], dtype)  # (1, L, D)

    def score_bias(self, query_len: int, key_len: int, dtype, *, first_query=0):
        """An absolute position term adds nothing to the attention scores: None."""
        return None


class RelativeBuckets(nnx.Module):
    """UMT5's relative positions: no term on the embeddings; the stack computes the bucket of every
    (query, key) once (T5's `_relative_position_bucket`), and each self-attention layer reads them in
    a table of its own (`relative_bias_per_layer`: `own_table_bias`); T5's `RelativePositionBias`
    reads them in the stack's one table."""

    def __init__(self, config: ModelConfig, *, bidirectional: bool, length: int):
        buckets = offset_buckets(config, bidirectional=bidirectional, length=length)  # (2 L - 1,): n at n + L - 1
        self.buckets = Sinusoid(jnp.asarray(buckets, dtype=jnp.int32))
        self.max_len = length

    def __call__(self, ids: jax.Array, dtype):
        return 0  # nothing is added to the embeddings

    def at(self, position, ids: jax.Array, dtype):
        return 0

    def span(self, length: int, dtype):
        return 0

    def score_bias(self, query_len: int, key_len: int, dtype, *, first_query=0) -> jax.Array:
        """(Tq, Tk): the buckets of queries first_query .. + Tq - 1 against keys 0 .. Tk - 1.

        `first_query` may be traced: a cached step's position."""
        query = first_query + jnp.arange(query_len)  # (Tq,)
        return self.buckets[...][jnp.arange(key_len)[None, :] - query[:, None] + self.max_len - 1]  # (Tq, Tk)


class RelativePositionBias(RelativeBuckets):
    """T5's relative position bias: no term on the embeddings; a learned (buckets, H) table whose
    row bucket(j - i) is added to every self-attention score of query i and key j in the stack
    (bidirectional in the encoder, causal in the decoder; `conformance.core.positions`)."""

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str, *, bidirectional: bool,
                 length: int):
        super().__init__(config, bidirectional=bidirectional, length=length)
        self.relative_bias = nnx.Param(params[f"{prefix}.relative_bias"])  # (buckets, H)

    def score_bias(self, query_len: int, key_len: int, dtype, *, first_query=0) -> jax.Array:
        """(1, H, Tq, Tk): the bias of queries first_query .. + Tq - 1 against keys 0 .. Tk - 1.

        `first_query` may be traced: a cached step's position."""
        buckets = super().score_bias(query_len, key_len, dtype, first_query=first_query)  # (Tq, Tk)
        return cast(self.relative_bias[...][buckets], dtype).transpose(2, 0, 1)[None]  # (1, H, Tq, Tk)


def positions(config: ModelConfig, params: Mapping[str, jax.Array], prefix: str, dtype, *, bidirectional: bool,
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


def cast(w: jax.Array, dtype) -> jax.Array:
    """w in `dtype`: w itself when it already is, else one rounding (exact when it widens).

    One exception: XLA rounds float64 to float16 through float32, so float64 parameters computed
    in float16 differ from NumPy's direct rounding (the core's up-front cast) in about one value in
    20000, by one float16 ulp (measured on 2e6 values; bfloat16 and float32 targets agree)."""
    return w if w.dtype == dtype else w.astype(dtype)


def at_least_float32(x: jax.Array) -> jax.Array:
    """float16 / bfloat16 -> float32; float32 and float64 unchanged."""
    return x.astype(reduction_dtype(x.dtype))


def optional_param(params: Mapping[str, jax.Array], name: str) -> nnx.Param | None:
    """The parameter `name` if the config has it (biases are switches), else None."""
    return nnx.Param(params[name]) if name in params else None


class Linear(nnx.Module):
    """y = x W + b, with W stored (d_in, d_out) as in the paper's notation."""

    def __init__(self, params: Mapping[str, jax.Array], prefix: str):
        self.weight = nnx.Param(params[f"{prefix}.weight"])
        self.bias = optional_param(params, f"{prefix}.bias")

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.matmul(x, cast(self.weight[...], x.dtype), precision=matmul_precision())
        if self.bias is not None:
            y = y + cast(self.bias[...], x.dtype)
        return y


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis, in the form the config names.

    standard:       y = (x - mean) / sqrt(var + eps) * weight + bias   (biased variance)
    std-eps:        y = (x - mean) / (std + eps) * weight + bias       (unbiased std; the
                    Annotated Transformer's own LayerNorm)
    fast-variance:  as standard, with var = max(E[x^2] - E[x]^2, 0)    (Flax nn.LayerNorm)
    rms:            y = x / sqrt(mean(x^2) + eps) * weight             (T5LayerNorm: RMSNorm, no
                    mean, no bias)

    Not `nnx.LayerNorm`: its epsilon defaults to 1e-6 (PyTorch's is 1e-5) and its fast variance
    E[x^2] - E[x]^2 cancels catastrophically when |mean| >> std. Here epsilon always comes from the
    config and the variance is the mean of squared deviations, as in the oracle, unless the config
    names the fast form (to reproduce a Flax model, exactly as the oracle computes it). Float16 and
    bfloat16 inputs are normalised in float32 (PyTorch's kernels do the same).
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str):
        self.weight = nnx.Param(params[f"{prefix}.weight"])
        self.bias = optional_param(params, f"{prefix}.bias")  # None for rms
        self.eps = config.layer_norm_eps
        self.form = config.layer_norm_form

    # One function under differentiation (a nested jit, which XLA inlines: the same forward, bit for
    # bit): x's gradient through the norm is summed inside it before it meets the residual's. Spread
    # out, a pre-LN stack's backward chained every layer's norm into XLA's fusions below it, and
    # its step compiled about 2x slower (docs/jax-compile.md). Traced once per shape, not once per
    # layer. (Called on its own, outside the model's programs, a norm compiles an executable of its
    # own, which impl_jax.compiled's cache does not count.)
    @jax.jit
    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x = at_least_float32(x)
        if self.form == "rms":
            normed = x / jnp.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps)
            return (normed * cast(self.weight[...], dtype)).astype(dtype)
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        if self.form == "standard":
            var = (centered * centered).mean(axis=-1, keepdims=True)
            normed = centered / jnp.sqrt(var + self.eps)
        elif self.form == "fast-variance":
            var = jnp.maximum((x * x).mean(axis=-1, keepdims=True) - mean * mean, 0)
            normed = centered / jnp.sqrt(var + self.eps)
        else:
            std = jnp.sqrt((centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1))
            normed = centered / (std + self.eps)
        return (normed * cast(self.weight[...], dtype) + cast(self.bias[...], dtype)).astype(dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    """ReLU (the paper), GELU (erf form), GELU with the tanh approximation, SiLU/swish, or tanh."""
    if name == "relu":
        return jnp.maximum(x, 0)
    if name == "gelu":
        # 0.5 x (1 + erf(x / sqrt 2)), the exact form (jax.nn.gelu defaults to the tanh one).
        erf = jax.lax.erf(x * (1 / math.sqrt(2)))
        return 0.5 * x * (1 + erf)
    if name == "gelu-tanh":
        return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "tanh":  # AlgoPerf WMT's GLU variant
        return jnp.tanh(x)
    # silu(x) = x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2, which cannot overflow.
    return x * (0.5 * (1 + jnp.tanh(0.5 * x)))


def apply_dropout(x: jax.Array, dropout, site: str) -> jax.Array:
    """Inverted dropout (section 5.4): x / (1 - rate) where the site's mask keeps, 0 where it drops.

    `dropout` is None (off: x itself) or a `conformance.core.dropout.Dropout` whose masks, drawn
    from one NumPy seed, every backend receives, so a training step with dropout is the same
    computation everywhere. A select, not a product: a dropped NaN is 0 as in PyTorch's kernel."""
    if dropout is None:
        return x
    return jnp.where(dropout.masks[site], x / (1 - dropout.rate), 0).astype(x.dtype)  # (B, L, D)


# -- Attention ---------------------------------------------------------------------------------


def softmax(scores: jax.Array) -> jax.Array:
    """softmax over the last axis. A row whose every score is -inf gives NaN (0 / 0), on purpose.

    Written out rather than `jax.nn.softmax`, whose `where=` masking decides fully masked rows
    by itself; here they follow the config's fill, exactly as in the oracle. Such a row is
    detected and written as NaN explicitly, so that exp never sees -inf - (-inf): compiled by
    XLA:CPU (jaxlib 0.10), exp of that NaN can come out as an arbitrary finite number once XLA
    folds the row's reduction (a single key), which is what `jax.nn.softmax` returns there.
    """
    row_max = scores.max(axis=-1, keepdims=True)
    empty = row_max == -jnp.inf  # every key masked with a -inf fill: the oracle's 0 / 0
    shifted = jnp.where(empty, 0, scores - row_max)
    e = jnp.exp(shifted)
    return jnp.where(empty, jnp.nan, e / e.sum(axis=-1, keepdims=True))


def replace_masked(scores: jax.Array, mask, fill: float) -> jax.Array:
    """s' = fill where masked, else s: a masked score becomes a constant (`masked_fill`, Flax)."""
    return jnp.where(mask, scores, fill)


def add_to_masked(scores: jax.Array, mask, fill: float) -> jax.Array:
    """s' = s + fill where masked, else s: transformers' eager attention adds a mask of
    finfo(dtype).min. The fill swamps the score (config.ADDED_FILL_LIMIT), so the value is the
    fill's, but the score is still an input of the sum: the backward pass reaches it."""
    return scores + jnp.where(mask, 0.0, fill).astype(scores.dtype)


def masking(config: ModelConfig):
    """How masked scores meet the fill: `replace_masked` or `add_to_masked` (config.masked_scores)."""
    return add_to_masked if config.masked_scores == "added" else replace_masked


def scaled_dot_product_attention(q, k, v, mask, fill: float, *, scaled: bool = True, bias=None, real_keys=None,
                                 masked=replace_masked, empty_rows=None):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(K) + bias) V  (section 3.2.1).

    q: (B, H, Tq, K); k, v: (B, H, Tk, K); mask: boolean, broadcastable to (B, H, Tq, Tk), or
    None. Masked scores are replaced by `fill` before the softmax. Returns the output
    (B, H, Tq, K) and the weights (B, H, Tq, Tk).

    `scaled=False` (keyword-only) drops the 1 / sqrt(K) (T5: scores = Q K^T); `bias` (keyword-only),
    broadcastable to (B, H, Tq, Tk), is added to the scores before the mask (T5's relative
    position bias, `score_bias`).

    The scores and the softmax are computed in at least float32. `real_keys` (Tk,) is False at
    keys that exist only because the length was padded up to a bucket: they get weight exactly 0
    (a -inf score, even in a fully masked row, whose uniform average stays over the real keys),
    and their values are zeroed so that a NaN there cannot leak into real rows as 0 * NaN.

    `masked` (keyword-only): how a masked score meets the fill, `replace_masked` (the default) or
    `add_to_masked` (config.masked_scores).

    `empty_rows` (keyword-only; 0.0 for empty_rows "zeros", and in the loss for a -inf fill,
    docs/training.md) gives a query with no key to attend to weights `empty_rows` instead of the
    softmax of its filled row, so that a NaN activation cannot reach a weight gradient as
    0 * NaN. (`softmax` already keeps exp away from a -inf row, and the gradient of a `where`
    selects, so no NaN enters the backward pass.)
    """
    dtype = reduction_dtype(q.dtype)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=matmul_precision(),
                        preferred_element_type=dtype)  # (B, H, Tq, Tk)
    if scaled:
        scores = scores / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = masked(scores, mask, fill)
    if real_keys is not None:
        scores = jnp.where(real_keys, scores, -jnp.inf)
        v = jnp.where(real_keys[:, None], v, 0)
    weights = softmax(scores).astype(q.dtype)  # (B, H, Tq, Tk)
    if empty_rows is not None and mask is not None:
        allowed = jnp.broadcast_to(mask, scores.shape) if real_keys is None else mask & real_keys  # (B, H, Tq, Tk)
        empty = ~allowed.any(axis=-1, keepdims=True)  # (B, H, Tq, 1): queries without a key
        weights = jnp.where(empty, jnp.asarray(empty_rows, weights.dtype), weights)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v, precision=matmul_precision()), weights  # (B, H, Tq, K)


def passed_bias(attention, bias, dtype):
    """The score bias as the stack computed it: T5's shared table read at the buckets, or None."""
    return bias


def own_table_bias(attention, buckets, dtype) -> jax.Array:
    """UMT5: this attention's own (buckets, H) table read at the stack's buckets (Tq, Tk)."""
    return cast(attention.relative_bias[...][buckets], dtype).transpose(2, 0, 1)[None]  # (1, H, Tq, Tk)


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o, head_h = Attention(Q W_q^h, K W_k^h, V W_v^h)
    (section 3.2.2). Head h owns columns h*K .. (h+1)*K - 1 of W_q, W_k and W_v."""

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str, *,
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
        self.relative_bias = nnx.Param(params[f"{prefix}.relative_bias"]) if own_bias else None
        self.layer_bias = own_table_bias if own_bias else passed_bias

    def split_heads(self, x: jax.Array) -> jax.Array:
        batch, length, _ = x.shape
        x = x.reshape(batch, length, self.n_heads, self.head_dim)  # (B, L, H, K)
        return x.transpose(0, 2, 1, 3)  # (B, H, L, K)

    def queries(self, x: jax.Array) -> jax.Array:
        """The queries x W_q split into heads (B, H, Tq, K), times the attention temperature:
        AlgoPerf's `attention_temp` scales the queries, so scores = temp * Q K^T / sqrt(K)."""
        q = self.split_heads(self.q_proj(x))  # (B, H, Tq, K)
        return q if self.temperature == 1.0 else q * self.temperature

    def __call__(self, x: jax.Array, memory: jax.Array, mask, *, bias=None, real_keys=None, empty_rows=None,
                 cache=None):
        """x: (B, Tq, D) queries; memory: (B, Tk, D) keys and values (x itself for self-attention).

        `bias` (keyword-only): added to the scores, (1, H, Tq, Tk) (T5's relative position bias).
        `cache` (keyword-only; a cached decoding step, impl_jax/decode.py): where the keys and
        values come from instead, `cache.keys_values(self, memory)`. `empty_rows`: the loss's rule
        for a query with no key (0.0), which reaches the NaN rows of a -inf fill only (a finite
        fill's are uniform); the config's own rule (empty_rows "zeros") comes first."""
        q = self.queries(x)  # (B, H, Tq, K)
        if cache is None:
            k, v = self.keys_values(memory)  # (B, H, Tk, K) each
        else:
            k, v = cache.keys_values(self, memory)
        bias = self.layer_bias(self, bias, reduction_dtype(q.dtype))  # (1, H, Tq, Tk), or None
        empty_rows = self.empty_rows if self.empty_rows is not None else empty_rows if math.isinf(self.fill) else None
        heads, weights = scaled_dot_product_attention(q, k, v, mask, self.fill, scaled=self.scaled, bias=bias,
                                                      real_keys=real_keys, masked=self.masked, empty_rows=empty_rows)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)  # (B, Tq, H K)
        return self.o_proj(concat), weights

    def keys_values(self, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The projected keys and values of `memory` (B, Tk, D), each (B, H, Tk, K), for the cache."""
        return self.split_heads(self.k_proj(memory)), self.split_heads(self.v_proj(memory))


# -- Feed-forward ------------------------------------------------------------------------------


class FeedForward(nnx.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2  (section 3.3; the paper's act is ReLU).

    With `ffn_glu` the activated units are multiplied by a linear gate (AlgoPerf's GLU, `MlpBlock`
    in algoperf/workloads/wmt/wmt_jax/models.py, `_ff_block` in wmt_pytorch/models.py):
        FFN(x) = (act(x W_1 + b_1) * (x W_gate + b_gate)) W_2 + b_2
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str):
        self.linear1 = Linear(params, f"{prefix}.linear1")
        self.gate = Linear(params, f"{prefix}.gate") if config.ffn_glu else None
        self.linear2 = Linear(params, f"{prefix}.linear2")
        self.activation = config.activation

    def __call__(self, x: jax.Array) -> jax.Array:
        units = activation(self.activation, self.linear1(x))  # (B, L, F)
        if self.gate is not None:
            units = units * self.gate(x)  # the linear gate branch (B, L, F)
        return self.linear2(units)


# -- Encoder layer -----------------------------------------------------------------------------
# Each sublayer is wrapped with a residual connection and a LayerNorm (sections 3.1 and 5.4):
#     post-LN (the paper):  x = LN(x + Sublayer(x))
#     pre-LN:               x = x + Sublayer(LN(x))
# `src_real` / `tgt_real` are the bucket-padding markers passed on to attention (None unbucketed);
# `empty_rows` is attention's rule for a query with no key (see scaled_dot_product_attention).


def sublayer(x: jax.Array, fn, norm: LayerNorm, pre_ln: bool, dropout=None, site: str = ""):
    """x = LN(x + Sublayer(x)) (post-LN, the paper) or x + Sublayer(LN(x)) (pre-LN), the
    sublayer's output dropped out at `site` before the sum (sections 3.1 and 5.4).

    `fn(h)` returns the sublayer's output and its attention weights (None for the feed-forward);
    returns the new x and those weights."""
    h, weights = fn(norm(x) if pre_ln else x)
    h = apply_dropout(h, dropout, site)
    return (x + h if pre_ln else norm(x + h)), weights


class EncoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str):
        self.self_attn = MultiHeadAttention(config, params, f"{prefix}.self_attn", own_bias=config.relative_bias_per_layer)
        self.self_attn_norm = LayerNorm(config, params, f"{prefix}.self_attn_norm")
        self.ffn = FeedForward(config, params, f"{prefix}.ffn")
        self.ffn_norm = LayerNorm(config, params, f"{prefix}.ffn_norm")
        self.pre_ln = config.norm_placement == "pre"

    def __call__(self, x: jax.Array, src_mask, name: str, out: ModelOutput | Encoded, *, bias=None, src_real=None,
                 dropout=None, empty_rows=None) -> jax.Array:
        # `bias`: the self-attention's score bias (T5's relative positions), or None.
        # Self-attention: each source position attends to every unmasked source position.
        x, out.attention[f"{name}.self"] = sublayer(
            x, lambda h: self.self_attn(h, h, src_mask, bias=bias, real_keys=src_real, empty_rows=empty_rows),
            self.self_attn_norm, self.pre_ln, dropout, f"{name}.self_attn")
        out.intermediates[f"{name}.self_attn"] = x

        # Position-wise feed-forward.
        x, _ = sublayer(x, lambda h: (self.ffn(h), None), self.ffn_norm, self.pre_ln,
                        dropout, f"{name}.ffn")
        out.intermediates[f"{name}.ffn"] = x
        return x


# -- Decoder layer -----------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str):
        self.self_attn = MultiHeadAttention(config, params, f"{prefix}.self_attn", own_bias=config.relative_bias_per_layer)
        self.self_attn_norm = LayerNorm(config, params, f"{prefix}.self_attn_norm")
        self.cross_attn = MultiHeadAttention(config, params, f"{prefix}.cross_attn")
        self.cross_attn_norm = LayerNorm(config, params, f"{prefix}.cross_attn_norm")
        self.ffn = FeedForward(config, params, f"{prefix}.ffn")
        self.ffn_norm = LayerNorm(config, params, f"{prefix}.ffn_norm")
        self.pre_ln = config.norm_placement == "pre"

    def __call__(self, x, memory, tgt_mask, cross_mask, name: str, out: ModelOutput, *,
                 bias=None, tgt_real=None, src_real=None, dropout=None, empty_rows=None, cache=None) -> jax.Array:
        # `bias`: the self-attention's score bias (T5's relative positions), or None.
        # `cache`: the (self, cross) attentions' key and value sources of a cached step (decode.py).
        self_cache, cross_cache = (None, None) if cache is None else cache
        # Masked self-attention: position t attends to target positions <= t.
        x, out.attention[f"{name}.self"] = sublayer(
            x, lambda h: self.self_attn(h, h, tgt_mask, bias=bias, real_keys=tgt_real, empty_rows=empty_rows,
                                        cache=self_cache),
            self.self_attn_norm, self.pre_ln, dropout, f"{name}.self_attn")
        out.intermediates[f"{name}.self_attn"] = x

        # Cross-attention: queries from the decoder, keys and values from the encoder's memory.
        x, out.attention[f"{name}.cross"] = sublayer(
            x, lambda h: self.cross_attn(h, memory, cross_mask, real_keys=src_real, empty_rows=empty_rows,
                                         cache=cross_cache),
            self.cross_attn_norm, self.pre_ln, dropout, f"{name}.cross_attn")
        out.intermediates[f"{name}.cross_attn"] = x

        # Position-wise feed-forward.
        x, _ = sublayer(x, lambda h: (self.ffn(h), None), self.ffn_norm, self.pre_ln,
                        dropout, f"{name}.ffn")
        out.intermediates[f"{name}.ffn"] = x
        return x


# -- Encoder and decoder -----------------------------------------------------------------------


def norm_of_sum(tokens: jax.Array, positions, norm) -> jax.Array:
    """LN(E x s + P): the embedding norm on the scaled tokens plus the position term (BART's
    `layernorm_embedding`), or E x s + P without one (section 3.4)."""
    x = tokens + positions
    return x if norm is None else norm(x)


def sum_of_norm(tokens: jax.Array, positions, norm) -> jax.Array:
    """LN(E x s) + P: the embedding norm on the scaled tokens alone, the position term added
    after it (BlenderbotSmall's decoder, `decoder_embedding_norm = "tokens"`)."""
    return norm(tokens) + positions


def embedding_sum(config: ModelConfig, stack: str):
    """How a stack combines its tokens, positions and embedding norm: `sum_of_norm` for a decoder
    with `decoder_embedding_norm = "tokens"`, else `norm_of_sum`."""
    return sum_of_norm if stack == "decoder" and config.decoder_embedding_norm == "tokens" else norm_of_sum


class Embedding(nnx.Module):
    """A token lookup table (V, D). With `freeze_pad_embedding` the lookups of pad_id send its row
    no gradient (`nn.Embedding(padding_idx=pad_id)`); the forward is the same."""

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], prefix: str):
        self.weight = nnx.Param(params[f"{prefix}.weight"])
        self.padding_idx = config.pad_id if config.freeze_pad_embedding else None

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        # The ids were checked on the host: JAX would clamp an out-of-range id here, not fail.
        rows = self.weight[...][ids]  # (B, L, D)
        if self.padding_idx is not None:  # the same values; no gradient through the pad lookups
            rows = jnp.where((ids == self.padding_idx)[..., None], jax.lax.stop_gradient(rows), rows)
        return cast(rows, dtype)  # the looked-up rows cast, not the table


class Encoder(nnx.Module):
    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], dtype):
        self.config = config
        # The source's input: a token table, or a features source's front end (impl_jax/frontend.py).
        self.embedding = Embedding(config, params, "encoder.embedding") if config.source == "ids" else None
        self.frontend = FrontEnd(params, "encoder.frontend") if config.source == "features" else None
        self.position = positions(config, params, "encoder.position", dtype, bidirectional=True, length=config.source_len)
        self.embedding_norm = LayerNorm(config, params, "encoder.embedding_norm") if config.embedding_norm else None
        self.embedding_sum = embedding_sum(config, "encoder")
        self.layers = nnx.List(
            [EncoderLayer(config, params, f"encoder.layers.{i}") for i in range(config.n_encoder_layers)])
        self.norm = LayerNorm(config, params, "encoder.norm") if config.final_encoder_norm else None

    def __call__(self, x: jax.Array, src_mask, out: Encoded, *, src_real=None, dropout=None,
                 empty_rows=None) -> jax.Array:
        self_mask = encoder_self_mask(self.config, src_mask)  # (B, 1, 1, S) or (B, 1, S, S)
        bias = self.score_bias(x.shape[1], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, self_mask, f"encoder.{i}", out, bias=bias, src_real=src_real, dropout=dropout,
                      empty_rows=empty_rows)
        x = self.finish(x)
        out.intermediates["encoder.output"] = x
        return x

    # The stack's own steps around its layers, named so that a caller running one layer at a
    # time (impl_jax/stream.py) takes these same steps.

    def score_bias(self, length: int, dtype):
        """The score bias every layer's self-attention adds for x of `dtype`: T5's relative positions."""
        bias = self.position.score_bias(length, length, reduction_dtype(dtype))  # (1, H, S, S), or None
        return bias

    def finish(self, x: jax.Array) -> jax.Array:
        """`encoder.output`: x after the last layer through the final LayerNorm, when the config has one."""
        return x if self.norm is None else self.norm(x)


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array], dtype):
        # With shared embeddings the decoder reads the encoder's table (see Model.decode).
        self.embedding = None if config.share_embeddings else Embedding(config, params, "decoder.embedding")
        self.position = positions(config, params, "decoder.position", dtype, bidirectional=False, length=config.max_len)
        self.embedding_norm = LayerNorm(config, params, "decoder.embedding_norm") if config.embedding_norm else None
        self.embedding_sum = embedding_sum(config, "decoder")
        self.layers = nnx.List(
            [DecoderLayer(config, params, f"decoder.layers.{i}") for i in range(config.n_decoder_layers)])
        self.norm = LayerNorm(config, params, "decoder.norm") if config.final_decoder_norm else None

    def __call__(self, x, memory, tgt_mask, cross_mask, out: ModelOutput, *, bias=None, tgt_real=None, src_real=None,
                 dropout=None, empty_rows=None, cache=None) -> jax.Array:
        # `bias`: the self-attention's score bias (a cached step's row of it); None: the stack's own.
        if bias is None:
            bias = self.score_bias(x.shape[1], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, tgt_mask, cross_mask, f"decoder.{i}", out, bias=bias, tgt_real=tgt_real,
                      src_real=src_real, dropout=dropout, empty_rows=empty_rows, cache=None if cache is None else cache[i])
        x = self.finish(x)
        out.intermediates["decoder.output"] = x
        return x

    # The stack's own steps around its layers, as in `Encoder`.

    def score_bias(self, length: int, dtype):
        """The score bias every layer's self-attention adds for y of `dtype`: T5's relative positions."""
        bias = self.position.score_bias(length, length, reduction_dtype(dtype))  # (1, H, T, T), or None
        return bias

    def finish(self, x: jax.Array) -> jax.Array:
        """`decoder.output`: y after the last layer through the final LayerNorm, when the config has one."""
        return x if self.norm is None else self.norm(x)


class Output(nnx.Module):
    """logits = y W_out + b_out. W_out is `output.weight` (D, V), or the target embedding
    transposed when the output is tied to it (section 3.4). With `scale_logits`,
    logits = y W_out / sqrt(D) + b_out (Flax examples/wmt's `logits_via_embedding`).

    The product y W_out is taken a block of vocabulary columns at a time (impl_jax/blocks.py):
    a W_out stored narrower than the compute dtype is never widened whole outside differentiation."""

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array]):
        self.weight = None if config.tie_output else nnx.Param(params["output.weight"])
        self.bias = optional_param(params, "output.bias")
        self.scale_logits = config.scale_logits

    def __call__(self, y: jax.Array, tied_embedding: Embedding) -> jax.Array:
        # W_out as stored: `output.weight` (D, V), or the tied embedding (V, D)
        weight, vocab_axis = (tied_embedding.weight[...], 0) if self.weight is None else (self.weight[...], 1)
        logits = product_in_blocks(y, weight, vocab_axis, cast)  # (B, T, V)
        if self.scale_logits:
            logits = logits / math.sqrt(y.shape[-1])
        if self.bias is not None:
            logits = logits + cast(self.bias[...], y.dtype)
        return logits


# -- Model -------------------------------------------------------------------------------------


def trained_bias(bias: jax.Array) -> jax.Array:
    """BART's final_logits_bias trained (freeze_final_logits_bias off): its values, and a gradient."""
    return bias


def frozen_bias(bias: jax.Array) -> jax.Array:
    """BART's final_logits_bias frozen, as transformers' buffer: its values, and no gradient.

    Behind `jax.lax.stop_gradient`: its gradient is a zero one."""
    return jax.lax.stop_gradient(bias)


class Model(nnx.Module):
    """The whole encoder-decoder (figure 1 of the paper), configured by a `ModelConfig`.

    `Model(config, params)` takes the canonical parameters (see `conformance.core.params`) as
    NumPy or JAX arrays (None: the seeded `init_params(config)`, held in float32 unless `dtype`
    says otherwise, because float64 needs x64); `dtype` casts them (float32, float64, float16 or
    bfloat16; default: their own dtype); the cast values must be finite too. `device`
    (keyword-only: "cpu", "gpu", or a `jax.Device`; default: JAX's default device) is where the
    parameters live and every computation runs; one that is not present is an `InputError`.
    float64 needs 64-bit JAX (see `impl_jax.enable_x64`).

    `param_dtype` (keyword-only; any of `SUPPORTED_DTYPES`; default None: `dtype`) stores the
    parameters in another dtype than the one the model computes in (Flax's `param_dtype` /
    `dtype`): `Model(config, params32, "float64", param_dtype="float32")` holds the float32 values
    as they are (half a float64 model's memory) and widens each where it is used (`cast`),
    exactly, so every output equals the float64 model's built from the same values, bit for bit;
    float32 parameters with `dtype="bfloat16"` is mixed precision. `dtype` stays the compute
    dtype; `loss_and_grads` returns gradients in `param_dtype` (jax.grad's: computed in `dtype`,
    rounded once). The parameters' dtype is part of what an executable is compiled for. Either
    dtype being float64 needs 64-bit JAX.

    `buckets` (e.g. (8, 16, 32)) pads every source and target length up to the next bucket
    (lengths above the last bucket go to `max_len`), so that at most len(buckets) + 1 lengths per
    side are ever compiled; results on the real positions equal the unpadded ones within rounding.

    `precision` (keyword-only) is the float32 matmul precision: "highest" (the default, and what
    every conformance run uses: full float32 on every device) or "default" (the device's fast
    passes, TF32 on recent NVIDIA GPUs; the same as "highest" on a CPU), for users who only run
    the model. Its measured error against the oracle is in docs/tolerances.md.
    """

    backend = "jax"

    def __init__(self, config: ModelConfig, params: Mapping[str, jax.Array] | None = None, dtype=None, *,
                 device=None, param_dtype=None, buckets=None, precision: str = "highest"):
        self.precision = check_precision(precision)
        params, self.dtype = host.prepare_params(config, params, dtype, SUPPORTED_DTYPES, host.resolve_device(device),
                                                 param_dtype=param_dtype)
        self.config = config
        self.buckets = host.check_buckets(buckets)
        self.encoder = Encoder(config, params, self.dtype)
        self.decoder = Decoder(config, params, self.dtype)
        self.output = Output(config, params)
        self.final_logits_bias = optional_param(params, "final_logits_bias")
        self.frozen_logits_bias = config.freeze_final_logits_bias  # a buffer in transformers: no gradient
        self.logits_bias = frozen_bias if config.freeze_final_logits_bias else trained_bias

    @property
    def params(self) -> dict[str, jax.Array]:
        """The canonical parameters by name, in checkpoint order: the model's `nnx.Param` state,
        flattened with dots (exactly `conformance.core.params.param_shapes(config)`'s keys)."""
        flat = {".".join(str(part) for part in path): variable[...]
                for path, variable in nnx.to_flat_state(nnx.state(self, nnx.Param))}
        return {name: flat[name] for name in param_shapes(self.config)}

    @property
    def param_dtype(self) -> np.dtype:
        """The dtype the parameters are stored in (`dtype` is the one they are computed in)."""
        return self.target_embedding.weight[...].dtype

    @property
    def device(self) -> jax.Device:
        """The device the parameters (and so every computation) live on."""
        return self._placement()[0]

    def _placement(self) -> tuple[jax.Device, np.dtype]:
        """(`device`, `param_dtype`) from one read of one parameter. A call reads them once, not at
        each use: each read goes through Flax's variable and JAX's array properties (about twenty
        Python calls), and a forward used them seven times. A subclass that says where its calls
        run (impl_jax.shard.ShardedModel: the mesh) is asked its `device`."""
        weight = self.target_embedding.weight[...]
        device = next(iter(weight.devices())) if type(self).device is Model.device else self.device
        return device, weight.dtype

    # Inputs ------------------------------------------------------------------------------------

    def ids(self, argument: str, ids, vocab_size: int) -> np.ndarray:
        """`ids` checked as a call checks `argument` (its shape, dtype, range), as this backend's ids."""
        return self._ids(argument, ids, vocab_size)

    def _ids(self, argument: str, ids, vocab_size: int) -> np.ndarray:
        # Host-side facts: a JAX array's values are copied here, because checking them is the point.
        if isinstance(ids, jax.core.Tracer):
            raise InputError(argument, "is traced (the model was called inside jax.jit, vmap or similar); the checked "
                                       "call runs on the host: use `model.traceable_forward` inside transforms, with "
                                       "checked ids")
        ids = host_ids(argument, ids, vocab_size, self.config.max_len)
        return ids.astype(np.int32)  # in [0, vocab_size); int64 would need x64

    def source(self, src_ids) -> np.ndarray:
        """The source checked as a call checks it: ids (B, S) (`ids`), or a features source's
        log-mel features (B, n_mels, frames) (`conformance.core.inputs.check_features`)."""
        if self.config.source != "features":
            return self._ids("src_ids", src_ids, self.config.src_vocab_size)
        if isinstance(src_ids, jax.core.Tracer):
            raise InputError("src_ids", "is traced (the model was called inside jax.jit, vmap or similar); the checked "
                                        "call runs on the host: use `model.traceable_forward` inside transforms")
        # In the model's dtype, cast on the host: one rounding, as the NumPy front end's first step.
        return host_features("src_ids", src_ids, self.config).astype(self.dtype)

    def _mask(self, argument: str, mask, expected, derived: np.ndarray) -> np.ndarray:
        return host_mask(argument, mask, expected, derived)  # a JAX mask is copied: its values are checked

    def make_masks(self, src_ids, tgt_ids) -> tuple[jax.Array, jax.Array]:
        src_mask, tgt_mask = make_masks(self.config, np.asarray(src_ids), np.asarray(tgt_ids))
        return jax.device_put(src_mask, self.device), jax.device_put(tgt_mask, self.device)

    def cross_mask(self, src_mask):
        """The decoder's cross-attention mask: the source's (B, 1, 1, S), or None when the config attends every
        source position (`cross_attn_src_mask` off)."""
        return src_mask if self.config.cross_attn_src_mask else None

    # Forward -----------------------------------------------------------------------------------
    # `encode` and `decode` check the inputs and build the masks on the host, pad to buckets if
    # asked, then run the compiled `_encode` / `_decode`.

    def embed(self, ids: jax.Array, embedding: Embedding, position: Positions, norm=None, *, at=None,
              combine=norm_of_sum) -> jax.Array:
        """Token embedding, times sqrt(D) when the config says so (section 3.4), plus positions,
        then `norm` when the config has an embedding norm (BART's `layernorm_embedding`).

        The positions count from 0, or (`at`, a cached decoding step's one new token) from `at`.
        `combine` (keyword-only): the stack's `embedding_sum`, where its norm sits (`norm_of_sum`,
        or BlenderbotSmall's decoder's `sum_of_norm`)."""
        x = embedding(ids, self.dtype)  # (B, L, D)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.d_model)
        positions = position(ids, self.dtype) if at is None else position.at(at, ids, self.dtype)
        return combine(x, positions, norm)

    def embed_source(self, src_ids: jax.Array, out: Encoded) -> jax.Array:
        """The encoder's input (B, S, D): the source tokens' embeddings (`embed`), or a features
        source through the front end (two convolutions, each followed by GELU; frontend.py)
        plus the positions 0 .. S - 1 (no embedding scale: there is no token table), then `norm`
        when the config has an embedding norm."""
        if self.encoder.frontend is None:
            return self.embed(src_ids, self.encoder.embedding, self.encoder.position, self.encoder.embedding_norm)
        x = self.encoder.frontend(src_ids, self.dtype, out)  # (B, S, D)
        x = x + self.encoder.position.span(x.shape[1], self.dtype)
        norm = self.encoder.embedding_norm
        return x if norm is None else norm(x)

    @property
    def target_embedding(self) -> Embedding:
        """The decoder's token table: the encoder's when the embeddings are shared (section 3.4)."""
        return self.encoder.embedding if self.config.share_embeddings else self.decoder.embedding

    def logits(self, y: jax.Array) -> jax.Array:
        """The logits (B, T, V) of `decoder.output` y: the output layer, plus BART's `final_logits_bias`."""
        logits = self.output(y, self.target_embedding)  # (B, T, V)
        if self.final_logits_bias is not None:
            logits = logits + self.logits_bias(cast(self.final_logits_bias[...], logits.dtype))
        return logits

    def encode(self, src_ids, src_mask=None, *, return_attention: bool = True, dropout=None, sink=None) -> Encoded:
        """Run the encoder: the memory (B, S, D) plus its attention weights and intermediates
        (with a `sink`, handed to it one at a time instead)."""
        return self._encoded(src_ids, src_mask, return_attention, dropout, sink)[0]

    def _encoded(self, src_ids, src_mask, return_attention: bool, dropout, sink) -> tuple[Encoded, tuple]:
        """`encode`, and the `_placement` it ran with, for a forward's decoder to run with too. Its
        `src_mask` is put on the device (`jax.device_put`) in a forward too: handed to the decoder
        as a NumPy array instead, it would make jit compile `_decode` once more (jit keys an
        argument committed to a device apart from a host array of its shape)."""
        src_ids, src_mask, dropout, placement = self._source(src_ids, src_mask, dropout)
        device = placement[0]
        padding = host.Padding(self.config, self.buckets, src_len=src_mask.shape[-1])
        args = (padding.source(src_ids), padding.mask(src_mask, keys="src"), padding.real("src"))
        static = {}
        if dropout is not None:  # masks are arguments, the rate is static; off, the call is unchanged
            args += ({site: padding.positions(m, "src") for site, m in dropout.masks.items()},)
            static["dropout_rate"] = dropout.rate
        # Put before the encoder is dispatched, not after: on a CPU the running encoder shares the
        # cores with this thread, and the put took three times as long behind it.
        encoded = Encoded(memory=None, src_mask=jax.device_put(src_mask, device))
        memory, attention, intermediates = compiled.call(
            self, Model._encode, args, device, return_attention=return_attention, **static)
        encoded.memory, encoded.attention, encoded.intermediates = padding.unpad(
            device, memory=memory, attention=attention, intermediates=intermediates)
        del attention, intermediates  # (bucket-padded: only the cut copies are needed)
        if sink is not None:  # returned together by the executable: handed over one at a time, each then dropped
            send_in_order(self.config, sink, encoded.attention, encoded.intermediates)
        if not return_attention:  # None, not {}: "not asked for", never "no attention layers"
            encoded.attention = None
        return encoded, placement

    def _source(self, src_ids, src_mask, dropout) -> tuple[np.ndarray, np.ndarray, Dropout | None, tuple]:
        """`encode`'s checks, in its order: the ids, dropout and mask as checked, and the
        `_placement`, read after them where `encode` first read the parameters (so that a model
        traced by jit is still refused by the ids' check first)."""
        src_ids = self.source(src_ids)
        derived = source_mask(self.config, src_ids, self.encoder.frontend)  # (B, 1, 1, S)
        batch, src_len = derived.shape[0], derived.shape[-1]
        dropout = host_dropout(self.config, dropout, "encoder", batch, src_len)
        if src_mask is None:
            src_mask = derived
        else:
            shapes = expected_mask_shapes(self.config, batch, src_len, 1)
            src_mask = self._mask("src_mask", src_mask, shapes["src_mask"], derived)
        placement = self._placement()
        host.check_runnable(self.dtype, param_dtype=placement[1])
        return src_ids, src_mask, dropout, placement

    def _encode(self, src_ids, src_mask, src_real, dropout_masks=None, *, return_attention: bool,
                dropout_rate: float | None = None, empty_rows: float | None = None):
        """The compiled part of `encode`: ids (B, S) and mask checked, S possibly bucket-padded.
        `empty_rows` (static): attention's rule for a query with no key, 0.0 in the loss."""
        encoded = Encoded(memory=None, src_mask=src_mask)
        dropout = None if dropout_masks is None else Dropout(dropout_rate, dropout_masks)
        x = self.embed_source(src_ids, encoded)
        encoded.intermediates["encoder.embeddings"] = x
        x = apply_dropout(x, dropout, "encoder.embeddings")
        encoded.memory = self.encoder(x, src_mask, encoded, src_real=src_real, dropout=dropout, empty_rows=empty_rows)
        if not return_attention:
            encoded.attention.clear()  # never leaves the executable, so XLA does not store it
        return encoded.memory, encoded.attention, encoded.intermediates

    def decode(self, tgt_ids, encoded: Encoded, tgt_mask=None, *, return_attention: bool = True,
               dropout=None, sink=None) -> ModelOutput:
        """Run the decoder against `encode`'s result: logits (B, T, V) and everything recorded
        (with a `sink`, handed to it one at a time instead, the logits last)."""
        return self._decoded(tgt_ids, encoded, tgt_mask, return_attention, dropout, sink)

    def _decoded(self, tgt_ids, encoded: Encoded, tgt_mask, return_attention: bool, dropout, sink,
                 placement: tuple | None = None) -> ModelOutput:
        """`decode`, with the `_placement` its encoder ran with (None: read where `decode` first
        read the parameters, after the inputs' checks)."""
        memory = encoded.memory
        tgt_ids, tgt_mask, dropout = self._target(tgt_ids, memory.shape, memory.dtype, tgt_mask, dropout)
        device, param_dtype = placement if placement is not None else self._placement()
        host.check_runnable(self.dtype, param_dtype=param_dtype)
        cross_mask = self.cross_mask(encoded.src_mask)
        padding = host.Padding(self.config, self.buckets, src_len=memory.shape[1], tgt_len=tgt_ids.shape[1])
        args = (padding.ids(tgt_ids, "tgt"), padding.mask(tgt_mask, queries="tgt", keys="tgt"),
                padding.memory(memory), padding.mask(cross_mask, keys="src"),
                padding.real("tgt"), padding.real("src"))
        static = {}
        if dropout is not None:  # masks are arguments, the rate is static; off, the call is unchanged
            args += ({site: padding.positions(m, "tgt") for site, m in dropout.masks.items()},)
            static["dropout_rate"] = dropout.rate
        logits, attention, intermediates = compiled.call(
            self, Model._decode, args, device, return_attention=return_attention, **static)
        logits, attention, intermediates = padding.unpad(
            device, logits=logits, attention=attention, intermediates=intermediates)
        if sink is not None:  # returned together by the executable: handed over one at a time, each then dropped
            intermediates["logits"], logits = logits, None
            send_in_order(self.config, sink, attention, intermediates)
        out = ModelOutput(logits=logits, attention=dict(encoded.attention or {}), intermediates=dict(encoded.intermediates))
        out.attention.update(attention)
        out.intermediates.update(intermediates)
        if not return_attention:
            out.attention = None
        return out

    def _target(self, tgt_ids, memory_shape, memory_dtype, tgt_mask,
                dropout) -> tuple[np.ndarray, np.ndarray, Dropout | None]:
        """`decode`'s checks, in its order, against a memory of this shape and dtype: the ids,
        mask and dropout as checked."""
        tgt_ids = self._ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size)
        check_memory(self.config, memory_shape, np.dtype(memory_dtype).name, self.dtype.name)
        check_same_batch(memory_shape, tgt_ids.shape)
        batch, tgt_len = tgt_ids.shape
        dropout = host_dropout(self.config, dropout, "decoder", batch, tgt_len)
        derived = target_mask(self.config, tgt_ids)  # (B, 1, T, T)
        if tgt_mask is None:
            tgt_mask = derived
        else:
            shapes = expected_mask_shapes(self.config, batch, 1, tgt_len)
            tgt_mask = self._mask("tgt_mask", tgt_mask, shapes["tgt_mask"], derived)
        return tgt_ids, tgt_mask, dropout

    def _decode(self, tgt_ids, tgt_mask, memory, cross_mask, tgt_real, src_real, dropout_masks=None, *,
                return_attention: bool, dropout_rate: float | None = None, empty_rows: float | None = None):
        """The compiled part of `decode`: ids (B, T) and masks checked, T and S possibly bucket-padded."""
        out = ModelOutput(logits=None)

        dropout = None if dropout_masks is None else Dropout(dropout_rate, dropout_masks)
        y = self.embed(tgt_ids, self.target_embedding, self.decoder.position, self.decoder.embedding_norm,
                       combine=self.decoder.embedding_sum)
        out.intermediates["decoder.embeddings"] = y
        y = apply_dropout(y, dropout, "decoder.embeddings")
        y = self.decoder(y, memory, tgt_mask, cross_mask, out, tgt_real=tgt_real, src_real=src_real, dropout=dropout,
                         empty_rows=empty_rows)
        logits = self.logits(y)
        assert logits.dtype == self.dtype, f"promoted to {logits.dtype}"
        out.logits = logits
        if not return_attention:
            out.attention.clear()
        return out.logits, out.attention, out.intermediates

    def traceable_forward(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, *,
                          return_attention: bool = True, dropout=None, empty_rows=None) -> ModelOutput:
        """The same forward pass as a call, traceable and unchecked: for use inside `jax.jit`,
        `vmap` or `shard_map` (a call checks its inputs on the host, which a tracer cannot do).

        Nothing is validated: out-of-range ids are clamped by JAX, not refused, so check them
        before (a call of the model on the same shapes does, and raises the NumPy backend's errors).
        Returned through jit, the attention and intermediates dicts come back with their keys
        sorted (JAX's order for dicts), so look tensors up by name. `dropout`: a `Dropout` whose
        masks may be traced (unchecked too), or None. `empty_rows`: attention's rule for a query
        with no key (`scaled_dot_product_attention`), None for the config's; the loss passes 0.0.
        """
        if src_mask is None:
            src_mask = source_mask(self.config, src_ids)  # (B, 1, 1, S)
        if tgt_mask is None:
            tgt_mask = target_mask(self.config, tgt_ids)  # (B, 1, T, T)
        cross_mask = self.cross_mask(src_mask)
        masks, rate = (None, None) if dropout is None else (dropout.masks, dropout.rate)
        with model_precision(self.precision):  # the model's matmul precision, inside any transform
            memory, attention, intermediates = self._encode(src_ids, src_mask, None, masks,
                                                            return_attention=return_attention, dropout_rate=rate,
                                                            empty_rows=empty_rows)
            logits, dec_attention, dec_intermediates = self._decode(
                tgt_ids, tgt_mask, memory, cross_mask, None, None, masks,
                return_attention=return_attention, dropout_rate=rate, empty_rows=empty_rows)
        return ModelOutput(logits=logits, attention={**attention, **dec_attention} if return_attention else None,
                           intermediates={**intermediates, **dec_intermediates})

    def __call__(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, *, return_attention: bool = True,
                 dropout=None, sink=None) -> ModelOutput:
        """logits (B, T, V) for source ids (B, S) and decoder input ids (B, T), plus the
        attention weights (`return_attention`) and the intermediates by name.

        `dropout` (keyword-only, training): a `conformance.core.dropout.Dropout` (masks drawn by
        `draw_dropout` from one NumPy seed); None, the default, is inference: no dropout.

        `sink` (keyword-only): `sink(name, tensor)` receives every attention map and intermediate,
        then the logits, in `forward_order`; the returned output then keeps none of them
        (conformance.core.output). The compiled encoder and decoder each return theirs at once, so
        the encoder's are handed over before the decoder runs, and each is dropped once handed over.

        `encode` then `decode`, with the device and the parameters' dtype read once for both; or,
        without a sink and with `impl_jax.one_executable_forward()` on, both in one executable
        (`_forward_in_one`). With a sink, the decoder reads the placement again: the sink may have
        moved the parameters while the encoder's tensors were handed over."""
        if sink is None and compiled.one_executable():
            return self._forward_in_one(src_ids, tgt_ids, src_mask, tgt_mask, return_attention, dropout)
        encoded, placement = self._encoded(src_ids, src_mask, return_attention, dropout, sink)
        return self._decoded(tgt_ids, encoded, tgt_mask, return_attention, dropout, sink,
                             placement if sink is None else None)

    def _forward_in_one(self, src_ids, tgt_ids, src_mask, tgt_mask, return_attention: bool, dropout) -> ModelOutput:
        """A forward without a sink as one executable (`compiled.forward_in_one`: `_encode` then
        `_decode` traced together): `encode`'s checks then `decode`'s, in their order, against the
        memory the encoder will give (B, S, D) in the model's dtype, then one dispatch."""
        src_ids, src_mask, src_dropout, (device, _) = self._source(src_ids, src_mask, dropout)
        batch, src_len = src_mask.shape[0], src_mask.shape[-1]
        tgt_ids, tgt_mask, tgt_dropout = self._target(tgt_ids, (batch, src_len, self.config.d_model), self.dtype,
                                                      tgt_mask, dropout)
        padding = host.Padding(self.config, self.buckets, src_len=src_len, tgt_len=tgt_ids.shape[1])
        args = (padding.source(src_ids), padding.mask(src_mask, keys="src"), padding.real("src"),
                padding.ids(tgt_ids, "tgt"), padding.mask(tgt_mask, queries="tgt", keys="tgt"), padding.real("tgt"))
        static = {}
        if src_dropout is not None:  # masks are arguments, the rate is static; off, the call is unchanged
            args += ({site: padding.positions(m, "src") for site, m in src_dropout.masks.items()},
                     {site: padding.positions(m, "tgt") for site, m in tgt_dropout.masks.items()})
            static["dropout_rate"] = src_dropout.rate
        logits, attention, intermediates = compiled.call(
            self, compiled.forward_in_one, args, device, return_attention=return_attention, **static)
        logits, attention, intermediates = padding.unpad(
            device, logits=logits, attention=attention, intermediates=intermediates)
        return ModelOutput(logits=logits, attention=attention if return_attention else None,
                           intermediates=intermediates)

    # Training ----------------------------------------------------------------------------------

    def loss_and_grads(self, src_ids, tgt_ids, labels, *, label_smoothing: float = 0.0, dropout=None):
        """The training loss of docs/training.md and its gradient for every parameter.

        By `nnx.value_and_grad`, jit-compiled:

            loss = 1/N · sum over the N counted tokens (labels != pad_id) of
                   (1 - ε) · -log p(label) + ε · 1/V · sum_v -log p(v),   p = softmax(logits)

        which is PyTorch's `cross_entropy(..., ignore_index=pad_id, label_smoothing=ε)`. Returns
        the loss (a 0-d array, at least float32) and the gradients as a dict keyed by the
        canonical parameter names, each of its parameter's shape and dtype, on the model's
        device. With a `param_dtype` other than `dtype` the gradients are computed in `dtype` and
        each is rounded once to `param_dtype`. Ids and labels are checked on the host first, then
        one compiled executable per (config, dtype, shapes) runs (`impl_jax.compiled`, bounded
        like the forward); ε is an argument of it, not a constant, so a new ε does not recompile.
        `dropout`: as for a call.
        """
        args, static = self._loss_args(src_ids, tgt_ids, labels, label_smoothing, dropout)
        return compiled.call(self, Model._loss_and_grads, args, self.device, **static)

    def _loss_args(self, src_ids, tgt_ids, labels, label_smoothing, dropout):
        """The host part of `loss_and_grads` (also the fused `impl_jax.train_step`'s): ids, labels,
        ε and dropout checked, masks built; returns the compiled part's arguments and statics."""
        src_ids = self.source(src_ids)
        tgt_ids = self._ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size)
        check_same_batch(src_ids.shape, tgt_ids.shape)
        labels = host_labels(self.config, labels, tgt_ids.shape).astype(np.int32)
        check_labels_finite(self.config, src_ids, tgt_ids, labels)
        epsilon = np.asarray(check_label_smoothing(label_smoothing), reduction_dtype(self.dtype))
        batch, src_len = source_real(self.config, src_ids).shape
        encoder_drop = host_dropout(self.config, dropout, "encoder", batch, src_len)
        decoder_drop = host_dropout(self.config, dropout, "decoder", batch, tgt_ids.shape[1])
        host.check_runnable(self.dtype, param_dtype=self.param_dtype)
        src_mask, tgt_mask = make_masks(self.config, src_ids, tgt_ids)
        args, static = (src_ids, tgt_ids, src_mask, tgt_mask, labels, epsilon), {}
        if dropout is not None:  # masks are arguments, the rate is static; off, the call is unchanged
            args += ({**encoder_drop.masks, **decoder_drop.masks},)
            static["dropout_rate"] = encoder_drop.rate
        return args, static

    def _loss_and_grads(self, src_ids, tgt_ids, src_mask, tgt_mask, labels, epsilon, dropout_masks=None, *,
                        dropout_rate: float | None = None):
        """The compiled part of `loss_and_grads`: ids, masks and labels checked on the host."""
        counted = labels != self.config.pad_id  # (B, T)

        def loss_fn(model):
            dropout = None if dropout_masks is None else Dropout(dropout_rate, dropout_masks)
            # A query with no key to attend to (-inf fill) gets zero weights instead of NaN while
            # the loss runs: a NaN activation would reach every weight gradient as 0 * NaN.
            logits = model.traceable_forward(src_ids, tgt_ids, src_mask, tgt_mask, return_attention=False,
                                             dropout=dropout, empty_rows=0.0).logits
            # The counted positions are selected before anything is computed, never multiplied by
            # 0: a NaN in a padded row reaches neither the loss nor the logits' gradient. One
            # function with its own gradient, as torch's fused cross-entropy (impl_jax/loss.py).
            return cross_entropy(at_least_float32(logits), labels, counted, epsilon)

        if self.param_dtype == self.dtype:
            loss, grads = nnx.value_and_grad(loss_fn)(self)
        else:
            # Differentiated at copies of the parameters in the compute dtype, each gradient then
            # rounded once to param_dtype. Through `cast` at each use, jax.grad would round every
            # use's gradient to param_dtype and sum them there (a shared or tied embedding, the
            # scatter-add of looked-up rows): an ulp away from the compute-dtype gradient.
            graphdef, params, rest = nnx.split(self, nnx.Param, ...)
            params = jax.tree.map(lambda w: cast(w, self.dtype), params)
            loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest)))(params)
        flat = {".".join(str(part) for part in path): cast(variable[...], self.param_dtype)
                for path, variable in nnx.to_flat_state(grads)}
        return loss, {name: flat[name] for name in param_shapes(self.config)}

    # Generation ------------------------------------------------------------------------------
    # The decoder with a KV cache: each layer keeps the keys and values of the positions so far,
    # and the memory's keys and values are projected once per source, so that a step costs O(T).
    # The cache, the cached step and the search driver live in impl_jax/decode.py; the cache is a
    # fixed-size buffer and the position a traced scalar, so that one executable serves every step.

    def start_cache(self, encoded: Encoded, length: int) -> DecoderCache:
        """An empty cache for up to `length` positions against `encoded` (one row per decoder row)."""
        return decode.start_cache(self, encoded, length)

    def decode_step(self, tgt_ids, cache: DecoderCache) -> jax.Array:
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
