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
import os
import secrets
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError, InputError
from conformance.core.memory import memory_limit, size_words
from conformance.core.params import check_finite_array, check_numpy_params, check_param_set, param_shapes
from conformance.core.sizes import param_count

FORMAT_NAME = "rosetta-transformer"
FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors library itself enforces
MAX_RANK = 64  # far beyond any real tensor; bounds the work a hostile shape can ask for

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

    def check_header(metadata: dict[str, str], entries: list[Entry]) -> None:
        # Everything the header can tell, before a byte of tensor data is read.
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
        found["config"] = config

    try:
        _, tensors = read_tensors(path, before_data=check_header)
    except CheckpointError as exc:
        if path.suffix.lower() != ".safetensors" and exc.problem.startswith(("corrupt", "truncated")):
            # A .pt, .npz or .bin file was never converted: its bytes are not worth describing.
            raise CheckpointError(path, f"not a rosetta checkpoint (rosetta checkpoints are .safetensors files "
                                  f"written by rosetta convert or checkpoint.save); {convert_hint(path)}") from None
        raise
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


def write_tensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write a safetensors file atomically, with a `sha256` digest added to the metadata."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    blobs = []
    offset = 0
    for name, value in tensors.items():
        value = np.asarray(value)
        code = dtype_code(value.dtype)
        blob = np.ascontiguousarray(value, dtype=DTYPES[code]).tobytes()
        header[name] = {"dtype": code, "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    data = b"".join(blobs)
    header["__metadata__"]["sha256"] = _canonical_digest(header, data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors requires
    atomic_write(path, [struct.pack("<Q", len(raw)), raw, data])


def atomic_write(path: str | os.PathLike, chunks: list[bytes]) -> None:
    """Write `chunks` to a temporary file beside `path` and rename it into place once complete:
    an interrupted write (Ctrl-C included) removes the temporary and leaves `path` as it was."""
    path = Path(path)
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
            for chunk in chunks:
                f.write(chunk)
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
        shutil.rmtree(hidden, ignore_errors=True)


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
    metadata = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "config": config.to_json()}
    try:
        write_tensors(path, ordered, metadata)
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory; give a file path to save to") from None
    except FileNotFoundError:
        raise CheckpointError(path, f"cannot save: the directory {str(path.parent)!r} does not exist") from None
    except PermissionError:
        raise CheckpointError(path, "cannot save: permission denied") from None
