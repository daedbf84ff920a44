"""Reading foreign weight files into `{key: numpy array}`, without executing anything.

    .safetensors          `conformance.core.checkpoint.read_tensors` (strict header validation)
    .pt / .pth / .bin     `torch.load(..., weights_only=True, map_location="cpu")`
    .npz                  `numpy.load(..., allow_pickle=False)` (Flax / NumPy exports)
    .msgpack              `flax.serialization.msgpack_restore` (Flax's `to_bytes`), flattened
    an Orbax directory    `orbax.checkpoint.PyTreeCheckpointer().restore`, flattened
    a DCP directory       `torch.distributed.checkpoint.load`, one key at a time (conformance.convert.sharded;
                          its `.metadata` pickle unpickled with DCP's metadata classes only); its entries
                          that are not tensors (a step count, param_groups) are left out
    (see `conformance.convert.trees`: nested Flax trees become keys joined with ".")

A Hugging Face model folder is read by `conformance.convert.hf_folder`, which reads its weights
files through this module; `conformance.convert.read_state_dict` takes either.

A pickle is a program: `weights_only=True` runs PyTorch's restricted unpickler, which builds
tensors and plain containers and refuses every other global, so a file that needs more (a
pickled module, or a crafted `__reduce__` that calls `os.system`) is refused before anything of
it runs. Files are only ever opened for reading.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from conformance.core.checkpoint import read_tensors
from conformance.convert.errors import TensorError, a_type
from conformance.convert import sharded, trees
from conformance.convert.arrays import as_numpy
from conformance.core.errors import CheckpointError

SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch", ".npz": "npz",
            ".msgpack": "msgpack"}


def as_arrays(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A flat state dict, or a nested Flax tree (linen `variables["params"]`, `nnx.State`), as
    `{key: NumPy array}`; a tree's keys are joined with "."."""
    if trees.is_tree(state_dict):
        state_dict = trees.flatten(state_dict)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    out = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TensorError(repr(key), "state dict keys must be strings")
        out[key] = as_numpy(value, key)
    return out


def file_kind(path: str | os.PathLike) -> str:
    if (Path(path) / "config.json").is_file():
        return "hf-folder"
    if trees.is_orbax_dir(Path(path)):
        return "orbax"
    if sharded.kind(path) == "dcp":
        return "dcp"
    if Path(path).is_dir():
        raise CheckpointError(path, "is a directory, but neither a model folder (config.json) nor an Orbax checkpoint "
                              f"(it has none of {', '.join(trees.ORBAX_MARKERS)}) nor a PyTorch Distributed "
                              f"Checkpoint (no {sharded.DCP_METADATA})")
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise CheckpointError(path, f"unknown file type {suffix!r}; expected one of {', '.join(SUFFIXES)}")
    return SUFFIXES[suffix]


def _first_bytes(path: Path, n: int = 8) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""  # the reader that follows says what is wrong with the file


def looks_like(path: str | os.PathLike) -> str:
    """What a file's first bytes say it is, for a message about a file that is not what its name
    says: "it is empty", "it is a Python pickle", "it is text, starting 'hello'", ..."""
    head = _first_bytes(Path(path), 64)
    if not head:
        return "it is empty"
    if head.startswith(b"\x93NUMPY"):
        return "it is a single .npy array"
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive"
    if head.startswith(b"\x80") and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it is a Python pickle"
    if len(head) >= 8 and int.from_bytes(head[:8], "little") < 100_000_000 and head[8:9] == b"{":
        return "it is a .safetensors file; rename it *.safetensors"
    if all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        return f"it is text, starting {head[:24].decode('ascii')!r}"
    return f"it starts with bytes {head[:8]!r}"


def _not_this_kind(path: Path, what: str) -> CheckpointError:
    """The file's name says `what`, its first bytes say otherwise: say what they look like."""
    return CheckpointError(path, f"not {what} ({looks_like(path)})")


def _reason(exc: Exception) -> str:
    """The line of PyTorch's long refusal message that names what the pickle asked for."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line
    return lines[0] if lines else type(exc).__name__


def _torch_file(path: Path) -> Any:
    try:
        import torch
    except ImportError:
        raise CheckpointError(path, "reading a PyTorch file needs PyTorch (pip install torch), or convert it to .safetensors") from None
    if not path.exists():
        raise CheckpointError(path, "no such file")
    if path.is_dir():
        raise CheckpointError(path, "is a directory, not a weights file")
    # torch.save writes a zip archive (legacy files: a pickle, whose first byte is PROTO 0x80).
    if not _first_bytes(path).startswith((b"PK\x03\x04", b"\x80")):
        raise _not_this_kind(path, "a PyTorch file: torch.save writes a zip archive or a pickle, and this is neither")
    try:
        with warnings.catch_warnings():
            # A file that is not a pickle at all makes the unpickler warn before it fails.
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        needed, refused = _needed_classes(torch, path)
        if needed and not refused:  # a training checkpoint whose layout names the classes it needs (system_files)
            from conformance.convert.system_files import SAFE_CLASSES

            with warnings.catch_warnings(), torch.serialization.safe_globals([SAFE_CLASSES[n] for n in needed]):
                warnings.simplefilter("ignore")
                return torch.load(path, map_location="cpu", weights_only=True)
        named = f"it needs {', '.join(refused)}, which no layout allows" if refused else _reason(exc)
        raise CheckpointError(
            path,
            "refused: unpickling it needs more than tensors and plain containers, so it could run code "
            f"({named}). Save a state dict (torch.save(model.state_dict(), path)) or a .safetensors file instead",
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, KeyError, AttributeError) as exc:
        raise CheckpointError(path, f"not a readable PyTorch file: {type(exc).__name__}: {exc}") from None


def _needed_classes(torch, path: Path) -> tuple[list[str], list[str]]:
    """(the globals beyond tensors and containers that the file's pickle names, those of them no
    built-in layout's `[checkpoint]` allows): the file is loaded, allowing exactly the first, only
    when the second is empty (an OpenNMT-py checkpoint's argparse.Namespace). The pickle is
    scanned, not run."""
    from conformance.convert.system_files import allowed_classes

    try:
        names = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - a file this cannot scan is refused as before
        return [], []
    return sorted(names), sorted(names - allowed_classes())


def _npz_file(path: Path) -> dict[str, np.ndarray]:
    if path.is_file() and not _first_bytes(path).startswith((b"PK\x03\x04", b"\x93NUMPY")):
        raise _not_this_kind(path, "an .npz file: np.savez writes a zip archive of .npy arrays, and this is not one")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise CheckpointError(path, "holds a single array, not a named set of arrays (.npz)")
            out = {}
            for name in archive.files:
                try:
                    out[name] = archive[name]
                except ValueError as exc:
                    # numpy says "Object arrays cannot be loaded" for an object dtype; any other
                    # ValueError is a damaged entry, which holds nothing at all.
                    if "Object arrays" in str(exc):
                        raise CheckpointError(path, f"refused: entry {name!r} holds Python objects ({exc})") from None
                    raise CheckpointError(path, f"entry {name!r} is not a readable array ({exc})") from None
            return out
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a weights file") from None
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(path, f"not a readable .npz file: {exc}") from None


def _tensor_dict(path: Path, obj: Any, key: str | None) -> dict[str, np.ndarray]:
    if key is None:
        from conformance.convert.system_files import system_file

        system = system_file(obj, path)  # a training checkpoint with its options (OpenNMT-py's)
        if system is not None:
            return system.arrays
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            found = sorted(map(str, obj)) if isinstance(obj, Mapping) else []
            raise CheckpointError(path, f"has no entry {key!r} (top-level entries: {', '.join(found) or 'none'})")
        obj = obj[key]
    if not isinstance(obj, Mapping):
        raise CheckpointError(path, f"holds {a_type(obj)}, not a state dict (a mapping of names to tensors)")
    nested = [str(k) for k, v in obj.items() if isinstance(v, Mapping)]
    others = [str(k) for k, v in obj.items() if not isinstance(v, Mapping) and not hasattr(v, "shape")]
    if nested or others:
        hint = f"; if the state dict is nested, pass --key NAME (candidates: {', '.join(nested)})" if nested else ""
        raise CheckpointError(path, f"is not a flat state dict: entries {', '.join((nested + others)[:6])} are not tensors{hint}")
    try:
        return as_arrays(obj)
    except TensorError as exc:
        raise CheckpointError(path, str(exc)) from None


def read_source(path: str | os.PathLike, key: str | None = None):
    """(every tensor by name, the `system_files.SystemFile` when the file is a training checkpoint
    that carries its own options, else None): `read_file`, keeping what such a file says."""
    path = Path(path)
    if key is None and file_kind(path) == "torch":
        from conformance.convert.system_files import system_file

        obj = _torch_file(path)
        system = system_file(obj, path)
        return (system.arrays, system) if system is not None else (_tensor_dict(path, obj, key), None)
    return read_file(path, key), None


def read_file(path: str | os.PathLike, key: str | None = None) -> dict[str, np.ndarray]:
    """Every tensor in a weights file or Orbax directory, by name, as NumPy arrays. `key` selects
    a nested state dict in a PyTorch file (`{"model": state_dict, "epoch": 3}` -> `key="model"`),
    or a subtree of a Flax msgpack file or Orbax directory by its dotted path (`key="params"`)."""
    path = Path(path)
    kind = file_kind(path)
    if kind == "hf-folder":
        raise CheckpointError(path, "is a model folder, not a weights file; read it with "
                              "conformance.convert.read_state_dict")
    if kind == "safetensors":
        if key is not None:
            raise CheckpointError(path, "--key applies to PyTorch files only; a .safetensors file is flat")
        return dict(read_tensors(path)[1])
    if kind == "npz":
        return _tensor_dict(path, _npz_file(path), key)
    if kind == "dcp":
        # DCP flattens {"model": {...}, "step": 7} into "model.<name>" keys and a bytes entry:
        # `key` keeps the tensors under "model." (without it); what is not a tensor is left out.
        source = sharded.DcpSource(path, prefix=key)
        return {name: source.read(name) for name in source.index}  # each loaded whole from its ranks' shards
    if kind in ("msgpack", "orbax"):
        tree = trees.read_msgpack(path) if kind == "msgpack" else trees.read_orbax(path)
        flat = trees.flatten(trees.select(tree, key, path), str(path))
        for name, value in flat.items():
            if not hasattr(value, "shape"):
                raise CheckpointError(path, f"entry {name!r} is a {type(value).__name__}, not an array (pass --key to "
                                      "select the parameter tree, e.g. --key params)")
        try:
            return as_arrays(flat)
        except TensorError as exc:
            raise CheckpointError(path, str(exc)) from None
    return _tensor_dict(path, _torch_file(path), key)
