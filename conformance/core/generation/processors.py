"""Hugging Face's logits processors, applied by the reference search on the host.

`Processors` holds what a search applies at each step besides the log-softmax: the forced first
and end tokens, the minimum length, banned ids and bad words, no repeated n-gram. `processed`
applies them in transformers' order to one step's float64 log-probabilities. The device search
(`conformance.core.generation.device`) applies the same rules as array operations.

Framework-free (NumPy and the standard library).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np




@dataclass(frozen=True)
class Processors:
    """Hugging Face's logits processors that `generate` supports, resolved. `processed` applies
    them in transformers' order (`GenerationMixin._get_logits_processor`): no repeated n-gram,
    bad words (the one-token ones, `banned_ids`, then the longer ones), the minimum length
    (MinLengthLogitsProcessor, then MinNewTokensLengthLogitsProcessor), the forced first token,
    the forced end token (docs/decoding.md, "What is scored").

    banned_ids:            ids banned at every step
    bad_words_ids:         words of two tokens or more: the last token is banned where the others
                           end the decoder input
    no_repeat_ngram_size:  n: no n-gram of the decoder input (its start token included) twice; 0 off
    min_length:            eos_id is banned while the decoder input (its start token included, as
                           transformers counts for an encoder-decoder) is shorter than this; 0 off
    min_new_tokens:        eos_id is banned while fewer tokens than this were generated; 0 off
    forced_bos_id:         the only id the first step may choose, or None
    forced_eos:            the only id the last step (the max_len-th token) may choose is eos_id
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

    def bans_eos(self, step: int) -> bool:
        """Whether the minimum length bans the end token at `step` (the decoder input holds
        step + 1 tokens, the start token first: step generated)."""
        return step + 1 < self.min_length or step < self.min_new_tokens


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


def bad_word_bans(tokens: np.ndarray, words: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """Per row of the decoder input so far (N, t), the last tokens of the bad words whose other
    tokens end the row (NoBadWordsLogitsProcessor's words of two tokens or more; a word longer
    than the row plus one never applies). The start token is part of the row."""
    t = tokens.shape[1]
    return [[word[-1] for word in words if len(word) - 1 <= t and tuple(row[t - len(word) + 1:]) == word[:-1]]
            for row in tokens.tolist()]


def processed(scores: np.ndarray, tokens: np.ndarray, step: int, processors: Processors) -> np.ndarray:
    """Hugging Face's logits processors, in its order, on scores (N, V) after the decoder input
    tokens (N, step + 1): repeated n-grams and bad words get -inf; below the minimum length the end
    token gets -inf; at the first step every id but the forced first token gets -inf and that
    token 0 (`forced_bos_token_id`); at the last step every id but the end token gets -inf and the
    end token 0 (`forced_eos_token_id`, so it wins over the minimum length)."""
    p = processors
    if p.no_repeat_ngram_size:
        for row, banned in enumerate(repeated_ngram_bans(tokens, p.no_repeat_ngram_size)):
            scores[row, banned] = -np.inf
    if p.banned_ids:
        scores[:, list(p.banned_ids)] = -np.inf
    if p.bad_words_ids:
        for row, banned in enumerate(bad_word_bans(tokens, p.bad_words_ids)):
            scores[row, banned] = -np.inf
    if p.bans_eos(step):
        scores[:, p.eos_id] = -np.inf
    if p.forced_bos_id is not None and step == 0:
        scores[:, :] = -np.inf
        scores[:, p.forced_bos_id] = 0.0
    if p.forced_eos and step == p.max_len - 1:
        scores[:, :] = -np.inf
        scores[:, p.eos_id] = 0.0
    return scores
