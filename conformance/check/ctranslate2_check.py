"""CTranslate2 beside the oracle: a rosetta checkpoint converted by CTranslate2's own converter, then
its `score_batch` and `translate_batch` compared with the float64 NumPy model.

    from conformance.check import ctranslate2_check
    ctranslate2_check.convert(config, params, "model-ct2/")            # `rosetta convert --to ctranslate2`
    report = ctranslate2_check.check(config, params, src_ids, tgt_ids)  # every compute type
    print(report.table())

    python -m conformance.check.ctranslate2_check [CHECKPOINT | LAYOUT] # the table, on fixed_batch

The path is the one a user takes: the checkpoint is written as a Hugging Face folder of the first
family in FAMILIES whose layout expresses it (Marian, T5, BART; `conformance.convert.hf_folder.write_folder`)
and handed to `ctranslate2.converters.TransformersConverter`, which loads it with transformers'
model class and CTranslate2's loader for that family. Only what the loader represents is converted
(`representable`): one vocabulary for source and target; and CTranslate2's Marian loader drops
the last vocabulary row as the `<pad>` transformers appended and starts the decoder from a zero
embedding, so for Marian the pad id must be the last id and its embedding row zero.

The oracle is the model as CTranslate2 runs it: the float64 model on the float32-rounded weights that
CTranslate2 received, its log-softmax taken over CTranslate2's vocabulary (Marian's without the pad
column), and our `generate` from the same start id with the ids CTranslate2 lacks banned
(transformers' bad_words_ids for Marian). A banned id still holds probability mass in our beam
scores and none in CTranslate2's; `pad_mass` reports the largest, which is what can part beam ids
that agree everywhere else.

Needs the [ctranslate2] extra and transformers with torch (the converter loads the folder).
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError, InputError


@dataclass(frozen=True)
class Family:
    """What CTranslate2's loader for one Hugging Face family does to a model (its
    ctranslate2/converters/transformers.py), as data: the layout the folder is written in, and
    whether the loader drops the pad id's vocabulary row (MarianMTLoader: the `<pad>` transformers
    appended, replaced by a decoder that starts from a zero embedding), and the config.json fields
    the loader reads that transformers no longer writes, added to the folder's config.json."""

    layout: str
    drops_pad: bool = False
    legacy_fields: tuple[tuple[str, Any], ...] = ()


# In the order tried for a checkpoint (`family_of`): each layout's export refuses what its family
# cannot express (Marian's sinusoids, T5's relative bias and RMSNorm, BART's offset table).
# CTranslate2 4.8.5's BartLoader reads BartConfig.normalize_before, a transformers 3 field that
# transformers 5 neither sets nor writes (false for BART: post-LN; hf-bart's [hf.unsupported]).
FAMILIES = (Family("hf-marian", drops_pad=True), Family("hf-t5"),
            Family("hf-bart", legacy_fields=(("normalize_before", False),)))

# The compute types compared, as CTranslate2 names them (`ctranslate2.Translator(compute_type=...)`). Its CPU
# build runs the first three (bfloat16 and float16 only on a GPU: `ctranslate2.get_supported_compute_types`).
COMPUTE_TYPES = ("float32", "int8", "int8_float32", "bfloat16", "float16")
BEAMS = (1, 4)


def require():
    """The `ctranslate2` module, or an InputError saying how to install it."""
    try:
        import ctranslate2
    except ImportError as exc:
        raise InputError("ctranslate2", f"CTranslate2 is not installed ({exc}): "
                         "pip install 'rosetta-transformer[ctranslate2,torch]' transformers") from None
    return ctranslate2


def family_of(config: ModelConfig, params, layout: str | None = None) -> Family:
    """The family CTranslate2 converts this model as: the one named by `layout`, or else the first
    of FAMILIES whose layout's export expresses it; ConfigError with each family's reason if none does."""
    from conformance.convert import export_state_dict, load_layout

    if layout is not None:
        for family in FAMILIES:
            if family.layout == layout:
                return family
        raise InputError("layout", f"CTranslate2 is checked through the layouts {[f.layout for f in FAMILIES]}, "
                         f"got {layout!r}")
    reasons, errors = [], []
    for family in FAMILIES:
        try:
            export_state_dict(config, params, load_layout(family.layout))
        except ConfigError as exc:
            reasons.append(f"{family.layout}: {exc}")
            errors.append(exc)
            continue
        return family
    fields = tuple(dict.fromkeys(f for exc in errors for f in exc.fields))
    raise ConfigError(fields[0], "no family CTranslate2 converts expresses this model:\n  " + "\n  ".join(reasons),
                      fields=fields)


def representable(config: ModelConfig, params, family: Family = FAMILIES[0]) -> None:
    """Refuse, with the switch named, a model that CTranslate2's loader for `family` would change.
    The family's export refuses what the family itself cannot express (position, norm placement, ...)."""
    vocab = config.tgt_vocab_size
    if config.src_vocab_size != vocab:
        raise ConfigError("src_vocab_size", f"CTranslate2's {family.layout} loader registers one vocabulary for "
                          f"source and target; src_vocab_size {config.src_vocab_size} != tgt_vocab_size {vocab}")
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
    note = json.loads(config.notes["generation"]) if config.notes.get("generation") else {}
    if note.get("decoder_start_token_id") not in (None, config.pad_id):
        raise ConfigError("notes", f"CTranslate2 starts Marian's decoder from a zero embedding, the pad id's row "
                          f"({config.pad_id}); the checkpoint's note starts it from {note['decoder_start_token_id']}")


def generation_ids(config: ModelConfig) -> tuple[int, int]:
    """(start id, end id) from the checkpoint's note: its decoder_start_token_id, else the pad id
    (Marian's and T5's start), and its end token."""
    note = json.loads(config.notes["generation"]) if config.notes.get("generation") else {}
    start = note.get("decoder_start_token_id")
    start = config.pad_id if start is None else int(start)
    eos = note.get("eos_token_id", config.notes.get("eos_id"))
    if eos is None:
        raise ConfigError("notes", "the checkpoint names no end token (note 'generation' eos_token_id, or 'eos_id'): "
                          "CTranslate2 needs one to stop decoding")
    return start, int(eos)


class _Vocabulary:
    """What `TransformersConverter` reads from a tokenizer: token `i` is spelled `str(i)`, so a
    CTranslate2 token maps back to its id exactly, with no tokenizer files in the folder. For
    Marian the pad id (the last) is left out: its loader drops its weights rows."""

    def __init__(self, size: int, start_id: int, eos_id: int, pad_id: int):
        self.size = size
        self.eos_token = self.unk_token = str(eos_id)  # rosetta has no unknown token; every id is known
        self.bos_token, self.pad_token = str(start_id), str(pad_id)  # BART's and T5's loaders read them

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.size)}

    def convert_ids_to_tokens(self, i: int) -> str:
        return str(i)


def convert(config: ModelConfig, params, dst: str | Path, quantization: str = "float32",
            layout: str | None = None) -> Path:
    """A new CTranslate2 model directory at `dst`, made whole or not at all, its weights stored in
    `quantization` (one of COMPUTE_TYPES), through the folder of `layout` (default: `family_of`)."""
    from conformance.convert import export_state_dict, load_layout
    from conformance.convert.hf_folder import write_folder
    from conformance.core.checkpoint import atomic_directory
    from conformance.core.errors import CheckpointError

    ctranslate2 = require()
    if quantization not in COMPUTE_TYPES:
        raise InputError("--quantization", f"expected one of {list(COMPUTE_TYPES)}, got {quantization!r}")
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(dst, "already exists; a CTranslate2 model goes into a new directory: name one that "
                              "does not exist")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    family = family_of(config, params, layout)
    representable(config, params, family)
    start, eos = generation_ids(config)
    layout = load_layout(family.layout)
    weights = {key: np.asarray(value, np.float32) for key, value in params.items()}  # CTranslate2 stores <= float32
    state = export_state_dict(config, weights, layout)
    size = config.tgt_vocab_size - (1 if family.drops_pad else 0)

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, *args, **kwargs):
            return _Vocabulary(size, start, eos, config.pad_id)

    with tempfile.TemporaryDirectory(prefix="rosetta-ct2-") as scratch, atomic_directory(dst) as staged:
        folder = Path(scratch) / family.layout
        write_folder(folder, config, state, layout)
        if family.legacy_fields:
            hf = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**hf, **dict(family.legacy_fields)}, indent=2))
        try:
            Converter(str(folder)).convert(str(staged), quantization=quantization)
        except ImportError as exc:  # its loader imports transformers and torch only now
            raise InputError("ctranslate2", f"CTranslate2's converter loads the Hugging Face folder with transformers "
                             f"and torch ({exc}): pip install transformers 'rosetta-transformer[torch]'") from None
    return dst


@dataclass
class ComputeTypeResult:
    """One compute type against the oracle. `position_error[t]`: the largest |log p| difference at
    target position t (the appended end token last) over the rows that reach it."""

    compute_type: str
    position_error: np.ndarray
    agreement: dict[int, float] = field(default_factory=dict)  # beams -> share of equal ids
    first_split: dict[int, int | None] = field(default_factory=dict)  # beams -> first step where ids part

    @property
    def max_error(self) -> float:
        return float(np.max(self.position_error))


@dataclass
class CTranslate2Report:
    rows: list[ComputeTypeResult]
    pad_mass: float  # the largest probability the oracle gives an id CTranslate2 lacks (Marian's pad)
    version: str
    max_len: int
    device: str = "cpu"
    skipped: dict[str, str] = field(default_factory=dict)  # compute type -> why it did not run
    banned: tuple[int, ...] = ()  # the ids banned from our generate: those CTranslate2's vocabulary lacks

    def table(self) -> str:
        head = "| compute type | max abs error, log p | per position | " + " | ".join(
            f"{'greedy' if b == 1 else f'beam {b}'} ids equal, first split" for b in self.rows[0].agreement) + " |"
        lines = [head, "|" + "---|" * (3 + len(self.rows[0].agreement))]
        for row in self.rows:
            ids = " | ".join(f"{row.agreement[b]:.0%}, {'-' if row.first_split[b] is None else row.first_split[b]}"
                             for b in row.agreement)
            per = " ".join(f"{e:.1e}" for e in row.position_error)
            lines.append(f"| {row.compute_type} | {row.max_error:.2e} | {per} | {ids} |")
        for compute_type, why in self.skipped.items():
            lines.append(f"| {compute_type} | not run: {why} |")
        lines.append(f"({self.version} on {self.device}; oracle: NumPy float64; max_len {self.max_len}; "
                     f"largest probability of an id CTranslate2 lacks {self.pad_mass:.1e})")
        # The two searches are lined up to be one algorithm; a user running either's defaults is not.
        banned = f" and {list(self.banned)} banned (not in CTranslate2's vocabulary)" if self.banned else ""
        lines.append("(search aligned: CTranslate2 min_decoding_length=0, its default 1 never ends at the first step; "
                     f"ours early_stopping=True{banned}, as CTranslate2's beam search stops once num_hypotheses "
                     "hypotheses ended, where transformers' default early_stopping=False does not)")
        return "\n".join(lines)


def _rows(ids: np.ndarray, pad_id: int, name: str) -> list[list[int]]:
    """Each row's ids before its trailing padding; padding inside a row is refused (CTranslate2
    takes unpadded lists, and positions would shift)."""
    rows = []
    for i, row in enumerate(np.asarray(ids).tolist()):
        n = len(row)
        while n and row[n - 1] == pad_id:
            n -= 1
        if n == 0 or pad_id in row[:n]:
            raise InputError(name, f"row {i} must be tokens followed by padding only (pad_id={pad_id}), got {row}")
        rows.append(row[:n])
    return rows


def _until(row, eos_id: int) -> list[int]:
    row = [int(i) for i in row]
    return row[:row.index(eos_id)] if eos_id in row else row


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, int | None]:
    """(share of steps where the ids are equal, the first step where any row's ids part, or None)."""
    equal = total = 0
    first = None
    for a, b in zip(ours, theirs):
        steps = max(len(a), len(b)) + 1  # the end token (or its absence) is a step too
        a, b = a + [-1] * (steps - len(a)), b + [-1] * (steps - len(b))
        same = [x == y for x, y in zip(a, b)]
        equal, total = equal + sum(same), total + steps
        if not all(same):
            step = same.index(False)
            first = step if first is None else min(first, step)
    return equal / total, first


def check(config: ModelConfig, params, src_ids, tgt_ids, *, compute_types=COMPUTE_TYPES, beams=BEAMS,
          max_len: int | None = None, length_penalty: float = 1.0, model_dir: str | Path | None = None,
          device: str = "cpu", layout: str | None = None) -> CTranslate2Report:
    """CTranslate2 (converted from `params` into `model_dir`, default a temporary directory) beside
    the float64 oracle in each compute type: `score_batch` log-probabilities of `tgt_ids` (plus the
    end token) per position, and `translate_batch` ids for each beam size against our `generate`
    with the same start and end ids, max_len, length_penalty, and no sampling. The two searches'
    defaults differ where the settings are lined up: CTranslate2's `min_decoding_length` (1) is
    set to 0, rosetta's (and transformers') none; its beam search stops once `beam_size`
    hypotheses end (`patience=1`), which is transformers' `early_stopping=True`, given to ours.
    `layout`: the family converted as (default: `family_of`)."""
    import impl_numpy

    ctranslate2 = require()
    for compute_type in compute_types:
        if compute_type not in COMPUTE_TYPES:
            raise InputError("compute_types", f"expected some of {list(COMPUTE_TYPES)}, got {compute_type!r}")
    family = family_of(config, params, layout)
    representable(config, params, family)
    start, eos = generation_ids(config)
    pad = config.pad_id
    lacked = [pad] if family.drops_pad else []  # ids not in CTranslate2's vocabulary
    sources, targets = _rows(src_ids, pad, "src_ids"), _rows(tgt_ids, pad, "tgt_ids")
    max_len = max_len or config.max_len
    weights = {key: np.asarray(value, np.float32) for key, value in params.items()}  # what CTranslate2 gets
    model = impl_numpy.Model(config, weights, dtype="float64")

    # The oracle's log p of each target token after [start] + prefix, the end token appended.
    longest = max(len(t) for t in targets) + 1
    decoder_in = np.full((len(targets), longest), pad)
    wanted = np.full((len(targets), longest), pad)
    for i, t in enumerate(targets):
        decoder_in[i, :len(t) + 1] = [start] + t
        wanted[i, :len(t) + 1] = t + [eos]
    src = np.asarray(src_ids)
    logits = model(src, decoder_in, return_attention=False).logits  # (B, T, V)
    kept = np.delete(logits, lacked, axis=-1)  # CTranslate2's vocabulary
    top = kept.max(-1, keepdims=True)
    log_z = top + np.log(np.exp(kept - top).sum(-1, keepdims=True))
    oracle = np.take_along_axis(logits, wanted[..., None], -1)[..., 0] - log_z[..., 0]  # (B, T)
    full_top = logits.max(-1, keepdims=True)
    probs = np.exp(logits - full_top) / np.exp(logits - full_top).sum(-1, keepdims=True)  # (B, T, V)
    pad_p = probs[..., lacked].max(-1) if lacked else np.zeros(probs.shape[:-1])
    valid = np.arange(longest)[None] <= np.array([len(t) for t in targets])[:, None]  # (B, T)

    ours = {b: [_until(r, eos) for r in model.generate(src, max_len=max_len, bos_id=start, eos_id=eos, num_beams=b,
                                                        length_penalty=length_penalty, banned_ids=lacked,
                                                        early_stopping=True)]
            for b in beams}
    text = [[str(i) for i in row] for row in sources]
    supported = ctranslate2.get_supported_compute_types(device)
    skipped = {t: f"CTranslate2 {ctranslate2.__version__} has no {t} kernels on this {device}" for t in compute_types
               if t not in supported}
    results = []
    with tempfile.TemporaryDirectory(prefix="rosetta-ct2-") as scratch:
        folder = Path(model_dir) if model_dir is not None else Path(scratch) / "model"
        if not folder.exists():
            convert(config, params, folder, layout=family.layout)
        for compute_type in [t for t in compute_types if t not in skipped]:
            translator = ctranslate2.Translator(str(folder), device=device, compute_type=compute_type)
            scored = translator.score_batch(text, [[str(i) for i in t] for t in targets])
            theirs = np.zeros_like(oracle)
            for i, s in enumerate(scored):
                theirs[i, :len(s.log_probs)] = s.log_probs
            error = np.where(valid, np.abs(theirs - oracle), 0.0).max(0)  # (T,)
            row = ComputeTypeResult(compute_type, error)
            for b in beams:
                out = translator.translate_batch(text, beam_size=b, max_decoding_length=max_len,
                                                 length_penalty=length_penalty, min_decoding_length=0)
                ids = [[int(t) for t in r.hypotheses[0]] for r in out]
                row.agreement[b], row.first_split[b] = _agreement(ours[b], ids)
            results.append(row)
    return CTranslate2Report(results, float(np.where(valid, pad_p, 0.0).max()), f"ctranslate2 {ctranslate2.__version__}",
                             max_len, device, skipped, tuple(lacked))


# Per family: (pad id, start id, end id) as its released models have them (Marian's pad last).
EXAMPLE_IDS = {"hf-marian": (31, 31, 0), "hf-t5": (0, 0, 1), "hf-bart": (1, 2, 2)}


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
    """`python -m conformance.check.ctranslate2_check [CHECKPOINT | LAYOUT]`: the error table on
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
    ctranslate2 = require()

    device = "cuda" if ctranslate2.get_cuda_device_count() else "cpu"
    print(check(config, params, src, tgt, device=device).table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
