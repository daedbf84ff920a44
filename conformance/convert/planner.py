"""Matching foreign keys to a layout, and choosing a layout by its key set.

`check_keys` needs no tensors: it matches every key against the layout's entries, counts the
layers from the captured indices, builds the key set the layout expects for the structure that
the preset and overrides imply (which parameters exist), and lists missing and unexpected keys.
Auto-detection runs it for every built-in layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from conformance.core.config import ModelConfig
from conformance.convert.errors import AmbiguousLayoutError, LayoutError, NoMatchingLayoutError, listing, overrides_note
from conformance.convert.layout import SIZE_FIELDS, SWITCH_FIELDS, Entry, Layout, builtin_layouts
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

    @property
    def exact(self) -> bool:
        return not self.missing and not self.unexpected


def _match(layout: Layout, key: str, switches: Mapping[str, Any] | None = None) -> tuple[Entry, dict[str, str]] | None:
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


def alias_keys(layout: Layout, stored_keys: Iterable[str]) -> dict[str, tuple[str, Entry]]:
    """alias key -> (the stored key it duplicates, its entry), for every alias of `stored_keys`."""
    out = {}
    aliases = [e for e in layout.entries if e.kind == "alias"]
    for key in stored_keys:
        for entry in aliases:
            values = entry.same_as.match(key)
            if values is not None:
                out[entry.source.format(values)] = (key, entry)
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
        found = _match(layout, key, switches)
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
            found = _match(layout, target, switches)
            if found is None or found[0].kind == "alias":
                raise LayoutError(layout.name, f"{key!r} is declared an alias of {target!r}, which no entry maps")
            effective[target] = found

    layers = {"encoder": 0, "decoder": 0}
    for entry, values in effective.values():
        for target in entry.targets:
            m = _LAYER.match(target.format(values))
            if m:
                layers[m.group(1)] = max(layers[m.group(1)], int(m.group(2)) + 1)
    check = KeyCheck(layout, effective, aliases, dropped, layers)

    skeleton = _skeleton(layout, overrides, layers)
    plan = plan_keys(layout, param_shapes(skeleton), skeleton.to_dict())
    expected = {fkey: not entry.optional for fkey, (entry, _, _) in plan.items()}
    for alias, (_, entry) in alias_keys(layout, plan).items():
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

    Raises `NoMatchingLayoutError` listing the closest layouts with their missing and unexpected
    keys, or `AmbiguousLayoutError` when several match.
    """
    keys = list(keys)
    results = []
    for layout in builtin_layouts():
        try:
            check = check_keys(layout, keys, overrides)
        except LayoutError as exc:  # the overrides ask for a structure this layout cannot store
            results.append((layout, [f"({exc.problem})"], []))
            continue
        results.append((layout, check.missing, check.unexpected))
    exact = [layout for layout, missing, unexpected in results if not missing and not unexpected]
    if len(exact) == 1:
        return exact[0]
    if exact:
        raise AmbiguousLayoutError([layout.name for layout in exact])
    results.sort(key=lambda r: (len(r[1]) + len(r[2]), r[0].name))
    structural = sorted({name for layout, _, _ in results for name in structural_overrides(layout, overrides)})
    raise NoMatchingLayoutError([(layout.name, m, u) for layout, m, u in results], len(keys),
                                note=overrides_note(structural, overrides))
