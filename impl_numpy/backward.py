"""The backward pass of impl_numpy/model.py, by hand, layer by layer: the gradient oracle.

Read it next to model.py: the sections come in the same order, each function is named after the
forward piece it differentiates (`layer_norm_backward` for `LayerNorm`), and each forward
equation is repeated above its derivative. Gradients flow in the reverse order of the forward
pass: the loss, the output projection, the decoder layers from the last to the first (each
handing a gradient to the encoder's memory through its cross-attention), the encoder layers,
and finally the embeddings and positions. In float64 this is the oracle that the PyTorch and
JAX gradients are judged against, so it is written out, never fused or approximated.

Notation: `d_x` is dLoss/dx, an array of x's shape. A parameter's gradient is summed over every
position that used the parameter; `grads` maps canonical names (`param_shapes(config)`) to them.

Dtypes. Everything here runs in the model's compute `dtype`: a parameter stored in another
`param_dtype` is widened or rounded as the forward's `cast` reads it (`astype(dtype, copy=False)`,
the array itself when the dtypes agree), the gradients are
accumulated in `dtype`, and each is rounded once to `param_dtype` at the very end, which is what
autograd gives for a parameter stored in that dtype.

Padding. The loss selects the positions that count (labels != pad_id) and never looks at the
others. With a `-inf` fill a query with no key to attend to gives a NaN row (0 / 0), and the
NaN travels down its position, but it can never reach a finite loss: every use of a NaN in a
sum gives NaN. So a row the forward left NaN belongs to no path to the loss, and its gradient is
0. `alive` reads such a kept value as 0, so that the products below never compute 0 x NaN
(= NaN): the NaN rows are selected out, as in the loss, not multiplied by zero. A counted label
at a position whose logits are NaN makes the loss NaN, and the gradient NaN with it: that is the
honest answer, not hidden.

Shape legend as in model.py: B batch, S source length, T target length, D d_model, H heads,
K head dim, F d_ff, V target vocabulary; Tq / Tk are query / key lengths inside attention.
"""

from __future__ import annotations

import math

import numpy as np

from conformance.core.params import param_shapes

Grads = dict  # canonical parameter name -> gradient, the parameter's shape and dtype


class Tape(dict):
    """What a forward pass keeps for this backward pass, by module: the input of each `Linear`,
    `LayerNorm` and of `Output`, the units of each `FeedForward` (before and after the activation,
    and its gate), and `(q, k, v, weights, mask)` of each `MultiHeadAttention`. `Model.loss_and_grads` passes a
    fresh tape to its forward call and hands it here; a plain call passes none and keeps nothing
    (a base-size model's tape at length 512 holds ~1.2 GB in float64)."""


def alive(x: np.ndarray) -> np.ndarray:
    """A kept forward value with the NaN of fully masked rows read as 0 (see the module
    docstring: those rows cannot reach the loss, and 0 x NaN must not reach the gradient)."""
    return np.where(np.isnan(x), 0, x)


# -- Masks -------------------------------------------------------------------------------------
# Masks are constants of the ids: nothing to differentiate. Where a mask replaces a score with the
# fill value, the score has no influence on the output, so its gradient is dropped
# (`replace_masked_backward`); where the fill is added to it, the score is still an input of the
# sum, and its gradient passes (`add_to_masked_backward`).


def replace_masked_backward(d_scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """s' = fill where masked, else s  ->  ds = ds' where not masked, 0 where masked."""
    # A masked score was replaced by the constant fill: it does not reach the output, so no
    # gradient reaches it. (A row with every key masked and a finite fill is a uniform
    # average: its softmax gradient is not 0 there, and must still be dropped.)
    d_scores = np.where(mask, d_scores, 0)
    return d_scores


def add_to_masked_backward(d_scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """s' = s + fill where masked, else s  ->  ds = ds' everywhere. A masked score of a row with
    an unmasked key has weight 0 (exp(fill - max) underflows), so its softmax gradient is 0; in a
    row with every key masked the weights are uniform and the gradient is the softmax's."""
    return d_scores


# The backward of each way masked scores meet the fill (model.masking), by the forward's name.
MASKED_BACKWARD = {"replace_masked": replace_masked_backward, "add_to_masked": add_to_masked_backward}


# -- Positions ---------------------------------------------------------------------------------


def positions_backward(config, position, prefix: str, ids: np.ndarray, d_x: np.ndarray, grads: Grads) -> None:
    """x = embedding + P[rows]  ->  dP[row] = the sum of dx over every token that read that row
    (rows p + position_offset; with "non-pad" position ids only the tokens that are not padding).

    Only a stored table (`{prefix}.table`) has a gradient; a sinusoid is a constant of the config.
    """
    if config.position == "table":
        rows, real = position.rows(ids)  # (1|B, L), and where a term was added
        if real is True:
            grads[f"{prefix}.table"][rows[0]] += d_x.sum(axis=0)  # (L, D): one row per position
        else:
            np.add.at(grads[f"{prefix}.table"], rows[real], d_x[real])


def score_bias_backward(tape: Tape, position, prefix: str, d_bias: list, grads: Grads) -> None:
    """bias[h, i, j] = R[bucket(j - i), h] added to every self-attention layer of the stack (T5)
    ->  dR[b, h] = the sum, over the layers and over every (i, j) in bucket b, of d scores[h, i, j];
    with a table per layer (UMT5), each layer's dR_l gets its own layer's sum only.
    `d_bias` holds each layer's (H, Tq, Tk), summed over the batch; empty without a score bias."""
    if d_bias:
        buckets = tape[position]  # (Tq, Tk)
        if type(position).__name__ == "RelativeBuckets":  # UMT5: each layer's own table (relative_bias_per_layer)
            stack = prefix.split(".", 1)[0]
            for i, d in enumerate(reversed(d_bias)):  # appended from the last layer to the first
                np.add.at(grads[f"{stack}.layers.{i}.self_attn.relative_bias"], buckets, d.transpose(1, 2, 0))
            return
        np.add.at(grads[f"{prefix}.relative_bias"], buckets, sum(d_bias).transpose(1, 2, 0))  # (Tq, Tk, H)


# -- Building blocks ---------------------------------------------------------------------------


def linear_backward(tape: Tape, linear, prefix: str, d_y: np.ndarray, grads: Grads) -> np.ndarray:
    """y = x W + b  ->  dW = x^T dy, db = sum of dy (both over every position), dx = dy W^T."""
    x = alive(tape[linear])
    d_in, d_out = linear.weight.shape
    grads[f"{prefix}.weight"] += x.reshape(-1, d_in).T @ d_y.reshape(-1, d_out)  # (d_in, d_out)
    if linear.bias is not None:
        grads[f"{prefix}.bias"] += d_y.reshape(-1, d_out).sum(axis=0)
    return d_y @ linear.weight.astype(d_y.dtype, copy=False).T


def layer_norm_backward(tape: Tape, norm, prefix: str, d_y: np.ndarray, grads: Grads) -> np.ndarray:
    """y = n * weight + bias, n the normalised x  ->  dweight = sum of dy * n, dbias = sum of dy,
    dn = dy * weight, and dx as below for each form. c = x - mean(x) throughout."""
    x = alive(tape[norm])
    d = x.shape[-1]
    if norm.form == "rms":
        # y = n * weight, n = x r, r = (mean(x^2) + eps)^(-1/2)  ->  dx = r (dn - n mean(dn n))
        rstd = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + norm.eps)
        normed = x * rstd
        grads[f"{prefix}.weight"] += (d_y * normed).reshape(-1, d).sum(axis=0)
        d_normed = d_y * norm.weight.astype(d_y.dtype, copy=False)
        return rstd * (d_normed - normed * (d_normed * normed).mean(axis=-1, keepdims=True))
    centered = x - x.mean(axis=-1, keepdims=True)
    if norm.form in ("standard", "fast-variance"):  # the same function: E[x^2] - E[x]^2 = mean(c^2)
        rstd = 1 / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + norm.eps)
        normed = centered * rstd
    else:
        std = np.sqrt((centered * centered).sum(axis=-1, keepdims=True) / (d - 1))
        normed = centered / (std + norm.eps)
    grads[f"{prefix}.weight"] += (d_y * normed).reshape(-1, d).sum(axis=0)
    if norm.bias is not None:
        grads[f"{prefix}.bias"] += d_y.reshape(-1, d).sum(axis=0)
    d_normed = d_y * norm.weight.astype(d_y.dtype, copy=False)
    if norm.form in ("standard", "fast-variance"):
        # n = c r, r = (mean(c^2) + eps)^(-1/2). The three terms: dn itself; the mean that c
        # subtracts; and the variance, which depends on every element of the row:
        #     dx = r (dn - mean(dn) - n mean(dn n))
        return rstd * (d_normed - d_normed.mean(axis=-1, keepdims=True)
                       - normed * (d_normed * normed).mean(axis=-1, keepdims=True))
    # n = c / (s + eps), s = sqrt(sum(c^2) / (D - 1)) (the unbiased std), ds/dc = c / ((D - 1) s):
    #     dc = dn / (s + eps) - c sum(dn c) / ((s + eps)^2 (D - 1) s)
    #     dx = dc - mean(dc)                                   (c = x - mean(x))
    # A constant row has c = 0 and s = 0: its second term is 0 (c = 0), not 0 / 0.
    safe_std = np.where(std > 0, std, 1)
    d_centered = (d_normed / (std + norm.eps)
                  - centered * (d_normed * centered).sum(axis=-1, keepdims=True)
                  / ((std + norm.eps) ** 2 * safe_std * (d - 1)))
    return d_centered - d_centered.mean(axis=-1, keepdims=True)


def activation_backward(name: str, x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """dy/dx of each activation at its input x, times dy."""
    if name == "relu":
        # relu(x) = max(x, 0)  ->  1 where x > 0, else 0 (0 at x = 0, as PyTorch and JAX)
        return d_y * (x > 0)
    if name == "gelu":
        # gelu(x) = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2  ->  Phi(x) + x phi(x),
        # phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the normal density
        erf = np.frompyfunc(math.erf, 1, 1)(x * (1 / math.sqrt(2))).astype(x.dtype)
        pdf = np.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
        return d_y * (0.5 * (1 + erf) + x * pdf)
    if name == "gelu-tanh":
        # gelu(x) = x (1 + tanh(u)) / 2, u = c (x + 0.044715 x^3), c = sqrt(2 / pi)
        #   ->  (1 + tanh(u)) / 2 + x (1 - tanh(u)^2) c (1 + 3 * 0.044715 x^2) / 2
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x**3))
        return d_y * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))
    if name == "tanh":
        # tanh(x)  ->  1 - tanh(x)^2
        t = np.tanh(x)
        return d_y * (1 - t * t)
    # silu(x) = x sigmoid(x)  ->  sigmoid(x) (1 + x (1 - sigmoid(x)))
    sigmoid = 0.5 * (1 + np.tanh(0.5 * x))
    return d_y * sigmoid * (1 + x * (1 - sigmoid))


# -- Attention ---------------------------------------------------------------------------------


def softmax_backward(weights: np.ndarray, d_weights: np.ndarray) -> np.ndarray:
    """a = softmax(s) over the last axis  ->  ds = a * (da - sum_k a da): the Jacobian
    diag(a) - a a^T applied to da, one row at a time."""
    return weights * (d_weights - (weights * d_weights).sum(axis=-1, keepdims=True))


def scaled_dot_product_attention_backward(q, k, v, weights, mask, d_out, *, scaled: bool = True,
                                           masked=replace_masked_backward):
    """out = a V, a = softmax(fill where masked, else s), s = Q K^T / sqrt(K) + bias  (section 3.2.1)  ->

        da = d_out V^T,  dV = a^T d_out,  ds = softmax'(da), 0 where masked,  dbias = ds,
        dQ = ds K / sqrt(K),  dK = ds^T Q / sqrt(K)   (without the 1 / sqrt(K) when not `scaled`).

    q: (B, H, Tq, K); k, v: (B, H, Tk, K); weights: (B, H, Tq, Tk); d_out: (B, H, Tq, K).
    Returns dq, dk, dv and ds (B, H, Tq, Tk), the gradient of a bias added to the scores.
    `masked` (keyword-only): the backward of how masked scores met the fill (`MASKED_BACKWARD`).
    A query with no key under empty_rows "zeros" has weights 0: nothing reaches q, k or v from it.
    """
    d_weights = d_out @ v.swapaxes(-1, -2)  # (B, H, Tq, Tk)
    d_v = weights.swapaxes(-1, -2) @ d_out  # (B, H, Tk, K)
    d_scores = softmax_backward(weights, d_weights)  # (B, H, Tq, Tk)
    if mask is not None:
        d_scores = masked(d_scores, mask)
    d_bias = d_scores
    if scaled:
        d_scores = d_scores / math.sqrt(q.shape[-1])
    return d_scores @ k, d_scores.swapaxes(-1, -2) @ q, d_v, d_bias  # (B, H, Tq, K), (B, H, Tk, K) x 2


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, H, L, K) -> (B, L, H K): the inverse of `MultiHeadAttention.split_heads`."""
    batch, heads, length, head_dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim)  # (B, L, H K)


def multi_head_attention_backward(tape: Tape, attn, prefix: str, d_out: np.ndarray, grads: Grads, d_bias=None):
    """MultiHead(x, memory) = Concat(heads) W_o, heads from x W_q, memory W_k, memory W_v
    (section 3.2.2). Returns (d_x, d_memory): what reaches the queries' input and what reaches
    the keys' and values' input (the same array for self-attention: the caller adds them).
    `d_bias` (a list): where an attention with a score bias appends the bias's gradient, summed
    over the batch (H, Tq, Tk)."""
    q, k, v, weights, mask, biased = tape[attn]
    d_concat = linear_backward(tape, attn.o_proj, f"{prefix}.o_proj", d_out, grads)  # (B, Tq, H K)
    # concat = heads transposed and reshaped, so its gradient splits back the same way.
    d_heads = attn.split_heads(d_concat)  # (B, H, Tq, K)
    d_q, d_k, d_v, d_scores = scaled_dot_product_attention_backward(
        alive(q), alive(k), alive(v), alive(weights), mask, d_heads, scaled=attn.scaled,
        masked=MASKED_BACKWARD[attn.masked.__name__])
    if biased:
        d_bias.append(d_scores.sum(axis=0))  # (H, Tq, Tk)
    if attn.temperature != 1.0:
        d_q = d_q * attn.temperature  # q = temp * (x W_q): the saved q is the scaled one
    d_x = linear_backward(tape, attn.q_proj, f"{prefix}.q_proj", merge_heads(d_q), grads)  # (B, Tq, D)
    d_memory = (linear_backward(tape, attn.k_proj, f"{prefix}.k_proj", merge_heads(d_k), grads)
                + linear_backward(tape, attn.v_proj, f"{prefix}.v_proj", merge_heads(d_v), grads))  # (B, Tk, D)
    return d_x, d_memory


# -- Feed-forward ------------------------------------------------------------------------------


def feed_forward_backward(tape: Tape, ffn, prefix: str, d_y: np.ndarray, grads: Grads) -> np.ndarray:
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2  (section 3.3)  ->  back through W_2, act', W_1.

    With the gate (`ffn_glu`), u = act(h) * g, g = x W_gate + b_gate  ->  d act(h) = du * g,
    dg = du * act(h), and x receives from both branches."""
    hidden, units, gated = tape[ffn]  # before the activation, after it, the gate (None without one)
    d_units = linear_backward(tape, ffn.linear2, f"{prefix}.linear2", d_y, grads)  # (B, L, F)
    if gated is None:
        d_act, d_x_gate = d_units, 0
    else:
        d_act = d_units * alive(gated)  # (B, L, F)
        d_gated = d_units * alive(units)  # (B, L, F)
        d_x_gate = linear_backward(tape, ffn.gate, f"{prefix}.gate", d_gated, grads)  # (B, L, D)
    d_hidden = activation_backward(ffn.activation, alive(hidden), d_act)  # (B, L, F)
    return linear_backward(tape, ffn.linear1, f"{prefix}.linear1", d_hidden, grads) + d_x_gate  # (B, L, D)


# -- Encoder layer -----------------------------------------------------------------------------
# The residual connection and its LayerNorm, the two placements (sections 3.1 and 5.4):
#     post-LN  x' = LN(x + f(x))   ->  d(x + f) = LN'(dx'),  dx = d(x + f) + f'(d(x + f))
#     pre-LN   x' = x + f(LN(x))   ->  dx = dx' + LN'(f'(dx'))
# The residual path passes the gradient through unchanged; that is why deep stacks train.


def dropout_backward(d_y: np.ndarray, dropout, site: str) -> np.ndarray:
    """y = where(keep, x / (1 - rate), 0)  (inverted dropout, section 5.4)  ->
    dx = where(keep, dy / (1 - rate), 0): the same mask, the same scale. No dropout: dx = dy."""
    if dropout is None:
        return d_y
    return np.where(dropout.masks[site], d_y / (1 - dropout.rate), 0)


def sublayer_backward(tape: Tape, pre_ln: bool, norm, prefix: str, fn_backward, d_out: np.ndarray, grads: Grads,
                      dropout=None, site: str = ""):
    """The gradient through one residual sublayer (`sublayer`); `fn_backward(d)` is f'(d). With
    dropout the sublayer's output was dropped at `site` before the sum: f' reads through that mask."""
    if pre_ln:
        d_fn = fn_backward(dropout_backward(d_out, dropout, site))
        return d_out + layer_norm_backward(tape, norm, prefix, d_fn, grads)
    d_sum = layer_norm_backward(tape, norm, prefix, d_out, grads)
    return d_sum + fn_backward(dropout_backward(d_sum, dropout, site))


def self_attention_backward(tape: Tape, attn, prefix: str, grads: Grads, d_bias=None):
    """f(h) = MultiHead(h, h): queries, keys and values all come from h, so dh is their sum."""
    def backward(d_out):
        d_x, d_memory = multi_head_attention_backward(tape, attn, prefix, d_out, grads, d_bias)
        return d_x + d_memory
    return backward


def encoder_layer_backward(tape: Tape, layer, prefix: str, name: str, d_x: np.ndarray, grads: Grads,
                           dropout=None, d_bias=None) -> np.ndarray:
    """The encoder layer backwards: the feed-forward sublayer first, then self-attention. `name`
    is the layer's name in the forward's records and dropout sites (`encoder.{i}`); `d_bias`
    collects the self-attention's score-bias gradient (`multi_head_attention_backward`)."""
    d_x = sublayer_backward(tape, layer.pre_ln, layer.ffn_norm, f"{prefix}.ffn_norm",
                            lambda d: feed_forward_backward(tape, layer.ffn, f"{prefix}.ffn", d, grads), d_x, grads,
                            dropout, f"{name}.ffn")
    return sublayer_backward(tape, layer.pre_ln, layer.self_attn_norm, f"{prefix}.self_attn_norm",
                             self_attention_backward(tape, layer.self_attn, f"{prefix}.self_attn", grads, d_bias), d_x,
                             grads, dropout, f"{name}.self_attn")


# -- Decoder layer -----------------------------------------------------------------------------


def decoder_layer_backward(tape: Tape, layer, prefix: str, name: str, d_x: np.ndarray, grads: Grads, dropout=None,
                           d_bias=None):
    """The decoder layer backwards: feed-forward, cross-attention, masked self-attention.
    Returns (d_x, d_memory): cross-attention's keys and values come from the encoder's memory."""
    d_memory = []

    def cross_attention_backward(d_out):
        d_q_input, d_kv_input = multi_head_attention_backward(tape, layer.cross_attn, f"{prefix}.cross_attn", d_out,
                                                              grads)
        d_memory.append(d_kv_input)
        return d_q_input

    d_x = sublayer_backward(tape, layer.pre_ln, layer.ffn_norm, f"{prefix}.ffn_norm",
                            lambda d: feed_forward_backward(tape, layer.ffn, f"{prefix}.ffn", d, grads), d_x, grads,
                            dropout, f"{name}.ffn")
    d_x = sublayer_backward(tape, layer.pre_ln, layer.cross_attn_norm, f"{prefix}.cross_attn_norm",
                            cross_attention_backward, d_x, grads, dropout, f"{name}.cross_attn")
    d_x = sublayer_backward(tape, layer.pre_ln, layer.self_attn_norm, f"{prefix}.self_attn_norm",
                            self_attention_backward(tape, layer.self_attn, f"{prefix}.self_attn", grads, d_bias), d_x,
                            grads, dropout, f"{name}.self_attn")
    return d_x, d_memory[0]


# -- Encoder and decoder -----------------------------------------------------------------------


def embedding_backward(embedding, name: str, ids: np.ndarray, d_x: np.ndarray, grads: Grads) -> None:
    """x = E[ids]  ->  dE[i] = sum of dx over every position whose id is i (a scatter-add: a token
    that occurs twice gets both gradients). With `freeze_pad_embedding` the lookups of pad_id send
    nothing (`nn.Embedding(padding_idx=pad_id)`: its backward skips that row)."""
    if embedding.padding_idx is not None:
        looked_up = ids != embedding.padding_idx  # (B, L)
        ids, d_x = ids[looked_up], d_x[looked_up]
    np.add.at(grads[name], ids, d_x)


def embed_backward(config, embedding, stack, prefix: str, name: str, ids: np.ndarray, d_x: np.ndarray,
                   grads: Grads, tape: Tape) -> None:
    """x = E[ids] * sqrt(D) (when scale_embedding) + P[rows], then the embedding norm if there is
    one (sections 3.4 and 3.5; BART's `layernorm_embedding`); or, where the stack norms the tokens
    alone (`sum_of_norm`: BlenderbotSmall's decoder), x = LN(E[ids] * sqrt(D)) + P[rows]."""
    if stack.embedding_sum.__name__ == "sum_of_norm":  # LN(E x s) + P: the positions see dx itself
        positions_backward(config, stack.position, f"{prefix}.position", ids, d_x, grads)
        d_x = layer_norm_backward(tape, stack.embedding_norm, f"{prefix}.embedding_norm", d_x, grads)
    else:  # LN(E x s + P), or E x s + P
        if stack.embedding_norm is not None:
            d_x = layer_norm_backward(tape, stack.embedding_norm, f"{prefix}.embedding_norm", d_x, grads)
        positions_backward(config, stack.position, f"{prefix}.position", ids, d_x, grads)
    if config.scale_embedding:
        d_x = d_x * math.sqrt(config.d_model)
    embedding_backward(embedding, name, ids, d_x, grads)


def conv1d_backward(tape: Tape, conv, prefix: str, d_y: np.ndarray, grads: Grads) -> np.ndarray:
    """y[t] = sum_k x[s t + k - 1] W[k] + b (impl_numpy/frontend.py)  ->  dW[k] = sum_t x[s t + k - 1]^T dy[t],
    db = sum of dy, dx[s t + k - 1] += dy[t] W[k]^T (what reaches the zero padding frames is dropped)."""
    x = tape[conv]  # (B, L, C_in)
    kernel, c_in, c_out = conv.weight.shape
    out_len, stride = d_y.shape[1], conv.stride
    padded = np.pad(x, ((0, 0), (1, 1), (0, 0)))  # (B, L + 2, C_in)
    d_padded = np.zeros_like(padded)
    for k in range(kernel):
        taps = np.s_[:, k:k + stride * (out_len - 1) + 1:stride]  # the frames s t + k - 1 (distinct within one k)
        grads[f"{prefix}.weight"][k] += padded[taps].reshape(-1, c_in).T @ d_y.reshape(-1, c_out)  # (C_in, C_out)
        d_padded[taps] += d_y @ conv.weight[k].astype(d_y.dtype, copy=False).T  # (B, L_out, C_in)
    grads[f"{prefix}.bias"] += d_y.reshape(-1, c_out).sum(axis=0)
    return d_padded[:, 1:-1]  # (B, L, C_in)


def frontend_backward(tape: Tape, frontend, prefix: str, d_x: np.ndarray, grads: Grads) -> None:
    """h1 = GELU(conv1(x)), h2 = GELU(conv2(h1)) (impl_numpy/frontend.py)  ->  back through GELU'
    (the exact form's, `activation_backward`) and each convolution; the features get no gradient."""
    d_hidden = activation_backward("gelu", tape[(frontend, "conv2")], d_x)  # (B, S, D)
    d_x = conv1d_backward(tape, frontend.conv2, f"{prefix}.conv2", d_hidden, grads)  # (B, F, D)
    d_hidden = activation_backward("gelu", tape[(frontend, "conv1")], d_x)  # (B, F, D)
    conv1d_backward(tape, frontend.conv1, f"{prefix}.conv1", d_hidden, grads)


def source_backward(config, encoder, src_ids: np.ndarray, d_x: np.ndarray, grads: Grads, tape: Tape) -> None:
    """The encoder's input backwards: the source tokens' embeddings (`embed_backward`), or a features
    source's x = FrontEnd(features) + P[offset .. offset + S - 1], then the embedding norm if there is one."""
    if encoder.frontend is None:
        embed_backward(config, encoder.embedding, encoder, "encoder", "encoder.embedding.weight", src_ids, d_x, grads,
                       tape)
        return
    if encoder.embedding_norm is not None:
        d_x = layer_norm_backward(tape, encoder.embedding_norm, "encoder.embedding_norm", d_x, grads)
    if config.position == "table":  # every row reads positions 0 .. S - 1
        offset = config.position_offset
        grads["encoder.position.table"][offset:offset + d_x.shape[1]] += d_x.sum(axis=0)
    frontend_backward(tape, encoder.frontend, "encoder.frontend", d_x, grads)


def encoder_backward(tape: Tape, encoder, d_memory: np.ndarray, grads: Grads, dropout=None) -> np.ndarray:
    """The encoder stack backwards: the final norm, then the layers from the last to the first.
    Returns the gradient of the embeddings (B, S, D)."""
    d_x = d_memory
    if encoder.norm is not None:
        d_x = layer_norm_backward(tape, encoder.norm, "encoder.norm", d_x, grads)
    d_bias = []
    for i in reversed(range(len(encoder.layers))):
        d_x = encoder_layer_backward(tape, encoder.layers[i], f"encoder.layers.{i}", f"encoder.{i}", d_x, grads, dropout,
                                     d_bias)
    score_bias_backward(tape, encoder.position, "encoder.position", d_bias, grads)
    return dropout_backward(d_x, dropout, "encoder.embeddings")


def decoder_backward(tape: Tape, decoder, d_y: np.ndarray, grads: Grads, dropout=None):
    """The decoder stack backwards. Returns the gradient of its embeddings (B, T, D) and of the
    encoder's memory (B, S, D): every layer's cross-attention reads the same memory, so their
    gradients add up."""
    if decoder.norm is not None:
        d_y = layer_norm_backward(tape, decoder.norm, "decoder.norm", d_y, grads)
    d_memory, d_bias = 0, []
    for i in reversed(range(len(decoder.layers))):
        d_y, d_layer_memory = decoder_layer_backward(tape, decoder.layers[i], f"decoder.layers.{i}", f"decoder.{i}",
                                                     d_y, grads, dropout, d_bias)
        d_memory = d_memory + d_layer_memory
    score_bias_backward(tape, decoder.position, "decoder.position", d_bias, grads)
    return dropout_backward(d_y, dropout, "decoder.embeddings"), d_memory


def output_backward(tape: Tape, output, config, tied_embedding, d_logits: np.ndarray, grads: Grads) -> np.ndarray:
    """logits = y W_out + b_out  ->  dW_out = y^T dlogits, db_out = sum of dlogits, dy = dlogits W_out^T
    (with `scale_logits`, logits = y W_out / sqrt(D) + b_out: dlogits / sqrt(D) in dW_out and dy).

    Tied (section 3.4): W_out = E^T for the target embedding E (the shared one when embeddings are
    shared), so E also gets dW_out^T = dlogits^T y, beside what its lookup gives it.
    """
    y = alive(tape[output])  # (B, T, D)
    if output.bias is not None:
        grads["output.bias"] += d_logits.reshape(-1, config.tgt_vocab_size).sum(axis=0)
    if config.scale_logits:
        # logits = y W_out / sqrt(D) + b_out (Flax examples/wmt): the 1/sqrt(D) scales dW_out and dy.
        d_logits = d_logits / math.sqrt(config.d_model)
    flat_y = y.reshape(-1, config.d_model)  # (B*T, D)
    flat_d = d_logits.reshape(-1, config.tgt_vocab_size)  # (B*T, V)
    if output.weight is None:
        weight = tied_embedding.weight.astype(d_logits.dtype, copy=False).T  # (D, V)
        grads[tied_name(config)] += flat_d.T @ flat_y  # (V, D)
    else:
        weight = output.weight.astype(d_logits.dtype, copy=False)
        grads["output.weight"] += flat_y.T @ flat_d  # (D, V)
    return d_logits @ weight.T  # (B, T, D)


def tied_name(config) -> str:
    """The target embedding's name: the encoder's table when the embeddings are shared."""
    return "encoder.embedding.weight" if config.share_embeddings else "decoder.embedding.weight"


# -- Model -------------------------------------------------------------------------------------


def cross_entropy(logits: np.ndarray, labels: np.ndarray, pad_id: int, label_smoothing: float):
    """The loss of docs/training.md and its gradient with respect to the logits.

    Over the N positions whose label is not pad_id (selected out, never multiplied by 0), with
    log p = log_softmax(z) over the V classes and eps the label smoothing:

        loss = (1 / N) sum over counted positions of [ (1 - eps) (-log p_label) + eps mean_c (-log p_c) ]
        dz   = (1 / N) (p - (1 - eps) onehot(label) - eps / V)       at counted positions, 0 elsewhere

    (the smoothing term is torch's: eps times the mean over all V classes of -log p, the target
    term weighted 1 - eps). Returns the loss, a scalar of the logits' dtype, and dlogits (B, T, V).
    """
    counted = labels != pad_id  # (B, T)
    z = logits[counted]  # (N, V): only the positions that count
    count, vocab = z.shape
    target = labels[counted]  # (N,)
    shifted = z - z.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # (N, V)
    nll = -log_probs[np.arange(count), target]  # (N,)
    smooth = -log_probs.mean(axis=-1)  # (N,)
    loss = ((1 - label_smoothing) * nll + label_smoothing * smooth).sum() / count
    d_z = np.exp(log_probs)  # p, (N, V)
    d_z[np.arange(count), target] -= 1 - label_smoothing
    d_z -= label_smoothing / vocab
    d_logits = np.zeros_like(logits)  # (B, T, V)
    d_logits[counted] = d_z / count
    return logits.dtype.type(loss), d_logits


def loss_and_grads(model, src_ids: np.ndarray, tgt_ids: np.ndarray, labels: np.ndarray,
                   label_smoothing: float, out, tape: Tape, dropout=None) -> tuple:
    """The backward pass of `model`'s forward call `out` on (src_ids, tgt_ids), which has just run
    with `dropout` and kept what this pass reads on `tape`. Returns (loss, grads): the gradients
    computed in the model's `dtype`, each cast once to its `param_dtype` at the end."""
    config = model.config
    grads = {name: np.zeros(shape, model.dtype) for name, shape in param_shapes(config).items()}
    loss, d_logits = cross_entropy(out.logits, labels, config.pad_id, label_smoothing)  # (B, T, V)

    # logits = Output(y) + final_logits_bias; a frozen one (a buffer in transformers) gets none
    if model.final_logits_bias is not None and not model.frozen_logits_bias:
        grads["final_logits_bias"] += d_logits.reshape(-1, config.tgt_vocab_size).sum(axis=0)
    tgt_embedding = model.encoder.embedding if config.share_embeddings else model.decoder.embedding
    d_y = output_backward(tape, model.output, config, tgt_embedding, d_logits, grads)  # (B, T, D)

    # The decoder, then the encoder through the memory every cross-attention read.
    d_y, d_memory = decoder_backward(tape, model.decoder, d_y, grads, dropout)  # (B, T, D), (B, S, D)
    d_x = encoder_backward(tape, model.encoder, d_memory, grads, dropout)  # (B, S, D)

    # The embeddings: with shared embeddings both lookups add to encoder.embedding.weight.
    embed_backward(config, tgt_embedding, model.decoder, "decoder", tied_name(config), tgt_ids, d_y, grads, tape)
    source_backward(config, model.encoder, src_ids, d_x, grads, tape)
    return loss, {name: g.astype(model.param_dtype, copy=False) for name, g in grads.items()}
