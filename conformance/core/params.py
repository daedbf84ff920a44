"""The canonical parameter key space and a seeded initialiser.

One flat, dot-separated key space serves every backend: the torch `state_dict()`, the flattened
Flax state and the checkpoint file all use exactly these names. Matrices are stored
`(d_in, d_out)` so that the math reads `y = x @ W + b` as in the paper; embeddings are `(V, D)`.

    encoder.embedding.weight                      (V_src, D)    source "ids"
    encoder.frontend.conv1.{weight,bias}          (3, n_mels, D), (D,)   source "features": kernel (3, C_in, C_out)
    encoder.frontend.conv2.{weight,bias}          (3, D, D), (D,)        source "features"
    encoder.position.table                        (source_len + position_offset, D)   position == "table"
    encoder.position.relative_bias                (relative_buckets, H)   position == "relative"
    encoder.layers.{i}.self_attn.relative_bias    (relative_buckets, H)   ... relative_bias_per_layer (instead)
    encoder.embedding_norm.{weight,bias}          (D,)          embedding_norm
    encoder.layers.{i}.self_attn.{q,k,v}_proj.weight    (D, H K)  (H K = D unless d_head is set)
    encoder.layers.{i}.self_attn.o_proj.weight          (H K, D)
    encoder.layers.{i}.self_attn.{q,k,v}_proj.bias      (H K,)   qkv_bias (k: and key_bias)
    encoder.layers.{i}.self_attn.o_proj.bias            (D,)     out_proj_bias
    encoder.layers.{i}.self_attn_norm.{weight,bias}     (D,)     (no bias: layer_norm_form "rms")
    encoder.layers.{i}.ffn.linear1.{weight,bias}        (D, F), (F,)    (biases: ffn_bias)
    encoder.layers.{i}.ffn.gate.{weight,bias}           (D, F), (F,)    ffn_glu
    encoder.layers.{i}.ffn.linear2.{weight,bias}        (F, D), (D,)
    encoder.layers.{i}.ffn_norm.{weight,bias}           (D,)
    encoder.norm.{weight,bias}                    (D,)          final_encoder_norm
    decoder.embedding.weight                      (V, D)        unless share_embeddings
    decoder.position.table                        (max_len + position_offset, D)  position == "table"
    decoder.embedding_norm.{weight,bias}          (D,)          embedding_norm
    decoder.layers.{i}.self_attn.* / self_attn_norm.* / cross_attn.* / cross_attn_norm.* /
        ffn.* / ffn_norm.*
    decoder.norm.{weight,bias}                    (D,)          final_decoder_norm
    output.weight                                 (D, V)        unless tie_output
    output.bias                                   (V,)          output_bias
    final_logits_bias                             (V,)          final_logits_bias

The shapes are computed by `sizes.param_shapes` (with the counts that refuse a config too large
to hold), exported here as `param_shapes`.

This module is framework-free (NumPy only).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.inputs import check_dtype
# The shapes and sizes of the key space, computed from the config alone; param_shapes, param_count
# and param_bytes are this module's public names too.
from conformance.core.sizes import Shape, check_fits, param_bytes, param_count, param_shapes  # noqa: F401


# Vocabulary columns per product of the output projection. Every backend's `Output` computes
# y W_out this many columns of W_out (D, V) at a time and casts each block where it is used, so a
# W_out stored narrower than the compute dtype (`param_dtype`) is never widened whole: 8 MB per
# block at D = 512 in float64, against 131 MB for the whole weight at V = 32000.
OUTPUT_BLOCK = 2048


def widened_at_use(config: ModelConfig) -> int:
    """Elements of the largest piece of one parameter that a model casts at once where it uses it
    (parameters stored narrower than the compute dtype): embeddings and position tables only
    their looked-up rows, the output projection (or the tied embedding read as it) OUTPUT_BLOCK
    columns at a time, every other parameter whole."""
    in_pieces = ("embedding.weight", "position.table", "output.weight")
    whole = [int(np.prod(shape)) for name, shape in param_shapes(config).items() if not name.endswith(in_pieces)]
    return max(whole + [config.d_model * min(config.tgt_vocab_size, OUTPUT_BLOCK)])


def _init_std(name: str, shape: Shape, config: ModelConfig) -> tuple[float, float]:
    """(mean, std) for one parameter: O(1) activations, and no value that hides a mistake.

    LayerNorm scales are drawn around 1 and every bias around 0 with a visible spread, so that a
    swapped scale/bias, a wrong epsilon or a missing norm changes the output.
    """
    parts = name.split(".")
    leaf = parts[-1]
    is_norm = len(parts) > 1 and parts[-2].endswith("norm")
    if is_norm:
        return (1.0, 0.2) if leaf == "weight" else (0.0, 0.2)
    if leaf == "bias" or name == "final_logits_bias":
        return 0.0, 0.2
    if leaf == "table":
        return 0.0, 0.5
    if name.endswith(("conv1.weight", "conv2.weight")):  # (3, C_in, C_out): keeps the sum over 3 C_in at x's scale
        return 0.0, (shape[0] * shape[1]) ** -0.5
    if leaf == "relative_bias":  # added to the scores: O(1), so that a wrong bucket is visible
        return 0.0, 1.0
    if name.endswith("q_proj.weight") and not config.scale_scores:
        # T5's initialisation folds the 1 / sqrt(K) it leaves out of the scores into W_q
        # (`T5PreTrainedModel._init_weights`: std (D K)^-1/2), so its scores are of the paper's size.
        return 0.0, (shape[0] * config.head_dim) ** -0.5
    if name.endswith("embedding.weight"):
        # Scaled by sqrt(D) in the forward pass when scale_embedding is set (section 3.4).
        return 0.0, config.d_model**-0.5 if config.scale_embedding else 0.5
    return 0.0, shape[0] ** -0.5  # (d_in, d_out): keeps x @ W at the scale of x


def init_params(
    config: ModelConfig, seed: int = 0, dtype=np.float64, scale: float = 1.0
) -> dict[str, np.ndarray]:
    """Seeded random parameters for `config`, as NumPy arrays of `dtype`.

    Each parameter has its own random stream keyed by (seed, name), so turning one switch on or
    off never changes the values of the parameters the two configs share. `scale` multiplies
    every standard deviation (weights far from 1 stress the tolerances and the masking).

    Raises `TooLargeError` (a `ConfigError` and a `MemoryError`) before drawing anything when the
    parameters in `dtype` are more than this process can ever hold (`memory_limit`).
    """
    check_fits(config, dtype)
    params = {}
    for name, shape in param_shapes(config).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        mean, std = _init_std(name, shape, config)
        values = mean + scale * std * rng.standard_normal(shape)
        params[name] = values.astype(dtype)
    return params


PARAM_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")


def check_param_set(
    config: ModelConfig, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]
) -> None:
    """Raise `InputError("params", ...)` unless the parameters are exactly those of `config`.

    `shapes` and `dtypes` map each given parameter name to its shape and dtype name ("float32",
    "bfloat16", ...), so every backend can describe its own arrays. One float dtype for all.
    """
    count = param_count(config)
    if count > 2 * len(shapes) + 64:
        # Not worth naming each missing one (and a config may claim 10**9 layers).
        raise InputError("params", f"the config calls for {count:,} parameters, {len(shapes):,} are given")
    expected = param_shapes(config)
    missing = [k for k in expected if k not in shapes]
    unexpected = sorted(set(shapes) - set(expected))

    def listing(names: list[str]) -> str:
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    if missing:
        raise InputError("params", f"missing parameter(s) for this config: {listing(missing)}")
    if unexpected:
        raise InputError("params", f"unexpected parameter(s) for this config: {listing(unexpected)}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise InputError("params", f"parameter {name!r} has shape {tuple(shapes[name])}, the config needs {shape}")
        if dtypes[name] not in PARAM_DTYPE_NAMES:
            raise InputError(
                "params", f"parameter {name!r} has dtype {dtypes[name]}; parameters must be one of {', '.join(PARAM_DTYPE_NAMES)}"
            )
    found = sorted(set(dtypes.values()))
    if len(found) > 1:
        raise InputError("params", f"parameters mix dtypes {found}; a model holds one dtype")


def check_finite(name: str, nonfinite: int, size: int, *, where: str = "") -> None:
    """NaN or infinite weights are refused: they only ever produce NaN logits far from their cause.
    `where` (keyword-only) says in which dtype, when it is not the parameter's own."""
    if nonfinite:
        raise InputError("params", f"parameter {name!r} has {nonfinite} NaN or infinite value(s) out of {size}{where}")


def check_finite_array(name: str, value: np.ndarray, *, where: str = "") -> None:
    """`check_finite` for a NumPy array.

    float32 and float64 arrays are first checked with two reductions that allocate nothing (NaN
    propagates through min and max, and an infinity is one of them); only an array that fails is
    counted element by element, for the message.
    """
    if value.size and value.dtype in (np.float32, np.float64):
        if np.isfinite(value.min()) and np.isfinite(value.max()):
            return
    check_finite(name, value.size - int(np.count_nonzero(np.isfinite(value))), value.size, where=where)


def check_numpy_params(
    config: ModelConfig, params: Mapping[str, Any], as_numpy: Callable[[Any], np.ndarray] = np.asarray
) -> dict[str, np.ndarray]:
    """`check_param_set` and `check_finite` for parameters `as_numpy` can read on the host;
    returns them as NumPy arrays (no copy where `as_numpy` makes none)."""
    if not isinstance(params, Mapping):
        raise InputError("params", f"must map parameter names to arrays, got {type(params).__name__}")
    arrays = {}
    for name, value in params.items():
        try:
            arrays[name] = as_numpy(value)
        except (ValueError, TypeError):
            raise InputError("params", f"parameter {name!r} is not a rectangular array") from None
    check_param_set(config, {k: v.shape for k, v in arrays.items()}, {k: v.dtype.name for k, v in arrays.items()})
    for name, value in arrays.items():
        check_finite_array(name, value)
    return arrays


def dtype_name(dtype: Any) -> str:
    """The plain name the shared checks use ("float32", "bfloat16") of a NumPy, ml_dtypes, JAX
    or PyTorch dtype, or of a name. Unknown names come back as they are, for `check_dtype` to refuse."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).removeprefix("torch.")


def host_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name the checks accept: ml_dtypes' for "bfloat16"."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def prepare_params(
    config: ModelConfig,
    params: Mapping[str, Any] | None,
    dtype: Any,
    backend: str,
    supported: Sequence[str],
    *,
    as_numpy: Callable[[Any], np.ndarray] = np.asarray,
    default_dtype: str = "float64",
    param_dtype: Any = None,
) -> tuple[dict[str, np.ndarray], str]:
    """The one parameter preparation every backend runs before it builds its model.

    1. `params=None` draws the seeded `init_params(config)` (float64 values), held in `dtype` or
       `default_dtype`;
    2. the parameter set is checked (names, shapes, one float dtype, every value finite);
    3. the dtype is resolved (default: the parameters' own) and refused unless `supported`;
       so is `param_dtype` (keyword-only), the dtype the parameters are stored in (default:
       `dtype`; refused as `InputError("param_dtype", ...)`);
    4. the values are cast on the host by NumPy (ml_dtypes for bfloat16) to `param_dtype`: one
       rounding from their own dtype, so every backend starts from the same weights;
    5. what was cast is checked for finiteness again: 1e39 is a finite float64 and an infinite
       float32, 1e5 a finite float32 and an infinite float16;
    6. with a `param_dtype` whose largest value is beyond `dtype`'s (float32 parameters computed
       in float16), the model casts each parameter to `dtype` where it is used, so each is also
       checked finite in `dtype`: one array at a time, a temporary copy, never a second set.
       Where `dtype` holds every `param_dtype` value (float32 in float64), nothing is copied.

    Returns the host arrays in `param_dtype`, ready for the backend to place on its device, and
    the name of `dtype` (the compute dtype; the arrays' own dtype is the storage's). `as_numpy`
    reads one of the backend's own arrays on the host (a CUDA or bfloat16 tensor needs the
    backend's help).
    """
    if params is None:
        params = init_params(config)
        dtype = default_dtype if dtype is None else dtype
    arrays = check_numpy_params(config, params, as_numpy)
    name = dtype_name(dtype) if dtype is not None else next(iter(arrays.values())).dtype.name
    check_dtype(backend, name, supported)
    stored = name if param_dtype is None else dtype_name(param_dtype)
    check_dtype(backend, stored, supported, argument="param_dtype")
    target, compute = host_dtype(stored), host_dtype(name)
    narrows = ml_dtypes.finfo(compute).max < ml_dtypes.finfo(target).max
    cast = {}
    for key, value in arrays.items():
        with np.errstate(over="ignore"):  # an overflow is refused just below, by name
            cast[key] = value.astype(target, copy=False)
        if value.dtype != target:
            check_finite_array(key, cast[key])
        if narrows:
            # torch and XLA round float64 to float16/bfloat16 through float32, which is never more
            # lenient than one rounding: a float64 just under 65520 is finite one way, inf the other.
            at_use = cast[key].astype(np.float32) if target == np.float64 and compute.itemsize < 4 else cast[key]
            with np.errstate(over="ignore"):
                check_finite_array(key, at_use.astype(compute), where=f" once cast to {name}, the compute dtype")
    return cast, name


def nest_dotted(flat: Mapping[str, Any]) -> dict[str, Any]:
    """`{"a.b": x}` -> `{"a": {"b": x}}`: a nested tree (Flax's form) from dotted names."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def flatten_dotted(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The inverse of `nest_dotted`: `{"a": {"b": x}}` -> `{"a.b": x}`."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
