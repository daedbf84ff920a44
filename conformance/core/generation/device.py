"""The search on the device: greedy search, beam search (Hugging Face's rule and Flax's) and
sampling, written once as pure functions over a small array adapter, so that each backend runs
them in its own arrays (NumPy, torch, jax.numpy).

`conformance.core.generation.search.search` is the readable float64 reference and the oracle; this module
is the same rules (docs/decoding.md) in the shape Hugging Face, Flax `examples/wmt` and t5x give
them for speed: a log-softmax in the search dtype (float32, or float64 for a float64 model), a
top-k of 2 x beams over beams x V, gathers, and the rows the KV cache must follow as an index
array. Nothing leaves the device inside a step; a driver reads one small flag per step (torch,
NumPy) or runs the whole search in one `lax.while_loop` (JAX).

Every function takes the adapter `ops` (see `NumpyOps`: `xp`, the framework's array namespace,
plus the few operations whose spelling differs), a `Rules` of static settings, and the search
state as a dict of arrays (a pytree for JAX). The step counter may be a Python int (the eager
drivers) or a traced scalar (JAX): columns are written with `where` against an `arange`, never by
item assignment, so the same code traces.

The ids equal the reference's in float64 bit for bit in every operation that decides an order:
the same formulas in the same order (log-softmax as shifted - log(sum(exp(shifted))), the same
additions of NEG, the same division by the penalty), and top-k keeps the lower index first among
equal scores, as the reference's stable argsort does. In float32 they differ only where the
reference had a near-tie (the suite's generate property).

This module is framework-free (NumPy and the standard library); the torch and JAX adapters live
in `impl_torch/decode.py` and `impl_jax/decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.core.generation.pipeline import (VALUE_KEYS, data_of, late, penalized_by, penalties,
                                                  read_column)
from conformance.core.generation.search import NEG, nan_error  # nan_error: the reference's, for every driver

State = dict[str, Any]


@dataclass(frozen=True)
class Rules:
    """The static settings of one search (a new value is a new JAX program; the length penalty,
    the ids, the banned mask, the forced first id, the minimum length and the bad-word table are
    data, not rules).

    max_len:          the most generated tokens
    num_beams:        1 for greedy
    early_stopping:   True, False or "never" (docs/decoding.md, "Beam search")
    form:             the length penalty's form, "hf" or "gnmt"
    forced_eos:       the last allowed step may produce only the end token
    rule:             the beam rule, "hf" or "flax" (docs/decoding.md, "Two beam rules")
    do_sample:        sampling instead of the arg-max (its temperature, top_k, top_p and
                      uniforms are data: `sampling_data`)
    no_repeat_ngram_size:  n of the no-repeated-n-gram rule, 0 for off (it sets the shape of the
                      windows compared)
    encoder_no_repeat_ngram_size:  n of the source's n-gram rule, 0 for off (the same)
    renormalize:      a log-softmax after every other processor (renormalize_logits)
    candidates:       rule "openai": the finished hypotheses a row waits for,
                      round(num_beams x patience) (the shape of its finished list)

    Whisper's forced prompt, timestamp rules and no-speech probability are data
    (`pipeline.data_of`): one program serves every prompt, timestamp range and bound.
    """

    max_len: int
    num_beams: int = 1
    early_stopping: bool | str = False
    form: str = "hf"
    forced_eos: bool = False
    rule: str = "hf"
    do_sample: bool = False
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    renormalize: bool = False
    candidates: int = 0

    @property
    def kind(self) -> str:
        """Which search: "sample", "flax" (Flax's beam rule, any number of beams), "openai"
        (openai-whisper's), "beam" (Hugging Face's) or "greedy"."""
        if self.do_sample:
            return "sample"
        if self.rule in ("flax", "openai"):
            return self.rule
        return "beam" if self.num_beams > 1 else "greedy"

    @property
    def beams(self) -> bool:
        """Whether the state is a beam search's (running and finished hypotheses per row)."""
        return self.kind in ("beam", "flax", "openai")

    @property
    def never(self) -> bool:
        return self.early_stopping == "never" and not isinstance(self.early_stopping, bool)

    @property
    def stop_when_full(self) -> bool:
        return self.early_stopping is True


class NumpyOps:
    """The array operations the search needs beyond what NumPy, torch and jax.numpy spell alike.

    An adapter holds `xp` (the namespace), `int_dtype`, and: `top_k(x, k)` -> (values, indices)
    along the last axis, best first, ties to the lower index; `sort(x)` -> (values, indices) along
    the last axis, ascending, ties to the lower index first; `cumsum(x)` along the last axis;
    `divide(x, y)`, x / y as one rounded division per element (y a number or of x's shape: the
    length penalty); `take(x, index)` gathers x (B, M, ...) along axis 1 by index (B, k);
    `cast(x, dtype)`; `full(shape, value, dtype)`; `arange(n)`;
    `concat(arrays)` along axis 1; `reduce(name, x, axis)` for max, min, sum, any, all; `argmax(x)`
    along the last axis (first of equal maxima); `where(c, a, b)`, also for a Python bool `c`;
    `mark(index, size)`: (N, size) bool, True at each row's ids index (N, M) (a scatter);
    `ban(scores, banned, owned)`: scores with -inf where `banned` ((V,) or scores' shape) is True;
    `accumulate(owned, other)`: owned + other. `owned` says the search made that array itself in
    this step (a log-softmax), so an adapter may write the result into it; these two default to
    the functional `where` and `+`, which an adapter may replace by in-place writes of the same
    values. `cond(condition, if_true, if_false)`: the result of one of the two functions (the
    forced prompt's steps or the search's)."""

    xp = np
    int_dtype = np.int64
    bool_dtype = np.bool_

    def top_k(self, x, k: int):
        index = np.argsort(-x, axis=-1, kind="stable")[..., :k]
        return np.take_along_axis(x, index, axis=-1), index

    def sort(self, x):
        index = np.argsort(x, axis=-1, kind="stable")
        return np.take_along_axis(x, index, axis=-1), index

    def cumsum(self, x):
        return np.cumsum(x, axis=-1)

    def divide(self, x, y):
        return x / y

    def take(self, x, index):
        return np.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)

    def cast(self, x, dtype):
        return np.asarray(x).astype(dtype, copy=False)

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype=dtype)

    def arange(self, n: int):
        return np.arange(n)

    def concat(self, arrays):
        return np.concatenate(arrays, axis=1)

    def reduce(self, name: str, x, axis=None, keepdims: bool = False):
        return getattr(np, name)(x, axis=axis, keepdims=keepdims)

    def argmax(self, x):
        return np.argmax(x, axis=-1)

    def where(self, condition, a, b):
        if isinstance(condition, bool):
            return a if condition else b
        return np.where(condition, a, b)

    def mark(self, index, size: int):
        out = np.zeros((index.shape[0], size), dtype=bool)
        np.put_along_axis(out, index, True, axis=-1)
        return out

    def ban(self, scores, banned, owned: bool):
        return self.xp.where(banned, -np.inf, scores)

    def accumulate(self, owned, other):
        return owned + other

    def cond(self, condition, if_true, if_false):
        """if_true() where `condition` holds, else if_false(): a Python branch here; a traced
        condition runs one of the two on the device (JAX's lax.cond)."""
        return if_true() if condition else if_false()


# -- Shared rules -------------------------------------------------------------------------------


def penalty(ops, length, length_penalty, form: str, dtype):
    """`conformance.core.generation.search.penalty` in the search dtype: hf length ** a, gnmt ((5 + length) / 6) ** a."""
    length = ops.cast(length, dtype)
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** length_penalty
    return length ** length_penalty


def penalized(ops, scores, length, length_penalty, form: str, dtype):
    """scores / `penalty` of length (a number, or an array of scores' shape): the reference's
    quotient, bit for bit (`ops.divide`)."""
    return ops.divide(scores, penalty(ops, length, length_penalty, form, dtype))


def log_softmax(ops, logits):
    """log softmax over the last axis, in the logits' dtype (the reference's formula, unless the
    adapter has a fused one: `ops.log_softmax`)."""
    fused = getattr(ops, "log_softmax", None)
    if fused is not None:
        return fused(logits)
    xp = ops.xp
    shifted = logits - ops.reduce("max", logits, axis=-1, keepdims=True)
    return shifted - xp.log(ops.reduce("sum", xp.exp(shifted), axis=-1, keepdims=True))


def processed(ops, rules: Rules, scores, step, banned, eos_id, forced_bos=None, owned: bool = False, data=None,
              seen=(), tokens=None):
    """Hugging Face's logits processors in its order (the reference's `processed`): the
    repetition penalties `seen` (`pipeline.penalties`, worked out once a step); `banned` (V,) or
    (N, V) bool (`bans`: banned ids, repeated n-grams of the output or the source, bad words, the
    end token below the minimum length) gets -inf; with a `forced_bos` id, at the first step every
    other id gets -inf and it 0; with forced_eos, at the last step every id but eos gets -inf, eos
    0; then `pipeline.late` (the end token's decay, the suppressed ids, Whisper's timestamp rules
    over the decoder input buffer `tokens` (N, W), from `data`) and, with rules.renormalize, a
    log-softmax. `owned`: scores is the step's own array (`ops.ban`)."""
    xp = ops.xp
    if seen:  # a penalty (the step's own array from here on)
        scores, owned = penalized_by(ops, scores, seen), True
    scores = ops.ban(scores, banned, owned)
    if forced_bos is not None:
        is_forced = ops.arange(scores.shape[-1]) == forced_bos
        scores = ops.where(step == 0, xp.where(is_forced, 0.0, xp.full_like(scores, -np.inf)), scores)
    if rules.forced_eos:
        last = step == rules.max_len - 1
        is_eos = ops.arange(scores.shape[-1]) == eos_id
        scores = ops.where(last, xp.where(is_eos, 0.0, xp.full_like(scores, -np.inf)), scores)
    scores = late(ops, rules, scores, step, data, eos_id, tokens)
    return renormalized(ops, scores) if rules.renormalize else scores


def renormalized(ops, scores):
    """The reference's `renormalize`: a log-softmax, a row with every id banned left all -inf."""
    banned = ops.reduce("max", scores, axis=-1, keepdims=True) == -np.inf  # (N, 1)
    with np.errstate(invalid="ignore"):  # NumPy: -inf - -inf in those rows, replaced
        return ops.xp.where(banned, -np.inf, log_softmax(ops, scores))


def whole_row(rules: Rules, data) -> bool:
    """Whether a processor changes scores other than by the bans and forced tokens that
    `processed_at` reads at the chosen ids alone (a penalty, the decay, a late ban, the
    renormalization): greedy search then reads its scores from the whole processed row."""
    return rules.renormalize or (data is not None and any(key in data for key in VALUE_KEYS))


def first_nan_row(ops, logits, live, bad):
    """The search's record of NaN logits: `bad` stays the first (step-ordered) NaN row of an open
    row, -1 while there is none (the driver raises the reference's NaNLogitsError from it, `decoding.nan_error`).

    A row holds a NaN exactly when its max is NaN: NumPy's, torch's and JAX's max propagate NaN
    (and +inf beside -inf is +inf, not NaN). One reduction, where isnan then any is a (N, V) mask
    and a second pass."""
    xp = ops.xp
    nan_rows = xp.isnan(ops.reduce("max", logits, axis=-1)) & live  # (N,)
    n = nan_rows.shape[0]
    first = ops.reduce("min", xp.where(nan_rows, ops.arange(n), n))
    return xp.where((bad < 0) & (first < n), first, bad)


def processed_at(ops, rules: Rules, values, ids, step, banned, eos_id, forced_bos=None):
    """`processed` of a (B, V) array, read at ids (B,) only: values (B,) are that array's entries
    at ids. The processors act on each entry alone, so this is the same number, without a pass
    over the whole vocabulary."""
    xp = ops.xp
    hit = banned[ids] if banned.ndim == 1 else ops.take(banned, ids[:, None])[:, 0]  # (B,)
    values = xp.where(hit, -np.inf, values)
    if forced_bos is not None:
        values = ops.where(step == 0, xp.where(ids == forced_bos, 0.0, -np.inf), values)
    if rules.forced_eos:
        last = step == rules.max_len - 1
        values = ops.where(last, xp.where(ids == eos_id, 0.0, -np.inf), values)
    return values


def write_column(ops, array, column, values):
    """array (..., W) with column `column` replaced by values (...): a `where`, so it traces."""
    return ops.xp.where(ops.arange(array.shape[-1]) == column, values[..., None], array)


# -- The processors that read the tokens --------------------------------------------------------


def processor_data(settings, as_array, src_ids=None, vocab_size: int | None = None) -> dict | None:
    """What the processors read besides the logits and the tokens, as data (so that JAX compiles
    one program for every forced id, every minimum length and every bad-word table of one shape):
    "forced_bos", the forced first id; "min_steps", the steps before which the end token is banned
    (`min_steps`: min_length and min_new_tokens in one number); "bad_prefixes" (M, P) and
    "bad_last" (M,), the bad words of two tokens or more (`bad_words_table`); and the penalties,
    the source's ids, the decay and the suppressed ids (`pipeline.data_of`, which reads `src_ids`
    (B, S) and `vocab_size`), each passed through `as_array(name, value)` (a Python int, or a NumPy
    array: float64 ones go to the search dtype, int64 to the backend's ids). None when `settings`
    (a `decoding.Generation`) has none of them; an entry that is off is left out."""
    data = data_of(settings, as_array, src_ids, vocab_size)
    if settings.forced_bos_id is not None:
        data["forced_bos"] = as_array("forced_bos", settings.forced_bos_id)
    if min_steps(settings):
        data["min_steps"] = as_array("min_steps", min_steps(settings))
    if settings.bad_words_ids:
        prefixes, last = bad_words_table(settings.bad_words_ids)
        data["bad_prefixes"], data["bad_last"] = as_array("bad_prefixes", prefixes), as_array("bad_last", last)
    return data or None


def min_steps(settings) -> int:
    """The first step at which the end token may be chosen: the reference's `Processors.bans_eos`
    (the end token is banned at step s while s + 1 < min_length or s - P < min_new_tokens, P the
    forced prompt's length) as one number, max(min_length - 1, min_new_tokens + P); 0 when
    neither rule bites."""
    new_tokens = settings.min_new_tokens + settings.prompt_len if settings.min_new_tokens else 0
    return max(settings.min_length - 1, new_tokens, 0)


def bad_words_table(words) -> tuple[np.ndarray, np.ndarray]:
    """Words of two tokens or more as arrays: their prefixes (M, P), right-aligned (the token
    before the last at column P - 1) with -1 before a shorter word's start, and their last
    tokens (M,), int64."""
    longest = max(len(word) - 1 for word in words)
    prefixes = np.full((len(words), longest), -1, dtype=np.int64)
    for m, word in enumerate(words):
        prefixes[m, longest - len(word) + 1:] = word[:-1]
    return prefixes, np.array([word[-1] for word in words], dtype=np.int64)


def bans(ops, rules: Rules, tokens, length, banned, data, eos_id=None):
    """The ids each row may not take next: `banned` (V,) alone when no rule reads the tokens,
    else (N, V) with the reference's `repeated_ngram_bans` and `bad_word_bans` added, and the end
    token `eos_id` while the decoder input is shorter than the minimum length (data "min_steps").
    tokens (N, W) is the decoder input buffer, its first `length` columns written (the start token
    first). Every ban is an -inf, so their order does not matter: the forced tokens come after."""
    n, vocab = rules.no_repeat_ngram_size, banned.shape[-1]
    if n and n <= tokens.shape[1]:  # a window longer than the buffer never fills
        banned = banned | repeated_ngrams(ops, tokens, length, n, vocab)
    if rules.encoder_no_repeat_ngram_size:
        banned = banned | source_ngrams(ops, tokens, length, data["encoder_ids"], rules.encoder_no_repeat_ngram_size,
                                        vocab)
    if data is not None and "bad_prefixes" in data:
        banned = banned | bad_word_completions(ops, tokens, length, data["bad_prefixes"], data["bad_last"], vocab)
    if data is not None and "min_steps" in data:  # the step is length - 1
        banned = banned | ((ops.arange(vocab) == eos_id) & (length - 1 < data["min_steps"]))
    return banned


def last_columns(ops, tokens, length, count: int):
    """(N, count): the `count` columns of tokens (N, W) before column `length` (a Python int or
    traced), and (count,) whether each exists (a column before the first is read as column 0)."""
    columns = ops.arange(count) + (length - count)  # (count,)
    exists = columns >= 0
    index = ops.full((tokens.shape[0], count), 0, ops.int_dtype) + ops.xp.where(exists, columns, 0)
    return ops.take(tokens, index), exists


def repeated_ngrams(ops, tokens, length, n: int, vocab: int):
    """(N, V) the reference's `repeated_ngram_bans`, with static shapes: every window of n columns
    of the buffer (N, W) that lies within the first `length` columns and whose first n - 1
    tokens are the row's last n - 1 bans its last token (HF's unfold, on the whole buffer)."""
    xp = ops.xp
    windows = tokens.shape[1] - n + 1  # J windows of n columns in the buffer
    match = ops.arange(windows) <= length - n  # (J,): within the decoder input so far
    if n > 1:
        suffix, _ = last_columns(ops, tokens, length, n - 1)  # (N, n - 1); read only if length >= n
        for k in range(n - 1):
            match = match & (tokens[:, k:k + windows] == suffix[:, k:k + 1])  # (N, J)
    banned = xp.where(match, tokens[:, n - 1:n - 1 + windows], vocab)  # (N, J): vocab is no id
    return ops.mark(banned, vocab + 1)[:, :vocab]


def source_ngrams(ops, tokens, length, sources, n: int, vocab: int):
    """(N, V) the reference's `source_ngram_bans`: every window of n ids of the row's source (N, S)
    whose first n - 1 are the last n - 1 of the first `length` columns of tokens (N, W) bans its
    last id (transformers' EncoderNoRepeatNGramLogitsProcessor); none before the decoder input
    holds n - 1 tokens; n = 1 bans every id of the source."""
    xp = ops.xp
    windows = sources.shape[1] - n + 1  # J windows of n ids in the source
    if windows < 1:  # a source shorter than n has no n-gram
        return ops.full((tokens.shape[0], vocab), False, ops.bool_dtype)
    match = ops.full((tokens.shape[0], windows), True, ops.bool_dtype)
    if n > 1:
        suffix, _ = last_columns(ops, tokens, length, n - 1)  # (N, n - 1); read only if length >= n - 1
        for k in range(n - 1):
            match = match & (sources[:, k:k + windows] == suffix[:, k:k + 1])  # (N, J)
        match = ops.where(length >= n - 1, match, xp.zeros_like(match))
    last = sources[:, n - 1:n - 1 + windows]  # (N, J)
    banned = xp.where(match & (last < vocab), last, vocab)  # vocab is no id (nor a source-only id)
    return ops.mark(banned, vocab + 1)[:, :vocab]


def bad_word_completions(ops, tokens, length, prefixes, last, vocab: int):
    """(N, V) the reference's `bad_word_bans`: the last token of every word (prefixes (M, P) from
    `bad_words_table`, last (M,)) whose prefix ends the first `length` columns of tokens (N, W);
    a prefix longer than those never matches."""
    xp = ops.xp
    seen, exists = last_columns(ops, tokens, length, prefixes.shape[1])  # (N, P), (P,)
    agree = (seen[:, None, :] == prefixes[None, :, :]) & exists  # (N, M, P)
    match = ops.reduce("all", agree | (prefixes < 0), axis=-1)  # (N, M)
    return ops.mark(xp.where(match, last, vocab), vocab + 1)[:, :vocab]


# -- Greedy -------------------------------------------------------------------------------------


def greedy_start(ops, rules: Rules, batch: int, bos_id, pad_id, dtype) -> State:
    """The state before the first step: every row holds the start token."""
    xp = ops.xp
    tokens = ops.full((batch, rules.max_len + 1), pad_id, ops.int_dtype)  # (B, 1 + max_len)
    tokens = write_column(ops, tokens, 0, ops.full((batch,), bos_id, ops.int_dtype))
    return {"tokens": tokens, "done": ops.full((batch,), False, ops.bool_dtype),
            "summed": ops.full((batch,), 0.0, dtype), "lengths": ops.full((batch,), 0, ops.int_dtype),
            "step": 0, "stop": xp.asarray(False), "bad": xp.asarray(-1)}


def greedy_update(ops, rules: Rules, state: State, logits, banned, eos_id, pad_id, sampling=None,
                  scores: bool = True, data=None) -> State:
    """One step: each open row appends the arg-max of its processed logits (the reference's
    `_greedy` loop body), or with `sampling` (`sampling_data`) the id it draws from them (the
    reference's `_sample` loop body); `logits` (B, V) already in the search dtype; `data`:
    `processor_data`.

    `scores` False (a Python bool: the eager drivers, when the caller does not want the scores)
    skips the log-softmax, which only the scores read: the ids are the same, "summed" stays 0."""
    xp = ops.xp
    i, done = state["step"], state["done"]
    bad = first_nan_row(ops, logits, ~done, state["bad"])
    summed = state["summed"]
    vocab = logits.shape[-1]
    seen = penalties(ops, state["tokens"], i + 1, data, vocab)  # the penalties: once, for logits and scores
    banned = bans(ops, rules, state["tokens"], i + 1, banned, data, eos_id)
    forced_bos = None if data is None else data.get("forced_bos")
    processed_logits = processed(ops, rules, logits, i, banned, eos_id, forced_bos, data=data, seen=seen,
                                 tokens=state["tokens"])
    if sampling is None:
        chosen = ops.argmax(processed_logits)  # (B,): the logits' arg-max, as HF
    else:
        warped = warp(ops, processed_logits, sampling["temperature"], sampling["top_k"], sampling["top_p"])
        chosen = draw(ops, xp.exp(log_softmax(ops, warped)), sampling["uniforms"][i])  # (B,)
    next_id = xp.where(done, pad_id, chosen)
    if scores and whole_row(rules, data):  # the processed log-probability of each chosen id, from its row
        row = processed(ops, rules, log_softmax(ops, logits), i, banned, eos_id, forced_bos, owned=True, data=data,
                        seen=seen, tokens=state["tokens"])
        summed = summed + xp.where(done, 0.0, ops.take(row, next_id[:, None])[:, 0])
    elif scores:  # the processed log-probability of each chosen id
        picked = ops.take(log_softmax(ops, logits), next_id[:, None])[:, 0]
        summed = summed + xp.where(done, 0.0, processed_at(ops, rules, picked, next_id, i, banned, eos_id, forced_bos))
    lengths = state["lengths"] + ops.cast(~done, ops.int_dtype)
    tokens = write_column(ops, state["tokens"], i + 1, next_id)
    done = done | (next_id == eos_id)
    step = i + 1
    stop = ops.reduce("all", done) | (step >= rules.max_len) | (bad >= 0)
    return {"tokens": tokens, "done": done, "summed": summed, "lengths": lengths, "step": step,
            "stop": stop, "bad": bad}


def greedy_newest(ops, state: State):
    """The tokens the next step feeds the decoder (B,): each row's newest."""
    return read_column(ops, state["tokens"], state["step"])


def greedy_result(ops, rules: Rules, state: State, length_penalty, steps: int, dtype):
    """(ids (B, steps), scores (B,)) once the search stopped after `steps` steps (a host int)."""
    scores = penalized(ops, state["summed"], state["lengths"], length_penalty, rules.form, dtype)
    return state["tokens"][:, 1:1 + steps], scores


# -- Sampling -----------------------------------------------------------------------------------


def sampling_data(settings, uniforms, as_array) -> dict | None:
    """What sampling reads besides the logits, as data (so that JAX compiles one program for every
    temperature, top_k, top_p and seed): the uniforms (max_len, N) from
    `conformance.core.generation.search.uniforms`, and the warpers' settings, each passed through
    `as_array` (the identity for the eager drivers, which then skip a filter that is off; a 0-d
    array for JAX). None when `settings` (a `decoding.Generation`) does not sample."""
    if not settings.do_sample:
        return None
    return {"uniforms": as_array("uniforms", uniforms), "temperature": as_array("temperature", settings.temperature),
            "top_k": as_array("top_k", settings.top_k), "top_p": as_array("top_p", settings.top_p)}


def warp(ops, scores, temperature, top_k, top_p):
    """The reference's `warp` (Hugging Face's temperature, top-k and top-p warpers) on scores
    (N, V). top_k and top_p may be Python numbers (a filter that is off is skipped) or traced
    scalars (both filters are computed, and kept where on).

    One stable ascending sort serves both filters. top-k's threshold is the k-th best score. The
    reference sorts the top-k filtered scores again for top-p; as values that sorted row is this
    one with every score below the threshold at -inf (those form its prefix, and the scores kept
    keep their order), and top-p removes a prefix of it at least that long (a -inf has
    cumulative probability 0). So the first id kept is at the same place of both sorts, and an id
    is kept when it is after that one in (score, index) order: no scatter back is needed."""
    xp = ops.xp
    scores = scores / temperature  # the reference skips a temperature of 1: x / 1 is x
    on_k, on_p = top_k > 0, top_p < 1.0
    if on_k is False and on_p is False:
        return scores
    rows, vocab = scores.shape
    ascending, order = ops.sort(scores)  # (N, V)
    at = ops.full((rows, 1), vocab, ops.int_dtype) - top_k  # where the k-th best sits, ascending
    at = xp.where(at < 0, 0, xp.where(at > vocab - 1, vocab - 1, at))  # top_k > V keeps all
    kth = ops.where(on_k, ops.take(ascending, at), -np.inf)  # (N, 1)
    scores = xp.where(scores < kth, -np.inf, scores)  # ties with the k-th stay
    if on_p is False:
        return scores
    kept = xp.where(ascending < kth, -np.inf, ascending)  # the reference's sorted top-k filtered scores
    cumulative = ops.cumsum(xp.exp(log_softmax(ops, kept)))
    remove = (cumulative <= 1 - top_p) & (ops.arange(vocab) < vocab - 1)  # a prefix; the best id stays
    first = ops.cast(ops.reduce("sum", ops.cast(remove, ops.int_dtype), axis=-1, keepdims=True), ops.int_dtype)
    first_score, first_id = ops.take(kept, first), ops.take(order, first)  # (N, 1): the first id kept
    keep = (scores > first_score) | ((scores == first_score) & (ops.arange(vocab) >= first_id))
    return ops.where(on_p, xp.where(keep, scores, -np.inf), scores)


def draw(ops, probs, uniforms):
    """The reference's `draw`: per row, the first id whose cumulative probability exceeds u times
    the total. An id at the very top (u x total rounded up to the total) is the last id of
    positive probability, never one past the vocabulary."""
    cumulative = ops.cumsum(probs)  # (N, V)
    total = cumulative[:, -1:]
    below = (cumulative <= uniforms[:, None] * total) & (cumulative < total)
    return ops.cast(ops.reduce("sum", ops.cast(below, ops.int_dtype), axis=-1), ops.int_dtype)


# -- Beam search ---------------------------------------------------------------------------------


def beam_start(ops, rules: Rules, batch: int, bos_id, pad_id, dtype) -> State:
    """The state before the first step: `beams` copies of the start token per row, of which only
    the first counts (the others start at NEG)."""
    xp = ops.xp
    beams, width = rules.num_beams, rules.max_len + 1
    running = ops.full((batch, beams, width), pad_id, ops.int_dtype)  # (B, beams, 1 + max_len)
    running = write_column(ops, running, 0, ops.full((batch, beams), bos_id, ops.int_dtype))
    first = ops.arange(beams) == 0
    return {"running": running,
            "running_scores": xp.where(first, 0.0, NEG) + ops.full((batch, beams), 0.0, dtype),
            "finished": running, "finished_scores": ops.full((batch, beams), NEG, dtype),
            "finished_lengths": ops.full((batch, beams), 0, ops.int_dtype),
            "is_finished": ops.full((batch, beams), False, ops.bool_dtype),
            "improvable": ops.full((batch,), True, ops.bool_dtype),
            "parents": ops.arange(batch * beams),
            "length": 1, "stop": xp.asarray(False), "bad": xp.asarray(-1)}


def beam_inputs(ops, rules: Rules, state: State, logits, banned, eos_id, data=None):
    """What a beam step reads before it processes the logits, for both beam rules: the row of a NaN
    logit (`bad`), the beams' tokens (N, W), the ids the penalties see, the bans this step, and the
    forced first id (or None)."""
    xp = ops.xp
    running, length = state["running"], state["length"]
    batch, beams = state["running_scores"].shape
    bad = first_nan_row(ops, logits, ops.full((batch * beams,), True, ops.bool_dtype), state["bad"])
    tokens = xp.reshape(running, (batch * beams, running.shape[-1]))  # (N, W)
    seen = penalties(ops, tokens, length, data, logits.shape[-1])
    banned = bans(ops, rules, tokens, length, banned, data, eos_id)
    forced_bos = None if data is None else data.get("forced_bos")
    return bad, tokens, seen, banned, forced_bos


def expand(ops, rules: Rules, state: State, logits, banned, eos_id, data=None):
    """What both beam rules do first: the row of a NaN logit (`bad`), then the best 2 x beams
    continuations over all beams of each row: their scores and parent beams, their tokens, and the
    running sequences they extend with those tokens written at `length` (B, 2 x beams, width)."""
    xp = ops.xp
    running, running_scores, length = state["running"], state["running_scores"], state["length"]
    batch, beams = running_scores.shape
    vocab = logits.shape[-1]
    bad, tokens, seen, banned, forced_bos = beam_inputs(ops, rules, state, logits, banned, eos_id, data)
    # The log-softmax is this step's own array, and so is every array `processed` returns from it.
    log_probs = processed(ops, rules, log_softmax(ops, logits), length - 1, banned, eos_id, forced_bos, owned=True,
                          data=data, seen=seen, tokens=tokens)
    totals = xp.reshape(ops.accumulate(xp.reshape(log_probs, (batch, beams, vocab)), running_scores[:, :, None]),
                        (batch, beams * vocab))
    candidate_scores, candidates = ops.top_k(totals, 2 * beams)  # (B, 2 x beams)
    parent_beam, token = candidates // vocab, candidates % vocab
    sequences = write_column(ops, ops.take(running, parent_beam), length, token)  # (B, keep, width)
    return bad, candidate_scores, parent_beam, token, sequences


def beam_update(ops, rules: Rules, state: State, logits, banned, eos_id, length_penalty, data=None) -> State:
    """One step of the reference's `_beam` loop, on the device. `logits` (N, V), N = B x beams,
    in the search dtype; the new state's `parents` (N,) are the rows the KV cache must follow."""
    xp = ops.xp
    running_scores, length = state["running_scores"], state["length"]
    batch, beams = running_scores.shape
    keep, width = 2 * beams, rules.max_len + 1
    dtype = running_scores.dtype
    bad, candidate_scores, parent_beam, token, sequences = expand(ops, rules, state, logits, banned, eos_id, data)
    ends = (token == eos_id) | (length + 1 >= width)

    # The best `beams` that did not end stay open.
    open_scores = candidate_scores + xp.where(ends, NEG, 0.0)
    running_scores, chosen = ops.top_k(open_scores, beams)
    running = ops.take(sequences, chosen)
    parents = xp.reshape(ops.arange(batch)[:, None] * beams + ops.take(parent_beam[:, :, None], chosen)[:, :, 0],
                         (batch * beams,))

    # Endings among the best `beams` candidates join the finished list, scored with the penalty,
    # unless the row is full (early_stopping=True) or can no longer improve.
    is_finished, improvable = state["is_finished"], state["improvable"]
    prompt = prompt_of(data)  # the lengths count after the forced prompt
    scored = penalized(ops, candidate_scores, length - prompt, length_penalty, rules.form, dtype)
    full = ops.reduce("all", is_finished, axis=1) & rules.stop_when_full
    just_ended = ends & (ops.arange(keep) < beams)
    scored = scored + xp.where(full | ~improvable, NEG, 0.0)[:, None] + xp.where(~just_ended, NEG, 0.0)
    merged = ops.concat([state["finished_scores"], scored])
    finished_scores, best = ops.top_k(merged, beams)
    finished = ops.take(ops.concat([state["finished"], sequences]), best)
    lengths = ops.concat([state["finished_lengths"], ops.full((batch, keep), 0, ops.int_dtype) + length])
    finished_lengths = ops.take(lengths[:, :, None], best)[:, :, 0]
    is_finished = ops.take(ops.concat([is_finished, just_ended])[:, :, None], best)[:, :, 0]

    length = length + 1
    # The length an open beam's best score is guessed at (docs/decoding.md, step 5).
    guess = ops.where(length_penalty > 0, rules.max_len, length - 1) if rules.never else length - 1
    best_open = penalized(ops, running_scores[:, 0], guess - prompt, length_penalty, rules.form, dtype)  # (B,)
    worst = xp.where(is_finished, ops.reduce("min", finished_scores, axis=1, keepdims=True), NEG)
    improvable = improvable & ops.reduce("any", best_open[:, None] > worst, axis=1)
    stop = (~ops.reduce("any", improvable)) | (ops.reduce("all", is_finished) & rules.stop_when_full) \
        | ops.reduce("all", ends) | (bad >= 0)
    return {"running": running, "running_scores": running_scores, "finished": finished,
            "finished_scores": finished_scores, "finished_lengths": finished_lengths, "is_finished": is_finished,
            "improvable": improvable, "parents": parents, "length": length, "stop": stop, "bad": bad}


def beam_newest(ops, state: State):
    """The tokens the next step feeds the decoder (N,): each open beam's newest."""
    running = state["running"]
    return ops.xp.reshape(read_column(ops, running, state["length"] - 1), (running.shape[0] * running.shape[1],))


def beam_width(ops, state: State, returned: int = 1):
    """How many generated tokens the result holds: the longest of the `returned` best hypotheses
    of every row (a 0-d array)."""
    return ops.reduce("max", state["finished_lengths"][:, :returned])


def beam_result(ops, state: State, width: int, returned: int = 1):
    """(ids (B x returned, width), scores (B x returned,)): each row's `returned` best finished
    hypotheses after the start token, best first."""
    finished = state["finished"]
    batch = finished.shape[0]
    return (ops.xp.reshape(finished[:, :returned, 1:1 + width], (batch * returned, width)),
            ops.xp.reshape(state["finished_scores"][:, :returned], (batch * returned,)))


# -- Flax's beam rule ----------------------------------------------------------------------------
# Flax examples/wmt `decode.beam_search` (t5x, MLCommons AlgoPerf): the reference's `_beam_flax`.
# The state is beam search's (`beam_start`); `is_finished` holds Flax's finished_flags.


def flax_update(ops, rules: Rules, state: State, logits, banned, eos_id, length_penalty, data=None) -> State:
    """One step of the reference's `_beam_flax` loop, on the device. It differs from
    `beam_update` where the rules do (docs/decoding.md): every end token among the 2 x beams
    candidates competes for the finished set, reaching max_len is not an end, and the search stops
    at max_len or once, in every row, each finished slot is filled and beats the best open beam
    scored at Flax's max_decode_len (max_len + 1)."""
    xp = ops.xp
    running_scores, length = state["running_scores"], state["length"]
    batch, beams = running_scores.shape
    keep, width = 2 * beams, rules.max_len + 1
    dtype = running_scores.dtype
    bad, candidate_scores, parent_beam, token, sequences = expand(ops, rules, state, logits, banned, eos_id, data)
    ends = token == eos_id  # only the end token ends a hypothesis

    # The best `beams` that did not end stay open.
    open_scores = candidate_scores + xp.where(ends, NEG, 0.0)
    running_scores, chosen = ops.top_k(open_scores, beams)
    running = ops.take(sequences, chosen)
    parents = xp.reshape(ops.arange(batch)[:, None] * beams + ops.take(parent_beam[:, :, None], chosen)[:, :, 0],
                         (batch * beams,))

    # Every ending among the 2 x beams candidates competes for the finished set.
    prompt = prompt_of(data)  # the lengths count after the forced prompt
    scored = penalized(ops, candidate_scores, length - prompt, length_penalty, rules.form, dtype) + xp.where(ends, 0.0,
                                                                                                             NEG)
    merged = ops.concat([state["finished_scores"], scored])
    finished_scores, best = ops.top_k(merged, beams)
    finished = ops.take(ops.concat([state["finished"], sequences]), best)
    lengths = ops.concat([state["finished_lengths"], ops.full((batch, keep), 0, ops.int_dtype) + length])
    finished_lengths = ops.take(lengths[:, :, None], best)[:, :, 0]
    is_finished = ops.take(ops.concat([state["is_finished"], ends])[:, :, None], best)[:, :, 0]

    length = length + 1
    # No row can improve: its best open beam, scored at max_decode_len, does not beat the worst
    # finished slot (an empty slot counts as NEG), in every row.
    best_open = penalized(ops, running_scores[:, :1], width - prompt, length_penalty, rules.form, dtype)  # (B, 1)
    worst = xp.where(is_finished, ops.reduce("min", finished_scores, axis=1, keepdims=True), NEG)
    stop = (length > rules.max_len) | ops.reduce("all", worst > best_open) | (bad >= 0)
    return {"running": running, "running_scores": running_scores, "finished": finished,
            "finished_scores": finished_scores, "finished_lengths": finished_lengths, "is_finished": is_finished,
            "improvable": state["improvable"], "parents": parents, "length": length, "stop": stop, "bad": bad}


def flax_width(ops, state: State):
    """How many generated tokens the result holds (a 0-d array): the longest returned row; a row
    without a finished hypothesis returns its best open beam, as long as the search ran."""
    some = ops.reduce("any", state["is_finished"], axis=1)  # (B,)
    return ops.reduce("max", ops.xp.where(some, state["finished_lengths"][:, 0], state["length"] - 1))


def flax_result(ops, state: State, width: int):
    """(ids (B, width), scores (B,)): each row's best finished hypothesis, or, in a row that has
    none, its best open beam scored by its plain sum."""
    xp = ops.xp
    some = ops.reduce("any", state["is_finished"], axis=1)  # (B,)
    ids = xp.where(some[:, None], state["finished"][:, 0], state["running"][:, 0])  # (B, 1 + max_len)
    return ids[:, 1:1 + width], xp.where(some, state["finished_scores"][:, 0], state["running_scores"][:, 0])


# -- openai-whisper's beam rule -------------------------------------------------------------------
# whisper/decoding.py's BeamSearchDecoder and MaximumLikelihoodRanker: the reference's `_beam_openai`.


def openai_start(ops, rules: Rules, batch: int, bos_id, pad_id, dtype) -> State:
    """The state before the first step: one open beam per row (openai's `beams` copies of it are
    one proposal each), the others at -inf; an empty finished list of `rules.candidates` slots."""
    xp = ops.xp
    beams, width, most = rules.num_beams, rules.max_len + 1, rules.candidates
    running = ops.full((batch, beams, width), pad_id, ops.int_dtype)  # (B, beams, 1 + max_len)
    running = write_column(ops, running, 0, ops.full((batch, beams), bos_id, ops.int_dtype))
    finished = ops.full((batch, most, width), pad_id, ops.int_dtype)  # (B, C, 1 + max_len)
    return {"running": running,
            "running_scores": xp.where(ops.arange(beams) == 0, 0.0, -np.inf) + ops.full((batch, beams), 0.0, dtype),
            "finished": finished, "finished_scores": ops.full((batch, most), -np.inf, dtype),
            "finished_lengths": ops.full((batch, most), 0, ops.int_dtype),
            "count": ops.full((batch,), 0, ops.int_dtype),
            "parents": ops.arange(batch * beams), "length": 1, "stop": xp.asarray(False), "bad": xp.asarray(-1)}


def slots(ops, chosen, rank, count: int):
    """For each of `count` slots, the candidate whose `rank` (B, M) is that slot's number among
    those `chosen` (B, M) bool: (which (B, count), the first candidate where none is; filled
    (B, count) bool)."""
    match = chosen[:, None, :] & (rank[:, None, :] == ops.arange(count)[None, :, None])  # (B, count, M)
    return ops.argmax(ops.cast(match, ops.int_dtype)), ops.reduce("any", match, axis=-1)


def openai_update(ops, rules: Rules, state: State, logits, banned, eos_id, length_penalty, data=None) -> State:
    """One step of the reference's `_beam_openai` loop, on the device: each beam's num_beams + 1
    best ids by the log-softmax of the processed logits, all B x beams x (beams + 1) proposals of
    a row ranked (ties in proposal order), the first num_beams that do not end kept open, the
    endings reached before them appended to the finished list while it has room."""
    xp = ops.xp
    running, sums, length = state["running"], state["running_scores"], state["length"]
    batch, beams = sums.shape
    proposals, most = beams * (beams + 1), rules.candidates
    bad, tokens, seen, banned, forced_bos = beam_inputs(ops, rules, state, logits, banned, eos_id, data)
    scores = processed(ops, rules, logits, length - 1, banned, eos_id, forced_bos, data=data, seen=seen, tokens=tokens)
    values, picked = ops.top_k(renormalized(ops, scores), beams + 1)  # (N, beams + 1): each beam's proposals
    totals = xp.reshape(xp.reshape(sums, (batch * beams, 1)) + values, (batch, proposals))  # (B, M)
    ranked, order = ops.top_k(totals, proposals)  # best first; ties in proposal order
    token = ops.take(xp.reshape(picked, (batch, proposals))[:, :, None], order)[:, :, 0]  # (B, M)
    parent_beam = order // (beams + 1)  # (B, M)
    sequences = write_column(ops, ops.take(running, parent_beam), length, token)  # (B, M, W)
    live = ranked > -np.inf  # a proposal scored -inf is none
    ends = token == eos_id
    continuing = live & ~ends
    as_int = ops.cast(continuing, ops.int_dtype)
    before = ops.cumsum(as_int) - as_int  # (B, M): continuing proposals ranked above each
    kept = continuing & (before < beams)
    ended = live & ends & (before < beams)  # the endings the walk reaches

    which, filled = slots(ops, kept, before, beams)  # (B, beams): the row's open beams
    running = ops.take(sequences, which)
    running_scores = xp.where(filled, ops.take(ranked[:, :, None], which)[:, :, 0], -np.inf)
    parents = xp.reshape(ops.arange(batch)[:, None] * beams + ops.take(parent_beam[:, :, None], which)[:, :, 0],
                         (batch * beams,))

    count = state["count"]
    as_int = ops.cast(ended, ops.int_dtype)
    position = count[:, None] + ops.cumsum(as_int) - as_int  # (B, M): the slot each ending would take
    joins = ended & (position < most)
    which, filled = slots(ops, joins, position, most)  # (B, C)
    finished = xp.where(filled[:, :, None], ops.take(sequences, which), state["finished"])
    finished_scores = xp.where(filled, ops.take(ranked[:, :, None], which)[:, :, 0], state["finished_scores"])
    finished_lengths = xp.where(filled, length, state["finished_lengths"])
    count = count + ops.reduce("sum", ops.cast(joins, ops.int_dtype), axis=1)

    length = length + 1
    stop = ops.reduce("all", count >= most) | (length - 1 >= rules.max_len) | (bad >= 0)
    return {"running": running, "running_scores": running_scores, "finished": finished,
            "finished_scores": finished_scores, "finished_lengths": finished_lengths,
            "count": ops.cast(count, ops.int_dtype), "parents": parents, "length": length, "stop": stop, "bad": bad}


def openai_ranked(ops, rules: Rules, state: State, length_penalty, dtype, prompt=0):
    """Each row's hypotheses as openai's ranker reads them, (B, C + beams): its finished list in
    the order it filled, then, while it holds fewer than num_beams, its open beams best first;
    each scored sum / penalty(length), the length the tokens after the prompt without the end
    token (at least 1), -inf where a slot holds none. Returns (scores, sequences (B, C + beams,
    W), lengths after the start token (B, C + beams))."""
    xp = ops.xp
    sums = state["running_scores"]
    batch, beams = sums.shape
    most = rules.candidates
    count = state["count"][:, None]  # (B, 1)
    open_scores, open_order = ops.top_k(sums, beams)  # (B, beams): best first
    open_take = (count + ops.arange(beams) < beams) & (open_scores > -np.inf)
    open_length = state["length"] - 1  # their tokens after the start token
    finished_take = ops.arange(most) < count  # (B, C)
    generated = ops.concat([state["finished_lengths"] - 1, ops.full((batch, beams), 0, ops.int_dtype) + open_length])
    generated = generated - prompt
    generated = xp.where(generated < 1, 1, generated)
    summed = ops.concat([state["finished_scores"], open_scores])  # (B, C + beams)
    scores = xp.where(ops.concat([finished_take, open_take]), penalized(ops, summed, generated, length_penalty,
                                                                         rules.form, dtype), -np.inf)
    sequences = ops.concat([state["finished"], ops.take(state["running"], open_order)])
    lengths = ops.concat([state["finished_lengths"], ops.full((batch, beams), 0, ops.int_dtype) + open_length])
    return scores, sequences, lengths


def openai_width(ops, rules: Rules, state: State, length_penalty, dtype, prompt=0):
    """How many generated tokens the result holds (a 0-d array): the longest chosen hypothesis."""
    scores, _, lengths = openai_ranked(ops, rules, state, length_penalty, dtype, prompt)
    _, best = ops.top_k(scores, 1)  # (B, 1): the first best
    return ops.reduce("max", ops.take(lengths[:, :, None], best)[:, :, 0])


def openai_result(ops, rules: Rules, state: State, length_penalty, dtype, width: int, prompt=0):
    """(ids (B, width), scores (B,)): each row's first best hypothesis after the start token."""
    scores, sequences, _ = openai_ranked(ops, rules, state, length_penalty, dtype, prompt)
    best_scores, best = ops.top_k(scores, 1)  # (B, 1)
    return ops.take(sequences, best)[:, 0, 1:1 + width], best_scores[:, 0]


# -- The forced prompt and the no-speech probability --------------------------------------------
# Whisper's start of transcript: the decoder reads the prompt one step at a time, before the
# search chooses anything (the reference's `search._prompt`); the rules' own state is untouched.


def prompt_of(data) -> Any:
    """The forced prompt's length (data "prompt_len"), 0 without one."""
    return 0 if data is None or "prompt_len" not in data else data["prompt_len"]


def prompt_token(ops, data, position, logits):
    """The prompt's id at `position` for every row (N,): the prefix table's, or where it holds -1
    the best language id by the raw logits (first of equals)."""
    xp = ops.xp
    forced = read_column(ops, data["prefix"][None, :], position)  # (1,)
    detected = ops.cast(ops.argmax(xp.where(data["languages"], logits, -np.inf)), ops.int_dtype)  # (N,)
    return xp.where(forced < 0, detected, forced)


def prompt_update(ops, rules: Rules, state: State, logits, data) -> State:
    """One step of the forced prompt: every row appends the prompt's next id; nothing is scored,
    no row ends, beams keep their places (the cache follows the identity)."""
    if not rules.beams:
        i = state["step"]
        bad = first_nan_row(ops, logits, ~state["done"], state["bad"])
        tokens = write_column(ops, state["tokens"], i + 1, prompt_token(ops, data, i, logits))
        return {**state, "tokens": tokens, "step": i + 1, "stop": (bad >= 0) | (i + 1 >= rules.max_len), "bad": bad}
    xp = ops.xp
    length = state["length"]
    batch, beams = state["running_scores"].shape
    bad = first_nan_row(ops, logits, ops.full((batch * beams,), True, ops.bool_dtype), state["bad"])
    token = xp.reshape(prompt_token(ops, data, length - 1, logits), (batch, beams))
    return {**state, "running": write_column(ops, state["running"], length, token), "length": length + 1,
            "parents": ops.arange(batch * beams), "stop": (bad >= 0) | False, "bad": bad}


def step_index(rules: Rules, state: State):
    """The step about to be taken (the decoder input holds step + 1 tokens)."""
    return state["length"] - 1 if rules.beams else state["step"]


def with_records(ops, state: State, data, rows: int, dtype) -> State:
    """The state with what the search records besides its ids: "no_speech" (N,), the no-speech
    id's probability at the first step, where data asks for it."""
    if data is not None and "no_speech_id" in data:
        state = {**state, "no_speech": ops.full((rows,), 0.0, dtype)}
    return state


def no_speech(ops, state: State, logits, step, data):
    """state's "no_speech", the first step's softmax at data's no-speech id (N,) at step 0."""
    xp = ops.xp
    first = step == 0
    if first is False:
        return state["no_speech"]
    probs = xp.exp(log_softmax(ops, logits))  # (N, V)
    picked = ops.take(probs, ops.full((logits.shape[0], 1), 0, ops.int_dtype) + data["no_speech_id"])[:, 0]
    return ops.where(first, picked, state["no_speech"])


# -- The eager driver ----------------------------------------------------------------------------


def rules_of(settings) -> Rules:
    """The static rules of a `decoding.Generation`."""
    return Rules(max_len=settings.max_len, num_beams=settings.num_beams, early_stopping=settings.early_stopping,
                 form=settings.length_penalty_form, forced_eos=settings.forced_eos, rule=settings.beam_rule,
                 do_sample=settings.do_sample, no_repeat_ngram_size=settings.no_repeat_ngram_size,
                 encoder_no_repeat_ngram_size=settings.encoder_no_repeat_ngram_size,
                 renormalize=settings.renormalize_logits,
                 candidates=round(settings.num_beams * settings.patience) if settings.beam_rule == "openai" else 0)


def newest(ops, rules: Rules, state: State):
    """The tokens the next step feeds the decoder (N,)."""
    return beam_newest(ops, state) if rules.beams else greedy_newest(ops, state)


def prefix(ops, rules: Rules, state: State, step: int):
    """The whole decoder input so far (N, step + 1), for a step without the KV cache."""
    if not rules.beams:
        return state["tokens"][:, :step + 1]
    running = state["running"]
    return ops.xp.reshape(running[:, :, :step + 1], (running.shape[0] * running.shape[1], step + 1))


def start(ops, rules: Rules, batch: int, bos_id, pad_id, dtype, returned: int = 1) -> State:
    """The state before the first step; `batch` source rows (sampling: `returned` rows each)."""
    if rules.kind == "openai":
        return openai_start(ops, rules, batch, bos_id, pad_id, dtype)
    if rules.beams:
        return beam_start(ops, rules, batch, bos_id, pad_id, dtype)
    return greedy_start(ops, rules, batch * returned if rules.do_sample else batch, bos_id, pad_id, dtype)


def update(ops, rules: Rules, state: State, logits, banned, eos_id, pad_id, length_penalty, sampling=None,
           scores: bool = True, data=None) -> State:
    """One step of the search `rules` choose (`scores`: see `greedy_update`; `data`:
    `processor_data`), or of the forced prompt while it lasts (`prompt_update`); the no-speech
    probability recorded at the first step (`with_records`)."""
    records = {name: state[name] for name in ("no_speech",) if name in state}
    state = {name: value for name, value in state.items() if name not in records}
    step = step_index(rules, state)

    def searched() -> State:
        if rules.kind == "flax":
            return flax_update(ops, rules, state, logits, banned, eos_id, length_penalty, data)
        if rules.kind == "openai":
            return openai_update(ops, rules, state, logits, banned, eos_id, length_penalty, data)
        if rules.kind == "beam":
            return beam_update(ops, rules, state, logits, banned, eos_id, length_penalty, data)
        return greedy_update(ops, rules, state, logits, banned, eos_id, pad_id, sampling, scores, data)

    if data is not None and "prefix" in data:  # the eager drivers' Python branch, JAX's lax.cond
        new = ops.cond(step < data["prompt_len"], lambda: prompt_update(ops, rules, state, logits, data), searched)
    else:
        new = searched()
    if records:
        new["no_speech"] = no_speech(ops, records, logits, step, data)
    return new


def counter(rules: Rules) -> str:
    """The state's step counter: "length" (beam search: the decoder input length, start token
    included) or "step" (greedy search and sampling: the steps done)."""
    return "length" if rules.beams else "step"


def run(ops, rules: Rules, step, batch: int, bos_id: int, eos_id: int, pad_id: int, banned, length_penalty,
        dtype, read, returned: int = 1, sampling=None, scores: bool = True, data=None, mask_fill=None,
        records: dict | None = None):
    """The search with a Python loop around the device's steps (NumPy, torch). Returns the ids
    (B x returned, n) and scores (B x returned,) in the backend's arrays; `records`, a dict,
    receives "no_speech_prob", each source row's no-speech probability (B,), where data asks for it.

    step(state, i) -> logits (N, V): the decoder's next-token logits at step i (the driver reads
        `newest`/`prefix` and, for beam search after the first step, reorders its cache by
        state["parents"]);
    read(*arrays) -> Python values: the one host read per step (the stop flag and the NaN row);
    returned: the hypotheses per row (num_return_sequences) of beam search, or its samples;
    sampling: `sampling_data`, when rules.do_sample;
    scores: False when the caller drops the scores (greedy search and sampling then skip the
        log-softmax, and the scores returned are None);
    data: `processor_data` (the forced first id, the minimum length, the bad-word table), or None;
    mask_fill: the model's, which NaN logits are blamed by (`decoding.nan_error`; None: no model);
    records: a dict for what the search records besides its ids (`with_records`), or None.
    """
    state = start(ops, rules, batch, bos_id, pad_id, dtype, returned)
    rows = batch * (rules.num_beams if rules.beams else returned if rules.do_sample else 1)
    state = with_records(ops, state, data, rows, dtype)
    steps = 0
    for i in range(rules.max_len):
        logits = ops.cast(step(state, i), dtype)
        state = update(ops, rules, state, logits, banned, eos_id, pad_id, length_penalty, sampling, scores, data)
        steps = i + 1
        stop, bad = read(state["stop"], state["bad"])
        if bad >= 0:
            raise nan_error(i, bad, mask_fill)
        if stop:
            break
    ids, found = result(ops, rules, state, length_penalty, steps, dtype, read, returned, prompt_of(data))
    if records is not None and "no_speech" in state:
        records["no_speech_prob"] = recorded_no_speech(rules, state, returned)
    return ids, found if scores or rules.beams else None


def recorded_no_speech(rules: Rules, state: State, returned: int = 1):
    """Each source row's no-speech probability (B,) (its first decoder row's), or None."""
    if "no_speech" not in state:
        return None
    return state["no_speech"][::rules.num_beams if rules.beams else returned if rules.do_sample else 1]


def result(ops, rules: Rules, state: State, length_penalty, steps: int, dtype, read, returned: int = 1, prompt=0):
    """(ids, scores) of a search that stopped after `steps` steps; `read` fetches the result's
    width (one more small host read for beam search)."""
    if rules.kind == "openai":
        (width,) = read(openai_width(ops, rules, state, length_penalty, dtype, prompt))
        return openai_result(ops, rules, state, length_penalty, dtype, int(width), prompt)
    if rules.kind == "flax":
        (width,) = read(flax_width(ops, state))
        return flax_result(ops, state, int(width))
    if rules.kind == "beam":
        (width,) = read(beam_width(ops, state, returned))
        return beam_result(ops, state, int(width), returned)
    return greedy_result(ops, rules, state, length_penalty, steps, dtype)
