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
    [hf.call]                                       # how its forward takes a batch: keyword =
    input_ids = "src_ids"                           # what it is given (CALL_VALUES)
    attention_mask = "src_mask"
    decoder_input_ids = "tgt_ids"

    feed_forward_proj = [                           # one field, two switches, by a table of
        { to = "activation", default = "relu", values = { relu = "relu", "gated-gelu" = "gelu-tanh" } },
        { to = "ffn_glu", default = "relu", values = { relu = false, "gated-gelu" = true } },
    ]
    scale_decoder_outputs = { to = "scale_logits", wins = true }   # decides when present

`default` is the config class's own (what transformers assumes when the file leaves a field
out); two fields that give one ModelConfig field must agree, unless one `wins`: a field that,
when the file has it, decides its ModelConfig fields whatever the others say (a value
transformers derives from another field and saves beside it, which then overrides it: T5's
`scale_decoder_outputs`, `dense_act_fn`). `add` shifts an integer on the way in (and back on the
way out); `values` spells out the field's values and what each gives (an export writes the first
value listed that gives the config's own, jointly for every line of the same field). Activation
names are transformers' (`ACT2FN` keys), translated by `HF_ACTIVATIONS` both ways. A `legacy` field is one transformers 3 read and today's config class
ignores: it is checked when present, never written.

`[hf.call]` is how the family's forward is called on a batch, by transformers' keyword names:
`conformance.compare` calls a live model so when no `run=` is given (with the padding mask its
tokenizer would return), and a one-graph ONNX export's inputs are found by the same names.

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
_TABLE_KEYS = {"model_types", "architectures", "generation", "special_ids", "generation_defaults", "fields", "unsupported",
               "call"}
# What a [hf.call] keyword is given: the batch's ids, or the padding mask they imply (1 where the
# id is not pad_id, 0 at padding: the attention_mask a transformers tokenizer returns).
CALL_VALUES = {"src_ids": "the source ids", "tgt_ids": "the decoder's input ids",
               "src_mask": "1 where a source id is not pad_id, 0 at padding",
               "tgt_mask": "1 where a decoder input id is not pad_id, 0 at padding"}
_SPEC_KEYS = {"to", "default", "add", "values", "wins"}
_UNSUPPORTED_KEYS = {"value", "field", "why", "legacy"}


@dataclass(frozen=True)
class FieldSpec:
    """One config.json field and the ModelConfig field(s) it gives (`to`). `default` is the
    config class's; `has_default=False` means null or absent says nothing (Marian's
    decoder_vocab_size). `add` shifts an integer on the way in; `values` maps each of the
    field's values to the ModelConfig value; `wins`: see the module docstring."""

    hf: str
    to: tuple[str, ...]
    default: Any = None
    has_default: bool = True
    add: int = 0
    # The field's values and what each gives (the field's own spelling -> the ModelConfig value),
    # instead of the value itself or HF_NAMES.
    values: Mapping[str, Any] | None = None
    # When the file has this field, it decides its ModelConfig fields over every other field's.
    wins: bool = False


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
    # keyword of the family's forward -> what it is given (CALL_VALUES); empty: not said.
    call: Mapping[str, str] = field(default_factory=dict)

    def call_arguments(self, src_ids: Any, tgt_ids: Any, pad_id: int) -> dict[str, Any]:
        """The keyword arguments of the family's forward for a batch (`[hf.call]`), in the ids'
        own kind of array (NumPy, torch, JAX): a mask is `(ids != pad_id) * 1`, integers as the
        tokenizer's attention_mask."""
        given = {"src_ids": lambda: src_ids, "tgt_ids": lambda: tgt_ids,
                 "src_mask": lambda: (src_ids != pad_id) * 1, "tgt_mask": lambda: (tgt_ids != pad_id) * 1}
        return {keyword: what if isinstance(what, bool) else given[what]() for keyword, what in self.call.items()}

    def describe_call(self, pad_id: int) -> str:
        """`model(input_ids=src_ids, attention_mask=(src_ids != 1), ...)`: the call, in words."""
        spelled = {"src_ids": "src_ids", "tgt_ids": "tgt_ids", "src_mask": f"(src_ids != {pad_id})",
                   "tgt_mask": f"(tgt_ids != {pad_id})"}
        return "model(" + ", ".join(f"{k}={v if isinstance(v, bool) else spelled[v]}" for k, v in self.call.items()) + ")"

    # -- config.json -> ModelConfig fields -----------------------------------------------------

    def read(self, hf: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The ModelConfig fields `hf` (a parsed config.json, or `model.config.to_dict()`) gives.

        Raises ConfigError naming the field: an unsupported value, a value of the wrong type, an
        activation without a ModelConfig name, or two config fields that disagree."""
        return read_fields(self.fields, self.unsupported, hf, where)

    # -- ModelConfig -> config.json ------------------------------------------------------------

    def write(self, config: ModelConfig, where: str) -> dict[str, Any]:
        """config.json for `config` (without the special ids: see `special`). Reading it back
        must give the config's own values, or the family would compute something else from it
        (M2M100 derives position_offset from pad_token_id): a ConfigError names the field."""
        out: dict[str, Any] = {"architectures": [self.architectures[0]], "model_type": self.model_types[0]}
        for spec in self.fields:
            if spec.hf not in out:
                out[spec.hf] = self._written(spec, config, where)
        for rule in self.unsupported:
            if not rule.legacy:
                out[rule.hf] = rule.value
        back = self.read(out, where)
        for name, value in back.items():
            if _value_of(config, name) != value:
                given = ", ".join(f"{s.hf}={out[s.hf]!r}" for s in self.fields if name in s.to)
                raise ConfigError(name, f"{where} derives {name}={value!r} from {given}, but this config has "
                                  f"{name}={getattr(config, name)!r}: that system cannot express it")
        return out

    def _written(self, spec: FieldSpec, config: ModelConfig, where: str) -> Any:
        """The value of `spec.hf` that gives the config's own values, for every line of that field."""
        lines = [s for s in self.fields if s.hf == spec.hf]
        listed = next((s.values for s in lines if s.values is not None), None)
        if listed is None:
            return _to_theirs(spec, spec.to[0], _value_of(config, spec.to[0]))
        for candidate in listed:
            try:
                if all(_to_ours(s, s.to[0], candidate, where) == _value_of(config, s.to[0]) for s in lines):
                    return candidate
            except ConfigError:
                continue
        wanted = ", ".join(f"{s.to[0]}={_value_of(config, s.to[0])!r}" for s in lines)
        raise ConfigError(lines[0].to[0], f"{where} has no {spec.hf} for {wanted} (its values: {', '.join(listed)})")

    def generation_of(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The generation fields `data` (a generation_config.json, or a config.json) sets."""
        return {key: data[key] for key in self.generation if data.get(key) is not None}


def read_fields(fields: tuple[FieldSpec, ...], unsupported: tuple[Unsupported, ...], hf: Mapping[str, Any],
                where: str) -> dict[str, Any]:
    """The ModelConfig fields a system's own settings give (`hf`: a parsed config.json, a live
    model's config, or a training checkpoint's options), by `fields`, refusing what `unsupported`
    names; see `HFTable.read`."""
    for rule in unsupported:
        if rule.hf in hf and hf[rule.hf] != rule.value:
            raise ConfigError(rule.field, f"{where} has {rule.hf}={hf[rule.hf]!r}: {rule.why}")
    values: dict[str, Any] = {}
    origin: dict[str, tuple[str, Any]] = {}
    decided = {target for spec in fields if spec.wins and hf.get(spec.hf) is not None for target in spec.to}
    for spec in fields:
        raw = hf[spec.hf] if spec.hf in hf else spec.default
        if raw is None and not spec.has_default:
            continue
        for target in spec.to:
            if target in decided and not (spec.wins and hf.get(spec.hf) is not None):
                continue  # a winning field that the file has says it
            value = _to_ours(spec, target, raw, where)
            if target in values and values[target] != value:
                (a, va) = origin[target]
                raise ConfigError(target, f"{where}: {a}={va!r} and {spec.hf}={raw!r} both give {target}, which "
                                  f"ModelConfig holds once")
            values[target], origin[target] = value, (spec.hf, raw)
    return values


def _value_of(config: ModelConfig, name: str) -> Any:
    """A ModelConfig field as a config.json states it: d_head 0 is ModelConfig's way of saying
    d_model / n_heads, and a config.json says the size itself (T5's d_kv); max_source_len 0 says
    max_len, and a config.json the encoder's length itself (Whisper's max_source_positions)."""
    if name == "d_head":
        return config.head_dim
    return config.source_len if name == "max_source_len" else getattr(config, name)


def _to_ours(spec: FieldSpec, target: str, raw: Any, where: str) -> Any:
    if spec.values is not None:
        if not isinstance(raw, str) or raw not in spec.values:
            raise ConfigError(target, f"{where}: {spec.hf} {raw!r} has no ModelConfig meaning; known: {sorted(spec.values)}")
        return spec.values[raw]
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
    if spec.values is not None:
        return next(hf for hf, ours in spec.values.items() if ours == value)
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
    rules = parse_unsupported(table.get("unsupported", {}), where, "[hf.unsupported]")
    call = table.get("call", {})
    if not isinstance(call, dict) or not all(isinstance(k, str) and (isinstance(v, bool) or v in CALL_VALUES)
                                             for k, v in call.items()):
        raise LayoutError(where, f"[hf.call] maps a keyword of the model's forward to one of {sorted(CALL_VALUES)}, "
                          f"or to true or false (passed as it is); got {call!r}")
    return HFTable(lists["model_types"], lists["architectures"], lists["generation"], lists["special_ids"],
                   tuple(specs), rules, dict(defaults), dict(call))


def parse_unsupported(table: Any, where: str, title: str) -> tuple[Unsupported, ...]:
    """A `[... .unsupported]` table: field = { value = ..., why = "...", field = ..., legacy = ... }."""
    if not isinstance(table, dict):
        raise LayoutError(where, f"{title} must be a table")
    rules = []
    for name, rule in table.items():
        if not isinstance(rule, dict) or set(rule) - _UNSUPPORTED_KEYS or "value" not in rule \
                or not isinstance(rule.get("why"), str) or not isinstance(rule.get("legacy", False), bool):
            raise LayoutError(where, f"{title} {name} = {{ value = ..., why = \"...\" }} (field, legacy optional); "
                              f"got {rule!r}")
        blamed = rule.get("field", name)
        if not isinstance(blamed, str) or not blamed:
            raise LayoutError(where, f"{title} {name}: field must name the ModelConfig field it concerns")
        rules.append(Unsupported(name, rule["value"], blamed, rule["why"], rule.get("legacy", False)))
    return tuple(rules)


def parse_fields(table: Any, where: str, title: str) -> tuple[FieldSpec, ...]:
    """A `[... .fields]` table: field = { to = ..., default = ..., ... } (or a list of them)."""
    if not isinstance(table, dict) or not table:
        raise LayoutError(where, f"{title} must be a table of field = {{ to = ..., default = ... }}")
    return tuple(_field_spec(name, spec, where) for name, given in table.items()
                 for spec in (given if isinstance(given, list) else [given]))


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
    wins = spec.get("wins", False)
    if not isinstance(wins, bool):
        raise LayoutError(where, f"wins must be true or false; got {wins!r}")
    values = spec.get("values")
    if values is not None:
        if not isinstance(values, dict) or not values or len(to) != 1 or add:
            raise LayoutError(where, "values must be a table of the field's values = what each gives, for one ModelConfig "
                              "field (one `to`, no add)")
        for word, value in values.items():
            _check_ours(to[0], value, f"{where} values {word!r}")
    result = FieldSpec(name, tuple(to), spec.get("default"), "default" in spec, add, values, wins)
    if result.has_default:
        for target in to:
            try:
                _to_ours(result, target, result.default, where)
            except ConfigError as exc:
                raise LayoutError(where, f"default: {exc.problem}") from None
    return result


def _check_ours(target: str, value: Any, where: str) -> None:
    """A `values` entry must be a ModelConfig value of `target` (a known name where it has names)."""
    if target in HF_NAMES:
        if value not in set(HF_NAMES[target].values()):
            raise LayoutError(where, f"{value!r} is not a ModelConfig {target}; known: {sorted(set(HF_NAMES[target].values()))}")
        return
    kind = _FIELD_TYPES[target]
    ok = {"int": isinstance(value, int) and not isinstance(value, bool), "bool": isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool), "str": isinstance(value, str)}[kind]
    if not ok:
        raise LayoutError(where, f"{target} must be {KIND_WORDS[kind]}, got {value!r}")
