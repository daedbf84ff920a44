"""Flax `examples/wmt/decode.py`'s beam search, re-created in JAX as wmt writes it, driving the
linen model of `tests/systems/flax_wmt.py` as wmt's `predict_step` (`examples/wmt/train.py`) does.

`beam_search` below follows `decode.beam_search` line for line: a `lax.while_loop` over a
`BeamState`; the best 2 x beams candidates over all beams; every end token among them enters the
finished set (scored with the brevity penalty ((5 + length) / 6) ** alpha); the best `beams`
candidates that did not end stay live; the loop stops at `max_decode_len - 1` or when no live
beam, scored at `max_decode_len`, can beat the worst finished one of any row; a row without a
finished hypothesis returns its live beams. Beams are kept in increasing order of score (the
`jnp.flip` after each `lax.top_k`), so the best is the last.

The decoder step differs from wmt's only in how it is computed, not in what: wmt runs the linen
decoder with `decode=True` and a KV cache; here the "cache" is the whole prefix so far, and each
step runs the decoder over it with the masks `decode=True` uses (causal only, no target padding
mask: the start token is wmt's pad id 0; cross-attention from every query to the real inputs),
then takes the logits at the current index. Causal attention makes the two the same numbers.
"""

from __future__ import annotations

import typing

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax

from systems import flax_wmt as wmt

EOS_ID = 2
NEG_INF = np.array(-1.0e7)


def brevity_penalty(alpha, length):
    return jnp.power(((5.0 + length) / 6.0), alpha)


def add_beam_dim(x, beam_size):
    if x.ndim == 0:  # ignore scalars (e.g. cache index)
        return x
    x = jnp.expand_dims(x, axis=1)
    tile_dims = [1] * x.ndim
    tile_dims[1] = beam_size
    return jnp.tile(x, tile_dims)


def flatten_beam_dim(x):
    if x.ndim == 0:
        return x
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unflatten_beam_dim(x, batch_size, beam_size):
    if x.ndim == 0:
        return x
    assert batch_size * beam_size == x.shape[0]
    return x.reshape((batch_size, beam_size) + x.shape[1:])


def flat_batch_beam_expand(x, beam_size):
    return flatten_beam_dim(add_beam_dim(x, beam_size))


def gather_beams(nested, beam_indices, batch_size, new_beam_size):
    batch_indices = jnp.reshape(jnp.arange(batch_size * new_beam_size) // new_beam_size, (batch_size, new_beam_size))

    def gather_fn(x):
        if x.ndim == 0:
            return x
        return x[batch_indices, beam_indices]

    return jax.tree_util.tree_map(gather_fn, nested)


def gather_topk_beams(nested, score_or_log_prob, batch_size, new_beam_size):
    _, topk_indices = lax.top_k(score_or_log_prob, k=new_beam_size)
    topk_indices = jnp.flip(topk_indices, axis=1)
    return gather_beams(nested, topk_indices, batch_size, new_beam_size)


@flax.struct.dataclass
class BeamState:
    cur_index: jax.Array
    live_logprobs: jax.Array
    finished_scores: jax.Array
    live_seqs: jax.Array
    finished_seqs: jax.Array
    finished_flags: jax.Array
    cache: typing.Any


def beam_init(batch_size, beam_size, max_decode_len, cache):
    cur_index0 = jnp.array(0)
    live_logprobs0 = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam_size - 1)), [batch_size, 1])
    finished_scores0 = jnp.ones((batch_size, beam_size)) * NEG_INF
    live_seqs0 = jnp.zeros((batch_size, beam_size, max_decode_len), jnp.int32)
    finished_seqs0 = jnp.zeros((batch_size, beam_size, max_decode_len), jnp.int32)
    finished_flags0 = jnp.zeros((batch_size, beam_size), jnp.bool_)
    beam_cache0 = jax.tree_util.tree_map(lambda x: add_beam_dim(x, beam_size), cache)
    return BeamState(cur_index=cur_index0, live_logprobs=live_logprobs0, finished_scores=finished_scores0,
                     live_seqs=live_seqs0, finished_seqs=finished_seqs0, finished_flags=finished_flags0,
                     cache=beam_cache0)


def beam_search(inputs, cache, tokens_to_logits, beam_size=4, alpha=0.6, eos_id=EOS_ID, max_decode_len=None):
    batch_size = inputs.shape[0]
    if max_decode_len is None:
        max_decode_len = inputs.shape[1]
    end_marker = jnp.array(eos_id)
    beam_search_init_state = beam_init(batch_size, beam_size, max_decode_len, cache)

    def beam_search_loop_cond_fn(state):
        not_at_end = state.cur_index < max_decode_len - 1
        min_brevity_penalty = brevity_penalty(alpha, max_decode_len)
        best_live_scores = state.live_logprobs[:, -1:] / min_brevity_penalty
        worst_finished_scores = jnp.min(state.finished_scores, axis=1, keepdims=True)
        worst_finished_scores = jnp.where(state.finished_flags, worst_finished_scores, NEG_INF)
        search_terminated = jnp.all(worst_finished_scores > best_live_scores)
        return not_at_end & (~search_terminated)

    def beam_search_loop_body_fn(state):
        flat_ids = flatten_beam_dim(lax.dynamic_slice(state.live_seqs, (0, 0, state.cur_index),
                                                      (batch_size, beam_size, 1)))
        flat_cache = jax.tree_util.tree_map(flatten_beam_dim, state.cache)
        flat_logits, new_flat_cache = tokens_to_logits(flat_ids, flat_cache)
        logits = unflatten_beam_dim(flat_logits, batch_size, beam_size)
        new_cache = jax.tree_util.tree_map(lambda x: unflatten_beam_dim(x, batch_size, beam_size), new_flat_cache)
        candidate_log_probs = jax.nn.log_softmax(logits)
        log_probs = candidate_log_probs + jnp.expand_dims(state.live_logprobs, axis=2)
        vocab_size = log_probs.shape[2]
        beams_to_keep = 2 * beam_size
        flat_log_probs = log_probs.reshape((batch_size, beam_size * vocab_size))
        topk_log_probs, topk_indices = lax.top_k(flat_log_probs, k=beams_to_keep)
        topk_beam_indices = topk_indices // vocab_size
        topk_seq = gather_beams(state.live_seqs, topk_beam_indices, batch_size, beams_to_keep)
        topk_ids = jnp.expand_dims(topk_indices % vocab_size, axis=2)
        topk_seq = lax.dynamic_update_slice(topk_seq, topk_ids.astype(topk_seq.dtype), (0, 0, state.cur_index + 1))
        newly_finished = topk_seq[:, :, state.cur_index + 1] == end_marker
        new_log_probs = topk_log_probs + newly_finished * NEG_INF
        _, new_topk_indices = lax.top_k(new_log_probs, k=beam_size)
        new_topk_indices = jnp.flip(new_topk_indices, axis=1)
        top_alive_seq, top_alive_log_probs = gather_beams([topk_seq, new_log_probs], new_topk_indices, batch_size,
                                                          beam_size)
        top_alive_indices = gather_beams(topk_beam_indices, new_topk_indices, batch_size, beam_size)
        top_alive_cache = gather_beams(new_cache, top_alive_indices, batch_size, beam_size)
        new_scores = topk_log_probs / brevity_penalty(alpha, state.cur_index + 1)
        new_scores += (~newly_finished) * NEG_INF
        finished_seqs = jnp.concatenate([state.finished_seqs, topk_seq], axis=1)
        finished_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
        finished_flags = jnp.concatenate([state.finished_flags, newly_finished], axis=1)
        top_finished_seq, top_finished_scores, top_finished_flags = gather_topk_beams(
            [finished_seqs, finished_scores, finished_flags], finished_scores, batch_size, beam_size)
        return BeamState(cur_index=state.cur_index + 1, live_logprobs=top_alive_log_probs,
                         finished_scores=top_finished_scores, live_seqs=top_alive_seq, finished_seqs=top_finished_seq,
                         finished_flags=top_finished_flags, cache=top_alive_cache)

    final_state = lax.while_loop(beam_search_loop_cond_fn, beam_search_loop_body_fn, beam_search_init_state)
    none_finished = jnp.any(final_state.finished_flags, axis=1)
    finished_seqs = jnp.where(none_finished[:, None, None], final_state.finished_seqs, final_state.live_seqs)
    finished_scores = jnp.where(none_finished[:, None], final_state.finished_scores, final_state.live_logprobs)
    return finished_seqs, finished_scores


# -- wmt's predict_step on the re-created linen model ------------------------------------------


def _decode_prefix(module, encoded, inputs, prefix):
    """The linen decoder with decode=True's masks over the whole prefix (N, L), prefix[:, 0] = 0:
    causal only, and every query sees the real inputs. The decoder shifts its targets right
    itself, so it is handed the prefix shifted left (the start token 0 comes back in front)."""
    dtype = module.config.dtype
    decoder_mask = nn.make_causal_mask(prefix, dtype=dtype)
    encoder_decoder_mask = nn.make_attention_mask(jnp.ones_like(prefix) > 0, inputs > 0, dtype=dtype)
    targets = jnp.pad(prefix[:, 1:], ((0, 0), (0, 1)))
    return module.decoder(encoded, targets, decoder_mask, encoder_decoder_mask)


def predict(config: wmt.WmtConfig, params: dict, inputs, *, beam_size: int = 4, alpha: float = 0.6,
            eos_id: int = EOS_ID, max_decode_len: int) -> np.ndarray:
    """wmt's `predict_step`: the inputs encoded, expanded per beam, beam search, and
    `beam_seqs[:, -1, 1:]` (the best beam without the start token): (B, max_decode_len - 1)."""
    model = wmt.Transformer(config)
    variables = {"params": params}
    inputs = jnp.asarray(inputs)
    encoded = model.apply(variables, inputs, method=wmt.Transformer.encode)
    encoded = flat_batch_beam_expand(encoded, beam_size)
    raw_inputs = flat_batch_beam_expand(inputs, beam_size)
    cache = {"prefix": jnp.zeros((inputs.shape[0], max_decode_len), jnp.int32), "index": jnp.array(0)}

    def tokens_ids_to_logits(flat_ids, flat_cache):
        index = flat_cache["index"]
        prefix = lax.dynamic_update_slice(flat_cache["prefix"], flat_ids.astype(jnp.int32), (0, index))
        logits = model.apply(variables, encoded, raw_inputs, prefix, method=_decode_prefix)  # (N, L, V)
        step = lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False)  # (N, V)
        return step, {"prefix": prefix, "index": index + 1}

    beam_seqs, _ = beam_search(inputs, cache, tokens_ids_to_logits, beam_size=beam_size, alpha=alpha, eos_id=eos_id,
                               max_decode_len=max_decode_len)
    return np.asarray(beam_seqs[:, -1, 1:])
