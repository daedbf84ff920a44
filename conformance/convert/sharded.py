"""Sharded checkpoint directories in rosetta's own key space: PyTorch Distributed Checkpoint (DCP)
and Orbax, to and from the safetensors checkpoint, one tensor at a time (docs/sharded-checkpoints.md).

    rosetta convert dcp_dir/ model.safetensors            # DCP (impl_torch.save_distributed) -> ours
    rosetta convert orbax_dir/ model.safetensors          # Orbax (impl_jax.save_sharded / save_state) -> ours
    rosetta convert model.safetensors dcp_dir/ --to dcp   # ours -> DCP, which load_distributed reads on any mesh
    rosetta convert model.safetensors orbax_dir/ --to orbax

A DCP directory is DCP's own (`.metadata` and the ranks' `*.distcp` files, written by
`torch.distributed.checkpoint.save`) plus `rosetta_config.json` (`checkpoint.DCP_CONFIG_FILE`), the
`ModelConfig` the tensors cannot tell. An Orbax one is `impl_jax.save_state`'s composite checkpoint:
the item "params" (the canonical names as a nested tree) and the item "config" (a ModelConfig's JSON).

Reading holds a few times the largest tensor, never the model: the names, shapes and dtypes come
from the directory's metadata (DCP's `Metadata`, Orbax's tree metadata) and are checked against the
config before any tensor is read; each tensor is then loaded alone, DCP's `load` of one key (the
whole tensor, filled from each saved chunk in turn, whichever rank wrote it) or Orbax's partial
restore of one leaf, checked, cast if asked (through a float64 temporary), and written into the
safetensors file (`checkpoint.save_streamed`), which is built beside its destination and renamed
into place once complete.

May import what `conformance.convert` may (the core, NumPy) and, when a directory is read or
written, torch.distributed.checkpoint or orbax.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from conformance.core import checkpoint
from conformance.core.checkpoint import DCP_CONFIG_FILE, ORBAX_ITEMS
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError, InputError
from conformance.core.params import check_finite_array, check_param_set, flatten_dotted, nest_dotted, param_shapes

DCP_METADATA = ".metadata"  # what torch.distributed.checkpoint.save writes last, once every rank has written
KINDS = ("dcp", "orbax")  # the `--to` names


def kind(path: str | os.PathLike) -> str | None:
    """"dcp" for a DCP directory (its `.metadata`), "orbax" for a composite Orbax checkpoint with
    the items "params" and "config" (`impl_jax.save_state` / `save_sharded`; whether that config
    is a rosetta one, `OrbaxSource` finds out), else None."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / DCP_METADATA).is_file():
        return "dcp"
    if all((path / item).is_dir() for item in ORBAX_ITEMS) and (path / "_CHECKPOINT_METADATA").is_file():
        return "orbax"
    return None


def has_config(path: str | os.PathLike) -> bool:
    """A DCP directory with rosetta's config beside it (a foreign one converts by its layout)."""
    return kind(path) == "dcp" and (Path(path) / DCP_CONFIG_FILE).is_file()


# -- Reading: a directory as (config, index, one tensor at a time) ---------------------------------


class Source:
    """A sharded checkpoint opened for reading: `config`, `index` ({name: (shape, dtype name)},
    from the metadata alone) and `read(name)`, one whole tensor as a NumPy array."""

    path: Path
    config: ModelConfig | None
    index: dict[str, tuple[tuple[int, ...], str]]

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def check(self) -> None:
        """CheckpointError unless the index holds exactly the config's parameters, in one float dtype."""
        try:
            check_param_set(self.config, {n: s for n, (s, _) in self.index.items()},
                            {n: d for n, (_, d) in self.index.items()})
        except InputError as exc:
            raise CheckpointError(self.path, exc.problem) from None


# What DCP's `.metadata` pickle may name: its own metadata classes, torch's sizes, dtypes and
# layouts, and the path it was saved to. Anything else (os.system, a crafted __reduce__) is refused
# before it runs: the standard library's "restricting globals" (pickle docs), as torch.load's
# weights_only does for tensor files; torch itself reads `.metadata` with a bare pickle.load.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex128",
              "complex64", "int64", "int32", "int16", "int8", "uint8", "bool"},  # torch.dtype objects, by name
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
}


def _restricted_unpickler():
    import pickle

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if name in _METADATA_GLOBALS.get(module, ()):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"refused: the metadata names {module}.{name}, which this reader's allow-list "
                                         "does not know (a newer torch's metadata, or a crafted file: unpickling it "
                                         "could run code)")

    return MetadataUnpickler


def safe_reader(path: Path):
    """DCP's `FileSystemReader` with its `.metadata` unpickled under `_METADATA_GLOBALS`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _restricted_unpickler()(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


class DcpSource(Source):
    """A DCP directory: `Metadata.state_dict_metadata` for the index; `dcp.load` of one key, in
    this process only (`no_dist`), for each tensor.

    With rosetta's config beside it every entry must be a tensor. Without one (torchtitan's, a
    training loop's `{"model": ..., "optimizer": ..., "step": 7}`) the entries that are not tensors
    are left out of the index (`skipped`), and `prefix` ("model", from `--key model`) keeps only the
    keys under it (DCP flattens a nested state dict into "model.<name>" keys), without the prefix."""

    def __init__(self, path: Path, prefix: str | None = None):
        try:
            import torch  # noqa: F401
            from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
        except ImportError:
            raise CheckpointError(path, "reading a Distributed Checkpoint needs PyTorch (pip install torch)") from None
        self.path = path
        config_file = path / DCP_CONFIG_FILE
        # None for a foreign directory: readers.read_file reads it whole, for a layout.
        self.config = (checkpoint.stored_config(path, config_file.read_text(), DCP_CONFIG_FILE)
                       if config_file.is_file() else None)
        try:
            metadata = safe_reader(path).read_metadata()
        except Exception as exc:  # noqa: BLE001 - a damaged, foreign or hostile .metadata
            raise CheckpointError(path, f"its {DCP_METADATA} is not readable DCP metadata: {type(exc).__name__}: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(path, f"its {DCP_METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
        self.keys: dict[str, str] = {}  # index name -> DCP's key
        self.index = {}
        self.skipped: list[str] = []
        start = f"{prefix}." if prefix else ""
        for key, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                if self.config is not None:
                    raise CheckpointError(path, f"entry {key!r} is not a tensor ({type(entry).__name__}); a rosetta "
                                          "checkpoint holds parameters only")
                self.skipped.append(key)
                continue
            if not key.startswith(start):
                continue
            name = key[len(start):]
            self.keys[name] = key
            self.index[name] = (tuple(int(n) for n in entry.size), str(entry.properties.dtype).removeprefix("torch."))
        if prefix and not self.index:
            tops = sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})
            raise CheckpointError(path, f"--key {prefix}: no tensor key starts with {start!r}; its keys start with "
                                  f"{', '.join(tops[:8])}")

    def read(self, name: str) -> np.ndarray:
        import torch
        import torch.distributed.checkpoint as dcp

        from conformance.convert.arrays import as_numpy

        shape, dtype = self.index[name]
        key = self.keys[name]
        one = {key: torch.empty(shape, dtype=getattr(torch, dtype))}
        with warnings.catch_warnings():  # one process reading every rank's shards is the point
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(one, storage_reader=safe_reader(self.path), no_dist=True)
        return as_numpy(one[key], name)


class OrbaxSource(Source):
    """`impl_jax.save_state`'s composite Orbax checkpoint: the "params" item's tree metadata for
    the index; a partial restore of one leaf, as a host NumPy array, for each tensor."""

    def __init__(self, path: Path):
        try:
            import orbax.checkpoint as ocp
        except ImportError:
            raise CheckpointError(path, "reading an Orbax checkpoint needs orbax-checkpoint "
                                  "(pip install 'rosetta-transformer[jax]')") from None
        self.path = path
        params, config = (path.resolve() / item for item in ORBAX_ITEMS)
        try:
            stored = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(config)
            metadata = ocp.PyTreeCheckpointer().metadata(params).item_metadata.tree
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign directory
            raise CheckpointError(path, f"not a readable Orbax checkpoint of rosetta's: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        try:
            if not isinstance(stored, dict):
                raise ConfigError("config", f"is a JSON {type(stored).__name__}, not an object")
            self.config = ModelConfig.from_dict(stored, complete=True)
        except ConfigError as exc:
            raise CheckpointError(path, f"is an Orbax composite checkpoint, but its {ORBAX_ITEMS[1]!r} item is not a "
                                  f"rosetta ModelConfig ({exc}): not written by rosetta (impl_jax.save_sharded, "
                                  f"save_state, --to orbax)? Convert its {ORBAX_ITEMS[0]!r} item by its layout: "
                                  f"rosetta convert {Path(path) / ORBAX_ITEMS[0]} OUT.safetensors --layout ...") from None
        self.index = {name: (tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype).name)
                      for name, leaf in flatten_dotted(metadata).items()}

    def read(self, name: str) -> np.ndarray:
        import jax
        import orbax.checkpoint as ocp

        shape, dtype = self.index[name]
        item = nest_dotted({name: jax.ShapeDtypeStruct(shape, np.dtype(dtype))})
        how = nest_dotted({name: ocp.RestoreArgs(restore_type=np.ndarray)})
        restored = ocp.PyTreeCheckpointer().restore(self.path.resolve() / ORBAX_ITEMS[0], args=ocp.args.PyTreeRestore(
            item=item, restore_args=how, partial_restore=True))
        return np.asarray(flatten_dotted(restored)[name])


def open_source(path: str | os.PathLike) -> Source:
    """The sharded checkpoint at `path` opened for reading (`kind` says which), its index checked
    against its config; a CheckpointError for a directory that is neither."""
    path = Path(path)
    found = kind(path)
    if found is None:
        raise CheckpointError(path, "is neither a PyTorch Distributed Checkpoint (no .metadata) nor a rosetta Orbax "
                              f"checkpoint (no {' and '.join(ORBAX_ITEMS)} items beside _CHECKPOINT_METADATA)")
    source = DcpSource(path) if found == "dcp" else OrbaxSource(path)
    if source.config is None:
        raise CheckpointError(path, f"is a PyTorch Distributed Checkpoint without {DCP_CONFIG_FILE}, so the model's "
                              "config is unknown: write it with impl_torch.save_distributed or `rosetta convert "
                              "MODEL.safetensors DIR --to dcp`, or convert it by its layout (rosetta convert DIR OUT)")
    source.check()
    return source


def tensors(source: Source, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Each parameter in checkpoint order, read alone and checked (shape, finite), cast to `dtype`."""
    from conformance.convert.engine import cast

    for name, shape in param_shapes(source.config).items():
        value = source.read(name)
        if tuple(value.shape) != shape:  # the metadata said otherwise: a damaged directory
            raise CheckpointError(source.path, f"parameter {name!r} reads with shape {tuple(value.shape)}, its "
                                  f"metadata and the config say {shape}")
        try:
            check_finite_array(name, value)
        except InputError as exc:
            raise CheckpointError(source.path, exc.problem) from None
        yield name, (cast(value, dtype, name) if dtype else value)


def to_safetensors(src: str | os.PathLike | Source, dst: str | os.PathLike, dtype: str | None = None,
                   progress: Callable[[str], None] | None = None) -> tuple[ModelConfig, int]:
    """Convert the DCP or Orbax directory `src` (or its opened `Source`) into the checkpoint
    `dst`, one tensor at a time; `dtype` casts every parameter. Returns the config and the
    number of values written. It does not check the file it wrote: `conformance.formats` does,
    against the directory read again apart from this path (`conformance.formats.sharded.reread`)."""
    source = src if isinstance(src, Source) else open_source(src)
    dtypes = {name: dtype or stored for name, (_, stored) in source.index.items()}

    def announced():
        for count, (name, value) in enumerate(tensors(source, dtype), 1):
            if progress is not None:
                progress(f"{count}/{len(dtypes)} {name}")
            yield name, value

    checkpoint.save_streamed(dst, source.config, dtypes, announced())
    return source.config, sum(math.prod(shape) for shape, _ in source.index.values())


# -- Writing a directory from canonical parameters --------------------------------------------------


def write_dcp(dst: str | os.PathLike, config: ModelConfig, params: Mapping[str, np.ndarray]) -> None:
    """A new DCP directory holding `params` by their canonical names, written by this process
    alone (`no_dist`) as one rank's shards, and `rosetta_config.json`; whole or not at all."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        raise InputError("--to", "dcp writes a PyTorch Distributed Checkpoint, which needs PyTorch "
                         "(pip install torch)") from None
    from conformance.convert.arrays import as_torch

    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(dst, "already exists; a Distributed Checkpoint goes into a new directory")
    checkpoint.check_params(config, params, dst)
    with checkpoint.atomic_directory(dst) as staged:
        staged.mkdir()
        state = {name: as_torch(params[name]) for name in param_shapes(config)}
        with warnings.catch_warnings():  # that one process writes it is the point, not a mistake to warn of
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staged)), no_dist=True)
        (staged / DCP_CONFIG_FILE).write_text(config.to_json())


def write_orbax(dst: str | os.PathLike, config: ModelConfig, params: Mapping[str, np.ndarray]) -> None:
    """A new Orbax directory in `impl_jax.save_state`'s form (items "params" and "config"), which
    `impl_jax.load_sharded` restores onto any mesh; whole or not at all."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise InputError("--to", "orbax writes an Orbax checkpoint, which needs orbax-checkpoint and JAX "
                         "(pip install 'rosetta-transformer[jax]')") from None

    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(dst, "already exists; an Orbax checkpoint goes into a new directory")
    checkpoint.check_params(config, params, dst)
    tree = nest_dotted({name: np.asarray(params[name]) for name in param_shapes(config)})
    with checkpoint.atomic_directory(dst) as staged:
        checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        try:
            checkpointer.save(staged.resolve(), ocp.args.Composite(**{
                ORBAX_ITEMS[0]: ocp.args.StandardSave(tree), ORBAX_ITEMS[1]: ocp.args.JsonSave(config.to_dict())}))
        finally:
            checkpointer.close()


def write(dst: str | os.PathLike, kind_name: str, config: ModelConfig, params: Mapping[str, np.ndarray]) -> None:
    """`write_dcp` or `write_orbax`, by the `--to` name. Neither loads what it wrote:
    `conformance.formats` (`rosetta convert --to dcp|orbax`) checks it with impl_torch.load_distributed
    or impl_jax.load_sharded before it lands."""
    if kind_name not in KINDS:
        raise InputError("--to", f"unknown sharded checkpoint kind {kind_name!r}; the kinds are {', '.join(KINDS)}")
    (write_dcp if kind_name == "dcp" else write_orbax)(dst, config, params)


__all__ = ["DCP_METADATA", "KINDS", "DcpSource", "OrbaxSource", "Source", "has_config", "kind", "open_source",
           "tensors", "to_safetensors", "write", "write_dcp", "write_orbax"]
