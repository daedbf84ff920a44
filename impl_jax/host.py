"""Everything the JAX backend does on the host before and after compiled code runs.

Checks raise the same `InputError`s, with the same messages, as the NumPy backend (they call the
same `conformance` checks), because compiled code cannot raise: JAX clamps an out-of-range index
and fills `jnp.take` with NaN. Bucket padding and unpadding happen here too, in NumPy, so that a
new real length never triggers a compilation (not even of a small slicing op).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.inputs import check_device
from conformance.core.params import dtype_name, host_dtype
from conformance.core.params import prepare_params as core_prepare_params
from impl_jax.precision import x64_enabled

X64_ADVICE = (
    "float64 needs 64-bit JAX, which is off: build and call the model inside "
    "`with impl_jax.enable_x64():` (or set JAX_ENABLE_X64=1 before importing JAX); "
    "the JAX backend never switches it on by itself"
)


# Parameters and devices ----------------------------------------------------------------------


def resolve_device(device: Any) -> jax.Device:
    """`device` ("cpu", "gpu", a `jax.Device`; None: JAX's default device) as a device present
    here; anything else is an `InputError` naming it."""
    if device is None:
        return jax.devices()[0]
    if isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise InputError("device", f"{device!r} is not a JAX device (e.g. 'cpu', 'gpu' or a jax.Device)")
    found, absent = [], None
    if device in ("cpu", "gpu"):
        try:
            found = jax.devices(device)
        except RuntimeError as exc:  # no such platform here
            absent = f"jax.devices({device!r}) found none ({str(exc).splitlines()[0]})"
        if not found and absent is None:
            absent = f"jax.devices({device!r}) found none"
    check_device("jax", device, ("cpu", "gpu"), absent)
    return found[0]


def check_runnable(dtype: np.dtype, *, param_dtype: np.dtype | None = None) -> None:
    """float64 runs only with 64-bit JAX; a float64 model built inside `enable_x64()` cannot run
    after the scope has closed. So do float64 parameters (`param_dtype`), whatever the compute
    dtype: without x64, jit would silently narrow them to float32."""
    for argument, value in (("dtype", dtype), ("param_dtype", param_dtype)):
        if value == np.float64 and not x64_enabled():
            raise InputError(argument, X64_ADVICE)


def prepare_params(
    config: ModelConfig, params: Mapping[str, Any] | None, dtype: Any, supported: Sequence[str], device: jax.Device,
    *, param_dtype: Any = None,
) -> tuple[dict[str, jax.Array], np.dtype]:
    """The core's parameter preparation (`conformance.core.params.prepare_params`: checked, cast
    on the host to `param_dtype`, re-checked), then placed on `device`; returns them and the
    compute dtype. None means the seeded `init_params(config)` held in float32 (float64 would
    need x64)."""
    arrays, name = core_prepare_params(config, params, None if dtype is None else dtype_name(dtype), "jax",
                                       supported, default_dtype="float32",
                                       param_dtype=None if param_dtype is None else dtype_name(param_dtype))
    resolved = host_dtype(name)
    check_runnable(resolved, param_dtype=next(iter(arrays.values())).dtype)
    # Each host array is let go of once placed, so that a cast copy of the whole set and the
    # device's never coexist (2x a float64 model's parameters at once otherwise).
    return {key: jax.device_put(arrays.pop(key), device) for key in list(arrays)}, resolved


def to_numpy(array: Any) -> np.ndarray:
    """A result (or parameter) as a host NumPy array with the same bits; bfloat16 stays ml_dtypes'."""
    return np.asarray(array)


# Buckets -------------------------------------------------------------------------------------


def check_buckets(buckets: Sequence[int] | None) -> tuple[int, ...] | None:
    if buckets is None:
        return None
    values = tuple(buckets)
    if not values or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in values):
        raise InputError("buckets", f"must be a non-empty sequence of positive ints, got {buckets!r}")
    if list(values) != sorted(set(values)):
        raise InputError("buckets", f"must be strictly increasing, got {values}")
    return tuple(int(b) for b in values)


def bucket_length(length: int, buckets: Sequence[int] | None, max_len: int) -> int:
    """The padded length: the smallest bucket >= length, capped at max_len (which is always the
    last bucket, so lengths above every bucket pad to max_len)."""
    if buckets is None:
        return length
    return min([b for b in buckets if b >= length] + [max_len])


class Padding:
    """Pads one call's inputs up to their buckets and cuts the outputs back to the real lengths.

    Without buckets every method is the identity and `real` is None, so the unbucketed compiled
    program has no trace of padding. With buckets, `real(side)` marks the real positions for
    attention, and bucketing is on even when a length already equals its bucket, so that each
    bucket compiles one program.
    """

    def __init__(self, config: ModelConfig, buckets, *, src_len: int | None = None, tgt_len: int | None = None):
        self.active = buckets is not None
        self.pad_id = config.pad_id
        self.features = config.source == "features"
        self.length = {"src": src_len, "tgt": tgt_len}
        longest = {"src": config.source_len, "tgt": config.max_len}
        self.padded = self.length if not self.active else {
            side: None if n is None else bucket_length(n, buckets, longest[side]) for side, n in self.length.items()}

    def _pad(self, x, widths: dict[int, int], value) -> np.ndarray:
        x = np.asarray(x)
        pads = [(0, widths.get(axis, 0)) for axis in range(x.ndim)]
        return np.pad(x, pads, constant_values=value) if any(w for _, w in pads) else x

    def ids(self, ids: np.ndarray, side: str) -> np.ndarray:
        """(B, L) -> (B, L_bucket), padded with the padding id (masked like any padding)."""
        if not self.active:
            return ids
        return self._pad(ids, {1: self.padded[side] - self.length[side]}, self.pad_id)

    def source(self, src: np.ndarray) -> np.ndarray:
        """The source padded up to its bucket: ids (`ids`), or a features source's frames (B, n_mels,
        F) with zero frames up to twice the bucket. The convolutions pad with zero frames anyway, so
        the real positions' values are unchanged; the added ones are cut off by `real` and `unpad`."""
        if not self.features:
            return self.ids(src, "src")
        if not self.active:
            return src
        return self._pad(src, {2: 2 * (self.padded["src"] - self.length["src"])}, np.zeros((), src.dtype))

    def positions(self, x, side: str):
        """(B, L, ...) -> (B, L_bucket, ...), False/0 at the added positions (cut off by `unpad`)."""
        if x is None or not self.active:
            return x
        return self._pad(x, {1: self.padded[side] - self.length[side]}, np.zeros((), np.asarray(x).dtype))

    def mask(self, mask, *, queries: str | None = None, keys: str | None = None):
        """Pad a mask's query axis (2) and key axis (3) where they have the real length.

        Axes of size 1 broadcast and stay, unless the real length is 1 too: then padding them
        keeps one shape (and one executable) per bucket. The added entries are False; what they
        say does not matter, because added keys are cut off by `real` inside attention and added
        queries are cut off by `unpad`.
        """
        if mask is None or not self.active:
            return mask
        widths = {}
        for axis, side in ((2, queries), (3, keys)):
            if side is not None and mask.shape[axis] == self.length[side]:
                widths[axis] = self.padded[side] - self.length[side]
        return self._pad(mask, widths, False)

    def memory(self, memory) -> Any:
        """(B, S, D) -> (B, S_bucket, D), zeros at the added positions (never attended)."""
        if not self.active:
            return memory
        return self._pad(memory, {1: self.padded["src"] - self.length["src"]}, 0)

    def real(self, side: str) -> np.ndarray | None:
        """(L_bucket,) boolean, True at the real positions; None without buckets."""
        if not self.active:
            return None
        return np.arange(self.padded[side]) < self.length[side]

    def unpad(self, device: jax.Device, **outputs: Any) -> tuple[Any, ...]:
        """Cut each named output back to the real lengths (on the host: no compilation)."""
        if not self.active:
            return tuple(outputs.values())
        src, tgt = self.length["src"], self.length["tgt"]

        def cut(x, index):
            return jax.device_put(np.asarray(x)[index], device)

        def rows(name: str) -> int:  # queries, or positions: encoder tensors run over the source
            if name == "encoder.conv1":  # a features source's first convolution: over its 2 S frames
                return 2 * src
            return src if name.startswith("encoder") else tgt

        def columns(name: str) -> int:  # keys: the source for the encoder and cross-attention
            return src if name.startswith("encoder") or name.endswith(".cross") else tgt

        results = []
        for kind, value in outputs.items():
            if kind == "memory":
                value = cut(value, np.s_[:, :src])  # (B, S, D)
            elif kind == "logits":
                value = cut(value, np.s_[:, :tgt])  # (B, T, V)
            elif kind == "attention":
                value = {name: cut(w, np.s_[:, :, : rows(name), : columns(name)])  # (B, H, Tq, Tk)
                         for name, w in value.items()}
            elif kind == "intermediates":
                value = {name: cut(x, np.s_[:, : rows(name)]) for name, x in value.items()}
            else:
                raise ValueError(f"unknown output kind {kind!r}")
            results.append(value)
        return tuple(results)
