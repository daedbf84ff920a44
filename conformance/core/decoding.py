"""Decoding written once: greedy and beam search bookkeeping on the host, in float64 NumPy.

Every backend's `generate` encodes the source, then hands `search` a `step` function:

    step(tokens, parents) -> logits
        tokens  (N, t) int64, the decoder input so far (N = batch * num_beams rows)
        parents (N,) int64 or None: row i of this step continues row parents[i] of the last one;
                a backend with a KV cache reorders it by `parents` before running the new token
        logits  (N, V) the next-token logits of each row, in the backend's own dtype

`search` does everything else: log-softmax in float64, banned ids and the forced end token,
the choice of tokens, the finished-hypothesis lists, the length penalty and the stopping rule.
So the backends can only differ through their logits; in float64 they choose the same ids.
The semantics (those of Hugging Face transformers' `generate`, 5.x) are written out in
`docs/decoding.md`.

`DecoderCache` is the state a backend's cached step carries; its fields hold the backend's own
arrays.

This module is framework-free (NumPy and the standard library).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from conformance.core.errors import InputError

# Hugging Face's stand-in for "minus infinity" in beam scores (finite, so that sums stay ordered).
NEG = -1.0e9
EARLY_STOPPING = (True, False, "never")
LENGTH_PENALTY_FORMS = ("hf", "gnmt")


@dataclass
class DecoderCache:
    """The decoder's state between steps, one entry per decoder layer.

    keys, values:              self-attention keys and values of the positions so far,
                               (N, H, L, K) buffers of which the first `length` positions are filled
    cross_keys, cross_values:  the encoder memory projected once per source, (N, H, S, K)
    tgt_ids:                   (N, L) the decoder input so far (for the target padding mask)
    cross_mask:                (N, 1, 1, S) the source padding mask, or None
    length:                    how many positions are filled (an int; a 0-d array in JAX)
    """

    keys: list[Any]
    values: list[Any]
    cross_keys: list[Any]
    cross_values: list[Any]
    tgt_ids: Any
    cross_mask: Any
    length: Any = 0


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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def check_search(num_beams, length_penalty, early_stopping, use_cache, length_penalty_form, forced_eos,
                 banned_ids, return_scores, vocab_size: int) -> tuple[int, ...]:
    """The decoding options of `generate`; returns the banned ids as a tuple of ints."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
        raise InputError("num_beams", f"must be an int >= 1, got {num_beams!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float, np.floating, np.integer)) \
            or not np.isfinite(length_penalty):
        raise InputError("length_penalty", f"must be a finite number, got {length_penalty!r}")
    if not any(early_stopping is option or (isinstance(option, str) and early_stopping == option)
               for option in EARLY_STOPPING):
        raise InputError("early_stopping", f"must be True, False or \"never\", got {early_stopping!r}")
    for name, value in (("use_cache", use_cache), ("forced_eos", forced_eos), ("return_scores", return_scores)):
        if not isinstance(value, bool):
            raise InputError(name, f"must be True or False, got {value!r}")
    if length_penalty_form not in LENGTH_PENALTY_FORMS:
        raise InputError("length_penalty_form", f"must be one of {LENGTH_PENALTY_FORMS}, got {length_penalty_form!r}")
    try:
        banned = tuple(banned_ids)
    except TypeError:
        raise InputError("banned_ids", f"must be a sequence of target token ids, got {banned_ids!r}") from None
    for value in banned:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < vocab_size:
            raise InputError("banned_ids", f"must hold target token ids in [0, {vocab_size}), got {value!r}")
    return tuple(int(value) for value in banned)


def _processed(logits: np.ndarray, step: int, max_len: int, eos_id: int, banned: tuple[int, ...],
               forced_eos: bool) -> np.ndarray:
    """Hugging Face's logits processors, in its order: banned ids get -inf (`bad_words_ids`);
    at the last step every id but the end token gets -inf and the end token 0 (`forced_eos_token_id`)."""
    if banned:
        logits[:, list(banned)] = -np.inf
    if forced_eos and step == max_len - 1:
        logits[:, :] = -np.inf
        logits[:, eos_id] = 0.0
    return logits


def _check_finite(logits: np.ndarray, live: np.ndarray, step: int) -> None:
    bad = np.argwhere(np.isnan(logits[live]).any(axis=-1))
    if len(bad):
        row = int(np.flatnonzero(live)[bad[0, 0]])
        raise InputError("src_ids", f"the decoder produced NaN logits at step {step}, row {row}: an attention row "
                                    "had every key masked with mask_fill=-inf (is bos_id the pad id?)")


def search(step: Callable[[np.ndarray, np.ndarray | None], Any], batch: int, max_len: int, bos_id: int, eos_id: int,
           pad_id: int, *, num_beams: int = 1, length_penalty: float = 1.0, early_stopping: bool | str = False,
           length_penalty_form: str = "hf", forced_eos: bool = False, banned_ids: Sequence[int] = (),
           as_numpy: Callable[[Any], np.ndarray] = np.asarray,
           trace: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy (num_beams=1) or beam search. Returns the best sequence per row after `bos_id`,
    (B, n) int64 with n <= max_len, padded with `pad_id` after the end token, and its score (B,)
    float64: the summed log-probabilities divided by `penalty(length)`.

    `trace`, a list, receives per step the closest call of each source row, for the conformance
    suite: {"gap": (B,), "scale": (B,)}, the smallest score difference between two candidates
    whose order decided something (greedy: the best two tokens; beam search: neighbours among the
    ranked candidates and finished hypotheses), and max(1, largest |logit|) of the row's beams.
    """
    banned = tuple(banned_ids)
    if num_beams == 1:
        return _greedy(step, batch, max_len, bos_id, eos_id, pad_id, length_penalty, length_penalty_form,
                       forced_eos, banned, as_numpy, trace)
    return _beam(step, batch, max_len, bos_id, eos_id, pad_id, num_beams, length_penalty, early_stopping,
                 length_penalty_form, forced_eos, banned, as_numpy, trace)


def _scale(logits: np.ndarray) -> np.ndarray:
    """max(1, largest finite |logit|) per row (the magnitude the tolerance table's atol scales)."""
    finite = np.where(np.isfinite(logits), np.abs(logits), 0.0)
    return np.maximum(1.0, finite.max(axis=-1))


def _neighbour_gap(scores: np.ndarray, k: int) -> np.ndarray:
    """Smallest difference between neighbours among the k + 1 best finite scores per row."""
    ranked = -np.sort(-scores, axis=1)[:, :k + 1]
    gaps = np.where(np.isfinite(ranked[:, :-1]) & np.isfinite(ranked[:, 1:]) & (ranked[:, 1:] > NEG / 2),
                    ranked[:, :-1] - ranked[:, 1:], np.inf)
    return gaps.min(axis=1)


def _greedy(step, batch, max_len, bos_id, eos_id, pad_id, length_penalty, form, forced_eos, banned, as_numpy,
            trace=None):
    tokens = np.full((batch, 1), bos_id, dtype=np.int64)  # (B, 1)
    done = np.zeros(batch, dtype=bool)
    summed = np.zeros(batch)
    lengths = np.zeros(batch, dtype=np.int64)
    for i in range(max_len):
        logits = np.array(as_numpy(step(tokens, None)), dtype=np.float64)  # (B, V)
        _check_finite(logits, ~done, i)
        log_probs = _processed(log_softmax(logits), i, max_len, eos_id, banned, forced_eos)
        if trace is not None:
            trace.append({"gap": np.where(done, np.inf, _neighbour_gap(log_probs, 1)), "scale": _scale(logits)})
        logits = _processed(logits, i, max_len, eos_id, banned, forced_eos)
        # The choice reads the logits, as Hugging Face's greedy search does (same argmax, fewer roundings).
        next_id = np.where(done, pad_id, logits.argmax(-1))  # (B,)
        summed += np.where(done, 0.0, log_probs[np.arange(batch), next_id])
        lengths += ~done
        tokens = np.concatenate([tokens, next_id[:, None]], axis=1)  # (B, t + 1)
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


def _beam(step, batch, max_len, bos_id, eos_id, pad_id, num_beams, length_penalty, early_stopping, form,
          forced_eos, banned, as_numpy, trace=None):
    beams, keep = num_beams, 2 * num_beams  # 2 x beams candidates, so that beams stay open after ends
    width = max_len + 1  # the start token and at most max_len generated ones
    running = np.full((batch, beams, width), pad_id, dtype=np.int64)  # (B, beams, 1 + max_len)
    running[:, :, 0] = bos_id
    running_scores = np.zeros((batch, beams))
    running_scores[:, 1:] = NEG  # every beam starts as a copy of the first: only its candidates count
    finished = running.copy()
    finished_scores = np.full((batch, beams), NEG)
    finished_lengths = np.zeros((batch, beams), dtype=np.int64)
    is_finished = np.zeros((batch, beams), dtype=bool)
    improvable = np.ones(batch, dtype=bool)  # Hugging Face's is_early_stop_heuristic_unsatisfied
    parents = None
    length = 1  # decoder input length, the start token included
    top_rank = np.arange(keep) < beams
    while True:
        tokens = running[:, :, :length].reshape(batch * beams, length)  # (N, t)
        logits = np.array(as_numpy(step(tokens, parents)), dtype=np.float64)  # (N, V)
        _check_finite(logits, np.ones(len(logits), dtype=bool), length - 1)
        vocab = logits.shape[-1]
        log_probs = _processed(log_softmax(logits), length - 1, max_len, eos_id, banned, forced_eos)
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
        scored = candidate_scores / penalty(length, length_penalty, form)
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
        guess = max_len if (early_stopping == "never" and not isinstance(early_stopping, bool)
                            and length_penalty > 0) else length - 1
        best_open = running_scores[:, 0] / penalty(guess, length_penalty, form)  # (B,)
        worst = np.where(is_finished, finished_scores.min(axis=1, keepdims=True), NEG)
        improvable &= (best_open[:, None] > worst).any(axis=1)
        if not improvable.any() or (is_finished.all() and early_stopping is True) or ends.all():
            break
    n = int(finished_lengths[:, 0].max())
    return finished[:, 0, 1:1 + n], finished_scores[:, 0]
