"""Decoding written once: greedy search, beam search and sampling, on the host, in float64 NumPy.

Every backend's `generate` resolves its arguments with `resolve` (the checkpoint's generation
note for what is left out, then the checks, the same errors from every backend), encodes the
source, then hands `search` a `step` function:

    step(tokens, parents) -> logits
        tokens  (N, t) int64, the decoder input so far (N = batch * num_beams rows, or batch *
                num_return_sequences when sampling)
        parents (N,) int64 or None: row i of this step continues row parents[i] of the last one;
                a backend with a KV cache reorders it by `parents` before running the new token
        logits  (N, V) the next-token logits of each row, in the backend's own dtype

`search` does everything else: log-softmax in float64, Hugging Face's logits processors (no
repeated n-gram, banned ids and words, the minimum length, the forced first and end tokens:
`Processors`), the choice
of tokens (Hugging Face's beam rule or Flax examples/wmt's; sampling with
temperature, top-k and top-p from uniforms drawn once from a NumPy seed), the finished-hypothesis
lists, the length penalty and the stopping rule. So the backends can only differ through their
logits; in float64 they choose the same ids. The semantics are written out in
`docs/decoding.md`.

`DecoderCache` is the state a backend's cached step carries; its fields hold the backend's own
arrays.

This module is framework-free (NumPy and the standard library).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from conformance.core.errors import InputError, NaNLogitsError

# Hugging Face's stand-in for "minus infinity" in beam scores (finite, so that sums stay ordered).
NEG = -1.0e9
EARLY_STOPPING = (True, False, "never")
LENGTH_PENALTY_FORMS = ("hf", "gnmt")
BEAM_RULES = ("hf", "flax")
# The penalty each beam rule uses when `length_penalty_form` is not given.
RULE_PENALTY_FORMS = {"hf": "hf", "flax": "gnmt"}


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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _integer(name: str, value, what: str = "an int") -> int:
    """An integer argument: a Python int or an integer scalar of any backend (np.int64(1),
    torch.tensor(1), jnp.int32(1)); a bool, a float or an array of several values is refused,
    naming its type."""
    dtype = str(getattr(value, "dtype", ""))
    shape = tuple(getattr(value, "shape", ()))
    if isinstance(value, bool) or "bool" in dtype or shape != ():
        raise InputError(name, f"must be {what}, got {value!r} ({type(value).__name__})")
    try:
        return operator.index(value)
    except TypeError:
        raise InputError(name, f"must be {what}, got {value!r} ({type(value).__name__})") from None


def _number(name: str, value) -> float:
    """A real-number argument (a Python or NumPy number; not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InputError(name, f"must be a finite number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not np.isfinite(value):
        raise InputError(name, f"must be a finite number, got {value!r}")
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(name, f"must be True or False, got {value!r}")
    return bool(value)


def check_search(num_beams, length_penalty, early_stopping, use_cache, length_penalty_form, forced_eos,
                 banned_ids, return_scores, vocab_size: int) -> tuple[int, ...]:
    """The decoding options of `generate`; returns the banned ids as a tuple of ints."""
    num_beams = _integer("num_beams", num_beams, "an int >= 1")
    if num_beams < 1:
        raise InputError("num_beams", f"must be an int >= 1, got {num_beams!r}")
    _number("length_penalty", length_penalty)
    if not any(early_stopping is option or (isinstance(option, str) and early_stopping == option)
               for option in EARLY_STOPPING):
        raise InputError("early_stopping", f"must be True, False or \"never\", got {early_stopping!r}")
    for name, value in (("use_cache", use_cache), ("forced_eos", forced_eos), ("return_scores", return_scores)):
        _flag(name, value)
    if length_penalty_form not in LENGTH_PENALTY_FORMS:
        raise InputError("length_penalty_form", f"must be one of {LENGTH_PENALTY_FORMS}, got {length_penalty_form!r}")
    if isinstance(banned_ids, (str, bytes)) or getattr(banned_ids, "shape", None) == ():
        raise InputError("banned_ids", f"must be a sequence of target token ids, got {banned_ids!r}")
    try:
        banned = tuple(banned_ids)
    except TypeError:
        raise InputError("banned_ids", f"must be a sequence of target token ids, got {banned_ids!r}") from None
    out = []
    for value in banned:
        what = f"target token ids in [0, {vocab_size})"
        value = _integer("banned_ids", value, "a sequence of " + what)
        if not 0 <= value < vocab_size:
            raise InputError("banned_ids", f"must hold {what}, got {value!r}")
        out.append(value)
    return tuple(out)


def check_processors(forced_bos_id, no_repeat_ngram_size, bad_words_ids, vocab_size: int, eos_id: int
                     ) -> tuple[int | None, int, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The options of the logits processors `generate` adds to the banned ids (Hugging Face's
    ForcedBOSTokenLogitsProcessor, NoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor).
    Returns (the forced first id or None, the n-gram size (0: off), the one-token bad words, the
    bad words of two tokens or more); a one-token bad word equal to the end id is dropped, as
    transformers drops it."""
    what = f"a target token id in [0, {vocab_size})"
    forced = None
    if forced_bos_id is not False:
        forced = _integer("forced_bos_id", forced_bos_id, what + ", or False for none")
        if not 0 <= forced < vocab_size:
            raise InputError("forced_bos_id", f"must be {what}, or False for none, got {forced!r}")
    size = _count("no_repeat_ngram_size", no_repeat_ngram_size)
    return (forced, size, *split_bad_words(_token_lists(bad_words_ids, vocab_size), eos_id))


def _count(name: str, value) -> int:
    """An int >= 0 where 0 turns a rule off (no_repeat_ngram_size, min_length, min_new_tokens)."""
    value = _integer(name, value, "an int >= 0 (0: off)")
    if value < 0:
        raise InputError(name, f"must be an int >= 0 (0: off), got {value!r}")
    return value


def check_min_length(min_length, min_new_tokens, recorded: dict) -> tuple[int, int]:
    """Hugging Face's MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor options, each
    an int >= 0 (0: off), the arguments given (None: not given) over the note's (`recorded`).
    Returns (min_length, min_new_tokens) of which the search applies both.

    As transformers' `_prepare_generated_length`, a min_new_tokens (given, or recorded and
    min_length not given) replaces min_length (transformers sets min_length = min_new_tokens +
    the start token's 1: the same rule), so min_length is then 0; an explicit min_length, where
    min_new_tokens is not given, wins over both recorded values (explicit arguments win)."""
    if min_new_tokens is None and min_length is None:
        min_new_tokens = recorded.get("min_new_tokens")
    if min_new_tokens is not None:
        if min_length is not None:
            _count("min_length", min_length)  # checked all the same
        return 0, _count("min_new_tokens", min_new_tokens)
    if min_length is None:
        min_length = recorded.get("min_length", 0)
    return _count("min_length", min_length), 0


def _token_lists(value, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """`bad_words_ids` as tuples of ints: a sequence of non-empty sequences of target token ids."""
    what = f"a list of non-empty lists of target token ids in [0, {vocab_size}) (Hugging Face's bad_words_ids)"

    def sequence(value, where: str) -> tuple:
        if isinstance(value, (str, bytes)) or getattr(value, "shape", None) == ():
            raise InputError("bad_words_ids", f"must be {what}; {where} is {value!r}")
        try:
            return tuple(value)
        except TypeError:
            raise InputError("bad_words_ids", f"must be {what}; {where} is {value!r}") from None

    out = []
    for i, words in enumerate(sequence(value, "it")):
        tokens = sequence(words, f"entry {i}")
        if not tokens:
            raise InputError("bad_words_ids", f"must be {what}; entry {i} is empty")
        word = tuple(_integer("bad_words_ids", token, what) for token in tokens)
        if not all(0 <= token < vocab_size for token in word):
            raise InputError("bad_words_ids", f"must be {what}; entry {i} is {list(word)!r}")
        out.append(word)
    return tuple(out)


def split_bad_words(words, eos_id: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Hugging Face's bad_words_ids as (the ids banned at every step, the words of two tokens or
    more, banned only where their prefix ends the sequence). A one-token word that is the end
    token is dropped, as NoBadWordsLogitsProcessor drops it."""
    words = [tuple(int(token) for token in word) for word in words]
    return (tuple(word[0] for word in words if len(word) == 1 and word[0] != eos_id),
            tuple(word for word in words if len(word) > 1))


# -- Arguments: the checkpoint's generation note, explicit arguments, checks ---------------------

# The arguments a checkpoint's "generation" note may give (Hugging Face's generation_config.json,
# read by `generation_note`) and the value each takes when neither the caller nor the note does;
# None means there is no default: the caller must pass it.
NOTE_DEFAULTS = {"max_len": "config.max_len", "bos_id": None, "eos_id": None, "num_beams": 1, "length_penalty": 1.0,
                 "forced_eos": False, "banned_ids": (), "bad_words_ids": (), "no_repeat_ngram_size": 0,
                 "forced_bos_id": False, "early_stopping": False}  # forced_bos_id False: no forced first token
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}


@dataclass(frozen=True)
class Generation:
    """Every argument of `generate`, resolved (note defaults filled in) and checked."""

    max_len: int
    bos_id: int
    eos_id: int
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    use_cache: bool = True
    length_penalty_form: str = "hf"
    forced_eos: bool = False
    banned_ids: tuple[int, ...] = ()  # every id banned at every step: banned_ids and one-token bad words
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # the bad words of two tokens or more
    no_repeat_ngram_size: int = 0
    forced_bos_id: int | None = None
    min_length: int = 0  # the end token is banned while the decoder input (start token included) is shorter
    min_new_tokens: int = 0  # the end token is banned while fewer tokens were generated
    return_scores: bool = False
    beam_rule: str = "hf"
    num_return_sequences: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def rows(self) -> int:
        """Decoder rows per source row: its beams, or its samples."""
        return self.num_return_sequences if self.do_sample else self.num_beams

    def search_options(self) -> dict:
        """The keyword arguments of `search` after (batch, max_len, bos_id, eos_id, pad_id)."""
        return {name: getattr(self, name) for name in (
            "num_beams", "length_penalty", "early_stopping", "length_penalty_form", "forced_eos", "banned_ids",
            "bad_words_ids", "no_repeat_ngram_size", "forced_bos_id", "min_length", "min_new_tokens", "beam_rule",
            "num_return_sequences", "do_sample", "temperature", "top_k", "top_p", "seed")}


# How many new tokens transformers' `generate` makes when a model's generation settings name neither
# max_length nor max_new_tokens (GenerationConfig().max_length is None; `_prepare_generated_length`:
# "by default let's always generate 20 new tokens"), its max_length, start token included, capped at
# max_position_embeddings (`hf_default_max_len`).
HF_DEFAULT_NEW_TOKENS = 20


def hf_default_max_len(config) -> int:
    """The tokens transformers' `generate` makes for `config` with no max_length or max_new_tokens
    set: `HF_DEFAULT_NEW_TOKENS`, with the start token at most max_position_embeddings (our
    max_len) long. T5's relative positions have no such table (its config has no
    max_position_embeddings), so only our own max_len bounds it."""
    positions = config.max_len if config.position == "relative" else config.max_len - 1
    return max(1, min(HF_DEFAULT_NEW_TOKENS, positions))


def generation_note(config) -> dict:
    """The decoding defaults a checkpoint records under its "generation" note (Hugging Face's
    generation_config.json names, see `conformance.convert.sources.GENERATION_KEYS`), as
    `generate` arguments: bos_id, eos_id, num_beams, length_penalty, early_stopping, max_len,
    forced_eos, forced_bos_id, no_repeat_ngram_size, min_length, min_new_tokens, and bad_words_ids
    split in two: its one-token words as banned_ids (without the end token, which transformers
    drops), the longer ones as bad_words_ids. An empty dict when there is no note."""
    import json

    from conformance.core.errors import ConfigError

    text = config.notes.get("generation")
    if not text:
        return {}
    try:
        recorded = json.loads(text)
    except ValueError:
        raise ConfigError("notes", "the checkpoint's \"generation\" note is not JSON") from None
    if not isinstance(recorded, dict):
        raise ConfigError("notes", "the checkpoint's \"generation\" note is not a JSON object")
    out = {}
    eos = recorded.get("eos_token_id")
    ends = eos if isinstance(eos, list) else [eos]
    if isinstance(eos, list):  # Hugging Face allows several end tokens; generate takes one
        eos = eos[0] if len(eos) == 1 else None
    for name, value in (("bos_id", recorded.get("decoder_start_token_id")), ("eos_id", eos),
                        ("num_beams", recorded.get("num_beams")), ("length_penalty", recorded.get("length_penalty")),
                        ("forced_bos_id", recorded.get("forced_bos_token_id")),
                        ("no_repeat_ngram_size", recorded.get("no_repeat_ngram_size")),
                        ("early_stopping", recorded.get("early_stopping")),
                        ("min_length", recorded.get("min_length")),  # both count as transformers does
                        ("min_new_tokens", recorded.get("min_new_tokens"))):
        if value is not None:
            out[name] = value
    if recorded.get("max_new_tokens") is not None:  # Hugging Face: it wins over max_length
        out["max_len"] = min(int(recorded["max_new_tokens"]), config.max_len)
    elif recorded.get("max_length") is not None:  # Hugging Face counts the start token
        out["max_len"] = min(int(recorded["max_length"]) - 1, config.max_len)
    else:  # neither: transformers' default number of new tokens
        out["max_len"] = hf_default_max_len(config)
    if recorded.get("forced_eos_token_id") is not None and recorded.get("forced_eos_token_id") == eos:
        out["forced_eos"] = True
    words = [words for words in recorded.get("bad_words_ids") or [] if isinstance(words, list) and words]
    banned = [word[0] for word in words if len(word) == 1 and word[0] not in ends]
    if banned:
        out["banned_ids"] = banned
    longer = [word for word in words if len(word) > 1]
    if longer:
        out["bad_words_ids"] = longer
    return out


class GenerationWarning(UserWarning):
    """A checkpoint's generation settings ask for something `generate` does not apply."""


def _sampling(fields) -> bool:
    return fields.get("do_sample") is True


# generation_config.json fields that change transformers' `generate` output and that `generate`
# does not apply, each with the test of whether its value (and the other fields) changes the
# output: the converter records those that do in the note, and warns (`unapplied_generation`).
UNAPPLIED_GENERATION = {
    "repetition_penalty": lambda v, f: v != 1,
    "encoder_repetition_penalty": lambda v, f: v != 1,
    "encoder_no_repeat_ngram_size": lambda v, f: v > 0,
    "suppress_tokens": lambda v, f: len(v) > 0,
    "begin_suppress_tokens": lambda v, f: len(v) > 0,
    "num_beam_groups": lambda v, f: v > 1,
    "diversity_penalty": lambda v, f: v != 0 and f.get("num_beam_groups", 1) > 1,
    "do_sample": lambda v, f: v is True,
    "temperature": lambda v, f: _sampling(f) and v != 1,
    "top_k": lambda v, f: _sampling(f) and v != 0,
    "top_p": lambda v, f: _sampling(f) and v < 1,
    "min_p": lambda v, f: _sampling(f) and v > 0,
    "top_h": lambda v, f: _sampling(f),
    "typical_p": lambda v, f: _sampling(f) and v < 1,
    "epsilon_cutoff": lambda v, f: _sampling(f) and 0 < v < 1,
    "eta_cutoff": lambda v, f: _sampling(f) and 0 < v < 1,
    "renormalize_logits": lambda v, f: v is True,
    "exponential_decay_length_penalty": lambda v, f: True,
    "sequence_bias": lambda v, f: len(v) > 0,
    "constraints": lambda v, f: len(v) > 0,
    "force_words_ids": lambda v, f: len(v) > 0,
    "guidance_scale": lambda v, f: v != 1,
    "penalty_alpha": lambda v, f: v > 0,
    "stop_strings": lambda v, f: len(v) > 0,
    "num_return_sequences": lambda v, f: v > 1,
}


def unapplied_generation(fields) -> dict:
    """The fields of a generation_config.json (Hugging Face's names; None: unset) that change
    transformers' output and that `generate` does not apply (`UNAPPLIED_GENERATION`), with their
    values, in that table's order. A value the test cannot read (a string for a number) counts."""
    out = {}
    for name, changes in UNAPPLIED_GENERATION.items():
        value = fields.get(name)
        if value is None:
            continue
        try:
            bites = bool(changes(value, fields))
        except (TypeError, ValueError):
            bites = True
        if bites:
            out[name] = value
    return out


def resolve(config, max_len=None, bos_id=None, eos_id=None, *, num_beams=None, length_penalty=None,
            early_stopping=None, use_cache=True, length_penalty_form=None, forced_eos=None, banned_ids=None,
            bad_words_ids=None, no_repeat_ngram_size=None, forced_bos_id=None, min_length=None, min_new_tokens=None,
            return_scores=False, beam_rule="hf", num_return_sequences=1, do_sample=False, temperature=None, top_k=None,
            top_p=None, seed=None) -> Generation:
    """`generate`'s arguments as a checked `Generation`. An argument left at None takes the
    checkpoint's generation note (`generation_note`), as transformers applies a model's
    generation_config, else its plain default (`NOTE_DEFAULTS`); explicit arguments win. bos_id
    and eos_id have no plain default: without a note they must be given. An explicit
    bad_words_ids replaces the note's whole list, its one-token words (banned_ids) included, as
    transformers' argument replaces generation_config's; forced_bos_id=False turns off a forced
    first token the note records. The note's early_stopping applies to beam_rule="hf" only (the
    flax rule has its own stopping rule); min_length and min_new_tokens: `check_min_length`."""
    recorded = generation_note(config)
    if bad_words_ids is not None and banned_ids is None:
        banned_ids = ()
    given = dict(max_len=max_len, bos_id=bos_id, eos_id=eos_id, num_beams=num_beams, length_penalty=length_penalty,
                 forced_eos=forced_eos, banned_ids=banned_ids, bad_words_ids=bad_words_ids,
                 no_repeat_ngram_size=no_repeat_ngram_size, forced_bos_id=forced_bos_id)
    if early_stopping is None:
        early_stopping = recorded.get("early_stopping", NOTE_DEFAULTS["early_stopping"]) if beam_rule == "hf" else False
    values = {}
    for name, value in given.items():
        if value is None:
            value = recorded.get(name, NOTE_DEFAULTS[name])
        if value is None:
            where = "its \"generation\" note does not say it" if recorded else "it has no \"generation\" note"
            raise InputError(name, f"was not given and the checkpoint does not record it ({where}): pass it")
        values[name] = config.max_len if isinstance(value, str) and value == "config.max_len" else value
    vocab = config.tgt_vocab_size
    values["max_len"] = _integer("max_len", values["max_len"], f"an int in [1, {config.max_len}] (the model's max_len)")
    if not 1 <= values["max_len"] <= config.max_len:
        raise InputError("max_len", f"must be an int in [1, {config.max_len}] (the model's max_len), "
                                    f"got {values['max_len']!r}")
    for name in ("bos_id", "eos_id"):
        values[name] = _integer(name, values[name], f"a target token id in [0, {vocab})")
        if not 0 <= values[name] < vocab:
            raise InputError(name, f"must be a target token id in [0, {vocab}), got {values[name]!r}")
    if beam_rule not in BEAM_RULES:
        raise InputError("beam_rule", f"must be one of {BEAM_RULES}, got {beam_rule!r}")
    form = RULE_PENALTY_FORMS[beam_rule] if length_penalty_form is None else length_penalty_form
    banned = check_search(values["num_beams"], values["length_penalty"], early_stopping, use_cache, form,
                          values["forced_eos"], values["banned_ids"], return_scores, vocab)
    forced_bos, ngram, one_token, words = check_processors(values["forced_bos_id"], values["no_repeat_ngram_size"],
                                                           values["bad_words_ids"], vocab, values["eos_id"])
    banned = tuple(dict.fromkeys(banned + one_token))  # in order, once each
    shortest, new_tokens = check_min_length(min_length, min_new_tokens, recorded)
    beams = _integer("num_beams", values["num_beams"])
    if beams > 1 and vocab < 2:  # the best 2 x num_beams of num_beams x V candidates: V >= 2
        raise InputError("num_beams", f"beam search keeps the best 2 x num_beams of num_beams x V candidates, so it "
                                      f"needs a target vocabulary of at least 2 ids; this model's has {vocab}; got "
                                      f"num_beams={beams}")
    sampling = check_sampling(do_sample, temperature, top_k, top_p, seed, beams, beam_rule)
    count = _integer("num_return_sequences", num_return_sequences, "an int >= 1")
    if count < 1:
        raise InputError("num_return_sequences", f"must be an int >= 1, got {count!r}")
    if not sampling["do_sample"]:
        most, why = ((1, "the flax rule returns each row's best hypothesis, as Flax's beam_search callers take it")
                     if beam_rule == "flax" else
                     (1, "greedy search has one sequence per row (use num_beams or do_sample)") if beams == 1 else
                     (beams, f"beam search keeps {beams} beams"))
        if count > most:
            raise InputError("num_return_sequences", f"must be at most {most}: {why}; got {count!r}")
    if beam_rule == "flax" and early_stopping is not False:
        raise InputError("early_stopping", "applies to beam_rule=\"hf\" only: the flax rule stops as Flax's "
                                           f"beam_search does (docs/decoding.md), got {early_stopping!r}")
    _check_pad_clash(config, values["bos_id"])
    return Generation(max_len=values["max_len"], bos_id=values["bos_id"], eos_id=values["eos_id"], num_beams=beams,
                      length_penalty=float(values["length_penalty"]), early_stopping=early_stopping,
                      use_cache=bool(use_cache), length_penalty_form=form, forced_eos=bool(values["forced_eos"]),
                      banned_ids=banned, bad_words_ids=words, no_repeat_ngram_size=ngram, forced_bos_id=forced_bos,
                      min_length=shortest, min_new_tokens=new_tokens, return_scores=bool(return_scores),
                      beam_rule=beam_rule,
                      num_return_sequences=count, **sampling)


def check_sampling(do_sample, temperature, top_k, top_p, seed, num_beams: int, beam_rule: str) -> dict:
    """do_sample and its warpers (Hugging Face's TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper): temperature > 0, top_k >= 0 (0 keeps every id), 0 < top_p <= 1, seed
    an int >= 0 or None (fresh entropy). Given without do_sample=True they are refused."""
    do_sample = _flag("do_sample", do_sample)
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    if not do_sample:
        extra = [name for name, value in given.items()
                 if value is not None and not (type(value) in (int, float) and value == SAMPLING[name])]
        if extra:
            raise InputError(extra[0], "applies only with do_sample=True (greedy and beam search do not sample)")
        return {"do_sample": False}
    if num_beams != 1:
        raise InputError("num_beams", f"must be 1 with do_sample=True (beam sampling is not supported), got {num_beams}")
    if beam_rule != "hf":
        raise InputError("beam_rule", "the flax rule is a beam search; do_sample=True samples instead")
    out = {"do_sample": True, **{name: SAMPLING[name] if value is None else value for name, value in given.items()}}
    out["temperature"] = _number("temperature", out["temperature"])
    if out["temperature"] <= 0:
        raise InputError("temperature", f"must be a number > 0 (logits are divided by it), got {temperature!r}")
    out["top_k"] = _integer("top_k", out["top_k"], "an int >= 0 (0 keeps every id)")
    if out["top_k"] < 0:
        raise InputError("top_k", f"must be an int >= 0 (0 keeps every id), got {top_k!r}")
    out["top_p"] = _number("top_p", out["top_p"])
    if not 0 < out["top_p"] <= 1:
        raise InputError("top_p", f"must be a number in (0, 1] (1 keeps every id), got {top_p!r}")
    if out["seed"] is not None:
        out["seed"] = _integer("seed", out["seed"], "an int >= 0 or None")
        if out["seed"] < 0:
            raise InputError("seed", f"must be an int >= 0 or None, got {seed!r}")
    return out


def _check_pad_clash(config, bos_id: int) -> None:
    """A start token that is the pad id is masked as a key by target padding: refused unless
    tgt_pad_mask="none" (Marian's and Flax wmt's choice). docs/decoding.md, "Special ids"."""
    if bos_id == config.pad_id and config.tgt_pad_mask != "none":
        raise InputError("bos_id", f"is the pad id {config.pad_id}: with tgt_pad_mask={config.tgt_pad_mask!r} the "
                                   "start token would be masked as padding, so no query could read it; decoding "
                                   "from the pad id needs tgt_pad_mask=\"none\" (docs/decoding.md)")


def check_sources(src_mask: np.ndarray) -> None:
    """A source row of padding only has nothing to translate: refused (docs/decoding.md).
    `src_mask` is the encoder's source mask on the host, (B, ...) with True at real positions."""
    src_mask = np.asarray(src_mask)
    empty = np.flatnonzero(~src_mask.reshape(len(src_mask), -1).any(axis=1))
    if len(empty):
        raise InputError("src_ids", f"row {int(empty[0])} is all padding: there is nothing to decode from; drop the row")


# -- The logits processors ----------------------------------------------------------------------


@dataclass(frozen=True)
class Processors:
    """Hugging Face's logits processors that `generate` supports, resolved. `_processed` applies
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


def _processed(scores: np.ndarray, tokens: np.ndarray, step: int, processors: Processors) -> np.ndarray:
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


# -- The search --------------------------------------------------------------------------------


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
           min_length: int = 0, min_new_tokens: int = 0, beam_rule: str = "hf", num_return_sequences: int = 1, do_sample: bool = False, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           as_numpy: Callable[[Any], np.ndarray] = np.asarray,
           trace: list | None = None, mask_fill: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy (num_beams=1), beam search (Hugging Face's rule, or Flax's with beam_rule="flax")
    or sampling (do_sample=True). Returns the best `num_return_sequences` sequences per source
    row after `bos_id` (best first; samples in the order drawn), (batch * num_return_sequences, n)
    int64 with n <= max_len, padded with `pad_id` after the end token, and their scores (.,)
    float64: the summed log-probabilities divided by `penalty(length)`.

    `step` gets batch * num_beams rows (beam search) or batch * num_return_sequences (sampling:
    each source row repeated), in source order. The options are checked by `resolve`. The logits
    processors (`Processors`): `banned_ids`, Hugging Face's `bad_words_ids` (a one-token word is
    banned everywhere, except the end token, which transformers drops), `no_repeat_ngram_size`,
    `min_length` and `min_new_tokens` (the end token banned while the decoder input, start token
    included, is shorter than min_length, or fewer than min_new_tokens tokens were generated),
    `forced_bos_id` and `forced_eos`.

    `trace`, a list, receives per step the closest call of each source row, for the conformance
    suite: {"gap": (B,), "scale": (B,)}, the smallest score difference between two candidates
    whose order decided something (greedy: the best two tokens; beam search: neighbours among the
    ranked candidates and finished hypotheses; sampling: the distance between the uniform and the
    nearest edge of the cumulative distribution, or of top_k's and top_p's thresholds,
    `filter_gap`), and max(1, largest |logit|) of the row's beams (or sampled row).

    `mask_fill`, the model's (None without one), picks the causes that NaN logits of an open row
    are blamed on (`nan_error`, raised as a `NaNLogitsError`).
    """
    one_token, words = split_bad_words(bad_words_ids, eos_id)
    processors = Processors(max_len=max_len, eos_id=eos_id, banned_ids=tuple(banned_ids) + one_token,
                            bad_words_ids=words, no_repeat_ngram_size=no_repeat_ngram_size,
                            min_length=min_length, min_new_tokens=min_new_tokens,
                            forced_bos_id=forced_bos_id, forced_eos=forced_eos)
    if do_sample:
        return _sample(step, batch * num_return_sequences, max_len, bos_id, eos_id, pad_id, length_penalty,
                       length_penalty_form, processors, temperature, top_k, top_p, seed, as_numpy, trace,
                       mask_fill=mask_fill)
    if beam_rule == "flax":
        return _beam_flax(step, batch, max_len, bos_id, eos_id, pad_id, num_beams, length_penalty,
                          length_penalty_form, processors, as_numpy, trace, mask_fill=mask_fill)
    if num_beams == 1:
        return _greedy(step, batch, max_len, bos_id, eos_id, pad_id, length_penalty, length_penalty_form,
                       processors, as_numpy, trace, mask_fill=mask_fill)
    return _beam(step, batch, max_len, bos_id, eos_id, pad_id, num_beams, length_penalty, early_stopping,
                 length_penalty_form, processors, as_numpy, trace, num_return_sequences, mask_fill=mask_fill)


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


def _greedy(step, batch, max_len, bos_id, eos_id, pad_id, length_penalty, form, processors, as_numpy, trace=None, *,
            mask_fill=None):
    tokens = np.full((batch, 1), bos_id, dtype=np.int64)  # (B, 1)
    done = np.zeros(batch, dtype=bool)
    summed = np.zeros(batch)
    lengths = np.zeros(batch, dtype=np.int64)
    for i in range(max_len):
        logits = np.array(as_numpy(step(tokens, None)), dtype=np.float64)  # (B, V)
        _check_finite(logits, ~done, i, mask_fill)
        log_probs = _processed(log_softmax(logits), tokens, i, processors)
        if trace is not None:
            trace.append({"gap": np.where(done, np.inf, _neighbour_gap(log_probs, 1)), "scale": _scale(logits)})
        logits = _processed(logits, tokens, i, processors)
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
    device searches take the same array (conformance.core.device_search.sampling_data)."""
    return np.random.default_rng(seed).random((max_len, rows))


def _sample(step, rows, max_len, bos_id, eos_id, pad_id, length_penalty, form, processors, temperature, top_k,
            top_p, seed, as_numpy, trace=None, *, mask_fill=None):
    """Multinomial sampling (Hugging Face's `_sample` with do_sample=True): at every step the
    processed logits are warped (`warp`), turned into float64 probabilities, and each open row
    draws its next id with one uniform. The uniforms, (max_len, rows), are drawn once up front
    from np.random.default_rng(seed) (`uniforms`), so every backend draws the same ids from the same logits."""
    drawn_uniforms = uniforms(seed, max_len, rows)  # step i uses drawn_uniforms[i]
    tokens = np.full((rows, 1), bos_id, dtype=np.int64)  # (N, 1)
    done = np.zeros(rows, dtype=bool)
    summed = np.zeros(rows)
    lengths = np.zeros(rows, dtype=np.int64)
    for i in range(max_len):
        logits = np.array(as_numpy(step(tokens, None)), dtype=np.float64)  # (N, V)
        _check_finite(logits, ~done, i, mask_fill)
        log_probs = _processed(log_softmax(logits), tokens, i, processors)
        processed = _processed(logits, tokens, i, processors)
        drawn, gap = draw(np.exp(log_softmax(warp(processed, temperature, top_k, top_p))), drawn_uniforms[i])
        if trace is not None:
            gap = np.minimum(gap, filter_gap(processed, temperature, top_k, top_p))
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


def _beam(step, batch, max_len, bos_id, eos_id, pad_id, num_beams, length_penalty, early_stopping, form,
          processors, as_numpy, trace=None, returned=1, *, mask_fill=None):
    """Hugging Face's beam search (transformers 5.x `_beam_search`), docs/decoding.md."""
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
        _check_finite(logits, np.ones(len(logits), dtype=bool), length - 1, mask_fill)
        vocab = logits.shape[-1]
        log_probs = _processed(log_softmax(logits), tokens, length - 1, processors)
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
    n = int(finished_lengths[:, :returned].max())
    return finished[:, :returned, 1:1 + n].reshape(batch * returned, n), finished_scores[:, :returned].reshape(-1)


def _beam_flax(step, batch, max_len, bos_id, eos_id, pad_id, num_beams, length_penalty, form, processors, as_numpy,
               trace=None, *, mask_fill=None):
    """Flax examples/wmt `decode.beam_search` (also t5x and MLCommons AlgoPerf's wmt decode.py),
    with Flax's `max_decode_len` = max_len + 1 (its sequences hold the start token). It differs
    from `_beam` in three places (docs/decoding.md):
    - every end token among the best 2 x beams candidates enters the finished set;
    - reaching max_len is not an end: an open beam is returned only by a row with no finished one;
    - the search stops at max_len, or once in every row each of the `beams` finished slots is
      filled and beats the best open beam scored at max_decode_len (one condition for the batch).
    """
    beams, keep = num_beams, 2 * num_beams
    width = max_len + 1  # Flax's max_decode_len: the start token and at most max_len generated ones
    live = np.full((batch, beams, width), pad_id, dtype=np.int64)  # (B, beams, 1 + max_len)
    live[:, :, 0] = bos_id
    live_scores = np.zeros((batch, beams))
    live_scores[:, 1:] = NEG  # every beam starts as a copy of the first: only its candidates count
    finished = live.copy()
    finished_scores = np.full((batch, beams), NEG)
    finished_lengths = np.zeros((batch, beams), dtype=np.int64)
    flags = np.zeros((batch, beams), dtype=bool)  # Flax's finished_flags: the slot holds a hypothesis
    parents = None
    length = 1  # decoder input length, the start token included (Flax's cur_index + 1)
    while True:
        tokens = live[:, :, :length].reshape(batch * beams, length)  # (N, t)
        logits = np.array(as_numpy(step(tokens, parents)), dtype=np.float64)  # (N, V)
        _check_finite(logits, np.ones(len(logits), dtype=bool), length - 1, mask_fill)
        vocab = logits.shape[-1]
        log_probs = _processed(log_softmax(logits), tokens, length - 1, processors)
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
        scored = candidate_scores / penalty(length, length_penalty, form) + ~ends * NEG
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
        best_open = live_scores[:, :1] / penalty(width, length_penalty, form)  # (B, 1)
        worst = np.where(flags, finished_scores.min(axis=1, keepdims=True), NEG)
        if (worst > best_open).all():
            break
    # A row without a finished hypothesis returns its best open beam, scored by its plain sum.
    some = flags.any(axis=1)
    ids = np.where(some[:, None], finished[:, 0], live[:, 0])  # (B, width)
    lengths = np.where(some, finished_lengths[:, 0], length - 1)
    n = int(lengths.max())
    return ids[:, 1:1 + n], np.where(some, finished_scores[:, 0], live_scores[:, 0])
