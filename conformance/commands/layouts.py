"""`rosetta layouts [NAME|FILE]`: the built-in layouts, or one layout's rules in full."""

from __future__ import annotations

import argparse
import sys

HELP = "List the built-in weight layouts, or show one layout (built-in name or TOML file) rule by rule."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layout", nargs="?", metavar="NAME|FILE", help="show this layout's switches and key rules")


def _transform(layout, entry) -> str:
    from conformance.convert.layout import needs_transpose

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
    return f"  [{', '.join(words)}]" if words else ""


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
    if layout.switches:
        print("  switches: " + ", ".join(f"{k}={v!r}" for k, v in layout.switches.items()))
    print(f"  matrices stored: {layout.matrices or 'not said'}")
    if layout.free:
        print(f"  free (the user's to set): {', '.join(sorted(layout.free))}")
    if layout.required:
        print(f"  required (--set): {', '.join(sorted(layout.required))}")
    print("  n_heads always, and max_len when no position table is stored, come from --set.")
    if layout.drop:
        print(f"  dropped: {', '.join(layout.drop)}")
    print("  keys:")
    for entry in layout.entries:
        if entry.kind == "alias":
            target = f"same tensor as {entry.same_as.text}"
        else:
            target = ", ".join(t.text for t in entry.targets)
        print(f"    {entry.source.text}\n      -> {target}{_transform(layout, entry)}")
    return 0
