"""Argument helpers shared by the commands."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError


def parse_ids(text: str, argument: str, pad_id: int | None = None, *, pad: bool = False) -> np.ndarray:
    """IDS: a `.npy` file of integers, or rows of comma-separated ids separated by `;` ("1,2,3;4,5,6").
    Rows of different lengths are refused (naming the model's `pad_id` when given), or with `pad`
    padded with `pad_id` on the right to the longest (`ragged_rows` says which were)."""
    if text.endswith(".npy"):
        return _load_ids(text, argument)
    try:
        rows = [[int(v) for v in row.split(",") if v.strip()] for row in text.split(";")]
    except ValueError:
        raise InputError(argument, f"expected ids like '1,2,3;4,5,6' or a .npy file, got {_brief(text)}") from None
    for row in rows:
        for value in row:
            _int64(value, argument, text)
    if not any(rows):
        raise InputError(argument, f"expected ids like '1,2,3;4,5,6' or a .npy file, got {text!r}")
    if len({len(r) for r in rows}) != 1:
        if not pad or pad_id is None:
            which = "the model's pad id" if pad_id is None else f"the model's pad id, {pad_id}"
            raise InputError(argument, f"rows have different lengths in {text!r}; pad them with {which}")
        width = max(len(r) for r in rows)
        rows = [row + [pad_id] * (width - len(row)) for row in rows]
    return np.array(rows, dtype=np.int64)


def ragged_rows(text: str) -> list[int]:
    """The rows of an IDS text shorter than its longest (those `parse_ids` pads); none for a file."""
    if text.endswith(".npy"):
        return []
    lengths = [len([v for v in row.split(",") if v.strip()]) for row in text.split(";")]
    return [i for i, n in enumerate(lengths) if n < max(lengths)]


def _load_ids(path: str, argument: str) -> np.ndarray:
    """A `.npy` file of integer ids `(B, L)`; anything else is an `InputError` naming the argument."""
    if Path(path).is_dir():
        raise InputError(argument, f"{path!r} is a directory, not a .npy file of ids")
    if not Path(path).is_file():
        raise InputError(argument, f"no such file {path!r}")
    # Bytes that are not a .npy (or .npz) file are read by np.load as a pickle, whose refusal
    # would say the file holds Python objects: say what the bytes are instead.
    with open(path, "rb") as f:
        head = f.read(6)
    if not head.startswith((b"\x93NUMPY", b"PK\x03\x04")):
        from conformance.convert.readers import looks_like

        looks = looks_like(path)
        if looks == "it is a Python pickle":
            raise InputError(argument, f"{path}: a Python pickle, not a .npy file; pickles are never unpickled: save an "
                             "integer array (np.save(path, ids.astype(np.int64)))")
        raise InputError(argument, f"{path}: not a readable .npy file ({looks})")
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "Object arrays" in str(exc):
            raise InputError(argument, f"{path}: holds Python objects, which are never unpickled; save an integer "
                             "array (np.save(path, ids.astype(np.int64)))") from None
        raise InputError(argument, f"{path}: not a readable .npy file ({exc})") from None
    except (OSError, EOFError) as exc:
        raise InputError(argument, f"{path}: not a readable .npy file ({type(exc).__name__}: {exc})") from None
    if not isinstance(ids, np.ndarray):  # np.load reads a zip archive whatever the name says
        ids.close()
        raise InputError(argument, f"{path}: an .npz archive, not a single array of ids")
    if ids.dtype.kind not in "iu":
        raise InputError(argument, f"{path}: must hold integer token ids, got {ids.dtype}")
    if ids.ndim != 2:
        raise InputError(argument, f"{path}: must be a (B, L) array of ids, got shape {ids.shape}")
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > INT64.max:
        raise InputError(argument, f"{path}: id {int(ids.max())} does not fit in a 64-bit integer")
    return ids


def parse_source(config: ModelConfig, text: str, argument: str = "--src") -> np.ndarray:
    """Text for a model trained on the toy task ("3 1 4"); a features source's log-mel features
    (`load_features`: a .npy float array (B, n_mels, frames)); else IDS, rows of different lengths
    padded with the model's pad id (`source_form` says so)."""
    from conformance.check import toy

    if config.source == "features":
        return load_features(text, argument)
    if config.notes.get("task") == toy.TASK and not text.endswith(".npy") and "," not in text:
        try:
            return np.array([toy.encode_text(text)], dtype=np.int64)
        except ValueError as exc:
            raise InputError(argument, str(exc)) from None
    return parse_ids(text, argument, config.pad_id, pad=True)


def load_features(path: str, argument: str) -> np.ndarray:
    """A `.npy` file of log-mel features, a float array (B, n_mels, frames) as Whisper takes them
    (`whisper.log_mel_spectrogram`, transformers' `WhisperFeatureExtractor`). Its shape against the
    model (n_mels, an even number of frames, the encoder table's rows) is the model's own check."""
    if not path.endswith(".npy"):
        raise InputError(argument, f"a features source takes a .npy file of log-mel features (B, n_mels, frames), got "
                         f"{_brief(path)}")
    if not Path(path).is_file():
        raise InputError(argument, f"no such file {path!r}")
    with open(path, "rb") as f:
        if not f.read(6).startswith(b"\x93NUMPY"):
            raise InputError(argument, f"{path}: not a readable .npy file")
    try:
        features = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InputError(argument, f"{path}: not a readable .npy file of floats ({type(exc).__name__}: {exc})") from None
    if features.dtype.kind != "f" or features.ndim != 3:
        raise InputError(argument, f"{path}: must hold log-mel features, a float array (B, n_mels, frames), got "
                         f"{features.dtype} {features.shape}")
    return features


def source_form(config: ModelConfig, text: str, ids: np.ndarray) -> str | None:
    """How `--src` was read, when it is worth saying: rows padded with the pad id (`parse_source`),
    and for the toy model which of its two forms it was read as ("3,1,4" is three token ids, not
    the digits 3 1 4); None when there is nothing to say."""
    from conformance.check import toy

    padded = ragged_rows(text) if "," in text or ";" in text else []
    said = None
    if padded:
        rows = ", ".join(map(str, padded[:10])) + (f" and {len(padded) - 10} more" if len(padded) > 10 else "")
        said = (f"--src row{'s' if len(padded) > 1 else ''} {rows} padded with the pad id {config.pad_id} to "
                f"{ids.shape[1]} ids, the longest row's length")
    form = _toy_form(config, text, ids)
    return "; ".join(part for part in (form, said) if part) or None


def _toy_form(config: ModelConfig, text: str, ids: np.ndarray) -> str | None:
    from conformance.check import toy

    if config.notes.get("task") != toy.TASK or text.endswith(".npy"):  # a file holds ids, never digits
        return None
    if "," in text:
        shown = "; ".join(" ".join(toy.token_labels(row)) for row in ids[:3]) + (" ..." if len(ids) > 3 else "")
        return (f"--src {_brief(text)} read as token ids ({shown}); to give digits, separate them with spaces: "
                f"--src \"3 1 4\"")
    return f"--src {_brief(text)} read as digits (token ids {','.join(str(int(i)) for i in ids[0])})"


def labels(config: ModelConfig, ids) -> list[str]:
    from conformance.check import toy

    if config.notes.get("task") == toy.TASK:
        return toy.token_labels(ids)
    return [str(int(i)) for i in ids]


def add_backend_argument(parser, default: str = "numpy") -> None:
    parser.add_argument("--backend", choices=["numpy", "torch", "jax"], default=default,
                        help=f"which implementation runs the model (default: {default})")


def load_model(checkpoint_path: str | None, backend: str, dtype: str = "float32"):
    """(config, model) on the CPU from a checkpoint, or the built-in default when None."""
    from conformance.check import backends
    from conformance.core import checkpoint
    from conformance.check.backends import Target
    from conformance.check.defaults import default_model

    if checkpoint_path:
        config, params = checkpoint.load(checkpoint_path)
    else:
        config, params, _ = default_model()
    return config, backends.build(Target(backend, "cpu", dtype), config, params)


# A model call's argument -> the flag a command reads it from.
FLAGS = {"src_ids": "--src", "tgt_ids": "--tgt", "max_len": "--max-len", "bos_id": "--bos", "eos_id": "--eos",
         "num_beams": "--beams", "length_penalty": "--length-penalty", "do_sample": "--sample",
         "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
         "beam_rule": "--beam-rule", "patience": "--patience", "prefix": "--prefix",
         "return_timestamps": "--timestamps", "max_initial_timestamp_index": "--max-initial-timestamp-index",
         "return_no_speech_prob": "--no-speech-prob"}


@contextlib.contextmanager
def named_by_flags():
    """A model call's `InputError` under the flag the user typed (`--beams`, not `num_beams`)."""
    try:
        yield
    except InputError as exc:
        if exc.argument not in FLAGS:
            raise
        raise InputError(FLAGS[exc.argument], exc.problem) from None


# Ids -----------------------------------------------------------------------------------------

INT64 = np.iinfo(np.int64)


def _int64(value: int, argument: str, text: str) -> int:
    if not INT64.min <= value <= INT64.max:
        raise InputError(argument, f"id {value} in {_brief(text)} does not fit in a 64-bit integer; token ids are "
                         "small non-negative integers below the vocabulary size")
    return value


def _brief(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


# Outputs -------------------------------------------------------------------------------------


def check_output(path: str, argument: str, suffixes: tuple[str, ...] = ()) -> Path:
    """`path` as a Path, or an `InputError` naming `argument` when a file cannot be written there.

    Called for every output before any work starts, so that a run that would fail at the end
    fails at once and writes nothing."""
    out = Path(path)
    if suffixes and out.suffix.lower() not in suffixes:
        raise InputError(argument, f"{path} must end in {' or '.join(suffixes)}")
    if out.is_dir():
        raise InputError(argument, f"{path} is a directory; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.exists():
        raise InputError(argument, f"cannot write {path}: the directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise InputError(argument, f"cannot write {path}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise InputError(argument, f"cannot write {path}: permission denied")
    return out


def write_outputs(files: dict[str, tuple[Path, bytes]]) -> None:
    """Write every `argument -> (path, bytes)` atomically, and only if all of them can be written.

    Each file is first written in full to a temporary file beside its target; only when every
    one exists are they renamed into place. A failure before that removes the temporaries and
    leaves every target as it was (an `InputError` naming the argument)."""
    staged: list[tuple[str, str, Path]] = []
    try:
        for argument, (path, data) in files.items():
            directory = path.parent if str(path.parent) else Path(".")
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=directory)
            except OSError as exc:
                raise InputError(argument, f"cannot write {path}: {exc.strerror or exc}") from None
            staged.append((argument, tmp, path))
            # mkstemp makes the file private (0600); give it the mode of the file it replaces.
            os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise InputError(argument, f"cannot write {path}: {exc.strerror or exc}") from None
        for _, tmp, path in staged:
            os.replace(tmp, path)
    except BaseException:
        for _, tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise


# Devices -------------------------------------------------------------------------------------


def check_device(backend: str, device: str, argument: str = "--device") -> None:
    """An `InputError` unless `backend` can run on `device` and this machine has it."""
    from conformance.check import backends

    kinds = backends.device_kinds(backend)
    if device not in kinds:
        raise InputError(argument, f"the {backend} backend runs on {' or '.join(kinds)}, not {device!r}"
                         + ("" if backend == "numpy" else f" ({'cuda is torch' if device == 'cuda' else 'gpu is JAX'}'s name)"))
    if device not in backends.present_devices(backend):
        raise InputError(argument, f"{device} is not available here: {backends.accelerator_skip_reason(backend)}")
