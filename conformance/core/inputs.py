"""Input validation shared by every backend, so that the same bad input gets the same error.

A backend extracts plain facts from its own array type (shape, whether the dtype is an integer,
the smallest and largest id, ...) and calls these checks; the checks decide and word the error.
The facts are computed on the host before any compiled or device code runs: JAX would clamp an
out-of-range id and CUDA would fail with an opaque device-side assert.

`host_ids` and `host_mask` do the whole job for anything NumPy can read (lists, NumPy arrays,
JAX arrays, CPU tensors): every backend converts its host-side input through them, so the same
input gets the same error, word for word.

This module is framework-free (NumPy and the standard library).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError


def check_ids(
    argument: str,
    shape: Sequence[int],
    dtype: str,
    is_integer: bool,
    bounds: Callable[[], tuple[int, int]],
    vocab_size: int,
    max_len: int,
) -> None:
    """Token ids must be an integer array of shape (B, L), 1 <= L <= max_len, in [0, vocab_size).

    `bounds()` returns (min id, max id); it is only called once the shape is known to be valid
    and non-empty, because on an accelerator it costs a device-to-host sync.
    """
    length_name = "S" if argument.startswith("src") else "T"
    if not is_integer:
        raise InputError(argument, f"token ids must have an integer dtype, got {dtype}")
    if len(shape) != 2:
        raise InputError(argument, f"expected shape (B, {length_name}) of rank 2, got shape {tuple(shape)}")
    batch, length = shape
    if batch == 0:
        raise InputError(argument, f"empty batch: shape {tuple(shape)} has B=0")
    if length == 0:
        raise InputError(argument, f"zero-length sequence: shape {tuple(shape)} has {length_name}=0")
    if length > max_len:
        raise InputError(argument, f"length {length_name}={length} exceeds max_len={max_len}")
    low, high = bounds()
    if low < 0:
        raise InputError(argument, f"negative token id {low}; ids must lie in [0, {vocab_size})")
    if high >= vocab_size:
        raise InputError(argument, f"token id {high} out of range; ids must lie in [0, {vocab_size})")


def check_features(argument: str, shape: Sequence[int], dtype: str, is_float: bool, finite: Callable[[], bool],
                   config: ModelConfig) -> None:
    """A features source must be a float array (B, n_mels, frames) with B >= 1 and an even number
    of frames, 2 <= frames <= 2 * source_len (the second convolution halves it: S = frames / 2
    positions, each reading a row of the encoder's position table), every value finite.

    `finite()` is only called once the shape is known to be valid (on an accelerator it costs a sync)."""
    legend = f"(B, n_mels={config.n_mels}, frames)"
    if not is_float:
        raise InputError(argument, f"a features source takes log-mel features {legend} with a floating dtype, got {dtype}")
    if len(shape) != 3:
        raise InputError(argument, f"expected features of shape {legend} of rank 3, got shape {tuple(shape)}")
    batch, mels, frames = shape
    if batch == 0:
        raise InputError(argument, f"empty batch: shape {tuple(shape)} has B=0")
    if mels != config.n_mels:
        raise InputError(argument, f"expected features of shape {legend}, got {mels} mel channels in shape {tuple(shape)}")
    if frames == 0:
        raise InputError(argument, f"no frames: shape {tuple(shape)} has frames=0")
    if frames % 2:
        raise InputError(argument, f"frames={frames} is odd: the second convolution (stride 2) gives the encoder "
                                   f"frames / 2 positions (Whisper: 3000 frames, 1500 positions), so frames must be even")
    if frames // 2 > config.source_len:
        raise InputError(argument, f"frames={frames} gives S={frames // 2} encoder positions, more than the "
                                   f"{config.source_len} rows of the encoder's position table (max_source_len="
                                   f"{config.source_len}): frames must be at most {2 * config.source_len}")
    if not finite():
        raise InputError(argument, "features must be finite: a NaN or infinite log-mel value makes every position of "
                                   "its row NaN")


def host_features(argument: str, features: Any, config: ModelConfig) -> np.ndarray:
    """A features source read on the host and checked (`check_features`): a NumPy float array
    (B, n_mels, frames), as given (the model casts it to its dtype)."""
    try:
        features = np.asarray(features)
    except (ValueError, TypeError, OverflowError):
        raise InputError(argument, "is not a rectangular array of log-mel features") from None
    is_float = features.dtype.kind == "f" or features.dtype.name == "bfloat16"
    finite = lambda: bool(np.isfinite(features.astype(np.float64)).all())  # noqa: E731
    check_features(argument, features.shape, features.dtype.name, is_float, finite, config)
    return features


def source_real(config: ModelConfig, src: np.ndarray) -> np.ndarray:
    """(B, S): where a source has a real position, from its host array: the ids that are not
    pad_id, or every one of a features source's S = frames / 2 positions (it has no padding)."""
    if config.source == "features":
        return np.ones((src.shape[0], src.shape[2] // 2), dtype=bool)
    return src != config.pad_id


def check_memory(config: ModelConfig, shape: Sequence[int], dtype: str, model_dtype: str) -> None:
    """`encoded.memory` given to `decode` must be (B, S, D) with 1 <= S <= the source's longest
    (max_len; a features source's source_len), in the model's dtype: a memory from another model
    (or edited by hand) would otherwise fail deep inside a matmul, or be silently promoted."""
    shape = tuple(shape)
    if len(shape) != 3 or shape[2] != config.d_model or not 1 <= shape[1] <= config.source_len:
        bound = "max_len" if config.source == "ids" else "source_len"
        raise InputError("encoded", f"memory must have shape (B, S, D={config.d_model}) with 1 <= S <= "
                                    f"{bound}={config.source_len}, got {shape}")
    if dtype != model_dtype:
        raise InputError("encoded", f"memory has dtype {dtype}, the model computes in {model_dtype}")


def check_same_batch(src_shape: Sequence[int], tgt_shape: Sequence[int]) -> None:
    if src_shape[0] != tgt_shape[0]:
        raise InputError(
            "tgt_ids", f"batch size B={tgt_shape[0]} does not match src_ids batch size B={src_shape[0]}"
        )


def check_mask(
    argument: str, shape: Sequence[int], dtype: str, is_bool: bool, expected: Sequence[int], legend: str
) -> None:
    """A mask must be boolean (True = may attend), rank 4, and broadcastable to `expected`.

    Integer and float masks are refused rather than guessed at: PyTorch's own modules read a
    boolean True as "may not attend" and add float masks to the scores.
    """
    if not is_bool:
        raise InputError(argument, f"masks must be boolean (True = may attend), got dtype {dtype}")
    if len(shape) != 4 or any(s not in (1, e) for s, e in zip(shape, expected)):
        raise InputError(
            argument,
            f"shape {tuple(shape)} does not broadcast to {legend} = {tuple(expected)}",
        )


def check_dtype(backend: str, dtype: str, supported: Sequence[str], *, argument: str = "dtype") -> None:
    """`dtype` (a name) must be one of the backend's `supported` ones; `argument` is the one blamed
    ("dtype", the compute dtype, or "param_dtype", the dtype the parameters are stored in)."""
    if dtype not in supported:
        raise InputError(argument, f"the {backend} backend cannot run {dtype}; it supports {', '.join(supported)}")


def expected_mask_shapes(config: ModelConfig, batch: int, src_len: int, tgt_len: int):
    """The shapes user masks must broadcast to, with their legends."""
    heads = config.n_heads
    return {
        "src_mask": ((batch, heads, 1, src_len), "(B, H, 1, S)"),
        "tgt_mask": ((batch, heads, tgt_len, tgt_len), "(B, H, T, T)"),
    }


def check_mask_within_ids(argument: str, first_violation: Sequence[int] | None) -> None:
    """An explicit mask may only narrow the mask derived from the ids, never widen it.

    `first_violation` is the first (b, h, q, k) where the given mask allows attention that the
    ids forbid (a padding key, or for the target a future position), or None. Letting a query
    see padding or the future would silently change results, so it is refused.
    """
    if first_violation is not None:
        where = tuple(int(i) for i in first_violation)
        raise InputError(
            argument,
            f"contradicts the ids: it allows attention at (b, h, q, k) = {where}, which the ids forbid "
            "(a padding key or a future position); an explicit mask may only narrow the mask derived from the ids",
        )


def check_generate(config: ModelConfig, max_len=None, bos_id=None, eos_id=None, **options):
    """Arguments of `generate`, resolved against the checkpoint's generation note and checked
    (`conformance.core.generation.settings.resolve`): 1 <= max_len <= config.max_len (the decoder input grows
    to max_len tokens), bos_id / eos_id valid target ids, and the decoding options. Returns the
    `conformance.core.generation.settings.Generation`."""
    from conformance.core.generation.settings import resolve# decoding imports this module's errors only

    return resolve(config, max_len, bos_id, eos_id, **options)


def host_ids(argument: str, ids: Any, vocab_size: int, max_len: int) -> np.ndarray:
    """Token ids read on the host and checked (`check_ids`): a NumPy integer array (B, L)."""
    try:
        ids = np.asarray(ids)
    except (ValueError, TypeError, OverflowError):
        raise InputError(argument, "is not a rectangular array of token ids") from None
    is_integer = np.issubdtype(ids.dtype, np.integer)
    bounds = lambda: (int(ids.min()), int(ids.max()))  # noqa: E731
    check_ids(argument, ids.shape, ids.dtype.name, is_integer, bounds, vocab_size, max_len)
    return ids


def host_mask(argument: str, mask: Any, expected: tuple[Sequence[int], str], derived: np.ndarray) -> np.ndarray:
    """An explicit mask read on the host and checked: boolean, broadcastable to `expected`
    (shape, legend), and no wider than the mask `derived` from the ids (`check_mask_within_ids`).
    The mask returned is a copy: a backend that computes asynchronously (JAX's dispatch, a jit
    transfer that shares host memory) must not see the caller's array change after the call returns."""
    try:
        mask = np.array(mask)
    except (ValueError, TypeError):
        raise InputError(argument, "is not a rectangular array of booleans") from None
    check_mask(argument, mask.shape, mask.dtype.name, mask.dtype == np.bool_, *expected)
    widened = np.argwhere(mask & ~np.asarray(derived))  # (b, h, q, k) the ids forbid but the mask allows
    check_mask_within_ids(argument, widened[0] if len(widened) else None)
    return mask


def check_device(backend: str, device: str, kinds: Sequence[str], absent: str | None = None) -> None:
    """A device must be one the backend knows (`kinds`) and present on this machine (`absent`
    is the reason it is not, or None)."""
    if device not in kinds:
        raise InputError("device", f"the {backend} backend runs on {' or '.join(kinds)}, not {device!r}")
    if absent:
        raise InputError("device", f"{device!r} is not available to the {backend} backend here: {absent}")


# -- Training arguments (the loss of docs/training.md) -------------------------------------------


def check_label_smoothing(value: Any) -> float:
    """Label smoothing ε must be a real number in [0, 1): ε = 1 would train towards the uniform
    distribution alone, and a NaN or a bool is a mistake, never a setting. Returns ε as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError("label_smoothing", f"must be a float in [0, 1), got {value!r}")
    if not 0.0 <= float(value) < 1.0:  # NaN fails this comparison too
        raise InputError("label_smoothing", f"must lie in [0, 1), got {float(value)!r}")
    return float(value)


def check_labels(
    config: ModelConfig,
    shape: Sequence[int],
    dtype: str,
    is_integer: bool,
    bounds: Callable[[], tuple[int, int]],
    tgt_shape: Sequence[int],
    counted: Callable[[], int],
) -> None:
    """Labels must be an integer array of the decoder input's shape (B, T), every id in
    [0, tgt_vocab_size), and at least one of them must differ from `pad_id` (the loss is a mean
    over the labels that count: with none, it is 0 / 0).

    `bounds()` returns (min label, max label) and `counted()` the number of labels != pad_id;
    both are only called once the shape is known to be valid (each may cost a device sync).
    """
    vocab = config.tgt_vocab_size
    if not is_integer:
        raise InputError("labels", f"labels must have an integer dtype, got {dtype}")
    if tuple(shape) != tuple(tgt_shape):
        raise InputError("labels", f"expected the shape of tgt_ids (B, T) = {tuple(tgt_shape)}, got {tuple(shape)}")
    low, high = bounds()
    if low < 0:
        raise InputError("labels", f"negative label {low}; labels must lie in [0, {vocab}) (padding is "
                                   f"pad_id={config.pad_id}, not a negative ignore index)")
    if high >= vocab:
        raise InputError("labels", f"label {high} out of range; labels must lie in [0, {vocab})")
    if counted() == 0:
        raise InputError("labels", f"no label counts: every label equals pad_id={config.pad_id}, and the "
                                   "loss is a mean over the labels that count")


def host_labels(config: ModelConfig, labels: Any, tgt_shape: Sequence[int]) -> np.ndarray:
    """Labels read on the host and checked (`check_labels`): a NumPy integer array (B, T)."""
    try:
        labels = np.asarray(labels)
    except (ValueError, TypeError, OverflowError):
        raise InputError("labels", "is not a rectangular array of token ids") from None
    is_integer = np.issubdtype(labels.dtype, np.integer)
    bounds = lambda: (int(labels.min()), int(labels.max()))  # noqa: E731
    counted = lambda: int(np.count_nonzero(labels != config.pad_id))  # noqa: E731
    check_labels(config, labels.shape, labels.dtype.name, is_integer, bounds, tgt_shape, counted)
    return labels


def nan_positions(config: ModelConfig, src_ids: np.ndarray, tgt_ids: np.ndarray) -> np.ndarray:
    """Which logits (B, T) the forward pass gives as NaN, read from the ids alone (host arrays).

    Only a `-inf` mask fill makes NaN (finite weights, no overflow), and only with empty_rows
    "softmax": a query whose every key is masked gets softmax(-inf, ..., -inf) = 0 / 0 (with
    "zeros" it gets weights 0). From there NaN spreads by two rules. A residual,
    LayerNorm and the feed-forward keep a position's NaN at that position. And attention computes
    `weights @ V` over every key, masked ones included with weight 0, and 0 * NaN is NaN: one NaN
    key or value makes every query of that attention NaN. So, per batch element: after an encoder
    layer, a source position is NaN if its query had no key or any position already was; after a
    decoder layer, likewise through its self-attention, then through cross-attention from any NaN
    memory position (or a query with no source key). Equal to `np.isnan(logits).any(-1)` of the
    NumPy oracle (tests/training/test_nan_positions.py)."""
    batch, tgt_len = tgt_ids.shape
    if not np.isinf(config.mask_fill) or config.empty_rows == "zeros":
        return np.zeros((batch, tgt_len), dtype=bool)
    src_real = source_real(config, src_ids)  # (B, S)
    tgt_real = tgt_ids != config.pad_id  # (B, T)
    # Encoder self-attention: a query with no key (padding on the keys; on the queries too with "both").
    enc_empty = ~src_real.any(-1, keepdims=True) | (~src_real if config.src_pad_mask == "both" else False)  # (B, S)
    src_nan = np.zeros_like(src_real)
    for _ in range(config.n_encoder_layers):
        src_nan = src_nan | enc_empty | src_nan.any(-1, keepdims=True)
    # Decoder self-attention: causal, with the target padding where tgt_pad_mask puts it.
    allowed = np.tril(np.ones((tgt_len, tgt_len), dtype=bool))[None]  # (1, T, T): query, key
    if config.tgt_pad_mask in ("keys", "both"):
        allowed = allowed & tgt_real[:, None, :]
    if config.tgt_pad_mask in ("queries", "both"):
        allowed = allowed & tgt_real[:, :, None]
    self_empty = ~allowed.any(-1)  # (B, T)
    cross_empty = (~src_real.any(-1, keepdims=True) if config.cross_attn_src_mask
                   else np.zeros((batch, 1), dtype=bool))  # (B, 1)
    memory_nan = src_nan.any(-1, keepdims=True)  # (B, 1)
    tgt_nan = np.zeros_like(tgt_real)
    for _ in range(config.n_decoder_layers):
        tgt_nan = tgt_nan | self_empty | tgt_nan.any(-1, keepdims=True)
        tgt_nan = tgt_nan | cross_empty | memory_nan
    return tgt_nan


def check_labels_finite(config: ModelConfig, src_ids: np.ndarray, tgt_ids: np.ndarray, labels: np.ndarray) -> None:
    """A label that counts must sit where the logits are finite (`nan_positions`): a loss over a
    NaN logit is NaN, and autograd frameworks disagree on what such a gradient is. Refused in
    every backend with the same `InputError`, before any work."""
    bad = np.argwhere(nan_positions(config, src_ids, tgt_ids) & (labels != config.pad_id))
    if bad.size:
        b, t = (int(i) for i in bad[0])
        raise InputError("labels", f"{len(bad)} label(s) count where the logits are NaN, first at (row {b}, "
                                   f"position {t}): with mask_fill=-inf a query with no key to attend to is NaN, "
                                   "and attention spreads it; give those labels pad_id, or use a finite mask_fill "
                                   "(or empty_rows 'zeros')")
