"""The framework-free core: the contract every backend imports.

    config       ModelConfig, every switch of the family (variants.md)
    presets      one named config per known system
    params       the canonical parameter key space, its checks and a seeded initialiser
    sizes        every parameter's shape and how large they are, from the config (TooLargeError)
    checkpoint   the one interchange file (safetensors + config + digest)
    positions    the sinusoid tables, computed once in float64
    inputs       host-side input checks and conversions shared by every backend
    output       the result types (ModelOutput, Encoded) and the names of their tensors
    surface      the names every backend package exports (`BACKEND_API`)
    training     host checks of the loss's arguments, the paper's learning-rate schedule
    dropout      dropout masks: sites, format, drawn from one seed (docs/training.md)
    errors       ConfigError, InputError, CheckpointError, TooLargeError
    memory       the most memory this process can ever hold (refusals before allocating)
    sharding     the plans and mesh axes every sharded backend and check names (PLANS, AXES, splits)
    generation/  decoding written once: generate's settings and the checkpoint's note, the logits
                 processors, the reference search and the device search
    moved        old import paths of modules that moved, kept for one release

May import: the standard library, NumPy, ml_dtypes, and itself. Never PyTorch, JAX, hypothesis,
pytest, a backend or another subpackage of `conformance` (tests/test_architecture.py imports
it with those absent).
"""

from conformance.core import checkpoint
from conformance.core.moved import install as _install
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError, InputError, TooLargeError
from conformance.core.output import Encoded, ModelOutput
from conformance.core.params import init_params, param_shapes
from conformance.core.presets import PRESETS, preset

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Encoded",
    "InputError",
    "ModelConfig",
    "ModelOutput",
    "PRESETS",
    "TooLargeError",
    "checkpoint",
    "init_params",
    "param_shapes",
    "preset",
]

# Old paths of the modules that moved; they keep working for one release (conformance/core/decoding.py,
# split in four, is a module of its own).
_install(__name__, {"device_search": "conformance.core.generation.device"})
