"""The device search's processors around its bans: the reference's `PIPELINE` as array operations.

`conformance.core.generation.device.processed` applies Hugging Face's processors in its order
(`conformance.core.generation.processors.PIPELINE`): the repetition penalties (`penalties`,
`penalized_by`) first, then the bans (the source's n-grams among them) and the forced tokens
(device.py), then the stages here that come after them (`LATE`: the end token's length penalty,
the suppressed ids, an end that penalty made certain), and the renormalization last
(device.py). What they read besides the scores is data (`data_of`), so that JAX compiles one
program for every penalty, decay and token list of one shape; a stage whose data is absent is
off.

A new processor is a function `(ops, rules, scores, step, data, eos_id, tokens) -> scores` in
`LATE` at transformers' place for it (Whisper's timestamp rules, `timestamp_rules`, come after
the suppressions, before `certain_end`), with its data built by `data_of` and its reference twin
in `processors.PIPELINE`. `data_of` also carries the forced prompt (`prefix`, read by the device
search's prompt steps) and the no-speech id.

Framework-free (NumPy and the standard library): every function takes the adapter `ops`.
"""

from __future__ import annotations

import numpy as np

from conformance.core.errors import InputError
from conformance.core.generation.processors import decay_factor


# data_of's keys that change the scores other than by a ban of the whole (V,) mask: greedy search
# then reads its chosen ids' scores from the whole processed row (device.whole_row).
VALUE_KEYS = ("repetition_penalty", "encoder_penalty", "decay", "suppress", "begin_suppress", "timestamp_begin")


def data_of(settings, as_array, src_ids=None, vocab_size: int | None = None) -> dict:
    """What these processors read, each through `as_array(name, value)` (value a NumPy array or a
    Python int: float64 arrays to the search dtype, int64 to the backend's ids, bool as they are):

    repetition_penalty   p, 0-d
    encoder_penalty      1 / p of encoder_repetition_penalty, 0-d (transformers divides first)
    encoder_seen         (N, V) bool: the ids of each decoder row's source, padding included
    encoder_ids          (N, S): each decoder row's source ids (encoder_no_repeat_ngram_size)
    decay                (max_len,): exponential_decay_length_penalty's multiplier of |s| per step
                         (`processors.decay_factor`, inf past float64 or, cast, past the search dtype)
    suppress             (V,) bool: suppress_tokens
    begin_suppress       (V,) bool, and begin_step, an int: begin_suppress_tokens and their step
    timestamp_begin, no_timestamps, max_initial, sample_begin   ints: Whisper's timestamp rules
                         (`timestamp_rules`; max_initial V when unbounded)
    prefix               (max_len,) int: the forced prompt, -1 where detected, then -1 padding;
                         prompt_len, an int: its length; languages (V,) bool: what a -1 is chosen
                         among (all False where the prompt has none)
    no_speech_id         an int: the id whose probability at the first step is returned

    Only those whose processor is on; `src_ids` (B, S) and `vocab_size` are needed by some."""
    data = {}
    if settings.repetition_penalty != 1.0:
        data["repetition_penalty"] = as_array("repetition_penalty", np.array(settings.repetition_penalty))
    if settings.reads_source:
        if src_ids is None:
            raise InputError("src_ids", "encoder_repetition_penalty and encoder_no_repeat_ngram_size read the source "
                                        "ids: pass them")
        sources = np.repeat(np.asarray(src_ids, dtype=np.int64), settings.rows, axis=0)  # (N, S)
        if settings.encoder_repetition_penalty != 1.0:
            seen = np.zeros((len(sources), vocab_size + 1), dtype=bool)  # a source-only id: the spare column
            np.put_along_axis(seen, np.minimum(sources, vocab_size), True, axis=1)
            seen = seen[:, :vocab_size]
            data["encoder_penalty"] = as_array("encoder_penalty", np.array(1.0 / settings.encoder_repetition_penalty))
            data["encoder_seen"] = as_array("encoder_seen", seen)
        if settings.encoder_no_repeat_ngram_size:
            data["encoder_ids"] = as_array("encoder_ids", sources)
    prompt = settings.prompt_len
    if settings.exponential_decay_length_penalty is not None:  # counted after the prompt, as transformers counts
        decay = [decay_factor(settings.exponential_decay_length_penalty, step - prompt)
                 for step in range(settings.max_len)]
        with np.errstate(over="ignore"):  # a multiplier beyond the search dtype is inf there, as in transformers
            data["decay"] = as_array("decay", np.array(decay, dtype=np.float64))
    for name, ids in (("suppress", settings.suppress_tokens), ("begin_suppress", settings.begin_suppress_tokens)):
        if ids:
            mask = np.zeros(vocab_size, dtype=bool)
            mask[list(ids)] = True
            data[name] = as_array(name, mask)
    if settings.begin_suppress_tokens:
        data["begin_step"] = as_array("begin_step", settings.begin_suppress_step)
    if settings.return_timestamps:
        for name, value in (("timestamp_begin", settings.no_timestamps_id + 1),
                            ("no_timestamps", settings.no_timestamps_id),
                            ("max_initial", vocab_size if settings.max_initial_timestamp_index is None
                             else settings.max_initial_timestamp_index),
                            ("sample_begin", 1 + prompt)):
            data[name] = as_array(name, int(value))
    if settings.prefix:
        table = np.full(settings.max_len, -1, dtype=np.int64)
        table[:prompt] = [-1 if token is None else token for token in settings.prefix]
        data["prefix"], data["prompt_len"] = as_array("prefix", table), as_array("prompt_len", prompt)
        languages = np.zeros(vocab_size, dtype=bool)  # all False without a None: one program either way
        languages[list(settings.language_ids)] = True
        data["languages"] = as_array("languages", languages)
    if settings.return_no_speech_prob:
        data["no_speech_id"] = as_array("no_speech_id", settings.no_timestamps_id - 1)
    return data


# -- Before the bans: the repetition penalties ----------------------------------------------------


def ids_seen(ops, tokens, length, vocab: int):
    """(N, V) bool: the ids among the first `length` columns of tokens (N, W) (the start token
    included: RepetitionPenaltyLogitsProcessor reads the whole decoder input)."""
    written = ops.arange(tokens.shape[1]) < length  # (W,)
    return ops.mark(ops.xp.where(written, tokens, vocab), vocab + 1)[:, :vocab]


def penalties(ops, tokens, length, data, vocab: int) -> list:
    """This step's penalties in transformers' order, as (ids (N, V) bool, factor): the source's
    ids by 1 / p (EncoderRepetitionPenaltyLogitsProcessor), then the decoder input's by p
    (RepetitionPenaltyLogitsProcessor). Worked out once a step, for the logits and the scores."""
    if not data:
        return []
    out = []
    if "encoder_penalty" in data:
        out.append((data["encoder_seen"], data["encoder_penalty"]))
    if "repetition_penalty" in data:
        out.append((ids_seen(ops, tokens, length, vocab), data["repetition_penalty"]))
    return out


def penalized_by(ops, scores, seen: list):
    """scores with each penalty of `penalties`: s * factor where s < 0, s / factor elsewhere, on
    its ids (the reference's `processors.penalize`, one division per element: `ops.divide`)."""
    xp = ops.xp
    for ids, factor in seen:
        scores = xp.where(ids, xp.where(scores < 0, scores * factor, ops.divide(scores, factor)), scores)
    return scores


# -- After the forced tokens ---------------------------------------------------------------------


def read_column(ops, array, column):
    """array[..., column] for a column that may be traced: a masked sum over the last axis."""
    if isinstance(column, int):  # the eager drivers' Python step
        return array[..., column]
    picked = ops.reduce("sum", ops.xp.where(ops.arange(array.shape[-1]) == column, array, 0), axis=-1)
    return ops.cast(picked, array.dtype)  # a sum may widen the integers (JAX with x64)


def at_step(ops, table, step):
    """table[step] of a (max_len,) table, for a step that may be traced (then an exact masked sum)."""
    if isinstance(step, int):
        return table[step]
    return ops.reduce("sum", ops.xp.where(ops.arange(table.shape[0]) == step, table, 0.0))


def exponential_decay(ops, rules, scores, step, data, eos_id, tokens=None):
    """ExponentialDecayLengthPenalty as transformers adds it: the end token's score s becomes
    s + |s| x decay[step] where it is finite; every other id keeps its score. A multiplier past
    the search dtype is inf there, and so is the end token's score (a 0 too, not 0 x inf = NaN):
    `certain_end` then takes it (the reference's `processors.exponential_decay`)."""
    if "decay" not in data:
        return scores
    xp = ops.xp
    gains = (ops.arange(scores.shape[-1]) == eos_id) & xp.isfinite(scores)  # (N, V)
    multiplier = at_step(ops, data["decay"], step)
    with np.errstate(over="ignore", invalid="ignore"):  # NumPy: the ids not taken may make inf or NaN
        gained = xp.where(multiplier == np.inf, np.inf, scores + xp.abs(scores) * multiplier)
    return xp.where(gains, gained, scores)


def suppress(ops, rules, scores, step, data, eos_id, tokens=None):
    """SuppressTokensLogitsProcessor: -inf at every step, after the forced tokens."""
    if "suppress" not in data:
        return scores
    return ops.xp.where(data["suppress"], -np.inf, scores)


def begin_suppress(ops, rules, scores, step, data, eos_id, tokens=None):
    """SuppressTokensAtBeginLogitsProcessor: -inf at data's begin_step only."""
    if "begin_suppress" not in data:
        return scores
    return ops.where(step == data["begin_step"], ops.xp.where(data["begin_suppress"], -np.inf, scores), scores)


def certain_end(ops, rules, scores, step, data, eos_id, tokens=None):
    """The reference's `processors.certain_end`: a row whose end token the decay made +inf (no
    suppression banned it) becomes the forced end's, 0 there and -inf elsewhere."""
    if "decay" not in data:
        return scores
    xp = ops.xp
    is_eos = ops.arange(scores.shape[-1]) == eos_id  # (V,)
    certain = ops.reduce("any", is_eos & (scores == np.inf), axis=-1, keepdims=True)  # (N, 1)
    return xp.where(certain, xp.where(is_eos, 0.0, -np.inf), scores)


def logsumexp(ops, x):
    """The reference's `processors.logsumexp` over the last axis: shifted by the row's max, -inf
    for a row of -inf."""
    xp = ops.xp
    top = ops.reduce("max", x, axis=-1, keepdims=True)  # (N, 1)
    top = xp.where(xp.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):  # NumPy: log(0) = -inf, a row of -inf
        return (top + xp.log(ops.reduce("sum", xp.exp(x - top), axis=-1, keepdims=True)))[:, 0]


def timestamp_rules(ops, rules, scores, step, data, eos_id, tokens=None):
    """Whisper's timestamp rules, the reference's `processors.timestamp_rules`, over the decoder
    input buffer tokens (N, W) whose first step + 1 columns are written, the generated ones from
    column data["sample_begin"] on: <|notimestamps|> banned; after two timestamps in a row (or one
    opening the output) no timestamp, after text and a timestamp no id below the end id; no
    timestamp below the last one (+ 1 unless it opened a pair); the first generated token a
    timestamp at most max_initial after the first; and where the timestamps' logsumexp beats
    every other id, every id below the first timestamp banned."""
    if "timestamp_begin" not in data:
        return scores
    xp = ops.xp
    begin, first_column = data["timestamp_begin"], data["sample_begin"]
    ids = ops.arange(scores.shape[-1])  # (V,)
    stamp_ids = ids >= begin  # (V,)
    scores = xp.where(ids == data["no_timestamps"], -np.inf, scores)
    length = step + 1  # the written columns
    count = length - first_column  # tokens generated so far
    last_was = (count >= 1) & (read_column(ops, tokens, length - 1) >= begin)  # (N,)
    before_last = read_column(ops, tokens, length - 2)  # (N,): a column read only where count >= 2
    penultimate_was = (count < 2) | (before_last >= begin)  # (N,)
    scores = xp.where((last_was & penultimate_was)[:, None] & stamp_ids, -np.inf, scores)  # text next
    scores = xp.where((last_was & ~penultimate_was)[:, None] & (ids < eos_id), -np.inf, scores)  # no text next
    columns = ops.arange(tokens.shape[1])  # (W,)
    is_stamp = (tokens >= begin) & (columns >= first_column) & (columns < length)  # (N, W)
    last_column = ops.reduce("max", xp.where(is_stamp, columns, -1), axis=-1)  # (N,): -1 without one
    last_stamp = ops.take(tokens, xp.where(last_column < 0, 0, last_column)[:, None])[:, 0]  # (N,)
    lowest = xp.where(last_was & ~penultimate_was, last_stamp, last_stamp + 1)  # (N,)
    below = (last_column >= 0)[:, None] & stamp_ids & (ids < lowest[:, None])  # (N, V)
    scores = xp.where(below, -np.inf, scores)
    initial = (ids < begin) | (ids > begin + data["max_initial"])  # (V,): barred from the first token
    scores = ops.where(count == 0, xp.where(initial, -np.inf, scores), scores)
    stamps = logsumexp(ops, xp.where(stamp_ids, scores, -np.inf))  # (N,)
    best_other = ops.reduce("max", xp.where(stamp_ids, -np.inf, scores), axis=-1)  # (N,)
    return xp.where((stamps > best_other)[:, None] & ~stamp_ids, -np.inf, scores)


# transformers' order after ForcedEOSTokenLogitsProcessor, then Whisper's, then ours (`certain_end`);
# renormalization follows them all.
LATE = (exponential_decay, suppress, begin_suppress, timestamp_rules, certain_end)


def late(ops, rules, scores, step, data, eos_id, tokens=None):
    """The stages of `LATE` in order (device.processed then renormalizes, rules.renormalize);
    tokens (N, W) is the decoder input buffer, for the stages that read it."""
    if data:
        for stage in LATE:
            scores = stage(ops, rules, scores, step, data, eos_id, tokens)
    return scores
