"""MLCommons AlgoPerf's PyTorch beam search (`algoperf/workloads/wmt/wmt_pytorch/decode.py`,
"PyTorch port of https://github.com/google/flax/tree/main/examples/wmt"), re-created line for
line on the CPU, driving the model of `tests/systems/algoperf_torch.py` as the workload's
`predict_step` (`wmt_pytorch/workload.py`) does: encode, repeat each row per beam, beam search
with alpha 0.6, and `beam_seqs[:, -1, 1:]` (the best beam without the start token 0).

Two things of the torch port that the Flax original does not do, kept:
- `topk_seq[:, :, cur_index + 1:] = topk_ids` writes the new token into every later position,
  so a finished sequence repeats its end token up to max_decode_len - 1 (the workload's
  `_decode_tokens` cuts at the first end token);
- the beam state's float tensors are float32 (`NEG_INF = -1e7`).

The decoder step differs from AlgoPerf's only in how it is computed: AlgoPerf runs its decoder
with `decode=True` and a KV cache whose self-attention mask hides the slots not yet written
(`arange(max_len) >= cache_index` -> -1e10) and whose cross-attention mask is
`ones_like(tgt) > 0` AND `src > 0`, with no target padding mask (the start token is the pad id
0). Here the "cache" is the prefix so far, and each step runs the decoder over it with a causal
mask and that cross-attention mask, then takes the logits at the current index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import jax
import numpy as np
import torch
import torch.nn.functional as F

from systems import algoperf_torch

DEVICE = torch.device("cpu")
EOS_ID = 2
NEG_INF = torch.tensor(-1.0e7, device=DEVICE)


def brevity_penalty(alpha: float, length: Union[int, torch.Tensor]) -> torch.Tensor:
    if not isinstance(length, torch.Tensor):
        length = torch.tensor(length, device=DEVICE)
    return torch.pow((5.0 + length) / 6.0, alpha)


def add_beam_dim(x: torch.Tensor, beam_size: int) -> torch.Tensor:
    if x.dim() < 2:  # ignore scalars (e.g. cache index)
        return x
    x = x.unsqueeze(dim=1)
    tile_dims = [1] * x.dim()
    tile_dims[1] = beam_size
    return torch.tile(x, tile_dims)


def flatten_beam_dim(x: torch.Tensor) -> torch.Tensor:
    if x.dim() < 2:
        return x
    return x.view(-1, *x.shape[2:])


def unflatten_beam_dim(x: torch.Tensor, batch_size: int, beam_size: int) -> torch.Tensor:
    if x.dim() < 2:
        return x
    assert batch_size * beam_size == x.shape[0]
    return x.view(batch_size, beam_size, *x.shape[1:])


def flat_batch_beam_expand(x: torch.Tensor, beam_size: int) -> torch.Tensor:
    return flatten_beam_dim(add_beam_dim(x, beam_size))


def gather_beams(nested: Dict[str, Any], beam_indices: torch.Tensor, batch_size: int, new_beam_size: int):
    batch_indices = torch.reshape(
        torch.div(torch.arange(batch_size * new_beam_size, device=DEVICE), new_beam_size, rounding_mode="floor"),
        (batch_size, new_beam_size))

    def gather_fn(x):
        if x.dim() < 2:
            return x
        return x[batch_indices, beam_indices]

    return jax.tree.map(gather_fn, nested)


def gather_topk_beams(nested, score_or_log_prob: torch.Tensor, batch_size: int, new_beam_size: int):
    _, topk_indices = torch.topk(score_or_log_prob, k=new_beam_size)
    topk_indices = torch.flip(topk_indices, (1,))
    return gather_beams(nested, topk_indices, batch_size, new_beam_size)


@dataclass
class BeamState:
    cur_index: torch.Tensor
    live_logprobs: torch.Tensor
    finished_scores: torch.Tensor
    live_seqs: torch.Tensor
    finished_seqs: torch.Tensor
    finished_flags: torch.Tensor
    cache: Dict[str, Any]


def beam_init(batch_size: int, beam_size: int, max_decode_len: int, cache: Dict[str, Any]) -> BeamState:
    cur_index0 = torch.tensor(0, device=DEVICE)
    live_logprobs0 = torch.tile(torch.tensor([0.0] + [NEG_INF] * (beam_size - 1), device=DEVICE), [batch_size, 1])
    finished_scores0 = torch.ones((batch_size, beam_size), device=DEVICE) * NEG_INF
    live_seqs0 = torch.zeros((batch_size, beam_size, max_decode_len), dtype=torch.int32, device=DEVICE)
    finished_seqs0 = torch.zeros((batch_size, beam_size, max_decode_len), dtype=torch.int32, device=DEVICE)
    finished_flags0 = torch.zeros((batch_size, beam_size), dtype=torch.bool, device=DEVICE)
    beam_cache0 = jax.tree.map(lambda x: add_beam_dim(x, beam_size), cache)
    return BeamState(cur_index=cur_index0, live_logprobs=live_logprobs0, finished_scores=finished_scores0,
                     live_seqs=live_seqs0, finished_seqs=finished_seqs0, finished_flags=finished_flags0,
                     cache=beam_cache0)


def beam_search_loop(inputs: torch.Tensor, cache: Optional[Dict[str, Any]], tokens_to_logits: Callable,
                     beam_size: int = 4, alpha: float = 0.6, eos_id: int = EOS_ID,
                     max_decode_len: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """AlgoPerf's `beam_search`."""
    batch_size = inputs.shape[0]
    if max_decode_len is None:
        max_decode_len = inputs.shape[1]
    end_marker = torch.tensor(eos_id, device=DEVICE)
    beam_search_init_state = beam_init(batch_size, beam_size, max_decode_len, cache)

    def beam_search_loop_cond_fn(state: BeamState) -> bool:
        not_at_end = state.cur_index < max_decode_len - 1
        min_brevity_penalty = brevity_penalty(alpha, max_decode_len)
        best_live_scores = state.live_logprobs[:, -1:] / min_brevity_penalty
        worst_finished_scores, _ = torch.min(state.finished_scores, dim=1, keepdim=True)
        worst_finished_scores = torch.where(state.finished_flags, worst_finished_scores, NEG_INF)
        search_terminated = torch.all(worst_finished_scores > best_live_scores)
        return not_at_end & (~search_terminated)

    def beam_search_loop_body_fn(state: BeamState) -> BeamState:
        cur_index = state.cur_index
        flat_ids = flatten_beam_dim(state.live_seqs[:batch_size, :beam_size, cur_index:cur_index + 1])
        flat_cache = jax.tree.map(flatten_beam_dim, state.cache)
        flat_logits, new_flat_cache = tokens_to_logits(flat_ids, flat_cache)
        logits = unflatten_beam_dim(flat_logits, batch_size, beam_size)
        new_cache = jax.tree.map(lambda x: unflatten_beam_dim(x, batch_size, beam_size), new_flat_cache)
        candidate_log_probs = F.log_softmax(logits, dim=-1)
        log_probs = candidate_log_probs + state.live_logprobs.unsqueeze(dim=2)
        vocab_size = log_probs.shape[2]
        beams_to_keep = 2 * beam_size
        flat_log_probs = log_probs.view(batch_size, beam_size * vocab_size)
        topk_log_probs, topk_indices = torch.topk(flat_log_probs, k=beams_to_keep)
        topk_beam_indices = torch.div(topk_indices, vocab_size, rounding_mode="floor")
        topk_seq = gather_beams(state.live_seqs, topk_beam_indices, batch_size, beams_to_keep)
        topk_ids = torch.unsqueeze(topk_indices % vocab_size, dim=2)
        topk_seq[:, :, cur_index + 1:] = topk_ids.to(topk_seq.dtype)
        newly_finished = topk_seq[:, :, cur_index + 1] == end_marker
        new_log_probs = topk_log_probs + newly_finished * NEG_INF
        _, new_topk_indices = torch.topk(new_log_probs, k=beam_size)
        new_topk_indices = torch.flip(new_topk_indices, (1,))
        top_alive_seq, top_alive_log_probs = gather_beams([topk_seq, new_log_probs], new_topk_indices, batch_size,
                                                          beam_size)
        top_alive_indices = gather_beams(topk_beam_indices, new_topk_indices, batch_size, beam_size)
        top_alive_cache = gather_beams(new_cache, top_alive_indices, batch_size, beam_size)
        new_scores = topk_log_probs / brevity_penalty(alpha, cur_index + 1)
        new_scores += (~newly_finished) * NEG_INF
        finished_seqs = torch.cat([state.finished_seqs, topk_seq], dim=1)
        finished_scores = torch.cat([state.finished_scores, new_scores], dim=1)
        finished_flags = torch.cat([state.finished_flags, newly_finished], dim=1)
        top_finished_seq, top_finished_scores, top_finished_flags = gather_topk_beams(
            [finished_seqs, finished_scores, finished_flags], finished_scores, batch_size, beam_size)
        return BeamState(cur_index=cur_index + 1, live_logprobs=top_alive_log_probs,
                         finished_scores=top_finished_scores, live_seqs=top_alive_seq, finished_seqs=top_finished_seq,
                         finished_flags=top_finished_flags, cache=top_alive_cache)

    state = beam_search_init_state
    while beam_search_loop_cond_fn(state):
        state = beam_search_loop_body_fn(state)
    final_state = state
    none_finished = torch.any(final_state.finished_flags, dim=1)
    finished_seqs = torch.where(none_finished[:, None, None], final_state.finished_seqs, final_state.live_seqs)
    finished_scores = torch.where(none_finished[:, None], final_state.finished_scores, final_state.live_logprobs)
    return finished_seqs, finished_scores


# -- The workload's predict_step on the re-created model ---------------------------------------


def _decode_prefix(model: algoperf_torch.Transformer, prefix: torch.Tensor, memory: torch.Tensor,
                   src: torch.Tensor) -> torch.Tensor:
    """The decoder as decode=True runs it, over the whole prefix (N, L): causal self-attention
    (the -1e10 of the cache's unwritten slots), cross-attention from every query to src > 0."""
    nhead = model.decoder.nhead
    length = prefix.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool)).expand(prefix.shape[0], length, length)
    memory_mask = (torch.ones_like(prefix) > 0).unsqueeze(-1) & (src > 0).unsqueeze(-2)
    y = model.pos_encoder(model.shared_embedding(prefix))
    y = model.decoder.decoder(y, memory, algoperf_torch.float_mask(causal, nhead),
                              algoperf_torch.float_mask(memory_mask, nhead))
    return torch.matmul(y, model.shared_embedding.weight.T) / math.sqrt(y.shape[-1])


@torch.no_grad()
def beam_search(model: algoperf_torch.Transformer, inputs, *, beam_size: int = 4, alpha: float = 0.6,
                eos_id: int = EOS_ID, max_decode_len: int) -> np.ndarray:
    """The workload's `predict_step`: (B, max_decode_len - 1) ids of the best beam per row."""
    inputs = torch.as_tensor(np.asarray(inputs)).to(torch.int)
    encoded_inputs = torch.repeat_interleave(model.encoder(inputs), repeats=beam_size, dim=0)
    raw_inputs = torch.repeat_interleave(inputs, repeats=beam_size, dim=0)
    cache = {"prefix": torch.zeros((inputs.shape[0], max_decode_len), dtype=torch.int32),
             "index": torch.tensor(0)}

    def tokens_ids_to_logits(flat_ids, flat_cache):
        index = int(flat_cache["index"])
        prefix = flat_cache["prefix"].clone()
        prefix[:, index] = flat_ids[:, 0]
        logits = _decode_prefix(model, prefix[:, :index + 1], encoded_inputs, raw_inputs)[:, index]  # (N, V)
        return logits, {"prefix": prefix, "index": torch.tensor(index + 1)}

    beam_seqs, _ = beam_search_loop(inputs, cache, tokens_ids_to_logits, beam_size=beam_size, alpha=alpha,
                                    eos_id=eos_id, max_decode_len=max_decode_len)
    return beam_seqs[:, -1, 1:].numpy()
