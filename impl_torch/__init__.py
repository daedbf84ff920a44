"""The PyTorch backend: the same model as `impl_numpy`, as a first-class `torch.nn.Module`.

    model = impl_torch.load("model.safetensors", torch.float32, device="cuda")
    with torch.inference_mode():
        out = model(src_ids, tgt_ids)                     # .logits, .attention, .intermediates
        fast = model(src_ids, tgt_ids, return_attention=False)   # fused attention, no weights
    impl_torch.save(model, "model.safetensors")           # the canonical checkpoint again

`model.state_dict()` has exactly the checkpoint's keys, so `load_state_dict` from a checkpoint
is strict. Compare results inside `impl_torch.full_precision()` (TF32 off on CUDA).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from conformance.core import checkpoint
from conformance.core.surface import BACKEND_API
from impl_torch.arrays import to_numpy
from impl_torch.model import (
    SUPPORTED_DTYPES,
    Model,
    causal_mask,
    fast_attention,
    make_masks,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    target_mask,
)
from impl_torch.precision import full_precision, precision_settings


def load(path: str | os.PathLike, dtype: Any = None, *, device: torch.device | str | None = None,
         param_dtype: Any = None) -> Model:
    """A `Model` from a checkpoint file on `device` (default: the CPU), in `eval()` mode like
    every `Model`; `dtype` casts the parameters (default: the stored dtype; float32, float64,
    float16 or bfloat16); `param_dtype` stores them in another dtype than `dtype`, as in `Model`.
    The mode changes nothing: dropout comes only from an explicit `dropout=` (see `Model`)."""
    config, params = checkpoint.load(path)
    return Model(config, params, dtype, device=device, param_dtype=param_dtype)


def save(model: Model, path: str | os.PathLike) -> None:
    """Write the model's config and parameters as a canonical checkpoint (atomically), in the
    dtype they are stored in (`model.param_dtype`), so a model trained or converted in PyTorch
    can go to any backend."""
    checkpoint.save(path, model.config, {name: to_numpy(value) for name, value in model.state_dict().items()})

from impl_torch.train import Adam, train_step  # the paper's optimizer (docs/training.md)


def parallelize(model: Model, mesh, plan: str, *, mp_policy=None) -> Model:
    """`impl_torch.parallel.parallelize`: the model sharded over a DeviceMesh by plan ("dp", "fsdp",
    "tp", "fsdp+tp"; docs/sharding.md). Imported when first called: it needs torch.distributed's
    FSDP2 and tensor-parallel APIs, which importing the backend does not."""
    from impl_torch.parallel import parallelize as shard

    return shard(model, mesh, plan, mp_policy=mp_policy)


# Sharded checkpoints through PyTorch Distributed Checkpoint (docs/sharded-checkpoints.md); the module imports
# only torch.nn when loaded, torch.distributed.checkpoint when called.
from impl_torch.distributed_checkpoint import load_distributed, save_distributed  # noqa: E402
from impl_torch import graphs  # noqa: E402  CUDA graphs of generate's step and of training (switched_off, release)

# The public surface, the same in every backend (conformance.core.surface; tests/backends/test_backend_surface.py).
from impl_torch import stream  # noqa: E402  a piece at a time, from each piece's own weights (rosetta check --stream)
__all__ = list(BACKEND_API)
# What only this backend has, importable by name but not part of the shared surface.
BACKEND_EXTRAS = ("Adam", "fast_attention", "graphs", "load_distributed", "parallelize", "save_distributed", "stream", "train_step")
