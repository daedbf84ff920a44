"""Whisper in CTranslate2 (faster-whisper's engine, `ctranslate2.models.Whisper`) beside the float64
oracle, in each compute type.

    report = measure(config, params, "whisper-ct2/", Directory.read("whisper-ct2/"), features)
    rosetta compare whisper-ct2/ whisper-tiny/          # a user's ct2-transformers-converter output
    rosetta check tiny.safetensors --backends numpy,ctranslate2

CTranslate2 runs a Whisper model by two calls, and each is compared:

    encode     Whisper.encode(features): the encoder's output (B, S, D), after its final norm,
               beside the oracle's `encode(features).memory`
    generate   Whisper.generate(features, prompts, beam_size=1, return_logits_vocab=True): the
               greedy ids beside our search from the same prompt, and the logits of every step
               beside the oracle's logits at the same prefix (the prompt and CTranslate2's own ids
               so far), so that a near-tie that parts the ids does not hide where the numbers part

The prompt is given explicitly to both: start of transcript, language, task, no timestamps
(openai-whisper's `sot_sequence_including_notimestamps`; from the checkpoint's generation note:
decoder_start_token_id, lang_to_id, task_to_id, no_timestamps_token_id). CTranslate2 forwards the
prompt but its last token as a prefix and starts decoding from the last (whisper.cc); ours is the
same search (`conformance.core.generation.search.search`) started from the last prompt token, each
step's logits the float64 model's on the whole prefix. A prompt that ends in <|notimestamps|>
leaves CTranslate2's timestamp rules off. The no-speech probability (the softmax at the start of
transcript's position, of <|nospeech|>) is compared where the vocabulary spells that token.

What else the search does is lined up by `aligned_search`: with rules="plain" (the default) neither
side suppresses anything (CTranslate2's suppress_tokens=[], suppress_blank=False), so the two
greedy searches are the same argmax; rules="note" gives both the note's suppress_tokens and
begin_suppress_tokens (CTranslate2's suppress_blank uses its config.json's suppress_ids_begin). The
note's timestamp rules, beam search with openai's patience, and the forced prompt as our
`generate(prefix=...)` are issue 54's decoding half: the hooks are `aligned_search` and `prompt_of`.

CTranslate2 finds Whisper's special tokens by their spelling (`<|startoftranscript|>`,
`<|endoftext|>`, `<|notimestamps|>`, `<|nospeech|>`), not by id: a directory whose vocabulary spells
them at other rows than the weights' note names is refused by name. `tokens` spells a rosetta
checkpoint's vocabulary so for `rosetta convert --to ctranslate2`.

Verdict, as for the translators (`ctranslate2_report`): float32 on float32 weights is held, to the
tolerance table's float32 row (the encoder output, every step's logits and the no-speech
probability, each scaled by max(1, max |oracle|)) and to equal greedy ids; int8 and the rest are
measured.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from conformance.check.ctranslate2.model import (COMPUTE_TYPES, HELD, Directory, checked_compute_types,
                                                 checked_device, intra_threads, require, runnable_compute_types)
from conformance.check.ctranslate2.report import WhisperReport, WhisperRow, agreement
from conformance.check.tolerances import tolerance
from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError, InputError

# Whisper's special tokens as its tokenizer spells them (whisper/tokenizer.py), by the note's name for their id.
START, END, NO_TIMESTAMPS = "<|startoftranscript|>", "<|endoftext|>", "<|notimestamps|>"
PREVIOUS, NO_SPEECH, START_LM = "<|startofprev|>", "<|nospeech|>", "<|startoflm|>"
TIMESTAMP_STEP = 0.02  # seconds between two timestamp tokens: <|0.00|>, <|0.02|>, ...


def recorded(config: ModelConfig) -> dict[str, Any]:
    """The checkpoint's generation note as written (generation_config.json's names), or {}."""
    text = config.notes.get("generation")
    return json.loads(text) if text else {}


def special_ids(config: ModelConfig) -> dict[str, int]:
    """{token: id} of Whisper's special tokens that the note names: the start of transcript
    (decoder_start_token_id), the end of text (eos_token_id), <|notimestamps|>, <|startofprev|>,
    each language (lang_to_id) and task (task_to_id: <|transcribe|>, <|translate|>); and, where
    the note's ids are laid out as every released Whisper's (<|startofprev|> two below
    <|notimestamps|>), <|startoflm|> and <|nospeech|> beside them."""
    note = recorded(config)
    ids: dict[str, int] = {}
    eos = note.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and len(eos) == 1 else eos
    for token, value in ((START, note.get("decoder_start_token_id")), (END, eos),
                         (NO_TIMESTAMPS, note.get("no_timestamps_token_id")), (PREVIOUS, note.get("prev_sot_token_id"))):
        if isinstance(value, int):
            ids[token] = value
    ids.update({token: int(i) for token, i in (note.get("lang_to_id") or {}).items()})
    ids.update({f"<|{task}|>": int(i) for task, i in (note.get("task_to_id") or {}).items()})
    if NO_TIMESTAMPS in ids and ids.get(PREVIOUS) == ids[NO_TIMESTAMPS] - 2:
        ids.setdefault(START_LM, ids[PREVIOUS] - 1)
        ids.setdefault(NO_SPEECH, ids[NO_TIMESTAMPS] - 1)
    return ids


def tokens(config: ModelConfig) -> list[str]:
    """The vocabulary `rosetta convert --to ctranslate2` gives a Whisper model: the note's special
    ids spelled as Whisper's tokenizer spells them (CTranslate2 finds them by spelling), the ids
    after <|notimestamps|> as timestamps (<|0.00|>, <|0.02|>, ...), every other id i as "i"."""
    named = {i: token for token, i in special_ids(config).items()}
    first = special_ids(config).get(NO_TIMESTAMPS, config.tgt_vocab_size) + 1
    return [named.get(i, f"<|{(i - first) * TIMESTAMP_STEP:.2f}|>" if i >= first else str(i))
            for i in range(config.tgt_vocab_size)]


def prompt_of(config: ModelConfig, language: str | None = None, task: str = "transcribe") -> list[int]:
    """Start of transcript, language, task, no timestamps: openai-whisper's
    sot_sequence_including_notimestamps, from the note (a model without lang_to_id, English-only:
    start of transcript and no timestamps). `language`: "en" (default: English where the note has
    it, else its first language); `task`: "transcribe" or "translate". ConfigError naming what the
    note lacks."""
    ids = special_ids(config)
    for token, field in ((START, "decoder_start_token_id"), (END, "eos_token_id"),
                         (NO_TIMESTAMPS, "no_timestamps_token_id")):
        if token not in ids:
            raise ConfigError("notes", f"the checkpoint's generation note names no {field}: Whisper's prompt "
                              f"needs {token} (CTranslate2 applies its timestamp rules unless the prompt ends in "
                              f"{NO_TIMESTAMPS})")
    note = recorded(config)
    languages, tasks = note.get("lang_to_id") or {}, note.get("task_to_id") or {}
    middle = []
    if languages:
        token = f"<|{language}|>" if language else ("<|en|>" if "<|en|>" in languages else next(iter(languages)))
        if token not in languages:
            raise InputError("language", f"{token} is not in the note's lang_to_id ({sorted(languages)})")
        middle.append(int(languages[token]))
        if task not in tasks:
            raise InputError("task", f"{task!r} is not in the note's task_to_id ({sorted(tasks)})")
        middle.append(int(tasks[task]))
    elif language:
        raise InputError("language", "the note has no lang_to_id: an English-only Whisper takes no language token")
    return [ids[START], *middle, ids[NO_TIMESTAMPS]]


def representable(config: ModelConfig, prompt: list[int]) -> None:
    """Refuse, with the field named, a Whisper model whose prompt CTranslate2 would read otherwise:
    it takes the prompt's task tokens as the ids after <|startoftranscript|> that lie between it and
    <|notimestamps|> (whisper.cc, get_prompt_length), as every released Whisper's vocabulary has them."""
    start, stop = prompt[0], prompt[-1]
    outside = [i for i in prompt[1:-1] if not start < i < stop]
    if outside:
        raise ConfigError("notes", f"CTranslate2 reads the task tokens of a Whisper prompt as the ids between "
                          f"<|startoftranscript|> ({start}) and <|notimestamps|> ({stop}); the note's prompt "
                          f"{prompt} has {outside} outside them")


def check_vocabulary(config: ModelConfig, directory: Directory, prompt: list[int]) -> None:
    """InputError unless the directory's vocabulary has the weights' rows and spells the prompt's
    start, its end of text and <|notimestamps|> where the note has their ids."""
    vocabulary = directory.target
    vocabulary.lacked(config.tgt_vocab_size, -1, "target")  # one token per row, or refused
    ids = special_ids(config)
    for token in (START, END, NO_TIMESTAMPS):
        row = vocabulary.row_of.get(token)
        if row != ids[token]:
            found = "does not hold it" if row is None else f"spells it at row {row}"
            raise InputError("model", f"{vocabulary.where} {found}; the weights' note names {token} id {ids[token]}: "
                                      "CTranslate2 finds Whisper's special tokens by their spelling, so it would "
                                      "start, stop or read the prompt at other ids than the weights were trained with")


def aligned_search(config: ModelConfig, directory: Directory, rules: str = "plain") -> tuple[dict, dict, list[str]]:
    """(our search's options, `Whisper.generate`'s, a line per setting) for `rules`: "plain", no
    suppression in either; "note", the note's suppress_tokens and begin_suppress_tokens in both.
    The hook for the rest of the note's settings (the timestamp rules, a beam's patience), which
    our search does not apply yet: they are run by neither, and the lines say so."""
    if rules not in ("plain", "note"):
        raise InputError("rules", f"expected 'plain' or 'note', got {rules!r}")
    note = recorded(config)
    lines = []
    if rules == "plain":
        ours = {"suppress_tokens": (), "begin_suppress_tokens": ()}
        theirs = {"suppress_tokens": [], "suppress_blank": False}
        lines.append("no suppression in either (CTranslate2 suppress_tokens=[], suppress_blank=False)")
    else:
        suppress, begin = list(note.get("suppress_tokens") or []), list(note.get("begin_suppress_tokens") or [])
        ours = {"suppress_tokens": tuple(suppress), "begin_suppress_tokens": tuple(begin)}
        theirs = {"suppress_tokens": suppress, "suppress_blank": bool(begin)}
        lines.append(f"the note's suppress_tokens {suppress} to both")
        own = directory.config.get("suppress_ids_begin")
        lines.append(f"the note's begin_suppress_tokens {begin} to ours; CTranslate2 suppress_blank="
                     f"{bool(begin)} suppresses its config.json's suppress_ids_begin {own}"
                     + ("" if own == begin or not begin else " (NOT the note's: ids may part at the first step)"))
    if note.get("return_timestamps") or note.get("max_initial_timestamp_index") is not None:
        lines.append("not aligned, run by neither: the timestamp rules (the prompt ends in <|notimestamps|>)")
    lines.append("greedy only: beam search with openai's patience is not compared yet")
    return ours, theirs, lines


def new_tokens(config: ModelConfig, prompt: list[int], max_len: int | None) -> int:
    """How many tokens each search generates after the prompt: `max_len`, at most what the
    decoder's max_len positions leave after the prompt (the prompt's last token is the first
    input of the search)."""
    room = config.max_len - len(prompt) + 1
    if max_len is None:
        return room
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= room:
        raise InputError("max_len", f"must be an int in [1, {room}] (the decoder's {config.max_len} positions less "
                                    f"the {len(prompt) - 1} the prompt takes before the search), got {max_len!r}")
    return int(max_len)


def ctranslate2_max_length(new: int, prompt: list[int]) -> int:
    """`Whisper.generate(max_length=...)` that generates `new` tokens after `prompt`: CTranslate2
    decodes min(max_length / 2, max_length - (len(prompt) - 1)) of them (whisper.cc)."""
    return max(2 * new, new + len(prompt) - 1)


def as_array(view) -> np.ndarray:
    """A CTranslate2 StorageView on the CPU as float64 (any compute type's float: widened first)."""
    import ctranslate2

    return np.asarray(view.to(ctranslate2.DataType.float32), dtype=np.float32).astype(np.float64)


def oracle_search(oracle, encoded, prompt: list[int], batch: int, new: int, eos: int, pad: int, mask_fill,
                  options: dict) -> list[list[int]]:
    """Our greedy search from the prompt's last token, each step the float64 model on the whole
    prefix (the prompt's first tokens, then the search's): as CTranslate2 decodes, after forwarding
    all but the prompt's last token."""
    from conformance.core.generation.search import search

    head = np.asarray(prompt[:-1], dtype=np.int64)

    def step(tokens: np.ndarray, parents) -> np.ndarray:
        full = np.concatenate([np.tile(head, (len(tokens), 1)), np.asarray(tokens, np.int64)], axis=1)
        return oracle.decode(full, encoded, return_attention=False).logits[:, -1]  # (B, V)

    ids, _ = search(step, batch, new, prompt[-1], eos, pad, num_beams=1, mask_fill=mask_fill, **options)
    return [until(row, eos) for row in np.asarray(ids).tolist()]


def until(row, eos: int) -> list[int]:
    row = [int(i) for i in row]
    return row[:row.index(eos)] if eos in row else row


def measure(config: ModelConfig, params, model: Any, directory: Directory, features, *, prompt: list[int] | None = None,
            compute_types=None, max_len: int | None = None, device: str | None = None, rules: str = "plain",
            source: str = "", notes: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> WhisperReport:
    """`model` (the directory's path, or a `ctranslate2.models.Whisper` of it, which runs in its own
    compute type and device only) beside the oracle on `params`, on log-mel `features` (B, n_mels,
    frames): see the module's docstring. `prompt`: default `prompt_of(config)`; `max_len`: the
    tokens generated after it (default: as many as the decoder's positions leave)."""
    import impl_numpy
    from conformance.core.inputs import host_features

    ctranslate2 = require()
    progress = progress or (lambda message: None)
    loaded = model if type(model).__name__ == "Whisper" else None
    if loaded is not None:
        own = {"compute_types": (loaded.compute_type,), "device": loaded.device}
        given = {"compute_types": None if compute_types is None else checked_compute_types(compute_types),
                 "device": device}
        for name, value in given.items():
            if value is not None and value != own[name]:
                raise InputError(name, f"the Whisper model runs in {own[name]!r} only (its own, fixed when it was "
                                       f"made), got {value!r}: leave {name}= out, or pass the directory")
        compute_types, device = own["compute_types"], own["device"]
    compute_types = checked_compute_types(COMPUTE_TYPES if compute_types is None else compute_types)
    device = checked_device("cpu" if device is None else device)
    features = host_features("src_ids", features, config)
    prompt = list(prompt_of(config) if prompt is None else prompt)
    representable(config, prompt)
    check_vocabulary(config, directory, prompt)
    new = new_tokens(config, prompt, max_len)
    eos, pad = special_ids(config)[END], config.pad_id
    ours_search, their_search, search_lines = aligned_search(config, directory, rules)
    notes = list(notes or [])
    no_speech = special_ids(config).get(NO_SPEECH)
    if no_speech is not None and directory.target.row_of.get(NO_SPEECH) != no_speech:
        notes.append(f"no-speech probability not compared: {directory.target.where} does not spell {NO_SPEECH} "
                     f"at row {no_speech}")
        no_speech = None

    weights = {key: np.asarray(value, np.float32) for key, value in params.items()}  # what CTranslate2 gets at best
    oracle = impl_numpy.Model(config, weights, dtype="float64")
    progress("the oracle: encode, and the greedy search from the prompt (numpy/cpu/float64)")
    encoded = oracle.encode(features, return_attention=False)
    memory = np.asarray(encoded.memory)
    batch = len(features)
    ours = oracle_search(oracle, encoded, prompt, batch, new, eos, pad, config.mask_fill, ours_search)
    prompted = oracle.decode(np.tile(np.asarray(prompt, np.int64), (batch, 1)), encoded, return_attention=False)
    oracle_no_speech = (np.exp(log_softmax(prompted.logits[:, 0]))[:, no_speech] if no_speech is not None else None)
    disabled_first = set(ours_search["suppress_tokens"]) | set(ours_search["begin_suppress_tokens"])
    disabled_later = set(ours_search["suppress_tokens"])

    runnable, skipped, float32_weights = runnable_compute_types(ctranslate2, directory, compute_types, device, notes)
    stored = ctranslate2.StorageView.from_array(np.ascontiguousarray(features, dtype=np.float32))
    rows = []
    for compute_type in runnable:
        progress(f"ctranslate2/{device}/{compute_type}: encode, generate")
        running = loaded or ctranslate2.models.Whisper(str(directory.path), device=device, compute_type=compute_type,
                                                       intra_threads=intra_threads(config, device))
        encoder_out = as_array(running.encode(stored, to_cpu=True))
        results = running.generate(stored, [list(prompt)] * batch, beam_size=1, max_length=ctranslate2_max_length(
            new, prompt), return_logits_vocab=True, return_no_speech_prob=no_speech is not None, **their_search)
        theirs = [[int(i) for i in r.sequences_ids[0]] for r in results]
        steps = [np.stack([as_array(v) for v in r.logits[0]])[:, :config.tgt_vocab_size] for r in results]  # (k, V)
        position_error = logits_error(oracle, encoded, prompt, theirs, steps, pad, disabled_first, disabled_later)
        scale = max(1.0, max(float(np.abs(s[np.isfinite(s)]).max()) for s in steps))
        held = tolerance(HELD, device) if compute_type == HELD and float32_weights else None
        row = WhisperRow(compute_type, position_error, held=held, scale=scale,
                         encoder_error=float(np.abs(encoder_out - memory).max()) if encoder_out.shape == memory.shape
                         else float("inf"), encoder_scale=max(1.0, float(np.abs(memory).max())))
        if oracle_no_speech is not None:
            row.no_speech_error = float(np.abs(np.array([r.no_speech_prob for r in results]) - oracle_no_speech).max())
        row.agreement[1], row.first_split[1] = agreement(ours, theirs)
        rows.append(row)
    return WhisperReport(rows, 0.0, f"ctranslate2 {ctranslate2.__version__}", new, device, skipped, (), source,
                         directory.weight_dtypes, notes, search_lines, prompt=prompt)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logits_error(oracle, encoded, prompt: list[int], theirs: list[list[int]], steps: list[np.ndarray], pad: int,
                 disabled_first: set[int], disabled_later: set[int]) -> np.ndarray:
    """(K,): at each generated step k, the largest |CTranslate2's logits - the oracle's| over the
    rows that reach it, the oracle run on the same prefix (the prompt and CTranslate2's ids before
    step k: teacher-forced on CTranslate2's path). Ids a rule disabled (-inf in CTranslate2's) are
    left out; any other non-finite value is an infinite error."""
    longest = max(len(s) for s in steps)
    width = len(prompt) - 1 + longest
    inputs = np.full((len(theirs), width), pad, dtype=np.int64)
    for i, (ids, s) in enumerate(zip(theirs, steps)):
        row = list(prompt) + ids[:len(s) - 1]
        inputs[i, :len(row)] = row
    logits = np.asarray(oracle.decode(inputs, encoded, return_attention=False).logits)  # (B, W, V)
    error = np.zeros(longest)
    for i, s in enumerate(steps):
        for k in range(len(s)):
            keep = np.ones(s.shape[1], dtype=bool)
            keep[list(disabled_first if k == 0 else disabled_later)] = False
            diff = np.abs(s[k, keep] - logits[i, len(prompt) - 1 + k, keep])
            error[k] = max(error[k], float(np.where(np.isfinite(diff), diff, np.inf).max()))
    return error


def divergence(report: WhisperReport) -> str:
    """Where the held row of a failed report first parts from the oracle, in words."""
    row = next(r for r in report.rows if r.held is not None and not r.passed)
    return (f"on {report.batch_note()}, {row.verdict().removeprefix('FAIL: ')}; CTranslate2 exposes the encoder's "
            "output and each step's logits, so the first diverging quantity named is one of them")


# The tiny example's vocabulary: Whisper's special tokens laid out as a multilingual Whisper's
# (tests/fixtures/optimum_whisper_onnx), 45 text ids before them and 9 timestamps after.
EXAMPLE_NOTE = {"decoder_start_token_id": 46, "bos_token_id": 45, "eos_token_id": 45, "pad_token_id": 45,
                "max_length": 16, "is_multilingual": True, "lang_to_id": {"<|en|>": 47, "<|de|>": 48},
                "task_to_id": {"transcribe": 50, "translate": 49}, "no_timestamps_token_id": 54,
                "prev_sot_token_id": 52, "suppress_tokens": [1, 2, 7, 8, 9, 46, 49, 50, 51, 52, 53],
                "begin_suppress_tokens": [3, 45]}


def example_model(seed: int = 7) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A tiny seeded Whisper (hf-whisper: D 16, 2 + 2 layers, 8 mels, 16 frames, 16 decoder
    positions, 64 ids as EXAMPLE_NOTE lays them out), every weight, norm and bias jittered off its
    initialisation, the encoder's sinusoid left as it is, and the end of text's row of the tied
    table grown 2.5x so that greedy outputs end at different lengths (seed 7: on
    `report.window_batch`'s three rows, two end after 2 tokens, one runs to the limit)."""
    from conformance.core.params import init_params
    from conformance.core.presets import preset

    config = preset("hf-whisper", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2,
                    src_vocab_size=64, tgt_vocab_size=64, n_mels=8, max_source_len=8, max_len=16, pad_id=45,
                    notes={"generation": json.dumps(EXAMPLE_NOTE)})
    rng = np.random.default_rng(seed)
    params = {}
    for key, value in init_params(config, seed=seed).items():
        if key != "encoder.position.table":
            value = value + rng.normal(0.0, 0.2 if value.ndim == 1 else 0.5 / np.sqrt(value.shape[0]), value.shape)
        params[key] = np.asarray(value, np.float32)
    params["decoder.embedding.weight"][EXAMPLE_NOTE["eos_token_id"]] *= 2.5
    return config, params
