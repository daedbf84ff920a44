"""`generate`'s arguments: their checks, and their resolution against the checkpoint's note.

Every backend's `generate` calls `resolve` first: an argument left at None takes the checkpoint's
generation note (`conformance.core.generation.note`), then every argument is checked, with the
same `InputError` from every backend, and the result is one frozen `Generation`. The semantics are
docs/decoding.md's.

Framework-free (NumPy and the standard library).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from conformance.core.errors import InputError
from conformance.core.generation.note import generation_note, warn_unapplied, whisper_max_len


EARLY_STOPPING = (True, False, "never")


LENGTH_PENALTY_FORMS = ("hf", "gnmt")


BEAM_RULES = ("hf", "flax", "openai")


# The penalty each beam rule uses when `length_penalty_form` is not given (openai-whisper's
# `length_penalty=None` is a plain division by the length: "hf" with alpha 1).
RULE_PENALTY_FORMS = {"hf": "hf", "flax": "gnmt", "openai": "hf"}


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


def check_penalties(repetition_penalty, encoder_repetition_penalty, encoder_no_repeat_ngram_size,
                    exponential_decay_length_penalty, suppress_tokens, begin_suppress_tokens, renormalize_logits,
                    vocab_size: int) -> dict:
    """The options of the logits processors transformers adds for the generation configs users
    ship (RepetitionPenaltyLogitsProcessor, EncoderRepetitionPenaltyLogitsProcessor,
    EncoderNoRepeatNGramLogitsProcessor, ExponentialDecayLengthPenalty, SuppressTokensLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor, LogitNormalization), each already resolved against the
    note: the two penalties numbers > 0 (1: off), the n-gram size an int >= 0 (0: off), the decay
    a pair (start, factor), an int >= 0 and a number > 0, or False (off), the token lists
    target ids, renormalize_logits True or False."""
    out = {}
    for name, value in (("repetition_penalty", repetition_penalty),
                        ("encoder_repetition_penalty", encoder_repetition_penalty)):
        out[name] = _number(name, value)
        if out[name] <= 0:
            raise InputError(name, f"must be a number > 0 (1: off; above 1 discourages the ids it applies to), "
                                   f"got {value!r}")
    out["encoder_no_repeat_ngram_size"] = _count("encoder_no_repeat_ngram_size", encoder_no_repeat_ngram_size)
    decay = exponential_decay_length_penalty
    if decay is False or decay is None:
        out["exponential_decay_length_penalty"] = None
    else:
        what = "a pair (start, factor): an int >= 0 and a number > 0, or False for none"
        if isinstance(decay, (str, bytes)) or getattr(decay, "shape", None) == ():
            raise InputError("exponential_decay_length_penalty", f"must be {what}, got {decay!r}")
        try:
            pair = tuple(decay)
        except TypeError:
            raise InputError("exponential_decay_length_penalty", f"must be {what}, got {decay!r}") from None
        if len(pair) != 2:
            raise InputError("exponential_decay_length_penalty", f"must be {what}, got {decay!r}")
        start = _integer("exponential_decay_length_penalty", pair[0], what)
        factor = _number("exponential_decay_length_penalty", pair[1])
        if start < 0 or factor <= 0:
            raise InputError("exponential_decay_length_penalty", f"must be {what}, got {decay!r}")
        out["exponential_decay_length_penalty"] = (start, factor)
    for name, value in (("suppress_tokens", suppress_tokens), ("begin_suppress_tokens", begin_suppress_tokens)):
        out[name] = _token_ids(name, value, vocab_size)
    out["renormalize_logits"] = _flag("renormalize_logits", renormalize_logits)
    return out


def check_forced_not_suppressed(suppress_tokens: tuple[int, ...], forced_bos_id: int | None, forced_eos: bool,
                                eos_id: int) -> None:
    """A forced token (the first, or the end at the last step) that suppress_tokens also bans
    leaves every id of that step at -inf: refused, as transformers' GenerationConfig.validate
    refuses it (a ValueError there; an InputError on suppress_tokens here)."""
    for forced, what, advice in (
            (forced_bos_id, "the forced first token (forced_bos_id)", "pass forced_bos_id=False"),
            (eos_id if forced_eos else None, "the end token, which forced_eos forces at the last step",
             "pass forced_eos=False (to keep the end token from coming early, use min_new_tokens)")):
        if forced is not None and forced in suppress_tokens:
            raise InputError("suppress_tokens", f"holds {forced}, {what}: forcing a token while suppressing it leaves "
                                                f"every id of that step at -inf; remove it from suppress_tokens or "
                                                f"{advice}")


def _token_ids(name: str, value, vocab_size: int) -> tuple[int, ...]:
    """A sequence of target token ids (suppress_tokens, begin_suppress_tokens), in order, once each."""
    what = f"a sequence of target token ids in [0, {vocab_size})"
    if isinstance(value, (str, bytes)) or getattr(value, "shape", None) == ():
        raise InputError(name, f"must be {what}, got {value!r}")
    try:
        values = tuple(value)
    except TypeError:
        raise InputError(name, f"must be {what}, got {value!r}") from None
    ids = tuple(_integer(name, token, what) for token in values)
    if not all(0 <= token < vocab_size for token in ids):
        raise InputError(name, f"must hold target token ids in [0, {vocab_size}), got {list(ids)!r}")
    return tuple(dict.fromkeys(ids))


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



def check_whisper(recorded: dict, prefix, return_timestamps, max_initial_timestamp_index, return_no_speech_prob,
                  vocab_size: int, eos_id: int, pad_id: int, forced_bos_id) -> dict:
    """Whisper's decoding options (transformers' WhisperGenerationMixin, openai-whisper's
    DecodingTask), each given, else from the note (`recorded`, `generation_note`'s):

    prefix             the forced prompt after the start token: target ids, None where the step's
                       best language id (of the note's lang_to_id) is taken (detection); not the
                       end or pad id. Not given: the note's Whisper prompt (`note.whisper_prompt`
                       under this call's return_timestamps), else none.
    return_timestamps  True or False: the timestamp rules; they need the note's
                       no_timestamps_token_id (the timestamps are the ids after it), and a prefix
                       that does not end with it.
    max_initial_timestamp_index  an int >= 0, or None for no bound on the first timestamp.
    return_no_speech_prob  True or False: the probability of the no-speech id (the no-timestamps
                       id - 1) at the start token's position, returned with the ids.

    A prefix and a forced first token (forced_bos_id) both force the first token: refused
    together."""
    whisper = "prefixes" in recorded  # a Whisper note (`note.whisper_note`)
    timestamps = _flag("return_timestamps", recorded.get("return_timestamps", False) if return_timestamps is None
                       else return_timestamps)
    no_speech = _flag("return_no_speech_prob", return_no_speech_prob)
    no_timestamps = recorded.get("no_timestamps_token_id")
    what = f"target token ids in [0, {vocab_size})"
    if no_timestamps is not None:
        no_timestamps = _integer("notes", no_timestamps, "an int")
    if (timestamps or no_speech) and no_timestamps is None:
        name = "return_timestamps" if timestamps else "return_no_speech_prob"
        raise InputError(name, "needs the checkpoint's no_timestamps_token_id (a Whisper generation note: the "
                               "timestamps are the ids after it, the no-speech id the one before it); this "
                               "checkpoint records none")
    if timestamps and not 0 <= no_timestamps < vocab_size - 1:
        raise InputError("return_timestamps", f"the note's no_timestamps_token_id {no_timestamps} leaves no timestamp "
                                              f"id below the vocabulary's {vocab_size}")
    if no_speech and not 1 <= no_timestamps <= vocab_size:
        raise InputError("return_no_speech_prob", f"the note's no_timestamps_token_id {no_timestamps} puts the "
                                                  f"no-speech id outside the vocabulary of {vocab_size}")
    if prefix is None:
        prefix = recorded["prefixes"][timestamps] if whisper else ()
    elif isinstance(prefix, (str, bytes)) or getattr(prefix, "shape", None) == ():
        raise InputError("prefix", f"must be a sequence of {what} (None: the detected language), got {prefix!r}")
    try:
        prefix = tuple(prefix)
    except TypeError:
        raise InputError("prefix", f"must be a sequence of {what} (None: the detected language), got "
                                   f"{prefix!r}") from None
    prefix = tuple(None if token is None else _integer("prefix", token, f"a sequence of {what}") for token in prefix)
    for token in prefix:
        if token is not None and not 0 <= token < vocab_size:
            raise InputError("prefix", f"must hold {what}, got {list(prefix)!r}")
        if token is not None and token in (eos_id, pad_id):
            raise InputError("prefix", f"holds the {'end' if token == eos_id else 'pad'} id {token}: a forced "
                                       "prompt is read by the decoder, not ended or masked")
    languages = tuple(recorded.get("language_ids", ()))
    if None in prefix and not languages:
        raise InputError("prefix", "has None, a language to detect, but the checkpoint's note records no lang_to_id "
                                   "to choose among: give the language id")
    if timestamps and prefix and prefix[-1] == no_timestamps:
        raise InputError("prefix", f"ends with the no-timestamps id {no_timestamps}, which asks for no timestamps, "
                                   "and return_timestamps=True: drop one")
    if prefix and forced_bos_id is not None:
        raise InputError("forced_bos_id", f"forces the first token, and so does prefix={list(prefix)!r}: give one")
    initial = recorded.get("max_initial_timestamp_index") if max_initial_timestamp_index is None \
        else max_initial_timestamp_index
    if initial is not None and initial is not False:
        # 0 is the tightest bound (the first timestamp is <|0.00|>), not "off": None or False is
        what = "an int >= 0 (the first timestamp's bound), or None for no bound"
        initial = _integer("max_initial_timestamp_index", initial, what)
        if initial < 0:
            raise InputError("max_initial_timestamp_index", f"must be {what}, got {initial!r}")
    else:
        initial = None
    return {"prefix": prefix, "language_ids": languages if None in prefix else (), "return_timestamps": timestamps,
            "no_timestamps_id": no_timestamps, "max_initial_timestamp_index": initial,
            "return_no_speech_prob": no_speech}


def check_patience(patience, beam_rule: str, num_beams: int) -> float:
    """openai-whisper's beam search patience (arXiv:2204.05424): the search ends once
    round(num_beams x patience) hypotheses have finished in every row. A number > 0 (None: 1.0),
    for beam_rule="openai" only."""
    if patience is None:
        return 1.0
    if beam_rule != "openai":
        raise InputError("patience", f"applies to beam_rule=\"openai\" (openai-whisper's beam search), got "
                                     f"beam_rule={beam_rule!r}")
    value = _number("patience", patience)
    if value <= 0 or round(num_beams * value) < 1:
        raise InputError("patience", f"must be a number > 0 with round(num_beams x patience) >= 1 finished "
                                     f"hypotheses to wait for, got {patience!r} with num_beams={num_beams}")
    return value


# The arguments a checkpoint's "generation" note may give (Hugging Face's generation_config.json,
# read by `generation_note`) and the value each takes when neither the caller nor the note does;
# None means there is no default: the caller must pass it.
NOTE_DEFAULTS = {"max_len": "config.max_len", "bos_id": None, "eos_id": None, "num_beams": 1, "length_penalty": 1.0,
                 "forced_eos": False, "banned_ids": (), "bad_words_ids": (), "no_repeat_ngram_size": 0,
                 "forced_bos_id": False, "early_stopping": False,  # forced_bos_id False: no forced first token
                 "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
                 "exponential_decay_length_penalty": False, "suppress_tokens": (), "begin_suppress_tokens": (),
                 "renormalize_logits": False}

# The processors' arguments that `check_penalties` checks (each from the note unless given).
PENALTY_ARGUMENTS = ("repetition_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
                     "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
                     "renormalize_logits")


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
    repetition_penalty: float = 1.0  # on the ids of the decoder input so far (1: off)
    encoder_repetition_penalty: float = 1.0  # on the ids of the row's source, its padding included (1: off)
    encoder_no_repeat_ngram_size: int = 0  # no n-gram of the row's source in the output (0: off)
    exponential_decay_length_penalty: tuple[int, float] | None = None  # (start, factor) on the end token
    suppress_tokens: tuple[int, ...] = ()  # banned at every step, after the forced tokens
    begin_suppress_tokens: tuple[int, ...] = ()  # banned at `begin_suppress_step`
    renormalize_logits: bool = False  # a log-softmax after every other processor
    return_scores: bool = False
    beam_rule: str = "hf"
    num_return_sequences: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    prefix: tuple[int | None, ...] = ()  # forced after the start token (None: the detected language)
    language_ids: tuple[int, ...] = ()  # what a None of the prefix is chosen among (the note's lang_to_id)
    return_timestamps: bool = False  # Whisper's timestamp rules
    no_timestamps_id: int | None = None  # the note's no_timestamps_token_id: timestamps follow it
    max_initial_timestamp_index: int | None = None  # the first timestamp's bound (None: none)
    return_no_speech_prob: bool = False  # P(no-speech id) at the start token's position, returned
    patience: float = 1.0  # beam_rule="openai": wait for round(num_beams x patience) finished

    @property
    def rows(self) -> int:
        """Decoder rows per source row: its beams, or its samples."""
        return self.num_return_sequences if self.do_sample else self.num_beams

    @property
    def prompt_len(self) -> int:
        """The forced prompt's length (`prefix`): the steps before the search chooses."""
        return len(self.prefix)

    @property
    def begin_suppress_step(self) -> int:
        """The step at which `begin_suppress_tokens` are banned: the first generated token, the
        second when a first token is forced (transformers' begin_index, `_get_logits_processor`),
        or the first after a forced prompt (Whisper's begin_index, the prompt's length)."""
        if self.prefix:
            return self.prompt_len
        return 0 if self.forced_bos_id is None else 1

    @property
    def reads_source(self) -> bool:
        """Whether a processor reads the source ids (the encoder's repetition penalty and n-grams)."""
        return self.encoder_repetition_penalty != 1.0 or self.encoder_no_repeat_ngram_size > 0

    def search_options(self) -> dict:
        """The keyword arguments of `search` after (batch, max_len, bos_id, eos_id, pad_id)."""
        return {name: getattr(self, name) for name in (
            "num_beams", "length_penalty", "early_stopping", "length_penalty_form", "forced_eos", "banned_ids",
            "bad_words_ids", "no_repeat_ngram_size", "forced_bos_id", "min_length", "min_new_tokens",
            *PENALTY_ARGUMENTS, "beam_rule", "num_return_sequences", "do_sample", "temperature", "top_k", "top_p",
            "seed", *WHISPER_ARGUMENTS)}

    def returned(self, ids, scores, no_speech):
        """What `generate` returns: the ids, with their scores (return_scores) and each source row's
        no-speech probability (return_no_speech_prob) after them, in that order."""
        out = (ids,) + ((scores,) if self.return_scores else ()) + ((no_speech,) if self.return_no_speech_prob else ())
        return out[0] if len(out) == 1 else out


# Whisper's options (`check_whisper`, `check_patience`), as `search` takes them.
WHISPER_ARGUMENTS = ("prefix", "language_ids", "return_timestamps", "no_timestamps_id", "max_initial_timestamp_index",
                     "return_no_speech_prob", "patience")


def resolve(config, max_len=None, bos_id=None, eos_id=None, *, num_beams=None, length_penalty=None,
            early_stopping=None, use_cache=True, length_penalty_form=None, forced_eos=None, banned_ids=None,
            bad_words_ids=None, no_repeat_ngram_size=None, forced_bos_id=None, min_length=None, min_new_tokens=None,
            return_scores=False, beam_rule="hf", num_return_sequences=1, do_sample=False, temperature=None, top_k=None,
            top_p=None, seed=None, repetition_penalty=None, encoder_repetition_penalty=None,
            encoder_no_repeat_ngram_size=None, exponential_decay_length_penalty=None, suppress_tokens=None,
            begin_suppress_tokens=None, renormalize_logits=None, prefix=None, return_timestamps=None,
            max_initial_timestamp_index=None, return_no_speech_prob=False, patience=None) -> Generation:
    """`generate`'s arguments as a checked `Generation`. An argument left at None takes the
    checkpoint's generation note (`generation_note`), as transformers applies a model's
    generation_config, else its plain default (`NOTE_DEFAULTS`); explicit arguments win. bos_id
    and eos_id have no plain default: without a note they must be given. An explicit
    bad_words_ids replaces the note's whole list, its one-token words (banned_ids) included, as
    transformers' argument replaces generation_config's; forced_bos_id=False turns off a forced
    first token the note records. The note's early_stopping applies to beam_rule="hf" only (the
    flax and openai rules have their own stopping rules); min_length and min_new_tokens:
    `check_min_length`; the penalties, suppressions and renormalization (`check_penalties`) as
    the others: exponential_decay_length_penalty=False, suppress_tokens=() and the like turn off
    the note's. Whisper's prompt, timestamps and no-speech probability: `check_whisper` (a
    Whisper note's max_len counts after its prompt, `note.whisper_max_len`); openai-whisper's
    beam search, beam_rule="openai" with `patience`: `check_patience`.

    A note that records settings transformers applies and `generate` does not is named in a
    `GenerationWarning` at every call (`warn_unapplied`)."""
    recorded = generation_note(config)
    warn_unapplied(config)
    if bad_words_ids is not None and banned_ids is None:
        banned_ids = ()
    given = dict(max_len=max_len, bos_id=bos_id, eos_id=eos_id, num_beams=num_beams, length_penalty=length_penalty,
                 forced_eos=forced_eos, banned_ids=banned_ids, bad_words_ids=bad_words_ids,
                 no_repeat_ngram_size=no_repeat_ngram_size, forced_bos_id=forced_bos_id,
                 repetition_penalty=repetition_penalty, encoder_repetition_penalty=encoder_repetition_penalty,
                 encoder_no_repeat_ngram_size=encoder_no_repeat_ngram_size,
                 exponential_decay_length_penalty=exponential_decay_length_penalty, suppress_tokens=suppress_tokens,
                 begin_suppress_tokens=begin_suppress_tokens, renormalize_logits=renormalize_logits)
    early_stopping_given = early_stopping
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
    # The arguments whose value is the note's: a bad one says so (`from_note`).
    noted = {name for name, value in given.items() if value is None and name in recorded}
    noted |= {"early_stopping"} & set(recorded) if early_stopping_given is None and beam_rule == "hf" else set()
    noted |= {"min_length", "min_new_tokens"} & set(recorded) if min_length is None and min_new_tokens is None else set()
    try:
        return _checked(config, values, recorded, early_stopping=early_stopping, use_cache=use_cache,
                        length_penalty_form=length_penalty_form, min_length=min_length, min_new_tokens=min_new_tokens,
                        return_scores=return_scores, beam_rule=beam_rule, num_return_sequences=num_return_sequences,
                        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        max_len_given=max_len is not None, prefix=prefix, return_timestamps=return_timestamps,
                        max_initial_timestamp_index=max_initial_timestamp_index,
                        return_no_speech_prob=return_no_speech_prob, patience=patience)
    except InputError as error:
        if error.argument in noted:
            raise from_note(error) from None
        raise


def from_note(error: InputError) -> InputError:
    """`error`, saying that the bad value came from the checkpoint's "generation" note (Hugging
    Face's generation_config.json, as the converter recorded it), not from the call."""
    return InputError(error.argument, f"{error.problem} (the value came from the checkpoint's \"generation\" note, "
                                      f"recorded when it was converted; pass {error.argument}=... to override it)")


def _checked(config, values: dict, recorded: dict, *, early_stopping, use_cache, length_penalty_form, min_length,
             min_new_tokens, return_scores, beam_rule, num_return_sequences, do_sample, temperature, top_k, top_p,
             seed, max_len_given, prefix, return_timestamps, max_initial_timestamp_index, return_no_speech_prob,
             patience) -> Generation:
    """`resolve`'s checks of the arguments, `values` those the note may give, already taken from it
    (`max_len_given`: whether the call gave max_len)."""
    vocab = config.tgt_vocab_size
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
    whisper = check_whisper(recorded, prefix, return_timestamps, max_initial_timestamp_index, return_no_speech_prob,
                            vocab, values["eos_id"], config.pad_id, forced_bos)
    if not max_len_given and "whisper_lengths" in recorded:  # counted after this call's prompt
        values["max_len"] = whisper_max_len(config, recorded["whisper_lengths"], len(whisper["prefix"]))
    values["max_len"] = _integer("max_len", values["max_len"], f"an int in [1, {config.max_len}] (the model's max_len)")
    if not 1 <= values["max_len"] <= config.max_len:
        raise InputError("max_len", f"must be an int in [1, {config.max_len}] (the model's max_len), "
                                    f"got {values['max_len']!r}")
    if values["max_len"] <= len(whisper["prefix"]):
        raise InputError("max_len", f"counts the forced prefix's {len(whisper['prefix'])} tokens, so it must be more "
                                    f"than that to generate any, got {values['max_len']!r}")
    banned = tuple(dict.fromkeys(banned + one_token))  # in order, once each
    shortest, new_tokens = check_min_length(min_length, min_new_tokens, recorded)
    penalties = check_penalties(*(values[name] for name in PENALTY_ARGUMENTS), vocab)
    if getattr(config, "source", "ids") == "features":
        for name, off in (("encoder_repetition_penalty", 1.0), ("encoder_no_repeat_ngram_size", 0)):
            if penalties[name] != off:
                raise InputError(name, f"reads the source's token ids, and this model's source is log-mel features "
                                       f"(source='features'), which have none; got {penalties[name]!r}: leave it at "
                                       f"{off!r}")
    check_forced_not_suppressed(penalties["suppress_tokens"], forced_bos, bool(values["forced_eos"]), values["eos_id"])
    beams = _integer("num_beams", values["num_beams"])
    if beams > 1 and vocab < 2:  # the best 2 x num_beams of num_beams x V candidates: V >= 2
        raise InputError("num_beams", f"beam search keeps the best 2 x num_beams of num_beams x V candidates, so it "
                                      f"needs a target vocabulary of at least 2 ids; this model's has {vocab}; got "
                                      f"num_beams={beams}")
    sampling = check_sampling(do_sample, temperature, top_k, top_p, seed, beams, beam_rule)
    patience = check_patience(patience, beam_rule, beams)
    count = _integer("num_return_sequences", num_return_sequences, "an int >= 1")
    if count < 1:
        raise InputError("num_return_sequences", f"must be an int >= 1, got {count!r}")
    if not sampling["do_sample"]:
        most, why = ((1, "the flax rule returns each row's best hypothesis, as Flax's beam_search callers take it")
                     if beam_rule == "flax" else
                     (1, "the openai rule returns each row's best hypothesis, as openai-whisper's decode does")
                     if beam_rule == "openai" else
                     (1, "greedy search has one sequence per row (use num_beams or do_sample)") if beams == 1 else
                     (beams, f"beam search keeps {beams} beams"))
        if count > most:
            raise InputError("num_return_sequences", f"must be at most {most}: {why}; got {count!r}")
    if beam_rule in ("flax", "openai") and early_stopping is not False:
        raise InputError("early_stopping", f"applies to beam_rule=\"hf\" only: the {beam_rule} rule stops as "
                                           f"{'Flax' if beam_rule == 'flax' else 'openai-whisper'}'s beam search "
                                           f"does (docs/decoding.md), got {early_stopping!r}")
    _check_pad_clash(config, values["bos_id"])
    return Generation(max_len=values["max_len"], bos_id=values["bos_id"], eos_id=values["eos_id"], num_beams=beams,
                      length_penalty=float(values["length_penalty"]), early_stopping=early_stopping,
                      use_cache=bool(use_cache), length_penalty_form=form, forced_eos=bool(values["forced_eos"]),
                      banned_ids=banned, bad_words_ids=words, no_repeat_ngram_size=ngram, forced_bos_id=forced_bos,
                      min_length=shortest, min_new_tokens=new_tokens, return_scores=bool(return_scores),
                      beam_rule=beam_rule, num_return_sequences=count, patience=patience, **penalties, **sampling,
                      **whisper)


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
