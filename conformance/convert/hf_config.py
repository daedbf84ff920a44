"""A layout's `[hf]` table: what a Hugging Face family's config.json says, as data beside its keys.

A transformers model folder (and a live model's `model.config`) carries the switches its state
dict cannot tell: sizes, the activation, the embedding scale, the padding id. Each family's
layout (`hf-marian.toml`, `hf-bart.toml`, ...) says where, in one table, and this module reads
and writes every family by that table alone:

    [hf]
    model_types = ["bart"]                          # config.json's model_type (picks the layout)
    architectures = ["BartForConditionalGeneration"]  # the class an export names; from_hf accepts
    generation = ["decoder_start_token_id", ...]    # generation_config.json fields kept in notes
    special_ids = ["eos_token_id", ...]             # ... that the config class has too
    [hf.generation_defaults]                        # an export's generation fields when the
    decoder_start_token_id = "pad_id"               # checkpoint records none (ModelConfig names)
    [hf.fields]                                     # config.json field -> ModelConfig field(s)
    vocab_size = { to = ["src_vocab_size", "tgt_vocab_size"], default = 50265 }
    pad_token_id = [{ to = "pad_id", default = 1 }, { to = "position_offset", default = 1, add = 1 }]
    decoder_vocab_size = { to = "tgt_vocab_size" }  # no default: null or absent says nothing
    [hf.unsupported]                                # fields whose other values cannot convert
    tie_word_embeddings = { value = true, field = "tie_output", why = "..." }
    normalize_before = { value = false, field = "norm_placement", legacy = true, why = "..." }

`default` is the config class's own (what transformers assumes when the file leaves a field
out); two fields that give one ModelConfig field must agree; `add` shifts an integer on the way
in (and back on the way out). Activation names are transformers' (`ACT2FN` keys), translated by
`HF_ACTIVATIONS` both ways. A `legacy` field is one transformers 3 read and today's config class
ignores: it is checked when present, never written.

Framework-free: JSON values in, ModelConfig field values out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError
from conformance.convert.errors import KIND_WORDS, LayoutError

# Hugging Face activation names (ACT2FN) -> ModelConfig names. "swish" is SiLU; the tanh GELUs
# ("gelu_new", "gelu_pytorch_tanh", "gelu_fast") all compute 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))).
# An export writes the first name of each (the config classes' own spelling).
HF_ACTIVATIONS = {
    "relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu",
    "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu_fast": "gelu-tanh", "tanh": "tanh",
}
# transformers' spelling of a ModelConfig field's values, where it has its own.
HF_NAMES = {"activation": HF_ACTIVATIONS}

_FIELD_TYPES = {f.name: f.type for f in fields(ModelConfig) if f.name != "notes"}
_TABLE_KEYS = {"model_types", "architectures", "generation", "special_ids", "generation_defaults", "fields", "unsupported"}
_SPEC_KEYS = {"to", "default", "add"}
_UNSUPPORTED_KEYS = {"value", "field", "why", "legacy"}


@dataclass(frozen=True)
class FieldSpec:
    """One config.json field and the ModelConfig field(s) it gives (`to`). `default` is the
    config class's; `has_default=False` means null or absent says nothing (Marian's
    decoder_vocab_size). `add` shifts an integer on the way in."""

    hf: str
    to: tuple[str, ...]
    default: Any = None
    has_default: bool = True
    add: int = 0


@dataclass(frozen=True)
class Unsupported:
    """A config.json field that must have `value`, else the layout cannot describe the model."""

    hf: str
    value: Any
    field: str
    why: str
    legacy: bool = False


@dataclass(frozen=True)
class HFTable:
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    generation: tuple[str, ...]
    special_ids: tuple[str, ...]
    fields: tuple[FieldSpec, ...]
    unsupported: tuple[Unsupported, ...] = ()
    generation_defaults: Mapping[str, str] = field(default_factory=dict)

    # -- config.json -> ModelConfig fields -----------------------------------------------------

    def read(self, hf: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The ModelConfig fields `hf` (a parsed config.json, or `model.config.to_dict()`) gives.

        Raises ConfigError naming the field: an unsupported value, a value of the wrong type, an
        activation without a ModelConfig name, or two config fields that disagree."""
        for rule in self.unsupported:
            if rule.hf in hf and hf[rule.hf] != rule.value:
                raise ConfigError(rule.field, f"{where} has {rule.hf}={hf[rule.hf]!r}: {rule.why}")
        values: dict[str, Any] = {}
        origin: dict[str, tuple[str, Any]] = {}
        for spec in self.fields:
            raw = hf[spec.hf] if spec.hf in hf else spec.default
            if raw is None and not spec.has_default:
                continue
            for target in spec.to:
                value = _to_ours(spec, target, raw, where)
                if target in values and values[target] != value:
                    (a, va) = origin[target]
                    raise ConfigError(target, f"{where}: {a}={va!r} and {spec.hf}={raw!r} both give {target}, which "
                                      f"ModelConfig holds once")
                values[target], origin[target] = value, (spec.hf, raw)
        return values

    # -- ModelConfig -> config.json ------------------------------------------------------------

    def write(self, config: ModelConfig, where: str) -> dict[str, Any]:
        """config.json for `config` (without the special ids: see `special`). Reading it back
        must give the config's own values, or the family would compute something else from it
        (M2M100 derives position_offset from pad_token_id): a ConfigError names the field."""
        out: dict[str, Any] = {"architectures": [self.architectures[0]], "model_type": self.model_types[0]}
        for spec in self.fields:
            if spec.hf not in out:
                out[spec.hf] = _to_theirs(spec, spec.to[0], getattr(config, spec.to[0]))
        for rule in self.unsupported:
            if not rule.legacy:
                out[rule.hf] = rule.value
        back = self.read(out, where)
        for name, value in back.items():
            if getattr(config, name) != value:
                given = ", ".join(f"{s.hf}={out[s.hf]!r}" for s in self.fields if name in s.to)
                raise ConfigError(name, f"{where} derives {name}={value!r} from {given}, but this config has "
                                  f"{name}={getattr(config, name)!r}: that system cannot express it")
        return out

    def generation_of(self, sources: list[Mapping[str, Any]]) -> dict[str, Any]:
        """The generation fields found first in `sources` (generation_config.json, then config.json)."""
        found: dict[str, Any] = {}
        for data in sources:
            for key in self.generation:
                if key in data and data[key] is not None and key not in found:
                    found[key] = data[key]
        return found


def _to_ours(spec: FieldSpec, target: str, raw: Any, where: str) -> Any:
    if target in HF_NAMES:
        names = HF_NAMES[target]
        if not isinstance(raw, str) or raw not in names:
            raise ConfigError(target, f"{where}: {spec.hf} {raw!r} has no ModelConfig name; known: {sorted(names)}")
        return names[raw]
    kind = _FIELD_TYPES[target]
    ok = {"int": isinstance(raw, int) and not isinstance(raw, bool), "bool": isinstance(raw, bool),
          "float": isinstance(raw, (int, float)) and not isinstance(raw, bool), "str": isinstance(raw, str)}[kind]
    if not ok:
        raise ConfigError(target, f"{where}: {spec.hf} must be {KIND_WORDS[kind]}, got {raw!r}")
    return raw + spec.add if spec.add else raw


def _to_theirs(spec: FieldSpec, target: str, value: Any) -> Any:
    if target in HF_NAMES:
        return next(hf for hf, ours in HF_NAMES[target].items() if ours == value)
    return value - spec.add if spec.add else value


# -- Parsing -------------------------------------------------------------------------------------


def parse_hf_table(table: Any, where: str) -> HFTable:
    """Validate a layout's raw `[hf]` table; `LayoutError` names the first problem."""
    where = f"{where} [hf]"
    if not isinstance(table, dict):
        raise LayoutError(where, "must be a table")
    unknown = sorted(set(table) - _TABLE_KEYS)
    if unknown:
        raise LayoutError(where, f"unknown key(s) {unknown}; expected some of {sorted(_TABLE_KEYS)}")
    lists = {}
    for key in ("model_types", "architectures", "generation", "special_ids"):
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise LayoutError(where, f"{key} must be a list of names")
        lists[key] = tuple(value)
    for key in ("model_types", "architectures"):
        if not lists[key]:
            raise LayoutError(where, f"{key} must name at least one")
    stray = sorted(set(lists["special_ids"]) - set(lists["generation"]))
    if stray:
        raise LayoutError(where, f"special_ids {stray} are not listed in generation")
    defaults = table.get("generation_defaults", {})
    if not isinstance(defaults, dict) or not all(v in _FIELD_TYPES for v in defaults.values()):
        raise LayoutError(where, "[hf.generation_defaults] maps a generation field to a ModelConfig field name")
    specs = []
    raw_fields = table.get("fields")
    if not isinstance(raw_fields, dict) or not raw_fields:
        raise LayoutError(where, "[hf.fields] must be a table of config.json field = { to = ..., default = ... }")
    for name, given in raw_fields.items():
        for spec in given if isinstance(given, list) else [given]:
            specs.append(_field_spec(name, spec, where))
    rules = []
    for name, rule in table.get("unsupported", {}).items():
        if not isinstance(rule, dict) or set(rule) - _UNSUPPORTED_KEYS or "value" not in rule \
                or not isinstance(rule.get("why"), str) or not isinstance(rule.get("legacy", False), bool):
            raise LayoutError(where, f"[hf.unsupported] {name} = {{ value = ..., why = \"...\" }} (field, legacy optional); "
                              f"got {rule!r}")
        blamed = rule.get("field", name)
        if not isinstance(blamed, str) or not blamed:
            raise LayoutError(where, f"[hf.unsupported] {name}: field must name the ModelConfig field it concerns")
        rules.append(Unsupported(name, rule["value"], blamed, rule["why"], rule.get("legacy", False)))
    return HFTable(lists["model_types"], lists["architectures"], lists["generation"], lists["special_ids"],
                   tuple(specs), tuple(rules), dict(defaults))


def _field_spec(name: str, spec: Any, where: str) -> FieldSpec:
    where = f"{where} fields {name!r}"
    if not isinstance(spec, dict) or set(spec) - _SPEC_KEYS or "to" not in spec:
        raise LayoutError(where, f"must be {{ to = \"ModelConfig field\" (or a list), default = ..., add = N }}; got {spec!r}")
    to = spec["to"] if isinstance(spec["to"], list) else [spec["to"]]
    bad = [t for t in to if t not in _FIELD_TYPES]
    if not to or bad:
        raise LayoutError(where, f"to names {bad or to}, which are not ModelConfig fields")
    add = spec.get("add", 0)
    if isinstance(add, bool) or not isinstance(add, int) or (add and any(_FIELD_TYPES[t] != "int" for t in to)):
        raise LayoutError(where, f"add must be an integer, for integer fields only; got {add!r}")
    result = FieldSpec(name, tuple(to), spec.get("default"), "default" in spec, add)
    if result.has_default:
        for target in to:
            try:
                _to_ours(result, target, result.default, where)
            except ConfigError as exc:
                raise LayoutError(where, f"default: {exc.problem}") from None
    return result
