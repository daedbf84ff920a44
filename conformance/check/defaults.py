"""The built-in default model that `rosetta check` runs on when given no checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.core import checkpoint
from conformance.core.config import ModelConfig
from conformance.core.params import init_params
from conformance.core.presets import preset

DATA = Path(__file__).parent / "data"
DEFAULT_CHECKPOINT = DATA / "default.safetensors"


def default_model() -> tuple[ModelConfig, dict[str, np.ndarray], str]:
    """(config, params, description) of the built-in default.

    The shipped checkpoint when the package has one; otherwise the `default` preset with seeded
    weights, created on the fly (no download).
    """
    if DEFAULT_CHECKPOINT.exists():
        config, params = checkpoint.load(DEFAULT_CHECKPOINT)
        return config, params, f"built-in default ({DEFAULT_CHECKPOINT.name})"
    config = preset("default")
    return config, init_params(config, seed=0), "built-in default (preset 'default', seed 0)"
