"""CTranslate2 beside the oracle: a rosetta checkpoint converted by CTranslate2's own converter, then
its `score_batch` and `translate_batch` compared with the float64 NumPy model.

    from conformance.check.ctranslate2 import target as ctranslate2_check
    ctranslate2_check.convert(config, params, "model-ct2/")            # `rosetta convert --to ctranslate2`, verified
    report = ctranslate2_check.check(config, params, src_ids, tgt_ids)  # every compute type
    print(report.table())

    python -m conformance.check.ctranslate2.target [CHECKPOINT | LAYOUT] # the table, on fixed_batch
    rosetta check [CHECKPOINT] --backends numpy,ctranslate2              # the table beside the tensor report

The path is the one a user takes: the checkpoint is written as a Hugging Face folder of the first
family in FAMILIES whose layout expresses it (Marian, T5, BART, mBART, Pegasus, M2M100/NLLB;
`conformance.convert.hf_folder.write_folder`) and handed to `ctranslate2.converters.TransformersConverter`,
which loads it with transformers' model class and CTranslate2's loader for that family. Only what
the loader represents is converted (`representable`): one vocabulary for source and target;
CTranslate2's Marian loader drops the last vocabulary row as the `<pad>` transformers appended and
starts the decoder from a zero embedding, so for Marian the pad id must be the last id and its
embedding row zero; mBART's loader starts the decoder from the end token, Pegasus's from the pad
token; M2M100's positions are right for pad id 1 only. What a loader reads otherwise than
transformers 5 writes it is corrected as data (`Family`). `convert` checks what it wrote before it
is renamed into place (`verified`: CTranslate2 itself beside the float64 oracle).

The oracle is the model as CTranslate2 runs it: the float64 model on the float32-rounded weights that
CTranslate2 received, its log-softmax taken over CTranslate2's vocabulary (Marian's without the pad
column), and our `generate` from the same start id with the ids CTranslate2 lacks banned
(transformers' bad_words_ids for Marian). A banned id still holds probability mass in our beam
scores and none in CTranslate2's; `pad_mass` reports the largest, which is what can part beam ids
that agree everywhere else.

The measurement is `ctranslate2_compare.measure`, which `conformance.compare` also runs on a user's
own CTranslate2 model, and its report `ctranslate2_report.CTranslate2Report` (float32 on float32
weights held to the tolerance table's float32 row and to equal ids, the rest measured); this module
converts.

Needs the [ctranslate2] extra and transformers with torch (the converter loads the folder).
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from conformance.check.ctranslate2.compare import measure
from conformance.check.ctranslate2.model import (BEAMS, COMPUTE_TYPES, Directory, checked_compute_types,
                                                 default_device, require)
from conformance.check.ctranslate2.report import CTranslate2Report, WhisperReport
from conformance.check.switches import switches_at
from conformance.core.config import ModelConfig
from conformance.core.generation.note import generation_note
from conformance.core.errors import ConfigError, InputError


@dataclass(frozen=True)
class Family:
    """What CTranslate2's loader for one Hugging Face family does to a model (its
    ctranslate2/converters/transformers.py), as data:

    layout          the layout the folder is written in
    drops_pad       the loader drops the pad id's vocabulary row (MarianMTLoader: the `<pad>`
                    transformers appended, replaced by a decoder that starts from a zero embedding)
    legacy_fields   config.json fields the loader reads that transformers no longer writes, added to
                    the folder's config.json
    loaded_config   (attribute, source) pairs set on the loaded model's config before the loader
                    reads it: a field transformers' config class forces on load (T5Config always sets
                    tie_word_embeddings true and keeps the real setting in scale_decoder_outputs, which
                    the T5 loader does not read), set from the attribute that holds the real setting
    start           which decoder start the loader can give: "note" (the note's own, through
                    config.json), or the special token it always starts from ("eos", "pad")
    pad_id          the one pad id the loader's positions are right for (None: any)
    kind            "translator" (a `ctranslate2.Translator`), or "whisper" (`ctranslate2.models.Whisper`:
                    WhisperLoader, its vocabulary spelled as Whisper's tokenizer spells it)
    """

    layout: str
    drops_pad: bool = False
    legacy_fields: tuple[tuple[str, Any], ...] = ()
    loaded_config: tuple[tuple[str, str], ...] = ()
    start: str = "note"
    pad_id: int | None = None
    kind: str = "translator"  # the CTranslate2 class that runs it: "translator", or "whisper" (models.Whisper)


# In the order tried for a checkpoint (`family_of`): each layout's export refuses what its family
# cannot express (Marian's sinusoids, T5's relative bias and RMSNorm, BART's offset table, ...).
# CTranslate2 4.8.5's BartLoader (and MBartLoader, PegasusLoader, which extend it) reads
# BartConfig.normalize_before, a transformers 3 field that transformers 5 neither sets nor writes
# (false for BART: post-LN; true for mBART and Pegasus: pre-LN), and Pegasus has no embedding
# LayerNorm (normalize_embedding, which the loader takes as true when absent). Its T5Loader scales
# the tied head by d_model**-0.5 when config.tie_word_embeddings is true, which transformers 5's
# T5Config always sets (the real setting: scale_decoder_outputs), so T5 v1.1, Flan-T5 and mT5 would
# be scaled. MBartLoader starts the decoder from the end token unless the config names
# MBartTokenizer (then from a target prefix); PegasusLoader from the pad token. M2M100Loader takes
# its sinusoid from row 2 (module.offset), which transformers' positions start at only for pad id 1.
FAMILIES = (Family("hf-marian", drops_pad=True),
            Family("hf-t5", loaded_config=(("tie_word_embeddings", "scale_decoder_outputs"),)),
            Family("hf-bart", legacy_fields=(("normalize_before", False),)),
            Family("hf-mbart", legacy_fields=(("normalize_before", True), ("tokenizer_class", "MBart50Tokenizer")),
                   start="eos"),
            Family("hf-pegasus", legacy_fields=(("normalize_before", True), ("normalize_embedding", False)),
                   start="pad"),
            Family("hf-m2m100", pad_id=1))

NAMES = ("Marian", "T5", "BART", "mBART", "Pegasus", "M2M100/NLLB")  # FAMILIES', as their users name them

# A features source, through WhisperLoader: a `ctranslate2.models.Whisper` (faster-whisper's engine),
# not a Translator, measured by `ctranslate2_whisper` (encode, generate from Whisper's prompt).
WHISPER = Family("hf-whisper", kind="whisper")


def family_of(config: ModelConfig, params, layout: str | None = None) -> Family:
    """The family CTranslate2 converts this model as: the one named by `layout`, or else the first
    of FAMILIES whose layout's export expresses it; ConfigError with each family's reason if none does."""
    from conformance.convert import load_layout
    from conformance.convert.engine import check_exportable

    if config.source == "features" or layout == WHISPER.layout:  # Whisper: faster-whisper's format
        if config.source != "features" or layout not in (None, WHISPER.layout):
            raise InputError("layout", f"CTranslate2 converts a features source (Whisper) through {WHISPER.layout} "
                             f"and an ids source through {[f.layout for f in FAMILIES]}; got layout {layout!r} for a "
                             f"{config.source} source")
        return WHISPER
    if layout is not None:
        for family in FAMILIES:
            if family.layout == layout:
                return family
        raise InputError("layout", f"CTranslate2 is checked through the layouts {[f.layout for f in FAMILIES]}, "
                         f"got {layout!r}")
    reasons, errors = [], []
    for family in FAMILIES:
        try:
            check_exportable(config, load_layout(family.layout), {}, advice=False)
        except ConfigError as exc:
            reasons.append(f"{family.layout}: {exc}")
            errors.append(exc)
            continue
        return family
    fields = tuple(dict.fromkeys(f for exc in errors for f in exc.fields))
    raise ConfigError(fields[0], f"CTranslate2's loaders represent {', '.join(NAMES)} "
                      f"({', '.join(f.layout for f in FAMILIES)}); no family CTranslate2 converts expresses this "
                      "model, each for the reason given:\n  " + "\n  ".join(reasons) + "\nCTranslate2 computes each "
                      "family as transformers does, so a switch cannot be set at this export: a model with other "
                      "switches is not one CTranslate2 runs. Its weights can still be checked in a system that has "
                      "them: `rosetta check` on our backends, or `--to LAYOUT` for the system it was trained in",
                      fields=fields)

def representable(config: ModelConfig, params, family: Family = FAMILIES[0]) -> None:
    """Refuse, with the switch named, a model that CTranslate2's loader for `family` would change.
    The family's export refuses what the family itself cannot express (position, norm placement, ...).
    Whisper: the note names Whisper's prompt, laid out as CTranslate2 reads it (`ctranslate2_whisper`)."""
    if family.kind == "whisper":
        from conformance.check.ctranslate2 import whisper

        whisper.representable(config, whisper.prompt_of(config))
        return
    vocab = config.tgt_vocab_size
    if config.src_vocab_size != vocab:
        raise ConfigError("src_vocab_size", f"CTranslate2's {family.layout} loader registers one vocabulary for "
                          f"source and target; src_vocab_size {config.src_vocab_size} != tgt_vocab_size {vocab}")
    if family.pad_id is not None and config.pad_id != family.pad_id:
        raise ConfigError("pad_id", f"CTranslate2's {family.layout} loader takes the position table from row 2, "
                          f"where transformers' positions start only for pad_id {family.pad_id} (they start at "
                          f"pad_id + 1), so pad_id must be {family.pad_id}, got {config.pad_id}")
    if family.start != "note":
        start, eos = generation_ids(config)
        want = {"eos": eos, "pad": config.pad_id}[family.start]
        if start != want:
            raise ConfigError("notes", f"CTranslate2's {family.layout} loader starts the decoder from the "
                              f"{'end' if family.start == 'eos' else 'pad'} token ({want}); the checkpoint's note "
                              f"starts it from {start}")
    if not family.drops_pad:
        return
    if config.pad_id != vocab - 1:
        raise ConfigError("pad_id", f"CTranslate2's Marian loader drops the last vocabulary row ({vocab - 1}) as the "
                          f"<pad> transformers appended, so pad_id must be {vocab - 1}, got {config.pad_id}")
    for key in ("encoder.embedding.weight", "decoder.embedding.weight"):
        if key in params and np.any(np.asarray(params[key])[config.pad_id] != 0):
            raise ConfigError("pad_id", f"row {config.pad_id} (the pad id) of {key} is not zero: CTranslate2 starts "
                              "Marian's decoder from a zero embedding, where transformers and rosetta look up the pad "
                              "id's row")
    note = generation_note(config)
    if note.get("bos_id") not in (None, config.pad_id):
        raise ConfigError("notes", f"CTranslate2 starts Marian's decoder from a zero embedding, the pad id's row "
                          f"({config.pad_id}); the checkpoint's note starts it from {note['bos_id']}")


def generation_ids(config: ModelConfig) -> tuple[int, int]:
    """(start id, end id) from the checkpoint's note: its decoder_start_token_id, else the pad id
    (Marian's and T5's start), and its end token."""
    note = generation_note(config)
    start = int(note.get("bos_id", config.pad_id))
    eos = note.get("eos_id", config.notes.get("eos_id"))
    if eos is None:
        raise ConfigError("notes", "the checkpoint names no end token (note 'generation' eos_token_id, or 'eos_id'; "
                          "one, not a list of several): CTranslate2 needs one to stop decoding")
    return start, int(eos)


class _Vocabulary:
    """What `TransformersConverter` reads from a tokenizer: token `i` is spelled `str(i)`, so a
    CTranslate2 token maps back to its id exactly, with no tokenizer files in the folder. For
    Marian the pad id (the last) is left out: its loader drops its weights rows. Whisper's
    special tokens are spelled as its tokenizer spells them (`tokens`, `ctranslate2_whisper.tokens`):
    CTranslate2 finds them by their spelling."""

    def __init__(self, size: int, start_id: int, eos_id: int, pad_id: int, tokens: list[str] | None = None):
        self.tokens = tokens  # Whisper's, spelled as its tokenizer spells them; else "i" for id i
        self.size = size
        self.eos_token = self.unk_token = self.convert_ids_to_tokens(eos_id)  # rosetta has no unknown token
        self.unk_token_id = eos_id
        self.bos_token = self.convert_ids_to_tokens(start_id)  # BART's and T5's loaders read them
        self.pad_token = self.convert_ids_to_tokens(pad_id)
        self.special_tokens_map: dict[str, Any] = {}  # M2M100's loader adds its additional special tokens

    def get_vocab(self) -> dict[str, int]:
        return {self.convert_ids_to_tokens(i): i for i in range(self.size)}

    def convert_ids_to_tokens(self, i: int) -> str:
        return str(i) if self.tokens is None else self.tokens[i]


def convert(config: ModelConfig, params, dst: str | Path, quantization: str = "float32",
            layout: str | None = None, *, verify: bool = True) -> Path:
    """A new CTranslate2 model directory at `dst`, made whole or not at all, its weights stored in
    `quantization` (one of COMPUTE_TYPES), through the folder of `layout` (default: `family_of`).

    With `verify` (the default), CTranslate2 loads the model before it is renamed into place and
    runs it beside the float64 oracle (`verify`): a held row that fails raises a
    `VerificationError` naming where it parts, and nothing is left at `dst`. Quantized weights are
    measured, not held (docs/deployment.md)."""
    from conformance.core.checkpoint import atomic_directory
    from conformance.core.errors import CheckpointError, VerificationError

    ctranslate2 = require()
    if not isinstance(quantization, str):
        raise InputError("--quantization", f"expected one of {list(COMPUTE_TYPES)}, got {quantization!r}")
    checked_compute_types(quantization, "--quantization")
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(dst, "already exists; a CTranslate2 model goes into a new directory: name one that "
                              "does not exist")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    family = family_of(config, params, layout)
    representable(config, params, family)
    with atomic_directory(dst) as staged:
        write(ctranslate2, config, params, staged, quantization, family)
        if verify:
            what, report = verified(config, params, staged, family.layout)[-1]
            if report.checked and not report.passed:
                raise VerificationError(dst, f"not written: {report.version} ran the written model beside the "
                                        f"float64 oracle: {divergence(report, what, config)}", (report,))
    return dst


def write(ctranslate2, config: ModelConfig, params, out: Path, quantization: str, family: Family) -> None:
    """CTranslate2's TransformersConverter on a Hugging Face folder of `family`, into `out` (which it makes)."""
    from conformance.convert import export_state_dict, load_layout
    from conformance.convert.hf_folder import write_folder

    start, eos = generation_ids(config)
    layout = load_layout(family.layout)
    weights = {key: np.asarray(value, np.float32) for key, value in params.items()}  # CTranslate2 stores <= float32
    state = export_state_dict(config, weights, layout)
    size = config.tgt_vocab_size - (1 if family.drops_pad else 0)
    spelled = None
    if family.kind == "whisper":  # CTranslate2 finds Whisper's special tokens by their spelling
        from conformance.check.ctranslate2 import whisper

        spelled = whisper.tokens(config)

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, *args, **kwargs):
            return _Vocabulary(size, start, eos, config.pad_id, spelled)

        def load_model(self, *args, **kwargs):
            model = super().load_model(*args, **kwargs)
            for name, source in family.loaded_config:
                setattr(model.config, name, getattr(model.config, source))
            return model

    with tempfile.TemporaryDirectory(prefix="rosetta-ct2-") as scratch:
        folder = Path(scratch) / family.layout
        write_folder(folder, config, state, layout)
        if family.legacy_fields:
            hf = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**hf, **dict(family.legacy_fields)}, indent=2))
        try:
            Converter(str(folder)).convert(str(out), quantization=quantization)
        except ImportError as exc:  # its loader imports transformers and torch only now
            raise InputError("ctranslate2", f"CTranslate2's converter loads the Hugging Face folder with transformers "
                             f"and torch ({exc}): pip install transformers 'rosetta-transformer[torch]'") from None
        except (ValueError, NotImplementedError, RuntimeError, KeyError, TypeError, AttributeError, OSError) as exc:
            # The converter's own refusals (a configuration or option it has no conversion for) and
            # its crashes: named as what refused, on which family's folder, not a traceback.
            from conformance.core.errors import CheckpointError

            said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(out, f"CTranslate2 {getattr(ctranslate2, '__version__', '')}'s TransformersConverter "
                                  f"could not convert the {family.layout} folder of this checkpoint "
                                  f"({quantization} weights): {type(exc).__name__}"
                                  f"{': ' + said if said else ''}") from None


# The longest output a check of a written model generates, and its searches: greedy only. Log p of
# every target position already holds the whole computation; the greedy ids hold the decoder's
# start and end as CTranslate2 runs them. A float64 beam search of 4 on a base-size model took 87 of
# the check's 117 s (benchmarks/bench_convert_verify.py): `check` and `rosetta check` run beams.
VERIFY_MAX_LEN = 16
VERIFY_BEAMS = (1,)


def verified(config: ModelConfig, params, model_dir: str | Path, layout: str | None = None,
             progress: Callable[[str], None] | None = None) -> list[tuple[str, CTranslate2Report]]:
    """The CTranslate2 model at `model_dir` (converted from `params`) beside the float64 oracle on
    each probe (`conformance.check.probes.probes`: the padded rows, then a row as long as the
    model takes, less the start token CTranslate2's decoder reads first and the tokens it adds to
    each source; a Whisper model: a whole window of features, greedy from Whisper's prompt): score_batch log p per position and translate_batch greedy ids, computed in
    float32 (`measure`: on float32 weights held to the float32 row and equal ids; on quantized
    weights measured, not held). Returns (the probe's name, its report) for each probe run, up to
    the first that failed."""
    from conformance.check.report import window_batch
    from conformance.check.probes import probes

    family = family_of(config, params, layout)
    if family.kind == "whisper":  # a whole window of features, greedy from Whisper's prompt
        from conformance.check.ctranslate2 import whisper

        prompt = whisper.prompt_of(config)
        return [("a whole window of features", whisper.measure(
            config, params, Path(model_dir), Directory.read(model_dir), window_batch(config)[0], prompt=prompt,
            compute_types=("float32",), max_len=min(whisper.new_tokens(config, prompt, None), VERIFY_MAX_LEN),
            device="cpu", source=f"the written model, converted through {family.layout}", progress=progress))]
    start, eos = generation_ids(config)
    directory = Directory.read(model_dir)
    added = sum(bool(directory.config.get(f"add_source_{side}")) for side in ("bos", "eos"))
    reports = []
    for what, src, tgt in probes(config, source=max(1, config.source_len - added), target=max(1, config.max_len - 1)):
        report = measure(config, params, Path(model_dir), directory, src, tgt, start=start, eos=eos,
                         compute_types=("float32",), beams=VERIFY_BEAMS, max_len=min(config.max_len, VERIFY_MAX_LEN),
                         device="cpu", source=f"the written model, converted through {family.layout}",
                         progress=progress)
        reports.append((what, report))
        if report.checked and not report.passed:
            break
    return reports


def divergence(report: CTranslate2Report, probe: str = "3 padded rows", config: ModelConfig | None = None) -> str:
    """Where the held row of a failed report first parts from the oracle, in words, with what acts
    there. CTranslate2 exposes no tensor but log p: where position 0 parts, everything before the
    logits may (the logits' own switches named); where the first positions agree and a later one
    parts, what acts by position does (the position switches, a position table's later rows);
    where every log p agrees and the greedy ids part, the search's start and end ids do."""
    from conformance.check.switches import switches_by_position

    if isinstance(report, WhisperReport):
        from conformance.check.ctranslate2 import whisper

        return whisper.divergence(report)
    row = next(r for r in report.rows if r.held is not None and not r.passed)
    beyond = np.flatnonzero(~(row.position_error <= row.limit))
    if not beyond.size:
        acting = ("the ids parted where every log p agrees: the decoder's start and end ids (the checkpoint's note "
                  "'generation') act there")
    elif beyond[0] > 0:
        acting = (f"positions 0-{beyond[0] - 1} agree, so what acts by position differs: "
                  f"{', '.join(switches_by_position(config)) or 'the position term'}, or a position table's rows from "
                  f"{beyond[0]}")
    else:
        acting = (f"it parts at the first position, where every switch has acted; those at the logits: "
                  f"{', '.join(switches_at('logits', config))}")
    return (f"on {probe}, {row.verdict().removeprefix('FAIL: ')} (largest |log p error| {row.max_error:.2e}); "
            f"CTranslate2 exposes no intermediate tensor, so the first diverging quantity named is log p; {acting}")


def check(config: ModelConfig, params, src_ids, tgt_ids, *, compute_types=None, beams=BEAMS,
          max_len: int | None = None, length_penalty: float = 1.0, model_dir: str | Path | None = None,
          device: str = "cpu", layout: str | None = None,
          progress: Callable[[str], None] | None = None) -> CTranslate2Report:
    """CTranslate2 (converted from `params` into `model_dir`, default a temporary directory; an
    existing `model_dir` is taken as converted already) beside the float64 oracle in each compute
    type: `score_batch` log-probabilities of `tgt_ids` (plus the end token) per position, and
    `translate_batch` ids for each beam size against our `generate` with the same start and end
    ids, max_len, length_penalty, and no sampling. The two searches' settings are lined up from
    the checkpoint's generation note (`ctranslate2_compare.aligned_search`: no_repeat_ngram_size,
    min_decoding_length, suppress_sequences; CTranslate2's beam search stops once `beam_size`
    hypotheses end, `patience=1`, transformers' `early_stopping=True`, given to ours). `compute_types`:
    default COMPUTE_TYPES. `layout`: the family converted
    as (default: `family_of`). The report (`ctranslate2_compare.measure`) holds float32 to the
    tolerance table and equal ids, and measures the rest. A features source (Whisper) is measured by
    `ctranslate2_whisper.measure` on `src_ids`, its log-mel features: the encoder's output, and the
    greedy ids and each step's logits from Whisper's prompt (`tgt_ids` and `beams` are not read;
    `max_len`: the tokens generated after the prompt)."""
    require()
    compute_types = checked_compute_types(COMPUTE_TYPES if compute_types is None else compute_types)
    family = family_of(config, params, layout)
    representable(config, params, family)
    start, eos = generation_ids(config)
    progress = progress or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="rosetta-ct2-") as scratch:
        folder = Path(model_dir) if model_dir is not None else Path(scratch) / "model"
        if not folder.exists():
            progress(f"converting to CTranslate2 through {family.layout}")
            convert(config, params, folder, layout=family.layout, verify=False)  # measured below
        source = f"converted from the checkpoint through {family.layout}"
        if family.kind == "whisper":  # the features, greedy from Whisper's prompt (tgt_ids not read)
            from conformance.check.ctranslate2 import whisper

            return whisper.measure(config, params, folder, Directory.read(folder), src_ids, compute_types=compute_types,
                                   max_len=max_len, device=device, source=source, progress=progress)
        return measure(config, params, folder, Directory.read(folder), src_ids, tgt_ids, start=start, eos=eos,
                       compute_types=compute_types, beams=beams, max_len=max_len, length_penalty=length_penalty,
                       device=device, source=source, progress=progress)


# Per family: (pad id, start id, end id) as its released models have them (Marian's pad last).
EXAMPLE_IDS = {"hf-marian": (31, 31, 0), "hf-t5": (0, 0, 1), "hf-bart": (1, 2, 2), "hf-mbart": (1, 2, 2),
               "hf-pegasus": (0, 0, 1), "hf-m2m100": (1, 2, 2)}


def example_model(seed: int = 0, layout: str = "hf-marian") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A tiny seeded model of `layout`'s family (EXAMPLE_IDS) that CTranslate2 represents, with
    the two logits a trained model learns apart from the rest: the pad's far below (it is never a
    target), the end token's raised so that outputs end at different lengths (where the family has
    a final_logits_bias; T5 has none). Marian's pad row is zero (its loader starts the decoder from
    a zero embedding)."""
    from conformance.core.params import init_params
    from conformance.core.presets import preset

    pad, start, eos = EXAMPLE_IDS[layout]
    config = preset(layout, src_vocab_size=32, tgt_vocab_size=32, pad_id=pad,
                    notes={"generation": json.dumps({"decoder_start_token_id": start, "eos_token_id": eos,
                                                     "pad_token_id": pad})})
    params = {key: np.asarray(value, np.float32) for key, value in init_params(config, seed=seed).items()}
    if "final_logits_bias" in params:
        params["final_logits_bias"][pad] = -30.0
        params["final_logits_bias"][eos] = 2.0
    if family_of(config, params, layout).drops_pad:
        params["encoder.embedding.weight"][pad] = 0.0
    return config, params


def main(argv: list[str] | None = None) -> int:
    """`python -m conformance.check.ctranslate2.target [CHECKPOINT | LAYOUT]`: the error table on
    `fixed_batch` for a rosetta checkpoint, or for `example_model()` of the family LAYOUT (one of
    FAMILIES' layouts; default hf-marian)."""
    from conformance.check.report import fixed_batch
    from conformance.core import checkpoint

    argv = sys.argv[1:] if argv is None else argv
    layouts = [family.layout for family in FAMILIES]
    if argv and argv[0] in layouts and not Path(argv[0]).exists():
        config, params = example_model(layout=argv[0])
    else:
        config, params = checkpoint.load(argv[0]) if argv else example_model()
    src, tgt = fixed_batch(config)
    print(check(config, params, src, tgt, device=default_device()).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
