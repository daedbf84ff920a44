"""Deliberately broken copies of a backend: the mistakes a port makes, planted one at a time.

Each break is a small edit to a private copy of a backend's `model.py` (or of the NumPy
backward pass, `impl_numpy/backward.py`: an edit `("backward.py", old, new)`), or a replaced module
attribute, registered as an extra backend so that the conformance properties and `rosetta check`
run against it exactly as against a real one. A break whose text no longer occurs in the model
file fails loudly, so the breaks follow the code as it changes.

`BREAKS` are the classic porting bugs: every tensor after the bug differs from the oracle, so
`rosetta check` names where each one lives. `PROPERTY_BREAKS` are invisible to that comparison
and each is planted for the one property that exists to catch it.
"""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from hypothesis import Phase, settings

from conformance.check import backends

ROOT = Path(__file__).resolve().parents[1]


def swapped_sinusoid(config, length=None):
    """`position_table` with sin and cos exchanged: the even (or first-half) dims get cos, the others sin."""
    from conformance.core.positions import position_table

    table = position_table(config, length)
    rows, d_model = table.shape
    if config.position == "sinusoid-interleaved":
        return table.reshape(rows, d_model // 2, 2)[:, :, ::-1].reshape(rows, d_model).copy()
    half = d_model // 2
    return np.concatenate([table[:, half:], table[:, :half]], axis=1)


def paper_timescales_for_t2t(config, length=None):
    """`position_table` with the t2t sinusoid built with the paper's timescales (spaced over D/2,
    not D/2 - 1)."""
    from conformance.core.positions import position_table, sinusoid_table

    if config.position != "sinusoid-t2t":
        return position_table(config, length)
    rows = (config.max_len if length is None else length) + config.position_offset
    return sinusoid_table(rows, config.d_model, "sinusoid-split")


def encoder_sinusoid_halves_swapped(config, length=None):
    """`position_table` of a features source (Whisper's) with its halves exchanged, `[cos | sin]`
    for `[sin | cos]`: a port of Whisper's `sinusoids()` that concatenates them the other way round."""
    from conformance.core.positions import position_table

    table = position_table(config, length)
    if config.source != "features":
        return table
    half = table.shape[1] // 2
    return np.concatenate([table[:, half:], table[:, :half]], axis=1)


def shifted_buckets(config, *, bidirectional, length=None):
    """T5's buckets per offset, read one offset off: offset n gets the bucket of n - 1."""
    from conformance.core.positions import offset_buckets

    return np.roll(offset_buckets(config, bidirectional=bidirectional, length=length), 1)


@contextmanager
def tf32_on():
    """torch's `full_precision` with TF32 on instead of off (then the previous settings back)."""
    import torch

    from impl_torch import full_precision

    with full_precision():
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False


# name -> (backend, [(text in model.py, replacement)], {module attribute: replacement})
BREAKS = {
    "wrong LayerNorm epsilon": ("numpy", [("self.eps = config.layer_norm_eps", "self.eps = 1e-5")], {}),
    "sin and cos swapped": ("numpy", [], {"position_table": swapped_sinusoid}),
    "missing embedding scale": ("numpy", [("if self.config.scale_embedding:", "if False:")], {}),
    "pre/post-LN swapped": ("numpy", [('self.pre_ln = config.norm_placement == "pre"',
                                       'self.pre_ln = config.norm_placement != "pre"')], {}),
    "causal mask shifted by one": ("numpy", [("np.tril(np.ones((length, length), dtype=bool))",
                                              "np.tril(np.ones((length, length), dtype=bool), k=1)")], {}),
    "heads split in the wrong order": ("numpy", [(
        "x = x.reshape(batch, length, self.n_heads, self.head_dim)  # (B, L, H, K)",
        "x = x.reshape(batch, length, self.head_dim, self.n_heads).swapaxes(2, 3)",
    )], {}),
    "mask fill changed": ("numpy", [("self.fill = config.mask_fill", "self.fill = -1e9")], {}),
    # transformers' SDPA attention (empty_rows "zeros") ported as the eager one: a query with no
    # key gets the softmax of its filled row (a uniform average, or NaN) instead of zeros.
    "empty rows give the softmax, not zeros": ("numpy", [(
        'self.empty_rows = 0.0 if config.empty_rows == "zeros" else None', "self.empty_rows = None")], {}),
    "t2t sinusoid with the paper's timescales": ("numpy", [], {"position_table": paper_timescales_for_t2t}),
    "source padding masked on the keys only": ("numpy", [('if config.src_pad_mask == "both" and src_mask is not None:',
                                                          "if False:")], {}),
    "logits not divided by sqrt(D)": ("numpy", [("        if self.scale_logits:\n", "        if False:\n")], {}),
    "attention temperature ignored": ("numpy", [("self.temperature = config.attention_temp", "self.temperature = 1.0")], {}),
    "GLU gate dropped": ("numpy", [("return self.linear2(units if gated is None else units * gated, tape=tape)",
                                   "return self.linear2(units, tape=tape)")], {}),
    "final norm dropped": ("numpy", [(
        'self.norm = LayerNorm(config, params, "decoder.norm") if config.final_decoder_norm else None',
        "self.norm = None",
    )], {}),
    # BART's learned table read from row 0, not row 2 (`BartLearnedPositionalEmbedding.offset`).
    "position offset ignored": ("numpy", [("self.offset = config.position_offset", "self.offset = 0")], {}),
    # M2M100's positions numbered over every token, padding included (fairseq's make_positions skips it).
    "pad tokens numbered as positions": ("numpy", [(
        'self.pad_id = config.pad_id if config.position_ids == "non-pad" else None', "self.pad_id = None")], {}),
    # BART's layernorm_embedding left out of a port.
    "embedding norm dropped": ("numpy", [(
        'self.embedding_norm = LayerNorm(config, params, "encoder.embedding_norm") if config.embedding_norm else None',
        "self.embedding_norm = None",
    )], {}),
    # T5's relative positions read one offset off (the bucket of j - i - 1 for key j, query i).
    "relative-position bucket off by one": ("numpy", [], {"offset_buckets": shifted_buckets}),
    # T5's RMSNorm written as a LayerNorm without its bias: the mean subtracted.
    "RMSNorm subtracts the mean": ("numpy", [(
        "return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * cast(self.weight, x.dtype)",
        "return (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(x.var(axis=-1, keepdims=True) + self.eps) "
        "* cast(self.weight, x.dtype)",
    )], {}),
    # T5's unscaled scores (Q K^T) divided by sqrt(K) as in the paper.
    "T5 scores scaled by 1/sqrt(K)": ("numpy", [("self.scaled = config.scale_scores", "self.scaled = True")], {}),
    # Whisper's front end (impl_numpy/frontend.py), as ports get it wrong: the second convolution
    # without its stride (every frame kept: S = frames, not frames / 2), the convolutions without
    # their padding (two frames lost at each), and the encoder's sinusoid as [cos | sin].
    "Whisper conv stride 1": ("numpy", [("frontend.py", 'self.conv2 = Conv1d(params, f"{prefix}.conv2", stride=2)',
                                         'self.conv2 = Conv1d(params, f"{prefix}.conv2", stride=1)')], {}),
    "Whisper conv padding 0": ("numpy", [("frontend.py", "PADDING = 1", "PADDING = 0")], {}),
    "Whisper sinusoid halves swapped": ("numpy", [], {"position_table": encoder_sinusoid_halves_swapped}),
    # Whisper's key projection has no bias (key_bias false). A bias added to the key alone changes
    # nothing (q . b_k is the same for every key of a query, which the softmax cancels), so the bug
    # that shows is the one a port makes when it loads the biases in order: the value's bias read
    # into the key, the value left without one.
    "Whisper key bias added (the value's bias read into the key)": ("numpy", [(
        '        self.o_proj = Linear(params, f"{prefix}.o_proj")\n',
        '        self.o_proj = Linear(params, f"{prefix}.o_proj")\n'
        '        if self.k_proj.bias is None and self.v_proj.bias is not None:\n'
        '            self.k_proj.bias, self.v_proj.bias = self.v_proj.bias, None\n',
    )], {}),
    # TF32 switched on by the backend (a `full_precision` that sets it the wrong way round): it
    # changes float32 matmuls on a GPU only, so the runner checks the switches themselves, on
    # every device (`runner.precise`).
    "TF32 left on by full_precision": ("torch", [], {"full_precision": tf32_on}),
    # ...or by the model while it runs (a forward pass that sets it for speed and leaves it).
    "TF32 turned on by the forward pass": ("torch", [(
        "        encoded = self.encode(src_ids, src_mask, return_attention=return_attention, dropout=dropout, sink=sink,\n",
        "        torch.backends.cuda.matmul.allow_tf32 = True\n"
        "        encoded = self.encode(src_ids, src_mask, return_attention=return_attention, dropout=dropout, sink=sink,\n",
    )], {}),
}


# Classic breaks that only padding other than trailing shows: `rosetta check`'s fixed batch pads its
# rows at the end, one row as wide as the batch, where they compute the right numbers; the suite
# draws left, interior and wider-than-needed padding (issue 58). Same form as `BREAKS`.
PADDING_BREAKS = {
    # OpenNMT-py's encoder mask (`sequence_mask(lengths)`): read from the row lengths, as wide as the
    # longest row. Left or interior padding is attended as if it were the row's end, and a batch
    # padded wider than its longest row gets a mask narrower than its scores (a broadcasting error,
    # or, when the longest row is one token, a silent broadcast over every key).
    "mask as wide as the longest row (OpenNMT-py)": ("numpy", [(
        "    return np.asarray(source_real(config, np.asarray(src_ids)))[:, None, None, :]",
        "    lengths = np.asarray(source_real(config, np.asarray(src_ids))).sum(axis=1)  # (B,)\n"
        "    return (np.arange(lengths.max())[None, :] < lengths[:, None])[:, None, None, :]",
    )], {}),
}


# Breaks that the forward-vs-oracle property cannot see, each planted where only one other
# property looks: name -> (the property's module in `conformance`, [(backend, edits, patches)]).
# A break of the pairwise property needs two copies, compared with each other.
DRIFT = 0.9e-12  # 0.9 x the float64 tolerance: one copy passes alone, two opposite ones differ by 1.8x
PROPERTY_BREAKS = {
    # torch's fused kernel returns 0 for a query without keys; the weights-returning path is fine.
    "fast path returns 0 for fully masked rows": ("test_fast_path", [("torch", [(
        "return heads if fix is None else torch.where(fix, fixed, heads)  # (B, H, Tq, K)",
        "return heads if fix is None else torch.where(fix, 0.0, heads)  # (B, H, Tq, K)",
    )], {})]),
    # An empty dict where no attention was asked for: reads as "this model has no attention layers".
    "no attention asked for gives {}": ("test_fast_path", [("numpy", [(
        "        if not return_attention:\n            out.attention = None",
        "        if not return_attention:\n            out.attention = {}",
    )], {})]),
    # Like a model whose decode, given precomputed encoder outputs, drops their padding mask:
    # only the full forward passes the source mask through.
    "decode ignores the encoded source mask": ("test_encode_decode", [("numpy", [
        ("def decode(self, tgt_ids, encoded: Encoded, tgt_mask=None, *, return_attention: bool = True,\n",
         "def decode(self, tgt_ids, encoded: Encoded, tgt_mask=None, *, return_attention: bool = True, _src_mask=None,\n"),
        ("cross_mask = self.cross_mask(encoded.src_mask)", "cross_mask = self.cross_mask(_src_mask)"),
        ("return self.decode(tgt_ids, encoded, tgt_mask, return_attention=return_attention, dropout=dropout, sink=sink)",
         "return self.decode(tgt_ids, encoded, tgt_mask, return_attention=return_attention, dropout=dropout, "
         "sink=sink, _src_mask=encoded.src_mask)"),
    ], {})]),
    # A mask passed in is read in nn.MultiheadAttention's convention (True = may NOT attend);
    # masks the model derives itself are read correctly.
    "explicit masks read as True = masked": ("test_explicit_masks", [("numpy", [(
        "return host_mask(argument, mask, expected, derived)",
        "return ~host_mask(argument, mask, expected, derived)",
    )], {})]),
    # The softmax normaliser summed in a different order on every call, as atomics on a GPU
    # do: the last bit changes, far below any tolerance.
    "softmax sum in a random order": ("test_determinism", [("numpy", [(
        "return e / e.sum(axis=-1, keepdims=True)",
        "return e / e[..., np.random.permutation(e.shape[-1])].sum(axis=-1, keepdims=True)",
    )], {})]),
    # A KV cache that loses the newest position's key and value (an off-by-one in the slice):
    # the full forward pass never reads the cache, so only decoding sees it.
    "cached decoding drops the newest key": ("test_generate", [("numpy", [(
        "decode.py",
        "return cache.keys[i][:, :, :t + 1], cache.values[i][:, :, :t + 1]  # (B, H, t + 1, K)",
        "return cache.keys[i][:, :, :max(t, 1)], cache.values[i][:, :, :max(t, 1)]",
    ), (
        "decode.py",
        "y = model.decoder(y, None, self_mask, cache.cross_mask,",
        "y = model.decoder(y, None, self_mask[..., :max(t, 1)], cache.cross_mask,",
    ), (
        "decode.py",  # T5's score bias over the same (shortened) keys
        "bias = model.decoder.position.score_bias(1, t + 1, model.dtype, first_query=t)",
        "bias = model.decoder.position.score_bias(1, max(t, 1), model.dtype, first_query=t)",
    )], {})]),
    # A device search that never reorders the KV cache after beam search chose its rows: every
    # beam keeps attending to its own old prefix. Greedy and the full forward pass never see it.
    "beam search forgets to reorder the cache": ("test_generate", [("numpy", [(
        "decode.py",
        "if settings.num_beams > 1 and i > 0:",
        "if False:",
    )], {})]),
    # A sampling driver that does not forward the caller's seed: it draws its uniforms from
    # seed 0 instead. Greedy and beam search never read the seed, so only sampling sees it.
    "sampling ignores the seed": ("test_generate", [("numpy", [(
        "decode.py",
        "drawn = uniforms(settings.seed, settings.max_len, rows)",
        "drawn = uniforms(0, settings.max_len, rows)",
    )], {})]),
    # The backward pass (impl_numpy/backward.py): invisible to every forward property.
    # LayerNorm's gradient without the term through the variance, which depends on the whole row.
    "LayerNorm gradient misses the variance term": ("test_gradients", [("numpy", [(
        "backward.py",
        "- normed * (d_normed * normed).mean(axis=-1, keepdims=True))",
        ")",
    )], {})]),
    # The softmax gradient sent on to masked scores: wrong only where a row is uniform over
    # masked keys (a finite fill with every key masked), where the softmax gradient is not 0.
    "softmax gradient ignores the mask": ("test_gradients", [("numpy", [(
        "backward.py",
        "d_scores = np.where(mask, d_scores, 0)",
        "d_scores = d_scores",
    )], {})]),
    # transformers' eager attention adds its mask, and an empty row's gradient passes through the
    # added scores into q and k: a port that drops it there as for a replaced score (`np.where`).
    "added scores' gradient dropped as if replaced": ("test_gradients", [("numpy", [(
        "backward.py",
        '"add_to_masked": add_to_masked_backward}',
        '"add_to_masked": replace_masked_backward}',
    )], {})]),
    # torch's fused kernel replaces masked scores: added ones sent through it lose an empty row's
    # gradient into q and k. The forward is the same (the kernel's uniform row), so only the
    # gradients show it (loss_and_grads runs without attention weights, through the kernel).
    "added scores through the fused kernel": ("test_gradients", [("torch", [(
        "if return_attention or bias is not None or not self.fused:",
        "if return_attention or bias is not None:",
    )], {})]),
    # The attention temperature scales the queries: their gradient must be scaled back.
    "query gradient misses the attention temperature": ("test_gradients", [("numpy", [(
        "backward.py",
        "d_q = d_q * attn.temperature",
        "d_q = d_q",
    )], {})]),
    # The GLU's activated branch: its gradient must be multiplied by the gate's value.
    "GLU gradient misses the gate": ("test_gradients", [("numpy", [(
        "backward.py",
        "d_act = d_units * alive(gated)  # (B, L, F)",
        "d_act = d_units  # (B, L, F)",
    )], {})]),
    # nn.Embedding(padding_idx=...) ignored: the pad row gets the gradient of every pad lookup.
    "pad embedding row gets lookup gradients": ("test_gradients", [("numpy", [(
        "backward.py",
        "    if embedding.padding_idx is not None:\n",
        "    if False:\n",
    )], {})]),
    # transformers' final_logits_bias is a buffer: a port whose optimizer trains it anyway.
    "frozen final_logits_bias gets a gradient": ("test_gradients", [("numpy", [(
        "backward.py",
        "    if model.final_logits_bias is not None and not model.frozen_logits_bias:",
        "    if model.final_logits_bias is not None:",
    )], {})]),
    # Whisper's front end backwards: a convolution's last kernel tap dropped from its gradient (its
    # weight's and the input's), as a hand-written conv backward with an off-by-one loop gets it.
    "conv1d gradient misses the last kernel tap": ("test_gradients", [("numpy", [(
        "backward.py",
        "    for k in range(kernel):\n        taps = np.s_",
        "    for k in range(kernel - 1):\n        taps = np.s_",
    )], {})]),
    # T5's relative bias: the score gradient never reaches the bucket table.
    "relative bias gets no gradient": ("test_gradients", [("numpy", [(
        "backward.py",
        "    if d_bias:\n",
        "    if False:\n",
    )], {})]),
    # RMSNorm's gradient without the term through the root mean square of the row.
    "RMSNorm gradient misses the normalisation term": ("test_gradients", [("numpy", [(
        "backward.py",
        "return rstd * (d_normed - normed * (d_normed * normed).mean(axis=-1, keepdims=True))",
        "return rstd * d_normed",
    )], {})]),
    # Hugging Face's logits processors, forwarded wrongly by a backend's generate (the rules
    # themselves are the core's, conformance/core/generation/device.py).
    "no_repeat_ngram window one token short": ("test_generate", [("numpy", [(
        "decode.py", "rules_of(settings)",
        'rules_of(__import__("dataclasses").replace(settings, no_repeat_ngram_size=max(settings.no_repeat_ngram_size - 1, 0)))',
    )], {})]),
    "no_repeat_ngram window one token long": ("test_generate", [("numpy", [(
        "decode.py", "rules_of(settings)",
        'rules_of(__import__("dataclasses").replace(settings, no_repeat_ngram_size=settings.no_repeat_ngram_size and '
        'settings.no_repeat_ngram_size + 1))',
    )], {})]),
    "forced BOS id not forwarded": ("test_generate", [("numpy", [(
        "decode.py", "data = processor_data(settings,",
        'data = processor_data(__import__("dataclasses").replace(settings, forced_bos_id=None),',
    )], {})]),
    "multi-token bad words banned everywhere (prefix ignored)": ("test_generate", [("numpy", [(
        "decode.py", "banned_mask[list(settings.banned_ids)] = True",
        "banned_mask[list(settings.banned_ids) + [w[-1] for w in settings.bad_words_ids]] = True",
    )], {})]),
    "min_length not forwarded": ("test_generate", [("numpy", [(
        "decode.py", "data = processor_data(settings,",
        'data = processor_data(__import__("dataclasses").replace(settings, min_length=0),',
    )], {})]),
    # transformers' processors of shipped generation configs (issue 56): the penalty never reaches
    # the search, and the device search forgets the renormalization that beam scores read.
    "repetition_penalty not forwarded": ("test_generate", [("numpy", [(
        "decode.py", "data = processor_data(settings,",
        'data = processor_data(__import__("dataclasses").replace(settings, repetition_penalty=1.0),',
    )], {})]),
    "renormalize_logits dropped by the device search": ("test_generate", [("numpy", [(
        "device.py", "return renormalized(ops, scores) if rules.renormalize else scores", "return scores",
    )], {})]),
    # Whisper's timestamp rules (issue 54), in the device search's processors (pipeline.py) a backend
    # decodes with: the rule that forces a timestamp where the timestamps' total probability beats
    # every text token's left out, as a port that copies only the simple bans gets it. The
    # reference's rules (the oracle's) keep it.
    "Whisper's forced-timestamp rule dropped": ("test_generate", [("numpy", [(
        "pipeline.py",
        "    return xp.where((stamps > best_other)[:, None] & ~stamp_ids, -np.inf, scores)",
        "    return scores",
    )], {})]),
    # ...and the rule that timestamps come in pairs: after two in a row, a timestamp may follow.
    "Whisper's timestamp pairs rule dropped": ("test_generate", [("numpy", [(
        "pipeline.py",
        "    scores = xp.where((last_was & penultimate_was)[:, None] & stamp_ids, -np.inf, scores)  # text next\n",
        "",
    )], {})]),
    "multi-token bad words dropped": ("test_generate", [("numpy", [(
        "decode.py", "data = processor_data(settings,",
        'data = processor_data(__import__("dataclasses").replace(settings, bad_words_ids=()),',
    )], {})]),
    # The search's rules (conformance/core/generation/device.py), planted in the NumPy backend's copy:
    # what a port of Hugging Face's or Flax's beam search gets wrong. Each is caught by the
    # scripted decoder (conformance/suite/test_search_rules.py); a random model's flat steps, rare
    # ties and random end tokens reach few of them (the generate property).
    "finished hypotheses' length penalty read one token long": ("test_search_rules", [("numpy", [(
        "device.py",
        "scored = penalized(ops, candidate_scores, length - prompt, length_penalty, rules.form, dtype)",
        "scored = penalized(ops, candidate_scores, length - prompt + 1, length_penalty, rules.form, dtype)",
    )], {})]),
    "early_stopping=True stops a row at its first finished hypothesis": ("test_search_rules", [("numpy", [(
        "device.py",
        'full = ops.reduce("all", is_finished, axis=1) & rules.stop_when_full',
        'full = ops.reduce("any", is_finished, axis=1) & rules.stop_when_full',
    )], {})]),
    'early_stopping="never" bound guessed at the current length': ("test_search_rules", [("numpy", [(
        "device.py",
        "guess = ops.where(length_penalty > 0, rules.max_len, length - 1) if rules.never else length - 1",
        "guess = length - 1",
    )], {})]),
    "equal finished scores ranked newest first": ("test_search_rules", [("numpy", [(
        "device.py",
        'merged = ops.concat([state["finished_scores"], scored])\n    finished_scores, best = ops.top_k(merged, beams)',
        'merged = ops.concat([state["finished_scores"], scored])\n'
        '    finished_scores, best = ops.top_k(merged[:, ::-1].copy(), beams)\n'
        '    best = merged.shape[1] - 1 - best',
    )], {})]),
    "endings below the best beams join Hugging Face's finished list": ("test_search_rules", [("numpy", [(
        "device.py", "just_ended = ends & (ops.arange(keep) < beams)", "just_ended = ends",
    )], {})]),
    # Flax's stopping bound scores the best open beam at max_decode_len; a port that scores it at
    # the length of the decoder's input so far (start token included) stops too soon where a
    # length penalty above 0 lets a long continuation overtake the finished ones late (issue 56).
    # Planted in torch's and JAX's device search, which the ci profile passed before it drew that case.
    **{f"Flax's stopping bound at the decoder input's length ({backend})": ("test_search_rules", [(backend, [(
        "device.py",
        "best_open = penalized(ops, running_scores[:, :1], width - prompt, length_penalty, rules.form, dtype)  # (B, 1)",
        "best_open = penalized(ops, running_scores[:, :1], length - prompt, length_penalty, rules.form, dtype)  # (B, 1)",
    )], {})]) for backend in ("torch", "jax")},
    "Flax's rule ends a hypothesis at max_len, as Hugging Face's does": ("test_search_rules", [("numpy", [(
        "device.py",
        "ends = token == eos_id  # only the end token ends a hypothesis",
        "ends = (token == eos_id) | (length + 1 >= width)",
    )], {})]),
    # A repeated training step that is not the step: what a mis-recorded CUDA graph would give
    # (impl_torch/graphs.py records a step the second time its shapes are seen). The first call on
    # a model is right; every later one is off by 0.1%.
    "a repeated training step computes another gradient": ("test_gradients", [("numpy", [(
        "        return backprop.loss_and_grads(self, src_ids, tgt_ids, labels, float(label_smoothing), out, tape, "
        "dropout)\n",
        "        loss, grads = backprop.loss_and_grads(self, src_ids, tgt_ids, labels, float(label_smoothing), out, "
        "tape, dropout)\n"
        "        self.__dict__['steps'] = self.__dict__.get('steps', 0) + 1\n"
        "        return loss, {name: g if self.steps == 1 else g * 1.001 for name, g in grads.items()}\n",
    )], {})]),
    # A replay that reads a stale input: every call after the first computes with the first
    # call's labels (a graph's static buffer that is not refilled).
    "a repeated training step reads the first call's labels": ("test_gradients", [("numpy", [(
        "        labels = host_labels(self.config, labels, tgt_ids.shape)\n        check_labels_finite(",
        "        labels = self.__dict__.setdefault('first_labels', host_labels(self.config, labels, tgt_ids.shape))\n"
        "        check_labels_finite(",
    )], {})]),
    # Two backends that each stay within tolerance of the oracle, drifting in opposite directions.
    "two backends drift apart within tolerance": ("test_pairs", [
        # Added, not multiplied: the float64 tolerance is absolute (atol), so a relative drift of
        # 0.9e-12 leaves it on logits larger than 1.1 (hypothesis draws them).
        ("numpy", [("logits = product_in_blocks(y, weight, vocab_axis, cast)  # (B, T, V)",
                    f"logits = product_in_blocks(y, weight, vocab_axis, cast) + {DRIFT!r}  # (B, T, V)")], {}),
        ("numpy", [("logits = product_in_blocks(y, weight, vocab_axis, cast)  # (B, T, V)",
                    f"logits = product_in_blocks(y, weight, vocab_axis, cast) - {DRIFT!r}  # (B, T, V)")], {}),
    ]),
}


# Float32-only mistakes: a property's float64 leg cannot see them (the copy passes it there), and
# each is planted for the float32 leg that exists to catch it. name -> (property module, copies),
# as `PROPERTY_BREAKS`, run at float32.
FLOAT32_PROPERTY_BREAKS = {
    # A greedy arg-max that makes float32 near-ties deterministic by sending every id within a
    # margin of the best to the lowest such id, the margin (0.2) far wider than float32's noise:
    # it passes over a better id whenever a lower one is within 0.2. In float64 the arg-max is
    # plain. Its partings from the reference come after an exact tie or near-tie in most
    # scripts, which the old excuse ("a close call anywhere up to the parting") forgave.
    "float32 greedy search ties ids within a 0.2 margin": ("test_search_rules", [("numpy", [(
        "device.py",
        "    def argmax(self, x):\n        return np.argmax(x, axis=-1)",
        "    def argmax(self, x):\n"
        "        if x.dtype == np.float32:\n"
        "            return np.argmax(x >= x.max(axis=-1, keepdims=True) - 0.2, axis=-1)\n"
        "        return np.argmax(x, axis=-1)",
    )], {})]),
}


# The phases a meta-test runs a property with: no shrinking.
FIRST_FAILURE_PHASES = [Phase.explicit, Phase.generate]


@contextmanager
def first_failure_only(*properties):
    """Run `properties` without shrinking, for the duration. A meta-test needs the failure, not the
    smallest failing example: a property that catches a break then stops at its first failing
    example instead of shrinking models (the softmax gradient break: 71 s with shrinking, 6 s
    without). A property's settings were fixed when its module was first imported (pytest
    collects the suite under `ci`, shrinking included), so loading a profile would not reach
    them: each property's own settings are replaced, then put back."""
    own = [(prop, prop._hypothesis_internal_use_settings) for prop in properties]
    for prop, fixed in own:
        prop._hypothesis_internal_use_settings = settings(fixed, phases=FIRST_FAILURE_PHASES)
    try:
        yield
    finally:
        for prop, fixed in own:
            prop._hypothesis_internal_use_settings = fixed


def edited_module(name: str, module_name: str, path: Path, edits):
    """A private module from the file at `path` with the `(old, new)` edits applied."""
    source = path.read_text()
    for old, new in edits:
        count = source.count(old)
        assert count >= 1, f"break {name!r}: {old!r} no longer occurs in {path.relative_to(ROOT)}"
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(module_name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    exec(compile(source, f"<{module_name}>", "exec"), module.__dict__)
    return module


# The files beside model.py a break may edit, and the name the model reads each under.
SIDE_FILES = {"backward.py": "backprop", "decode.py": "decode", "frontend.py": "frontend"}
# The core's device search (shared by the backends' decode rooms): an edit of it applies to a
# private copy that the copied decode room imports instead (`broken_copy`).
# file name in a break -> (its path, its module name)
# pipeline.py (the device search's processors, which device.py imports) comes first: an edit of it
# makes a copy of device.py too, importing the edited pipeline.
CORE_FILES = {"pipeline.py": (ROOT / "conformance" / "core" / "generation" / "pipeline.py",
                              "conformance.core.generation.pipeline"),
              "device.py": (ROOT / "conformance" / "core" / "generation" / "device.py", "conformance.core.generation.device")}
# Which core file imports each one a break may edit: its copy imports the edited one.
CORE_IMPORTERS = {"pipeline.py": "device.py", "device.py": "decode.py"}


def side_path(backend: str, file: str) -> Path:
    """Where a break's file lives: the backend's own, or the core's (`CORE_FILES`)."""
    return CORE_FILES[file][0] if file in CORE_FILES else ROOT / f"impl_{backend}" / file


def broken_copy(name: str, backend: str, edits, patches):
    """A private copy of `impl_<backend>.model` with the edits applied, as a registered backend.

    An edit `(old, new)` applies to model.py; `("backward.py", old, new)` to a private copy of
    impl_numpy/backward.py, which the copied model then uses as its `backprop`, and
    `("decode.py", old, new)` to a private copy of the backend's decode room, its `decode`;
    `("device.py", old, new)` to a private copy of conformance/core/generation/device.py, which
    that copied decode room imports (the search's rules, planted in one backend), and
    `("pipeline.py", old, new)` to one of conformance/core/generation/pipeline.py, which a copy of
    device.py imports (the device search's processors)."""
    module_name = "broken_" + "".join(c if c.isalnum() else "_" for c in name)
    model_edits = [edit for edit in edits if len(edit) == 2]
    assert all(edit[0] in SIDE_FILES or edit[0] in CORE_FILES for edit in edits if len(edit) == 3), (
        f"break {name!r}: unknown file")
    for file, (path, dotted) in CORE_FILES.items():
        core_edits = [edit[1:] for edit in edits if len(edit) == 3 and edit[0] == file]
        if core_edits:  # its importer (the copied decode room, or device.py's copy) imports the edited copy
            core_name = f"{module_name}_{file[:-3]}"
            edited_module(name, core_name, path, core_edits)
            edits = [*edits, (CORE_IMPORTERS[file], f"from {dotted} import", f"from {core_name} import")]
    module = edited_module(name, module_name, ROOT / f"impl_{backend}" / "model.py", model_edits)
    for file, attribute in SIDE_FILES.items():
        side_edits = [edit[1:] for edit in edits if len(edit) == 3 and edit[0] == file]
        if side_edits:
            patches = {**patches, attribute: edited_module(
                name, f"{module_name}_{file[:-3]}", ROOT / f"impl_{backend}" / file, side_edits)}
    # The rest of the backend's surface (full_precision, enable_x64, ...) from the real package,
    # so that the copy is a whole backend to the suite and to `rosetta check`; a patch may replace it.
    package = importlib.import_module(f"impl_{backend}")
    surface = [*package.__all__, *package.BACKEND_EXTRAS]
    for attribute, value in patches.items():
        assert hasattr(module, attribute) or attribute in surface, (
            f"break {name!r}: impl_{backend}.model has no {attribute!r}")
        setattr(module, attribute, value)
    for attribute in surface:
        if not hasattr(module, attribute):
            setattr(module, attribute, getattr(package, attribute))
    backends.register_backend(module_name, module, like=backend)
    return module_name


# -- Bugs that only trained-scale numbers and long sequences show (issue 14) -------------------
#
# Each is planted in a copy of a backend and run at the dtype where a port makes it. The oracle
# comparison on the tame strategies (`test_forward.py`) passes most of them; the realistic sample
# (`test_forward_realistic.py`) must fail every one. `tame_misses` says whether the tame
# strategies alone miss it (checked by tests/suite/test_realistic_teeth.py either way).


def float32_sinusoid(config, length=None):
    """`position_table` computed in float32 (as several tutorials do), returned as float64."""
    rows = (config.max_len if length is None else length) + config.position_offset
    return _sinusoid_in(np.float32, rows, config.d_model, config.position)


def float16_sinusoid(config, length=None):
    """`position_table` computed in float16, the dtype of a half-precision model."""
    rows = (config.max_len if length is None else length) + config.position_offset
    return _sinusoid_in(np.float16, rows, config.d_model, config.position)


def _sinusoid_in(dtype, max_len, d_model, form):
    pos = np.arange(max_len, dtype=dtype)[:, None]  # (L, 1)
    pair = np.arange(d_model // 2, dtype=dtype)[None, :]  # (1, D/2)
    angle = (pos / np.power(dtype(10000.0), dtype(2.0) * pair / dtype(d_model))).astype(dtype)  # (L, D/2)
    table = np.empty((max_len, d_model), dtype=dtype)
    half = d_model // 2
    if form == "sinusoid-interleaved":
        table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    else:
        table[:, :half], table[:, half:] = np.sin(angle), np.cos(angle)
    return table.astype(np.float64)


def float16_sum_softmax(scores):
    """torch softmax whose normaliser is summed in float16, one term at a time (a naive kernel)."""
    import torch

    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    total = np.add.accumulate(e.detach().cpu().numpy().astype(np.float16), axis=-1, dtype=np.float16)[..., -1:]
    return e / torch.from_numpy(total.astype(np.float32)).to(e.dtype)


# Not in the table, because the suite cannot honestly catch it: a sinusoid computed in float32 at
# float32 moves the embeddings by 1.7e-5 x their scale at position 2047 (50x a correct float32
# backend's 3e-7, but 17x below the float32 tolerance 3e-4, which the attention weights of
# trained-scale examples need: measured, docs/tolerances.md). `float32_sinusoid` stays for that
# measurement. In float16 (below) the same bug is caught.
#
def realistic_property_module(dtype: str) -> str:
    """The realistic property a break at `dtype` must fail: half precision has its own."""
    return "test_half_precision_long" if dtype in ("float16", "bfloat16") else "test_forward_realistic"


# name -> (backend, dtype, [(text in model.py, replacement)], {module attribute: replacement}, tame_misses)
REALISTIC_BREAKS = {
    # One pass over x for both moments: cancels when |mean| >> std (eps * (mean/std)^2 relative).
    "LayerNorm variance as E[x^2] - E[x]^2": ("numpy", "float32", [(
        "var = (centered * centered).mean(axis=-1, keepdims=True)",
        "var = (x * x).mean(axis=-1, keepdims=True) - mean * mean",
    )], {}, True),
    # The Annotated Transformer's std + eps form, its unbiased variance by the expanded formula
    # (sum x^2 - D mean^2) / (D - 1): the same cancellation, in torch's float32 statistics. The
    # realistic property meets it on every form's covering row with large-mean rows (issue 56).
    "std-eps LayerNorm statistics by the expanded formula (torch)": ("torch", "float32", [(
        "std = torch.sqrt((centered * centered).sum(dim=-1, keepdim=True) / (x.shape[-1] - 1))",
        "std = torch.sqrt(((x32 * x32).sum(dim=-1, keepdim=True) - x.shape[-1] * mean * mean) / (x.shape[-1] - 1))",
    )], {}, True),
    # exp(score) overflows float32 above 88.7.
    "softmax without the max shift": ("numpy", "float32", [(
        "shifted = scores - scores.max(axis=-1, keepdims=True)", "shifted = scores",
    )], {}, False),
    # The tame sample meets it too, barely (8 tokens: 0.07 against the table's 0.05); the long
    # anchor's 2048 tokens by far more (0.088 against its measured tolerance, `LONG_HALF_TOLERANCES`).
    "position table computed in float16": ("torch", "float16", [], {"position_table": float16_sinusoid}, False),
    "softmax sum accumulated in float16": ("torch", "float16", [], {"softmax": float16_sum_softmax}, True),
    # Scores formed in float16: q k^T and the fill overflow 65504.
    "attention scores in float16 without the float32 upcast": ("torch", "float16", [(
        "q, k = at_least_float32(q), at_least_float32(k)", "pass",
    )], {}, False),
}


# -- Wrong derivatives in the oracle's own backward pass (issue 24) ----------------------------
#
# Planted in impl_numpy.backward itself, not in a copy: the NumPy model is the oracle, so the
# oracle and the numpy targets go wrong together and only another backend (torch) can disagree,
# as in a user's `rosetta conformance --backends numpy,torch`. One per activation and one per
# LayerNorm form, read from the config's value tuples (a new activation or form gets its own).
# Each replaces a function of impl_numpy/backward.py by its name (`ORACLE_BACKWARD_BREAKS`:
# name -> (function name, a factory of the replacement from the right function)), so the breaks
# follow the module as it is restructured: a name that no longer exists fails loudly.


def derivative_of_another_activation(activation: str):
    """`activation_backward` that answers for `activation` with the next activation's derivative
    (a port's wrong branch); right for every other activation."""
    from conformance.core.config import ACTIVATIONS

    other = ACTIVATIONS[(ACTIVATIONS.index(activation) + 1) % len(ACTIVATIONS)]

    def make(right):
        def activation_backward(name, x, d_y):
            return right(other if name == activation else name, x, d_y)
        return activation_backward

    return other, make


class _PosingAs:
    """A LayerNorm module that says its form is `form`, and is otherwise itself: the same key on
    the backward pass's tape (a dict by module), so that what the forward kept is found."""

    def __init__(self, norm, form: str):
        self._norm, self.form = norm, form

    def __getattr__(self, name):
        return getattr(self._norm, name)

    def __hash__(self):
        return hash(self._norm)

    def __eq__(self, other):
        return other is self._norm or other is self


def layer_norm_backward_of_another_form(form: str):
    """`layer_norm_backward` that differentiates `form` as another form would be (the standard
    form's derivative for the Annotated Transformer's std + eps, std + eps's for the others);
    right for every other form."""
    # rms (no mean, no bias) is differentiated as the standard form, as if its mean were subtracted.
    other = "standard" if form in ("std-eps", "rms") else "std-eps"

    def make(right):
        def layer_norm_backward(*args, **kwargs):  # the norm found by its `form`, wherever it is passed
            args = [_PosingAs(a, other) if getattr(a, "form", None) == form else a for a in args]
            return right(*args, **kwargs)
        return layer_norm_backward

    return other, make


def _oracle_backward_breaks() -> dict:
    from conformance.core.config import ACTIVATIONS, LAYER_NORM_FORMS

    breaks = {}
    for activation in ACTIVATIONS:
        other, make = derivative_of_another_activation(activation)
        breaks[f"{activation} differentiated as {other}"] = ("activation_backward", make)
    for form in LAYER_NORM_FORMS:
        other, make = layer_norm_backward_of_another_form(form)
        breaks[f"LayerNorm {form} differentiated as {other}"] = ("layer_norm_backward", make)
    return breaks


ORACLE_BACKWARD_BREAKS = _oracle_backward_breaks()


@contextmanager
def planted_in_the_oracle(name: str):
    """`ORACLE_BACKWARD_BREAKS[name]` planted in impl_numpy.backward for the duration."""
    from impl_numpy import backward

    attribute, make = ORACLE_BACKWARD_BREAKS[name]
    assert hasattr(backward, attribute), f"break {name!r}: impl_numpy/backward.py has no {attribute!r}"
    right = getattr(backward, attribute)
    setattr(backward, attribute, make(right))
    try:
        yield
    finally:
        setattr(backward, attribute, right)


def pytest_configure(config):
    """As a pytest plugin (`-p breaks`, tests/ on the path): plant `$ROSETTA_ORACLE_BREAK` in the
    oracle for the whole run, e.g. to watch `rosetta conformance --backends numpy,torch -- -p breaks` fail."""
    import os

    name = os.environ.get("ROSETTA_ORACLE_BREAK")
    if name:
        planted = planted_in_the_oracle(name)
        planted.__enter__()
        config.add_cleanup(lambda: planted.__exit__(None, None, None))


# -- Export bugs: planted in conformance.check.onnx.export, whose graphs the `onnxruntime` target runs --


def ignored_source_mask(right):
    """The graphs' src_mask input read as all-True: every padded source token attended to, as a
    tracer that drops a mask leaves it."""
    return lambda src_mask: right(src_mask | True)


def cache_of_the_next_layer(right):
    """Decoder layer i reads layer i + 1's self-attention cache (the last layer the first's)."""
    return lambda past, cross: right(past[2:] + past[:2], cross)


# name -> (the conformance.check.onnx.export function replaced, its replacement made from the right one,
#          the tensor where it shows first)
ONNX_EXPORT_BREAKS = {
    "source mask input ignored": ("source_mask", ignored_source_mask, "encoder.0.self"),
    "decoder reads the cache of the wrong layer": ("layer_caches", cache_of_the_next_layer, "decoder.0.self"),
}


def last_position_masked(right):
    """A features source's encoder mask with its last position False: the window's last frames
    taken for padding, as a port that counts positions with `frames // 2 - 1` leaves it."""
    import torch

    def mask(x):
        whole = right(x)  # (B, 1, 1, S), all True
        return whole & (torch.arange(whole.shape[-1]) < whole.shape[-1] - 1)
    return mask


# The same, for a features source's encoder graph (Whisper's): kept apart, as ONNX_EXPORT_BREAKS's
# are planted in an ids model's export by tests/runtimes/test_onnx.py.
WHISPER_EXPORT_BREAKS = {
    "features mask drops the last position": ("features_mask", last_position_masked, "encoder.0.self"),
}


# (name, the function it replaces) -> the replacement planted, made once: the export cache keys
# on the functions themselves (onnx_export.exporter), so a break planted again reuses its graphs.
_PLANTED: dict[tuple, object] = {}


@contextmanager
def planted_in_the_export(name: str):
    """`ONNX_EXPORT_BREAKS[name]` (or WHISPER_EXPORT_BREAKS') planted in conformance.check.onnx.export for the duration."""
    from conformance.check.onnx import export as onnx_export

    attribute, make, _ = {**ONNX_EXPORT_BREAKS, **WHISPER_EXPORT_BREAKS}[name]
    assert hasattr(onnx_export, attribute), f"break {name!r}: conformance/check/onnx/export.py has no {attribute!r}"
    right = getattr(onnx_export, attribute)
    setattr(onnx_export, attribute, _PLANTED.setdefault((name, right), make(right)))
    try:
        yield
    finally:
        setattr(onnx_export, attribute, right)


# -- Sharded bugs (issue 46): planted in every rank of a sharded run ------------------------------
#
# A sharded run happens in a child process (conformance.check.scale.sharded), so a break is planted
# there: `sharded_runs(..., _plant=("breaks", "plant_sharded", "NAME,NAME"))` has each child
# process import this module and call `plant_sharded` before it runs anything. Each break edits
# a private copy of the file it names and puts the edited function in the real module's place.
# All are torch's: JAX's sharded model is GSPMD's partition of the unsharded program, with no
# parallel layer or reduction of ours to get wrong (docs/sharding.md).

# name -> (backend, file, [(text, replacement)], (class or None, function), the plan it shows under)
SHARDED_BREAKS = {
    # The classic tensor-parallel bug: the local shard of q/k/v (H / model heads' columns) split
    # into the global number H of heads, each K / model wide. Unsharded, every head is local and
    # the same line is right, so only a sharded run can show it.
    "tp attention splits its shard into the global number of heads": ("torch", "model.py", [(
        "x = x.view(batch, length, width // self.head_dim, self.head_dim)  # (B, L, H, K)",
        "x = x.view(batch, length, self.n_heads, width // self.n_heads)  # (B, L, H, K / model): wrong under tp",
    )], ("MultiHeadAttention", "split_heads"), "tp"),
    # The loss each data rank differentiates divided by the number of data ranks as well, on top
    # of its share of the batch (a DDP habit, with FSDP2's sum reduction): gradients averaged
    # twice. The loss it reports is right, so a loss curve does not show it.
    "fsdp divides the loss by the data ranks as well": ("torch", "parallel.py", [(
        "        loss.backward()\n",
        '        (loss / mesh["data"].size() if "fsdp" in model.plan else loss).backward()\n',
    )], (None, "loss_and_grads"), "fsdp"),
    # A bug on one rank only: under "dp" rank 1 steps its replicated parameters twice. A
    # replicated DTensor's `full_tensor()` is the rank's own copy, so rank 0's record is right and
    # only the ranks' comparison with each other shows it.
    "dp rank 1 steps twice": ("torch", "train.py", [(
        "        self.optimizer.step()\n",
        "        self.optimizer.step()\n"
        "        if getattr(self.model, 'plan', None) == 'dp' and torch.distributed.get_rank() == 1:\n"
        "            self.optimizer.step()\n",
    )], ("Adam", "step"), "dp"),
}


def plant_sharded(names: str) -> None:
    """Plant each of the comma-separated `SHARDED_BREAKS` in this process's backend modules."""
    for name in filter(None, names.split(",")):
        backend, file, edits, (owner, function), _ = SHARDED_BREAKS[name]
        module_name = f"impl_{backend}." + file[:-3]
        real = importlib.import_module(module_name)
        copy = edited_module(name, "broken_sharded_" + "".join(c if c.isalnum() else "_" for c in name),
                             ROOT / f"impl_{backend}" / file, edits)
        if owner is None:
            setattr(real, function, getattr(copy, function))
        else:
            setattr(getattr(real, owner), function, getattr(getattr(copy, owner), function))
