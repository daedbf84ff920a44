"""The checkpoint's generation note: transformers' generation_config.json, as `generate` arguments.

A converted Hugging Face folder records its generation_config.json under the checkpoint's
"generation" note (`conformance.convert.sources.GENERATION_KEYS`). `generation_note` reads it back
as the defaults `generate` applies where the caller gives nothing; `unapplied_generation` names
the fields that change transformers' output and that `generate` does not apply, which the
converter and `generate` warn about (`GenerationWarning`).

Framework-free (the standard library).
"""

from __future__ import annotations

import warnings


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
    forced_eos, forced_bos_id, no_repeat_ngram_size, min_length, min_new_tokens, the processors of
    `APPLIED_PROCESSORS` (repetition_penalty, suppress_tokens, ...) under their own names, and
    bad_words_ids split in two: its one-token words as banned_ids (without the end token, which
    transformers drops), the longer ones as bad_words_ids. An empty dict when there is no note."""
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
                        ("min_new_tokens", recorded.get("min_new_tokens")),
                        *((name, recorded.get(name)) for name in APPLIED_PROCESSORS)):
        if value is not None:
            out[name] = value
    if recorded.get("max_new_tokens") is not None:  # Hugging Face: it wins over max_length
        out["max_len"] = min(int(recorded["max_new_tokens"]), config.max_len)
    elif recorded.get("max_length") is not None:  # Hugging Face counts the start token
        out["max_len"] = min(int(recorded["max_length"]) - 1, config.max_len)
    else:  # neither: transformers' default number of new tokens
        out["max_len"] = hf_default_max_len(config)
    if is_whisper_note(recorded):
        out.update(whisper_note(recorded))
        out["max_len"] = whisper_max_len(config, recorded, len(out["prefix"]))
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


# -- Whisper's note (transformers' WhisperGenerationMixin, openai-whisper's DecodingTask) ----------


def is_whisper_note(recorded: dict) -> bool:
    """Whether a generation note is Whisper's: it records the no-timestamps id or a forced prompt
    (transformers 5 reads forced_decoder_ids for Whisper only)."""
    return recorded.get("no_timestamps_token_id") is not None or recorded.get("forced_decoder_ids") is not None


def whisper_note(recorded: dict) -> dict:
    """A Whisper note's `generate` arguments: `prefix` (the forced prompt after the start token,
    `whisper_prompt` with the note's own return_timestamps), `return_timestamps`,
    `no_timestamps_token_id`, `max_initial_timestamp_index` (None: no bound), `language_ids`
    (lang_to_id's ids: what a free language slot of the prompt is chosen among) and
    `whisper_lengths` (the note's max_new_tokens and max_length, for `whisper_max_len`)."""
    timestamps = recorded.get("return_timestamps") is True
    languages = recorded.get("lang_to_id") or {}
    out = {"return_timestamps": timestamps, "prefix": whisper_prompt(recorded, timestamps),
           "prefixes": {flag: whisper_prompt(recorded, flag) for flag in (False, True)},
           "language_ids": tuple(sorted(int(i) for i in languages.values()))}
    for name in ("no_timestamps_token_id", "max_initial_timestamp_index"):
        if recorded.get(name) is not None:
            out[name] = recorded[name]
    out["whisper_lengths"] = {name: recorded.get(name) for name in ("max_new_tokens", "max_length")}
    return out


def whisper_prompt(recorded: dict, timestamps: bool) -> tuple:
    """The forced prompt after the start token that transformers' Whisper `generate` builds from a
    generation config (`WhisperGenerationMixin._retrieve_init_tokens`, 5.23), None where the
    language is left to detection (`lang_to_id` recorded and no language forced):

    - `forced_decoder_ids` [[1, a], [2, b], ...] give a, b, ... in order (a list that does not
      start at index 1 is ignored, as transformers ignores it; a gap is refused);
    - a recorded `language` ("en" or "<|en|>", read through lang_to_id) replaces the first, and
      adds "transcribe" when no task id is there; a recorded `task` is appended (transformers'
      `replace_or_add` result is dropped, so the task id is added, not replaced);
    - the no-timestamps id is appended without timestamps, or dropped from the end with them;
    - a free language slot without lang_to_id is dropped (transformers drops None tokens)."""
    from conformance.core.errors import ConfigError

    forced = [list(pair) for pair in recorded.get("forced_decoder_ids") or []]
    language, task = recorded.get("language"), recorded.get("task")
    lang_to_id = recorded.get("lang_to_id") or {}
    task_to_id = recorded.get("task_to_id") or {}
    prompt: list = []
    if task is None and language is None and forced and forced[0][0] == 1:
        index = 1
        while forced and forced[0][0] == index:
            prompt.append(forced.pop(0)[1])
            index += 1
        if forced:
            raise ConfigError("notes", f"the \"generation\" note's forced_decoder_ids has no entry for every index "
                                       f"from 1 to {forced[0][0] - 1}: {recorded['forced_decoder_ids']!r} is not "
                                       "Whisper's prompt pattern (transformers refuses it too)")
    undefined = not prompt or prompt[0] is None
    if language is not None:
        key = language if language in lang_to_id else f"<|{language}|>"
        if key not in lang_to_id:
            raise ConfigError("notes", f"the \"generation\" note's language {language!r} is not in its lang_to_id")
        prompt[:1] = [lang_to_id[key]]
    elif lang_to_id and undefined:
        prompt[:1] = [None]  # detected at the first step (`generate`'s prefix: docs/whisper.md)
    if task is not None:
        if task not in task_to_id:
            raise ConfigError("notes", f"the \"generation\" note's task {task!r} is not in its task_to_id")
        prompt.append(task_to_id[task])
    elif language is not None and task_to_id and not any(t in prompt for t in task_to_id.values()):
        prompt.append(task_to_id["transcribe"])
    no_timestamps = recorded.get("no_timestamps_token_id")
    if no_timestamps is not None:
        if not timestamps and (not prompt or prompt[-1] != no_timestamps):
            prompt.append(no_timestamps)
        elif timestamps and prompt and prompt[-1] == no_timestamps:
            prompt.pop()
    if not lang_to_id:
        prompt = [token for token in prompt if token is not None]
    return tuple(prompt)


def whisper_max_len(config, recorded: dict, prompt_len: int) -> int:
    """The tokens after the start token (the prompt's `prompt_len` included) that transformers'
    Whisper `generate` makes under a note's lengths (`_set_max_new_tokens_and_length`): its
    max_new_tokens after the prompt; else max_length plus the prompt and start token (at most
    max_target_positions // 2 - 1 of them counted), the whole at most max_target_positions (our
    max_len) long; neither: transformers' default of 20 new tokens after the prompt."""
    positions = config.max_len
    if recorded.get("max_new_tokens") is not None:
        total = 1 + prompt_len + int(recorded["max_new_tokens"])
    elif recorded.get("max_length") is not None:
        total = int(recorded["max_length"]) + min(positions // 2 - 1, 1 + prompt_len)
    else:
        total = 1 + prompt_len + HF_DEFAULT_NEW_TOKENS
    return max(1, min(total, positions) - 1)


class GenerationWarning(UserWarning):
    """A checkpoint's generation settings ask for something `generate` does not apply."""


# Said at every call, not once per place in the code (Python's default for a UserWarning): each
# `generate` on such a checkpoint gives ids transformers' would not. Appended, so that any filter
# a user sets (ignore, error) still comes first.
warnings.filterwarnings("always", category=GenerationWarning, append=True)


# generation_config.json fields that `generate` applies as Hugging Face's logits processors, under
# the same names (docs/decoding.md, "What is scored"), each with the value that turns it off.
APPLIED_PROCESSORS = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "exponential_decay_length_penalty": False,
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
    "renormalize_logits": False,
}


def _sampling(fields) -> bool:
    return fields.get("do_sample") is True


# generation_config.json fields that change transformers' `generate` output and that `generate`
# does not apply, each with the test of whether its value (and the other fields) changes the
# output: the converter records those that do in the note, and warns (`unapplied_generation`).
UNAPPLIED_GENERATION = {
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
    "sequence_bias": lambda v, f: len(v) > 0,
    "constraints": lambda v, f: len(v) > 0,
    "force_words_ids": lambda v, f: len(v) > 0,
    "guidance_scale": lambda v, f: v != 1,
    "penalty_alpha": lambda v, f: v > 0,
    "stop_strings": lambda v, f: len(v) > 0,
    "num_return_sequences": lambda v, f: v > 1,
    # Whisper's temperature fallback (transformers' `generate_with_fallback`, openai-whisper's
    # `transcribe`): a threshold recorded makes transformers decode a row again, or skip it.
    "no_speech_threshold": lambda v, f: True,
    "logprob_threshold": lambda v, f: True,
    "compression_ratio_threshold": lambda v, f: True,
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


def unapplied_message(unapplied: dict, source: str) -> str:
    """What a warning says of `unapplied` (`unapplied_generation`'s) found in `source`."""
    import json

    listed = ", ".join(f"{name}={json.dumps(value, default=repr)}" for name, value in unapplied.items())
    return (f"{source} set{'s' if not source.endswith('settings') else ''} {listed}: transformers' generate "
            f"applies {'it' if len(unapplied) == 1 else 'them'}, rosetta's `generate` does not, so its outputs may "
            "differ from transformers' (docs/decoding.md)")


def warn_unapplied(config) -> None:
    """A `GenerationWarning` naming what the checkpoint's generation note records and `generate`
    does not apply (`unapplied_generation`), at every call that reads the note; nothing when it
    records nothing of the kind."""
    import json

    text = config.notes.get("generation")
    if not text:
        return
    try:
        recorded = json.loads(text)
    except ValueError:
        return  # generation_note refuses it
    unapplied = unapplied_generation(recorded) if isinstance(recorded, dict) else {}
    if unapplied:
        warnings.warn(unapplied_message(unapplied, "the checkpoint's generation settings"), GenerationWarning,
                      stacklevel=4)
