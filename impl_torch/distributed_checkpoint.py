"""A parallelized model's parameters through PyTorch Distributed Checkpoint (DCP), each rank
writing and reading only its own shards (docs/sharded-checkpoints.md).

    impl_torch.save_distributed(model, "ckpt/")    # on every rank: DCP save of the DTensor state dict
    model = impl_torch.parallelize(impl_torch.Model(config), other_mesh, "tp")
    impl_torch.load_distributed(model, "ckpt/")    # on every rank: the saved chunks that overlap its shards

The directory is DCP's own (`.metadata` and one `__R_0.distcp` file per rank) under the canonical
parameter names, plus `rosetta_config.json` (`checkpoint.DCP_CONFIG_FILE`), the config. DCP plans
the reads: a rank reads the saved chunks that overlap its own shards (one at a time, each whole)
and keeps only the overlap, whatever mesh and plan wrote them, so no rank gathers the whole model. `rosetta convert ckpt/ model.safetensors` turns it into the
interchange checkpoint, and `--to dcp` back (conformance.convert.sharded).

Both calls are collective over the default process group when one is initialized (every rank
calls them, with the same path); without one they run in this process alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from torch import nn

from conformance.core import checkpoint
from conformance.core.checkpoint import DCP_CONFIG_FILE
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, InputError


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _state_dict(model: nn.Module) -> dict:
    """The model's state dict by canonical name: DTensors (each holding its rank's shard) for a
    parallelized model, plain tensors otherwise (`get_model_state_dict`, FSDP2 and TP aware)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not hasattr(model, "config") or not isinstance(model.config, ModelConfig):
        raise InputError("model", f"must be an impl_torch.Model (parallelized or not), got {type(model).__name__}")
    return get_model_state_dict(model)


def save_distributed(model: nn.Module, path: str | os.PathLike) -> None:
    """Write `model`'s parameters as a new DCP directory at `path` (which must not exist), each
    rank its own shards, and its config beside them. Collective: call it on every rank.

    Rank 0 builds the directory under a hidden name beside `path` and renames it into place once
    DCP has finished on every rank: an interrupted save leaves no `path`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state = _state_dict(model)
    distributed = _distributed()
    rank = dist.get_rank() if distributed else 0
    with contextlib.ExitStack() as stack:
        said: list = [None, None]  # [problem, staged directory], rank 0's
        if rank == 0:
            if path.exists():
                said[0] = "already exists; save_distributed writes a new Distributed Checkpoint directory"
            elif not path.parent.is_dir():
                said[0] = f"cannot save: the directory {str(path.parent)!r} does not exist"
            else:
                staged = stack.enter_context(checkpoint.atomic_directory(path))
                staged.mkdir()
                said[1] = str(staged)
        if distributed:
            dist.broadcast_object_list(said, src=0)
        if said[0] is not None:
            raise CheckpointError(path, said[0])
        dcp.save(state, storage_writer=dcp.FileSystemWriter(said[1]))  # collective; .metadata written last
        if rank == 0:
            (Path(said[1]) / DCP_CONFIG_FILE).write_text(model.config.to_json())
    if distributed:
        dist.barrier()  # every rank returns once the directory is in place


def _stored_config(path: Path) -> ModelConfig:
    if not (path / ".metadata").is_file():
        raise CheckpointError(path, "is not a Distributed Checkpoint directory (no .metadata)")
    try:
        text = (path / DCP_CONFIG_FILE).read_text()
    except FileNotFoundError:
        raise CheckpointError(path, f"has no {DCP_CONFIG_FILE}: not written by save_distributed or rosetta convert "
                              "--to dcp") from None
    return checkpoint.stored_config(path, text, DCP_CONFIG_FILE)


def load_distributed(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Read the DCP directory at `path` into `model` (an `impl_torch.Model`, parallelized on any
    mesh and plan or not), in place; returns it. Each rank reads the saved chunks that overlap its
    shards (one at a time) and keeps only the overlap. Collective: call it on every rank.

    The stored config must equal the model's, and every parameter be stored with the model's
    shape and dtype (no silent cast: the values arrive bit for bit); otherwise a
    `CheckpointError` naming the field or parameter, before anything is read
    (`conformance.core.checkpoint.check_stored`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    path = Path(path)
    state = _state_dict(model)
    stored = _stored_config(path)
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {name: entry for name, entry in metadata.items() if isinstance(entry, TensorStorageMetadata)}
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    checkpoint.check_stored(path, model.config, stored, {name: tuple(e.size) for name, e in tensors.items()},
                            {name: str(e.properties.dtype).removeprefix("torch.") for name, e in tensors.items()}, dtype)
    if set(metadata) != set(tensors):
        raise CheckpointError(path, f"entry {sorted(set(metadata) - set(tensors))[0]!r} is not a tensor; a rosetta "
                              "checkpoint holds parameters only")
    dcp.load(state, storage_reader=reader)
    set_model_state_dict(model, state)
    return model


__all__ = ["load_distributed", "save_distributed"]
