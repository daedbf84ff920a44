"""What an adapter declares beyond its switches (`conformance.check.targets.adapter`, docs/own-backend.md):
the parameters its model never trains, the searches its own `generate` runs, the differences its
user acknowledges; and `canonical_gradients`, the way back from a system's own gradient keys to
rosetta's canonical names.

    build.frozen = ("final_logits_bias",)
    build.searches = ("greedy", "beam")
    build.known_differences = [dict(tensor="*.embeddings", when={"dtype": "float64"},
                                    condition="float64 models", reason="its position table is float32")]
    build.known_differences = "known_differences.toml"      (a file beside the adapter's module)

Each is checked when the adapter is loaded: a name, a search or a condition no run can meet is
refused in one line (AdapterError), as a held switch no config can have is.

May import: the core, the converters and NumPy.
"""

from __future__ import annotations

import fnmatch
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from conformance.core.config import ModelConfig


class AdapterError(ValueError):
    """An adapter asked for cannot be loaded or does not follow the protocol; says which and why."""


# The searches a `generate` may run (docs/decoding.md): greedy search; beam search with Hugging
# Face's rule and its length penalty; the same with GNMT's penalty (length_penalty_form "gnmt");
# Flax's beam rule; sampling from rosetta's seeds; openai-whisper's beam rule ("openai"), and with it
# Whisper's decoding on a features source (its forced prompt, timestamp rules and no-speech
# probability): a target that does not declare "openai" gets neither.
SEARCHES = ("greedy", "beam", "beam-gnmt", "flax", "sample", "openai")
# What a known difference's `when` may name besides a ModelConfig switch: the property (`PROPERTIES`
# of the suite's adapter targets, by these short names), the target's dtype, a padding kind of the
# example's rows or the width of its batches (conformance.suite.strategies.ids).
PROPERTY_NAMES = ("forward", "determinism", "generate", "gradients")
CONDITIONS = ("property", "dtype", "src_padding", "tgt_padding", "src_width", "tgt_width")
# ModelConfig fields that are sizes, always drawn: the rest are switches an adapter may hold.
SIZES = frozenset({"src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_encoder_layers",
                   "n_decoder_layers", "max_len", "notes"})


# The small config an adapter's model is built on once, to see what it offers (its vocabularies
# grown to hold a held pad id), and its held values are checked on (with vocabularies of any size).
PROBE = ModelConfig(d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1, src_vocab_size=8,
                    tgt_vocab_size=8, max_len=8)


def refused(switch: str, value: Any) -> str | None:
    """Why `ModelConfig` refuses `value` for `switch` (a value it never accepts, as a typo), or None.
    A refusal that names another field is a value that needs other switches, not a bad one."""
    from conformance.core.errors import ConfigError

    try:
        PROBE.replace(src_vocab_size=2**31 - 1, tgt_vocab_size=2**31 - 1, **{switch: value})
    except ConfigError as exc:
        return None if exc.field != switch else str(exc)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# -- Frozen parameters ----------------------------------------------------------------------------


def canonical_names() -> set[str]:
    """Every canonical parameter name some config has (a small config per structure: a stored
    position table or T5's relative bias, every optional norm, bias and gate)."""
    from conformance.core.params import param_shapes

    full = PROBE.replace(final_encoder_norm=True, final_decoder_norm=True, embedding_norm=True, ffn_glu=True,
                         final_logits_bias=True, output_bias=True, n_encoder_layers=2, n_decoder_layers=2)
    configs = [full.replace(position="table"), full.replace(position="relative"), full.replace(tie_output=False)]
    return set().union(*(param_shapes(config) for config in configs))


def frozen_patterns(name: str, frozen) -> tuple[str, ...]:
    """The adapter's frozen parameters: canonical names or fnmatch patterns (`*.position.table`),
    each of which names a parameter of some config (a typo would skip nothing and say so here)."""
    patterns = (frozen,) if isinstance(frozen, str) else tuple(frozen)
    names = canonical_names()
    for pattern in patterns:
        if not isinstance(pattern, str) or not fnmatch.filter(names, pattern):
            raise AdapterError(f"{name}: frozen names {pattern!r}, which is no canonical parameter of any config "
                                 f"(conformance.core.params; e.g. final_logits_bias, encoder.position.table)")
    return patterns


# -- Searches -------------------------------------------------------------------------------------


def searches(name: str, declared) -> tuple[str, ...]:
    """The searches the adapter's `generate` runs, in `adapter.SEARCHES`'s order; at least one."""
    declared = (declared,) if isinstance(declared, str) else tuple(declared)
    unknown = [s for s in declared if s not in SEARCHES]
    if unknown or not declared:
        raise AdapterError(f"{name}: searches {list(declared)} must be some of {list(SEARCHES)} (docs/decoding.md)")
    return tuple(s for s in SEARCHES if s in declared)


# -- Known differences -----------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownDifference:
    """A difference the adapter's user knows of and accepts: where it shows first (`tensor`: fnmatch
    patterns of the tensor compared, a forward tensor such as `encoder.0.self`, `loss` or a
    parameter's gradient, or `ids` for generate), on which examples (`when`: conditions that must
    all hold, each a value or a list of values, `adapter.CONDITIONS` or a ModelConfig switch), what
    that is in words (`condition`) and why (`reason`). An example whose first difference it matches
    is reported apart, with its shrunk example, and the property goes on looking for others."""

    tensor: tuple[str, ...]
    reason: str
    condition: str = ""
    when: Mapping[str, tuple] = field(default_factory=dict)

    def matches(self, tensor: str, facts: Mapping[str, set]) -> bool:
        """Whether a first difference at `tensor`, on an example with these `facts` (name -> the
        values it has: its property, dtype, switches, padding kinds), is this one."""
        return (any(fnmatch.fnmatchcase(tensor, pattern) for pattern in self.tensor)
                and all(facts.get(key, set()) & set(values) for key, values in self.when.items()))

    def describe(self) -> str:
        when = ", ".join(f"{k}={'|'.join(map(str, v))}" for k, v in self.when.items())
        return (f"{', '.join(self.tensor)}" + (f" when {when}" if when else "")
                + (f" ({self.condition})" if self.condition else "") + f": {self.reason}")


def known_differences(name: str, factory: Callable, declared) -> tuple[KnownDifference, ...]:
    """The adapter's known differences: a list of dicts (or `KnownDifference`s), or the path of a
    TOML file of `[[difference]]` tables, relative to the adapter's own module."""
    if isinstance(declared, (str, Path)):
        declared = _read_file(name, factory, Path(declared))
    out = []
    for i, entry in enumerate(declared):
        if isinstance(entry, KnownDifference):
            out.append(entry)
            continue
        if not isinstance(entry, Mapping):
            raise AdapterError(f"{name}: known difference {i} must be a dict (tensor, when, condition, reason)")
        allowed = {f.name for f in fields(KnownDifference)}
        extra = sorted(set(entry) - allowed)
        if extra or "tensor" not in entry or "reason" not in entry:
            raise AdapterError(f"{name}: known difference {i} takes {sorted(allowed)}, tensor and reason required"
                                 + (f" (not {extra})" if extra else ""))
        tensor = (entry["tensor"],) if isinstance(entry["tensor"], str) else tuple(entry["tensor"])
        when = {key: tuple(v) if isinstance(v, (list, tuple)) else (v,) for key, v in entry.get("when", {}).items()}
        _check_when(name, i, when)
        out.append(KnownDifference(tensor=tensor, reason=str(entry["reason"]), condition=str(entry.get("condition", "")),
                                   when=when))
    return tuple(out)


def _read_file(name: str, factory: Callable, path: Path) -> list:
    if not path.is_absolute():
        module = sys.modules.get(getattr(factory, "__module__", ""), None)
        where = getattr(module, "__file__", None)
        path = (Path(where).parent if where else Path.cwd()) / path
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AdapterError(f"{name}: known differences {path}: {type(exc).__name__}: {exc}") from None
    return data.get("difference", [])


# The padding kinds and batch widths a condition may name: the suite's (conformance.suite.strategies.ids
# PADDING_PATTERNS and WIDTHS; tests/check/test_adapter_declarations.py holds them equal).
PADDING_KINDS = ("none", "trailing", "all-but-one", "leading", "interior", "whole-row")
WIDTHS = ("longest row", "wider")


def _check_when(name: str, i: int, when: Mapping[str, tuple]) -> None:
    """AdapterError for a condition no example can meet: an unknown name or value."""
    from conformance.core.params import PARAM_DTYPE_NAMES

    switches = {f.name for f in fields(ModelConfig)} - SIZES
    choices = {"property": PROPERTY_NAMES, "dtype": PARAM_DTYPE_NAMES, "src_padding": PADDING_KINDS,
               "tgt_padding": PADDING_KINDS, "src_width": WIDTHS, "tgt_width": WIDTHS}
    for key, values in when.items():
        if key not in CONDITIONS and key not in switches:
            raise AdapterError(f"{name}: known difference {i}: when names {key!r}, which is neither one of "
                                 f"{list(CONDITIONS)} nor a ModelConfig switch")
        for value in values:
            bad = (value not in choices[key]) if key in choices else refused(key, value)
            if bad:
                raise AdapterError(f"{name}: known difference {i}: when {key}={value!r} can never hold"
                                     + (f" (one of {list(choices[key])})" if key in choices else f": {bad}"))


# -- Gradients back to canonical names ------------------------------------------------------------


def canonical_gradients(config: ModelConfig, grads: Mapping[str, Any], layout, **target: Any) -> dict[str, np.ndarray]:
    """Gradients under a system's own keys (`grads`: key -> array, as its framework gives them:
    each trained parameter once) under rosetta's canonical names, through the layout's key map
    (`export_state_dict`) read backwards: a probe whose every canonical element holds its own index
    is exported, and each foreign element's gradient is added to the canonical element it came
    from (a shared or tied embedding gets the sum of its uses, a transposed matrix is transposed
    back, a fused q/k/v split). A canonical parameter the system does not train gets zeros."""
    from conformance.convert import export_state_dict
    from conformance.core.params import param_shapes

    shapes = param_shapes(config)
    sizes = [int(np.prod(shape)) for shape in shapes.values()]
    starts = np.cumsum([0, *sizes])
    probe = {name: (start + np.arange(size, dtype=np.float64)).reshape(shape)
             for (name, shape), start, size in zip(shapes.items(), starts, sizes)}
    exported = _flat(export_state_dict(config, probe, layout, **target))
    flat = np.zeros(int(starts[-1]))
    for key, grad in grads.items():
        if key not in exported:
            raise AdapterError(f"canonical_gradients: {key!r} is not a key the {getattr(layout, 'name', layout)} layout "
                                 f"writes for this config")
        index = np.asarray(exported[key], dtype=np.float64)
        grad = np.asarray(grad, dtype=np.float64)
        if index.size != grad.size or not np.array_equal(index, np.round(index)) or index.min() < 0:
            raise AdapterError(f"canonical_gradients: {key!r} ({grad.shape}) holds no canonical parameter of that "
                                 f"shape (a table the system rebuilds has no gradient: leave it out)")
        np.add.at(flat, index.astype(np.int64).reshape(-1), grad.reshape(index.shape).reshape(-1))
    return {name: flat[start:start + size].reshape(shape)
            for (name, shape), start, size in zip(shapes.items(), starts, sizes)}


def _flat(state, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
