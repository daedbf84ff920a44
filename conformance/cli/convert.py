"""`rosetta convert SRC DST`: a foreign checkpoint in, a rosetta checkpoint out (with --to LAYOUT, the other way)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HELP = ("Convert a foreign checkpoint (.safetensors, .pt/.pth/.bin state dict, .npz, Flax .msgpack, an Orbax directory) into a rosetta checkpoint, "
        "choosing the layout by its keys unless --layout is given.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the foreign weights file, Orbax directory or Hugging Face model folder (never modified)")
    parser.add_argument("dst", help="the rosetta checkpoint to write (.safetensors; written atomically)")
    parser.add_argument("--layout", metavar="NAME|FILE", help="a built-in layout (see `rosetta layouts`) or a layout TOML file; default: auto-detect")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a ModelConfig field the tensors cannot tell or that your copy of the system changed, e.g. n_heads=8 (repeatable)")
    parser.add_argument("--dtype", choices=["float64", "float32", "float16", "bfloat16"], help="cast every parameter (default: keep the stored dtype)")
    parser.add_argument("--to", metavar="LAYOUT", help="the other direction: SRC is a rosetta checkpoint, DST the "
                        "foreign file in LAYOUT's key space (.safetensors, .msgpack for Flax's msgpack, or a "
                        "new directory for an Orbax checkpoint)")
    parser.add_argument("--key", metavar="NAME", help="the entry of a PyTorch file that holds the state dict (e.g. model), or the dotted path of the parameter tree in a Flax msgpack file or Orbax checkpoint (e.g. params)")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`["n_heads=8", "mask_fill=-inf"]` -> `{"n_heads": 8, "mask_fill": -inf}`, typed by ModelConfig.

    A field given twice must be given the same value both times (`true` and `1` are the same bool);
    otherwise which one wins would be an accident of argument order."""
    from conformance.core.config import ModelConfig
    from conformance.core.errors import ConfigError

    types = {f.name: f.type for f in dataclasses.fields(ModelConfig) if f.name != "notes"}
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name:
            raise ConfigError(name or item, f"--set {item!r} must look like KEY=VALUE")
        if name not in types:
            raise ConfigError(name, "is not a ModelConfig field (--set)")
        kind = types[name]
        try:
            if kind == "bool":
                lowered = text.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                value = lowered in ("true", "1", "yes")
            elif kind == "int":
                value = int(text)
            elif kind == "float":
                value = float(text)
            else:
                value = text
        except ValueError:
            raise ConfigError(name, f"--set {name}={text!r}: expected a {kind}") from None
        if name in out and repr(out[name]) != repr(value):  # repr: NaN is NaN, and 1e-5 is 0.00001
            raise ConfigError(name, f"given twice with different values: --set {name}={spelled[name]} and "
                              f"--set {name}={text}; give it once")
        out[name], spelled[name] = value, text
    return out


def run(args: argparse.Namespace) -> int:
    from conformance.core import checkpoint
    from conformance.convert import convert_arrays, read_state_dict
    from conformance.convert.errors import AmbiguousLayoutError, LayoutError, NoMatchingLayoutError, TensorError
    from conformance.core.errors import CheckpointError

    src, dst = Path(args.src), Path(args.dst)
    if getattr(args, "to", None):
        return export(src, dst, args.to, parse_sets(args.sets))
    if dst.suffix != ".safetensors":
        raise CheckpointError(dst, "a rosetta checkpoint is a .safetensors file; name the output *.safetensors")
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise CheckpointError(dst, "is the input file; converting never overwrites its input")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    overrides = parse_sets(args.sets)
    from conformance.convert.hf_folder import convert_folder, is_hf_folder

    try:
        if is_hf_folder(src):
            if args.layout not in (None, "hf-marian") or args.key:
                raise CheckpointError(src, "a model folder converts with the hf-marian layout and no --key")
            result = convert_folder(src, dtype=args.dtype, **overrides)
        else:
            arrays = read_state_dict(src, key=args.key)
            result = convert_arrays(arrays, args.layout, dtype=args.dtype, notes={"source_file": src.name}, **overrides)
    except (LayoutError, NoMatchingLayoutError, AmbiguousLayoutError, TensorError) as exc:
        # Nothing has been written: the checkpoint is built in memory and saved only at the end.
        print(f"rosetta convert: error: {exc}", file=sys.stderr)
        return 2
    checkpoint.save(dst, result.config, result.params)
    total = sum(int(v.size) for v in result.params.values())
    dtypes = sorted({v.dtype.name for v in result.params.values()})
    print(f"{src} -> {dst}")
    for line in result.decisions:
        print(f"  {line}")
    print(f"  config: {result.config.summary()}")
    print(f"  {len(result.params)} parameters, {total:,} values, {'/'.join(dtypes)}")
    return 0


def export(src: Path, dst: Path, layout_name: str, target: dict[str, Any]) -> int:
    """`rosetta convert model.safetensors OUT --to LAYOUT`: a rosetta checkpoint out to a foreign
    layout. A nested (Flax) tree goes to a .msgpack file or an Orbax directory; a flat state
    dict to a .safetensors file (its keys only, no rosetta metadata)."""
    from conformance.core import checkpoint
    from conformance.convert import export_state_dict, load_layout
    from conformance.convert.engine import unflatten
    from conformance.convert import trees
    from conformance.core.errors import CheckpointError

    layout = load_layout(layout_name)
    if dst.exists():
        raise CheckpointError(dst, "already exists; converting never overwrites a file or directory")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    config, params = checkpoint.load(src)
    exported = export_state_dict(config, params, layout, **target)
    tree = exported if layout.nested else unflatten(exported)
    if dst.suffix == ".msgpack":
        trees.write_msgpack(dst, tree)
        kind = "Flax msgpack"
    elif dst.suffix == ".safetensors":
        from safetensors.numpy import save_file

        flat = trees.flatten(tree) if layout.nested else exported
        save_file({k: np.ascontiguousarray(v) for k, v in flat.items()}, str(dst))
        kind = "safetensors"
    elif dst.suffix == "":
        trees.write_orbax(dst, tree)
        kind = "Orbax checkpoint"
    else:
        raise CheckpointError(dst, "name the output *.msgpack, *.safetensors, or a new directory (Orbax)")
    print(f"{src} -> {dst} ({kind}, layout {layout.name})")
    print(f"  config: {config.summary()}")
    return 0
