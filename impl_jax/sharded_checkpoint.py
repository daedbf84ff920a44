"""A sharded model's parameters through Orbax, each array written and read shard by shard by the
devices that hold it (docs/sharded-checkpoints.md).

    impl_jax.save_sharded(sharded, "ckpt/")              # the arrays as they lie on the mesh
    target = impl_jax.shard(impl_jax.Model(config), other_mesh, "tp")
    impl_jax.load_sharded(target, "ckpt/")               # restored straight into target's shardings

The directory is `save_state`'s: an Orbax composite checkpoint whose item "params" holds the
canonical parameters as a nested tree and whose item "config" holds the config as JSON, so
`impl_jax.load_state` reads it on one device and `rosetta convert ckpt/ model.safetensors`
into the interchange checkpoint, one array at a time. Orbax (tensorstore) writes each array's
shards from the devices that hold them and, on restore, reads into each device only the part
its target `NamedSharding` gives it: no host array of the whole model is built.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from conformance.core import checkpoint
from conformance.core.checkpoint import ORBAX_ITEMS
from conformance.core.errors import CheckpointError, InputError
from conformance.core.params import flatten_dotted, nest_dotted
from impl_jax.model import Model


def _model(model) -> Model:
    if not isinstance(model, Model):
        raise InputError("model", f"must be an impl_jax.Model (sharded with impl_jax.shard or not), got {type(model).__name__}")
    return model


def save_sharded(model: Model, path: str | os.PathLike) -> None:
    """Write `model`'s parameters, as placed (a `shard`ed model's `NamedSharding`s), and its
    config as a new Orbax checkpoint directory at `path` (which must not exist). Orbax builds it
    under a temporary name and renames it into place once every shard is written."""
    import orbax.checkpoint as ocp

    model, path = _model(model), Path(path)
    if path.exists():
        raise CheckpointError(path, "already exists; save_sharded writes a new Orbax checkpoint directory")
    if not path.parent.is_dir():
        raise CheckpointError(path, f"cannot save: the directory {str(path.parent)!r} does not exist")
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        checkpointer.save(path.resolve(), ocp.args.Composite(**{
            ORBAX_ITEMS[0]: ocp.args.StandardSave(nest_dotted(model.params)),
            ORBAX_ITEMS[1]: ocp.args.JsonSave(model.config.to_dict())}))
    finally:
        checkpointer.close()


def load_sharded(model: Model, path: str | os.PathLike) -> Model:
    """Restore the Orbax directory at `path` (`save_sharded`, `save_state` or `rosetta convert
    --to orbax`) into `model`, in place, each parameter straight into the sharding it has now
    (a `shard`ed model's plan on its mesh, or its one device); returns `model`.

    The stored config must equal the model's and every parameter be stored with the model's shape
    and dtype (restored bit for bit, never cast); otherwise a `CheckpointError` naming the field or
    parameter, before any array is read."""
    import orbax.checkpoint as ocp

    model, path = _model(model), Path(path)
    params_item, config_item = ORBAX_ITEMS
    if not all((path / item).is_dir() for item in ORBAX_ITEMS):
        raise CheckpointError(path, f"is not an Orbax checkpoint of save_sharded's (no {params_item} and {config_item} items)")
    try:
        stored = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path.resolve() / config_item)
        metadata = ocp.PyTreeCheckpointer().metadata(path.resolve() / params_item).item_metadata.tree
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign directory
        raise CheckpointError(path, f"not a readable Orbax checkpoint: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not isinstance(stored, dict):
        raise CheckpointError(path, f"its {config_item} item is a JSON {type(stored).__name__}, not a ModelConfig")
    config = checkpoint.stored_config(path, stored, f"its {config_item} item")
    params = model.params
    index = flatten_dotted(metadata)
    checkpoint.check_stored(path, model.config, config, {name: tuple(leaf.shape) for name, leaf in index.items()},
                            {name: np.dtype(leaf.dtype).name for name, leaf in index.items()},
                            np.dtype(next(iter(params.values())).dtype).name)
    target = nest_dotted({name: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding) for name, w in params.items()})
    restored = flatten_dotted(ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        path.resolve(), ocp.args.Composite(**{params_item: ocp.args.StandardRestore(target)}))[params_item])
    for parts, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(part) for part in parts)
        variable.set_raw_value(restored[name])
    return model


__all__ = ["load_sharded", "save_sharded"]
