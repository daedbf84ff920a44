"""What is read from a CTranslate2 model directory beside the model: its vocabularies (token i is
row i), its config.json, and from model.bin's header the dtypes of its weight matrices and its
decoder's start; and the checks of the options every CTranslate2 run takes (compute types, device).

Ids and tokens. CTranslate2 takes and returns token strings. Its vocabulary file
(shared_vocabulary.json, or source_ and target_vocabulary.json; .txt in older directories, one
token a line, split on "\\n" only as CTranslate2 reads it) lists them in row order: token i names
row i of the embedding, as every converter writes it (a Hugging Face tokenizer's vocabulary sorted
by id, for `ct2-transformers-converter`; "i" for id i, for rosetta's). So id i is spelled
`tokens[i]`, and a token is read back as CTranslate2 reads it: a token that names two rows is the
first (T5's converter pads its vocabulary with repeated `<extra_id_i>`), so a batch that needs the
later row is refused, and an output id is compared as CTranslate2 sees it (`Vocabulary.as_seen`:
a later row's id reads as the first row's). A vocabulary that is not the weights' rows is refused:
a length other than the vocabulary size, except Marian's, whose loader drops the last row (the
`<pad>` transformers appended) and starts the decoder from a zero embedding, where transformers
looks up the pad id's row (model.bin's `decoder/start_from_zero_embedding` says which start a
model has).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conformance.core.errors import InputError

# The compute types compared, as CTranslate2 names them (`ctranslate2.Translator(compute_type=...)`). Its CPU
# build runs the first three (bfloat16 and float16 only on a GPU: `ctranslate2.get_supported_compute_types`).
COMPUTE_TYPES = ("float32", "int8", "int8_float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
BEAMS = (1, 4)
HELD = "float32"  # the compute type held to a tolerance; the rest are measured
VOCABULARY_FILES = ("shared_vocabulary", "source_vocabulary", "target_vocabulary", "vocabulary")
WHISPER_SPEC = "WhisperSpec"  # model.bin's spec name for a Whisper model (a LanguageModelSpec: one vocabulary.json)
# model.bin's element types, by the id it stores (ctranslate2/specs/model_spec.py `_dtype_to_type_id`,
# include/ctranslate2/types.h), and the one binary version read (the one CTranslate2 4.8.5 writes).
MODEL_BIN_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
MODEL_BIN_VERSION = 6
ZERO_START = "decoder/start_from_zero_embedding"
# Below this many parameters CTranslate2 runs on one intra-op thread (`intra_threads`), as torch
# does in rosetta's commands (conformance/cli/threads.py, the same bound): its default is 4 OpenMP
# threads, and on a machine with fewer free cores than that each tiny operation waits at a
# barrier for a thread the scheduler has put aside. Measured on the shared 2-core machine (load
# average 11), a 2+2-layer T5 of 11k parameters, batch 3, 512 steps: translate_batch beam 4 took
# 44.5 s with the default and 0.48 s with one thread; score_batch 1.68 s and 0.13 s.
SMALL_MODEL_PARAMETERS = 2_000_000
THREAD_VARIABLES = ("OMP_NUM_THREADS",)  # a count the user set: CTranslate2 gets it as it is


def require():
    """The `ctranslate2` module, or an InputError saying how to install it."""
    try:
        import ctranslate2
    except ImportError as exc:
        raise InputError("ctranslate2", f"CTranslate2 is not installed ({exc}): "
                         "pip install 'rosetta-transformer[ctranslate2,torch]' transformers") from None
    return ctranslate2


def intra_threads(config, device: str) -> int:
    """`ctranslate2.Translator(intra_threads=...)` for `config`'s model on `device`: one thread for a
    model below `SMALL_MODEL_PARAMETERS` on the CPU, the user's OMP_NUM_THREADS when set, else 0
    (CTranslate2's own default)."""
    from conformance.core.params import param_bytes

    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    if device == "cpu" and param_bytes(config, "float64") // 8 < SMALL_MODEL_PARAMETERS:
        return 1
    return 0


def is_ctranslate2(model: Any) -> bool:
    """Whether `model` is a CTranslate2 model for `compare_ctranslate2`: a `ctranslate2.Translator`
    or `ctranslate2.models.Whisper`, or a directory holding model.bin and config.json."""
    if type(model).__name__ in ("Translator", "Whisper") and type(model).__module__.startswith("ctranslate2"):
        return True
    if not isinstance(model, (str, os.PathLike)):
        return False
    path = Path(model)
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


def checked_compute_types(compute_types, name: str = "compute_types") -> tuple[str, ...]:
    """`compute_types` as a tuple of CTranslate2's names (COMPUTE_TYPES), at least one; InputError if not."""
    if isinstance(compute_types, str):
        compute_types = (compute_types,)
    compute_types = tuple(compute_types)
    if not compute_types or any(t not in COMPUTE_TYPES for t in compute_types):
        raise InputError(name, f"expected some of {list(COMPUTE_TYPES)}, got {list(compute_types)!r}")
    return compute_types


def runnable_compute_types(ctranslate2, directory, compute_types, device: str, notes: list) -> tuple[list, dict, bool]:
    """Of `compute_types`, those CTranslate2 has kernels for on `device`, the others with why
    (`skipped`), and whether the directory's weights are stored float32: only then is a row held to
    a tolerance (otherwise `notes` gets why every row is measured, none held)."""
    skipped = {t: f"CTranslate2 {ctranslate2.__version__} has no {t} kernels on this {device}" for t in compute_types
               if t not in ctranslate2.get_supported_compute_types(device)}
    float32_weights = directory.weight_dtypes == ("float32",)
    if not float32_weights:
        notes.append(f"weights stored as {'+'.join(directory.weight_dtypes)}: every row is measured, none held "
                     f"(the {HELD} row computes on the stored weights, widened)")
    return [t for t in compute_types if t not in skipped], skipped, float32_weights


def checked_device(device: str) -> str:
    """`device` if CTranslate2 names it so (DEVICES); InputError if not."""
    if device not in DEVICES:
        raise InputError("device", f"expected one of {list(DEVICES)} (CTranslate2's device names), got {device!r}")
    return device


def default_device() -> str:
    """"cuda" when CTranslate2 sees a CUDA device, else "cpu"."""
    return "cuda" if require().get_cuda_device_count() else "cpu"


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
            # CTranslate2 2.x: one token a line, split on "\n" only (str.splitlines would also split a
            # token holding \x1c, \x85 or \u2028, which tokenizers' byte-level vocabularies do hold).
            tokens = text.split("\n")
            if tokens and tokens[-1] == "":
                tokens.pop()
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

    def as_seen(self, row: list[int]) -> list[int]:
        """Our output ids as CTranslate2 sees them: spelled and read back, so a later row of a
        repeated token is its first row (an id beyond the tokens, Marian's banned pad, stays)."""
        return [self.row_of[self.tokens[i]] if 0 <= i < len(self.tokens) else i for i in row]


@dataclass(frozen=True)
class Directory:
    """A CTranslate2 model directory, read: its vocabularies, its config.json, and from model.bin's
    header the dtypes of its weight matrices and its decoder's start."""

    path: Path
    source: Vocabulary
    target: Vocabulary
    config: dict[str, Any]
    weight_dtypes: tuple[str, ...]
    zero_start: bool
    spec: str = ""  # model.bin's spec name: "TransformerSpec", WHISPER_SPEC, ...

    @property
    def whisper(self) -> bool:
        """A Whisper model (`ctranslate2.models.Whisper`), not a Translator's."""
        return self.spec == WHISPER_SPEC

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
        if "shared_vocabulary" in found or "vocabulary" in found:  # a Translator's shared one, or Whisper's
            source = target = Vocabulary.read(found.get("shared_vocabulary", found.get("vocabulary")))
        elif {"source_vocabulary", "target_vocabulary"} <= set(found):
            source, target = Vocabulary.read(found["source_vocabulary"]), Vocabulary.read(found["target_vocabulary"])
        else:
            raise InputError("model", f"{path}: no vocabulary: expected shared_vocabulary.json, or "
                                      "source_vocabulary.json and target_vocabulary.json (a Whisper model's: "
                                      "vocabulary.json)")
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InputError("model", f"{path / 'config.json'}: not JSON ({exc})") from None
        dtypes, zero_start, spec = read_header(path / "model.bin")
        return cls(path, source, target, config, dtypes, zero_start, spec)

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


def read_header(path: Path) -> tuple[tuple[str, ...], bool, str]:
    """(the dtypes of model.bin's weight matrices, its decoder's start_from_zero_embedding, the
    spec's name), read from the variables' headers; their data is skipped (the layout of
    `ModelSpec._serialize`)."""
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
        spec = string()
        read("<I")  # the spec's revision
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
    return tuple(sorted(dtypes)), zero_start, spec
