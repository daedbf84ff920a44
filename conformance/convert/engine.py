"""The layout engine: a foreign state dict <-> `(ModelConfig, canonical params)`, for any layout.

Import, in order (1 is `planner.plan_import`, decided once; `execute` carries out the rest):
  1. key check: every foreign key is dropped, matched by exactly one entry, or unexpected; the
     keys the layout expects for the structure implied by the preset, the overrides and the layer
     indices found are compared with the keys given (missing / unexpected);
  2. aliases: a tied duplicate must be bit-identical to the key it duplicates (or stands in
     for it when that key was not saved);
  3. transforms: squeeze, split or copy, then transpose matrices the system stores (out, in);
  4. positions: a stored table is kept, or recognised as a sinusoid (see `transforms.recognise_positions`);
  5. config: the layout's switches, sizes read from shapes, then the overrides; a contradiction
     between an override and a tensor is a `ConfigError` naming the field and the tensor;
  6. every tensor's shape against the config, and finiteness, blaming the foreign key.
Export runs the same plan backwards and is the exact inverse.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from conformance.core.config import ModelConfig, computes_alike
from conformance.core.params import nest_dotted
from conformance.convert.errors import LayoutError, TensorError, listing, setting
from conformance.convert.planner import Plan, alias_keys, build_config, defaulted_switches, plan_import, plan_keys
from conformance.convert.layout import SIZE_FIELDS, SWITCH_FIELDS, TABLES, Layout, load_layout
from conformance.convert.transforms import backward, forward, identical, recognise_positions, stored_heads
from conformance.core.errors import ConfigError
from conformance.core.params import PARAM_DTYPE_NAMES, check_numpy_params, param_shapes
from conformance.core.positions import position_table

_CONFIG_FIELDS = SWITCH_FIELDS | SIZE_FIELDS | {"notes"}
# Switches that change a training step and never a forward pass: exported weights compute the
# same logits in the system whatever they say, so an export does not refuse them.
TRAINING_ONLY = frozenset({"freeze_pad_embedding", "freeze_final_logits_bias"})


# -- Import ------------------------------------------------------------------------------------


@dataclass
class Conversion:
    """The result of an import, with what the engine decided on the way (for reports)."""

    config: ModelConfig
    params: dict[str, np.ndarray]
    layout: Layout
    detected: bool = False
    decisions: list[str] = field(default_factory=list)


def _dtype(name: str) -> np.dtype:
    if name not in PARAM_DTYPE_NAMES:
        raise ConfigError("dtype", f"unknown parameter dtype {name!r}; expected one of {list(PARAM_DTYPE_NAMES)}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


class CastOverflowError(TensorError):
    """A cast to `.dtype` that would turn finite values infinite (a `TensorError` naming `.key`):
    the command line adds the flag that asked for the dtype; a Python caller passed `dtype=`."""

    def __init__(self, key: str, problem: str, dtype: str):
        super().__init__(key, problem)
        self.dtype = dtype


def cast(array: np.ndarray, dtype: str, key: str) -> np.ndarray:
    """`array` in `dtype`, refusing a cast that turns finite values infinite: 1e5 is a finite
    float32 and an infinite float16. The `CastOverflowError` names `key` and says that the cast,
    not the file, made the infinity (a value the file itself holds infinite is left for the
    finiteness check, which blames the file)."""
    target = _dtype(dtype)
    with np.errstate(over="ignore"):
        out = array.astype(target)
    if out.dtype.itemsize >= array.dtype.itemsize and out.dtype.kind == array.dtype.kind == "f":
        return out  # a widening cast cannot overflow
    wide = array.astype(np.float64)
    overflowed = np.isfinite(wide) & ~np.isfinite(out.astype(np.float64))
    if overflowed.any():
        largest = float(np.abs(wide[overflowed]).max())
        raise CastOverflowError(key, f"has {int(overflowed.sum())} value(s) that overflow when cast to {dtype}: the "
                                f"largest, {largest:g}, is finite as stored in {array.dtype.name} but beyond "
                                f"{dtype}'s largest finite value {float(ml_dtypes.finfo(target).max):g}; keep a "
                                "wider dtype", dtype)
    return out


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype == np.dtype(ml_dtypes.bfloat16)


def check_overrides(overrides: Mapping[str, Any]) -> None:
    unknown = sorted(set(overrides) - _CONFIG_FIELDS)
    if unknown:
        raise ConfigError(unknown[0], "is not a ModelConfig field")
    pad = overrides.get("pad_id")
    if isinstance(pad, int) and not isinstance(pad, bool) and pad < 0:
        # Refused here, before any placeholder config can blame placeholder vocabulary sizes.
        raise ConfigError("pad_id", f"{pad} is negative; it must be a token id of both vocabularies (0 <= pad_id)")


class PaddingWarning(UserWarning):
    """The padding id given (or defaulted) is not the one the embeddings' zero row shows."""


def padding_evidence(canonical: Mapping[str, np.ndarray]) -> tuple[int, str] | None:
    """`(row, where)` when exactly one row is all zeros in every token embedding: the mark
    `nn.Embedding(padding_idx=row)` leaves (it zeroes that row and never trains it). None otherwise."""
    tables = [k for k in ("encoder.embedding.weight", "decoder.embedding.weight") if k in canonical]
    if not tables:
        return None
    rows = None
    for key in tables:
        table = np.asarray(canonical[key])
        if table.ndim != 2 or table.shape[1] == 0:
            return None
        zero = set(np.flatnonzero(~table.astype(np.float64).any(axis=1)).tolist())
        rows = zero if rows is None else rows & zero
    if rows is None or len(rows) != 1:
        return None
    row = rows.pop()
    where = "both token embeddings" if len(tables) == 2 else "the token embedding"
    return row, f"row {row} of {where} is all zeros, the mark nn.Embedding(padding_idx={row}) leaves"


def _padding(layout: Layout, canonical, overrides: dict[str, Any], decisions: list[str]) -> None:
    """Use the evidence the weights carry for pad_id: take it when the user did not say, warn
    when what they said (or the preset's value) contradicts it."""
    evidence = padding_evidence(canonical)
    if evidence is None:
        return
    row, mark = evidence
    user_says = "pad_id" in layout.free or "pad_id" in layout.required
    if "pad_id" not in overrides and user_says:
        overrides["pad_id"] = row
        decisions.append(f"pad_id={row} (read from the weights: {mark}; --set pad_id=N if yours differs)")
        return
    value = overrides.get("pad_id", layout.base_switches().get("pad_id", ModelConfig().pad_id))
    if value != row:
        message = (f"pad_id={value} ({'given' if 'pad_id' in overrides else 'the layout preset'}), but {mark}; "
                   "a wrong padding id masks real tokens and attends to padding: check the model's padding id")
        decisions.append(f"WARNING: {message}")
        warnings.warn(message, PaddingWarning, stacklevel=3)


def convert_arrays(arrays: Mapping[str, np.ndarray], layout: Layout | str | None = None, *, dtype: str | None = None,
                   notes: Mapping[str, str] | None = None, **overrides: Any) -> Conversion:
    """Import NumPy arrays keyed by foreign names; see `import_state_dict` for the arguments."""
    check_overrides(overrides)
    return execute(plan_import(arrays, layout, overrides), arrays, dtype=dtype, notes=notes)


def execute(plan: Plan, arrays: Mapping[str, np.ndarray], *, dtype: str | None = None,
            notes: Mapping[str, str] | None = None) -> Conversion:
    """Carry out a `Plan` (`planner.plan_import`) on the arrays it was made for: steps 2 to 6 above."""
    layout, check = plan.layout, plan.check
    decisions = [f"layout: {layout.name}" + (" (auto-detected)" if plan.detected else "")]
    if check.dropped:
        decisions.append(f"dropped {len(check.dropped)} key(s) the layout marks as not parameters: {listing(check.dropped)}")

    stored = {key: arrays[key] for key in check.effective if key in arrays}
    for alias, target in check.aliases.items():
        if target in stored:
            if not identical(np.asarray(arrays[alias]), np.asarray(stored[target])):
                raise TensorError(alias, f"is declared the same tensor as {target} (tied weights), but it differs; this "
                                  "model does not tie them, so the layout does not describe it")
        else:
            stored[target] = arrays[alias]
    if check.aliases:
        decisions.append(f"verified {len(check.aliases)} tied duplicate(s): {listing(sorted(check.aliases))}")

    canonical, origin, heads = {}, {}, None
    for key, (entry, values) in check.effective.items():
        h = stored_heads(entry, np.asarray(stored[key]))
        if h is not None:
            shape = np.shape(stored[key])
            width, d_model = (shape[1] * shape[2], shape[0]) if entry.heads == "out" else (shape[0] * shape[1], shape[2])
            if width != d_model:
                # ModelConfig.d_head could hold it (as for T5's d_kv), but no per-head system
                # (Flax DenseGeneral) has been checked with such a width yet.
                raise ConfigError("d_model", f"{key} has shape {shape}: an attention width H*K={width} (Flax's "
                                  f"qkv_features, wmt's qkv_dim) other than d_model={d_model}, which the per-head "
                                  "(DenseGeneral) layouts do not convert yet")
        if h is not None and heads is not None and h != heads[0]:
            raise TensorError(key, f"stores {h} heads, but {heads[1]} stores {heads[0]}")
        heads = heads or ((h, key) if h is not None else None)
        for ckey, array in forward(layout, entry, values, key, np.asarray(stored[key])):
            if ckey in canonical:
                raise LayoutError(layout.name, f"{origin[ckey]!r} and {key!r} both give {ckey!r}")
            canonical[ckey], origin[ckey] = array, key

    for ckey, array in canonical.items():
        if not _is_float(array):
            raise TensorError(origin[ckey], f"has dtype {array.dtype}; parameters must be floating point (a buffer "
                              "that is not a parameter can be listed in the layout's drop = [...])")
    if dtype is not None:
        canonical = {k: cast(v, dtype, origin[k]) for k, v in canonical.items()}
    else:
        counts = Counter(v.dtype.name for v in canonical.values())
        if len(counts) > 1:
            common = counts.most_common(1)[0][0]
            odd = next(k for k, v in canonical.items() if v.dtype.name != common)
            raise TensorError(origin[odd], f"has dtype {canonical[odd].dtype} while the other tensors are {common}; a "
                              f"model holds one dtype: pass dtype='{common}' (--dtype {common}) to cast")

    overrides = dict(plan.overrides)
    _padding(layout, canonical, overrides, decisions)
    position, rows = recognise_positions(layout, canonical, origin, overrides, decisions)
    config = build_config(layout, canonical, origin, check.layers, overrides, position, rows, notes, heads)
    defaulted = defaulted_switches(layout, overrides, config, rows is not None)
    if defaulted:
        decisions.extend(defaulted)
        summary = ", ".join(line.split(" ", 1)[0] for line in defaulted)
        config = config.replace(notes={**config.notes, "layout_defaults": summary})

    expected = param_shapes(config)
    for ckey in canonical:
        if ckey not in expected:
            raise TensorError(origin[ckey], f"gives {ckey}, which a config with {config.summary()} does not have")
    for ckey, shape in expected.items():
        if ckey not in canonical:
            raise LayoutError(layout.name, f"no key gives {ckey}, which the config needs")
        array = canonical[ckey]
        if array.shape != shape:
            raise TensorError(origin[ckey], f"has shape {np.shape(stored[origin[ckey]])} ({ckey} {array.shape} after the "
                              f"layout's transforms); the config (D={config.d_model}, F={config.d_ff}, V={config.src_vocab_size}/"
                              f"{config.tgt_vocab_size}, max_len={config.max_len}) needs {shape}")
        nonfinite = array.size - int(np.count_nonzero(np.isfinite(array.astype(np.float64))))
        if nonfinite:
            raise TensorError(origin[ckey], f"has {nonfinite} NaN or infinite value(s); such a model only produces NaN")
    # Copies, C-ordered: the caller's tensors are never shared, so nothing done to the result
    # (or to the source model afterwards) reaches the other.
    params = {ckey: np.array(canonical[ckey], copy=True, order="C") for ckey in expected}
    return Conversion(config, params, layout, plan.detected, decisions)

# -- Export ------------------------------------------------------------------------------------


def check_exportable(config: ModelConfig, layout: Layout, target: Mapping[str, Any], *, advice: bool = True) -> None:
    """Refuse an export whose config the target system would compute differently.

    Every switch the system computes with (`system_switches`: ModelConfig's defaults, which an
    import of its keys assumes, then its preset and `[switches]`, plus `target` for a copy of the
    system that was changed) must equal the config's; all that differ are named at once, with the
    keys the system loads that the export would lack (a shared or tied embedding, a missing bias).
    `free` switches are the user's to set in the target system. A system that computes with the position table it loads can hold any
    position term; one that rebuilds its table on load (`recomputed`, Marian) only its own.
    `advice=False` leaves out how to say that a changed copy of the system matches (`--set`,
    `position=...`): for a caller whose target takes no such word (CTranslate2's loaders).
    """
    check_overrides(target)
    # A transformers family reads some switches from its config.json, which an export of a folder
    # writes (and checks: hf_config.HFTable.write): like free ones, they are the user's.
    carried = {name for spec in layout.hf.fields for name in spec.to} if layout.hf else set()
    for rule in layout.infer:
        key, present, absent = rule.key, rule.present, rule.absent
        # A structure the system can have: the switches of one side of each rule, all together.
        # A free switch in a rule is only the import's default for that structure (AlgoPerf's
        # GLU with tanh): the system takes any value of it from its user; so is one that the
        # system's config.json carries (T5's scale_decoder_outputs beside its lm_head).
        sides = [side for side in (present, absent)
                 if all(getattr(config, k) == v for k, v in side.items() if k not in layout.free | carried)]
        if not sides:
            wrong = next(k for k, v in present.items() if getattr(config, k) != v)
            raise ConfigError(wrong, f"the {layout.name} system has {', '.join(f'{k}={v!r}' for k, v in present.items())} "
                              f"(with {key}) or {', '.join(f'{k}={v!r}' for k, v in absent.items())} (without it); this "
                              f"config's {', '.join(f'{k}={getattr(config, k)!r}' for k in present)} is neither")
    expected = system_switches(layout, target)
    # The system's own config, where it is one: a switch that acts in neither (T5's relative
    # buckets under a sinusoid) cannot make the logits differ, and is never named.
    try:
        system = config.replace(**{k: v for k, v in expected.items() if k != "position"})
    except ConfigError:
        system = None
    wrong = []
    for name in sorted(SWITCH_FIELDS):
        if name in layout.free or name in layout.inferred_names() or name in carried or name in TRAINING_ONLY:
            continue
        if computes_alike(config, name, expected[name]) and (
                system is None or computes_alike(system, name, getattr(config, name))):
            continue
        if name == "position" and layout.computes_with_stored_positions():
            continue
        if name == "position" and layout.stores_positions() and config.position != expected[name]:
            raise ConfigError(name, f"the {layout.name} system recomputes its position tables as position="
                              f"{expected[name]!r} when it loads a model, so this config's position={config.position!r} "
                              "would be replaced after a save and load, giving other logits" + (
                                  " (if your copy of that system was changed to keep its table, pass position=... to "
                                  "the export)" if advice else ""))
        if getattr(config, name) != expected[name]:
            wrong.append(name)
    if wrong:
        # Every one at once: a user fixing them one run at a time takes as many runs as there are.
        keys = _keys_lost(config, layout, expected)
        raise ConfigError(wrong[0], f"the {layout.name} system computes "
                          f"{', '.join(f'{n}={expected[n]!r}' for n in wrong)} but this config has "
                          f"{', '.join(f'{n}={getattr(config, n)!r}' for n in wrong)}, so exported weights "
                          "would give other logits there"
                          + (f" (and the file would lack {listing(keys)}, which that system loads)" if keys else "")
                          + ("; if your copy of that system was changed to match, say so: "
                             f"{' '.join(f'--set {n}={setting(getattr(config, n))}' for n in wrong)} "
                             f"(the same keywords to export_state_dict in Python)" if advice else ""))

def system_switches(layout: Layout, target: Mapping[str, Any]) -> dict[str, Any]:
    """Every switch the system computes with: ModelConfig's defaults (what an import of its keys
    assumes), its preset and `[switches]`, then `target` (a changed copy of the system)."""
    defaults = {name: getattr(ModelConfig(), name) for name in SWITCH_FIELDS}
    return {**defaults, **layout.base_switches(), **target}


def _keys_lost(config: ModelConfig, layout: Layout, expected: Mapping[str, Any]) -> list[str]:
    """The system's keys that an export of `config` would not write (a structure it lacks)."""
    structure = config.replace(**{k: v for k, v in expected.items() if k != "position"})
    try:
        system = plan_keys(layout, param_shapes(structure), structure.to_dict())
        ours = plan_keys(layout, param_shapes(config), config.to_dict())
    except (ConfigError, LayoutError, ValueError):
        return []
    return sorted(set(system) - set(ours))


def export_state_dict(config: ModelConfig, params: Mapping[str, Any], layout: Layout | str, **target: Any) -> dict[str, np.ndarray]:
    """Canonical `(config, params)` -> a state dict in `layout`'s key space, as NumPy arrays.

    The exact inverse of the import: importing the result gives back `config` and `params` bit
    for bit. Tied duplicates are written as copies so that `load_state_dict(strict=True)` works;
    keys the layout drops are not written. A `nested` layout (Flax) is returned as its nested tree
    of dicts, ready for `Module.apply({"params": tree}, ...)`. A position table the system stores is written even
    when the config computes a sinusoid (as `conformance.core.positions.position_table`, in the
    parameters' dtype), since the system reads its buffer. `target` names switches of a changed
    copy of the system (see `check_exportable`).
    """
    layout = load_layout(layout)
    arrays = {name: np.asarray(value) for name, value in params.items()}
    check_numpy_params(config, arrays)
    check_exportable(config, layout, target)
    canonical = dict(arrays)
    if layout.stores_positions() and config.position != "table":
        dtype = next(iter(arrays.values())).dtype
        # (length + position_offset, D): the encoder's length is a features source's source_len
        canonical.update({name: position_table(config, length).astype(dtype)
                          for name, length in zip(TABLES, (config.source_len, config.max_len))})
    plan = plan_keys(layout, canonical, config.to_dict())
    out = {fkey: backward(layout, entry, fkey, [canonical[c] for c in ckeys], ckeys, config.n_heads)
           for fkey, (entry, _, ckeys) in plan.items()}
    for alias, (stored, _) in alias_keys(layout, list(out), config.to_dict()).items():
        out[alias] = out[stored].copy()
    if layout.nested:
        return unflatten(out)
    return out


# A Flax system's tree from its dotted keys (written once, in the core, for impl_jax too).
unflatten = nest_dotted
