"""Hugging Face's logits processors, applied by the reference search on the host.

`Processors` holds what a search applies at each step besides the log-softmax: the penalties on
repeated ids, the bans (repeated n-grams of the output or of the source, bad words, the end token
below the minimum length), the forced first and end tokens, the length penalty on the end token,
the suppressed tokens and the renormalization. `processed` applies them in transformers' order
(`PIPELINE`) to one step's float64 scores. The device search
(`conformance.core.generation.device`) applies the same rules as array operations.

Each processor is one function `(scores, tokens, step, processors) -> scores` that leaves the
scores alone when its settings are off; a new one is a field of `Processors` and a function in
`PIPELINE` at transformers' place for it (Whisper's timestamp rules, `timestamp_rules`, come
after the suppressions).

Framework-free (NumPy and the standard library).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Timestamps:
    """Whisper's timestamp rules' ids (openai-whisper's ApplyTimestampRules, transformers'
    WhisperTimeStampLogitsProcessor; docs/whisper.md).

    begin:          the first timestamp id (<|0.00|>): no_timestamps + 1; every id from it on is one
    no_timestamps:  <|notimestamps|>, banned at every step
    max_initial:    the first timestamp is at most begin + max_initial (None: no bound)
    sample_begin:   the first generated column of the decoder input: 1 + the forced prompt's length
    """

    begin: int
    no_timestamps: int
    max_initial: int | None
    sample_begin: int


@dataclass(frozen=True)
class Processors:
    """Hugging Face's logits processors that `generate` supports, resolved. `processed` applies
    them in transformers' order (`GenerationMixin._get_logits_processor`, `PIPELINE`)
    (docs/decoding.md, "What is scored").

    banned_ids:            ids banned at every step
    bad_words_ids:         words of two tokens or more: the last token is banned where the others
                           end the decoder input
    no_repeat_ngram_size:  n: no n-gram of the decoder input (its start token included) twice; 0 off
    min_length:            eos_id is banned while the decoder input (its start token included, as
                           transformers counts for an encoder-decoder) is shorter than this; 0 off
    min_new_tokens:        eos_id is banned while fewer tokens than this were generated; 0 off
    forced_bos_id:         the only id the first step may choose, or None
    forced_eos:            the only id the last step (the max_len-th token) may choose is eos_id
    repetition_penalty:    every id of the decoder input (its start token included): a score s
                           becomes s * p if s < 0, else s / p; 1 off
    encoder_repetition_penalty: every id of the row's source (its padding included, as
                           transformers reads input_ids): with q = 1 / p formed first, as
                           transformers does, s * q if s < 0, else s / q; 1 off
    encoder_no_repeat_ngram_size: n: an n-gram of the row's source bans its last token where its
                           first n - 1 end the decoder input; 0 off
    encoder_ids:           (N, S) each decoder row's source ids, for the two above (None without);
                           an id outside the target vocabulary is never penalized nor banned
    exponential_decay_length_penalty: (start, factor): from step start + 1 on, eos_id's score s
                           gains |s| (factor ** (step - start) - 1) where it is finite; None off
    suppress_tokens:       ids banned at every step, after the forced tokens
    begin_suppress_tokens: ids banned at step `begin_suppress_step`, after the forced tokens
    begin_suppress_step:   0, 1 where a first token is forced, or the forced prompt's length
                           (transformers' begin_index)
    timestamps:            Whisper's timestamp rules (`Timestamps`), or None
    renormalize_logits:    a log-softmax of the scores after every other processor
    prompt_len:            the forced prompt's length: min_new_tokens and the decay count the
                           tokens after it, as transformers counts after its decoder prompt
    """

    max_len: int
    eos_id: int
    banned_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    no_repeat_ngram_size: int = 0
    min_length: int = 0
    min_new_tokens: int = 0
    forced_bos_id: int | None = None
    forced_eos: bool = False
    repetition_penalty: float = 1.0
    encoder_repetition_penalty: float = 1.0
    encoder_no_repeat_ngram_size: int = 0
    encoder_ids: np.ndarray | None = field(default=None, compare=False)
    exponential_decay_length_penalty: tuple[int, float] | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    begin_suppress_step: int = 0
    timestamps: Timestamps | None = None
    renormalize_logits: bool = False
    prompt_len: int = 0

    def bans_eos(self, step: int) -> bool:
        """Whether the minimum length bans the end token at `step` (the decoder input holds
        step + 1 tokens, the start token first: step generated, the prompt's among them)."""
        return step + 1 < self.min_length or step - self.prompt_len < self.min_new_tokens


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def repeated_ngram_bans(tokens: np.ndarray, n: int) -> list[list[int]]:
    """Per row of the decoder input so far (N, t), the ids that would repeat one of its n-grams
    (NoRepeatNGramLogitsProcessor): each n-gram whose first n - 1 tokens are the row's last n - 1
    bans its last token. The start token is part of the row, as in transformers' encoder-decoder
    search, so n = 1 bans every id the row holds, the start token too."""
    t = tokens.shape[1]
    if t < n:  # no whole n-gram yet
        return [[] for _ in tokens]
    bans = []
    for row in tokens.tolist():
        suffix = row[t - n + 1:]
        bans.append([row[j + n - 1] for j in range(t - n + 1) if row[j:j + n - 1] == suffix])
    return bans


def source_ngram_bans(tokens: np.ndarray, sources: np.ndarray, n: int) -> list[list[int]]:
    """Per row of the decoder input so far (N, t), the last tokens of the n-grams of its source row
    (N, S) whose first n - 1 tokens are the row's last n - 1 (EncoderNoRepeatNGramLogitsProcessor:
    none before the row holds n - 1 tokens; n = 1 bans every id of the source)."""
    t = tokens.shape[1]
    if t < n - 1:
        return [[] for _ in tokens]
    bans = []
    for row, source in zip(tokens.tolist(), sources.tolist()):
        suffix = row[t - n + 1:] if n > 1 else []
        bans.append([source[j + n - 1] for j in range(len(source) - n + 1) if source[j:j + n - 1] == suffix])
    return bans


def bad_word_bans(tokens: np.ndarray, words: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """Per row of the decoder input so far (N, t), the last tokens of the bad words whose other
    tokens end the row (NoBadWordsLogitsProcessor's words of two tokens or more; a word longer
    than the row plus one never applies). The start token is part of the row."""
    t = tokens.shape[1]
    return [[word[-1] for word in words if len(word) - 1 <= t and tuple(row[t - len(word) + 1:]) == word[:-1]]
            for row in tokens.tolist()]


def penalize(scores: np.ndarray, rows: list, factor: float) -> np.ndarray:
    """Each row's ids `rows[r]` with s * factor where s < 0 and s / factor elsewhere
    (RepetitionPenaltyLogitsProcessor's rule; the encoder's takes 1 / p as its factor). An id
    outside the scores' vocabulary (a source id of a larger source vocabulary) is no target id:
    nothing to penalize."""
    vocab = scores.shape[-1]
    for row, ids in enumerate(rows):
        ids = sorted(i for i in set(ids) if i < vocab)
        picked = scores[row, ids]
        scores[row, ids] = np.where(picked < 0, picked * factor, picked / factor)
    return scores


# -- The processors, each `(scores, tokens, step, processors) -> scores` --------------------------


def encoder_repetition(scores, tokens, step, p: Processors):
    """EncoderRepetitionPenaltyLogitsProcessor: the source's ids, by 1 / p (so favoured for p > 1)."""
    if p.encoder_repetition_penalty == 1.0:
        return scores
    return penalize(scores, [list(row) for row in p.encoder_ids.tolist()], 1.0 / p.encoder_repetition_penalty)


def repetition(scores, tokens, step, p: Processors):
    """RepetitionPenaltyLogitsProcessor: the decoder input's ids (the start token among them)."""
    if p.repetition_penalty == 1.0:
        return scores
    return penalize(scores, tokens.tolist(), p.repetition_penalty)


def no_repeat_ngram(scores, tokens, step, p: Processors):
    """NoRepeatNGramLogitsProcessor (`repeated_ngram_bans`)."""
    if p.no_repeat_ngram_size:
        for row, banned in enumerate(repeated_ngram_bans(tokens, p.no_repeat_ngram_size)):
            scores[row, banned] = -np.inf
    return scores


def encoder_no_repeat_ngram(scores, tokens, step, p: Processors):
    """EncoderNoRepeatNGramLogitsProcessor (`source_ngram_bans`)."""
    if p.encoder_no_repeat_ngram_size:
        for row, banned in enumerate(source_ngram_bans(tokens, p.encoder_ids, p.encoder_no_repeat_ngram_size)):
            scores[row, [i for i in banned if i < scores.shape[-1]]] = -np.inf  # a source-only id is no target id
    return scores


def bad_words(scores, tokens, step, p: Processors):
    """NoBadWordsLogitsProcessor: the one-token words (`banned_ids`), then the longer ones."""
    if p.banned_ids:
        scores[:, list(p.banned_ids)] = -np.inf
    if p.bad_words_ids:
        for row, banned in enumerate(bad_word_bans(tokens, p.bad_words_ids)):
            scores[row, banned] = -np.inf
    return scores


def minimum_length(scores, tokens, step, p: Processors):
    """MinLengthLogitsProcessor, then MinNewTokensLengthLogitsProcessor (`Processors.bans_eos`)."""
    if p.bans_eos(step):
        scores[:, p.eos_id] = -np.inf
    return scores


def forced_bos(scores, tokens, step, p: Processors):
    """ForcedBOSTokenLogitsProcessor: at the first step every id but the forced one gets -inf, it 0."""
    if p.forced_bos_id is not None and step == 0:
        scores[:, :] = -np.inf
        scores[:, p.forced_bos_id] = 0.0
    return scores


def forced_eos(scores, tokens, step, p: Processors):
    """ForcedEOSTokenLogitsProcessor: at the last step every id but the end token gets -inf, it 0."""
    if p.forced_eos and step == p.max_len - 1:
        scores[:, :] = -np.inf
        scores[:, p.eos_id] = 0.0
    return scores


def decay_factor(decay: tuple[int, float], step: int) -> float:
    """ExponentialDecayLengthPenalty's multiplier of |s| at `step`: factor ** (step - start) - 1
    after the start step (transformers' cur_len > start + 1, the start token counted), else 0.
    Computed as transformers does (Python's float power), except that a power beyond float64 is
    +inf where Python raises OverflowError (transformers' own pow raises there, if it gets so far)."""
    start, factor = decay
    if step <= start:
        return 0.0
    try:
        return factor ** (step - start) - 1
    except OverflowError:  # factor > 1 (it is > 0): the power overflowed upwards
        return math.inf


def exponential_decay(scores, tokens, step, p: Processors):
    """ExponentialDecayLengthPenalty: the end token's score s gains |s| x `decay_factor`, where it
    is finite (a banned end token stays banned). Past the dtype that is +inf, as transformers'
    float32 sum; with an infinite multiplier a score of 0 is +inf too, not |0| x inf = NaN
    (`certain_end` then makes the row the forced end's, unless a suppression bans the end token)."""
    step -= p.prompt_len  # transformers counts from its decoder prompt's end
    if p.exponential_decay_length_penalty is None or step <= p.exponential_decay_length_penalty[0]:
        return scores
    eos = scores[:, p.eos_id]
    multiplier = decay_factor(p.exponential_decay_length_penalty, step)
    with np.errstate(over="ignore", invalid="ignore"):  # past the dtype: +inf; -inf + inf is not taken
        gained = np.inf if math.isinf(multiplier) else eos + np.abs(eos) * multiplier
    scores[:, p.eos_id] = np.where(np.isfinite(eos), gained, eos)
    return scores


def suppress(scores, tokens, step, p: Processors):
    """SuppressTokensLogitsProcessor: -inf at every step, after the forced tokens (suppressing a
    forced one is refused, as transformers refuses it: `settings.check_forced_not_suppressed`)."""
    if p.suppress_tokens:
        scores[:, list(p.suppress_tokens)] = -np.inf
    return scores


def begin_suppress(scores, tokens, step, p: Processors):
    """SuppressTokensAtBeginLogitsProcessor: -inf at `begin_suppress_step` only."""
    if p.begin_suppress_tokens and step == p.begin_suppress_step:
        scores[:, list(p.begin_suppress_tokens)] = -np.inf
    return scores


def logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x))) over the last axis, shifted by the row's max; -inf for a row of -inf."""
    top = x.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf: a row of -inf
        return (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))[..., 0]


def timestamp_rules(scores, tokens, step, p: Processors):
    """Whisper's timestamp rules (openai-whisper's ApplyTimestampRules, transformers'
    WhisperTimeStampLogitsProcessor, which copies it), over each row's generated tokens (those
    after the start token and the forced prompt):

    1. <|notimestamps|> gets -inf;
    2. timestamps come in pairs: after two timestamps in a row (or one opening the output) no
       timestamp may follow, after a text token and a timestamp no text token (ids below the end
       id) may;
    3. they never decrease: the timestamps below the last one get -inf, and below the last one + 1
       unless it opened a pair (a segment is never empty);
    4. the first generated token is a timestamp (every id below `begin` gets -inf) and at most
       begin + max_initial;
    5. where the timestamps' total probability beats every other single id's, every id below
       `begin` gets -inf. The comparison reads the scores themselves, logsumexp(timestamps) >
       max(other ids): both sides of openai's and transformers' comparison of log-probabilities
       carry the same normaliser."""
    t = p.timestamps
    if t is None:
        return scores
    scores[:, t.no_timestamps] = -np.inf
    for k, row in enumerate(tokens.tolist()):
        generated = row[t.sample_begin:]
        last_was = len(generated) >= 1 and generated[-1] >= t.begin
        penultimate_was = len(generated) < 2 or generated[-2] >= t.begin
        if last_was:
            if penultimate_was:  # has to be text
                scores[k, t.begin:] = -np.inf
            else:  # the pair's closing timestamp, or the end
                scores[k, :p.eos_id] = -np.inf
        stamps = [token for token in generated if token >= t.begin]
        if stamps:
            lowest = stamps[-1] if last_was and not penultimate_was else stamps[-1] + 1
            scores[k, t.begin:lowest] = -np.inf
    if tokens.shape[1] == t.sample_begin:  # the first generated token
        scores[:, :t.begin] = -np.inf
        if t.max_initial is not None:
            scores[:, t.begin + t.max_initial + 1:] = -np.inf
    is_stamp = np.arange(scores.shape[-1]) >= t.begin  # (V,)
    forced = logsumexp(np.where(is_stamp, scores, -np.inf)) > np.where(is_stamp, -np.inf, scores).max(axis=-1)
    scores[forced, :t.begin] = -np.inf
    return scores


def certain_end(scores, tokens, step, p: Processors):
    """Not transformers': a row whose end token the decay made +inf (and no suppression banned)
    becomes the forced end's, 0 at the end token and -inf elsewhere: the limit of its
    probability, so that greedy search chooses it as transformers' +inf does, while a
    log-softmax, sampling's draw and beam search's sums stay finite (transformers' go NaN)."""
    if p.exponential_decay_length_penalty is None:
        return scores
    certain = np.isposinf(scores[:, p.eos_id])  # (N,)
    scores[certain] = -np.inf
    scores[certain, p.eos_id] = 0.0
    return scores


def renormalize(scores, tokens, step, p: Processors):
    """LogitNormalization, always last: the scores as log-probabilities again. A row with every id
    banned stays all -inf (transformers' log-softmax makes it NaN; here it ranks last, as every
    such row does: docs/decoding.md)."""
    if not p.renormalize_logits:
        return scores
    banned = np.isneginf(scores).all(axis=-1, keepdims=True)  # (N, 1)
    with np.errstate(invalid="ignore"):  # -inf - -inf in those rows, replaced
        return np.where(banned, -np.inf, log_softmax(scores))


# transformers' order (`_get_logits_processor`, 5.23), and `certain_end`, ours, before the
# renormalization; sampling's warpers come after these, but before LogitNormalization there,
# where a log-softmax changes no probability drawn from. Whisper's (transformers'
# WhisperGenerationMixin) come after these, in the order begin_suppress, suppress, timestamps: the
# two suppressions commute.
PIPELINE = (encoder_repetition, repetition, no_repeat_ngram, encoder_no_repeat_ngram, bad_words, minimum_length,
            forced_bos, forced_eos, exponential_decay, suppress, begin_suppress, timestamp_rules, certain_end,
            renormalize)


def processed(scores: np.ndarray, tokens: np.ndarray, step: int, processors: Processors) -> np.ndarray:
    """Hugging Face's logits processors, in its order (`PIPELINE`), on float64 scores (N, V)
    after the decoder input tokens (N, step + 1): penalties on repeated ids; repeated n-grams,
    bad words and, below the minimum length, the end token get -inf; at the first step every id
    but the forced first token gets -inf and that token 0 (`forced_bos_token_id`); at the last step
    every id but the end token gets -inf and the end token 0 (`forced_eos_token_id`, so it wins
    over the minimum length); the end token's length penalty; the suppressed ids get -inf;
    Whisper's timestamp rules (`timestamp_rules`); and a log-softmax last when
    renormalize_logits. `scores` may be written in place."""
    for processor in PIPELINE:
        scores = processor(scores, tokens, step, processors)
    return scores
