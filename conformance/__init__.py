"""Rosetta Transformer's contract and its checks.

The framework-free core (this package's import surface, safe with only NumPy installed):
`ModelConfig`, `preset`, the canonical parameter key space (`param_shapes`, `init_params`),
`checkpoint.save` / `checkpoint.load`, the error types and the shared input checks. The
cross-backend suite, the converters and the CLI live in submodules that import PyTorch or JAX
lazily, only when they are used.
"""

from conformance import checkpoint
from conformance.config import ModelConfig
from conformance.errors import CheckpointError, ConfigError, InputError
from conformance.output import Encoded, ModelOutput
from conformance.params import init_params, param_shapes
from conformance.presets import PRESETS, preset

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Encoded",
    "InputError",
    "ModelConfig",
    "ModelOutput",
    "PRESETS",
    "checkpoint",
    "init_params",
    "param_shapes",
    "preset",
]
