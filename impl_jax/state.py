"""The NNX model's own state through Orbax, for JAX training code that keeps its models that way.

    impl_jax.save_state(model, "ckpt/")          # an Orbax checkpoint directory
    model = impl_jax.load_state("ckpt/")          # the same Model, bit for bit

The directory is an Orbax composite checkpoint with two items: "params", the canonical parameters
as a nested tree (`encoder.layers.0.self_attn.q_proj.weight` -> ["encoder"]["layers"]["0"]...,
restorable with `StandardRestore`), and "config", the `ModelConfig` as JSON. The interchange
format between backends stays the safetensors checkpoint (`impl_jax.save` / `load`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from conformance.core.checkpoint import ORBAX_ITEMS
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError
from conformance.core.params import flatten_dotted
from impl_jax.model import Model


def save_state(model: Model, path: str | os.PathLike) -> None:
    """Write `model` as a new Orbax checkpoint directory at `path` (which must not exist):
    `impl_jax.save_sharded`, each array written as it lies (a sharded model's shards by the devices
    that hold them), with no host copy of the whole model."""
    from impl_jax.sharded_checkpoint import save_sharded

    save_sharded(model, path)


def load_state(path: str | os.PathLike, dtype=None, *, param_dtype=None, buckets=None) -> Model:
    """A `Model` from a `save_state` / `save_sharded` directory, whatever mesh wrote it, restored
    onto this process's first device; `dtype` and `param_dtype` cast as in `Model`. A directory
    that is not such a checkpoint, or whose config or parameters do not validate, is a
    `CheckpointError`."""
    import jax
    import orbax.checkpoint as ocp

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(path, "no such Orbax checkpoint directory")
    params_item, config_item = ORBAX_ITEMS
    try:
        # Restored against a one-device target: a directory saved from a mesh of several devices
        # carries their shardings, which a bare StandardRestore refuses here ("Topology mismatch").
        metadata = ocp.PyTreeCheckpointer().metadata(path.resolve() / params_item).item_metadata.tree
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
                                        metadata)
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(path.resolve(), ocp.args.Composite(**{
            params_item: ocp.args.StandardRestore(target), config_item: ocp.args.JsonRestore()}))
        params, stored = restored[params_item], restored[config_item]
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign directory
        raise CheckpointError(path, f"not a save_state checkpoint: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    try:
        config = ModelConfig.from_dict(stored, complete=True)
    except ConfigError as exc:
        raise CheckpointError(path, f"invalid config: {exc}") from None
    if not isinstance(params, dict):
        raise CheckpointError(path, f"its {params_item} item is not a tree of named arrays")
    try:
        return Model(config, {k: np.asarray(v) for k, v in flatten_dotted(params).items()}, dtype=dtype,
                     param_dtype=param_dtype, buckets=buckets)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(path, f"its parameters do not fit its config: {exc}") from None
