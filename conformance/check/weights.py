"""The weights a deployed model (ONNX graphs, a CTranslate2 directory) was made from, read for the
oracle: a rosetta checkpoint, a Hugging Face folder (its own layout), or a file through a layout.

    config, params, layout = oracle_weights("opus-mt/", None, None, {})
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError


def oracle_weights(weights, graphs_path: Any, layout, overrides: dict) -> tuple[ModelConfig, dict, Any]:
    """(config, params, layout) of the checkpoint a deployed model was made from. `graphs_path`: a
    folder that may be its own Hugging Face folder (optimum writes config.json beside its graphs),
    the default for `weights`. `overrides`: ModelConfig fields for a foreign file or folder; a
    rosetta checkpoint states its own config, so overrides given with one are refused."""
    from conformance.convert import convert_arrays, load_layout, read_state_dict
    from conformance.convert.hf_folder import from_hf_folder, is_hf_folder
    from conformance.core import checkpoint

    if weights is None and isinstance(graphs_path, (str, os.PathLike)) and is_hf_folder(Path(graphs_path)):
        weights = graphs_path
    if weights is None:
        raise InputError("weights", "the oracle needs the weights the graphs were exported from: a rosetta "
                                    "checkpoint, a Hugging Face folder or a file with a layout")
    path = Path(weights)
    if path.is_dir() and is_hf_folder(path):
        config, params = from_hf_folder(path, **overrides)
        if layout is None:
            from conformance.convert.hf_folder import read_switches

            layout = read_switches(path)[0]
        return config, params, load_layout(layout)
    if layout is None:
        if overrides:
            raise InputError(sorted(overrides)[0], f"{path} is read as a rosetta checkpoint, which states its own "
                                                   "config: config overrides apply to a foreign file (with a layout) "
                                                   "or a Hugging Face folder")
        config, params = checkpoint.load(path)
        return config, params, None
    layout = load_layout(layout)
    conversion = convert_arrays(read_state_dict(path), layout, **overrides)
    return conversion.config, conversion.params, layout
