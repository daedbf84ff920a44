"""Weight converters: foreign checkpoints in, canonical `(config, params)` out, and back.

    from conformance.convert import import_state_dict, export_state_dict
    config, params = import_state_dict(model.state_dict(), "annotated-transformer", n_heads=8, pad_id=2)
    config, params = import_state_dict(state_dict, None, n_heads=8)        # auto-detect the layout
    config, params = import_state_dict(rename_prefixes(state_dict, {"embed_src.": "src_tok_emb.embedding."}),
                                       "torch-nn-transformer", n_heads=8, pad_id=0, norm_placement="post")
    state_dict = export_state_dict(config, params, "annotated-transformer")  # NumPy arrays

    from conformance.convert import from_hf, from_hf_folder, from_torch_nn_transformer
    config, params = from_hf(model)                          # Marian, BART, mBART, M2M100/NLLB, Pegasus, T5, mT5
    config, params = from_hf_folder("opus-mt-en-de/")        # a published folder: config.json read too
    config, params = from_openai_whisper(model)              # a live whisper.model.Whisper (openai-whisper)
    config, params = from_torch_nn_transformer(model.transformer, model.src_tok_emb, model.tgt_tok_emb, model.generator)

A layout is a TOML file (`conformance/convert/layouts/*.toml` for the built-in ones; see
`docs/porting.md` to write your own). PyTorch is imported only when a torch tensor, file or
module is handed in.

May import: the core, NumPy, ml_dtypes, and (lazily) the framework of the file or module handed
in. Never a backend, the check tools, the suite or the CLI: a conversion needs no model to run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from conformance.core.config import ModelConfig
from conformance.convert.engine import Conversion, check_exportable, convert_arrays, export_state_dict
from conformance.convert.errors import (
    AmbiguousLayoutError,
    KeyMismatchError,
    LayoutError,
    NoMatchingLayoutError,
    TensorError,
)
from conformance.convert.planner import check_keys, detect_layout
from conformance.convert.layout import Layout, builtin_layout_names, builtin_layouts, load_layout
from conformance.convert.hf_folder import from_hf_folder, is_hf_folder, read_weights
from conformance.convert.readers import as_arrays, read_file
from conformance.core.errors import CheckpointError
from conformance.convert.sources import from_hf, from_hf_marian, from_torch_nn_transformer
from conformance.convert.bundles import from_openai_whisper


def read_state_dict(path: str | os.PathLike, key: str | None = None) -> dict[str, np.ndarray]:
    """Every tensor in a weights file, Orbax directory or Hugging Face model folder, by name, as
    NumPy arrays (`readers.read_file`; a folder's weights: `hf_folder.read_weights`). `key`
    selects a nested state dict in a PyTorch file or a subtree of a Flax tree (see `read_file`)."""
    if is_hf_folder(Path(path)):
        if key is not None:
            raise CheckpointError(path, "--key does not apply to a model folder")
        return read_weights(Path(path))
    return read_file(path, key)


def rename_prefixes(state_dict: Mapping[str, Any], renames: Mapping[str, str]) -> dict[str, Any]:
    """A copy of `state_dict` with key prefixes renamed: `{"embed_src.": "src_tok_emb.embedding."}`
    turns `embed_src.weight` into `src_tok_emb.embedding.weight`, so a wrapper that names a few
    modules differently fits a built-in layout without a layout file of its own.

    Each key is renamed by the longest prefix that matches it. A prefix that matches no key, and
    two keys that would get the same name, are `KeyError`s naming them (nothing is guessed)."""
    unused = [old for old in renames if not any(key.startswith(old) for key in state_dict)]
    if unused:
        raise KeyError(f"no key starts with {unused[0]!r} (keys start with: "
                       f"{', '.join(sorted({k.split('.')[0] + ('.' if '.' in k else '') for k in state_dict})[:8])})")
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in state_dict.items():
        old = max((p for p in renames if key.startswith(p)), key=len, default=None)
        new = key if old is None else renames[old] + key[len(old):]
        if new in out:
            raise KeyError(f"{origin[new]!r} and {key!r} would both be named {new!r}")
        out[new], origin[new] = value, key
    return out


def import_state_dict(state_dict: Mapping[str, Any], layout: str | Layout | None = None, *, dtype: str | None = None,
                      **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A foreign state dict -> `(config, params)` in the canonical key space.

    Args:
        state_dict: foreign key -> torch tensor or NumPy (or JAX) array. Never modified; the
            returned params are copies.
        layout: a built-in layout name, a path to a layout TOML file, a `Layout`, or None to
            auto-detect among the built-in layouts (the one whose key set matches exactly).
        dtype: cast every parameter to this dtype ("float32", ...); by default the stored dtype
            is kept and a mix of dtypes is an error.
        **overrides: ModelConfig fields. Sizes the shapes cannot tell (n_heads; max_len when no
            position table is stored) must be given; a size the shapes do tell must agree with
            them; switches replace the layout's (for a copy of a system that was changed).

    Raises:
        KeyMismatchError / NoMatchingLayoutError: the keys do not fit (lists missing and unexpected).
        ConfigError: a field is missing, invalid or contradicts a tensor (names the field).
        TensorError: a tensor cannot be transformed or has the wrong shape (names the foreign key).
    """
    result = convert_arrays(as_arrays(state_dict), layout, dtype=dtype, **overrides)
    return result.config, result.params


__all__ = [
    "AmbiguousLayoutError",
    "Conversion",
    "KeyMismatchError",
    "Layout",
    "LayoutError",
    "NoMatchingLayoutError",
    "TensorError",
    "as_arrays",
    "builtin_layout_names",
    "builtin_layouts",
    "check_exportable",
    "check_keys",
    "convert_arrays",
    "detect_layout",
    "export_state_dict",
    "from_hf",
    "from_hf_folder",
    "from_hf_marian",
    "from_openai_whisper",
    "from_torch_nn_transformer",
    "import_state_dict",
    "load_layout",
    "read_state_dict",
    "rename_prefixes",
]
