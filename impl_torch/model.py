"""The encoder-decoder Transformer of "Attention Is All You Need", as a torch.nn.Module.

This file is written to be read next to the paper (Vaswani et al., 2017) and next to
`impl_numpy/model.py`, whose skeleton, names and comments it repeats: `diff` the two files and
only PyTorch idioms remain. Parameters are `nn.Parameter`s in the canonical layout (matrices
`(d_in, d_out)`, so the math reads `x @ W + b` as in the paper) and `state_dict()` uses exactly
the checkpoint's names, so loading a checkpoint is a strict key-for-key copy.

Shape legend:
    B batch, S source length, T target length, D d_model, H heads, K head dim (D / H),
    F d_ff, V target vocabulary. Tq / Tk are query / key lengths inside attention.

Sections, in the same order in every backend: masks, positions, building blocks, attention,
feed-forward, encoder layer, decoder layer, encoder and decoder, model.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from conformance.core.config import ModelConfig, inert_switches
from conformance.core.generation.search import DecoderCache
from conformance.core.inputs import (
    check_features,
    check_label_smoothing,
    check_labels_finite,
    check_ids,
    check_mask,
    check_mask_within_ids,
    check_memory,
    check_same_batch,
    expected_mask_shapes,
    host_features,
    host_ids,
    host_labels,
    host_mask,
)
from conformance.core.dropout import Dropout, host_dropout
from conformance.core.output import Encoded, ModelOutput, record
from conformance.core.params import param_shapes, prepare_params
from conformance.core.positions import offset_buckets, position_table
from impl_torch import decode, graphs, packed
from impl_torch.arrays import dtype_name, id_bounds, resolve_device, to_numpy, to_torch
from impl_torch.blocks import product_in_blocks
from impl_torch.compiling import eager_under_compile
from impl_torch.frontend import FrontEnd
from impl_torch.fused import kernel_fix_ups
from impl_torch.precision import check_no_autocast
from impl_torch.train import leaf_in, parameters_replaced

SUPPORTED_DTYPES = ("float32", "float64", "float16", "bfloat16")


# -- Masks -------------------------------------------------------------------------------------
# Masks are boolean, True = may attend, and broadcast against scores of shape (B, H, Tq, Tk).
# (torch.nn.MultiheadAttention reads a boolean True as "may NOT attend"; SDPA, like us, as "may".)
# The helpers accept NumPy arrays as well as tensors and return tensors on the ids' device.


def padding_mask(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, L) ids -> (B, 1, 1, L): every query may attend to every non-padding key."""
    return (torch.as_tensor(ids) != pad_id)[:, None, None, :]


def causal_mask(length: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, T, T) lower triangle: position t may attend to positions <= t (section 3.2.3)."""
    return torch.tril(torch.ones((length, length), dtype=torch.bool, device=device))[None, None, :, :]


def target_mask(config: ModelConfig, tgt_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T): target padding AND causal.

    Target padding is masked on the keys (B, 1, 1, T), or, in the tutorials that do so, on the
    queries (B, 1, T, 1), or on both (B, 1, T, T), or not at all (Marian: its start token is the
    pad id).
    """
    tgt_ids = torch.as_tensor(tgt_ids)
    tgt_pad = padding_mask(tgt_ids, config.pad_id)  # (B, 1, 1, T)
    if config.tgt_pad_mask == "queries":
        tgt_pad = tgt_pad.transpose(2, 3)  # (B, 1, T, 1)
    elif config.tgt_pad_mask == "both":
        tgt_pad = tgt_pad & tgt_pad.transpose(2, 3)  # (B, 1, T, T)
    elif config.tgt_pad_mask == "none":
        tgt_pad = tgt_pad | True  # causal only: the decoder's start token may be the pad id
    return tgt_pad & causal_mask(tgt_ids.shape[1], device=tgt_ids.device)  # (B, 1, T, T)


def encoder_self_mask(config: ModelConfig, src_mask):
    """The encoder self-attention's mask from the source mask (B, H|1, 1, S): the source mask
    itself (padding on the keys), or with padding on the queries too (B, H|1, S, S), as Flax
    `examples/wmt` masks it. Cross-attention always takes the source mask on the keys only."""
    if config.src_pad_mask == "both" and src_mask is not None:
        return src_mask & src_mask.transpose(-1, -2)  # (B, H|1, S, S)
    return src_mask


def source_mask(config: ModelConfig, src_ids: torch.Tensor, frontend=None) -> torch.Tensor:
    """(B, 1, 1, S): source padding on the keys; a features source (B, n_mels, frames) has none,
    so every one of its S = frames / 2 positions may be attended.

    `frontend`: the model's front end, whose `positions(frames)` give S (None: frames / 2)."""
    src_ids = torch.as_tensor(src_ids)
    if config.source == "features":
        batch, _, frames = src_ids.shape
        length = frames // 2 if frontend is None else frontend.positions(frames)
        return torch.ones((batch, 1, 1, length), dtype=torch.bool, device=src_ids.device)
    return padding_mask(src_ids, config.pad_id)


def make_masks(config: ModelConfig, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks a model derives from its ids: src_mask (B, 1, 1, S) and tgt_mask (B, 1, T, T)."""
    return source_mask(config, src_ids), target_mask(config, tgt_ids)


# -- Positions ---------------------------------------------------------------------------------


class Positions(nn.Module):
    """The position term added to the scaled token embeddings (section 3.5).

    A sinusoid (a constant of the config, computed in float64) or a stored table, of
    `max_len + position_offset` rows: position p reads row p + position_offset (BART's learned
    table and M2M100's sinusoid skip 2 rows). With position_ids "non-pad" (M2M100/NLLB) only the
    tokens that are not the pad id are numbered, and a pad token gets no position term.
    The sinusoid is a non-persistent buffer: it follows `.to(device/dtype)` like any tensor of
    the module but is not a parameter, so it never appears in `state_dict()`.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, length: int):
        # `length`: the stack's longest sequence (max_len; a features source's encoder: source_len)
        super().__init__()
        self.length = length
        if config.position == "table":
            self.table = nn.Parameter(torch.empty(length + config.position_offset, config.d_model, dtype=dtype))
        else:
            # Cast on the host from float64, once (`to_torch`): the same rounding as the NumPy and
            # JAX tables; torch's own float64 -> float16 cast rounds twice, through float32.
            table = position_table(config, length)  # (length + offset, D) float64
            table = to_torch(table, dtype_name(dtype)).to(torch.get_default_device())
            self.register_buffer("table", table, persistent=False)
        self.offset = config.position_offset
        self.pad_id = config.pad_id if config.position_ids == "non-pad" else None

    def extra_repr(self) -> str:
        kind = "stored table" if isinstance(self.table, nn.Parameter) else "sinusoid buffer"
        return f"{kind} {tuple(self.table.shape)}, offset={self.offset}"

    def rows(self, ids: torch.Tensor):
        """The table row each token reads (B, L), and where it adds one (B, L), or True: all do."""
        length = ids.shape[1]
        if self.pad_id is None:
            return torch.arange(self.offset, self.offset + length, device=ids.device)[None, :], True  # (1, L)
        real = ids != self.pad_id  # (B, L)
        counted = torch.cumsum(real, dim=1) - 1  # (B, L): the real tokens before each one
        return self.offset + counted.clamp_min(0), real

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The terms of the tokens `ids` (B, L): (1, L, D), or (B, L, D) with "non-pad" ids."""
        if self.pad_id is None:  # a slice, not a gather: (1, L, D)
            return cast(self.table[None, self.offset:self.offset + ids.shape[1], :], dtype)
        rows, real = self.rows(ids)
        return torch.where(real[..., None], cast(self.table[rows], dtype), 0.0)  # (B, L, D)

    def at(self, position: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The term of one position for the tokens `ids` (B, 1), for a cached decoding step: row
        position + offset, as transformers' cached step reads it (no pad token before it is counted)."""
        term = cast(self.table[None, self.offset + position:self.offset + position + 1, :], dtype)  # (1, 1, D)
        return term if self.pad_id is None else torch.where((ids != self.pad_id)[..., None], term, 0.0)

    def span(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """The terms of positions 0 .. length - 1 of a source with no padding (a features source):
        rows offset .. offset + length - 1, (1, L, D)."""
        return cast(self.table[None, self.offset:self.offset + length, :], dtype)  # (1, L, D)

    def score_bias(self, query_len: int, key_len: int, dtype: torch.dtype, *, first_query: int = 0):
        """An absolute position term adds nothing to the attention scores: None."""
        return None


class RelativeBuckets(nn.Module):
    """UMT5's relative positions: no term on the embeddings; the stack computes the bucket of every
    (query, key) once (T5's `_relative_position_bucket`), and each self-attention layer reads them in
    a table of its own (`relative_bias_per_layer`: `own_table_bias`); T5's `RelativePositionBias`
    reads them in the stack's one table."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, bidirectional: bool, length: int):
        super().__init__()
        buckets = offset_buckets(config, bidirectional=bidirectional, length=length)  # (2 L - 1,): n at n + L - 1
        self.register_buffer("buckets", torch.as_tensor(buckets).to(torch.get_default_device()), persistent=False)
        self.max_len = length

    def forward(self, ids: torch.Tensor, dtype: torch.dtype):
        return 0  # nothing is added to the embeddings

    def at(self, position: int, ids: torch.Tensor, dtype: torch.dtype):
        return 0

    def span(self, length: int, dtype: torch.dtype):
        return 0

    def score_bias(self, query_len: int, key_len: int, dtype: torch.dtype, *, first_query: int = 0) -> torch.Tensor:
        """(Tq, Tk): the buckets of queries first_query .. + Tq - 1 against keys 0 .. Tk - 1."""
        device = self.buckets.device
        query = first_query + torch.arange(query_len, device=device)  # (Tq,)
        return self.buckets[torch.arange(key_len, device=device)[None, :] - query[:, None] + self.max_len - 1]


class RelativePositionBias(RelativeBuckets):
    """T5's relative position bias: no term on the embeddings; a learned (buckets, H) table whose
    row bucket(j - i) is added to every self-attention score of query i and key j in the stack
    (bidirectional in the encoder, causal in the decoder; `conformance.core.positions`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, bidirectional: bool, length: int):
        super().__init__(config, dtype, bidirectional=bidirectional, length=length)
        self.relative_bias = nn.Parameter(torch.empty(config.relative_buckets, config.n_heads, dtype=dtype))  # (buckets, H)

    def extra_repr(self) -> str:
        return f"relative bias {tuple(self.relative_bias.shape)}"

    def score_bias(self, query_len: int, key_len: int, dtype: torch.dtype, *, first_query: int = 0) -> torch.Tensor:
        """(1, H, Tq, Tk): the bias of queries first_query .. + Tq - 1 against keys 0 .. Tk - 1."""
        buckets = super().score_bias(query_len, key_len, dtype, first_query=first_query)  # (Tq, Tk)
        return cast(self.relative_bias[buckets], dtype).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)


def positions(config: ModelConfig, dtype: torch.dtype, *, bidirectional: bool, length: int):
    """The stack's position term: `RelativePositionBias` for position "relative" (T5), `RelativeBuckets`
    with `relative_bias_per_layer` (UMT5), else `Positions`."""
    if config.position == "relative" and config.relative_bias_per_layer:
        return RelativeBuckets(config, dtype, bidirectional=bidirectional, length=length)
    if config.position == "relative":
        return RelativePositionBias(config, dtype, bidirectional=bidirectional, length=length)
    return Positions(config, dtype, length=length)


# -- Building blocks ---------------------------------------------------------------------------
# Parameters are stored in the model's `param_dtype` and computed in its `dtype` (Flax's
# `param_dtype` / `dtype` split): every read of a parameter goes through `cast`, which widens or
# rounds it to the dtype of the computation it enters (the activations' dtype), and is the array
# itself when the two agree (`param_dtype=None`, the default: no cast, no copy).


def cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype`: w itself when it already is, else one rounding (exact when it widens).

    One exception: torch rounds float64 to float16 through float32, so float64 parameters computed
    in float16 differ from NumPy's direct rounding (the core's up-front cast) in about one value in
    20000, by one float16 ulp (measured on 2e6 values; bfloat16 and float32 targets agree)."""
    return w if w.dtype == dtype else w.to(dtype)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 -> float32; float32 and float64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x



class Linear(nn.Module):
    """y = x W + b, with W stored (d_in, d_out) as in the paper's notation.

    (`nn.Linear` stores W transposed; keeping the canonical layout means a checkpoint loads
    without any transpose.)
    """

    def __init__(self, d_in: int, d_out: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_in, d_out, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(d_out, dtype=dtype)) if bias else None

    def extra_repr(self) -> str:
        return f"d_in={self.weight.shape[0]}, d_out={self.weight.shape[1]}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ cast(self.weight, x.dtype)
        # One fused GEMM (bias as the C of C + A B) over the flattened leading axes.
        weight, bias = cast(self.weight, x.dtype), cast(self.bias, x.dtype)
        if x.is_contiguous():  # F.linear's own flatten, addmm and view: the same GEMM, one dispatch
            return F.linear(x, weight.T, bias)  # (B, L, d_out)
        y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)  # (B * L, d_out)
        return y.view(*x.shape[:-1], -1)  # (B, L, d_out)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis, in the form the config names.

    standard:       y = (x - mean) / sqrt(var + eps) * weight + bias   (biased variance)
    std-eps:        y = (x - mean) / (std + eps) * weight + bias       (unbiased std; the
                    Annotated Transformer's own LayerNorm)
    fast-variance:  as standard, with var = max(E[x^2] - E[x]^2, 0)    (Flax nn.LayerNorm)
    rms:            y = x / sqrt(mean(x^2) + eps) * weight             (T5LayerNorm: RMSNorm, no
                    mean, no bias)

    Statistics and the affine are computed in at least float32 (float16 would lose the mean of a
    large residual) and cast once at the end, as JAX does.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.d_model, dtype=dtype))
        rms = config.layer_norm_form == "rms"
        self.bias = None if rms else nn.Parameter(torch.empty(config.d_model, dtype=dtype))
        self.eps = config.layer_norm_eps
        self.form = config.layer_norm_form

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}, form={self.form!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "standard":
            # PyTorch's fused kernel computes exactly the standard form (biased variance, eps
            # inside the root), accumulating float16/bfloat16 inputs in float32.
            return F.layer_norm(x, (x.shape[-1],), cast(self.weight, x.dtype), cast(self.bias, x.dtype), self.eps)
        x32 = at_least_float32(x)
        if self.form == "rms":
            normed = x32 / torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + self.eps)
            return (normed * cast(self.weight, x.dtype)).to(x.dtype)
        mean = x32.mean(dim=-1, keepdim=True)
        centered = x32 - mean
        if self.form == "fast-variance":
            var = torch.clamp_min((x32 * x32).mean(dim=-1, keepdim=True) - mean * mean, 0)
            normed = centered / torch.sqrt(var + self.eps)
        else:
            std = torch.sqrt((centered * centered).sum(dim=-1, keepdim=True) / (x.shape[-1] - 1))
            normed = centered / (std + self.eps)
        return (normed * cast(self.weight, x.dtype) + cast(self.bias, x.dtype)).to(x.dtype)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """ReLU (the paper), GELU (erf form), GELU with the tanh approximation, SiLU/swish, or tanh."""
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        # 0.5 x (1 + erf(x / sqrt 2)), the exact form.
        return F.gelu(x, approximate="none")
    if name == "gelu-tanh":
        return F.gelu(x, approximate="tanh")
    if name == "tanh":  # AlgoPerf WMT's GLU variant
        return torch.tanh(x)
    # silu(x) = x * sigmoid(x); PyTorch's kernel stays finite for large |x|.
    return F.silu(x)


def apply_dropout(x: torch.Tensor, dropout, site: str) -> torch.Tensor:
    """Inverted dropout (section 5.4): x / (1 - rate) where the site's mask keeps, 0 where it drops.

    `dropout` is None (off: x itself) or a `conformance.core.dropout.Dropout` whose masks, drawn
    from one NumPy seed, every backend receives, so a training step with dropout is the same
    computation everywhere. A select, not a product: a dropped NaN is 0 as in PyTorch's kernel."""
    if dropout is None:
        return x
    return torch.where(dropout.masks[site], x / (1 - dropout.rate), 0.0)  # (B, L, D)


# -- Attention ---------------------------------------------------------------------------------


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis. A row whose every score is -inf gives NaN (0 / 0), on purpose."""
    return torch.softmax(scores, dim=-1)


def replace_masked(scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """s' = fill where masked, else s: a masked score becomes a constant (`masked_fill`, Flax)."""
    return torch.where(mask, scores, fill)


def add_to_masked(scores: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """s' = s + fill where masked, else s: transformers' eager attention adds a mask of
    finfo(dtype).min. The fill swamps the score (config.ADDED_FILL_LIMIT), so the value is the
    fill's, but the score is still an input of the sum: the backward pass reaches it."""
    return scores + torch.where(mask, 0.0, fill).to(scores.dtype)


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
    `add_to_masked` (config.masked_scores).

    `empty_rows` (keyword-only; 0.0 for empty_rows "zeros", and in the loss for a -inf fill,
    docs/training.md) gives a query with no key to attend to weights `empty_rows` instead of the
    softmax of its filled row: the row is selected out of the softmax (a double where, so that
    neither its value nor its gradient sees 0 / 0), and a NaN there cannot reach a weight
    gradient as 0 * NaN.

    The scores are formed, filled and normalised in at least float32, as fused kernels do:
    float16 cannot even hold a fill of -1e9 (its largest magnitude is 65504), and a bfloat16
    score of 20 would be rounded by up to 0.06, a 6% change of its weight. The weights are cast
    back to the model's dtype for the product with v.
    """
    q, k = at_least_float32(q), at_least_float32(k)
    scores = q @ k.transpose(-1, -2)  # (B, H, Tq, Tk)
    if scaled:
        scores = scores / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = masked(scores, mask, fill)
    if empty_rows is not None and mask is not None:
        empty = ~mask.any(dim=-1, keepdim=True)  # (B, H, Tq, 1): queries without a key
        weights = torch.where(empty, empty_rows, softmax(torch.where(empty, 0.0, scores))).to(v.dtype)
        return weights @ v, weights  # (B, H, Tq, K)
    weights = softmax(scores).to(v.dtype)  # (B, H, Tq, Tk)
    return weights @ v, weights  # (B, H, Tq, K)


def fast_attention(q, k, v, mask, fill: float, *, scaled: bool = True, empty_rows: float | None = None,
                   fix_ups=None) -> torch.Tensor:
    """The same attention through PyTorch's fused kernel, without the weights.

    `F.scaled_dot_product_attention` reads a boolean mask as we do (True = may attend) and
    replaces masked scores by -inf, so every row with at least one key agrees with the explicit
    path (a finite fill's exp(fill - max) underflows to 0 there as well). Where the kernel and
    the config part ways, the config wins:

    - a query with no key to attend to: the config says NaN (0 / 0) for a -inf fill and, for a
      finite fill, equal scores everywhere, i.e. the plain mean of v (or, with `empty_rows`,
      weights `empty_rows` on every key: empty_rows "zeros", the loss's rule for a -inf fill).
      The kernel never sees such a row: it is
      unmasked for the kernel (`mask | empty`), so no kernel's convention for it (0, NaN) and no
      0 / 0 in its backward pass can leak, and its result there is replaced;
    - a NaN value: `weights @ v` multiplies it by a masked key's weight 0 and gets NaN (IEEE),
      in every query; a fused kernel may skip masked keys, so that NaN is restored explicitly.

    Both fix-ups are one `where` (no host sync, no data-dependent branch, so it also compiles),
    and the gradient of a `where` selects: the replaced rows send the kernel a zero gradient.

    `fix_ups` (keyword-only): `kernel_fix_ups(v, mask, fill, empty_rows)` when it is known in
    advance (a cached step's cross-attention, whose values and mask do not change between steps,
    impl_torch/decode.py), instead of computing it again at every call.
    """
    kernel_mask, fix, fixed = kernel_fix_ups(v, mask, fill, empty_rows) if fix_ups is None else fix_ups
    heads = F.scaled_dot_product_attention(q, k, v, attn_mask=kernel_mask, scale=None if scaled else 1.0)  # (B, H, Tq, K)
    return heads if fix is None else torch.where(fix, fixed, heads)  # (B, H, Tq, K)


def passed_bias(attention, bias, dtype: torch.dtype):
    """The score bias as the stack computed it: T5's shared table read at the buckets, or None."""
    return bias


def own_table_bias(attention, buckets, dtype: torch.dtype) -> torch.Tensor:
    """UMT5: this attention's own (buckets, H) table read at the stack's buckets (Tq, Tk)."""
    return cast(attention.relative_bias[buckets], dtype).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o, head_h = Attention(Q W_q^h, K W_k^h, V W_v^h)
    (section 3.2.2). Head h owns columns h*K .. (h+1)*K - 1 of W_q, W_k and W_v."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, own_bias: bool = False):
        super().__init__()
        d, inner = config.d_model, config.inner_dim  # inner = H K: d_model unless d_head is set (T5's d_kv)
        self.q_proj = Linear(d, inner, config.qkv_bias, dtype)
        self.k_proj = Linear(d, inner, config.qkv_bias and config.key_bias, dtype)  # Whisper's key has none
        self.v_proj = Linear(d, inner, config.qkv_bias, dtype)
        self.o_proj = Linear(inner, d, config.out_proj_bias, dtype)
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.fill = config.mask_fill
        self.masked = masking(config)
        self.empty_rows = 0.0 if config.empty_rows == "zeros" else None  # None: the softmax of the filled row
        # The fused kernel replaces masked scores: added ones go to it only where they compute the
        # same (a -inf fill, empty rows of zeros), not where an empty row's gradient reaches q and k.
        self.fused = self.masked is replace_masked or "masked_scores" in inert_switches(config)
        self.temperature = config.attention_temp
        self.scaled = config.scale_scores
        # `own_bias` (UMT5's self-attention): a relative position table of its own, read at the
        # stack's buckets; else the stack's score bias is used as passed.
        self.relative_bias = nn.Parameter(torch.empty(config.relative_buckets, config.n_heads, dtype=dtype)) if own_bias else None
        self.layer_bias = own_table_bias if own_bias else passed_bias

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, mask_fill={self.fill:g}"

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # The heads from the width, not config.n_heads: a tensor-parallel shard holds H / model of them.
        if width % self.head_dim:
            raise ValueError(f"a projection of width {width} does not split into heads of size {self.head_dim}")
        x = x.view(batch, length, width // self.head_dim, self.head_dim)  # (B, L, H, K)
        return x.transpose(1, 2)  # (B, H, L, K)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """The queries x W_q split into heads (B, H, Tq, K), times the attention temperature:
        AlgoPerf's `attention_temp` scales the queries, so scores = temp * Q K^T / sqrt(K)."""
        q = self.split_heads(self.q_proj(x))  # (B, H, Tq, K)
        return q if self.temperature == 1.0 else q * self.temperature

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask, *, bias=None, return_attention: bool = True,
                empty_rows=None, cache=None):
        """x: (B, Tq, D) queries; memory: (B, Tk, D) keys and values (x itself for self-attention).

        `bias` (keyword-only): added to the scores, (1, H, Tq, Tk) (T5's relative position bias).
        `cache` (keyword-only; a cached decoding step, impl_torch/decode.py): where the keys and
        values come from instead, `cache.keys_values(self, memory)`.

        Returns the output (B, Tq, D) and the weights (B, H, Tq, Tk), or None for the weights
        when they are not wanted (the fused kernel never forms them). `empty_rows`: the loss's
        rule for a query with no key (0.0), which reaches the NaN rows of a -inf fill only (a
        finite fill's are uniform); the config's own rule (empty_rows "zeros") comes first.
        """
        q = self.queries(x)  # (B, H, Tq, K)
        if cache is None:
            k, v = self.keys_values(memory)  # (B, H, Tk, K) each
        else:
            k, v = cache.keys_values(self, memory)
        bias = self.layer_bias(self, bias, torch.promote_types(q.dtype, torch.float32))  # (1, H, Tq, Tk), or None
        empty_rows = self.empty_rows if self.empty_rows is not None else empty_rows if math.isinf(self.fill) else None
        # A score bias (T5) takes the explicit path, and so do added scores where they act (`fused`).
        if return_attention or bias is not None or not self.fused:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, self.fill, scaled=self.scaled, bias=bias,
                                                          masked=self.masked, empty_rows=empty_rows)
            weights = weights if return_attention else None
        else:
            fix_ups = None if cache is None else cache.fix_ups  # known once per search: the cross-attention's
            heads, weights = fast_attention(q, k, v, mask, self.fill, scaled=self.scaled, empty_rows=empty_rows,
                                            fix_ups=fix_ups), None
        batch, _, length, _ = heads.shape
        concat = heads.transpose(1, 2).reshape(batch, length, -1)  # (B, Tq, H K)
        return self.o_proj(concat), weights

    def keys_values(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected keys and values of `memory` (B, Tk, D), each (B, H, Tk, K), for the cache."""
        return self.split_heads(self.k_proj(memory)), self.split_heads(self.v_proj(memory))


# -- Feed-forward ------------------------------------------------------------------------------


class FeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2  (section 3.3; the paper's act is ReLU).

    With `ffn_glu` the activated units are multiplied by a linear gate (AlgoPerf's GLU, `MlpBlock`
    in algoperf/workloads/wmt/wmt_jax/models.py, `_ff_block` in wmt_pytorch/models.py):
        FFN(x) = (act(x W_1 + b_1) * (x W_gate + b_gate)) W_2 + b_2
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.linear1 = Linear(config.d_model, config.d_ff, config.ffn_bias, dtype)
        self.gate = Linear(config.d_model, config.d_ff, config.ffn_bias, dtype) if config.ffn_glu else None
        self.linear2 = Linear(config.d_ff, config.d_model, config.ffn_bias, dtype)
        self.activation = config.activation

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        units = activation(self.activation, self.linear1(x))  # (B, L, F)
        if self.gate is not None:
            units = units * self.gate(x)  # the linear gate branch (B, L, F)
        return self.linear2(units)


# -- Encoder layer -----------------------------------------------------------------------------
# Each sublayer is wrapped with a residual connection and a LayerNorm (sections 3.1 and 5.4):
#     post-LN (the paper):  x = LN(x + Sublayer(x))
#     pre-LN:               x = x + Sublayer(LN(x))
# `empty_rows` is attention's rule for a query with no key (see scaled_dot_product_attention).


def sublayer(x: torch.Tensor, fn, norm: LayerNorm, pre_ln: bool, dropout=None, site: str = ""):
    """x = LN(x + Sublayer(x)) (post-LN, the paper) or x + Sublayer(LN(x)) (pre-LN), the
    sublayer's output dropped out at `site` before the sum (sections 3.1 and 5.4).

    `fn(h)` returns the sublayer's output and its attention weights (None for the feed-forward);
    returns the new x and those weights."""
    h, weights = fn(norm(x) if pre_ln else x)
    h = apply_dropout(h, dropout, site)
    return (x + h if pre_ln else norm(x + h)), weights


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, dtype, own_bias=config.relative_bias_per_layer)
        self.self_attn_norm = LayerNorm(config, dtype)
        self.ffn = FeedForward(config, dtype)
        self.ffn_norm = LayerNorm(config, dtype)
        self.pre_ln = config.norm_placement == "pre"

    def forward(self, x: torch.Tensor, src_mask, name: str, out: ModelOutput | Encoded, *,
                bias=None, return_attention: bool = True, dropout=None, empty_rows=None) -> torch.Tensor:
        # `bias`: the self-attention's score bias (T5's relative positions), or None.
        options = {"return_attention": return_attention, "empty_rows": empty_rows}  # for each attention
        # Self-attention: each source position attends to every unmasked source position.
        x, out.attention[f"{name}.self"] = sublayer(
            x, lambda h: self.self_attn(h, h, src_mask, bias=bias, **options), self.self_attn_norm, self.pre_ln,
            dropout, f"{name}.self_attn")
        out.intermediates[f"{name}.self_attn"] = x

        # Position-wise feed-forward.
        x, _ = sublayer(x, lambda h: (self.ffn(h), None), self.ffn_norm, self.pre_ln,
                        dropout, f"{name}.ffn")
        out.intermediates[f"{name}.ffn"] = x
        return x


# -- Decoder layer -----------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, dtype, own_bias=config.relative_bias_per_layer)
        self.self_attn_norm = LayerNorm(config, dtype)
        self.cross_attn = MultiHeadAttention(config, dtype)
        self.cross_attn_norm = LayerNorm(config, dtype)
        self.ffn = FeedForward(config, dtype)
        self.ffn_norm = LayerNorm(config, dtype)
        self.pre_ln = config.norm_placement == "pre"

    def forward(self, x, memory, tgt_mask, cross_mask, name: str, out: ModelOutput, *,
                bias=None, return_attention: bool = True, dropout=None, empty_rows=None, cache=None) -> torch.Tensor:
        # `bias`: the self-attention's score bias (T5's relative positions), or None.
        # `cache`: the (self, cross) attentions' key and value sources of a cached step (decode.py).
        self_cache, cross_cache = (None, None) if cache is None else cache
        options = {"return_attention": return_attention, "empty_rows": empty_rows}  # for each attention
        # Masked self-attention: position t attends to target positions <= t.
        x, out.attention[f"{name}.self"] = sublayer(
            x, lambda h: self.self_attn(h, h, tgt_mask, bias=bias, cache=self_cache, **options), self.self_attn_norm,
            self.pre_ln, dropout, f"{name}.self_attn")
        out.intermediates[f"{name}.self_attn"] = x

        # Cross-attention: queries from the decoder, keys and values from the encoder's memory.
        x, out.attention[f"{name}.cross"] = sublayer(
            x, lambda h: self.cross_attn(h, memory, cross_mask, cache=cross_cache, **options), self.cross_attn_norm,
            self.pre_ln, dropout, f"{name}.cross_attn")
        out.intermediates[f"{name}.cross_attn"] = x

        # Position-wise feed-forward.
        x, _ = sublayer(x, lambda h: (self.ffn(h), None), self.ffn_norm, self.pre_ln,
                        dropout, f"{name}.ffn")
        out.intermediates[f"{name}.ffn"] = x
        return x


# -- Encoder and decoder -----------------------------------------------------------------------


def norm_of_sum(tokens: torch.Tensor, positions, norm) -> torch.Tensor:
    """LN(E x s + P): the embedding norm on the scaled tokens plus the position term (BART's
    `layernorm_embedding`), or E x s + P without one (section 3.4)."""
    x = tokens + positions
    return x if norm is None else norm(x)


def sum_of_norm(tokens: torch.Tensor, positions, norm) -> torch.Tensor:
    """LN(E x s) + P: the embedding norm on the scaled tokens alone, the position term added
    after it (BlenderbotSmall's decoder, `decoder_embedding_norm = "tokens"`)."""
    return norm(tokens) + positions


def embedding_sum(config: ModelConfig, stack: str):
    """How a stack combines its tokens, positions and embedding norm: `sum_of_norm` for a decoder
    with `decoder_embedding_norm = "tokens"`, else `norm_of_sum`."""
    return sum_of_norm if stack == "decoder" and config.decoder_embedding_norm == "tokens" else norm_of_sum


class Embedding(nn.Module):
    """A token lookup table (V, D). With `freeze_pad_embedding` the lookups of pad_id send its row
    no gradient (`nn.Embedding(padding_idx=pad_id)`); the forward is the same."""

    def __init__(self, config: ModelConfig, vocab_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, config.d_model, dtype=dtype))
        self.padding_idx = config.pad_id if config.freeze_pad_embedding else None

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, padding_idx={self.padding_idx}"

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = F.embedding(ids, self.weight, padding_idx=self.padding_idx)  # (B, L, D)
        return cast(rows, dtype)  # the looked-up rows cast, not the table


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        # The source's input: a token table, or a features source's front end (impl_torch/frontend.py).
        self.embedding = Embedding(config, config.src_vocab_size, dtype) if config.source == "ids" else None
        self.frontend = FrontEnd(config.n_mels, config.d_model, dtype) if config.source == "features" else None
        self.position = positions(config, dtype, bidirectional=True, length=config.source_len)
        self.embedding_norm = LayerNorm(config, dtype) if config.embedding_norm else None
        self.embedding_sum = embedding_sum(config, "encoder")
        self.layers = nn.ModuleList(EncoderLayer(config, dtype) for _ in range(config.n_encoder_layers))
        self.norm = LayerNorm(config, dtype) if config.final_encoder_norm else None

    def forward(self, x: torch.Tensor, src_mask, out: Encoded, *, return_attention: bool = True,
                dropout=None, empty_rows=None) -> torch.Tensor:
        self_mask = encoder_self_mask(self.config, src_mask)  # (B, 1, 1, S) or (B, 1, S, S)
        bias = self.score_bias(x.shape[1], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, self_mask, f"encoder.{i}", out, bias=bias, return_attention=return_attention, dropout=dropout,
                      empty_rows=empty_rows)
        x = self.finish(x)
        out.intermediates["encoder.output"] = x
        return x

    # The stack's own steps around its layers, named so that a caller running one layer at a
    # time (impl_torch/stream.py) takes these same steps.

    def score_bias(self, length: int, dtype: torch.dtype):
        """The score bias every layer's self-attention adds for x of `dtype`: T5's relative positions."""
        scores = torch.promote_types(dtype, torch.float32)  # the dtype attention forms its scores in
        bias = self.position.score_bias(length, length, scores)  # (1, H, S, S), or None
        return bias

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """`encoder.output`: x after the last layer through the final LayerNorm, when the config has one."""
        return x if self.norm is None else self.norm(x)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        # With shared embeddings the decoder reads the encoder's table (see Model.decode); it is
        # passed at call time, not registered here, so state_dict() holds it once.
        self.embedding = None if config.share_embeddings else Embedding(config, config.tgt_vocab_size, dtype)
        self.position = positions(config, dtype, bidirectional=False, length=config.max_len)
        self.embedding_norm = LayerNorm(config, dtype) if config.embedding_norm else None
        self.embedding_sum = embedding_sum(config, "decoder")
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.n_decoder_layers))
        self.norm = LayerNorm(config, dtype) if config.final_decoder_norm else None

    def forward(self, x, memory, tgt_mask, cross_mask, out: ModelOutput, *, bias=None,
                return_attention: bool = True, dropout=None, empty_rows=None, cache=None) -> torch.Tensor:
        # `bias`: the self-attention's score bias (a cached step's row of it); None: the stack's own.
        if bias is None:
            bias = self.score_bias(x.shape[1], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, tgt_mask, cross_mask, f"decoder.{i}", out, bias=bias, return_attention=return_attention,
                      dropout=dropout, empty_rows=empty_rows, cache=None if cache is None else cache[i])
        x = self.finish(x)
        out.intermediates["decoder.output"] = x
        return x

    # The stack's own steps around its layers, as in `Encoder`.

    def score_bias(self, length: int, dtype: torch.dtype):
        """The score bias every layer's self-attention adds for y of `dtype`: T5's relative positions."""
        scores = torch.promote_types(dtype, torch.float32)  # the dtype attention forms its scores in
        bias = self.position.score_bias(length, length, scores)  # (1, H, T, T), or None
        return bias

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """`decoder.output`: y after the last layer through the final LayerNorm, when the config has one."""
        return x if self.norm is None else self.norm(x)


class Output(nn.Module):
    """logits = y W_out + b_out. W_out is `output.weight` (D, V), or the target embedding
    transposed when the output is tied to it (section 3.4). With `scale_logits`,
    logits = y W_out / sqrt(D) + b_out (Flax examples/wmt's `logits_via_embedding`).

    The product y W_out is taken a block of vocabulary columns at a time (impl_torch/blocks.py):
    a W_out stored narrower than the compute dtype is never widened whole outside differentiation."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d, v = config.d_model, config.tgt_vocab_size
        self.weight = None if config.tie_output else nn.Parameter(torch.empty(d, v, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(v, dtype=dtype)) if config.output_bias else None
        self.scale_logits = config.scale_logits

    def forward(self, y: torch.Tensor, tied_embedding: Embedding, *, weight=None) -> torch.Tensor:
        # W_out as stored: `output.weight` (D, V), or the tied embedding (V, D); or `weight`, a
        # (D, V) copy a cached step multiplies instead (decode.step_output_weight) or its oneDNN-packed
        # W_out (impl_torch/packed.py)
        if weight is not None:
            vocab_axis = 1
        else:
            weight, vocab_axis = (tied_embedding.weight, 0) if self.weight is None else (self.weight, 1)
        if weight.is_mkldnn:
            logits = packed.product(y, weight)  # (B, T, V)
        else:
            logits = product_in_blocks(y, weight, vocab_axis, cast)  # (B, T, V)
        # Outside autograd's graph the scale and the bias are applied in place: at V = 32000 each
        # fresh result would be another copy of the largest tensor of the forward pass.
        if self.scale_logits:
            scale = math.sqrt(y.shape[-1])
            logits = logits / scale if logits.requires_grad else logits.div_(scale)
        if self.bias is not None:
            bias = cast(self.bias, y.dtype)
            logits = logits + bias if logits.requires_grad else logits.add_(bias)
        return logits


# -- Model -------------------------------------------------------------------------------------


def trained_bias(bias: torch.Tensor) -> torch.Tensor:
    """BART's final_logits_bias trained (freeze_final_logits_bias off): its values, and a gradient."""
    return bias


def frozen_bias(bias: torch.Tensor) -> torch.Tensor:
    """BART's final_logits_bias frozen, as transformers' buffer: its values, and no gradient.

    Detached from autograd's graph: its gradient is a zero one."""
    return bias.detach()


class Model(nn.Module):
    """The whole encoder-decoder (figure 1 of the paper), configured by a `ModelConfig`.

    `Model(config, params, dtype, device=...)` takes the canonical parameters (see
    `conformance.core.params`) as NumPy arrays (e.g. from `conformance.checkpoint.load`) or torch
    tensors; `params=None` draws them with `conformance.init_params(config)` (float64). `dtype`
    casts them (float32, float64, float16 or bfloat16; default: their own dtype); the cast values
    must be finite too. `device` (keyword-only, so that the first three arguments mean the same
    in every backend; default "cpu") is where the parameters are created; one that is not
    present here is an `InputError`.

    The model is an ordinary `nn.Module`: `.to("cuda")`, `.to(torch.float16)`, `torch.compile`,
    `torch.inference_mode()` and autograd all apply; a call under `torch.autocast` is refused with an
    `InputError` (it would recompute the products in autocast's dtype: `param_dtype` is the mixed
    precision, `impl_torch.precision.check_no_autocast`). `.to(dtype)` casts the sinusoid buffer along
    with the parameters, like any buffer. Under `torch.compile` the input checks stay eager (they
    read ids on the host), so the tensor work compiles as a few graphs, not one `fullgraph`.
    `model.compile()` compiles it in place, so `loss_and_grads` and `train_step` run compiled too
    (docs/training.md, "Compiled training").

    `param_dtype` (keyword-only; any of `SUPPORTED_DTYPES`; default None: `dtype`) stores the
    parameters in another dtype than the one the model computes in: `Model(config, params32,
    torch.float64, param_dtype=torch.float32)` holds the float32 values as they are (half a
    float64 model's memory) and widens each where it is used (`cast`), exactly, so every output
    equals the float64 model's built from the same values, bit for bit; float32 parameters with
    `dtype=torch.float16` is mixed precision. Without `param_dtype` the compute dtype follows the
    parameters, as in any module (`.to(torch.float16)` makes a float16 model). With it, the
    compute dtype is fixed at construction: `.to(dtype)` (and `.half()`, `.double()`, ...) then
    recasts the storage only, and the sinusoid buffer stays in the compute dtype. Gradients
    (`loss_and_grads`) come in `param_dtype`, each computed in `dtype` and rounded once (autograd
    through `cast` itself, e.g. `loss.backward()`, rounds each use's gradient and sums them in
    `param_dtype`, as mixed-precision training does).

    The module starts in `eval()` mode, from `Model(...)` and from `load` alike, and its mode
    changes nothing: `.train()` does not switch dropout on. Dropout (section 5.4) happens only
    where a call passes `dropout=` masks (`conformance.core.dropout.draw_dropout(config, B, S, T,
    rate, seed)`, docs/training.md), the same masks in every backend, so that a training step is
    the same step in all three; a call without them is deterministic in either mode.
    """

    backend = "torch"

    def __init__(self, config: ModelConfig, params: Mapping[str, Any] | None = None, dtype: Any = None, *,
                 device: torch.device | str | None = None, param_dtype: Any = None):
        super().__init__()
        device = resolve_device(device)
        # Checked, cast and re-checked on the host by the core, like every backend's parameters.
        params, model_dtype = prepare_params(config, params, None if dtype is None else dtype_name(dtype),
                                             self.backend, SUPPORTED_DTYPES, as_numpy=to_numpy,
                                             param_dtype=None if param_dtype is None else dtype_name(param_dtype))
        stored = next(iter(params.values())).dtype.name  # the parameters' dtype: param_dtype, or model_dtype
        # None: the compute dtype follows the parameters (`.to(torch.float16)` makes a float16
        # model); with `param_dtype` it is fixed here, and `.to(dtype)` recasts the storage only.
        self._compute_dtype = None if param_dtype is None else getattr(torch, model_dtype)
        dtype = getattr(torch, stored)
        self.config = config
        # Factory functions inside create the (still uninitialised) tensors on `device` directly.
        with torch.device(device):
            self.encoder = Encoder(config, dtype)
            self.decoder = Decoder(config, dtype)
            self.output = Output(config, dtype)
            self.final_logits_bias = nn.Parameter(torch.empty(config.tgt_vocab_size, dtype=dtype)) if config.final_logits_bias else None
        self.frozen_logits_bias = config.freeze_final_logits_bias  # a buffer in transformers: no gradient
        self.logits_bias = frozen_bias if config.freeze_final_logits_bias else trained_bias
        # A strict key-for-key copy: state_dict() names are the checkpoint's names. copy_ moves
        # each value to the device; each host array is let go of once copied, so that a cast copy
        # of the whole set and the model's never coexist (2x a float64 model's parameters).
        state = self.state_dict()
        if state.keys() != params.keys():  # the core checked the names against the config: a bug here
            raise RuntimeError(f"the module's parameters differ from the checkpoint's: {sorted(state.keys() ^ params.keys())}")
        for key in list(params):
            state[key].copy_(to_torch(params.pop(key), stored))
        if self._compute_dtype is not None:
            self._apply(lambda t: t)  # the sinusoid buffer in the compute dtype (see `_apply`)
        self.eval()  # as `load` returns it: the mode switches nothing (see the class docstring)

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module`'s hook under `.to()`, `.half()`, `.cuda()`, ...: with a fixed compute dtype
        (`param_dtype` given) a dtype change recasts the parameters only, and the sinusoid buffer
        is kept in the compute dtype, computed again from float64 where it was recast."""
        super()._apply(fn, recurse)
        if self._compute_dtype is not None:
            for position in (self.encoder.position, self.decoder.position):
                if not isinstance(position, Positions) or isinstance(position.table, nn.Parameter):
                    continue  # a stored table or T5's relative bias: parameters, recast as stored
                if position.table.dtype != self._compute_dtype:
                    table = position_table(self.config, position.length)
                    position.table = to_torch(table, dtype_name(self._compute_dtype)).to(position.table.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the parameters' own, unless `param_dtype` fixed it at construction."""
        return self.target_embedding.weight.dtype if self._compute_dtype is None else self._compute_dtype

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the parameters are stored in (`dtype` is the one they are computed in)."""
        return self.target_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device the parameters (and so every computation) live on."""
        return self.target_embedding.weight.device

    # Inputs ------------------------------------------------------------------------------------
    # Ids and masks are checked before any kernel indexes with them: on CUDA an out-of-range id
    # would otherwise surface as an opaque device-side assert instead of the shared error. For
    # NumPy input the facts are taken on the host; for a tensor, one min/max reduction and sync.

    def ids(self, argument: str, ids, vocab_size: int) -> torch.Tensor:
        """`ids` checked as a call checks `argument` (its shape, dtype, range), as this backend's ids."""
        return self._ids(argument, ids, vocab_size)

    @eager_under_compile  # host-side checks: torch.compile runs them eagerly, outside the graph
    def _ids(self, argument: str, ids, vocab_size: int) -> torch.Tensor:
        check_no_autocast(self.device)  # the model's dtype is its precision, not autocast's
        if not isinstance(ids, torch.Tensor):
            ids = host_ids(argument, ids, vocab_size, self.config.max_len)
            return torch.tensor(ids, dtype=torch.long, device=self.device)
        if graphs.checked_static_input(ids):  # a training graph's input, checked before its recording
            return ids
        is_integer = not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
        bounds = lambda: id_bounds(ids)  # noqa: E731
        check_ids(argument, ids.shape, dtype_name(ids.dtype), is_integer, bounds, vocab_size, self.config.max_len)
        return ids.to(device=self.device, dtype=torch.long)

    @eager_under_compile
    def source(self, src_ids) -> torch.Tensor:
        """The source checked as a call checks it: ids (B, S) (`ids`), or a features source's
        log-mel features (B, n_mels, frames) (`conformance.core.inputs.check_features`)."""
        if self.config.source != "features":
            return self._ids("src_ids", src_ids, self.config.src_vocab_size)
        check_no_autocast(self.device)
        if not isinstance(src_ids, torch.Tensor):
            return torch.tensor(host_features("src_ids", src_ids, self.config), device=self.device)
        if graphs.checked_static_input(src_ids):  # a training graph's input, checked before its recording
            return src_ids
        finite = lambda: bool(torch.isfinite(src_ids).all())  # noqa: E731 - one reduction, one sync
        check_features("src_ids", src_ids.shape, dtype_name(src_ids.dtype), src_ids.is_floating_point(), finite,
                       self.config)
        return src_ids.to(self.device)

    @eager_under_compile
    def _mask(self, argument: str, mask, expected, derived: torch.Tensor) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor):
            mask = host_mask(argument, mask, expected, derived.cpu().numpy())
            return torch.tensor(mask, device=self.device)
        check_mask(argument, mask.shape, dtype_name(mask.dtype), mask.dtype == torch.bool, *expected)
        mask = mask.to(self.device)
        widened = torch.argwhere(mask & ~derived)  # (b, h, q, k) the ids forbid but the mask allows
        check_mask_within_ids(argument, widened[0].tolist() if len(widened) else None)
        return mask

    def make_masks(self, src_ids, tgt_ids) -> tuple[torch.Tensor, torch.Tensor]:
        return make_masks(self.config, torch.as_tensor(src_ids), torch.as_tensor(tgt_ids))

    def cross_mask(self, src_mask):
        """The decoder's cross-attention mask: the source's (B, 1, 1, S), or None when the config attends every
        source position (`cross_attn_src_mask` off)."""
        return src_mask if self.config.cross_attn_src_mask else None

    # Forward -----------------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor, embedding: Embedding, position: Positions, norm=None, *,
              at=None, combine=norm_of_sum) -> torch.Tensor:
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

    def embed_source(self, src_ids: torch.Tensor, out: Encoded) -> torch.Tensor:
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

    def logits(self, y: torch.Tensor, *, weight=None) -> torch.Tensor:
        """The logits (B, T, V) of `decoder.output` y: the output layer, plus BART's `final_logits_bias`.

        `weight` (keyword-only): a (D, V) copy of W_out to multiply instead (`Output`; a cached step's
        `decode.step_output_weight`)."""
        logits = self.output(y, self.target_embedding, weight=weight)  # (B, T, V)
        if self.final_logits_bias is not None:  # in place outside autograd's graph, as in `Output`
            bias = self.logits_bias(cast(self.final_logits_bias, logits.dtype))
            logits = logits + bias if logits.requires_grad else logits.add_(bias)
        return logits

    def encode(self, src_ids, src_mask=None, *, return_attention: bool = True, dropout=None, sink=None,
               empty_rows=None) -> Encoded:
        """Run the encoder: the memory (B, S, D) plus its attention weights and intermediates
        (with a `sink`, handed to it one at a time instead).

        `empty_rows` (keyword-only): None, the default, gives a query with no key to attend to
        the config's answer (NaN for a -inf fill); `loss_and_grads` passes 0.0, the training rule
        of docs/training.md (`scaled_dot_product_attention`)."""
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
        if dropout is not None:  # the checked host masks, on the model's device
            dropout = Dropout(dropout.rate, {site: torch.tensor(m, device=self.device) for site, m in dropout.masks.items()})
        x = self.embed_source(src_ids, encoded)
        encoded.intermediates["encoder.embeddings"] = x
        x = apply_dropout(x, dropout, "encoder.embeddings")
        encoded.memory = self.encoder(x, src_mask, encoded, return_attention=return_attention, dropout=dropout,
                                      empty_rows=empty_rows)
        if not return_attention:  # None, not {}: "not asked for", never "no attention layers"
            encoded.attention = None
        return encoded

    def decode(self, tgt_ids, encoded: Encoded, tgt_mask=None, *, return_attention: bool = True,
               dropout=None, sink=None, empty_rows=None) -> ModelOutput:
        """Run the decoder against `encode`'s result: logits (B, T, V) and everything recorded
        (with a `sink`, handed to it one at a time instead, the logits last).

        `empty_rows`: as for `encode`."""
        tgt_ids = self._ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size)
        check_memory(self.config, encoded.memory.shape, dtype_name(encoded.memory.dtype), dtype_name(self.dtype))
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

        if dropout is not None:  # the checked host masks, on the model's device
            dropout = Dropout(dropout.rate, {site: torch.tensor(m, device=self.device) for site, m in dropout.masks.items()})
        y = self.embed(tgt_ids, self.target_embedding, self.decoder.position, self.decoder.embedding_norm,
                       combine=self.decoder.embedding_sum)
        out.intermediates["decoder.embeddings"] = y
        y = apply_dropout(y, dropout, "decoder.embeddings")
        y = self.decoder(y, encoded.memory, tgt_mask, cross_mask, out, return_attention=return_attention,
                         dropout=dropout, empty_rows=empty_rows)
        logits = self.logits(y)
        assert logits.dtype == self.dtype, f"promoted to {logits.dtype}"
        if sink is not None:  # the sink has had every other tensor; the output keeps none of them
            sink("logits", logits)
            logits = None
        out.logits = logits
        if not return_attention:
            out.attention = None
        return out

    def forward(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, *, return_attention: bool = True,
                dropout=None, sink=None, empty_rows=None) -> ModelOutput:
        """logits (B, T, V) for source ids (B, S) and decoder input ids (B, T), plus the
        attention weights (`return_attention`) and the intermediates by name.

        `dropout` (keyword-only, training): a `conformance.core.dropout.Dropout` (masks drawn by
        `draw_dropout` from one NumPy seed); None, the default, is inference: no dropout.

        `sink` (keyword-only): `sink(name, tensor)` receives every attention map and intermediate
        as soon as it is computed, then the logits, in `forward_order`; the returned output then
        keeps none of them (conformance.core.output).

        Without the attention weights, attention runs through PyTorch's fused kernel. `empty_rows`:
        as for `encode`."""
        encoded = self.encode(src_ids, src_mask, return_attention=return_attention, dropout=dropout, sink=sink,
                              empty_rows=empty_rows)
        return self.decode(tgt_ids, encoded, tgt_mask, return_attention=return_attention, dropout=dropout, sink=sink,
                           empty_rows=empty_rows)

    # Training ----------------------------------------------------------------------------------

    def loss_and_grads(self, src_ids, tgt_ids, labels, *, label_smoothing: float = 0.0, dropout=None):
        """The training loss of docs/training.md and its gradient for every parameter.

        By autograd:

            loss = 1/N · sum over the N counted tokens (labels != pad_id) of
                   (1 - ε) · -log p(label) + ε · 1/V · sum_v -log p(v),   p = softmax(logits)

        which is `F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=pad_id,
        label_smoothing=ε)`. Returns the loss (a 0-d tensor, at least float32) and the gradients
        as a dict keyed by the canonical parameter names (`state_dict()`'s), each of its
        parameter's shape and dtype, on the model's device (with a `param_dtype` other than
        `dtype`: computed in `dtype`, each rounded once to `param_dtype`). The ids are checked as
        by `forward`; labels (B, T) must be target ids with at least one that is not `pad_id`.
        `dropout`: as for `forward` (masks from `conformance.core.dropout.draw_dropout`), None for
        none. On a CUDA device a call without dropout whose shapes recur is replayed from a CUDA
        graph (impl_torch/graphs.py): the same kernels, the same numbers.
        """
        given = (src_ids, tgt_ids)  # NumPy ids are read on the host as given, not copied back from the device
        src_ids = self.source(src_ids)
        tgt_ids = self._ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size)
        check_same_batch(src_ids.shape, tgt_ids.shape)
        labels = host_labels(self.config, to_numpy(labels), tuple(tgt_ids.shape))
        check_labels_finite(self.config, *(to_numpy(ids) for ids in given), labels)
        epsilon = check_label_smoothing(label_smoothing)
        targets = torch.tensor(labels, dtype=torch.long, device=self.device)  # (B, T)
        # On a GPU, the same tensor work replayed from a CUDA graph once its shapes recur (impl_torch/graphs.py).
        replayed = (graphs.replayed_loss_and_grads(self, src_ids, tgt_ids, targets, epsilon)
                    if dropout is None and type(self) is Model else None)
        loss, grads = replayed or self._loss_and_grads(src_ids, tgt_ids, targets, epsilon, dropout)
        grads = dict(zip((name for name, _ in self.named_parameters()), grads))
        return loss, {name: grads[name] for name in param_shapes(self.config)}  # checkpoint order

    def _loss_and_grads(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor, targets: torch.Tensor, epsilon: float,
                        dropout) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tensor work of `loss_and_grads` on its checked ids and targets (B, T), on the
        model's device: the loss, detached, and the gradients in `named_parameters` order."""
        counted = targets != self.config.pad_id  # (B, T)
        params = list(self.parameters())
        # With a param_dtype other than dtype, autograd runs at copies of the parameters in the
        # compute dtype, and each gradient is rounded once to param_dtype. Through `cast` at each
        # use, autograd would round every use's gradient to param_dtype and sum them there (a
        # shared or tied embedding, the scatter-add of looked-up rows): an ulp away.
        mixed = self.param_dtype != self.dtype
        with torch.no_grad():  # the copies are leaves of the graph below (no .detach(): 260 dispatches fewer)
            leaves = [leaf_in(p, self.dtype) for p in params] if mixed else params
        # A query with no key to attend to (-inf fill) gets zero weights instead of NaN while the
        # loss runs: a NaN activation would reach every weight gradient as 0 * NaN. Attention runs
        # through the fused kernel (`fast_attention`), which takes that rule outside the kernel.
        forward = {"dropout": dropout, "empty_rows": 0.0, "return_attention": False}
        with torch.enable_grad():
            with parameters_replaced(self, {id(p): leaf for p, leaf in zip(params, leaves)} if mixed else {}):
                logits = self(src_ids, tgt_ids, **forward).logits  # (B, T, V)
            # The counted positions are selected before the log-softmax, never multiplied by 0: a
            # padded row is replaced by zeros (a where, whose gradient selects), so a NaN there
            # reaches neither the loss nor the gradient; the fused cross-entropy then ignores it
            # (ignore_index) and averages over the N counted positions. No host sync.
            selected = at_least_float32(torch.where(counted[..., None], logits, 0.0))  # (B, T, V)
            loss = F.cross_entropy(selected.flatten(0, 1), targets.flatten(), ignore_index=self.config.pad_id,
                                   label_smoothing=epsilon)
            grads = torch.autograd.grad(loss, leaves, materialize_grads=True)
        return loss.detach(), [cast(grad, param.dtype) for grad, param in zip(grads, params)]

    # Generation ------------------------------------------------------------------------------
    # The decoder with a KV cache: each layer keeps the keys and values of the positions so far,
    # and the memory's keys and values are projected once per source, so that a step costs O(T).
    # The cache, the cached step and the search driver live in impl_torch/decode.py.

    def start_cache(self, encoded: Encoded, length: int) -> DecoderCache:
        """An empty cache for up to `length` positions against `encoded` (one row per decoder row)."""
        return decode.start_cache(self, encoded, length)

    def decode_step(self, tgt_ids, cache: DecoderCache) -> torch.Tensor:
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
