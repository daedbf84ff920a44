"""`rosetta layouts [NAME|FILE]`: the built-in layouts, or one layout's rules in full."""

from __future__ import annotations

import argparse
import sys

HELP = "List the built-in weight layouts, or show one layout (built-in name or TOML file) rule by rule."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layout", nargs="?", metavar="NAME|FILE", help="show this layout's switches and key rules")


def _transform(layout, entry) -> str:
    from conformance.convert.planner import needs_transpose

    words = []
    if entry.squeeze is not None:
        words.append(f"squeeze axis {entry.squeeze}")
    if entry.kind == "split":
        words.append(f"split axis {entry.axis} into {len(entry.targets)}")
    if entry.kind == "copy":
        words.append(f"one tensor for {len(entry.targets)} keys")
    if any(needs_transpose(layout, entry, key) for target in entry.targets for key in target.examples()):
        words.append("matrices transposed")
    if entry.optional:
        words.append("optional")
    if entry.recomputed:
        words.append("recomputed by the system on load")
    if entry.when:
        words.append("when " + ", ".join(f"{k} = {v!r}" for k, v in entry.when.items()))
    return f"  [{', '.join(words)}]" if words else ""


def _switch_rows(layout) -> list[str]:
    """Every ModelConfig switch as an import through `layout` sets it: the value and its origin
    (the layout's [switches], its preset, or ModelConfig's default), and what --set can change."""
    from conformance.core.config import ModelConfig
    from conformance.convert.errors import setting
    from conformance.convert.planner import alternatives
    from conformance.convert.layout import SWITCH_FIELDS
    from conformance.core.presets import PRESETS

    preset = PRESETS[layout.preset] if layout.preset else {}
    values = {**ModelConfig().to_dict(), **layout.base_switches()}
    rows = []
    for name in (f for f in ModelConfig.__dataclass_fields__ if f in SWITCH_FIELDS):
        origin = "layout" if name in layout.switches else "preset" if name in preset else "ModelConfig default"
        value = setting(values[name])
        hint = f"; {layout.hints[name]}" if name in layout.hints else ""
        if name in layout.required:
            value, origin = "(--set)", f"required: --set {name}={alternatives(name)}{hint}"
        elif name in layout.free:
            origin += f"; free: --set {name}={alternatives(name, values[name])} if yours differs{hint}"
        elif name == "position" and layout.stores_positions():
            form = values[name]
            optional = all(e.optional for e in layout.entries if any(t.text.endswith("position.table") for t in e.targets))
            value, origin = "table", (f"a stored table{f' ({form} when none is stored)' if optional else ''}; read as "
                                      f"{form} when it is exactly that sinusoid, or with --set position={form}")
        rows.append((name, value, origin))
    widths = [max(len(r[i]) for r in rows) for i in (0, 1)]
    return [f"{name:<{widths[0]}}  {value:<{widths[1]}}  {origin}" for name, value, origin in rows]


def run(args: argparse.Namespace) -> int:
    from conformance.convert import LayoutError, builtin_layouts, load_layout

    if not args.layout:
        layouts = builtin_layouts()
        width = max(len(layout.name) for layout in layouts)
        for layout in layouts:
            print(f"{layout.name:<{width}}  {layout.description}")
        print("\n`rosetta layouts NAME` shows a layout's rules; docs/porting.md explains how to write your own.")
        return 0
    try:
        layout = load_layout(args.layout)
    except LayoutError as exc:
        print(f"rosetta layouts: error: {exc}", file=sys.stderr)
        return 2
    print(f"{layout.name}: {layout.description}")
    if layout.path:
        print(f"  file: {layout.path}")
    print(f"  preset: {layout.preset or '(none: ModelConfig defaults)'}")
    print(f"  matrices stored: {layout.matrices or 'not said'}")
    free = sorted(layout.free - layout.required)
    if free:
        print(f"  free (the user's to set; an import not told takes the value below and says so): {', '.join(free)}")
    if layout.required:
        print(f"  required (--set): {', '.join(sorted(layout.required))}")
    print("  switches (value, and where it comes from):")
    for line in _switch_rows(layout):
        print(f"    {line}")
    print("  n_heads (unless per-head tensors or a relative position bias store it), and max_len when no position "
          "table is stored, come from --set (or a Hugging Face folder's config.json).")
    if layout.drop:
        print(f"  dropped: {', '.join(layout.drop)}")
    print("  keys:")
    for entry in layout.entries:
        if entry.kind == "alias":
            target = f"same tensor as {entry.same_as.text}"
        else:
            target = ", ".join(t.text for t in entry.targets)
        print(f"    {entry.source.text}\n      -> {target}{_transform(layout, entry)}")
    if layout.infer:
        print("  switches the keys tell:")
        for rule in layout.infer:
            differs = f" (holding other values than {rule.differs_from})" if rule.differs_from else ""
            show = lambda side: ", ".join(f"{k} = {v!r}" for k, v in side.items())  # noqa: E731
            print(f"    {rule.key}{differs}: present -> {show(rule.present)}; absent -> {show(rule.absent)}")
    if layout.hf is not None:
        hf = layout.hf
        print(f"  Hugging Face folders (model_type {', '.join(hf.model_types)}; {', '.join(hf.architectures)}): "
              "config.json gives")
        for spec in hf.fields:
            default = f"default {spec.default!r}" if spec.has_default else "no default"
            shift = f" = {spec.hf} + {spec.add}" if spec.add else ""
            if spec.values is not None:
                shift = " by " + ", ".join(f"{word} -> {value!r}" for word, value in spec.values.items())
            wins = "; decides over other fields when present" if spec.wins else ""
            print(f"    {spec.hf:<26} -> {', '.join(spec.to)}{shift}  ({default}{wins})")
        for rule in hf.unsupported:
            print(f"    {rule.hf:<26} must be {rule.value!r}{' (transformers 3 field)' if rule.legacy else ''}: {rule.why}")
        print(f"    generation note: {', '.join(hf.generation)}")
        if hf.call:
            print(f"    called as {hf.describe_call(layout.base_switches().get('pad_id', 0))} (pad_id: the model's; "
                  "rosetta compare's default call, a one-graph ONNX export's inputs)")
    if layout.bundle is not None:
        table = layout.bundle
        print(f"  checkpoint files ({{{table.config!r}: ..., {table.weights!r}: state dict}}, recognised by those two "
              f"entries): {table.config!r} gives")
        for spec in table.fields:
            print(f"    {spec.hf:<26} -> {', '.join(spec.to)}")
        if table.ffn_ratio is not None:
            print(f"    d_ff is {table.ffn_ratio} x d_model")
        if table.pad_ids:
            rules = "; ".join(f"{pad} from {least} ids" for least, pad in table.pad_ids)
            print(f"    pad_id by the vocabulary: {rules}")
    if layout.taps:
        options = ", ".join(f"{k} = {v!r}" for k, v in layout.tap_options.items())
        print(f"  taps (where the system computes each tensor, for rosetta compare; {options}):")
        for tap in layout.taps:
            print(f"    {tap.tensor:<22} <- {tap.describe()}")
        print("  a tensor not listed is not exposed by the system")
    return 0
