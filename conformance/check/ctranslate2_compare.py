"""A CTranslate2 model beside the float64 oracle: its `score_batch` log-probabilities per position
and its `translate_batch` ids (greedy, beam 4) against our `generate`, in each compute type.

    report = compare_ctranslate2("opus-ct2/", "hf-marian", src_ids, tgt_ids, weights="opus-mt/")
    conformance.compare("opus-ct2/", "hf-marian", src_ids, tgt_ids, weights="opus-mt/")  # dispatched here
    rosetta compare opus-ct2/ opus-mt/ --layout hf-marian
    print(report.table())

The model is a CTranslate2 model directory (model.bin, config.json, its vocabulary), or a
`ctranslate2.Translator` with `model_dir=` the directory it was loaded from (a Translator does not
say, and the directory's vocabulary and config.json are what map ids to tokens); a Translator runs
in its own compute type and device only. `weights` are what the model was converted from, read as
`onnx_compare.oracle_weights` reads them: a rosetta checkpoint, a Hugging Face folder (its own
layout), or a file through `layout`. `rosetta check --backends numpy,ctranslate2` runs the same
measurement on a model `ctranslate2_check.convert` made.

Ids and tokens. CTranslate2 takes and returns token strings. Its vocabulary file
(shared_vocabulary.json, or source_ and target_vocabulary.json; .txt in older directories) lists
them in row order: token i names row i of the embedding, as every converter writes it (a Hugging
Face tokenizer's vocabulary sorted by id, for `ct2-transformers-converter`; "i" for id i, for
rosetta's). So id i is spelled `tokens[i]`, and a token is read back as CTranslate2 reads it: a
token that names two rows is the first (T5's converter pads its vocabulary with repeated
`<extra_id_i>`), so a batch that needs the later row is refused, and the report says how many rows
cannot be named. A vocabulary that is not the weights' rows is refused: a length other than the
vocabulary size, except Marian's, whose loader drops the last row (the `<pad>` transformers
appended) and starts the decoder from a zero embedding, where transformers looks up the pad id's
row (model.bin's `decoder/start_from_zero_embedding` says which start a model has).

What is compared. The oracle is the weights' model in float64 on the float32-rounded weights
(CTranslate2 stores at most float32), its log-softmax over the rows CTranslate2 has, started from
the weights' decoder start id and stopped at their end id (the generation note; CTranslate2's
config.json tokens where the weights name none), the rows CTranslate2 lacks banned from our search.
Where CTranslate2 adds tokens to the source itself (config.json's add_source_bos/eos), the oracle's
source has them too. Where the two name different start or end tokens, or Marian's zero start meets
a pad row that is not zero, the report's notes say so and the scores show it from the first step.

Verdict: a row is held when CTranslate2 computes in float32 on float32 weights (model.bin's weight
dtypes): every position's |log p - oracle| <= atol * max(1, max |oracle log p|), the tolerance
table's float32 row for the device (the table's rule for any tensor), and its greedy and beam ids
equal ours. The other compute types, and float32 on quantized weights, are measured, not held.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from conformance.check.tolerances import Tolerance, tolerance
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError

# The compute types compared, as CTranslate2 names them (`ctranslate2.Translator(compute_type=...)`). Its CPU
# build runs the first three (bfloat16 and float16 only on a GPU: `ctranslate2.get_supported_compute_types`).
COMPUTE_TYPES = ("float32", "int8", "int8_float32", "bfloat16", "float16")
BEAMS = (1, 4)
HELD = "float32"  # the compute type held to a tolerance; the rest are measured
VOCABULARY_FILES = ("shared_vocabulary", "source_vocabulary", "target_vocabulary")
# model.bin's element types, by the id it stores (ctranslate2/specs/model_spec.py `_dtype_to_type_id`,
# include/ctranslate2/types.h), and the one binary version read (the one CTranslate2 4.8.5 writes).
MODEL_BIN_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
MODEL_BIN_VERSION = 6
ZERO_START = "decoder/start_from_zero_embedding"


def require():
    """The `ctranslate2` module, or an InputError saying how to install it."""
    try:
        import ctranslate2
    except ImportError as exc:
        raise InputError("ctranslate2", f"CTranslate2 is not installed ({exc}): "
                         "pip install 'rosetta-transformer[ctranslate2,torch]' transformers") from None
    return ctranslate2


def is_ctranslate2(model: Any) -> bool:
    """Whether `model` is a CTranslate2 model for `compare_ctranslate2`: a `ctranslate2.Translator`,
    or a directory holding model.bin and config.json."""
    if type(model).__name__ == "Translator" and type(model).__module__.startswith("ctranslate2"):
        return True
    if not isinstance(model, (str, os.PathLike)):
        return False
    path = Path(model)
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


@dataclass
class ComputeTypeResult:
    """One compute type against the oracle. `position_error[t]`: the largest |log p| difference at
    target position t (the appended end token last) over the rows that reach it. `held`: the
    tolerance the row is held to (None: measured), with `scale` = max(1, max |oracle log p|)."""

    compute_type: str
    position_error: np.ndarray
    agreement: dict[int, float] = field(default_factory=dict)  # beams -> share of equal ids
    first_split: dict[int, int | None] = field(default_factory=dict)  # beams -> first step where ids part
    held: Tolerance | None = None
    scale: float = 1.0

    @property
    def max_error(self) -> float:
        return float(np.max(self.position_error))

    @property
    def limit(self) -> float | None:
        return None if self.held is None else self.held.atol * self.scale

    @property
    def passed(self) -> bool | None:
        """None for a measured row; else whether every position is within the limit (NaN is not)
        and every search's ids equal ours."""
        if self.held is None:
            return None
        within = bool(np.all(self.position_error <= self.limit))  # False for NaN
        return within and all(share == 1.0 for share in self.agreement.values())

    def verdict(self) -> str:
        if self.held is None:
            return "measured"
        if self.passed:
            return f"ok (<= {self.limit:.1e}, ids equal)"
        problems = []
        beyond = np.flatnonzero(~(self.position_error <= self.limit))
        if beyond.size:
            t = int(beyond[0])
            problems.append(f"log p beyond {self.limit:.1e} from position {t} ({self.position_error[t]:.1e} there)")
        problems += [f"{_search(b)} ids part at step {self.first_split[b]}" for b in self.agreement
                     if self.agreement[b] != 1.0]
        return "FAIL: " + "; ".join(problems)

    def to_json(self) -> dict[str, Any]:
        return {"compute_type": self.compute_type, "max_abs": self.max_error,
                "position_error": [float(e) for e in self.position_error],
                "ids_equal": {_search(b): share for b, share in self.agreement.items()},
                "first_split": {_search(b): step for b, step in self.first_split.items()},
                "held": self.held is not None, "limit": self.limit, "passed": self.passed}


def _search(beams: int) -> str:
    return "greedy" if beams == 1 else f"beam {beams}"


@dataclass
class CTranslate2Report:
    rows: list[ComputeTypeResult]
    pad_mass: float  # the largest probability the oracle gives an id CTranslate2 lacks (Marian's pad)
    version: str
    max_len: int
    device: str = "cpu"
    skipped: dict[str, str] = field(default_factory=dict)  # compute type -> why it did not run
    banned: tuple[int, ...] = ()  # the ids banned from our generate: those CTranslate2's vocabulary lacks
    source: str = ""  # what was compared with what
    weight_dtypes: tuple[str, ...] = ("float32",)  # model.bin's weight matrices
    notes: list[str] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        return any(row.held is not None for row in self.rows)

    @property
    def passed(self) -> bool:
        """Every held row passed, and one was held: a report that held nothing passes nothing."""
        return self.checked and all(row.passed for row in self.rows if row.held is not None)

    def table(self) -> str:
        searches = list(self.rows[0].agreement) if self.rows else list(BEAMS)
        head = "| compute type | max abs error, log p | per position | " + " | ".join(
            f"{_search(b)} ids equal, first split" for b in searches) + " | verdict |"
        lines = [head, "|" + "---|" * (4 + len(searches))]
        for row in self.rows:
            ids = " | ".join(f"{row.agreement[b]:.0%}, {'-' if row.first_split[b] is None else row.first_split[b]}"
                             for b in row.agreement)
            per = " ".join(f"{e:.1e}" for e in row.position_error)
            lines.append(f"| {row.compute_type} | {row.max_error:.2e} | {per} | {ids} | {row.verdict()} |")
        for compute_type, why in self.skipped.items():
            lines.append(f"| {compute_type} | not run: {why} |")
        lines.append(f"({self.version} on {self.device}; oracle: NumPy float64; weights stored as "
                     f"{'+'.join(self.weight_dtypes)}; max_len {self.max_len}; largest probability of an id "
                     f"CTranslate2 lacks {self.pad_mass:.1e})")
        # The two searches are lined up to be one algorithm; a user running either's defaults is not.
        banned = f" and {list(self.banned)} banned (not in CTranslate2's vocabulary)" if self.banned else ""
        lines.append("(search aligned: CTranslate2 min_decoding_length=0, its default 1 never ends at the first step; "
                     f"ours early_stopping=True{banned}, as CTranslate2's beam search stops once num_hypotheses "
                     "hypotheses ended, where transformers' default early_stopping=False does not)")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_text(self) -> str:
        held = (f"{HELD} on {HELD} weights is held to |log p error| <= atol * max(1, max |oracle log p|) "
                f"(atol {tolerance(HELD, self.device).atol:.0e}, the tolerance table's {HELD} row) and ids equal to "
                "ours; the rest are measured")
        return "\n".join([f"ctranslate2: {self.source}" if self.source else "ctranslate2",
                          "score_batch log p per target position and translate_batch ids against the oracle "
                          "(CTranslate2 exposes no intermediate tensors)", f"verdict: {held}", "", self.table(), "",
                          f"ctranslate2: {'ok' if self.passed else 'FAIL' if self.checked else 'nothing held'}"])

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "version": self.version, "device": self.device, "passed": self.passed,
                "checked": self.checked, "weight_dtypes": list(self.weight_dtypes), "max_len": self.max_len,
                "pad_mass": self.pad_mass, "banned": list(self.banned), "skipped": self.skipped,
                "notes": self.notes, "compute_types": [row.to_json() for row in self.rows]}


def token_rows(ids, pad_id: int, name: str) -> list[list[int]]:
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


def until(row, eos_id: int) -> list[int]:
    row = [int(i) for i in row]
    return row[:row.index(eos_id)] if eos_id in row else row


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, int | None]:
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


class Vocabulary:
    """One side's tokens in row order, read as CTranslate2 reads them (see the module's docstring)."""

    def __init__(self, tokens: list[str], where: str):
        self.tokens, self.where = list(tokens), where
        self.row_of: dict[str, int] = {}
        for row, token in enumerate(self.tokens):
            self.row_of.setdefault(token, row)  # CTranslate2's lookup: a repeated token reads as its first row
        self.unnamed = [row for row, token in enumerate(self.tokens) if self.row_of[token] != row]

    @classmethod
    def read(cls, path: Path) -> Vocabulary:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            try:
                tokens = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError("model", f"{path}: not JSON ({exc})") from None
            if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                raise InputError("model", f"{path}: expected a JSON list of token strings")
        else:
            tokens = text.splitlines()  # CTranslate2 2.x: one token a line
        return cls(tokens, str(path))

    def lacked(self, size: int, pad_id: int, side: str) -> list[int]:
        """The ids of a `size`-row vocabulary this one has no token for: none, or Marian's pad
        (the last row, dropped by its loader); InputError for any other length."""
        if len(self.tokens) == size:
            return []
        if len(self.tokens) == size - 1 and pad_id == size - 1:
            return [pad_id]
        raise InputError("model", f"{self.where} holds {len(self.tokens)} tokens, the weights' {side} vocabulary "
                                  f"{size} rows: CTranslate2's token i is row i of the weights it was converted from "
                                  f"(only Marian's loader drops one, the last: the pad id {size - 1}), so these are "
                                  "not the weights of this model, or not their vocabulary")

    def spell(self, row: list[int], name: str) -> list[str]:
        """Row `row` of ids as CTranslate2's tokens; InputError for an id it cannot name."""
        for i in row:
            if not 0 <= i < len(self.tokens):
                raise InputError(name, f"id {i} has no token in {self.where} ({len(self.tokens)} tokens)")
            if self.row_of[self.tokens[i]] != i:
                raise InputError(name, f"id {i}'s token {self.tokens[i]!r} in {self.where} also names row "
                                       f"{self.row_of[self.tokens[i]]}, which is the row CTranslate2 reads it as: "
                                       f"id {i} cannot be given to CTranslate2 (use ids it can name)")
        return [self.tokens[i] for i in row]

    def read_back(self, tokens: list[str]) -> list[int]:
        return [self.row_of[t] for t in tokens]


@dataclass(frozen=True)
class Directory:
    """What is read from a CTranslate2 model directory beside the model: its vocabularies, its
    config.json, and from model.bin's header the dtypes of its weight matrices and its decoder's start."""

    path: Path
    source: Vocabulary
    target: Vocabulary
    config: dict[str, Any]
    weight_dtypes: tuple[str, ...]
    zero_start: bool

    @classmethod
    def read(cls, path: str | Path) -> Directory:
        path = Path(path)
        if not is_ctranslate2(path):
            raise InputError("model", f"{path}: not a CTranslate2 model directory (model.bin and config.json)")
        found = {}
        for name in VOCABULARY_FILES:
            for suffix in (".json", ".txt"):
                if (path / f"{name}{suffix}").is_file():
                    found.setdefault(name, path / f"{name}{suffix}")
        if "shared_vocabulary" in found:
            source = target = Vocabulary.read(found["shared_vocabulary"])
        elif {"source_vocabulary", "target_vocabulary"} <= set(found):
            source, target = Vocabulary.read(found["source_vocabulary"]), Vocabulary.read(found["target_vocabulary"])
        else:
            raise InputError("model", f"{path}: no vocabulary: expected shared_vocabulary.json, or "
                                      "source_vocabulary.json and target_vocabulary.json")
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InputError("model", f"{path / 'config.json'}: not JSON ({exc})") from None
        dtypes, zero_start = _read_header(path / "model.bin")
        return cls(path, source, target, config, dtypes, zero_start)

    def token_id(self, key: str, vocabulary: Vocabulary) -> int | None:
        """The id of config.json's special token `key` (None when it names none, or a token the
        vocabulary lacks: Marian's decoder start, which its zero embedding replaces)."""
        token = self.config.get(key)
        return vocabulary.row_of.get(token) if token is not None else None

    def added_to_source(self, side: str) -> int:
        """The id of the token CTranslate2 adds to each source (`side`: "bos" or "eos")."""
        token = self.config.get(f"{side}_token")
        if token not in self.source.row_of:
            raise InputError("model", f"{self.path / 'config.json'}: add_source_{side} adds {token!r}, which "
                                      f"{self.source.where} does not hold")
        return self.source.row_of[token]


def _read_header(path: Path) -> tuple[tuple[str, ...], bool]:
    """(the dtypes of model.bin's weight matrices, its decoder's start_from_zero_embedding), read
    from the variables' headers; their data is skipped (the layout of `ModelSpec._serialize`)."""
    with open(path, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise InputError("model", f"{path}: ends inside its header (a model.bin cut short?)")
            return struct.unpack(fmt, data)[0]

        def string() -> str:
            size = read("<H")
            data = f.read(size)
            if len(data) != size:
                raise InputError("model", f"{path}: ends inside its header (a model.bin cut short?)")
            return data[:-1].decode("utf-8", errors="replace")  # stored with its NUL

        version = read("<I")
        if version != MODEL_BIN_VERSION:
            raise InputError("model", f"{path}: binary version {version}; compare reads version {MODEL_BIN_VERSION}, "
                                      "the version CTranslate2 4.8.5 writes (convert the model again with it)")
        string(), read("<I")  # the spec's name and revision
        dtypes, zero_start = set(), False
        for _ in range(read("<I")):
            name = string()
            shape = [read("<I") for _ in range(read("<B"))]
            kind, size = read("<B"), read("<I")
            if kind >= len(MODEL_BIN_DTYPES):
                raise InputError("model", f"{path}: variable {name} has element type {kind}, none of "
                                          f"{MODEL_BIN_DTYPES}")
            dtype = MODEL_BIN_DTYPES[kind]
            if name == ZERO_START:
                zero_start = bool(np.frombuffer(f.read(size), dtype=np.dtype(dtype))[0])
                continue
            if len(shape) == 2 and name.endswith("/weight"):
                dtypes.add(dtype)
            f.seek(size, os.SEEK_CUR)
    return tuple(sorted(dtypes)), zero_start


def _padded(rows: list[list[int]], pad_id: int) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), pad_id)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def measure(config: ModelConfig, params, model: Any, directory: Directory, src_ids, tgt_ids, *, start: int,
            eos: int, compute_types=COMPUTE_TYPES, beams=BEAMS, max_len: int | None = None,
            length_penalty: float = 1.0, device: str = "cpu", source: str = "", notes: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> CTranslate2Report:
    """`model` (the directory's path, or a Translator of it) beside the oracle on `params`: see
    the module's docstring. `start`, `eos`: the oracle's decoder start and end ids. With a
    Translator, `compute_types` is its own only."""
    import impl_numpy

    ctranslate2 = require()
    progress = progress or (lambda message: None)
    for compute_type in compute_types:
        if compute_type not in COMPUTE_TYPES:
            raise InputError("compute_types", f"expected some of {list(COMPUTE_TYPES)}, got {compute_type!r}")
    pad = config.pad_id
    lacked = directory.target.lacked(config.tgt_vocab_size, pad, "target")
    directory.source.lacked(config.src_vocab_size, pad, "source")
    sources, targets = token_rows(src_ids, pad, "src_ids"), token_rows(tgt_ids, pad, "tgt_ids")
    text = [directory.source.spell(row, "src_ids") for row in sources]
    spelled = [directory.target.spell(row, "tgt_ids") for row in targets]
    notes = list(notes or [])
    # What CTranslate2 adds to each source itself (config.json add_source_bos/eos), the oracle's source has too.
    before, after = ([directory.added_to_source(side)] if directory.config.get(f"add_source_{side}") else []
                     for side in ("bos", "eos"))
    src = _padded([before + row + after for row in sources], pad)
    unnamed = directory.target.unnamed
    if unnamed:
        notes.append(f"{len(unnamed)} rows of {directory.target.where} (from {unnamed[0]}) have an earlier row's "
                     "token; CTranslate2 reads an output of one as the earlier row")
    max_len = max_len or config.max_len
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
    kept = np.delete(logits, lacked, axis=-1)  # CTranslate2's vocabulary
    top = kept.max(-1, keepdims=True)
    log_z = top + np.log(np.exp(kept - top).sum(-1, keepdims=True))
    oracle = np.take_along_axis(logits, wanted[..., None], -1)[..., 0] - log_z[..., 0]  # (B, T)
    full_top = logits.max(-1, keepdims=True)
    probs = np.exp(logits - full_top) / np.exp(logits - full_top).sum(-1, keepdims=True)  # (B, T, V)
    pad_p = probs[..., lacked].max(-1) if lacked else np.zeros(probs.shape[:-1])
    valid = np.arange(longest)[None] <= np.array([len(t) for t in targets])[:, None]  # (B, T)
    scale = max(1.0, float(np.abs(np.where(valid, oracle, 0.0)).max()))

    ours = {b: [until(r, eos) for r in oracle_model.generate(src, max_len=max_len, bos_id=start, eos_id=eos,
                                                               num_beams=b, length_penalty=length_penalty,
                                                               banned_ids=lacked, early_stopping=True)]
            for b in beams}
    translator = model if not isinstance(model, (str, os.PathLike)) else None
    if translator is not None:
        compute_types, device = (translator.compute_type,), translator.device
    supported = ctranslate2.get_supported_compute_types(device)
    skipped = {t: f"CTranslate2 {ctranslate2.__version__} has no {t} kernels on this {device}" for t in compute_types
               if t not in supported}
    float32_weights = directory.weight_dtypes == ("float32",)
    if not float32_weights:
        notes.append(f"weights stored as {'+'.join(directory.weight_dtypes)}: every row is measured, none held "
                     f"(the {HELD} row computes on the stored weights, widened)")
    rows = []
    for compute_type in [t for t in compute_types if t not in skipped]:
        progress(f"ctranslate2/{device}/{compute_type}: score_batch, translate_batch")
        running = translator or ctranslate2.Translator(str(directory.path), device=device, compute_type=compute_type)
        scored = running.score_batch(text, spelled)
        theirs = np.zeros_like(oracle)
        for i, s in enumerate(scored):
            theirs[i, :len(s.log_probs)] = s.log_probs
        error = np.where(valid, np.abs(theirs - oracle), 0.0).max(0)  # (T,)
        held = tolerance(HELD, device) if compute_type == HELD and float32_weights else None
        row = ComputeTypeResult(compute_type, error, held=held, scale=scale)
        for b in beams:
            out = running.translate_batch(text, beam_size=b, max_decoding_length=max_len,
                                          length_penalty=length_penalty, min_decoding_length=0)
            ids = [directory.target.read_back(r.hypotheses[0]) for r in out]
            row.agreement[b], row.first_split[b] = agreement(ours[b], ids)
        rows.append(row)
    return CTranslate2Report(rows, float(np.where(valid, pad_p, 0.0).max()), f"ctranslate2 {ctranslate2.__version__}",
                             max_len, device, skipped, tuple(lacked), source, directory.weight_dtypes, notes)


def generation_note(config: ModelConfig) -> dict[str, Any]:
    """The checkpoint's "generation" note (special ids, decoding defaults), or {}."""
    return json.loads(config.notes["generation"]) if config.notes.get("generation") else {}


def compare_ctranslate2(model: Any, layout: Any, src_ids, tgt_ids, *, weights=None, model_dir=None,
                        compute_types=COMPUTE_TYPES, beams=BEAMS, max_len: int | None = None,
                        length_penalty: float = 1.0, device: str = "cpu", run: Callable | None = None,
                        backends: Any = None, grads: bool = False, progress: Callable[[str], None] | None = None,
                        oracle: tuple[ModelConfig, dict, Any] | None = None, **overrides: Any) -> CTranslate2Report:
    """The user's CTranslate2 model beside the oracle run on `weights` (read through `layout`);
    see the module's docstring. `run`, `backends` and `grads` do not apply (CTranslate2 runs by
    tokens, exposes no tensors for our backends' table, has no backward pass): refused. `oracle`:
    the (config, params, layout) of `onnx_compare.oracle_weights`, read already."""
    from conformance.check.onnx_compare import oracle_weights

    for given, name, why in ((run is not None, "run", "CTranslate2 is run by compare itself, by tokens"),
                             (grads, "grads", "CTranslate2 has no backward pass to compare"),
                             (bool(backends), "backends", "a CTranslate2 model exposes no tensors to put beside our "
                                                          "backends': check ours with rosetta check")):
        if given:
            raise InputError(name, why)
    require()
    progress = progress or (lambda message: None)
    translator = None if isinstance(model, (str, os.PathLike)) else model
    if translator is not None and model_dir is None:
        raise InputError("model_dir", "a ctranslate2.Translator does not say which directory it was loaded from: "
                                      "pass model_dir= (its vocabulary and config.json map ids to tokens)")
    directory = Directory.read(model_dir if translator is not None else model)
    if oracle is None:
        if weights is None:
            raise InputError("weights", "the oracle needs the weights the CTranslate2 model was converted from: a "
                                        "rosetta checkpoint, a Hugging Face folder or a file with a layout")
        progress(f"reading {weights}")
        oracle = oracle_weights(weights, None, layout, overrides)
    config, params, layout = oracle
    note = generation_note(config)
    notes = []
    # The start: the weights' own (as transformers starts), else CTranslate2's.
    theirs_start = (config.pad_id if directory.zero_start
                    else directory.token_id("decoder_start_token", directory.target))
    theirs_eos = directory.token_id("eos_token", directory.target)
    start = note.get("decoder_start_token_id", theirs_start)
    eos = note.get("eos_token_id", theirs_eos)
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
    source = f"{model_dir or model} against {weights or 'the given weights'}" + (
        f" through layout {layout.name}" if layout is not None else "")
    return measure(config, params, translator or directory.path, directory, src_ids, tgt_ids, start=int(start),
                   eos=int(eos), compute_types=compute_types, beams=beams, max_len=max_len,
                   length_penalty=length_penalty, device=device, source=source, notes=notes, progress=progress)
