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
# "Attention Is All You Need" (Vaswani et al., 2017). Every step prints its shapes and a few
# actual numbers, and **asserts that it equals the model's own intermediate**, so this file is
# also a test (CI runs it: `python docs/walkthrough.py`).
#
# Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H head dim,
# F d_ff, V vocabulary.
#
# Open it as a notebook with `jupytext --to notebook docs/walkthrough.py`, or just read it.

# %%
import math

import numpy as np

import impl_numpy
from conformance import toy
from conformance.defaults import default_model
from conformance.output import ModelOutput
from conformance.positions import sinusoid_table

np.set_printoptions(precision=4, suppress=True, linewidth=110)
config, params, description = default_model()
model = impl_numpy.Model(config, params, dtype="float64")
print(description)
print(config.summary())
D, H, K = config.d_model, config.n_heads, config.head_dim

# %% [markdown]
# ## 1. Tokens
#
# The source is a string of digits; the decoder input is `<bos>` followed by the answer so far
# (teacher forcing: here, the whole correct answer, so every position is predicted at once).

# %%
src_text = "3 1 4 1 5 9 2 6"
src_ids = np.array([toy.encode_text(src_text)])  # (B, S)
answer = toy.encode_text(src_text)[::-1]
tgt_ids = np.array([[toy.BOS] + answer])  # (B, T)
print("source ids:       ", src_ids, toy.token_labels(src_ids[0]))
print("decoder input ids:", tgt_ids, toy.token_labels(tgt_ids[0]))
out = model(src_ids, tgt_ids)  # the model's own results, to check every step against
S, T = src_ids.shape[1], tgt_ids.shape[1]

# %% [markdown]
# ## 2. Embeddings and positions (sections 3.4 and 3.5)
#
# $$x = \text{Embedding}(\text{ids}) \cdot \sqrt{D} + PE, \qquad
# PE_{(pos, 2i)} = \sin(pos / 10000^{2i/D}),\; PE_{(pos, 2i+1)} = \cos(pos / 10000^{2i/D})$$
#
# (The square-root scale and the interleaved layout are switches: `scale_embedding`, `position`.)

# %%
E = params["encoder.embedding.weight"]  # (V, D)
scale = math.sqrt(D) if config.scale_embedding else 1.0
if config.position == "table":
    PE = params["encoder.position.table"]
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

# %%
layer = model.encoder.layers[0]
pre_ln = config.norm_placement == "pre"
h_in = layer.self_attn_norm(x) if pre_ln else x
attn = layer.self_attn
q = h_in @ attn.q_proj.weight + (attn.q_proj.bias if attn.q_proj.bias is not None else 0)  # (B, S, D)
k = h_in @ attn.k_proj.weight + (attn.k_proj.bias if attn.k_proj.bias is not None else 0)
v = h_in @ attn.v_proj.weight + (attn.v_proj.bias if attn.v_proj.bias is not None else 0)
head = 0
cols = slice(head * K, (head + 1) * K)
scores = q[0, :, cols] @ k[0, :, cols].T / math.sqrt(K)  # (S, S)
print(f"head {head}: queries/keys/values use columns {cols.start}..{cols.stop - 1}; scores shape {scores.shape}")
print("scores[:3, :3] =\n", scores[:3, :3])

# %% [markdown]
# ## 4. The mask and the softmax
#
# Masks are boolean, `True` = may attend. The source has no padding here, so every key is
# allowed; masked scores would be replaced by `mask_fill` before the softmax.

# %%
src_mask, tgt_mask = impl_numpy.make_masks(config, src_ids, tgt_ids)
print("src_mask", src_mask.shape, src_mask[0, 0, 0])
scores = np.where(src_mask[0, 0], scores, config.mask_fill)
weights = np.exp(scores - scores.max(-1, keepdims=True))
weights /= weights.sum(-1, keepdims=True)  # softmax over the keys
print("weights[:3] (rows sum to 1) =\n", weights[:3])
assert np.allclose(weights, out.attention["encoder.0.self"][0, head], rtol=0, atol=1e-12)

# %% [markdown]
# ## 5. Head outputs, concatenation, output projection (section 3.2.2)
#
# $$\text{MultiHead}(Q,K,V) = \text{Concat}(\text{head}_1, \ldots, \text{head}_H) W^O$$

# %%
heads = []
for h in range(H):
    c = slice(h * K, (h + 1) * K)
    s = np.where(src_mask[0, 0], q[0, :, c] @ k[0, :, c].T / math.sqrt(K), config.mask_fill)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    heads.append(w @ v[0, :, c])  # (S, K)
concat = np.concatenate(heads, axis=-1)[None]  # (B, S, D)
attn_out = concat @ attn.o_proj.weight + (attn.o_proj.bias if attn.o_proj.bias is not None else 0)
print("concat", concat.shape, "-> attention output", attn_out.shape)

# %% [markdown]
# ## 6. Residual connection and LayerNorm (sections 3.1, 5.4)
#
# Post-LN (the paper): $x \leftarrow \text{LN}(x + \text{Sublayer}(x))$;
# pre-LN: $x \leftarrow x + \text{Sublayer}(\text{LN}(x))$, with
# $\text{LN}(x) = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \gamma + \beta$.

# %%
def layer_norm(z, prefix):
    mu = z.mean(-1, keepdims=True)
    var = ((z - mu) ** 2).mean(-1, keepdims=True)
    if config.layer_norm_form == "standard":
        normed = (z - mu) / np.sqrt(var + config.layer_norm_eps)
    else:  # the Annotated Transformer's (x - mean) / (std + eps), unbiased std
        normed = (z - mu) / (np.sqrt(var * D / (D - 1)) + config.layer_norm_eps)
    return normed * params[f"{prefix}.weight"] + params[f"{prefix}.bias"]


prefix = "encoder.layers.0"
x = x + attn_out if pre_ln else layer_norm(x + attn_out, f"{prefix}.self_attn_norm")
print("after self-attention sublayer: mean %.3f, std %.3f" % (x.mean(), x.std()))
assert np.allclose(x, out.intermediates["encoder.0.self_attn"], rtol=0, atol=1e-10)

# %% [markdown]
# ## 7. The position-wise feed-forward network (section 3.3)
#
# $$\text{FFN}(x) = \max(0, xW_1 + b_1) W_2 + b_2$$

# %%
f_in = layer_norm(x, f"{prefix}.ffn_norm") if pre_ln else x
hidden = np.maximum(f_in @ params[f"{prefix}.ffn.linear1.weight"] + params[f"{prefix}.ffn.linear1.bias"], 0)  # (B, S, F)
f_out = hidden @ params[f"{prefix}.ffn.linear2.weight"] + params[f"{prefix}.ffn.linear2.bias"]  # (B, S, D)
assert config.activation == "relu", "this walkthrough writes out the paper's ReLU"
x = x + f_out if pre_ln else layer_norm(x + f_out, f"{prefix}.ffn_norm")
print(f"hidden {hidden.shape}: {100 * (hidden > 0).mean():.0f}% of ReLU units active")
assert np.allclose(x, out.intermediates["encoder.0.ffn"], rtol=0, atol=1e-10)

# %% [markdown]
# ## 8. The rest of the encoder
#
# The other layers repeat the same two sublayers with their own weights; we let the model's
# layers do them and keep checking.

# %%
scratch = ModelOutput(logits=None)  # where the layers record their weights and intermediates
for i, enc_layer in enumerate(model.encoder.layers[1:], start=1):
    x = enc_layer(x, src_mask, f"encoder.{i}", scratch)
if model.encoder.norm is not None:
    x = model.encoder.norm(x)
memory = x  # (B, S, D): what every decoder layer attends to
assert np.allclose(memory, out.intermediates["encoder.output"], rtol=0, atol=1e-10)
print("memory", memory.shape)

# %% [markdown]
# ## 9. The decoder: masked self-attention
#
# Position $t$ may only attend to positions $\le t$ (section 3.2.3): the causal mask, combined
# with target padding.

# %%
print("tgt_mask[0, 0] (True = may attend):\n", tgt_mask[0, 0].astype(int))
dec_embedding = model.encoder.embedding if config.share_embeddings else model.decoder.embedding
y = model.embed(tgt_ids, dec_embedding, model.decoder.position)  # (B, T, D)
assert np.allclose(y, out.intermediates["decoder.embeddings"], rtol=0, atol=1e-12)
w_self = out.attention["decoder.0.self"][0, 0]  # (T, T)
assert np.all(w_self[np.triu_indices(T, k=1)] == 0), "no weight on the future"
print("decoder.0.self head 0, first rows:\n", w_self[:4, :4])

# %% [markdown]
# ## 10. Cross-attention: where the reversal happens
#
# Queries come from the decoder, keys and values from the encoder's memory. To write output
# position $t$ the model must read source position $S - 1 - t$: look for the anti-diagonal.

# %%
cross = out.attention[f"decoder.{config.n_decoder_layers - 1}.cross"][0]  # (H, T, S)
strongest = cross.mean(0).argmax(-1)  # for each target position, the source position it reads most
print("target position -> most-attended source position:", list(enumerate(strongest.tolist())))
print("(the reversal reads S-1-t = ", [S - 1 - t for t in range(T - 1)], ")")
assert strongest[: T - 1].tolist() == [S - 1 - t for t in range(T - 1)], "the trained model reads the source backwards"

# %% [markdown]
# ## 11. Logits and the prediction
#
# $$\text{logits} = y_{\text{final}} W_{\text{out}} + b, \qquad \text{prediction} = \arg\max$$
#
# With a tied output (`tie_output`), $W_{\text{out}}$ is the target embedding transposed.

# %%
y_final = out.intermediates["decoder.output"]  # (B, T, D)
W_out = dec_embedding.weight.T if config.tie_output else params["output.weight"]  # (D, V)
logits = y_final @ W_out
if "output.bias" in params:
    logits = logits + params["output.bias"]
if "final_logits_bias" in params:
    logits = logits + params["final_logits_bias"]
assert np.allclose(logits, out.logits, rtol=0, atol=1e-10)
prediction = logits.argmax(-1)[0]
print("logits", logits.shape)
print("source:    ", src_text)
print("prediction:", toy.decode_ids(prediction))
assert toy.decode_ids(prediction) == " ".join(reversed(src_text.split()))
