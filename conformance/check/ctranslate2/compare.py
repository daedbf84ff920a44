"""A CTranslate2 model beside the float64 oracle: its `score_batch` log-probabilities per position
and its `translate_batch` ids (greedy, beam 4) against our `generate`, in each compute type.

    report = compare_ctranslate2("opus-ct2/", "hf-marian", src_ids, tgt_ids, weights="opus-mt/")
    conformance.compare("opus-ct2/", "hf-marian", src_ids, tgt_ids, weights="opus-mt/")  # dispatched here
    rosetta compare opus-ct2/ opus-mt/ --layout hf-marian
    print(report.table())

The model is a CTranslate2 model directory (model.bin, config.json, its vocabulary), or a
`ctranslate2.Translator` with `model_dir=` the directory it was loaded from (a Translator does not
say, and the directory's vocabulary and config.json are what map ids to tokens); a Translator runs
in its own compute type and device only (other compute_types= or device= are refused). `weights`
are what the model was converted from, read as `weights.oracle_weights` reads them: a rosetta
checkpoint, a Hugging Face folder (its own layout), or a file through `layout`. `rosetta check
--backends numpy,ctranslate2` runs the same measurement on a model `ctranslate2_check.convert`
made. The directory is read by `ctranslate2_model` (ids and tokens: its docstring); the report
and its verdict are `ctranslate2_report`'s.

What is compared. The oracle is the weights' model in float64 on the float32-rounded weights
(CTranslate2 stores at most float32), its log-softmax over the rows CTranslate2 has, started from
the weights' decoder start id and stopped at their end id (the generation note; CTranslate2's
config.json tokens where the weights name none), the rows CTranslate2 lacks banned from our search.
Where CTranslate2 adds tokens to the source itself (config.json's add_source_bos/eos), the oracle's
source has them too. Where the two name different start or end tokens, or Marian's zero start meets
a pad row that is not zero, the report's notes say so and the scores show it from the first step.

The two searches are one algorithm only when their settings are (`aligned_search`): the
checkpoint's generation note (its no_repeat_ngram_size, min_length / min_new_tokens, bad_words_ids)
is given to CTranslate2 as its own options (no_repeat_ngram_size, min_decoding_length,
suppress_sequences) and to our `generate` explicitly, so that neither takes a default the other
lacks; a note setting CTranslate2 has no option for (forced_bos_token_id, forced_eos_token_id,
several end tokens, what our `generate` does not apply) is run by neither, and the report says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import numpy as np

from conformance.check.ctranslate2.model import (BEAMS, COMPUTE_TYPES, HELD, ZERO_START, Directory, intra_threads,
                                                 checked_compute_types, checked_device, require,
                                                 runnable_compute_types)
from conformance.check.ctranslate2.report import ComputeTypeResult, CTranslate2Report, agreement
from conformance.check.tolerances import tolerance
from conformance.core.generation.note import APPLIED_PROCESSORS, generation_note, unapplied_generation
from conformance.core.generation.settings import check_min_length
from conformance.core.generation.search import log_softmax
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError


def token_rows(ids, pad_id: int, name: str) -> list[list[int]]:
    """Each row's ids before its trailing padding; padding inside a row is refused (CTranslate2
    takes unpadded lists, and positions would shift), and so is anything but a (B, L) integer array."""
    array = np.asarray(ids)
    if array.ndim != 2 or array.dtype.kind not in "iu":
        raise InputError(name, f"must be a (B, L) array of integer token ids, got {array.dtype} {array.shape}")
    rows = []
    for i, row in enumerate(array.tolist()):
        n = len(row)
        while n and row[n - 1] == pad_id:
            n -= 1
        if n == 0 or pad_id in row[:n]:
            raise InputError(name, f"row {i} must be tokens followed by padding only (pad_id={pad_id}), got {row}")
        rows.append(row[:n])
    return rows


def until(row, eos_id: int) -> list[int]:
    row = [int(i) for i in row]
    return row[:row.index(eos_id)] if eos_id in row else row


def _padded(rows: list[list[int]], pad_id: int) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), pad_id)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def checked_beams(beams) -> tuple[int, ...]:
    beams = tuple(beams) if not isinstance(beams, (int, str)) else (beams,)
    if not beams or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in beams):
        raise InputError("beams", f"expected one or more beam sizes, ints >= 1 (1: greedy), got {list(beams)!r}")
    return tuple(dict.fromkeys(int(b) for b in beams))


def checked_max_len(max_len, config: ModelConfig) -> int:
    """`max_len` (None: the model's) as an int in [1, config.max_len]."""
    if max_len is None:
        return config.max_len
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= config.max_len:
        raise InputError("max_len", f"must be an int in [1, {config.max_len}] (the model's max_len), got {max_len!r}")
    return int(max_len)


def aligned_search(config: ModelConfig, directory: Directory, lacked: list[int],
                   eos: int) -> tuple[dict[str, Any], dict[str, Any], list[str], bool]:
    """(our `generate`'s settings, `translate_batch`'s, a line per setting saying how they were
    lined up, whether the note bans tokens during the search) from the checkpoint's generation note
    (`conformance.core.generation.note.generation_note`). Each of ours is given explicitly, so the note is
    never applied to one side only.

    A ban (no_repeat_ngram_size, a minimum length, bad words) is one rule in both, but the beam
    scores it leaves are not: CTranslate2 takes the log-softmax over the ids left (its beam score
    of a banned step is renormalized), transformers and our `generate` take it over every id and
    then ban. Greedy ids do not depend on it (the largest of the ids left is the same); beam ids
    can, so with a ban the beam searches' ids are measured, not held."""
    note = generation_note(config)
    ngram = int(note.get("no_repeat_ngram_size", 0))
    shortest, new_tokens = check_min_length(None, None, note)
    # transformers' min_length counts the start token; CTranslate2's min_decoding_length (its default 1
    # never ends at the first step) and our min_new_tokens count only what is generated.
    least = new_tokens or max(shortest - 1, 0)
    banned, words = [int(i) for i in note.get("banned_ids", ())], [list(w) for w in note.get("bad_words_ids", ())]
    spelled = [directory.target.spell([i], "notes") for i in banned if i not in lacked]
    spelled += [directory.target.spell(word, "notes") for word in words]
    ours = {"early_stopping": True, "no_repeat_ngram_size": ngram, "min_length": 0, "min_new_tokens": least,
            "banned_ids": list(dict.fromkeys(lacked + banned)), "bad_words_ids": words, "forced_bos_id": False,
            "forced_eos": False, **APPLIED_PROCESSORS}  # the penalties and suppressions: off, as in CTranslate2's
    theirs = {"no_repeat_ngram_size": ngram, "min_decoding_length": least, "suppress_sequences": spelled or None,
              "patience": 1.0}
    source = "the note's" if note else "no note"
    lines = [f"no_repeat_ngram_size {ngram} ({source}) to both",
             f"CTranslate2 min_decoding_length={least}, ours min_new_tokens={least} "
             + ("(the note's min_new_tokens)" if new_tokens else f"(the note's min_length {shortest}, less the start)"
                if shortest else "(no minimum; CTranslate2's default 1 never ends at the first step)"),
             "ours early_stopping=True, as CTranslate2's beam search (patience 1) stops once num_hypotheses "
             "hypotheses ended, where transformers' default early_stopping=False does not"]
    if lacked:
        lines.append(f"{list(lacked)} banned from ours (not in CTranslate2's vocabulary)")
    if spelled:
        lines.append(f"the note's bad_words_ids: {len(spelled)} word(s) as CTranslate2's suppress_sequences, ours "
                     "banned_ids / bad_words_ids")
    not_aligned = []
    if "forced_bos_id" in note:
        not_aligned.append(f"forced_bos_token_id {note['forced_bos_id']} (CTranslate2 forces a first token only as a "
                           "target_prefix, whose log p its beam scores count)")
    if note.get("forced_eos"):
        not_aligned.append(f"forced_eos_token_id {eos} (CTranslate2 has no forced end token)")
    recorded = json.loads(config.notes["generation"]) if note else {}  # JSON: generation_note read it
    if isinstance(recorded.get("eos_token_id"), list) and len(recorded["eos_token_id"]) > 1:
        not_aligned.append(f"the end tokens {recorded['eos_token_id']} (our generate ends at one: {eos})")
    skipped = {name: note[name] for name, off in APPLIED_PROCESSORS.items()
               if name in note and note[name] not in (off, [], None)}
    if skipped:
        not_aligned.append(f"{', '.join(f'{k} {v}' for k, v in skipped.items())} (our generate applies them; "
                           "CTranslate2 is not given them here, so neither side runs them)")
    unapplied = unapplied_generation(recorded)
    if unapplied:
        not_aligned.append(f"{', '.join(f'{k} {v}' for k, v in unapplied.items())} (our generate does not apply "
                           "them)")
    lines += [f"not aligned, run by neither: {what}" for what in not_aligned]
    bans = bool(ngram or least or spelled)
    if bans:
        lines.append("beam ids measured, not held: the note bans tokens, and CTranslate2's beam scores take the "
                     "log-softmax over the ids left where transformers' and ours take it over every id")
    return ours, theirs, lines, bans


def measure(config: ModelConfig, params, model: Any, directory: Directory, src_ids, tgt_ids, *, start: int,
            eos: int, compute_types=None, beams=BEAMS, max_len: int | None = None, length_penalty: float = 1.0,
            device: str | None = None, source: str = "", notes: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> CTranslate2Report:
    """`model` (the directory's path, or a Translator of it) beside the oracle on `params`: see
    the module's docstring. `start`, `eos`: the oracle's decoder start and end ids. `compute_types`
    (default: COMPUTE_TYPES) and `device` (default "cpu"): with a Translator, its own (others are refused)."""
    import impl_numpy

    ctranslate2 = require()
    progress = progress or (lambda message: None)
    translator = model if not isinstance(model, (str, os.PathLike)) else None
    if translator is not None:
        own = {"compute_types": (translator.compute_type,), "device": translator.device}
        for name, given in (("compute_types", None if compute_types is None else checked_compute_types(compute_types)),
                            ("device", device)):
            if given is not None and given != own[name]:
                raise InputError(name, f"the Translator runs in {own[name]!r} only (its own, fixed when it was made), "
                                       f"got {given!r}: leave {name}= out, or pass the directory")
        compute_types, device = own["compute_types"], own["device"]
    compute_types = checked_compute_types(COMPUTE_TYPES if compute_types is None else compute_types)
    device = checked_device("cpu" if device is None else device)
    beams, max_len = checked_beams(beams), checked_max_len(max_len, config)
    pad = config.pad_id
    lacked = directory.target.lacked(config.tgt_vocab_size, pad, "target")
    directory.source.lacked(config.src_vocab_size, pad, "source")
    sources, targets = token_rows(src_ids, pad, "src_ids"), token_rows(tgt_ids, pad, "tgt_ids")
    if len(sources) != len(targets):
        raise InputError("tgt_ids", f"has {len(targets)} rows, src_ids {len(sources)}")
    text = [directory.source.spell(row, "src_ids") for row in sources]
    spelled = [directory.target.spell(row, "tgt_ids") for row in targets]
    ours_search, their_search, search, bans = aligned_search(config, directory, lacked, eos)
    notes = list(notes or [])
    # What CTranslate2 adds to each source itself (config.json add_source_bos/eos), the oracle's source has too.
    before, after = ([directory.added_to_source(side)] if directory.config.get(f"add_source_{side}") else []
                     for side in ("bos", "eos"))
    src = _padded([before + row + after for row in sources], pad)
    unnamed = directory.target.unnamed
    if unnamed:
        notes.append(f"{len(unnamed)} rows of {directory.target.where} (from {unnamed[0]}) have an earlier row's "
                     "token; CTranslate2 reads an output of one as the earlier row, and ours are compared so")
    weights = {key: np.asarray(value, np.float32) for key, value in params.items()}  # what CTranslate2 gets at best
    oracle_model = impl_numpy.Model(config, weights, dtype="float64")

    progress("the oracle: log p of the targets, and generate (numpy/cpu/float64)")
    # The oracle's log p of each target token after [start] + prefix, the end token appended.
    longest = max(len(t) for t in targets) + 1
    decoder_in = np.full((len(targets), longest), pad)
    wanted = np.full((len(targets), longest), pad)
    for i, t in enumerate(targets):
        decoder_in[i, :len(t) + 1] = [start] + t
        wanted[i, :len(t) + 1] = t + [eos]
    logits = oracle_model(src, decoder_in, return_attention=False).logits  # (B, T, V)
    valid = np.arange(longest)[None] <= np.array([len(t) for t in targets])[:, None]  # (B, T): the end token too
    # CTranslate2's vocabulary: lacked is at most the last row, so every other id keeps its column
    # (a padded position, whose pad may be the lacked row, reads column 0 and is masked out).
    kept = np.delete(logits, lacked, axis=-1)
    oracle = np.take_along_axis(log_softmax(kept), np.where(valid, wanted, 0)[..., None], -1)[..., 0]
    probs = np.exp(log_softmax(logits))  # (B, T, V)
    pad_p = probs[..., lacked].max(-1) if lacked else np.zeros(probs.shape[:-1])
    scale = max(1.0, float(np.abs(np.where(valid, oracle, 0.0)).max()))

    ours = {b: [directory.target.as_seen(until(r, eos))
                for r in oracle_model.generate(src, max_len=max_len, bos_id=start, eos_id=eos, num_beams=b,
                                               length_penalty=length_penalty, **ours_search)]
            for b in beams}
    runnable, skipped, float32_weights = runnable_compute_types(ctranslate2, directory, compute_types, device, notes)
    rows = []
    for compute_type in runnable:
        progress(f"ctranslate2/{device}/{compute_type}: score_batch, translate_batch")
        running = translator or ctranslate2.Translator(str(directory.path), device=device, compute_type=compute_type,
                                                       intra_threads=intra_threads(config, device))
        scored = running.score_batch(text, spelled)
        theirs = np.zeros_like(oracle)
        for i, s in enumerate(scored):
            theirs[i, :len(s.log_probs)] = s.log_probs
        error = np.where(valid, np.abs(theirs - oracle), 0.0).max(0)  # (T,)
        held = tolerance(HELD, device) if compute_type == HELD and float32_weights else None
        row = ComputeTypeResult(compute_type, error, held=held, scale=scale,
                                unheld=tuple(b for b in beams if b > 1) if bans else ())
        for b in beams:
            out = running.translate_batch(text, beam_size=b, max_decoding_length=max_len,
                                          length_penalty=length_penalty, **their_search)
            ids = [directory.target.read_back(r.hypotheses[0]) for r in out]
            row.agreement[b], row.first_split[b] = agreement(ours[b], ids)
        rows.append(row)
    return CTranslate2Report(rows, float(np.where(valid, pad_p, 0.0).max()), f"ctranslate2 {ctranslate2.__version__}",
                             max_len, device, skipped, tuple(lacked), source, directory.weight_dtypes, notes, search)


# compare_ctranslate2's keywords besides ModelConfig overrides (the rest are refused by name).
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig) if f.name != "notes")


def compare_ctranslate2(model: Any, layout: Any, src_ids, tgt_ids, *, weights=None, model_dir=None,
                        compute_types=None, beams=BEAMS, max_len: int | None = None,
                        length_penalty: float = 1.0, device: str | None = None, run: Callable | None = None,
                        backends: Any = None, grads: bool = False, progress: Callable[[str], None] | None = None,
                        oracle: tuple[ModelConfig, dict, Any] | None = None, **overrides: Any) -> CTranslate2Report:
    """The user's CTranslate2 model beside the oracle run on `weights` (read through `layout`);
    see the module's docstring. A Whisper model (a directory of WhisperSpec, or a
    `ctranslate2.models.Whisper` with model_dir=) beside Whisper weights is measured by
    `ctranslate2_whisper.measure`: `src_ids` are log-mel features, `tgt_ids` are not read (both
    searches start from Whisper's prompt), greedy only. `run`, `backends` and `grads` do not apply (CTranslate2 runs by
    tokens, exposes no tensors for our backends' table, has no backward pass): refused. `oracle`:
    the (config, params, layout) of `weights.oracle_weights`, read already. `overrides`:
    ModelConfig fields for reading `weights` (as `rosetta compare --set`); any other keyword is refused."""
    from conformance.check.weights import oracle_weights

    unknown = sorted(set(overrides) - CONFIG_FIELDS)
    if unknown:
        raise InputError(unknown[0], "is no keyword of compare for a CTranslate2 model: it takes weights=, model_dir=, "
                                     "compute_types=, beams=, max_len=, length_penalty=, device=, progress=, oracle= "
                                     "and ModelConfig fields for reading the weights")
    for given, name, why in ((run is not None, "run", "CTranslate2 is run by compare itself, by tokens"),
                             (grads, "grads", "CTranslate2 has no backward pass to compare"),
                             (bool(backends), "backends", "a CTranslate2 model exposes no tensors to put beside our "
                                                          "backends': check ours with rosetta check"),
                             (oracle is not None and bool(overrides), sorted(overrides)[0] if overrides else "",
                              "the weights were read already (oracle=): config overrides would not apply")):
        if given:
            raise InputError(name, why)
    require()
    progress = progress or (lambda message: None)
    translator = None if isinstance(model, (str, os.PathLike)) else model
    if translator is not None and model_dir is None:
        raise InputError("model_dir", "a ctranslate2.Translator (or models.Whisper) does not say which directory it was loaded from: "
                                      "pass model_dir= (its vocabulary and config.json map ids to tokens)")
    if translator is None and model_dir is not None:
        raise InputError("model_dir", f"names the directory a Translator was loaded from; {model} is a directory "
                                      "already: leave model_dir= out")
    directory = Directory.read(model_dir if translator is not None else model)
    if oracle is None:
        if weights is None:
            raise InputError("weights", "the oracle needs the weights the CTranslate2 model was converted from: a "
                                        "rosetta checkpoint, a Hugging Face folder or a file with a layout")
        progress(f"reading {weights}")
        oracle = oracle_weights(weights, None, layout, overrides)
    config, params, layout = oracle
    source = f"{model_dir or model} against {weights or 'the given weights'}" + (
        f" through layout {layout.name}" if layout is not None else "")
    if config.source == "features" or directory.whisper:  # Whisper: encode, and generate from its prompt
        from conformance.check.ctranslate2 import whisper

        if config.source != "features" or not directory.whisper:
            raise InputError("model", f"{directory.path} is a {directory.spec or 'CTranslate2'} model and the weights "
                             f"have a{'' if config.source == 'features' else 'n'} {config.source} source: a "
                             "Whisper model (WhisperSpec) is compared with Whisper weights (a features source) only")
        if beams != BEAMS:
            raise InputError("beams", "a Whisper model is compared greedy only (beam search with openai's patience is "
                                      "not compared yet): leave beams= out")
        if length_penalty != 1.0:
            raise InputError("length_penalty", "applies to beam search, which a Whisper model is not compared with")
        return whisper.measure(config, params, translator or directory.path, directory, src_ids,
                               compute_types=compute_types, max_len=max_len, device=device, source=source,
                               progress=progress)
    note = generation_note(config)
    notes = []
    # The start: the weights' own (as transformers starts), else CTranslate2's.
    theirs_start = (config.pad_id if directory.zero_start
                    else directory.token_id("decoder_start_token", directory.target))
    theirs_eos = directory.token_id("eos_token", directory.target)
    start = note.get("bos_id", theirs_start)
    eos = note.get("eos_id", theirs_eos)
    if start is None or eos is None:
        raise InputError("weights", f"{weights or 'the weights'} name no decoder start or end id (generation note) "
                                    f"and {directory.path / 'config.json'} no token of its vocabulary for them")
    if directory.zero_start:
        row = np.asarray(params["decoder.embedding.weight"] if "decoder.embedding.weight" in params
                         else params["encoder.embedding.weight"])[int(start)]
        if np.any(row != 0):
            notes.append(f"CTranslate2 starts the decoder from a zero embedding ({ZERO_START}, Marian's loader); "
                         f"the weights start from row {start}, which is not zero (max |x| {np.abs(row).max():.2e})")
    elif theirs_start is not None and theirs_start != start:
        notes.append(f"CTranslate2 starts the decoder from id {theirs_start} (config.json decoder_start_token), "
                     f"the weights from {start}")
    if theirs_eos is not None and theirs_eos != eos:
        notes.append(f"CTranslate2 ends at id {theirs_eos} (config.json eos_token), the weights at {eos}")
    return measure(config, params, translator or directory.path, directory, src_ids, tgt_ids, start=int(start),
                   eos=int(eos), compute_types=compute_types, beams=beams, max_len=max_len,
                   length_penalty=length_penalty, device=device, source=source, notes=notes, progress=progress)
