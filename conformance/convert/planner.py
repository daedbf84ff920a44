"""The conversion planner: which foreign key is which canonical tensor, stored which way round,
and which config the keys, the shapes and the overrides make. One room for what `rosetta convert`
decides before a tensor is transformed; `conformance.convert.engine` carries the plan out.

    match_key, plan_keys, alias_keys    a foreign key's entry; the foreign keys that store given
                                        canonical tensors (export); the tied duplicates of keys
    check_keys, detect_layout           a key set against a layout (missing and unexpected keys,
                                        no tensors needed), and the one built-in layout it fits
    Plan, plan_import                   all an import decides from the keys, decided once
    needs_transpose                     whether a canonical matrix is stored (out, in) there
    infer_sizes, build_config           the sizes the shapes tell; the config: the layout's
                                        switches, those sizes, then the overrides
    merge_switches                      facts read from a model or its config.json, which an
                                        override may not contradict
    defaulted_switches, alternatives    what the layout's defaults supplied, and how to change it

`check_keys` matches every key against the layout's entries, counts the layers from the captured
indices, builds the key set the layout expects for the structure that the preset and overrides
imply (which parameters exist), and lists missing and unexpected keys. Auto-detection runs it for
every built-in layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from conformance.core.config import (
    ACTIVATIONS, LAYER_NORM_FORMS, NORM_PLACEMENTS, PAD_MASK_SIDES, POSITIONS, SRC_PAD_MASK_SIDES, ModelConfig,
)
from conformance.core.errors import ConfigError
from conformance.convert.errors import (
    AmbiguousLayoutError, KeyMismatchError, LayoutError, NoMatchingLayoutError, listing, overrides_note, setting,
)
from conformance.convert.layout import (
    SIZE_FIELDS, SWITCH_FIELDS, TABLES, Entry, Layout, builtin_layouts, is_matrix, load_layout,
)
from conformance.core.params import param_shapes

_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.")


@dataclass
class KeyCheck:
    """How a set of foreign keys fits a layout (see `check_keys`)."""

    layout: Layout
    effective: dict[str, tuple[Entry, dict[str, str]]]  # stored key -> (entry, canonical values)
    aliases: dict[str, str]  # alias key -> the key it duplicates
    dropped: list[str]
    layers: dict[str, int]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    missing_summary: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)  # the caller's, over those the key names tell

    @property
    def exact(self) -> bool:
        return not self.missing and not self.unexpected


@dataclass
class Plan:
    """What an import decided from the keys alone, before a tensor is transformed: the layout, the
    switches (the caller's over those the key set tells), and in `check` each foreign key's entry
    (its transforms) and captured values, the tied duplicates and the layer counts. Built once by
    `plan_import`; `engine.execute` carries it out (config from the shapes, then the tensors)."""

    layout: Layout
    detected: bool
    overrides: dict[str, Any]
    check: KeyCheck


def match_key(layout: Layout, key: str, switches: Mapping[str, Any] | None = None) -> tuple[Entry, dict[str, str]] | None:
    found = [(e, v) for e in layout.entries
             if (switches is None or e.applies(switches)) and (v := e.source.match(key)) is not None]
    if len(found) > 1:
        raise LayoutError(layout.name, f"key {key!r} matches two entries, {found[0][0].text!r} and {found[1][0].text!r}")
    return found[0] if found else None


def plan_keys(layout: Layout, canonical_keys: Iterable[str],
              switches: Mapping[str, Any] | None = None) -> dict[str, tuple[Entry, dict[str, str], list[str]]]:
    """canonical keys -> {foreign key: (entry, values, canonical key per target)}, in order.
    `switches` (the config's) select the entries that apply (`when`); None: entries without one.

    Raises `LayoutError` for a canonical key no entry produces, or that two entries produce.
    """
    groups: dict[tuple[int, tuple], list[str | None]] = {}
    for ckey in canonical_keys:
        hits = []
        for index, entry in enumerate(layout.entries):
            if not entry.applies(switches or {}):
                continue
            for slot, target in enumerate(entry.targets):
                values = target.match(ckey)
                if values is not None:
                    hits.append((index, slot, values))
        if not hits:
            raise LayoutError(layout.name, f"has no key for the canonical parameter {ckey!r}, which this config needs")
        if len(hits) > 1:
            a, b = (layout.entries[h[0]].text for h in hits[:2])
            raise LayoutError(layout.name, f"canonical key {ckey!r} comes from two entries, {a!r} and {b!r}")
        index, slot, values = hits[0]
        group = groups.setdefault((index, tuple(sorted(values.items()))), [None] * len(layout.entries[index].targets))
        group[slot] = ckey
    plan = {}
    for (index, values), ckeys in groups.items():
        entry = layout.entries[index]
        if None in ckeys:
            present = [c for c in ckeys if c]
            absent = [t.format(dict(values)) for t, c in zip(entry.targets, ckeys) if c is None]
            raise LayoutError(layout.name, f"{entry.text!r} stores {', '.join(present)} together with {', '.join(absent)}, "
                              "which this config does not have")
        plan[entry.source.format(dict(values))] = (entry, dict(values), ckeys)
    return plan


def alias_keys(layout: Layout, stored_keys: Iterable[str],
               switches: Mapping[str, Any] | None = None) -> dict[str, tuple[str, Entry]]:
    """alias key -> (the stored key it duplicates, its entry), for every alias of `stored_keys`
    that applies under `switches` (the config's; None: the aliases without a `when`)."""
    out = {}
    aliases = [e for e in layout.entries if e.kind == "alias" and e.applies(switches or {})]
    for key in stored_keys:
        for entry in aliases:
            values = entry.same_as.match(key)
            if values is not None:
                out[entry.source.format(values)] = (key, entry)
    return out


def tied_copies(layout: Layout, wanted: Iterable[str], stored: Mapping[str, Any] | Iterable[str]) -> dict[str, str]:
    """wanted key that `stored` lacks -> the stored key holding the same tensor, by the layout's
    ties (its `same_as` aliases, under the switches the stored keys imply): what `from_pretrained`
    does when a folder written by `save_pretrained`, which keeps a tied tensor once, is loaded into
    a model that has every copy. Keys no tie fills are left out."""
    stored_keys = set(stored)
    switches = {**layout.base_switches(), **layout.inferred_switches(stored)}
    ties: dict[str, set[str]] = {}  # the key an alias names -> it and every alias of it
    for entry in layout.entries:
        if entry.kind != "alias" or not entry.applies(switches):
            continue
        for key in set(wanted) | stored_keys:
            values = entry.source.match(key)
            if values is not None:
                target = entry.same_as.format(values)
                ties.setdefault(target, {target}).add(key)
    out = {}
    for key in wanted:
        if key in stored_keys:
            continue
        group = next((g for g in ties.values() if key in g), None)
        present = sorted(group & stored_keys) if group else []
        if present:
            out[key] = present[0]
    return out


def _skeleton(layout: Layout, overrides: Mapping[str, Any], layers: Mapping[str, int]) -> ModelConfig:
    """A config with the structure (which parameters exist) implied by the layout and overrides.

    Sizes are placeholders: only the key set of `param_shapes` is used.
    """
    values = layout.base_switches()
    values.update({k: v for k, v in overrides.items() if k not in SIZE_FIELDS and k != "notes"})
    if layout.stores_positions():
        values["position"] = "table"
    pad = values.get("pad_id", 0)
    vocab = max(2, pad + 1) if isinstance(pad, int) and not isinstance(pad, bool) else 2
    values.update(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=4, n_heads=1, d_ff=1, max_len=1,
                  n_encoder_layers=layers["encoder"], n_decoder_layers=layers["decoder"])
    return ModelConfig(**values)


def structural_overrides(layout: Layout, overrides: Mapping[str, Any]) -> list[str]:
    """The switch overrides that change which parameters `layout` expects (a bias, a final norm, a
    shared embedding): the ones to name when the keys then do not fit."""
    one_layer = {"encoder": 1, "decoder": 1}  # every per-layer parameter kind exists once

    def keys(given):
        try:
            return set(param_shapes(_skeleton(layout, given, one_layer)))
        except ValueError:  # an override the config refuses: reported elsewhere
            return None

    given = {k: v for k, v in overrides.items() if k in SWITCH_FIELDS}
    with_all = keys(given)
    names = []
    for name in sorted(given):
        without = keys({k: v for k, v in given.items() if k != name})
        if with_all is not None and without is not None and without != with_all:
            names.append(name)
    return names


def check_keys(layout: Layout, keys: Iterable[str], overrides: Mapping[str, Any] | None = None) -> KeyCheck:
    """Match foreign keys against a layout and list what is missing and unexpected. No tensors."""
    keys = list(keys)
    overrides = {**layout.inferred_switches(keys), **(overrides or {})}
    switches = {**layout.base_switches(), **overrides}
    effective, aliases, dropped, unmatched = {}, {}, [], []
    for key in keys:
        if layout.is_dropped(key):
            dropped.append(key)
            continue
        found = match_key(layout, key, switches)
        if found is None:
            unmatched.append(key)
        elif found[0].kind == "alias":
            aliases[key] = found[0].same_as.format(found[1])
        else:
            effective[key] = found
    # A tied duplicate stands in for the key it duplicates when that one was not saved
    # (Hugging Face's save_pretrained keeps one name per tied tensor, not always the same one).
    for key, target in aliases.items():
        if target not in effective:
            found = match_key(layout, target, switches)
            if found is None or found[0].kind == "alias":
                raise LayoutError(layout.name, f"{key!r} is declared an alias of {target!r}, which no entry maps")
            effective[target] = found

    layers = {"encoder": 0, "decoder": 0}
    for entry, values in effective.values():
        for target in entry.targets:
            m = _LAYER.match(target.format(values))
            if m:
                layers[m.group(1)] = max(layers[m.group(1)], int(m.group(2)) + 1)
    check = KeyCheck(layout, effective, aliases, dropped, layers, overrides=overrides)

    skeleton = _skeleton(layout, overrides, layers)
    plan = plan_keys(layout, param_shapes(skeleton), skeleton.to_dict())
    expected = {fkey: not entry.optional for fkey, (entry, _, _) in plan.items()}
    for alias, (_, entry) in alias_keys(layout, plan, skeleton.to_dict()).items():
        expected.setdefault(alias, not entry.optional)
    present = set(effective) | set(aliases)
    check.missing = [k for k, required in expected.items() if required and k not in present]
    # A key that matches an entry can still be unexpected: a bias the config does not have, or a
    # tied duplicate of a key the config does not have.
    skipped = set(dropped)
    check.unexpected = [k for k in keys if k not in skipped and k not in expected]
    check.missing_summary = _summarise_missing(check.missing, plan, expected)
    return check


def _summarise_missing(missing: list[str], plan, expected) -> str:
    """Name a whole missing layer once ('every key of encoder layer 2') instead of key by key."""
    by_layer: dict[tuple[str, int], list[str]] = {}
    for fkey, (_, _, ckeys) in plan.items():
        m = _LAYER.match(ckeys[0])
        if m and expected.get(fkey):
            by_layer.setdefault((m.group(1), int(m.group(2))), []).append(fkey)
    missing_set = set(missing)
    whole = {layer for layer, fkeys in by_layer.items() if set(fkeys) <= missing_set}
    covered = {k for layer in whole for k in by_layer[layer]}
    parts = [f"every key of {stack} layer {i} ({len(by_layer[(stack, i)])} keys, e.g. {by_layer[(stack, i)][0]})"
             for stack, i in sorted(whole)]
    rest = [k for k in missing if k not in covered]
    if rest:
        parts.append(listing(rest))
    return "; ".join(parts)


# -- Detection ---------------------------------------------------------------------------------


def detect_layout(keys: Iterable[str], **overrides: Any) -> Layout:
    """The one built-in layout whose key set matches `keys` exactly.

    Every built-in layout whose keys fit is a candidate, those with `detect = false` (a system
    that saves exactly another's keys: mT5 saves T5's) included. When the candidates would
    compute the same model from these keys (the same switches: `implied_switches`), the one that
    may be detected wins; when they would compute different models, no key tells which one the
    file is, and neither can a trial forward pass (each runs, and gives finite logits: other
    ones), so nothing is guessed: `AmbiguousLayoutError` lists the candidates, the switches
    that differ between them and the `--layout` line that picks each.

    Raises `NoMatchingLayoutError` listing the closest layouts with their missing and unexpected
    keys (and, where one switch would make a layout's keys fit, that structure by name), or
    `AmbiguousLayoutError`.
    """
    return _detect(keys, overrides).layout


def implied_switches(layout: Layout, keys, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Every switch an import of `keys` (names, or a mapping to tensors) with `layout` starts from:
    ModelConfig's defaults, the layout's preset and `[switches]`, what its `[[infer]]` rules read
    from the keys, then `overrides`; a stored position table as `position = "table"`. Two layouts
    whose keys fit the same file and that give the same switches compute the same model."""
    defaults = ModelConfig()
    values = {name: getattr(defaults, name) for name in SWITCH_FIELDS}
    values.update(layout.base_switches())
    values.update(layout.inferred_switches(keys))
    values.update({k: v for k, v in overrides.items() if k in SWITCH_FIELDS})
    tables = [e for e in layout.entries if any(t.text.endswith("position.table") for t in e.targets)]
    if any(e.source.match(key) is not None for e in tables for key in keys):
        values["position"] = "table"
    return values


# Switches that decide which parameters exist, one flip of which may make a near-miss key set fit:
# the structure a refusal names ("the keys of hf-pegasus with an embedding LayerNorm").
_STRUCTURAL = ("embedding_norm", "final_encoder_norm", "final_decoder_norm", "qkv_bias", "out_proj_bias", "ffn_bias",
               "output_bias", "final_logits_bias", "share_embeddings", "tie_output", "ffn_glu")


def _structure_by_name(layout: Layout, keys: list[str], overrides: Mapping[str, Any]) -> str:
    """When flipping one structural switch (or two of them together) makes the keys fit `layout`
    exactly: that structure, named, which the layout's system does not have ('' otherwise)."""
    base = implied_switches(layout, keys, overrides)
    flips = [(name,) for name in _STRUCTURAL if name not in overrides and isinstance(base.get(name), bool)]
    flips += [("final_encoder_norm", "final_decoder_norm")]
    for names in flips:
        if any(name in overrides for name in names):
            continue
        changed = {name: not base[name] for name in names}
        try:
            if check_keys(layout, keys, {**overrides, **changed}).exact:
                told = ", ".join(f"{name}={setting(value)}" for name, value in changed.items())
                sets = " ".join(f"--set {name}={setting(value)}" for name, value in changed.items())
                return (f"these are the keys of {layout.name} with {told}, a structure the {layout.name} system does "
                        f"not have: refused rather than converted as {layout.name}; if your copy of that system was "
                        f"changed that way, say so: --layout {layout.name} {sets}")
        except (LayoutError, ValueError):
            continue
    return ""


def _detect(keys: Iterable[str], overrides: Mapping[str, Any]) -> KeyCheck:
    """`detect_layout`, returning the winner's `KeyCheck` so that an import need not match the
    keys against it a second time."""
    given = keys if isinstance(keys, Mapping) else None  # tensors too: an [[infer]] rule may compare them
    keys = list(keys)
    results, checks = [], {}
    for layout in builtin_layouts():
        try:
            check = check_keys(layout, keys, overrides)
        except LayoutError as exc:  # the overrides ask for a structure this layout cannot store
            results.append((layout, [f"({exc.problem})"], []))
            continue
        except ConfigError as exc:
            if exc.field in overrides:  # a value no config may have (activation="swish"): the caller's to fix
                raise
            # the overrides ask for a config this layout's preset cannot have (UMT5's per-layer
            # tables beside --set position=table): a layout that does not fit
            results.append((layout, [f"({exc})"], []))
            continue
        results.append((layout, check.missing, check.unexpected))
        checks[layout.name] = check
    exact = [layout for layout, missing, unexpected in results if not missing and not unexpected]
    if exact:
        implied = {layout.name: implied_switches(layout, given if given is not None else keys, overrides)
                   for layout in exact}
        differing = sorted(name for name in SWITCH_FIELDS if len({repr(implied[l.name][name]) for l in exact}) > 1)
        detectable = [layout for layout in exact if layout.detect]
        if not differing and detectable:
            return checks[detectable[0].name]
        raise AmbiguousLayoutError([layout.name for layout in exact], [
            (layout.name, layout.description, {name: implied[layout.name][name] for name in differing})
            for layout in exact], detectable=[layout.name for layout in detectable])
    results.sort(key=lambda r: (len(r[1]) + len(r[2]), not r[0].detect, r[0].name))
    structural = sorted({name for layout, _, _ in results for name in structural_overrides(layout, overrides)})
    notes = [overrides_note(structural, overrides)] if structural else []
    for layout, missing, unexpected in results[:3]:
        named = _structure_by_name(layout, keys, overrides)
        if named:
            notes.append(named)
            break
    raise NoMatchingLayoutError([(layout.name, m, u) for layout, m, u in results], len(keys), note="; ".join(notes))


def plan_import(arrays: Mapping[str, Any], layout: Layout | str | None, overrides: Mapping[str, Any]) -> Plan:
    """The `Plan` for importing `arrays` (foreign key -> tensor) with `layout` (None: detect it).

    Each foreign key is matched against the chosen layout once: detection's check of the winner is
    the plan's, unless the tensors tell a switch the key names alone did not (an `[[infer]]` rule
    with `differs_from`): those change what the layout expects, so the keys are checked again.

    Raises `NoMatchingLayoutError` / `AmbiguousLayoutError` (detection), `KeyMismatchError`
    (missing or unexpected keys), `LayoutError` (the overrides ask for what the layout cannot store).
    """
    overrides = dict(overrides)
    detected = layout is None
    check = _detect(arrays, overrides) if detected else None
    layout = check.layout if detected else load_layout(layout)
    # Structure the key set tells (a shared embedding, a logits projection): as if given.
    overrides = {**layout.inferred_switches(arrays), **overrides}
    note = overrides_note(structural_overrides(layout, overrides), overrides)
    if check is None or check.overrides != {**layout.inferred_switches(list(arrays)), **overrides}:
        try:
            check = check_keys(layout, arrays, overrides)
        except LayoutError as exc:
            if not note or exc.layout != layout.name:
                raise
            raise LayoutError(layout.name, f"{exc.problem} ({note})") from None
    if not check.exact:
        raise KeyMismatchError(layout.name, check.missing, check.unexpected, check.missing_summary, note)
    return Plan(layout, detected, overrides, check)


# -- Orientation -------------------------------------------------------------------------------


def needs_transpose(layout: Layout, entry: Entry, canonical_key: str) -> bool:
    """Whether the system stores this canonical matrix (out, in), the other way round from ours:
    the entry's own `transpose` if it says, else the layout's `matrices`."""
    if entry.transpose is not None:
        return entry.transpose and is_matrix(canonical_key)
    return layout.matrices == "out-in" and is_matrix(canonical_key)


# -- Config ------------------------------------------------------------------------------------

_CHOICES = {"norm_placement": NORM_PLACEMENTS, "layer_norm_form": LAYER_NORM_FORMS, "position": POSITIONS,
            "tgt_pad_mask": PAD_MASK_SIDES, "src_pad_mask": SRC_PAD_MASK_SIDES, "activation": ACTIVATIONS}


def infer_sizes(canonical: dict) -> dict[str, tuple[int, str]]:
    """field -> (value, the canonical key it was read from), for the sizes shapes tell."""
    inferred = {}

    def read(fieldname, ckey, axis):
        if fieldname not in inferred and ckey in canonical and canonical[ckey].ndim > axis:
            inferred[fieldname] = (int(canonical[ckey].shape[axis]), ckey)

    read("src_vocab_size", "encoder.embedding.weight", 0)
    read("d_model", "encoder.embedding.weight", 1)
    # A features source: no source table; its front end's kernel (3, n_mels, D) and the decoder's.
    read("n_mels", "encoder.frontend.conv1.weight", 1)
    read("d_model", "encoder.frontend.conv1.weight", 2)
    read("src_vocab_size", "decoder.embedding.weight", 0)
    # Shared embeddings with a tied output and no bias leave only the shared table to tell it.
    for ckey, axis in (("decoder.embedding.weight", 0), ("output.weight", 1), ("output.bias", 0),
                       ("final_logits_bias", 0), ("encoder.embedding.weight", 0)):
        read("tgt_vocab_size", ckey, axis)
    for ckey in canonical:
        if ckey.endswith(".ffn.linear1.weight"):
            read("d_ff", ckey, 1)
    # A learned relative position bias is (buckets, H): the one tensor whose shape names the heads.
    for stack in ("encoder", "decoder"):
        for ckey in (f"{stack}.position.relative_bias", f"{stack}.layers.0.self_attn.relative_bias"):  # T5, UMT5
            read("relative_buckets", ckey, 0)
            read("n_heads", ckey, 1)
    return inferred


def attention_width(canonical: dict) -> tuple[int, str] | None:
    """(H * K, the canonical key it was read from): the width of the concatenated heads, from the
    first query projection (D, H K); None without attention."""
    for ckey in ("encoder.layers.0.self_attn.q_proj.weight", "decoder.layers.0.self_attn.q_proj.weight"):
        if ckey in canonical and canonical[ckey].ndim == 2:
            return int(canonical[ckey].shape[1]), ckey
    return None


def _head_size(values: dict, canonical: dict, origin: dict, overrides: Mapping[str, Any]) -> None:
    """d_head from the attention width once n_heads is known: K = H K / H. Set when the width is
    not d_model (T5's d_kv apart from d_model / H) or d_head was given (then it must agree)."""
    width = attention_width(canonical)
    if width is None:
        return
    inner, ckey = width
    n, d = values["n_heads"], values.get("d_model")
    given = overrides.get("d_head")
    if inner == d and not given:
        return  # the paper's K = D / H (d_head 0 or absent)
    shape = tuple(canonical[ckey].shape)
    if inner % n:
        raise ConfigError("n_heads", f"{n} heads do not split the attention width {inner} of {origin[ckey]} (canonical "
                          f"{ckey}, shape {shape}) into equal heads")
    if given is not None and given != inner // n:
        raise ConfigError("d_head", f"{given!r} (given) contradicts {origin[ckey]} (canonical {ckey}, shape {shape}), "
                          f"whose width {inner} over n_heads={n} gives d_head={inner // n}")
    values["d_head"] = inner // n


def alternatives(name: str, current: Any = None) -> str:
    """What `--set NAME=` could say instead of `current` ("gelu|gelu-tanh|silu", "false", "N")."""
    if name in _CHOICES:
        return "|".join(c for c in _CHOICES[name] if c != current)
    kind = ModelConfig.__dataclass_fields__[name].type
    if kind == "bool":
        return "true|false" if current is None else setting(not current)
    return "N" if kind == "int" else "..."


def _hint(layout: Layout, name: str) -> str:
    return f"; {layout.hints[name]}" if name in layout.hints else ""


def defaulted_switches(layout: Layout, overrides: Mapping[str, Any], config: ModelConfig, position_stored: bool) -> list[str]:
    """One line per free switch the caller did not give: the value the preset supplied, and how to
    change it. A free switch is one the system takes from its user, so the tensors cannot tell it."""
    lines = []
    for name in sorted(layout.free - layout.required - SIZE_FIELDS):
        if name in overrides or (name == "position" and position_stored):
            continue
        value = getattr(config, name)
        lines.append(f"{name}={setting(value)} (the layout's default: the tensors do not tell it; --set "
                     f"{name}={alternatives(name, value)} if your model differs{_hint(layout, name)})")
    return lines


def build_config(layout, canonical, origin, layers, overrides, position, rows, notes, heads=None) -> ModelConfig:
    values = layout.base_switches()
    inferred = infer_sizes(canonical)
    if heads is not None:  # (H, the foreign key that stores it per head)
        given = overrides.get("n_heads")
        if given is not None and given != heads[0]:
            raise ConfigError("n_heads", f"{given!r} (given) contradicts {heads[1]}, which stores {heads[0]} heads")
        if "n_heads" in inferred and inferred["n_heads"][0] != heads[0]:
            ckey = inferred["n_heads"][1]
            raise ConfigError("n_heads", f"{origin[ckey]} has {inferred['n_heads'][0]} heads, but {heads[1]} stores {heads[0]}")
        values["n_heads"] = heads[0]
    if rows is not None:
        # A table of max_len + position_offset rows: BART's first 2 are never read. A features
        # source's encoder table has max_source_len + position_offset (Whisper's 1500 beside 448).
        enc_rows, dec_rows = rows
        offset = overrides.get("position_offset", values.get("position_offset", 0))
        if isinstance(offset, int) and not isinstance(offset, bool) and offset:
            if min(rows) <= offset:
                raise ConfigError("position_offset", f"{offset}, but the stored position table has only {min(rows)} "
                                  "rows: position p reads row p + position_offset, so the table needs more")
            enc_rows, dec_rows = enc_rows - offset, dec_rows - offset
        if overrides.get("source", values.get("source")) == "features":
            inferred["max_len"] = (dec_rows, TABLES[1])
            inferred["max_source_len"] = (enc_rows, TABLES[0])
        else:
            inferred["max_len"] = (dec_rows, TABLES[0])  # the tables' rows are equal (recognise_positions)
    for fieldname, (value, ckey) in inferred.items():
        given = overrides.get(fieldname)
        if given is not None and given != value:
            shape = tuple(canonical[ckey].shape) if ckey in canonical else f"({value}, ...)"  # a recognised table
            raise ConfigError(fieldname, f"{given!r} (given) contradicts {origin[ckey]} (canonical {ckey}, shape "
                              f"{shape}), which gives {fieldname}={value}")
        values[fieldname] = value
    for stack in ("encoder", "decoder"):
        fieldname, n = f"n_{stack}_layers", layers[stack]
        given = overrides.get(fieldname)
        if given is not None and given != n:
            have = f"layers 0..{n - 1}" if n else "no layers"
            raise ConfigError(fieldname, f"{given!r} (given) contradicts the state dict, which has {stack} {have}")
        values[fieldname] = n
    values.update({k: v for k, v in overrides.items() if k != "notes"})
    if position is not None:
        values["position"] = position
    # Every field the caller must give is named at once, not one per attempt.
    missing = {}
    if layers["encoder"] + layers["decoder"] == 0:
        values.setdefault("n_heads", 1)  # no attention at all: the head count is meaningless
    elif "n_heads" not in overrides and heads is None and "n_heads" not in inferred:
        missing["n_heads"] = ("cannot be read from tensor shapes (every head count splits d_model the same way); give "
                              "it: n_heads=8 in Python, --set n_heads=8 on the command line")
    if "max_len" not in values:
        missing["max_len"] = (f"the {layout.name} state dict stores no position table, so max_len cannot be read from "
                              "it; give the longest sequence the source system accepts (--set max_len=N)")
    for fieldname in sorted(layout.required):
        if fieldname not in overrides:
            missing[fieldname] = (f"the {layout.name} layout cannot tell it (it differs between copies of that system "
                                  f"and is not in the tensors); give it: {fieldname}=... in Python, --set {fieldname}="
                                  f"{alternatives(fieldname)} on the command line{_hint(layout, fieldname)}")
    if len(missing) == 1:
        raise ConfigError(*missing.popitem())
    if missing:
        names = tuple(missing)
        paste = " ".join(f"--set {name}={alternatives(name)}" for name in names)
        raise ConfigError(names[0], f"{len(names)} fields must be given (the weights do not tell them): {', '.join(names)}\n" +
                          "\n".join(f"  ModelConfig.{name}: {problem}" for name, problem in missing.items()) +
                          f"\n  on the command line, all at once: {paste}", fields=names)
    if layers["encoder"] + layers["decoder"]:
        _head_size(values, canonical, origin, overrides)
    return ModelConfig(**values, notes={**(notes or {}), "converted_from": layout.name})


def merge_switches(read: dict[str, Any], defaults: dict[str, Any], overrides: dict[str, Any], source: str) -> dict[str, Any]:
    """Facts read from the model cannot be overridden; defaults (the tutorial's choices) can."""
    for name, value in overrides.items():
        if name in read and read[name] != value:
            raise ConfigError(name, f"{value!r} (given) contradicts the model, whose {source} has {name}={read[name]!r}")
    return {**defaults, **read, **overrides}
