# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # One forward pass, step by step
#
# This walkthrough runs the built-in default model — a small Transformer trained to reverse a
# string of digits — through one forward pass in NumPy, one equation at a time, next to
# "Attention Is All You Need" (Vaswani et al., 2017). Every step is computed here by hand from
# the parameters alone, prints its shapes and a few actual numbers, and **asserts that it equals
# the model's own intermediate** (`out.intermediates`, `out.attention`, `out.logits`), so this
# file is also a test (CI runs it: `python docs/walkthrough.py`). Nothing below calls a layer of
# the model: only the final comparison does.
#
# Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H head dim,
# F d_ff, V vocabulary.
#
# Open it as a notebook with `jupytext --to notebook docs/walkthrough.py`, or just read it.

# %%
import math

import numpy as np

import impl_numpy
from conformance.check import toy
from conformance.check.defaults import default_model
from conformance.core.positions import sinusoid_table

np.set_printoptions(precision=4, suppress=True, linewidth=110)
config, params, description = default_model()
model = impl_numpy.Model(config, params, dtype="float64")
P = {name: value.astype(np.float64) for name, value in params.items()}  # the parameters, by name
print(description)
print(config.summary())
D, H, K = config.d_model, config.n_heads, config.head_dim
pre_ln = config.norm_placement == "pre"
assert config.activation == "relu", "this walkthrough writes out the paper's ReLU"

# %% [markdown]
# ## 1. Tokens
#
# A batch of two sources. The second is shorter, so it is padded with `<pad>` to the length of
# the first: the model must ignore those positions. The decoder input is `<bos>` followed by the
# answer so far (teacher forcing: here the whole correct answer, so every position is predicted
# at once), padded the same way.

# %%
src_texts = ["3 1 4 1 5 9 2 6", "2 7 1 8"]
S = max(len(toy.encode_text(t)) for t in src_texts)
T = S + 1
src_ids = np.full((2, S), toy.PAD)  # (B, S)
tgt_ids = np.full((2, T), toy.PAD)  # (B, T)
for row, text in enumerate(src_texts):
    ids = toy.encode_text(text)
    src_ids[row, : len(ids)] = ids
    tgt_ids[row, : len(ids) + 1] = [toy.BOS] + ids[::-1]
for row in range(2):
    print(f"row {row}  source:", toy.token_labels(src_ids[row]))
    print(f"row {row}  decoder input:", toy.token_labels(tgt_ids[row]))
out = model(src_ids, tgt_ids)  # the model's own results, to check every step against
b = 1  # the padded row: the one whose masks have something to do

# %% [markdown]
# ## 2. Embeddings and positions (sections 3.4 and 3.5)
#
# $$x = \text{Embedding}(\text{ids}) \cdot \sqrt{D} + PE, \qquad
# PE_{(pos, 2i)} = \sin(pos / 10000^{2i/D}),\; PE_{(pos, 2i+1)} = \cos(pos / 10000^{2i/D})$$
#
# (The square-root scale and the interleaved layout are switches: `scale_embedding`, `position`.)

# %%
E = P["encoder.embedding.weight"]  # (V, D)
scale = math.sqrt(D) if config.scale_embedding else 1.0
if config.position == "table":
    PE = P["encoder.position.table"]
else:
    PE = sinusoid_table(config.max_len, D, config.position)  # (max_len, D)
x = E[src_ids] * scale + PE[None, :S]  # (B, S, D)
print("PE[1, :6] =", PE[1, :6], "  (sin, cos, sin, cos, ... of 1, 1, 1/10000^(2/D), ...)")
print("x shape", x.shape, " x[0, 0, :6] =", x[0, 0, :6])
assert np.allclose(x, out.intermediates["encoder.embeddings"], rtol=0, atol=1e-12)

# %% [markdown]
# ## 3. One attention head (section 3.2.1)
#
# Every head projects the input to queries, keys and values; head $h$ owns columns
# $hK \ldots (h+1)K-1$ of each projection:
#
# $$\text{Attention}(Q, K, V) = \text{softmax}\!\left(\frac{QK^\top}{\sqrt{K}}\right) V$$
#
# In a pre-LN model the sublayer reads `LN(x)`; in a post-LN model (the paper's) it reads `x`.
# We follow row `b` = 1, the padded source.

# %%
def linear(z, prefix):
    """z W + b, with W stored (d_in, d_out); the bias only where the config has one."""
    return z @ P[f"{prefix}.weight"] + P.get(f"{prefix}.bias", 0.0)


def layer_norm(z, prefix):
    """LN(z) = (z - mean) / sqrt(var + eps) * gamma + beta, over the last axis (section 3.1)."""
    mu = z.mean(-1, keepdims=True)
    var = ((z - mu) ** 2).mean(-1, keepdims=True)
    if config.layer_norm_form == "standard":
        normed = (z - mu) / np.sqrt(var + config.layer_norm_eps)
    else:  # the Annotated Transformer's (x - mean) / (std + eps), unbiased std
        normed = (z - mu) / (np.sqrt(var * D / (D - 1)) + config.layer_norm_eps)
    return normed * P[f"{prefix}.weight"] + P[f"{prefix}.bias"]


prefix = "encoder.layers.0"
h_in = layer_norm(x, f"{prefix}.self_attn_norm") if pre_ln else x  # (B, S, D)
q = linear(h_in, f"{prefix}.self_attn.q_proj")  # (B, S, D)
k = linear(h_in, f"{prefix}.self_attn.k_proj")
v = linear(h_in, f"{prefix}.self_attn.v_proj")
head = 0
cols = slice(head * K, (head + 1) * K)
scores = q[b, :, cols] @ k[b, :, cols].T / math.sqrt(K)  # (S, S)
print(f"head {head}: queries/keys/values use columns {cols.start}..{cols.stop - 1}; scores shape {scores.shape}")
print("scores[:3, :6] =\n", scores[:3, :6])

# %% [markdown]
# ## 4. The mask and the softmax
#
# Masks are boolean, `True` = may attend. The source padding mask has shape (B, 1, 1, S): the
# same for every head and every query. A masked score is replaced by `mask_fill` before the
# softmax, so its key gets weight $e^{\text{fill} - \max} = 0$.

# %%
src_mask = (src_ids != config.pad_id)[:, None, None, :]  # (B, 1, 1, S)
assert np.array_equal(src_mask, impl_numpy.make_masks(config, src_ids, tgt_ids)[0])
print(f"src_mask[{b}, 0, 0] =", src_mask[b, 0, 0].astype(int), " (the last keys are <pad>)")
scores = np.where(src_mask[b, 0], scores, config.mask_fill)
weights = np.exp(scores - scores.max(-1, keepdims=True))
weights /= weights.sum(-1, keepdims=True)  # softmax over the keys
print("weights[:3] (rows sum to 1; nothing on the padding) =\n", weights[:3])
assert np.all(weights[:, ~src_mask[b, 0, 0]] == 0)
assert np.allclose(weights, out.attention["encoder.0.self"][b, head], rtol=0, atol=1e-12)

# %% [markdown]
# ## 5. Every head, concatenated, and the output projection (section 3.2.2)
#
# $$\text{MultiHead}(Q,K,V) = \text{Concat}(\text{head}_1, \ldots, \text{head}_H)\, W^O,
# \qquad \text{head}_h = \text{Attention}(Q W^Q_h, K W^K_h, V W^V_h)$$
#
# Splitting into heads is a reshape (B, L, D) → (B, L, H, K) and a transpose to (B, H, L, K);
# the concatenation undoes it. We write this once, as a function, and use it from here on.

# %%
def split_heads(z):
    batch, length, _ = z.shape
    return z.reshape(batch, length, H, K).transpose(0, 2, 1, 3)  # (B, H, L, K)


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def multi_head(queries_from, keys_from, prefix, mask):
    """MultiHead for queries from `queries_from` (B, Tq, D), keys and values from `keys_from`
    (B, Tk, D). Returns the output (B, Tq, D) and the weights (B, H, Tq, Tk)."""
    q = split_heads(linear(queries_from, f"{prefix}.q_proj"))  # (B, H, Tq, K)
    k = split_heads(linear(keys_from, f"{prefix}.k_proj"))  # (B, H, Tk, K)
    v = split_heads(linear(keys_from, f"{prefix}.v_proj"))  # (B, H, Tk, K)
    scores = np.einsum("bhqk,bhsk->bhqs", q, k) / math.sqrt(K)  # (B, H, Tq, Tk)
    weights = softmax(np.where(mask, scores, config.mask_fill))  # (B, H, Tq, Tk)
    heads = weights @ v  # (B, H, Tq, K)
    concat = heads.transpose(0, 2, 1, 3).reshape(heads.shape[0], heads.shape[2], D)  # (B, Tq, D)
    return linear(concat, f"{prefix}.o_proj"), weights


attn_out, enc_weights = multi_head(h_in, h_in, f"{prefix}.self_attn", src_mask)
print("heads (B, H, S, K) -> concat", (2, S, D), "-> @ W^O", P[f"{prefix}.self_attn.o_proj.weight"].shape,
      "-> attention output", attn_out.shape)
assert np.allclose(enc_weights, out.attention["encoder.0.self"], rtol=0, atol=1e-12)

# %% [markdown]
# ## 6. Residual connection and LayerNorm (sections 3.1, 5.4)
#
# Post-LN (the paper): $x \leftarrow \text{LN}(x + \text{Sublayer}(x))$;
# pre-LN: $x \leftarrow x + \text{Sublayer}(\text{LN}(x))$, with
# $\text{LN}(x) = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \gamma + \beta$ (`layer_norm` above).

# %%
x = x + attn_out if pre_ln else layer_norm(x + attn_out, f"{prefix}.self_attn_norm")
print("after self-attention sublayer: mean %.3f, std %.3f" % (x.mean(), x.std()))
assert np.allclose(x, out.intermediates["encoder.0.self_attn"], rtol=0, atol=1e-10)

# %% [markdown]
# ## 7. The position-wise feed-forward network (section 3.3)
#
# $$\text{FFN}(x) = \max(0, xW_1 + b_1) W_2 + b_2$$

# %%
def ffn(z, prefix):
    hidden = np.maximum(linear(z, f"{prefix}.linear1"), 0)  # (B, L, F)
    return linear(hidden, f"{prefix}.linear2"), hidden  # (B, L, D)


f_out, hidden = ffn(layer_norm(x, f"{prefix}.ffn_norm") if pre_ln else x, f"{prefix}.ffn")
x = x + f_out if pre_ln else layer_norm(x + f_out, f"{prefix}.ffn_norm")
print(f"hidden {hidden.shape}: {100 * (hidden > 0).mean():.0f}% of ReLU units active")
assert np.allclose(x, out.intermediates["encoder.0.ffn"], rtol=0, atol=1e-10)

# %% [markdown]
# ## 8. The rest of the encoder
#
# The other layers repeat the same two sublayers with their own weights: steps 3–7 as one
# function, checked layer by layer.

# %%
def sublayer(z, f, norm):
    """Post-LN: LN(z + f(z)); pre-LN: z + f(LN(z))."""
    return z + f(layer_norm(z, norm)) if pre_ln else layer_norm(z + f(z), norm)


for i in range(1, config.n_encoder_layers):
    prefix = f"encoder.layers.{i}"
    x = sublayer(x, lambda z: multi_head(z, z, f"{prefix}.self_attn", src_mask)[0], f"{prefix}.self_attn_norm")
    assert np.allclose(x, out.intermediates[f"encoder.{i}.self_attn"], rtol=0, atol=1e-10)
    x = sublayer(x, lambda z: ffn(z, f"{prefix}.ffn")[0], f"{prefix}.ffn_norm")
    assert np.allclose(x, out.intermediates[f"encoder.{i}.ffn"], rtol=0, atol=1e-10)
if config.final_encoder_norm:
    x = layer_norm(x, "encoder.norm")
memory = x  # (B, S, D): what every decoder layer attends to
assert np.allclose(memory, out.intermediates["encoder.output"], rtol=0, atol=1e-10)
print("memory", memory.shape)

# %% [markdown]
# ## 9. The decoder's embeddings
#
# The same recipe as the encoder's (step 2): a table lookup, times $\sqrt{D}$, plus the
# positions. With `share_embeddings` the decoder reads the encoder's table.

# %%
E_dec = P["encoder.embedding.weight"] if config.share_embeddings else P["decoder.embedding.weight"]  # (V, D)
PE_dec = P["decoder.position.table"] if config.position == "table" else PE  # (max_len, D)
y = E_dec[tgt_ids] * scale + PE_dec[None, :T]  # (B, T, D)
print("y shape", y.shape, " y[0, 0, :6] =", y[0, 0, :6], " (<bos> at position 0)")
assert np.allclose(y, out.intermediates["decoder.embeddings"], rtol=0, atol=1e-12)

# %% [markdown]
# ## 10. The decoder: masked self-attention (section 3.2.3)
#
# Position $t$ may only attend to positions $\le t$: the causal mask (T, T), a lower triangle,
# combined with the target padding (`tgt_pad_mask`: on the keys, on the queries, or not at all).

# %%
causal = np.tril(np.ones((T, T), dtype=bool))  # (T, T)
tgt_pad = (tgt_ids != config.pad_id)[:, None, None, :]  # (B, 1, 1, T)
if config.tgt_pad_mask == "queries":
    tgt_pad = tgt_pad.transpose(0, 1, 3, 2)  # (B, 1, T, 1)
elif config.tgt_pad_mask == "none":
    tgt_pad = np.ones_like(tgt_pad)
tgt_mask = tgt_pad & causal  # (B, 1, T, T)
assert np.array_equal(tgt_mask, impl_numpy.make_masks(config, src_ids, tgt_ids)[1])
print(f"tgt_mask[{b}, 0] (True = may attend; padding masked on the {config.tgt_pad_mask}):\n",
      tgt_mask[b, 0].astype(int))

prefix = "decoder.layers.0"
h_in = layer_norm(y, f"{prefix}.self_attn_norm") if pre_ln else y  # (B, T, D)
q = linear(h_in, f"{prefix}.self_attn.q_proj")[b, :, cols]  # (T, K): head `head` of row b
k = linear(h_in, f"{prefix}.self_attn.k_proj")[b, :, cols]
scores = np.where(tgt_mask[b, 0], q @ k.T / math.sqrt(K), config.mask_fill)  # (T, T)
w_self = softmax(scores)
print(f"decoder.0.self head {head}, row {b}, first rows (no weight on the future):\n", w_self[:4, :5])
assert np.all(w_self[np.triu_indices(T, k=1)] == 0), "no weight on the future"
assert np.allclose(w_self, out.attention["decoder.0.self"][b, head], rtol=0, atol=1e-12)

y = sublayer(y, lambda z: multi_head(z, z, f"{prefix}.self_attn", tgt_mask)[0], f"{prefix}.self_attn_norm")
assert np.allclose(y, out.intermediates["decoder.0.self_attn"], rtol=0, atol=1e-10)

# %% [markdown]
# ## 11. Cross-attention: where the reversal happens
#
# Queries come from the decoder (the output of step 10), keys and values from the encoder's
# memory; the source padding mask applies again (`cross_attn_src_mask`):
#
# $$\text{CrossAttention}(y, m) = \text{Concat}_h\!\left(\text{softmax}\!\left(
#   \frac{(y W^Q_h)(m W^K_h)^\top}{\sqrt{K}}\right) m W^V_h\right) W^O$$
#
# Written out in full once more, every head at once, with its shapes:

# %%
c_in = layer_norm(y, f"{prefix}.cross_attn_norm") if pre_ln else y  # (B, T, D)
Q = split_heads(linear(c_in, f"{prefix}.cross_attn.q_proj"))  # (B, H, T, K)
Kc = split_heads(linear(memory, f"{prefix}.cross_attn.k_proj"))  # (B, H, S, K)
Vc = split_heads(linear(memory, f"{prefix}.cross_attn.v_proj"))  # (B, H, S, K)
scores = np.einsum("bhtk,bhsk->bhts", Q, Kc) / math.sqrt(K)  # (B, H, T, S)
cross_mask = src_mask if config.cross_attn_src_mask else np.ones_like(src_mask)  # (B, 1, 1, S)
w_cross = softmax(np.where(cross_mask, scores, config.mask_fill))  # (B, H, T, S)
heads = w_cross @ Vc  # (B, H, T, K): one output per head
concat = heads.transpose(0, 2, 1, 3).reshape(2, T, D)  # (B, T, H*K) = (B, T, D)
W_O = P[f"{prefix}.cross_attn.o_proj.weight"]  # (D, D)
cross_out = concat @ W_O + P.get(f"{prefix}.cross_attn.o_proj.bias", 0.0)  # (B, T, D)
print("Q", Q.shape, " K", Kc.shape, " V", Vc.shape, " weights", w_cross.shape, " heads", heads.shape,
      " concat", concat.shape, " @ W^O", W_O.shape)
print(f"row {b}, head {head}: target position 1 reads source positions", w_cross[b, head, 1].round(3),
      "(nothing on the padding)")
assert np.all(w_cross[b][..., ~src_mask[b, 0, 0]] == 0)
assert np.allclose(w_cross, out.attention["decoder.0.cross"], rtol=0, atol=1e-12)
first_layer_cross = w_cross

y = y + cross_out if pre_ln else layer_norm(y + cross_out, f"{prefix}.cross_attn_norm")
assert np.allclose(y, out.intermediates["decoder.0.cross_attn"], rtol=0, atol=1e-10)
y = sublayer(y, lambda z: ffn(z, f"{prefix}.ffn")[0], f"{prefix}.ffn_norm")
assert np.allclose(y, out.intermediates["decoder.0.ffn"], rtol=0, atol=1e-10)

# %% [markdown]
# ## 12. The rest of the decoder
#
# The other decoder layers repeat the three sublayers (steps 10 and 11). To write output
# position $t$ the model must read source position $L - 1 - t$ (L the source's real length):
# in the last layer every head draws that anti-diagonal. In the first layer only head 1 draws
# one, a row lower: query $t \ge 1$ reads source position $L - t$, where the token it was fed
# (output $t - 1$) came from.

# %%
for i in range(1, config.n_decoder_layers):
    prefix = f"decoder.layers.{i}"
    y = sublayer(y, lambda z: multi_head(z, z, f"{prefix}.self_attn", tgt_mask)[0], f"{prefix}.self_attn_norm")
    assert np.allclose(y, out.intermediates[f"decoder.{i}.self_attn"], rtol=0, atol=1e-10)
    c_in = layer_norm(y, f"{prefix}.cross_attn_norm") if pre_ln else y
    cross_out, w_cross = multi_head(c_in, memory, f"{prefix}.cross_attn", cross_mask)  # w_cross: (B, H, T, S)
    y = y + cross_out if pre_ln else layer_norm(y + cross_out, f"{prefix}.cross_attn_norm")
    assert np.allclose(w_cross, out.attention[f"decoder.{i}.cross"], rtol=0, atol=1e-12)
    assert np.allclose(y, out.intermediates[f"decoder.{i}.cross_attn"], rtol=0, atol=1e-10)
    y = sublayer(y, lambda z: ffn(z, f"{prefix}.ffn")[0], f"{prefix}.ffn_norm")
    assert np.allclose(y, out.intermediates[f"decoder.{i}.ffn"], rtol=0, atol=1e-10)
if config.final_decoder_norm:
    y = layer_norm(y, "decoder.norm")
assert np.allclose(y, out.intermediates["decoder.output"], rtol=0, atol=1e-10)

for row, text in enumerate(src_texts):
    L = len(text.split())
    strongest = w_cross[row].argmax(-1)[:, :L]  # (H, L): per head, the source position each target position reads
    print(f"row {row}: target position -> most-attended source position, per head of the last layer:\n", strongest)
    assert (strongest == [L - 1 - t for t in range(L)]).all(), "the trained model reads the source backwards"
    fed_from = first_layer_cross[row, 1].argmax(-1)[1 : L + 1]  # first layer, head 1, queries 1..L
    print(f"row {row}: first layer, head 1, target position -> source position:", fed_from)
    assert (fed_from == [L - t for t in range(1, L + 1)]).all()

# %% [markdown]
# ## 13. Logits and the prediction
#
# $$\text{logits} = y_{\text{final}} W_{\text{out}} + b, \qquad \text{prediction} = \arg\max$$
#
# With a tied output (`tie_output`), $W_{\text{out}}$ is the target embedding transposed.

# %%
W_out = E_dec.T if config.tie_output else P["output.weight"]  # (D, V)
logits = y @ W_out + P.get("output.bias", 0.0) + P.get("final_logits_bias", 0.0)  # (B, T, V)
assert np.allclose(logits, out.logits, rtol=0, atol=1e-10)
prediction = logits.argmax(-1)  # (B, T)
print("logits", logits.shape)
for row, text in enumerate(src_texts):
    print("source:    ", text)
    print("prediction:", toy.decode_ids(prediction[row]))
    assert toy.decode_ids(prediction[row]) == " ".join(reversed(text.split()))
