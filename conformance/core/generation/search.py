"""The reference search, written once: greedy search, beam search and sampling, on the host, in float64 NumPy.

Every backend's `generate` resolves its arguments (`conformance.core.generation.settings.resolve`),
encodes the source, then hands `search` a `step` function:

    step(tokens, parents) -> logits
        tokens  (N, t) int64, the decoder input so far (N = batch * num_beams rows, or batch *
                num_return_sequences when sampling)
        parents (N,) int64 or None: row i of this step continues row parents[i] of the last one;
                a backend with a KV cache reorders it by `parents` before running the new token
        logits  (N, V) the next-token logits of each row, in the backend's own dtype

`search` does everything else: log-softmax in float64, Hugging Face's logits processors
(`conformance.core.generation.processors`), the choice of tokens (Hugging Face's beam rule or Flax
examples/wmt's; sampling with temperature, top-k and top-p from uniforms drawn once from a NumPy
seed), the finished-hypothesis lists, the length penalty and the stopping rule. So the backends
can only differ through their logits; in float64 they choose the same ids. The semantics are
written out in `docs/decoding.md`.

`DecoderCache` is the state a backend's cached step carries; its fields hold the backend's own
arrays.

Framework-free (NumPy and the standard library).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from conformance.core.errors import InputError, NaNLogitsError
from conformance.core.generation.processors import Processors, Timestamps, log_softmax, processed
from conformance.core.generation.settings import split_bad_words


# Hugging Face's stand-in for "minus infinity" in beam scores (finite, so that sums stay ordered).
NEG = -1.0e9


@dataclass
class DecoderCache:
    """The decoder's state between steps, one entry per decoder layer.

    keys, values:              self-attention keys and values of the positions so far,
                               (N, H, L, K) buffers of which the first `length` positions are filled
    cross_keys, cross_values:  the encoder memory projected once per source, (N, H, S, K)
    tgt_ids:                   (N, L) the decoder input so far (for the target padding mask)
    cross_mask:                (N, 1, 1, S) the source padding mask, or None
    length:                    how many positions are filled (an int; a 0-d array in JAX)
    cross_fix_ups:             what a backend works out once per source for each layer's
                               cross-attention, which does not change between steps (impl_torch:
                               its fused kernel's mask and fix-ups), or None
    output_weight:             W_out (D, V) in the layout a backend's step multiplies fastest, when
                               that is not how it is stored (impl_torch on the CPU: packed for
                               oneDNN in float32, impl_torch/packed.py; else the tied embedding
                               transposed once per search), or None for the stored one
    step_decoder:              the decoder modules a backend's cached step runs when they are not the
                               model's own (impl_torch on the CPU: the same layers with oneDNN-packed
                               products, impl_torch/packed.py), or None
    """

    keys: list[Any]
    values: list[Any]
    cross_keys: list[Any]
    cross_values: list[Any]
    tgt_ids: Any
    cross_mask: Any
    length: Any = 0
    cross_fix_ups: Any = None
    output_weight: Any = None
    step_decoder: Any = None


def penalty(length, length_penalty: float, form: str):
    """The divisor of a finished hypothesis' summed log-probability.

    hf:    length ** alpha                (Hugging Face `length_penalty`; alpha 0 = plain sum)
    gnmt:  ((5 + length) / 6) ** alpha    (Wu et al. 2016, as in Flax examples/wmt)
    `length` counts the generated tokens, the end token included, the start token not.
    """
    length = np.asarray(length, dtype=np.float64)
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** length_penalty
    return length ** length_penalty




def nan_error(step: int, row: int, mask_fill: float | None = None) -> NaNLogitsError:
    """The error for NaN logits of an open row, naming the causes the model's `mask_fill` allows
    (None: a search without a model, whose step gave them): only a -inf fill makes a query whose
    every key is masked NaN (0 / 0); with a finite one, a value in the model overflowed."""
    found = f"the decoder produced NaN logits at step {step}, row {row}"
    if mask_fill is None:
        return NaNLogitsError(step, row, f"{found}: the step function returned them")
    if math.isinf(mask_fill):
        return NaNLogitsError(step, row, f"{found}: an attention row had every key masked with mask_fill=-inf (is "
                                         "bos_id the pad id?), or a value in the model overflowed")
    return NaNLogitsError(step, row, f"{found}: a value in the model overflowed its dtype (non-finite values; "
                                     f"mask_fill={mask_fill:g} is finite, so no masked attention row made them); "
                                     "`rosetta check` on the checkpoint, or the model's intermediates, name the first "
                                     "non-finite tensor")


def _check_finite(logits: np.ndarray, live: np.ndarray, step: int, mask_fill: float | None) -> None:
    bad = np.argwhere(np.isnan(logits[live]).any(axis=-1))
    if len(bad):
        raise nan_error(step, int(np.flatnonzero(live)[bad[0, 0]]), mask_fill)


def search(step: Callable[[np.ndarray, np.ndarray | None], Any], batch: int, max_len: int, bos_id: int, eos_id: int,
           pad_id: int, *, num_beams: int = 1, length_penalty: float = 1.0, early_stopping: bool | str = False,
           length_penalty_form: str = "hf", forced_eos: bool = False, banned_ids: Sequence[int] = (),
           bad_words_ids: Sequence[Sequence[int]] = (), no_repeat_ngram_size: int = 0, forced_bos_id: int | None = None,
           min_length: int = 0, min_new_tokens: int = 0, repetition_penalty: float = 1.0,
           encoder_repetition_penalty: float = 1.0, encoder_no_repeat_ngram_size: int = 0,
           exponential_decay_length_penalty: tuple[int, float] | None = None, suppress_tokens: Sequence[int] = (),
           begin_suppress_tokens: Sequence[int] = (), renormalize_logits: bool = False, beam_rule: str = "hf",
           num_return_sequences: int = 1, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, seed: int | None = None, prefix: Sequence[int | None] = (),
           language_ids: Sequence[int] = (), return_timestamps: bool = False, no_timestamps_id: int | None = None,
           max_initial_timestamp_index: int | None = None, return_no_speech_prob: bool = False,
           patience: float = 1.0, src_ids: np.ndarray | None = None,
           as_numpy: Callable[[Any], np.ndarray] = np.asarray,
           trace: list | None = None, mask_fill: float | None = None) -> tuple:
    """Greedy (num_beams=1), beam search (Hugging Face's rule, Flax's with beam_rule="flax",
    openai-whisper's with beam_rule="openai") or sampling (do_sample=True). Returns the best
    `num_return_sequences` sequences per source row after `bos_id` (best first; samples in the
    order drawn), (batch * num_return_sequences, n) int64 with n <= max_len, padded with `pad_id`
    after the end token, and their scores (.,) float64: the summed log-probabilities divided by
    `penalty(length)`; with `return_no_speech_prob` also each source row's probability of the
    no-speech id (no_timestamps_id - 1) at the start token's position (batch,).

    `step` gets batch * num_beams rows (beam search) or batch * num_return_sequences (sampling:
    each source row repeated), in source order. The options are checked by `resolve`. The logits
    processors (`Processors`): `banned_ids`, Hugging Face's `bad_words_ids` (a one-token word is
    banned everywhere, except the end token, which transformers drops), `no_repeat_ngram_size`,
    `min_length` and `min_new_tokens` (the end token banned while the decoder input, start token
    included, is shorter than min_length, or fewer than min_new_tokens tokens were generated),
    `forced_bos_id` and `forced_eos`; `repetition_penalty`, `encoder_repetition_penalty` and
    `encoder_no_repeat_ngram_size` (these two read `src_ids` (batch, S), the source ids as given,
    padding included), `exponential_decay_length_penalty` (start, factor), `suppress_tokens`,
    `begin_suppress_tokens` (at the first step, or the second when a first token is forced, or
    the first after the prefix), Whisper's timestamp rules (`return_timestamps`, on the ids after
    `no_timestamps_id`, the first at most `max_initial_timestamp_index` after them) and
    `renormalize_logits`.

    `prefix`: ids fed after `bos_id` before the search chooses any (Whisper's forced prompt; a
    None is the step's best id of `language_ids`, language detection); they begin the returned
    sequences, and the scores and lengths count only what follows them (`_prompt`).

    `trace`, a list, receives per step the closest call of each source row, for the conformance
    suite: {"gap": (B,), "scale": (B,)}, the smallest score difference between two candidates
    whose order decided something (greedy: the best two processed logits, which the arg-max
    reads; beam search: neighbours among the
    ranked candidates and finished hypotheses; sampling: the distance between the uniform and the
    nearest edge of the cumulative distribution, or of top_k's and top_p's thresholds,
    `filter_gap`; a forced prompt step: none, or the best two language ids where it detects), and
    max(1, largest |logit|) of the row's beams (or sampled row). Flax's rule adds, per step that may
    stop, "worst" (B,), the worst finished slot (NEG while one is empty), and "open_now" (B,), the
    best open beam scored at its own length, not at max_decode_len.

    `mask_fill`, the model's (None without one), picks the causes that NaN logits of an open row
    are blamed on (`nan_error`, raised as a `NaNLogitsError`).
    """
    one_token, words = split_bad_words(bad_words_ids, eos_id)
    encoder_ids = None
    per = num_return_sequences if do_sample else num_beams  # decoder rows per source row
    if encoder_repetition_penalty != 1.0 or encoder_no_repeat_ngram_size:
        if src_ids is None:
            raise InputError("src_ids", "encoder_repetition_penalty and encoder_no_repeat_ngram_size read the source "
                                        "ids: pass them")
        encoder_ids = np.repeat(np.asarray(src_ids, dtype=np.int64), per, axis=0)  # (N, S)
    prompt_len = len(prefix)
    timestamps = None
    if return_timestamps:
        timestamps = Timestamps(begin=no_timestamps_id + 1, no_timestamps=no_timestamps_id,
                                max_initial=max_initial_timestamp_index, sample_begin=1 + prompt_len)
    processors = Processors(max_len=max_len, eos_id=eos_id, banned_ids=tuple(banned_ids) + one_token,
                            bad_words_ids=words, no_repeat_ngram_size=no_repeat_ngram_size,
                            min_length=min_length, min_new_tokens=min_new_tokens,
                            forced_bos_id=forced_bos_id, forced_eos=forced_eos,
                            repetition_penalty=repetition_penalty,
                            encoder_repetition_penalty=encoder_repetition_penalty,
                            encoder_no_repeat_ngram_size=encoder_no_repeat_ngram_size, encoder_ids=encoder_ids,
                            exponential_decay_length_penalty=exponential_decay_length_penalty,
                            suppress_tokens=tuple(suppress_tokens), begin_suppress_tokens=tuple(begin_suppress_tokens),
                            begin_suppress_step=prompt_len if prompt_len else 0 if forced_bos_id is None else 1,
                            timestamps=timestamps, renormalize_logits=renormalize_logits, prompt_len=prompt_len)
    first: list = []  # the first step's logits: the start token's position (the no-speech probability)

    def recorded(tokens, parents):
        logits = step(tokens, parents)
        if return_no_speech_prob and not first:
            first.append(np.array(as_numpy(logits), dtype=np.float64))
        return logits

    rows = batch * per
    beams = not do_sample and (beam_rule != "hf" or num_beams > 1)
    start = _prompt(recorded, rows, bos_id, prefix, language_ids, as_numpy, trace, mask_fill,
                    group=num_beams if beams else 1)
    if do_sample:
        found = _sample(recorded, rows, max_len, eos_id, pad_id, length_penalty, length_penalty_form, processors,
                        temperature, top_k, top_p, seed, as_numpy, trace, start, mask_fill=mask_fill)
    elif beam_rule == "flax":
        found = _beam_flax(recorded, batch, max_len, eos_id, pad_id, num_beams, length_penalty, length_penalty_form,
                           processors, as_numpy, trace, start, mask_fill=mask_fill)
    elif beam_rule == "openai":
        found = _beam_openai(recorded, batch, max_len, eos_id, pad_id, num_beams, length_penalty, length_penalty_form,
                             processors, patience, as_numpy, trace, start, mask_fill=mask_fill)
    elif num_beams == 1:
        found = _greedy(recorded, batch, max_len, eos_id, pad_id, length_penalty, length_penalty_form, processors,
                        as_numpy, trace, start, mask_fill=mask_fill)
    else:
        found = _beam(recorded, batch, max_len, eos_id, pad_id, num_beams, length_penalty, early_stopping,
                      length_penalty_form, processors, as_numpy, trace, num_return_sequences, start,
                      mask_fill=mask_fill)
    if not return_no_speech_prob:
        return found
    probs = np.exp(log_softmax(first[0]))[::per, no_timestamps_id - 1]  # (B,): each source row's first decoder row
    return (*found, probs)


def _prompt(step, rows: int, bos_id: int, prefix, language_ids, as_numpy, trace, mask_fill, group: int) -> np.ndarray:
    """The decoder input (rows, 1 + len(prefix)) after the forced prompt: the start token, then
    each prefix id, fed one step at a time (the decoder reads them; nothing is scored), a None
    being the step's best id among `language_ids` (by the raw logits, first of equals: openai's
    `detect_language` and transformers' on the start token's position). Its trace rows are per
    `group` decoder rows (a source's beams)."""
    tokens = np.full((rows, 1), bos_id, dtype=np.int64)  # (N, 1)
    for i, forced in enumerate(prefix):
        logits = np.array(as_numpy(step(tokens, None)), dtype=np.float64)  # (N, V)
        _check_finite(logits, np.ones(rows, dtype=bool), i, mask_fill)
        gap = np.full(rows, np.inf)
        if forced is None:
            is_language = np.zeros(logits.shape[-1], dtype=bool)
            is_language[list(language_ids)] = True
            masked = np.where(is_language, logits, -np.inf)
            chosen = masked.argmax(-1)
            gap = _neighbour_gap(masked, 1)
        else:
            chosen = np.full(rows, forced, dtype=np.int64)
        if trace is not None:
            trace.append({"gap": gap.reshape(-1, group).min(axis=1),
                          "scale": _scale(logits).reshape(-1, group).max(axis=1)})
        tokens = np.concatenate([tokens, chosen[:, None]], axis=1)  # (N, i + 2)
    return tokens


def _scale(logits: np.ndarray) -> np.ndarray:
    """max(1, largest finite |logit|) per row (the magnitude the tolerance table's atol scales)."""
    finite = np.where(np.isfinite(logits), np.abs(logits), 0.0)
    return np.maximum(1.0, finite.max(axis=-1))


def _neighbour_gap(scores: np.ndarray, k: int) -> np.ndarray:
    """Smallest difference between neighbours among the k + 1 best finite scores per row."""
    ranked = -np.sort(-scores, axis=1)[:, :k + 1]
    with np.errstate(invalid="ignore"):  # -inf - -inf (banned ids), masked below
        gaps = np.where(np.isfinite(ranked[:, :-1]) & np.isfinite(ranked[:, 1:]) & (ranked[:, 1:] > NEG / 2),
                        ranked[:, :-1] - ranked[:, 1:], np.inf)
    return gaps.min(axis=1)


def _greedy(step, batch, max_len, eos_id, pad_id, length_penalty, form, processors, as_numpy, trace, start, *,
            mask_fill=None):
    tokens = start  # (B, 1 + P): the start token and the forced prompt
    done = np.zeros(batch, dtype=bool)
    summed = np.zeros(batch)
    lengths = np.zeros(batch, dtype=np.int64)  # generated after the prompt
    for i in range(start.shape[1] - 1, max_len):
        logits = np.array(as_numpy(step(tokens, None)), dtype=np.float64)  # (B, V)
        _check_finite(logits, ~done, i, mask_fill)
        log_probs = processed(log_softmax(logits), tokens, i, processors)
        scale = _scale(logits)
        logits = processed(logits, tokens, i, processors)
        if trace is not None:  # the gap the choice reads: a penalty or the decay ranks logits and log-probs apart
            trace.append({"gap": np.where(done, np.inf, _neighbour_gap(logits, 1)), "scale": scale})
        # The choice reads the logits, as Hugging Face's greedy search does (same argmax, fewer roundings).
        next_id = np.where(done, pad_id, logits.argmax(-1))  # (B,)
        summed += np.where(done, 0.0, log_probs[np.arange(batch), next_id])
        lengths += ~done
        tokens = np.concatenate([tokens, next_id[:, None]], axis=1)  # (B, t + 1)
        done |= next_id == eos_id
        if done.all():
            break
    return tokens[:, 1:], summed / penalty(lengths, length_penalty, form)


def warp(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Hugging Face's sampling warpers in its order, on float64 logits (N, V): the logits divided
    by `temperature` (TemperatureLogitsWarper), then every id scoring below the k-th best set to
    -inf (TopKLogitsWarper; ties with the k-th are kept; 0 keeps all), then, over the ids sorted
    from the lowest score, every id whose cumulative probability is at most 1 - top_p set to -inf,
    the best id always kept (TopPLogitsWarper with min_tokens_to_keep=1)."""
    scores = np.array(logits, dtype=np.float64)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = -np.sort(-scores, axis=-1)[:, min(top_k, scores.shape[-1]) - 1:][:, :1]  # (N, 1)
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending, as HF sorts
        cumulative = np.cumsum(np.exp(log_softmax(np.take_along_axis(scores, order, axis=-1))), axis=-1)
        remove = cumulative <= 1 - top_p
        remove[:, -1] = False
        unsorted = np.empty_like(remove)
        np.put_along_axis(unsorted, order, remove, axis=-1)
        scores = np.where(unsorted, -np.inf, scores)
    return scores


def filter_gap(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """How close each row (N, V) came to keeping other ids under `warp`: the score difference
    between the k-th and the next id (after the temperature), and the distance of the sorted
    cumulative probabilities from 1 - top_p (after top_k). inf where a filter is off."""
    scores = np.array(logits, dtype=np.float64) / temperature
    gap = np.full(len(scores), np.inf)
    if top_k and top_k < scores.shape[-1]:
        ranked = -np.sort(-scores, axis=-1)
        kth, after = ranked[:, top_k - 1], ranked[:, top_k]
        with np.errstate(invalid="ignore"):  # -inf - -inf where ids are banned: selected out below
            gap = np.minimum(gap, np.where(np.isfinite(after), kth - after, np.inf))
    if top_p < 1.0:
        kept = warp(logits, temperature, top_k)
        cumulative = np.cumsum(np.exp(log_softmax(np.sort(kept, axis=-1))), axis=-1)
        gap = np.minimum(gap, np.abs(cumulative - (1 - top_p)).min(axis=-1))
    return gap


def draw(probs: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse-CDF sampling: per row, the first id whose cumulative probability (in vocabulary
    order, float64) exceeds u times the total; ids of probability 0 are never drawn. Returns the
    ids (N,) and each row's distance from u * total to the nearest edge of the distribution."""
    cumulative = np.cumsum(probs, axis=-1)  # (N, V)
    target = uniforms * cumulative[:, -1]  # (N,)
    ids = (cumulative <= target[:, None]).sum(axis=-1)
    return ids, np.abs(cumulative - target[:, None]).min(axis=-1)


def uniforms(seed: int | None, max_len: int, rows: int) -> np.ndarray:
    """Sampling's uniforms, (max_len, rows) float64, drawn once up front from
    np.random.default_rng(seed) (seed None: fresh entropy): step i of row r uses [i, r]. The
    device searches take the same array (conformance.core.generation.device.sampling_data)."""
    return np.random.default_rng(seed).random((max_len, rows))


def _sample(step, rows, max_len, eos_id, pad_id, length_penalty, form, processors, temperature, top_k,
            top_p, seed, as_numpy, trace, start, *, mask_fill=None):
    """Multinomial sampling (Hugging Face's `_sample` with do_sample=True): at every step the
    processed logits are warped (`warp`), turned into float64 probabilities, and each open row
    draws its next id with one uniform. The uniforms, (max_len, rows), are drawn once up front
    from np.random.default_rng(seed) (`uniforms`), so every backend draws the same ids from the same logits."""
    drawn_uniforms = uniforms(seed, max_len, rows)  # step i uses drawn_uniforms[i]
    tokens = start  # (N, 1 + P): the start token and the forced prompt
    done = np.zeros(rows, dtype=bool)
    summed = np.zeros(rows)
    lengths = np.zeros(rows, dtype=np.int64)  # generated after the prompt
    for i in range(start.shape[1] - 1, max_len):
        logits = np.array(as_numpy(step(tokens, None)), dtype=np.float64)  # (N, V)
        _check_finite(logits, ~done, i, mask_fill)
        log_probs = processed(log_softmax(logits), tokens, i, processors)
        processed_logits = processed(logits, tokens, i, processors)
        drawn, gap = draw(np.exp(log_softmax(warp(processed_logits, temperature, top_k, top_p))), drawn_uniforms[i])
        if trace is not None:
            gap = np.minimum(gap, filter_gap(processed_logits, temperature, top_k, top_p))
            trace.append({"gap": np.where(done, np.inf, gap), "scale": _scale(logits)})
        next_id = np.where(done, pad_id, drawn)  # (N,)
        summed += np.where(done, 0.0, log_probs[np.arange(rows), next_id])
        lengths += ~done
        tokens = np.concatenate([tokens, next_id[:, None]], axis=1)  # (N, t + 1)
        done |= next_id == eos_id
        if done.all():
            break
    return tokens[:, 1:], summed / penalty(lengths, length_penalty, form)


def _take(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """array (B, M, ...) gathered along axis 1 by index (B, k) -> (B, k, ...)."""
    return np.take_along_axis(array, index.reshape(index.shape + (1,) * (array.ndim - 2)), axis=1)


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, best first; ties keep the lower index."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def _beam(step, batch, max_len, eos_id, pad_id, num_beams, length_penalty, early_stopping, form,
          processors, as_numpy, trace, returned, start, *, mask_fill=None):
    """Hugging Face's beam search (transformers 5.x `_beam_search`), docs/decoding.md. The forced
    prompt (`start`'s columns after the first) is its decoder prompt: the lengths the penalty
    reads count the tokens after it (transformers' cur_len + 1 - decoder_prompt_len)."""
    beams, keep = num_beams, 2 * num_beams  # 2 x beams candidates, so that beams stay open after ends
    width = max_len + 1  # the start token and at most max_len generated ones
    prompt = start.shape[1] - 1  # P
    running = np.full((batch, beams, width), pad_id, dtype=np.int64)  # (B, beams, 1 + max_len)
    running[:, :, :prompt + 1] = start.reshape(batch, beams, prompt + 1)
    running_scores = np.zeros((batch, beams))
    running_scores[:, 1:] = NEG  # every beam starts as a copy of the first: only its candidates count
    finished = running.copy()
    finished_scores = np.full((batch, beams), NEG)
    finished_lengths = np.zeros((batch, beams), dtype=np.int64)
    is_finished = np.zeros((batch, beams), dtype=bool)
    improvable = np.ones(batch, dtype=bool)  # Hugging Face's is_early_stop_heuristic_unsatisfied
    parents = None
    length = 1 + prompt  # decoder input length, the start token included
    top_rank = np.arange(keep) < beams
    while True:
        tokens = running[:, :, :length].reshape(batch * beams, length)  # (N, t)
        logits = np.array(as_numpy(step(tokens, parents)), dtype=np.float64)  # (N, V)
        _check_finite(logits, np.ones(len(logits), dtype=bool), length - 1, mask_fill)
        vocab = logits.shape[-1]
        log_probs = processed(log_softmax(logits), tokens, length - 1, processors)
        totals = (log_probs.reshape(batch, beams, vocab) + running_scores[:, :, None]).reshape(batch, -1)

        # The best 2 x beams continuations over all beams of each row.
        candidates = _top(totals, keep)  # (B, keep)
        candidate_scores = np.take_along_axis(totals, candidates, axis=1)
        parent_beam, token = candidates // vocab, candidates % vocab
        sequences = _take(running, parent_beam)  # (B, keep, width)
        sequences[:, :, length] = token
        ends = (token == eos_id) | (length + 1 >= width)  # an end token, or the longest allowed

        # The best `beams` that did not end stay open.
        open_scores = candidate_scores + ends * NEG
        chosen = _top(open_scores, beams)
        running = _take(sequences, chosen)
        running_scores = np.take_along_axis(open_scores, chosen, axis=1)
        parents = (np.arange(batch)[:, None] * beams + np.take_along_axis(parent_beam, chosen, axis=1)).reshape(-1)

        # Endings among the best `beams` candidates join the finished list, scored with the length
        # penalty, unless the row is full (early_stopping=True) or can no longer improve.
        scored = candidate_scores / penalty(length - prompt, length_penalty, form)
        full = is_finished.all(axis=1) & (early_stopping is True)
        just_ended = ends & top_rank[None, :]
        scored = scored + (full | ~improvable)[:, None] * NEG + ~just_ended * NEG
        merged = np.concatenate([finished_scores, scored], axis=1)
        best = _top(merged, beams)
        if trace is not None:
            gap = np.minimum(_neighbour_gap(totals, keep), _neighbour_gap(merged, beams))
            trace.append({"gap": gap, "scale": _scale(logits).reshape(batch, beams).max(axis=1)})
        finished = _take(np.concatenate([finished, sequences], axis=1), best)
        finished_scores = np.take_along_axis(merged, best, axis=1)
        finished_lengths = np.take_along_axis(
            np.concatenate([finished_lengths, np.full((batch, keep), length)], axis=1), best, axis=1)
        is_finished = np.take_along_axis(np.concatenate([is_finished, just_ended], axis=1), best, axis=1)

        length += 1
        # Can an open beam still beat the worst finished one? Its best possible score is guessed at
        # the current length (True, False) or, for "never" with a positive penalty, at max_len.
        guess = max_len - prompt if (early_stopping == "never" and not isinstance(early_stopping, bool)
                                     and length_penalty > 0) else length - 1 - prompt
        best_open = running_scores[:, 0] / penalty(guess, length_penalty, form)  # (B,)
        worst = np.where(is_finished, finished_scores.min(axis=1, keepdims=True), NEG)
        improvable &= (best_open[:, None] > worst).any(axis=1)
        if not improvable.any() or (is_finished.all() and early_stopping is True) or ends.all():
            break
    n = int(finished_lengths[:, :returned].max())
    return finished[:, :returned, 1:1 + n].reshape(batch * returned, n), finished_scores[:, :returned].reshape(-1)


def _beam_flax(step, batch, max_len, eos_id, pad_id, num_beams, length_penalty, form, processors, as_numpy,
               trace, start, *, mask_fill=None):
    """Flax examples/wmt `decode.beam_search` (also t5x and MLCommons AlgoPerf's wmt decode.py),
    with Flax's `max_decode_len` = max_len + 1 (its sequences hold the start token). It differs
    from `_beam` in three places (docs/decoding.md):
    - every end token among the best 2 x beams candidates enters the finished set;
    - reaching max_len is not an end: an open beam is returned only by a row with no finished one;
    - the search stops at max_len, or once in every row each of the `beams` finished slots is
      filled and beats the best open beam scored at max_decode_len (one condition for the batch).
    A forced prompt is not counted in the lengths the penalty reads, as in `_beam`.
    """
    beams, keep = num_beams, 2 * num_beams
    width = max_len + 1  # Flax's max_decode_len: the start token and at most max_len generated ones
    prompt = start.shape[1] - 1  # P
    live = np.full((batch, beams, width), pad_id, dtype=np.int64)  # (B, beams, 1 + max_len)
    live[:, :, :prompt + 1] = start.reshape(batch, beams, prompt + 1)
    live_scores = np.zeros((batch, beams))
    live_scores[:, 1:] = NEG  # every beam starts as a copy of the first: only its candidates count
    finished = live.copy()
    finished_scores = np.full((batch, beams), NEG)
    finished_lengths = np.zeros((batch, beams), dtype=np.int64)
    flags = np.zeros((batch, beams), dtype=bool)  # Flax's finished_flags: the slot holds a hypothesis
    parents = None
    length = 1 + prompt  # decoder input length, the start token included (Flax's cur_index + 1)
    while True:
        tokens = live[:, :, :length].reshape(batch * beams, length)  # (N, t)
        logits = np.array(as_numpy(step(tokens, parents)), dtype=np.float64)  # (N, V)
        _check_finite(logits, np.ones(len(logits), dtype=bool), length - 1, mask_fill)
        vocab = logits.shape[-1]
        log_probs = processed(log_softmax(logits), tokens, length - 1, processors)
        totals = (log_probs.reshape(batch, beams, vocab) + live_scores[:, :, None]).reshape(batch, -1)

        # The best 2 x beams continuations over all beams of each row.
        candidates = _top(totals, keep)  # (B, keep)
        candidate_scores = np.take_along_axis(totals, candidates, axis=1)
        parent_beam, token = candidates // vocab, candidates % vocab
        sequences = _take(live, parent_beam)  # (B, keep, width)
        sequences[:, :, length] = token
        ends = token == eos_id  # only the end token ends a hypothesis

        # The best `beams` that did not end stay open.
        open_scores = candidate_scores + ends * NEG
        chosen = _top(open_scores, beams)
        live = _take(sequences, chosen)
        live_scores = np.take_along_axis(open_scores, chosen, axis=1)
        parents = (np.arange(batch)[:, None] * beams + np.take_along_axis(parent_beam, chosen, axis=1)).reshape(-1)

        # Every ending among the 2 x beams candidates competes for the finished set.
        scored = candidate_scores / penalty(length - prompt, length_penalty, form) + ~ends * NEG
        merged = np.concatenate([finished_scores, scored], axis=1)
        best = _top(merged, beams)
        if trace is not None:
            gap = np.minimum(_neighbour_gap(totals, keep), _neighbour_gap(merged, beams))
            trace.append({"gap": gap, "scale": _scale(logits).reshape(batch, beams).max(axis=1)})
        finished = _take(np.concatenate([finished, sequences], axis=1), best)
        finished_scores = np.take_along_axis(merged, best, axis=1)
        finished_lengths = np.take_along_axis(
            np.concatenate([finished_lengths, np.full((batch, keep), length)], axis=1), best, axis=1)
        flags = np.take_along_axis(np.concatenate([flags, ends], axis=1), best, axis=1)

        length += 1
        if length > max_len:  # Flax: cur_index < max_decode_len - 1
            break
        # No row can improve: the best open beam, scored at max_decode_len (the length that favours
        # it most for alpha >= 0), does not beat the worst finished slot, in every row; an empty
        # slot counts as NEG.
        best_open = live_scores[:, :1] / penalty(width - prompt, length_penalty, form)  # (B, 1)
        worst = np.where(flags, finished_scores.min(axis=1, keepdims=True), NEG)
        if trace is not None:  # a bound at the open beam's own length (the suite's late-overtake check)
            trace[-1].update(worst=worst[:, 0], open_now=live_scores[:, 0] / penalty(length - 1 - prompt, length_penalty,
                                                                                       form))
        if (worst > best_open).all():
            break
    # A row without a finished hypothesis returns its best open beam, scored by its plain sum.
    some = flags.any(axis=1)
    ids = np.where(some[:, None], finished[:, 0], live[:, 0])  # (B, width)
    lengths = np.where(some, finished_lengths[:, 0], length - 1)
    n = int(lengths.max())
    return ids[:, 1:1 + n], np.where(some, finished_scores[:, 0], live_scores[:, 0])


def _beam_openai(step, batch, max_len, eos_id, pad_id, num_beams, length_penalty, form, processors, patience,
                 as_numpy, trace, start, *, mask_fill=None):
    """openai-whisper's beam search (whisper/decoding.py, 20250625: `BeamSearchDecoder` and the
    `MaximumLikelihoodRanker`), docs/whisper.md:

    - every step scores each id by the log-softmax of the processed logits (so the processors'
      bans are renormalized away), added to its beam's sum; each beam proposes its num_beams + 1
      best ids;
    - a row's proposals are walked best first (equal scores in proposal order): one that ends with
      the end token is finished, any other continues, until num_beams continue;
    - the finished ones join the row's list, best first, while it holds fewer than
      C = round(num_beams x patience);
    - the search stops once every row's list holds C, or at max_len;
    - a row with fewer than num_beams finished takes its open beams, best first, up to num_beams;
    - the row's result is the first best of sum / penalty(length), its length the tokens after
      the prompt without the end token (openai's length_penalty=None is "hf" with alpha 1).

    The beams start as one (openai's repeats it num_beams times, and its dictionary of proposals
    keeps one of each). Where openai-whisper differs: a proposal scored -inf (every id its beam
    may take is banned, fewer than num_beams + 1 are allowed) is dropped here, so a row may run
    fewer beams, each slot left open holding a copy of the row's best proposal at -inf; openai's
    torch.topk picks such ids among equal -inf scores in no promised order and keeps them. A
    hypothesis of no token (the end token first) is ranked as one token long, where openai's
    division by its length 0 raises."""
    beams, most = num_beams, round(num_beams * patience)  # beams, the finished hypotheses to wait for
    prompt = start.shape[1] - 1  # P
    running = [[tuple(int(t) for t in start[b * beams + j]) for j in range(beams)] for b in range(batch)]
    sums = np.full((batch, beams), -np.inf)
    sums[:, 0] = 0.0  # one beam: openai's copies of it are one proposal each
    finished: list[dict] = [{} for _ in range(batch)]  # per row: hypothesis -> its sum, in the order they joined
    parents = None
    length = 1 + prompt  # decoder input length, the start token included
    while True:
        tokens = np.array([seq for row in running for seq in row], dtype=np.int64)  # (N, length)
        logits = np.array(as_numpy(step(tokens, parents)), dtype=np.float64)  # (N, V)
        _check_finite(logits, np.ones(len(logits), dtype=bool), length - 1, mask_fill)
        log_probs = renormalized(processed(logits.copy(), tokens, length - 1, processors))  # (N, V)
        new_running, new_sums, sources, gaps = [], np.full((batch, beams), -np.inf), [], []
        for b in range(batch):
            proposals = []  # (score, sequence, decoder row), in proposal order
            for j in range(beams):
                idx = b * beams + j
                for token in np.argsort(-log_probs[idx], kind="stable")[:beams + 1]:
                    proposals.append((sums[b, j] + log_probs[idx, token], running[b][j] + (int(token),), idx))
            order = sorted(range(len(proposals)), key=lambda k: -proposals[k][0])  # stable: ties in proposal order
            kept, ended = [], []
            for k in order:
                total, sequence, idx = proposals[k]
                if total == -np.inf:  # a banned id: no proposal
                    continue
                if sequence[-1] == eos_id:
                    ended.append((sequence, total))
                else:
                    kept.append((sequence, total, idx))
                    if len(kept) == beams:
                        break
            best = proposals[order[0]]
            kept += [(best[1], -np.inf, best[2])] * (beams - len(kept))  # slots left open
            new_running.append([sequence for sequence, _, _ in kept])
            new_sums[b] = [total for _, total, _ in kept]
            sources += [idx for _, _, idx in kept]
            for sequence, total in ended:  # best first
                if len(finished[b]) >= most:
                    break
                finished[b][sequence] = total
            if trace is not None:
                totals = np.array([[proposal[0] for proposal in proposals]])
                per_beam = log_probs[b * beams:(b + 1) * beams]
                gaps.append(min(_neighbour_gap(totals, len(proposals) - 1)[0],
                                _neighbour_gap(per_beam, beams + 1).min()))
        if trace is not None:
            trace.append({"gap": np.array(gaps), "scale": _scale(logits).reshape(batch, beams).max(axis=1)})
        running, sums, parents = new_running, new_sums, np.array(sources, dtype=np.int64)
        length += 1
        if all(len(row) >= most for row in finished) or length - 1 >= max_len:
            break
    ids = np.full((batch, max_len), pad_id, dtype=np.int64)
    scores = np.zeros(batch)
    widths = []
    for b in range(batch):
        hypotheses = list(finished[b].items())
        for j in np.argsort(-sums[b], kind="stable"):  # open beams, best first, while fewer than num_beams
            if len(hypotheses) >= beams:
                break
            if sums[b, j] > -np.inf:
                hypotheses.append((running[b][j], sums[b, j]))
        lengths = [len(seq) - 1 - prompt - (seq[-1] == eos_id) for seq, _ in hypotheses]
        ranked = np.array([total / penalty(max(n, 1), length_penalty, form)
                           for (_, total), n in zip(hypotheses, lengths)])
        chosen = int(np.argmax(ranked))
        sequence = hypotheses[chosen][0][1:]
        ids[b, :len(sequence)], scores[b] = sequence, ranked[chosen]
        widths.append(len(sequence))
        if trace is not None and len(ranked) > 1:  # the ranking decides too: at the last step
            trace[-1]["gap"][b] = min(trace[-1]["gap"][b], _neighbour_gap(ranked[None, :], len(ranked) - 1)[0])
    return ids[:, :max(widths)], scores


def renormalized(scores: np.ndarray) -> np.ndarray:
    """A log-softmax of processed scores (N, V), a row of every id banned left all -inf."""
    banned = np.isneginf(scores).all(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        return np.where(banned, -np.inf, log_softmax(scores))
