"""Decoding examples: a model, a source batch and the arguments of `generate`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from conformance.core.inputs import nan_positions

from conformance.suite.strategies.forward_cases import Case, cases
from conformance.suite.strategies.model_configs import configs, preset_configs

@dataclass(frozen=True)
class GenerationCase:
    """One decoding example: a model and source batch (`case`, its tgt_ids unused) and the
    arguments of `generate`. The pad id is banned (as Marian's generation config does), so that no
    open row reads a pad token as a query (a forced first token is never the pad id either)."""

    case: Case
    max_len: int
    bos_id: int
    eos_id: int
    options: tuple[tuple[str, object], ...]

    def arguments(self) -> dict:
        return dict(self.options, banned_ids=(self.case.config.pad_id,))

    def __repr__(self) -> str:
        return (f"GenerationCase({self.case!r}, max_len={self.max_len}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"options={self.options!r})")


# How a drawn case decodes: Hugging Face's search (greedy or beam), Flax's beam rule, or sampling.
MODES = ("search", "flax", "sample")


def as_mode(options: tuple[tuple[str, object], ...], mode: str, seed: int, temperature: float, top_k: int,
            top_p: float) -> tuple[tuple[str, object], ...]:
    """Search options turned into `mode`'s: the flax rule keeps the beams and penalty and takes
    no early_stopping; sampling keeps the penalty form, draws as many samples per row as there
    were beams (the same decoder rows, so no new shapes to compile) and takes the warpers."""
    if mode == "search":
        return options
    kept = dict(options)
    if mode == "flax":
        return tuple((k, v) for k, v in kept.items() if k != "early_stopping") + (("beam_rule", "flax"),)
    rows = kept.pop("num_beams")
    kept.pop("early_stopping", None)
    return tuple(kept.items()) + (("num_beams", 1), ("do_sample", True), ("num_return_sequences", rows),
                                  ("seed", seed), ("temperature", temperature), ("top_k", top_k), ("top_p", top_p))


@st.composite
def generation_cases(draw) -> GenerationCase:
    """Greedy or beam search (1-3 beams), Flax's beam rule, or sampling (1-3 samples per row,
    with drawn temperature, top_k, top_p and seed) over a drawn config and a source batch
    without all-padding rows and whose first step is not NaN, generating at most 6 tokens, with
    drawn length penalty and stopping rule, and sometimes Hugging Face's logits processors
    (`processor_options`). A features source with room for Whisper's special ids decodes as
    Whisper two times in three (`whisper_choices`, `as_whisper`), drawn after everything else."""
    case = draw(cases(st.one_of(preset_configs(), configs(max_layers=2)), allow_empty_source_rows=False))
    config = case.config
    vocab, pad = config.tgt_vocab_size, config.pad_id
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad)
    bos = draw(real)
    eos = draw(real.filter(lambda i: i != bos))
    # A first step that is NaN (a -inf fill whose empty queries poison the memory every
    # cross-attention reads, e.g. src_pad_mask "both" over a padded source) decodes nothing: every
    # backend refuses it alike, with the same InputError (docs/decoding.md), so it is not a search case.
    assume(not nan_positions(config, case.src_ids, np.full((len(case.src_ids), 1), bos)).any())
    options = (("num_beams", draw(st.sampled_from([1, 2, 3]))),
               ("length_penalty", draw(st.sampled_from([1.0, 0.0, 0.6, -0.5]))),
               ("early_stopping", draw(st.sampled_from([False, True, "never"]))),
               ("length_penalty_form", draw(st.sampled_from(["hf", "gnmt"]))))
    # Drawn after the search options, so that the configs and batches drawn before stay those of
    # the other properties (`shared_examples`: one JAX compile per config and shape).
    options = as_mode(options, draw(st.sampled_from(MODES)), draw(st.integers(0, 2 ** 16)),
                      draw(st.sampled_from([1.0, 0.5, 2.0])), draw(st.sampled_from([0, 1, 3])),
                      draw(st.sampled_from([1.0, 0.9, 0.5])))
    options += draw(processor_options(vocab, pad, bos, eos, sampling=dict(options).get("do_sample", False),
                                      source_ids=config.source == "ids"))
    gcase = GenerationCase(case=case, max_len=min(6, config.max_len), bos_id=bos, eos_id=eos, options=options)
    note = whisper_note(vocab, pad) if config.source == "features" else None
    if note is not None and draw(st.integers(0, 2)):  # two features cases in three decode as Whisper
        gcase = as_whisper(gcase, note, **draw(whisper_choices(note, gcase.options)))
    return gcase


@st.composite
def processor_options(draw, vocab: int, pad: int, bos: int, eos: int,
                      sampling: bool = False, source_ids: bool = True) -> tuple[tuple[str, object], ...]:
    """Hugging Face's logits processors, drawn after everything else (so that the configs and
    batches stay those of the other properties), none changing a shape the backends compile for:
    no_repeat_ngram_size 2 or 3 (two times in three: a random model repeats itself within 6 tokens
    often); a forced first token, not the pad id nor the end id (one time in two); bad words that
    bite (one time in two): the start token followed by half the real ids (the first step loses
    them), plus one three-token word; a minimum length (two times in three) that bans the end
    token for the first 2 or 4 generated tokens (min_length 3 or 5: the start token counts); and
    last the processors of shipped generation configs (`shipped_processors`; those that read the
    source's ids only where it has them: not a features source's)."""
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad)
    options = ()
    ngram = draw(st.sampled_from([0, 2, 3]))
    if ngram:
        options += (("no_repeat_ngram_size", ngram),)
    forced = ()
    if draw(st.booleans()):
        forced = (draw(real.filter(lambda i: i != eos)),)
        options += (("forced_bos_id", forced[0]),)
    if draw(st.booleans()):
        half = max(1, (vocab - 1) // 2)
        after_start = draw(st.lists(real, min_size=half, max_size=half, unique=True))
        longer = tuple(draw(st.lists(real, min_size=3, max_size=3)))
        options += (("bad_words_ids", tuple((bos, token) for token in after_start) + (longer,)),)
    shortest = draw(st.sampled_from([0, 3, 5]))
    if shortest:
        options += (("min_length", shortest),)
    return options + draw(shipped_processors(vocab, pad, bans=not sampling, forced=forced, source_ids=source_ids))


# The processors that read the source's token ids (a features source has none).
SOURCE_READING = ("encoder_repetition_penalty", "encoder_no_repeat_ngram_size")


@st.composite
def shipped_processors(draw, vocab: int, pad: int, bans: bool = True, forced: tuple[int, ...] = (),
                       source_ids: bool = True) -> tuple[tuple[str, object], ...]:
    """transformers' processors that published generation configs set (issue 56), each on about
    half the time: a repetition penalty above or below 1 on the output's ids; one on the source's
    ids; no source n-gram of 1 or 2 tokens in the output; the end token's exponential length
    penalty from step 1 or 2; two suppressed ids (every step); two ids suppressed at the first
    step; and renormalized scores. Without `bans` (sampling, which has nothing to draw from once
    every id is banned: docs/decoding.md) the three that ban ids are drawn and left out. The
    suppressed ids avoid the `forced` ids (a forced token that is suppressed is refused, as
    transformers refuses it). Without `source_ids` (a features source) the two that read the
    source's ids are drawn and left out."""
    banning = ("encoder_no_repeat_ngram_size", "suppress_tokens", "begin_suppress_tokens")
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad)
    options = ()
    for name, values in (("repetition_penalty", [1.0, 1.6, 0.7]), ("encoder_repetition_penalty", [1.0, 1.4, 0.6]),
                         ("encoder_no_repeat_ngram_size", [0, 0, 1, 2]),
                         ("exponential_decay_length_penalty", [None, (1, 1.5), (2, 2.0)])):
        value = draw(st.sampled_from(values))
        if value not in (None, 0, 1.0) and (bans or name not in banning) and (source_ids or name not in SOURCE_READING):
            options += ((name, value),)
    for name, allowed in (("suppress_tokens", real.filter(lambda i: i not in forced)),
                          ("begin_suppress_tokens", real)):
        if draw(st.booleans()):
            ids = tuple(draw(st.lists(allowed, min_size=2, max_size=2, unique=True)))
            if bans:
                options += ((name, ids),)
    if draw(st.booleans()):
        options += (("renormalize_logits", True),)
    return options


# -- Whisper's decoding (docs/whisper.md, "Decoding") ---------------------------------------------


# Whisper's special ids at the top of a small vocabulary, as its tokenizer lays them out after the
# text: the start of transcript, the end, two languages, the task, the no-speech id, the
# no-timestamps id, then the timestamps (`TIMESTAMPS` of them) to the last id. A vocabulary
# smaller than `WHISPER_MIN_VOCAB` leaves no text id beside the pad id: no Whisper note.
TIMESTAMPS = 3
WHISPER_SPECIALS = 7 + TIMESTAMPS
WHISPER_MIN_VOCAB = WHISPER_SPECIALS + 3


def whisper_note(vocab: int, pad: int) -> dict | None:
    """A Whisper generation note (transformers' generation_config.json names, as a converted
    checkpoint records it) for a vocabulary of `vocab` ids laid out as `WHISPER_SPECIALS` says;
    its prompt is [language to detect, transcribe] (+ no-timestamps without timestamps). None
    where the vocabulary is too small, or the pad id would be one of the special ids."""
    first = vocab - WHISPER_SPECIALS
    if vocab < WHISPER_MIN_VOCAB or pad >= first:
        return None
    sot, eot, en, de, transcribe, _no_speech, no_timestamps = range(first, first + 7)
    return {"decoder_start_token_id": sot, "eos_token_id": eot, "no_timestamps_token_id": no_timestamps,
            "forced_decoder_ids": [[1, None], [2, transcribe]], "lang_to_id": {"<|en|>": en, "<|de|>": de},
            "task_to_id": {"transcribe": transcribe}}


# What a Whisper case decodes with, beside its search (`whisper_choices`, the covering rows):
# prefix "note" (not given: the note's own prompt, its language detected), or a prompt of the
# note's ids by name ("lang", "task", "notimestamps"; None: the language detected).
PREFIXES = ("note", (None, "task"), ("en", "task"), ("de", "task", "notimestamps"))


@st.composite
def whisper_choices(draw, note: dict, options) -> dict:
    """Whisper's decoding options for a case of `options`: a prefix (`PREFIXES`; one ending with
    the no-timestamps id only without timestamps), return_timestamps, a bound on the first
    timestamp (none, 0 or 1: the first two timestamps), return_no_speech_prob, and for Hugging
    Face's beam search one time in two openai-whisper's rule with a patience of 1, 2 or 0.5."""
    timestamps = draw(st.booleans())
    prefix = draw(st.sampled_from([p for p in PREFIXES if not (timestamps and "notimestamps" in p)]))
    initial = draw(st.sampled_from([None, 0, 1])) if timestamps else None
    no_speech = draw(st.booleans())
    kept = dict(options)
    openai = (not kept.get("do_sample") and kept.get("beam_rule", "hf") == "hf" and kept.get("num_beams", 1) > 1
              and draw(st.booleans()))
    patience = draw(st.sampled_from([1.0, 2.0, 0.5])) if openai else None
    return dict(prefix=prefix, timestamps=timestamps, initial=initial, no_speech=no_speech, patience=patience)


def as_whisper(gcase: GenerationCase, note: dict, *, prefix, timestamps: bool, initial: int | None,
               no_speech: bool, patience: float | None) -> GenerationCase:
    """`gcase` decoding as Whisper: its config carries `note` (so every backend and the oracle read
    it), its start and end ids are the note's, its prompt is `prefix` (`PREFIXES`), with the
    timestamp rules and their bound, the no-speech probability, and openai-whisper's beam rule
    where `patience` is given. A forced first token goes (the prompt forces the first tokens:
    both together are refused)."""
    import dataclasses
    import json

    ids = {"en": note["lang_to_id"]["<|en|>"], "de": note["lang_to_id"]["<|de|>"],
           "task": note["task_to_id"]["transcribe"], "notimestamps": note["no_timestamps_token_id"], None: None}
    options = {k: v for k, v in gcase.options if k != "forced_bos_id"}
    if patience is not None:
        options.pop("early_stopping", None)
        options.update(beam_rule="openai", patience=patience)
    if prefix != "note":
        options["prefix"] = tuple(ids[token] for token in prefix)
    options["return_timestamps"] = timestamps
    if initial is not None:
        options["max_initial_timestamp_index"] = initial
    if no_speech:
        options["return_no_speech_prob"] = True
    config = gcase.case.config
    config = config.replace(notes={**config.notes, "generation": json.dumps(note)})
    return dataclasses.replace(gcase, case=dataclasses.replace(gcase.case, config=config),
                               bos_id=note["decoder_start_token_id"], eos_id=note["eos_token_id"],
                               options=tuple(options.items()))


# The options that only Whisper's decoding takes (an adapter that does not declare it: dropped).
WHISPER_OPTIONS = ("prefix", "return_timestamps", "max_initial_timestamp_index", "return_no_speech_prob")
