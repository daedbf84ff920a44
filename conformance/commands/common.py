"""Argument helpers shared by the commands."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.config import ModelConfig
from conformance.errors import InputError


def parse_ids(text: str, argument: str) -> np.ndarray:
    """IDS: a `.npy` file of integers, or rows of comma-separated ids separated by `;` ("1,2,3;4,5,6")."""
    if text.endswith(".npy"):
        if not Path(text).is_file():
            raise InputError(argument, f"no such file {text!r}")
        return np.load(text, allow_pickle=False)
    try:
        rows = [[int(v) for v in row.split(",") if v.strip()] for row in text.split(";")]
    except ValueError:
        raise InputError(argument, f"expected ids like '1,2,3;4,5,6' or a .npy file, got {text!r}") from None
    if len({len(r) for r in rows}) != 1:
        raise InputError(argument, f"rows have different lengths in {text!r}; pad them with the pad id")
    return np.array(rows, dtype=np.int64)


def parse_source(config: ModelConfig, text: str, argument: str = "src") -> np.ndarray:
    """Text for a model trained on the toy task ("3 1 4"), else IDS."""
    from conformance import toy

    if config.notes.get("task") == toy.TASK and not text.endswith(".npy") and "," not in text:
        try:
            return np.array([toy.encode_text(text)], dtype=np.int64)
        except ValueError as exc:
            raise InputError(argument, str(exc)) from None
    return parse_ids(text, argument)


def labels(config: ModelConfig, ids) -> list[str]:
    from conformance import toy

    if config.notes.get("task") == toy.TASK:
        return toy.token_labels(ids)
    return [str(int(i)) for i in ids]


def add_backend_argument(parser, default: str = "numpy") -> None:
    parser.add_argument("--backend", choices=["numpy", "torch", "jax"], default=default,
                        help=f"which implementation runs the model (default: {default})")


def load_model(checkpoint_path: str | None, backend: str, dtype: str = "float32"):
    """(config, model) on the CPU from a checkpoint, or the built-in default when None."""
    from conformance import backends, checkpoint
    from conformance.backends import Target
    from conformance.defaults import default_model

    if checkpoint_path:
        config, params = checkpoint.load(checkpoint_path)
    else:
        config, params, _ = default_model()
    return config, backends.build(Target(backend, "cpu", dtype), config, params)
