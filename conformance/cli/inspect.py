"""`rosetta inspect FILE`: what a weights file holds, read without executing anything.

Works on any .safetensors file (our checkpoints and foreign ones: the header is validated by
`conformance.core.checkpoint.read_tensors` before any data is read), and on .pt/.pth/.bin state dicts
(`torch.load(weights_only=True)`) and .npz files. Prints the config of a rosetta checkpoint, a
parameter table (name, shape, dtype, count), the total, and a sha256 of the tensors.

A rosetta sharded directory (a PyTorch Distributed Checkpoint with `rosetta_config.json`, or an
Orbax one with its params and config items; docs/sharded-checkpoints.md) is described from its
metadata alone: its config, whether its index matches that config, and the table; no tensor is read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

HELP = "Show a weights file's config (for rosetta checkpoints), its tensors (name, shape, dtype, count), the total and a sha256 of the tensors."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a .safetensors, .pt/.pth/.bin or .npz file, or a rosetta Distributed "
                        "Checkpoint or Orbax directory")
    parser.add_argument("--key", metavar="NAME", help="the entry of a PyTorch file that holds the state dict")
    parser.add_argument("--layout", metavar="NAME|FILE", help="compare a foreign file's keys with this layout (built-in "
                        "name or TOML file) and list every missing and unexpected key; default: the closest built-in one")


def tensor_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 over the tensors alone, in name order: for each, the UTF-8 name, NUL, the
    safetensors dtype code, the JSON shape, NUL, then the little-endian bytes. Two files with the
    same tensors have the same digest whatever their header order, metadata or container."""
    from conformance.core.checkpoint import DTYPES, dtype_code

    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        code = dtype_code(value.dtype)
        digest.update(name.encode() + b"\0" + code.encode() + json.dumps(list(value.shape)).encode() + b"\0")
        digest.update(np.ascontiguousarray(value, dtype=DTYPES[code]).tobytes())
    return digest.hexdigest()


def _print_fit(name: str, missing: list[str], unexpected: list[str]) -> None:
    """Every missing and unexpected key, one a line: what a wrapper renamed, or left out."""
    if not missing and not unexpected:
        print(f"  keys match the layout {name} exactly")
        return
    print(f"  against the layout {name}: {len(missing)} missing, {len(unexpected)} unexpected")
    for key in missing:
        print(f"    missing:    {key}")
    for key in unexpected:
        print(f"    unexpected: {key}")
    if missing and unexpected:
        print("  if these are the same modules under other names: rosetta convert --rename OLD.=NEW. (a key prefix), "
              f"or a layout file with extends = \"{name}\" that renames them (docs/porting.md)")


def _print_table(index: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """The tensors ({name: (shape, dtype name)}) one a line, and the total."""
    rows = [(name, "x".join(map(str, shape)) or "scalar", dtype, int(np.prod(shape, dtype=np.int64)))
            for name, (shape, dtype) in index.items()]
    if rows:
        widths = [max(len(str(r[i])) for r in rows + [("name", "shape", "dtype", "count")]) for i in range(4)]
        print(f"  {'name':<{widths[0]}}  {'shape':<{widths[1]}}  {'dtype':<{widths[2]}}  {'count':>{widths[3]}}")
        for name, shape, dtype, count in rows:
            print(f"  {name:<{widths[0]}}  {shape:<{widths[1]}}  {dtype:<{widths[2]}}  {count:>{widths[3]},}")
    total = sum(r[3] for r in rows)
    print(f"  total: {len(rows)} tensors, {total:,} values")


def inspect_sharded(path: str, args: argparse.Namespace) -> int:
    """A rosetta DCP or Orbax directory, from its metadata alone (`conformance.convert.sharded`)."""
    from conformance.convert import sharded
    from conformance.core.errors import CheckpointError, InputError

    if args.key or args.layout:
        raise InputError("--key" if args.key else "--layout", f"{path} is a sharded checkpoint in rosetta's own names "
                         "with its config stored beside it: there is no entry to select or layout to compare")
    source = sharded.DcpSource(Path(path)) if sharded.kind(path) == "dcp" else sharded.OrbaxSource(Path(path))
    what = "PyTorch Distributed Checkpoint" if sharded.kind(path) == "dcp" else "Orbax checkpoint"
    print(path)
    status = 0
    try:
        source.check()
        print(f"  rosetta {what} (sharded): config and tensor index agree (no tensor read)")
    except CheckpointError as exc:
        print(f"  rosetta {what} (sharded), but NOT loadable: {exc.problem}")
        status = 2
    print(f"  config: {source.config.summary()}")
    for name, value in source.config.to_dict().items():
        print(f"    {name} = {value!r}")
    _print_table(source.index)
    print(f"  sha256: not computed (the tensors are not read); rosetta convert {path} OUT.safetensors writes the "
          "checkpoint, whose digest rosetta inspect shows")
    sys.stdout.flush()
    return status


def run(args: argparse.Namespace) -> int:
    from conformance.core import checkpoint
    from conformance.core.checkpoint import FORMAT_NAME, read_tensors
    from conformance.convert import NoMatchingLayoutError, read_state_dict
    from conformance.convert.errors import AmbiguousLayoutError, LayoutError
    from conformance.convert import load_layout
    from conformance.convert.planner import check_keys, detect_layout
    from conformance.convert.readers import file_kind
    from conformance.core.errors import CheckpointError

    from conformance.convert import sharded

    path = args.checkpoint
    if sharded.kind(path) == "orbax" or sharded.has_config(path):
        return inspect_sharded(path, args)
    metadata: dict[str, str] = {}
    if file_kind(path) == "safetensors":
        if args.key:
            raise CheckpointError(path, "--key applies to PyTorch files only")
        metadata, tensors = read_tensors(path)
    else:
        tensors = read_state_dict(path, key=args.key)
    print(f"{path}")
    status = 0
    if metadata.get("format") == FORMAT_NAME:
        try:
            config, _ = checkpoint.load(path)
            print(f"  rosetta checkpoint, format_version {metadata.get('format_version')}: valid")
            print(f"  config: {config.summary()}")
            for name, value in config.to_dict().items():
                print(f"    {name} = {value!r}")
        except CheckpointError as exc:
            print(f"  rosetta checkpoint, but NOT loadable: {exc.problem}")
            status = 2
    else:
        print(f"  not a rosetta checkpoint{': metadata ' + ', '.join(sorted(metadata)) if metadata else ''}")
        if args.layout:
            layout = load_layout(args.layout)
            try:
                check = check_keys(layout, tensors, {})
                _print_fit(layout.name, check.missing, check.unexpected)
            except LayoutError as exc:
                print(f"  layout {layout.name}: {exc.problem}")
        else:
            try:
                print(f"  keys match the built-in layout: {detect_layout(tensors).name} (rosetta convert needs no --layout)")
            except NoMatchingLayoutError as exc:
                print("  keys match no built-in layout exactly; the closest:")
                name, missing, unexpected = exc.candidates[0]
                _print_fit(name, missing, unexpected)
                others = ", ".join(f"{n} ({len(m)} missing, {len(u)} unexpected)" for n, m, u in exc.candidates[1:3])
                if others:
                    print(f"  next closest: {others}")
            except AmbiguousLayoutError as exc:  # every candidate and the line that picks it
                print("\n".join(f"  layout: {line}" if i == 0 else f"  {line}" for i, line in enumerate(str(exc).splitlines())))
            except LayoutError as exc:
                first = str(exc).splitlines()
                print(f"  layout: {first[0]}" + (f"\n  {first[1].strip()}" if len(first) > 1 else ""))
    _print_table({name: (np.shape(v), np.asarray(v).dtype.name) for name, v in tensors.items()})
    try:
        print(f"  sha256 (tensors): {tensor_digest(tensors)}")
    except ValueError as exc:  # a dtype safetensors cannot name (e.g. complex)
        print(f"  sha256 (tensors): not computed ({exc})")
    if "sha256" in metadata:
        print(f"  sha256 (file digest, verified): {metadata['sha256']}")
    sys.stdout.flush()
    return status
