"""Layouts: TOML files that describe a foreign key space, read into validated objects.

A layout says, for one system (a tutorial, a library), which switches it implies (a preset from
`conformance.core.presets` plus anything on top), how it stores a `d_in -> d_out` matrix, and for each
foreign key pattern the canonical key(s) it becomes and the transform on the way. The format is
documented for users in `docs/porting.md`; in short:

    preset = "annotated-transformer"
    matrices = "out-in"                  # torch.nn.Linear stores (out_features, in_features)
    detect = false                       # never auto-detected: its keys are another system's
    free = ["pad_id"]                    # switches the system takes from its user
    required = ["pad_id"]                # ... that an import must be told (--set)
    drop = ["*.num_batches_tracked"]     # foreign keys that are not parameters
    [hints]                              # where the system keeps a free or required switch
    pad_id = "the pad passed to Batch(src, tgt, pad)"
    [switches]                           # switches on top of the preset
    [keys]
    "src_embed.0.lut.weight" = "encoder.embedding.weight"
    "encoder.layers.{i}.self_attn.linears.{p:0=q|1=k|2=v|3=o}.{w:weight|bias}" = "encoder.layers.{i}.self_attn.{p}_proj.{w}"
    "src_embed.1.pe" = { to = "encoder.position.table", squeeze = 0 }
    "in_proj_weight" = { split = ["...q_proj.weight", "...k_proj.weight", "...v_proj.weight"] }
    "pos.pe" = { copy = ["encoder.position.table", "decoder.position.table"], squeeze = 0 }
    "lm_head.weight" = { same_as = "model.shared.weight", optional = true }
    "...query.kernel" = { to = "...q_proj.weight", heads = "out" }   # (D, H, K) -> (D, H*K)
    "...out.kernel" = { to = "...o_proj.weight", heads = "in" }      # (H, K, D) -> (H*K, D)
    "lm_head.weight" = [                 # (T5) alternatives, each under its switches (`when`)
        { to = "output.weight", when = { tie_output = false } },
        { same_as = "shared.weight", optional = true, when = { tie_output = true } },
    ]
    [[infer]]                            # switches that the presence of a key decides
    key = "decoder.logitdense.kernel"
    present = { tie_output = false }
    absent = { tie_output = true }
    [[infer]]                            # ... or a key whose tensor differs from another's:
    key = "lm_head.weight"               # a saved copy of a tied weight counts as absent
    differs_from = "shared.weight"
    present = { tie_output = false }
    absent = { tie_output = true }
    [taps]                               # which foreign module computes each canonical tensor
    "encoder.embeddings" = { module = "encoder", input = 0 }        # what the encoder is called with
    "encoder.{i}.self_attn" = "encoder.layers.{i}.sublayer.0"       # a module's output
    "encoder.{i}.self" = { module = "encoder.layers.{i}.self_attn", attribute = "attn" }
    "decoder.embeddings" = { module = "pos_encoder", call = 1 }     # a shared module's second call
    "decoder.{i}.cross" = { module = "...encoder_attn", output = 1 } # an element of a tuple output
    "encoder.{i}.self_attn" = [          # variants computing it in different modules:
        { module = "...norm2", input = 0, when = { norm_placement = "pre" } },   # the first whose
        { module = "...norm1", when = { norm_placement = "post" } },             # switches hold
    ]
    batch_axis = 1                       # the system's tensors are sequence-first
    decoder_input = "shift-right"        # the system embeds shift_right(targets) itself
    [hf]                                 # a transformers family: its config.json as data
    model_types = ["bart"]               # (conformance.convert.hf_config)
    [float32_islands]                    # parts computed in float32 in a float64 model, and the
    T5LayerNorm = { tensors = ["encoder.{i}.self"], why = "..." }   # tensors where they first enter
    [checkpoint]                         # a training checkpoint with its own options (OpenNMT-py's
    tensors = { model = "" }             # .pt): conformance.convert.system_files
    [bundle]                             # a file bundling its config with its weights
    config = "dims"                      # (openai-whisper's; conformance.convert.bundle_table)
    weights = "model_state_dict"

`[taps]` serves `conformance.compare` (docs/porting.md): a tensor the system does not expose is
left out, never guessed. See `Tap` for each field.

A layout may start from another: `extends = "torch-nn-transformer"` (a built-in name, or a .toml
path relative to this file) takes everything from it, and this file's tables and lists replace
what they name: a `[keys]` entry replaces the base's entry for the same canonical key(s) (or the
same foreign pattern), `[switches]` and `[hints]` entries replace the base's one by one, and
`free`, `required`, `drop`, `preset`, `matrices`, `[[infer]]`, `nested`, `detect`, `[hf]`, `[checkpoint]`, `[bundle]` and `[float32_islands]` given here replace the base's whole;
`[taps]` entries (and options) replace the base's one by one.

    extends = "torch-nn-transformer"
    [keys]
    "src_emb.weight" = "encoder.embedding.weight"     # instead of src_tok_emb.embedding.weight

Patterns: `{i}` captures a layer index (any name without a colon captures a number);
`{p:a|b}` captures one of the listed words, `{p:a=x|b=y}` also maps the foreign word `a` to the
canonical word `x`. The canonical side uses the same captures as `{i}`, `{p}`.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from conformance.core.config import ModelConfig
from conformance.convert.errors import KIND_WORDS, LayoutError
from conformance.convert.bundle_table import BundleTable, parse_bundle_table
from conformance.convert.checkpoint_table import parse_checkpoint_table
from conformance.convert.hf_config import HFTable, parse_hf_table
from conformance.convert.patterns import CAPTURE, Capture, Pattern, glob
from conformance.core.params import param_shapes
from conformance.core.presets import PRESETS

LAYOUT_DIR = Path(__file__).parent / "layouts"

# Sizes are read from tensor shapes (or given as overrides); every other field is a switch.
SIZE_FIELDS = frozenset({"src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "max_len",
                         "n_encoder_layers", "n_decoder_layers", "d_head", "n_mels", "max_source_len"})
SWITCH_FIELDS = frozenset(f.name for f in fields(ModelConfig)) - SIZE_FIELDS - {"notes"}
_FIELD_TYPES = {f.name: f.type for f in fields(ModelConfig)}

_TOP_KEYS = {"name", "description", "extends", "preset", "matrices", "free", "required", "drop", "hints", "switches", "keys", "infer",
             "nested", "taps", "hf", "detect", "checkpoint", "bundle", "float32_islands"}
_ENTRY_KEYS = {"to", "split", "copy", "same_as", "axis", "squeeze", "transpose", "optional", "recomputed", "heads", "when"}
# How a system stores a projection per head (Flax DenseGeneral): "out" is (d_in, H, K), merged
# to (d_in, H*K); "in" is (H, K, d_out), merged to (H*K, d_out). Head h owns columns (rows)
# h*K .. (h+1)*K - 1, as in the canonical matrices.
HEAD_AXES = ("out", "in")


# -- Entries and layouts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One line of `[keys]`: a foreign key pattern and what it becomes.

    kind: "rename" (one canonical key), "split" (equal parts along `axis`, e.g. a packed q/k/v),
        "copy" (one stored tensor serves several canonical keys, e.g. one position buffer for
        both stacks) or "alias" (a duplicate of another foreign key, e.g. a tied weight).
    """

    text: str
    kind: str
    source: Pattern
    targets: tuple[Pattern, ...] = ()
    same_as: Pattern | None = None
    axis: int = 0
    squeeze: int | None = None
    transpose: bool | None = None  # None: decided by the layout's `matrices` and the target
    optional: bool = False
    # A position table the system rebuilds itself when a model is loaded (Hugging Face's frozen
    # sinusoids): what it holds after a save and load is the preset's position term, whatever
    # was written.
    recomputed: bool = False
    heads: str | None = None  # see HEAD_AXES
    # Switches the entry applies under (`when = { share_embeddings = true }`): a system that stores
    # one canonical tensor under different names depending on its structure.
    when: Mapping[str, Any] = field(default_factory=dict)

    def applies(self, switches: Mapping[str, Any]) -> bool:
        return all(switches.get(k) == v for k, v in self.when.items())


# -- Taps ---------------------------------------------------------------------------------------

# The canonical tensors a tap may name (conformance.core.output.forward_order, `{i}` for a layer;
# a features source's front end first, each convolution after its GELU, time-major (B, F|S, D)).
TAP_TENSORS = ("encoder.conv1", "encoder.conv2", "encoder.embeddings", "encoder.{i}.self", "encoder.{i}.self_attn", "encoder.{i}.ffn", "encoder.output",
               "decoder.embeddings", "decoder.{i}.self", "decoder.{i}.self_attn", "decoder.{i}.cross",
               "decoder.{i}.cross_attn", "decoder.{i}.ffn", "decoder.output", "logits")
_TAP_FIELDS = {"module", "input", "output", "attribute", "call", "when"}
# Options in [taps] beside the tensors, and their defaults:
#   batch_axis: the axis of the batch in the system's tensors (0 batch-first, 1 sequence-first);
#   decoder_input: "as-given", or "shift-right" for a system that embeds shift_right(targets)
#       itself (a 0 in front, the last dropped): our model is then given the shifted targets, and
#       the decoder's tensors are compared where the target is not padding.
TAP_DEFAULTS = {"batch_axis": 0, "decoder_input": "as-given"}
_TAP_CHOICES = {"batch_axis": (0, 1), "decoder_input": ("as-given", "shift-right")}


@dataclass(frozen=True)
class Tap:
    """One line of `[taps]`: where the foreign model computes one canonical tensor.

    `tensor` is a canonical name (TAP_TENSORS, `{i}` for the layer) and `module` the foreign
    module's dotted path (torch `named_modules()`, a linen module's path), using the same `{i}`.
    What is read there: the module's output (default); `output = k` (or a name) of a tuple (or an
    output object); `input = k` (or a keyword), what the module was called with; `attribute =
    "attn"`, an attribute the module sets during its call. `call = k` picks the k-th call of a
    module that runs more than once in a forward pass (one position module for both stacks).
    `when = { norm_placement = "post" }` makes the tap apply only to a model converted with those
    switches: a tensor may list several taps (a TOML array of tables), and the first that applies
    is read (a system whose variants compute a tensor in different modules: AlgoPerf's pre-LN
    and post-LN). A tensor none of whose taps applies is not exposed.
    """

    tensor: str
    module: str
    input: int | str | None = None
    output: int | str | None = None
    attribute: str | None = None
    call: int | None = None
    when: Mapping[str, Any] = field(default_factory=dict)

    def applies(self, switches: Mapping[str, Any]) -> bool:
        """Whether the tap reads a model converted with these switches (its `when` holds)."""
        return all(switches.get(k) == v for k, v in self.when.items())

    def module_for(self, tensor: str) -> str | None:
        """The foreign module path for a concrete canonical tensor name, or None if not this tap's."""
        match = re.fullmatch(re.escape(self.tensor).replace(r"\{i\}", r"(?P<i>\d+)"), tensor)
        if match is None:
            return None
        return self.module.replace("{i}", match.group("i")) if "i" in match.groupdict() else self.module

    def describe(self) -> str:
        read = (f"input {self.input!r}" if self.input is not None else f"attribute {self.attribute!r}"
                if self.attribute is not None else f"output {self.output!r}" if self.output is not None else "output")
        when = ", ".join(f"{k} = {v!r}" for k, v in self.when.items())
        return (f"{self.module} ({read}{'' if self.call is None else f', call {self.call}'})"
                f"{f' when {when}' if when else ''}")


def _tap(tensor: str, spec: Any, where: str) -> Tap:
    where = f"{where} [taps] {tensor!r}"
    if tensor not in TAP_TENSORS:
        raise _fail(where, f"not a canonical tensor; expected one of {', '.join(TAP_TENSORS)}")
    if isinstance(spec, str):
        spec = {"module": spec}
    if not isinstance(spec, dict):
        raise _fail(where, f"must be a module path or an inline table, got {type(spec).__name__}")
    unknown = sorted(set(spec) - _TAP_FIELDS)
    if unknown:
        raise _fail(where, f"unknown field(s) {unknown}; expected some of {sorted(_TAP_FIELDS)}")
    module = spec.get("module")
    if not isinstance(module, str) or not module:
        raise _fail(where, f"module must be the foreign module's dotted path, got {module!r}")
    if ("{i}" in tensor) != ("{i}" in module) or CAPTURE.sub("", module.replace("{i}", "")) != module.replace("{i}", ""):
        raise _fail(where, f"module {module!r} must use {{i}} exactly when the tensor does (and no other capture)")
    read = [k for k in ("input", "output", "attribute") if k in spec]
    if len(read) > 1:
        raise _fail(where, f"reads one thing: give one of input, output, attribute, not {read}")
    for key in ("input", "output"):
        value = spec.get(key)
        if key in spec and (isinstance(value, bool) or not isinstance(value, (int, str)) or value == ""
                            or (isinstance(value, int) and value < 0)):
            raise _fail(where, f"{key} must be a position (0, 1, ...) or a name, got {value!r}")
    if "attribute" in spec and (not isinstance(spec["attribute"], str) or not spec["attribute"]):
        raise _fail(where, f"attribute must be a name, got {spec['attribute']!r}")
    call = spec.get("call")
    if "call" in spec and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
        raise _fail(where, f"call must be 0, 1, ... (which call of the module), got {call!r}")
    when = spec.get("when", {})
    if not isinstance(when, dict) or not (when or "when" not in spec):
        raise _fail(where, f"when must be a non-empty table of switches, got {when!r}")
    for key, value in when.items():
        if key not in SWITCH_FIELDS:
            raise _fail(where, f"when: {key} is not a ModelConfig switch")
        _check_switch(key, value, where)
    return Tap(tensor, module, spec.get("input"), spec.get("output"), spec.get("attribute"), call, dict(when))


def _taps(table: Any, where: str) -> tuple[tuple[Tap, ...], dict[str, Any]]:
    if not isinstance(table, dict):
        raise _fail(where, "[taps] must be a table of canonical tensor = foreign module")
    options = dict(TAP_DEFAULTS)
    taps = []
    for key, value in table.items():
        if key in TAP_DEFAULTS:
            if value not in _TAP_CHOICES[key] or isinstance(value, bool):
                raise _fail(where, f"[taps] {key} must be one of {list(_TAP_CHOICES[key])}, got {value!r}")
            options[key] = value
        elif isinstance(value, list):  # alternatives, each with its `when`: the first that applies
            if not value:
                raise _fail(f"{where} [taps] {key!r}", "an empty list of taps")
            taps.extend(_tap(key, spec, where) for spec in value)
        else:
            taps.append(_tap(key, value, where))
    return tuple(taps), options


@dataclass(frozen=True)
class Island:
    """One `[float32_islands]` entry: a part the system computes in float32 even in a float64
    model (transformers' T5LayerNorm variance, Marian's sinusoid table, OpenNMT-py's softmax), and
    the canonical tensors (TAP_TENSORS names, `{i}` for every layer) where its rounding first
    enters: those and every tensor after them in forward order may carry it. `conformance.compare`
    in float64 labels such a tensor whose error sits at float32 rounding "float32 island in
    NAME: expected" instead of a divergence."""

    name: str
    tensors: tuple[str, ...]
    why: str

    def first_index(self, order: list[str]) -> int | None:
        """Where in `order` (the forward order's tensor names) the island first enters, or None."""
        hits = [i for i, tensor in enumerate(order) for pattern in self.tensors
                if re.fullmatch(re.escape(pattern).replace(r"\{i\}", r"\d+"), tensor)]
        return min(hits) if hits else None


def _islands(table: Any, where: str) -> tuple[Island, ...]:
    if not isinstance(table, dict):
        raise _fail(where, "[float32_islands] must be a table of name = { tensors = [...], why = \"...\" }")
    out = []
    for name, spec in table.items():
        if not isinstance(spec, dict) or set(spec) != {"tensors", "why"} or not isinstance(spec["why"], str) \
                or not isinstance(spec["tensors"], list) or not spec["tensors"]:
            raise _fail(where, f"[float32_islands] {name!r} = {{ tensors = [canonical tensors], why = \"...\" }}; got {spec!r}")
        bad = [t for t in spec["tensors"] if t not in TAP_TENSORS]
        if bad:
            raise _fail(where, f"[float32_islands] {name!r}: {bad} are not canonical tensors; expected some of "
                               f"{', '.join(TAP_TENSORS)}")
        out.append(Island(name, tuple(spec["tensors"]), spec["why"]))
    return tuple(out)


class InferRule(NamedTuple):
    """One `[[infer]]` rule: the switches `present` when the foreign `key` is there, else `absent`.

    `differs_from` names another foreign key: the key then counts as present only when its tensor
    differs from that one's (`torch.equal` semantics: the same shape and values). A system that
    ties two weights when a checkpoint stores equal copies of both and unties them when they differ
    (transformers' `tie_weights` at load) is described exactly so. With keys alone (no tensors) the
    key's presence decides."""

    key: str
    present: Mapping[str, Any]
    absent: Mapping[str, Any]
    differs_from: str | None = None

    def holds(self, keys) -> bool:
        """Whether the rule's key counts as present among `keys` (names, or a mapping to tensors)."""
        if self.key not in keys:
            return False
        if self.differs_from is None or not isinstance(keys, Mapping) or self.differs_from not in keys:
            return True
        a, b = np.asarray(keys[self.key]), np.asarray(keys[self.differs_from])
        return not (a.shape == b.shape and np.array_equal(a, b))


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    preset: str | None
    switches: Mapping[str, Any]
    matrices: str | None
    free: frozenset[str]
    required: frozenset[str]
    drop: tuple[str, ...]
    entries: tuple[Entry, ...]
    path: Path | None = None
    # free or required switch -> where the system keeps it ("nn.Transformer(norm_first=...)"),
    # quoted when an import defaults it or asks for it.
    hints: Mapping[str, str] = field(default_factory=dict)
    # Structure that the key set itself tells (a shared embedding, a logits projection), for
    # systems that have both: see InferRule.
    infer: tuple[InferRule, ...] = ()
    # The system keeps its parameters as a nested tree (Flax): keys are its path joined with ".",
    # and an export returns the tree.
    nested: bool = False
    # [taps]: where the system computes each canonical tensor (conformance.compare), and how its
    # tensors are laid out (TAP_OPTIONS).
    taps: tuple[Tap, ...] = ()
    tap_options: Mapping[str, Any] = field(default_factory=lambda: dict(TAP_DEFAULTS))
    # [hf]: the Hugging Face family's config.json as data (conformance.convert.hf_config), for a
    # layout whose system is a transformers model; None for every other.
    hf: HFTable | None = None
    # [float32_islands]: parts the system computes in float32 even in a float64 model (Island).
    islands: tuple["Island", ...] = ()
    # [checkpoint]: the training checkpoint the system writes, with its options, as data
    # (conformance.convert.system_files); None for a system that saves a state dict only.
    checkpoint: Any = None
    # [bundle]: a checkpoint file that bundles the config with the weights (openai-whisper's
    # {"dims", "model_state_dict"}; conformance.convert.bundle_table), or None.
    bundle: BundleTable | None = None
    # Whether auto-detection (no --layout) may pick it. A system that saves exactly another's keys
    # (mT5 saves T5's) cannot be told by them: it is chosen by name, or by config.json's model_type.
    detect: bool = True
    _drop_regex: tuple[re.Pattern, ...] = field(default=(), repr=False, compare=False)

    def base_switches(self) -> dict[str, Any]:
        """The switches the system implies: its preset, then the layout's own additions."""
        base = dict(PRESETS[self.preset]) if self.preset else {}
        return {**base, **self.switches}

    def inferred_switches(self, keys) -> dict[str, Any]:
        """The switches the `[[infer]]` rules read from foreign keys: a set of names, or a mapping of
        names to tensors (which a rule with `differs_from` compares)."""
        keys = keys if isinstance(keys, Mapping) else set(keys)
        out: dict[str, Any] = {}
        for rule in self.infer:
            out.update(rule.present if rule.holds(keys) else rule.absent)
        return out

    def inferred_names(self) -> set[str]:
        return {name for rule in self.infer for name in (*rule.present, *rule.absent)}

    def is_dropped(self, key: str) -> bool:
        return any(r.fullmatch(key) for r in self._drop_regex)

    def stores_positions(self) -> bool:
        """Whether the system keeps a position table in its state dict (learned or a buffer)."""
        return any(_is_table(e) for e in self.entries)

    def computes_with_stored_positions(self) -> bool:
        """Whether the system computes with the position table it loads, so that an export may carry
        any position term in it; not when the table is `recomputed` on load."""
        return any(_is_table(e) and not e.recomputed for e in self.entries)

    def __str__(self) -> str:
        return self.name


# The canonical position tables, one per stack.
TABLES = ("encoder.position.table", "decoder.position.table")


def _is_table(entry: Entry) -> bool:
    return any(t.text.endswith("position.table") for t in entry.targets)


def _fail(where: str, problem: str) -> LayoutError:
    return LayoutError(where, problem)


def _parse_captures(text: str, where: str) -> dict[str, Capture]:
    captures: dict[str, Capture] = {}
    for m in CAPTURE.finditer(text):
        name, spec = m.group(1), m.group(2)
        if name in captures:
            raise _fail(where, f"pattern {text!r} uses {{{name}}} twice")
        if spec is None:
            captures[name] = Capture(name)
            continue
        pairs = []
        for word in spec.split("|"):
            foreign, _, canonical = word.partition("=")
            canonical = canonical if _ else foreign
            if not foreign or not canonical:
                raise _fail(where, f"pattern {text!r}: empty word in {{{name}:{spec}}}")
            pairs.append((foreign, canonical))
        for side in (0, 1):
            words = [p[side] for p in pairs]
            if len(set(words)) != len(words):
                raise _fail(where, f"pattern {text!r}: {{{name}:{spec}}} repeats a word, so it cannot be inverted")
        captures[name] = Capture(name, tuple(pairs))
    leftover = CAPTURE.sub("", text)
    if "{" in leftover or "}" in leftover:
        raise _fail(where, f"pattern {text!r} has a brace that is not a {{name}} or {{name:a|b}} capture")
    return captures


def _canonical_pattern(text: Any, captures: Mapping[str, Capture], where: str, known: set[str]) -> Pattern:
    if not isinstance(text, str) or not text:
        raise _fail(where, f"a canonical key must be a non-empty string, got {text!r}")
    for m in CAPTURE.finditer(text):
        if m.group(2) is not None:
            raise _fail(where, f"canonical pattern {text!r}: declare {{{m.group(1)}:...}} on the foreign side only")
        if m.group(1) not in captures:
            raise _fail(where, f"canonical pattern {text!r} uses {{{m.group(1)}}}, which the foreign pattern does not capture")
    pattern = Pattern(text, captures, "canonical")
    if pattern.names != set(captures):
        missing = sorted(set(captures) - pattern.names)
        raise _fail(where, f"canonical pattern {text!r} must use every capture of the foreign pattern; it lacks {missing}")
    # Not every combination need exist (one rule may cover self- and cross-attention for both
    # stacks, and the encoder has no cross-attention), but every word must take part in some
    # canonical name: that catches a typo in the pattern or in any one word.
    combos = list(pattern.combinations())
    valid = [values for values, key in combos if key in known]
    if not valid:
        raise _fail(where, f"{combos[0][1]!r} (from {text!r}) is not a canonical parameter name (see conformance/core/params.py)")
    for name, capture in captures.items():
        for _, word in capture.choices or ():
            if not any(values[name] == word for values in valid):
                example = next(key for values, key in combos if values[name] == word)
                raise _fail(where, f"{example!r} (from {text!r}) is not a canonical parameter name (see conformance/core/params.py)")
    return pattern


@functools.lru_cache(maxsize=1)
def _all_canonical_names() -> frozenset[str]:
    """Every canonical name with layer index 0, under configs that turn every parameter on (one
    per position term that has parameters: a table, a relative bias, or one per layer)."""
    config = ModelConfig(
        n_encoder_layers=1, n_decoder_layers=1, position="table", qkv_bias=True, out_proj_bias=True,
        final_encoder_norm=True, final_decoder_norm=True, share_embeddings=False, tie_output=False,
        output_bias=True, final_logits_bias=True, ffn_glu=True, embedding_norm=True,
    )
    return (frozenset(param_shapes(config)) | frozenset(param_shapes(config.replace(position="relative")))
            | frozenset(param_shapes(config.replace(position="relative", relative_bias_per_layer=True)))
            | frozenset(param_shapes(config.replace(source="features", src_vocab_size=config.tgt_vocab_size))))


def _entry(text: str, spec: Any, where: str, known: set[str]) -> Entry:
    where = f"{where} [keys] {text!r}"
    captures = _parse_captures(text, where)
    source = Pattern(text, captures, "foreign")
    if isinstance(spec, str):
        spec = {"to": spec}
    if not isinstance(spec, dict):
        raise _fail(where, f"must be a canonical key or an inline table, got {type(spec).__name__}")
    unknown = sorted(set(spec) - _ENTRY_KEYS)
    if unknown:
        raise _fail(where, f"unknown field(s) {unknown}; expected some of {sorted(_ENTRY_KEYS)}")
    kinds = [k for k in ("to", "split", "copy", "same_as") if k in spec]
    if len(kinds) != 1:
        raise _fail(where, f"needs exactly one of to, split, copy, same_as; got {kinds or 'none'}")
    kind = kinds[0]
    for flag in ("transpose", "optional", "recomputed"):
        if flag in spec and not isinstance(spec[flag], bool):
            raise _fail(where, f"{flag} must be true or false, got {spec[flag]!r}")
    for number in ("axis", "squeeze"):
        if number in spec and (isinstance(spec[number], bool) or not isinstance(spec[number], int)):
            raise _fail(where, f"{number} must be an integer axis, got {spec[number]!r}")
    if "axis" in spec and kind != "split":
        raise _fail(where, "axis only applies to split")
    when = spec.get("when", {})
    if not isinstance(when, dict):
        raise _fail(where, "when must be a table of switches")
    for key, value in when.items():
        if key not in SWITCH_FIELDS:
            raise _fail(where, f"when: {key} is not a ModelConfig switch")
        _check_switch(key, value, where)
    if kind == "same_as":
        if set(spec) - {"same_as", "optional", "when"}:
            raise _fail(where, "an alias (same_as) takes no transform: it is the same tensor stored twice")
        target = spec["same_as"]
        if not isinstance(target, str):
            raise _fail(where, f"same_as must be a foreign key, got {target!r}")
        for m in CAPTURE.finditer(target):
            if m.group(2) is not None or m.group(1) not in captures:
                raise _fail(where, f"same_as {target!r} may only use the captures of {text!r}")
        same_as = Pattern(target, captures, "foreign")
        if same_as.names != set(captures):
            raise _fail(where, f"same_as {target!r} must use every capture of {text!r}")
        return Entry(text, "alias", source, same_as=same_as, optional=spec.get("optional", False), when=dict(when))
    if kind == "to":
        targets = (_canonical_pattern(spec["to"], captures, where, known),)
        kind = "rename"
    else:
        listed = spec[kind]
        if not isinstance(listed, list) or len(listed) < 2:
            raise _fail(where, f"{kind} needs a list of at least two canonical keys, got {listed!r}")
        targets = tuple(_canonical_pattern(t, captures, where, known) for t in listed)
    heads = spec.get("heads")
    if heads is not None and (heads not in HEAD_AXES or kind != "rename"):
        raise _fail(where, f"heads must be one of {list(HEAD_AXES)} on a single-target entry, got {heads!r}")
    entry = Entry(
        text, kind, source, targets, axis=spec.get("axis", 0), squeeze=spec.get("squeeze"),
        transpose=spec.get("transpose"), optional=spec.get("optional", False), recomputed=spec.get("recomputed", False),
        heads=heads, when=dict(when),
    )
    if entry.recomputed and not all(t.text.endswith("position.table") for t in targets):
        raise _fail(where, "recomputed applies to position tables only (a table the system rebuilds when it loads a model)")
    return entry


def _check_switch(name: str, value: Any, where: str) -> None:
    kind = _FIELD_TYPES[name]
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        raise _fail(where, f"[switches] {name} must be {KIND_WORDS[kind]}, got {value!r}")


def parse_layout(data: Mapping[str, Any], name: str, path: Path | None = None) -> Layout:
    """Validate parsed TOML and build a `Layout`; `LayoutError` names the first problem."""
    where = str(path) if path else name
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _fail(where, f"unknown top-level key(s) {unknown}; expected some of {sorted(_TOP_KEYS)}")
    name = data.get("name", name)
    preset = data.get("preset")
    if preset is not None and preset not in PRESETS:
        raise _fail(where, f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    switches = data.get("switches", {})
    if not isinstance(switches, dict):
        raise _fail(where, "[switches] must be a table")
    for key, value in switches.items():
        if key in SIZE_FIELDS:
            raise _fail(where, f"[switches] {key} is a size; sizes are read from the tensors or given with --set")
        if key not in SWITCH_FIELDS:
            raise _fail(where, f"[switches] {key} is not a ModelConfig switch")
        _check_switch(key, value, where)
    lists = {}
    for key in ("free", "required", "drop"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _fail(where, f"{key} must be a list of strings")
        lists[key] = value
    for key in ("free", "required"):
        bad = [v for v in lists[key] if v not in SWITCH_FIELDS | SIZE_FIELDS]
        if bad:
            raise _fail(where, f"{key} names {bad}, which are not ModelConfig fields")
    hints = data.get("hints", {})
    if not isinstance(hints, dict) or not all(isinstance(v, str) and v for v in hints.values()):
        raise _fail(where, "[hints] must be a table of switch = \"where the system keeps it\"")
    stray = sorted(set(hints) - set(lists["free"]) - set(lists["required"]))
    if stray:
        raise _fail(where, f"[hints] names {stray}, which are not listed in free or required")
    matrices = data.get("matrices")
    if matrices not in (None, "out-in", "in-out"):
        raise _fail(where, f"matrices must be 'out-in' (torch.nn.Linear) or 'in-out' (Flax Dense, NumPy), got {matrices!r}")
    keys = data.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise _fail(where, "[keys] must be a non-empty table of foreign key pattern = canonical key")
    known = set(_all_canonical_names())
    entries = []
    for text, spec in keys.items():
        if not isinstance(spec, list):
            entries.append(_entry(text, spec, where, known))
            continue
        # Alternatives: one foreign key stored as different things under different switches (an
        # lm_head that is output.weight when untied, a saved copy of the embedding when tied).
        if len(spec) < 2:
            raise _fail(f"{where} [keys] {text!r}", "a list gives alternatives: at least two inline tables, each with when")
        for alternative in spec:
            entry = _entry(text, alternative, where, known)
            if not entry.when:
                raise _fail(f"{where} [keys] {text!r}", "each alternative needs when = { switch = value }, which "
                            "decides when it applies")
            entries.append(entry)
    entries = tuple(entries)
    if matrices is None:
        for entry in entries:
            if entry.transpose is None and any(is_matrix(e) for t in entry.targets for e in t.examples()):
                raise _fail(where, f"[keys] {entry.text!r} maps a matrix; say how the system stores matrices "
                            "with matrices = 'out-in' or 'in-out' (or transpose = true/false on the entry)")
    def together(a: Entry, b: Entry) -> bool:  # both can apply under one set of switches
        return all(a.when[k] == b.when[k] for k in set(a.when) & set(b.when))

    for entry in entries:
        if entry.kind == "alias" and any(other.kind == "alias" and other.text == entry.same_as.text and together(entry, other)
                                         for other in entries):
            raise _fail(where, f"[keys] {entry.text!r} is an alias of another alias; point it at the stored key")
    nested = data.get("nested", False)
    if not isinstance(nested, bool):
        raise _fail(where, f"nested must be true or false, got {nested!r}")
    infer = []
    rules = data.get("infer", [])
    if not isinstance(rules, list):
        raise _fail(where, "[[infer]] must be an array of tables")
    for rule in rules:
        if not isinstance(rule, dict) or set(rule) - {"key", "present", "absent", "differs_from"} \
                or not isinstance(rule.get("key"), str) or not isinstance(rule.get("differs_from", ""), str):
            raise _fail(where, f"an [[infer]] rule is key = \"foreign key\", present = {{...}}, absent = {{...}} "
                        f"(differs_from = \"foreign key\" optional); got {rule!r}")
        sides = []
        for side in ("present", "absent"):
            table = rule.get(side, {})
            if not isinstance(table, dict):
                raise _fail(where, f"[[infer]] {rule['key']!r}: {side} must be a table of switches")
            for key, value in table.items():
                if key not in SWITCH_FIELDS:
                    raise _fail(where, f"[[infer]] {rule['key']!r}: {key} is not a ModelConfig switch")
                _check_switch(key, value, where)
            sides.append(dict(table))
        infer.append(InferRule(rule["key"], sides[0], sides[1], rule.get("differs_from")))
    taps, tap_options = _taps(data.get("taps", {}), where)
    hf = parse_hf_table(data["hf"], where) if "hf" in data else None
    islands = _islands(data.get("float32_islands", {}), where)
    checkpoint = None
    if "checkpoint" in data:
        checkpoint = parse_checkpoint_table(data["checkpoint"], where)
    bundle = parse_bundle_table(data["bundle"], where) if "bundle" in data else None
    detect = data.get("detect", True)
    if not isinstance(detect, bool):
        raise _fail(where, f"detect must be true or false, got {detect!r}")
    return Layout(
        name=name, description=str(data.get("description", "")), preset=preset, switches=dict(switches),
        matrices=matrices, free=frozenset(lists["free"]) | frozenset(lists["required"]),
        required=frozenset(lists["required"]), drop=tuple(lists["drop"]), entries=entries, path=path,
        hints=dict(hints), infer=tuple(infer), nested=nested, taps=taps, tap_options=tap_options, hf=hf,
        detect=detect, checkpoint=checkpoint, bundle=bundle, islands=islands, _drop_regex=tuple(glob(d) for d in lists["drop"]),
    )


# The canonical matrices, stored (d_in, d_out); everything else (embeddings, tables, vectors) has
# one orientation only. A system that stores (d_out, d_in) needs each of these transposed. The
# front end's convolution kernels are (3, C_in, C_out), which such a system (torch.nn.Conv1d)
# stores (C_out, C_in, 3): every axis reversed, the same `.T`.
_MATRIX_SUFFIXES = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
                    ".linear1.weight", ".gate.weight", ".linear2.weight", "frontend.conv1.weight",
                    "frontend.conv2.weight")


def is_matrix(canonical_key: str) -> bool:
    return canonical_key.endswith(_MATRIX_SUFFIXES) or canonical_key == "output.weight"


# -- Loading -----------------------------------------------------------------------------------


def read_layout_file(path: str | Path) -> Layout:
    path = Path(path)
    return parse_layout(_with_base(_read_toml(path), path, ()), path.stem, path)


def _targets(spec: Any) -> frozenset[str]:
    """The canonical key(s) a raw `[keys]` value gives (empty for an alias)."""
    if isinstance(spec, list):  # alternatives
        return frozenset().union(*(_targets(s) for s in spec))
    if isinstance(spec, str):
        return frozenset([spec])
    if isinstance(spec, dict):
        for name in ("split", "copy"):
            if isinstance(spec.get(name), list):
                return frozenset(str(t) for t in spec[name])
        if isinstance(spec.get("to"), str):
            return frozenset([spec["to"]])
    return frozenset()


def _with_base(data: dict[str, Any], path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """`data` on top of the layout it `extends` (recursively), as one raw layout table."""
    if "extends" not in data:
        return data
    base_name = data["extends"]
    if not isinstance(base_name, str) or not base_name:
        raise _fail(str(path), f"extends must be a built-in layout's name or a .toml path, got {base_name!r}")
    if base_name in builtin_layout_names():
        base_path = LAYOUT_DIR / f"{base_name}.toml"
    else:
        base_path = (path.parent / base_name) if not Path(base_name).is_absolute() else Path(base_name)
        if not base_path.is_file():
            raise _fail(str(path), f"extends {base_name!r}: no built-in layout of that name "
                        f"({', '.join(builtin_layout_names())}) and no such file {str(base_path)!r}")
    if base_path.resolve() in seen or base_path.resolve() == path.resolve():
        raise _fail(str(path), f"extends {base_name!r}, which extends this layout again (a cycle)")
    base = _with_base(_read_toml(base_path), base_path, seen + (path.resolve(),))
    merged = {k: v for k, v in base.items() if k not in ("extends", "name", "description")}
    for key, value in data.items():
        if key == "extends":
            continue
        if key in ("switches", "hints", "taps") and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif key == "keys" and isinstance(value, dict) and isinstance(merged.get(key), dict):
            replaced = {t for spec in value.values() for t in _targets(spec)}
            kept = {pattern: spec for pattern, spec in merged["keys"].items()
                    if pattern not in value and not (_targets(spec) & replaced)}
            merged[key] = {**kept, **value}
        else:
            merged[key] = value
    merged.setdefault("description", f"{base.get('description', base_name)} (extended by {path.name})")
    return merged


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise LayoutError(str(path), "no such file") from None
    except IsADirectoryError:
        raise LayoutError(str(path), "is a directory; give a layout's .toml file or a built-in layout's name") from None
    except PermissionError:
        raise LayoutError(str(path), "permission denied") from None
    except UnicodeDecodeError:
        raise LayoutError(str(path), "not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise LayoutError(str(path), f"not valid TOML: {exc}") from None


def builtin_layout_names() -> list[str]:
    return sorted(p.stem for p in LAYOUT_DIR.glob("*.toml"))


@functools.lru_cache(maxsize=None)
def _builtin(name: str) -> Layout:
    return read_layout_file(LAYOUT_DIR / f"{name}.toml")


def builtin_layouts() -> list[Layout]:
    return [_builtin(name) for name in builtin_layout_names()]


def load_layout(layout: str | Path | Layout) -> Layout:
    """A `Layout` from a built-in name, a path to a TOML file, or a `Layout` (returned as is)."""
    if isinstance(layout, Layout):
        return layout
    text = str(layout)
    if text in builtin_layout_names():
        return _builtin(text)
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        return read_layout_file(path)
    raise LayoutError(text, f"no built-in layout of that name ({', '.join(builtin_layout_names())}) and no such .toml file")
