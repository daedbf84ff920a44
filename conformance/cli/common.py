"""Argument helpers shared by the commands."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError


def parse_ids(text: str, argument: str) -> np.ndarray:
    """IDS: a `.npy` file of integers, or rows of comma-separated ids separated by `;` ("1,2,3;4,5,6")."""
    if text.endswith(".npy"):
        return _load_ids(text, argument)
    try:
        rows = [[int(v) for v in row.split(",") if v.strip()] for row in text.split(";")]
    except ValueError:
        raise InputError(argument, f"expected ids like '1,2,3;4,5,6' or a .npy file, got {text!r}") from None
    if len({len(r) for r in rows}) != 1:
        raise InputError(argument, f"rows have different lengths in {text!r}; pad them with the pad id")
    return np.array(rows, dtype=np.int64)


def _load_ids(path: str, argument: str) -> np.ndarray:
    """A `.npy` file of integer ids `(B, L)`; anything else is an `InputError` naming the argument."""
    if not Path(path).is_file():
        raise InputError(argument, f"no such file {path!r}")
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc):
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
    return ids


def parse_source(config: ModelConfig, text: str, argument: str = "src") -> np.ndarray:
    """Text for a model trained on the toy task ("3 1 4"), else IDS."""
    from conformance.check import toy

    if config.notes.get("task") == toy.TASK and not text.endswith(".npy") and "," not in text:
        try:
            return np.array([toy.encode_text(text)], dtype=np.int64)
        except ValueError as exc:
            raise InputError(argument, str(exc)) from None
    return parse_ids(text, argument)


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
