"""Flax parameter trees in: nested dicts, `nnx.State`, `flax.serialization` msgpack files and
Orbax checkpoint directories, flattened to `{"a.b.c": array}` (linen's names joined with ".").

    {"encoder": {"encoder_norm": {"scale": x}}}  ->  {"encoder.encoder_norm.scale": x}

Reading runs no code from the file: msgpack holds only maps, lists, numbers, strings and Flax's
ndarray extension (shape, dtype name, raw bytes; an object dtype cannot be built from a buffer);
an Orbax directory holds JSON/msgpack metadata and array data read by tensorstore. Flax and
Orbax are imported only when such a file is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from conformance.core.errors import CheckpointError

# Files Orbax writes at the top of every checkpoint directory (one of them suffices).
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding")


def is_flax_state(obj: Any) -> bool:
    """An `nnx.State` (or anything of Flax's with `to_pure_dict`)."""
    return type(obj).__module__.startswith("flax") and hasattr(obj, "to_pure_dict")


def is_tree(obj: Any) -> bool:
    """A nested mapping (some value is itself a mapping), or an `nnx.State`."""
    return is_flax_state(obj) or (isinstance(obj, Mapping) and any(isinstance(v, Mapping) for v in obj.values()))


def flatten(tree: Any, where: str = "the tree") -> dict[str, Any]:
    """A nested mapping (or `nnx.State`) -> `{dotted key: leaf}`. linen's `variables` with only a
    "params" collection are taken as `variables["params"]`."""
    if is_flax_state(tree):
        tree = tree.to_pure_dict()
    if isinstance(tree, Mapping) and list(tree) == ["params"] and isinstance(tree["params"], Mapping):
        tree = tree["params"]
    out: dict[str, Any] = {}

    def walk(node: Mapping, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if not isinstance(key, (str, int)) or "." in str(key):
                raise CheckpointError(where, f"key {name!r} cannot be joined with '.' (keys must be names without a dot)")
            if isinstance(value, Mapping):
                walk(value, name + ".")
            else:
                out[name] = value
    if not isinstance(tree, Mapping):
        raise CheckpointError(where, f"holds a {type(tree).__name__}, not a tree of named arrays")
    walk(tree, "")
    return out


def select(tree: Any, key: str | None, path) -> Any:
    """The subtree at a dotted `key` ("params", "state.params"), or the tree itself."""
    if key is None:
        return tree
    node = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            found = sorted(map(str, node)) if isinstance(node, Mapping) else []
            raise CheckpointError(path, f"has no entry {key!r} (entries at that level: {', '.join(found) or 'none'})")
        node = node[part]
    return node


def read_msgpack(path: Path) -> Any:
    """The tree in a `flax.serialization.msgpack_serialize` file (Flax's `to_bytes`)."""
    try:
        from flax import serialization
    except ImportError:
        raise CheckpointError(path, "reading a Flax msgpack file needs flax (pip install 'rosetta-transformer[jax]')") from None
    if not path.exists():
        raise CheckpointError(path, "no such file")
    if path.is_dir():
        raise CheckpointError(path, "is a directory, not a msgpack file")
    data = path.read_bytes()
    try:
        tree = serialization.msgpack_restore(data)
    except Exception as exc:  # noqa: BLE001 - any failure to parse untrusted bytes is the file's problem
        raise CheckpointError(path, f"not a readable Flax msgpack file: {type(exc).__name__}: {exc}") from None
    if not isinstance(tree, Mapping):
        raise CheckpointError(path, f"holds a {type(tree).__name__}, not a tree of named arrays")
    return tree


def is_orbax_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in ORBAX_MARKERS)


def read_orbax(path: Path) -> Any:
    """The tree an Orbax checkpoint directory holds, restored on the host without a target."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise CheckpointError(path, "reading an Orbax checkpoint needs orbax-checkpoint (pip install 'rosetta-transformer[jax]')") from None
    try:
        tree = ocp.PyTreeCheckpointer().restore(path.resolve())
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign directory
        raise CheckpointError(path, f"not a readable Orbax checkpoint: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not isinstance(tree, Mapping):
        raise CheckpointError(path, f"holds a {type(tree).__name__}, not a tree of named arrays")
    return tree


def write_msgpack(path: Path, tree: Mapping) -> None:
    """`tree` as a Flax msgpack file (what `flax.serialization.from_bytes` reads), written
    atomically: an interrupted write leaves the file that was there. Not read back here:
    `conformance.formats` checks what `rosetta convert` writes."""
    from flax import serialization

    from conformance.core.checkpoint import atomic_write

    atomic_write(path, [serialization.msgpack_serialize(dict(tree))])


def write_orbax(path: Path, tree: Mapping) -> None:
    """A new Orbax checkpoint directory holding `tree` (NumPy arrays), as `StandardCheckpointer`
    writes it, built in a hidden directory beside `path` and renamed into place once Orbax has
    finished: an interrupted write leaves no directory. Not read back here: `conformance.formats`
    checks what `rosetta convert` writes."""
    import orbax.checkpoint as ocp

    from conformance.core.checkpoint import atomic_directory

    if path.exists():
        raise CheckpointError(path, "already exists; Orbax writes a new directory")
    with atomic_directory(path) as staged:
        checkpointer = ocp.StandardCheckpointer()
        try:
            checkpointer.save(staged.resolve(), dict(tree))
            checkpointer.wait_until_finished()
        finally:
            checkpointer.close()  # its writer thread stops before the staged files are removed
