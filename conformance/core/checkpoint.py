"""The checkpoint format: one `.safetensors` file that describes itself.

Layout (the standard safetensors container, https://huggingface.co/docs/safetensors):

    8 bytes    little-endian u64 N, the header length
    N bytes    JSON header: {"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...},
               padded with spaces so that the data starts on an 8-byte boundary
    rest       the tensors' bytes, back to back, in the order of their offsets

Our metadata holds `format` ("rosetta-transformer"), `format_version` ("1"), `config` (the
`ModelConfig` JSON) and `sha256`, a digest of the canonical header (without the digest) and the
data, so that a flipped byte anywhere in the file is caught instead of loading plausible numbers.
Any safetensors reader can open the file; only this module checks all of it.

Loading is strict and reads no tensor data before the header has been validated: its length
against the real file size, every entry against the data section, and (for `load`) the format,
version, config and the parameter names, shapes and dtypes the config calls for. A hostile header
can therefore neither make the loader allocate nor hang it. Saving is atomic: the file is written
beside its destination and renamed into place.

This module is framework-free (NumPy and ml_dtypes only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError, InputError
from conformance.core.memory import memory_limit, size_words
from conformance.core.params import check_finite_array, check_numpy_params, check_param_set, host_dtype, param_shapes
from conformance.core.sizes import param_count

FORMAT_NAME = "rosetta-transformer"
FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors library itself enforces
MAX_RANK = 64  # far beyond any real tensor; bounds the work a hostile shape can ask for

# The sharded forms of a checkpoint (docs/sharded-checkpoints.md), named here so that the backends
# that write them (impl_torch.distributed_checkpoint, impl_jax) and the converter agree by import.
DCP_CONFIG_FILE = "rosetta_config.json"  # beside a PyTorch Distributed Checkpoint's files: the ModelConfig
ORBAX_ITEMS = ("params", "config")  # a rosetta Orbax composite checkpoint's items: the nested tree, the config JSON

# safetensors dtype code <-> NumPy dtype (little-endian, as the format requires).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}


def dtype_code(dtype: Any) -> str:
    """The safetensors code of a NumPy dtype (`float32` -> "F32")."""
    dtype = np.dtype(dtype)
    if dtype == DTYPES["BF16"]:
        return "BF16"
    for code, known in DTYPES.items():
        if code != "BF16" and dtype.kind == known.kind and dtype.itemsize == known.itemsize:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in a safetensors file")


# Reading ------------------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r} in the header")
        seen[key] = value
    return seen


def _is_u64(value: Any) -> bool:
    """A JSON integer that fits the format's unsigned 64-bit sizes and offsets."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _header_length(path: Path, size: int, raw_length: bytes) -> int:
    (n,) = struct.unpack("<Q", raw_length)
    if n == 0:
        raise CheckpointError(path, "corrupt: the header length is 0")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(path, f"corrupt: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if n > size - 8:
        raise CheckpointError(
            path, f"truncated or corrupt: header length {n} points past the end of the file ({size} bytes)"
        )
    return n


def _nbytes(shape: list[int], itemsize: int, limit: int) -> int | None:
    """The bytes a tensor of `shape` needs, or None if more than `limit`. Multiplied step by step
    with an early exit, so a hostile shape never builds a huge integer (or spends time on one)."""
    if 0 in shape:
        return 0
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
        if nbytes > limit:
            return None
    return nbytes


def _brief(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: a hostile header must not make a huge message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


Entry = tuple[str, str, tuple, int, int]  # name, dtype code, shape, begin, end (in the data section)


def _validate_index(path: Path, header: Mapping[str, Any], data_len: int) -> list[Entry]:
    """Check every tensor entry and that the offsets tile the data exactly; return the entries."""
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {_brief(name)}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(path, f"corrupt: {where} must have exactly dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code not in DTYPES:
            raise CheckpointError(path, f"corrupt: {where} has unknown dtype {code!r}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_u64(s) for s in shape):
            raise CheckpointError(path, f"corrupt: {where} has invalid shape {_brief(shape)} (at most {MAX_RANK} "
                                        f"non-negative int dimensions)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
            raise CheckpointError(path, f"corrupt: {where} has invalid data_offsets {_brief(offsets)}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise CheckpointError(
                path, f"truncated or corrupt: {where} offsets {_brief(offsets)} lie outside the {data_len}-byte data section"
            )
        nbytes = _nbytes(shape, DTYPES[code].itemsize, data_len)
        if nbytes is None:
            raise CheckpointError(
                path, f"corrupt: {where} of shape {_brief(shape)} and dtype {code} needs more bytes than the whole "
                      f"{data_len}-byte data section"
            )
        if end - begin != nbytes:
            raise CheckpointError(
                path, f"corrupt: {where} of shape {_brief(shape)} and dtype {code} needs {nbytes} bytes, offsets give {end - begin}"
            )
        entries.append((name, code, tuple(shape), begin, end))
    position = 0
    for name, _, _, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != position:
            problem = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise CheckpointError(path, f"corrupt: tensor {name!r} {problem} (offset {begin}, expected {position})")
        position = end
    if position != data_len:
        raise CheckpointError(
            path, f"corrupt: the tensors cover {position} bytes but the data section has {data_len} (trailing bytes)"
        )
    return entries


def _header_digest(header: Mapping[str, Any]) -> "hashlib._Hash":
    """sha256 started with the header (without its own digest) in canonical JSON; the data
    follows (`_canonical_digest`)."""
    stripped = dict(header)
    meta = dict(stripped.get("__metadata__", {}))
    meta.pop("sha256", None)
    stripped["__metadata__"] = meta
    return hashlib.sha256(json.dumps(stripped, sort_keys=True, separators=(",", ":")).encode())


def _canonical_digest(header: Mapping[str, Any], data: bytes | bytearray | memoryview) -> str:
    """sha256 of the header (without its own digest) in canonical JSON, then the data."""
    digest = _header_digest(header)
    digest.update(data)
    return digest.hexdigest()


READ_CHUNK = 16 * 1024 * 1024


def _read_data(f, length: int, digest) -> np.ndarray | None:
    """The data section as one uint8 buffer (None if the file ends early), hashed into `digest`
    as it arrives.

    Reading and hashing overlap: each 16 MiB chunk is handed to one worker thread that updates
    the digest (hashlib releases the GIL on large updates) while the next chunk is read (file
    reads release it too), so loading costs about max(read, hash) instead of their sum. The
    buffer is not zero-filled first: every byte of it is read from the file.
    """
    data = np.empty(length, dtype=np.uint8)
    view = memoryview(data)
    pending = None
    with ThreadPoolExecutor(max_workers=1) as hasher:
        position = 0
        while position < length:
            got = f.readinto(view[position: position + READ_CHUNK])
            if not got:
                return None
            if digest is not None:
                if pending is not None:
                    pending.result()
                pending = hasher.submit(digest.update, view[position: position + got])
            position += got
        if pending is not None:
            pending.result()
    return data


def read_tensors(
    path: str | os.PathLike, before_data: Callable[[dict[str, str], list[Entry]], None] | None = None
) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Read any safetensors file strictly: `(metadata, tensors)`, or `CheckpointError`.

    Checks, before reading any tensor data: the header length against the file size, the header
    is UTF-8 JSON with no duplicate keys, every entry's dtype/shape/offsets, and that the offsets
    tile the data section with no overlap, gap or trailing bytes; then `before_data(metadata,
    entries)` may refuse the file from its header alone. If the metadata carries a `sha256`, the
    digest is verified after reading.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(path, f"truncated: {size} bytes, shorter than the 8-byte header length")
            n = _header_length(path, size, f.read(8))
            raw_header = f.read(n)
            if len(raw_header) != n:
                raise CheckpointError(path, "truncated: the file ended inside the header")
            try:
                header = json.loads(raw_header.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
            except (UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise CheckpointError(path, f"corrupt: the header is not valid JSON ({exc})") from None
            if not isinstance(header, dict):
                raise CheckpointError(path, "corrupt: the header is not a JSON object")
            metadata = header.get("__metadata__", {})
            if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
            ):
                raise CheckpointError(path, "corrupt: __metadata__ must map strings to strings")
            data_len = size - 8 - n
            entries = _validate_index(path, header, data_len)
            if before_data is not None:
                before_data(metadata, entries)
            limit, source = memory_limit()
            if limit is not None and data_len > limit:
                # Reading would end in a MemoryError, or a process killed, after minutes of work.
                raise CheckpointError(path, f"holds {size_words(data_len)} of tensors, which cannot fit in the "
                                      f"memory this process can hold ({size_words(limit)} of {source})")
            digest = _header_digest(header) if "sha256" in metadata else None
            data = _read_data(f, data_len, digest)
            if data is None:
                raise CheckpointError(path, "truncated: the file ended inside the data")
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a checkpoint file") from None
    except PermissionError:
        raise CheckpointError(path, "permission denied") from None
    if digest is not None and digest.hexdigest() != metadata["sha256"]:
        raise CheckpointError(path, "corrupt: the sha256 digest does not match the header and data")
    tensors = {}
    for name, code, shape, begin, end in entries:
        dtype = DTYPES[code]
        count = (end - begin) // dtype.itemsize
        tensors[name] = np.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(shape)
    return metadata, tensors


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a safetensors file whose header says it is a rosetta checkpoint (only
    the header is read; whether the rest holds up is `load`'s to say)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                return False
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                return False
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(metadata, dict) and metadata.get("format") == FORMAT_NAME


def load(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Load a checkpoint: `(config, params)` with params as NumPy arrays in their stored dtype.

    Raises `CheckpointError` naming the file for: a missing or unreadable file, a corrupt or
    truncated file, an unknown format or version, a config that fails validation, a missing or
    unexpected parameter, a wrong shape, a dtype that is not a float, mixed dtypes.
    """
    path = Path(path)
    found: dict[str, ModelConfig] = {}

    def check_header_of(metadata: dict[str, str], entries: list[Entry]) -> None:
        # Everything the header can tell, before a byte of tensor data is read.
        found["config"] = check_header(path, metadata, entries)

    with said_as_load_says(path):
        _, tensors = read_tensors(path, before_data=check_header_of)
    try:  # what the header could not tell: finite values
        for name, value in tensors.items():
            check_finite_array(name, value)
    except InputError as exc:
        raise CheckpointError(path, exc.problem) from None
    return found["config"], tensors


def convert_hint(path: str | os.PathLike) -> str:
    """How to turn a foreign weights file into a checkpoint, spelled for this file."""
    path = Path(path)
    if path.is_file() and (path.parent / "config.json").is_file():
        # A model folder's weights: the folder's config.json tells what the tensors cannot.
        folder = path.parent
        return f"convert its folder first: rosetta convert {folder} {folder.resolve().name}.rosetta.safetensors"
    return f"convert it first: rosetta convert {path} {path.with_suffix('').name}.rosetta.safetensors"


def check_params(config: ModelConfig, params: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Raise `CheckpointError` unless `params` are exactly the finite float parameters of `config`."""
    try:
        check_numpy_params(config, params)
    except InputError as exc:
        raise CheckpointError(path, exc.problem) from None


# Writing ------------------------------------------------------------------------------------


def _layout(metadata: Mapping[str, str], tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[dict[str, Any], int]:
    """The header of `tensors` ((name, dtype code, shape), back to back in that order) under
    `metadata`, and the data section's length in bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, code, shape in tensors:
        size = math.prod(shape) * DTYPES[code].itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def _encoded(header: Mapping[str, Any]) -> bytes:
    """The length prefix and the JSON header, padded so that the data starts 8-byte aligned, as
    safetensors requires."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _stored_bytes(value: np.ndarray, code: str) -> bytes:
    """`value`'s bytes as the file stores them: C order, little-endian (`DTYPES[code]`)."""
    return np.ascontiguousarray(value, dtype=DTYPES[code]).tobytes()


def write_tensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write a safetensors file atomically, with a `sha256` digest added to the metadata."""
    arrays = {name: np.asarray(value) for name, value in tensors.items()}
    codes = {name: dtype_code(value.dtype) for name, value in arrays.items()}
    header, _ = _layout(metadata, [(name, codes[name], value.shape) for name, value in arrays.items()])
    data = b"".join(_stored_bytes(value, codes[name]) for name, value in arrays.items())
    header["__metadata__"]["sha256"] = _canonical_digest(header, data)
    atomic_write(path, [_encoded(header), data])


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[Any]:
    """A temporary file beside `path`, open for writing, renamed into place once the block
    completes and synced; any exception (Ctrl-C included) removes it and leaves `path` as it was."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=directory)
    except OSError as exc:
        # Said of the file being saved: the temporary's name (".x.safetensors.tmp-3ghl3eo7") is ours.
        raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None
    try:
        # mkstemp makes the file private (0600); give it the mode of the file it replaces.
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def atomic_write(path: str | os.PathLike, chunks: list[bytes]) -> None:
    """Write `chunks` to a temporary file beside `path` and rename it into place once complete:
    an interrupted write (Ctrl-C included) removes the temporary and leaves `path` as it was."""
    with _atomic_file(Path(path)) as f:
        for chunk in chunks:
            f.write(chunk)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """A new directory at `path`, made whole or not at all: yields a path, not yet created, in a
    hidden temporary directory beside `path` (`.name.tmp-3ghl3eo7/name`) for the caller to create
    and fill; once the block completes it is renamed to `path`. Any exception, Ctrl-C included,
    removes the temporary directory and everything in it, so `path` never exists half-written."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    for _ in range(100):
        hidden = directory / f".{path.name}.tmp-{secrets.token_hex(4)}"
        try:
            hidden.mkdir()
            break
        except FileExistsError:
            continue
        except OSError as exc:  # said of the directory being written, not of our temporary
            raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None
    else:
        raise FileExistsError(17, "cannot make a temporary directory beside it", os.fspath(path))
    try:
        yield hidden / path.name
        os.rename(hidden / path.name, path)
    finally:
        _uninterrupted(lambda: shutil.rmtree(hidden, ignore_errors=True))


def _uninterrupted(cleanup: Callable[[], None]) -> None:
    """`cleanup()` run whole: a Ctrl-C (SIGINT) that arrives during it, a second one after the
    interrupt being cleaned up after, is held until it ends and then raised, so that a hidden
    temporary directory is never left half-removed. Outside the main thread (where no signal
    handler can be set) it just runs."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        cleanup()
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: held.append(number))
    try:
        cleanup()
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _metadata(config: ModelConfig) -> dict[str, str]:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "config": config.to_json()}


@contextlib.contextmanager
def _saving(path: Path) -> Iterator[None]:
    """The OS's refusals to write `path` as CheckpointErrors that say why."""
    try:
        yield
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory; give a file path to save to") from None
    except FileNotFoundError:
        raise CheckpointError(path, f"cannot save: the directory {str(path.parent)!r} does not exist") from None
    except PermissionError:
        raise CheckpointError(path, "cannot save: permission denied") from None


def save(path: str | os.PathLike, config: ModelConfig, params: Mapping[str, Any]) -> None:
    """Save `config` and `params` (NumPy arrays, one float dtype) to one checkpoint file."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors" and not path.is_dir():  # (a directory: said below)
        # A .pt name on safetensors bytes misleads every tool (and `rosetta inspect` reads a .pt as PyTorch's).
        raise CheckpointError(path, "a rosetta checkpoint is a .safetensors file; name it *.safetensors")
    if not isinstance(config, ModelConfig):
        raise CheckpointError(path, f"config must be a ModelConfig, got {type(config).__name__}")
    check_params(config, params, path)
    arrays = {name: np.asarray(value) for name, value in params.items()}
    ordered = {name: arrays[name] for name in param_shapes(config)}
    with _saving(path):
        write_tensors(path, ordered, _metadata(config))


def _code(dtype: np.dtype) -> str | None:
    try:
        return dtype_code(dtype)
    except ValueError:
        return None


def save_streamed(path: str | os.PathLike, config: ModelConfig, dtypes: Mapping[str, str],
                  arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """The file `save(path, config, params)` writes, byte for byte, from `arrays` given one at a
    time in checkpoint order (`dtypes`: each one's dtype name, known beforehand), so that no more
    than one of them need be alive (`rosetta convert` of a sharded directory; benchmarks).

    The header is laid out first from the shapes and dtypes, with a placeholder digest of the same
    length (a hex sha256 always has 64 characters); each tensor is checked (name, shape, dtype,
    finite), hashed and written as it comes; the digest is then written over the placeholder. The
    file is built beside `path` and renamed into place once complete; on any error it is removed."""
    path = Path(path)
    shapes = param_shapes(config)
    codes = {name: dtype_code(host_dtype(dtypes[name])) for name in shapes}
    header, length = _layout(_metadata(config), [(name, codes[name], shape) for name, shape in shapes.items()])
    digest = _header_digest(header)
    header["__metadata__"]["sha256"] = "0" * 64
    placeholder = _encoded(header)
    given = iter(arrays)
    with _saving(path), _atomic_file(path) as f:
        f.write(placeholder)
        for expected in shapes:
            name, value = next(given, (None, None))
            value = np.asarray(value)
            entry = header[expected]
            if name != expected or list(value.shape) != entry["shape"] or _code(value.dtype) != codes[expected]:
                got = "nothing" if name is None else f"tensor {name!r} {value.dtype.name}{list(value.shape)}"
                raise CheckpointError(path, f"{got} came where {expected!r} {dtypes[expected]}{entry['shape']} was "
                                      "laid out")
            try:
                check_finite_array(name, value)
            except InputError as exc:
                raise CheckpointError(path, exc.problem) from None
            blob = _stored_bytes(value, codes[name])
            digest.update(blob)
            f.write(blob)
        extra = next(given, None)
        if extra is not None:
            raise CheckpointError(path, f"tensor {extra[0]!r} came after the config's last parameter")
        header["__metadata__"]["sha256"] = digest.hexdigest()
        final = _encoded(header)
        if len(final) != len(placeholder) or f.tell() != len(placeholder) + length:
            raise CheckpointError(path, "the streamed file does not match its layout (a bug: please report it)")
        f.seek(0)
        f.write(final)


def check_stored(path: str | os.PathLike, config: ModelConfig, stored: ModelConfig,
                 shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str], dtype: str) -> None:
    """Raise `CheckpointError` unless a sharded directory can be read into a model of `config`
    holding `dtype`: its `stored` config equals the model's (all but `notes`), its tensors
    (`shapes`, `dtypes` from its metadata) are exactly the config's parameters, and they are stored
    in `dtype` (loading never casts: the values arrive bit for bit). Said before any tensor is read;
    `impl_torch.load_distributed` and `impl_jax.load_sharded` both check with it."""
    ours, theirs = config.to_dict(), stored.to_dict()
    differ = [field for field in theirs if field != "notes" and ours.get(field) != theirs[field]]
    if differ:
        raise CheckpointError(path, "its config differs from the model's in " + ", ".join(
            f"{field} (stored {theirs[field]!r}, the model's {ours.get(field)!r})" for field in differ))
    try:
        check_param_set(config, shapes, dtypes)
    except InputError as exc:
        raise CheckpointError(path, exc.problem) from None
    name, held = next(iter(dtypes.items()))  # one dtype for all (check_param_set)
    if held != dtype:
        raise CheckpointError(path, f"parameter {name!r} and every other is stored as {held}, the model holds {dtype}: "
                              f"loading never casts; build the model in {held}")


def stored_config(path: str | os.PathLike, stored: str | Mapping[str, Any], where: str) -> ModelConfig:
    """The complete `ModelConfig` a sharded directory stores beside its tensors (DCP's
    `rosetta_config.json` text, or the dict Orbax's JSON item restores), or a `CheckpointError`
    saying `where` it was invalid."""
    try:
        if isinstance(stored, str):
            return ModelConfig.from_json(stored, complete=True)
        return ModelConfig.from_dict(dict(stored), complete=True)
    except ConfigError as exc:
        raise CheckpointError(path, f"invalid config in {where}: {exc}") from None


# Checking without loading ------------------------------------------------------------------
# `load`'s checks, each usable alone: a reader that takes the tensors a few at a time
# (`rosetta check --stream`) verifies the file first with these, in the words `load` uses.


def check_header(path: str | os.PathLike, metadata: Mapping[str, str], entries: list[Entry]) -> ModelConfig:
    """The config of a checkpoint whose header holds, from the header alone (format, version, a
    digest, a valid config, exactly the config's parameters); `CheckpointError` otherwise."""
    path = Path(path)
    fmt = metadata.get("format")
    if fmt != FORMAT_NAME:
        raise CheckpointError(path, f"not a rosetta checkpoint (unknown format {fmt!r}; expected {FORMAT_NAME!r}); "
                              f"{convert_hint(path)}")
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(path, f"unsupported format_version {version!r}; this version reads {FORMAT_VERSION!r}")
    if "sha256" not in metadata:
        raise CheckpointError(path, "corrupt: the metadata has no sha256 digest")
    try:
        config = ModelConfig.from_json(metadata.get("config", ""), complete=True)
    except ConfigError as exc:
        raise CheckpointError(path, f"invalid config: {exc}") from None
    expected = param_count(config)
    if expected > 2 * len(entries) + 64:
        # Not worth naming each missing name (and a hostile config may claim 10**9 layers).
        raise CheckpointError(path, f"the config calls for {expected} parameters, the file holds {len(entries)}")
    shapes = {name: shape for name, _, shape, _, _ in entries}
    dtypes = {name: DTYPES[code].name for name, code, _, _, _ in entries}
    try:
        check_param_set(config, shapes, dtypes)
    except InputError as exc:
        raise CheckpointError(path, exc.problem) from None
    return config


@contextlib.contextmanager
def said_as_load_says(path: str | os.PathLike) -> Iterator[None]:
    """A `CheckpointError` about a file that is no safetensors file (a .pt, .npz or .bin never
    converted) reworded as `load` words it: its bytes are not worth describing."""
    path = Path(path)
    try:
        yield
    except CheckpointError as exc:
        if path.suffix.lower() != ".safetensors" and exc.problem.startswith(("corrupt", "truncated")):
            raise CheckpointError(path, f"not a rosetta checkpoint (rosetta checkpoints are .safetensors files "
                                  f"written by rosetta convert or checkpoint.save); {convert_hint(path)}") from None
        raise


class _HeaderChecked(Exception):
    """`verify`'s stop after the header: the data is hashed a chunk at a time, not read whole."""


def verify(path: str | os.PathLike) -> tuple[ModelConfig, str]:
    """(config, the parameters' dtype) of the checkpoint at `path` after `load`'s checks of its
    header and of the sha256 digest over header and data, read through a `READ_CHUNK` buffer:
    memory that does not grow with the file. The values are not read (nor checked finite);
    `CheckpointError` as `load` raises it otherwise."""
    path = Path(path)
    found: dict[str, Any] = {}

    def header_only(metadata: dict[str, str], entries: list[Entry]) -> None:
        found["config"] = check_header(path, metadata, entries)
        found["dtype"] = DTYPES[entries[0][1]].name if entries else None
        raise _HeaderChecked

    with said_as_load_says(path):
        try:
            read_tensors(path, before_data=header_only)
        except _HeaderChecked:
            pass
        with open(path, "rb") as f:  # read_tensors has checked the header's length, JSON and index
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length).decode("utf-8"))
            digest = _header_digest(header)
            while chunk := f.read(READ_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != header["__metadata__"]["sha256"]:
            raise CheckpointError(path, "corrupt: the sha256 digest does not match the header and data")
    return found["config"], found["dtype"]
