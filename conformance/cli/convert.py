"""`rosetta convert SRC DST`: a foreign checkpoint in, a rosetta checkpoint out (with --to LAYOUT, the other way)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

HELP = ("Convert a foreign checkpoint (.safetensors, .pt/.pth/.bin state dict, .npz, Flax .msgpack, an Orbax or "
        "PyTorch Distributed Checkpoint directory) into a rosetta checkpoint, "
        "choosing the layout by its keys unless --layout is given.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the foreign weights file, Orbax directory or Hugging Face model folder (never modified)")
    parser.add_argument("dst", help="the rosetta checkpoint to write (.safetensors; written atomically)")
    parser.add_argument("--layout", metavar="NAME|FILE", help="a built-in layout (see `rosetta layouts`) or a layout TOML file; default: auto-detect")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a ModelConfig field the tensors cannot tell or that your copy of the system changed, e.g. n_heads=8 (repeatable)")
    parser.add_argument("--dtype", choices=["float64", "float32", "float16", "bfloat16"], help="cast every parameter (default: keep the stored dtype)")
    parser.add_argument("--to", metavar="LAYOUT", help="the other direction: SRC is a rosetta checkpoint, DST the "
                        "foreign file in LAYOUT's key space (.safetensors, .pt/.pth/.bin for a PyTorch state dict of "
                        "tensors, .msgpack for Flax's msgpack, or a "
                        "new directory: for a Hugging Face layout (hf-marian, hf-bart, ...) a model folder that its "
                        "from_pretrained loads, otherwise an Orbax checkpoint); `--to dcp` / `--to orbax`: a new "
                        "PyTorch Distributed Checkpoint / Orbax directory in rosetta's own names, which "
                        "impl_torch.load_distributed / impl_jax.load_sharded read onto any mesh")
    parser.add_argument("--taps", action="store_true",
                        help="with --to onnx: add the tensors `rosetta check` compares (embeddings, attention weights, "
                             "each sublayer's output) to the graphs as outputs of those names")
    parser.add_argument("--quantization", choices=["float32", "int8", "int8_float32", "bfloat16", "float16"],
                        help="with --to ctranslate2: the type CTranslate2 stores the weights in (its names; default "
                             "float32), its default compute type when loaded (docs/deployment.md)")
    parser.add_argument("--key", metavar="NAME", help="the entry of a PyTorch file that holds the state dict (e.g. model), or the dotted path of the parameter tree in a Flax msgpack file or Orbax checkpoint (e.g. params)")
    parser.add_argument("--force", action="store_true",
                        help="replace DST if it exists (a file only, never a directory; the new file is written beside it "
                             "and renamed over it once complete, so an interrupted run leaves the old one)")
    parser.add_argument("--rename", dest="renames", action="append", default=[], metavar="OLD=NEW",
                        help="rename a key prefix before matching a layout, e.g. embed_src.=src_tok_emb.embedding. "
                             "(repeatable): your own wrapper, a built-in layout, no layout file")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`["n_heads=8", "mask_fill=-inf"]` -> `{"n_heads": 8, "mask_fill": -inf}`, typed by ModelConfig.

    A field given twice must be given the same value both times (`true` and `1` are the same bool);
    otherwise which one wins would be an accident of argument order."""
    from conformance.core.config import ModelConfig
    from conformance.convert.errors import KIND_WORDS
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
            raise ConfigError(name, f"--set {name}={text!r}: expected {KIND_WORDS[kind]}") from None
        if name in out and repr(out[name]) != repr(value):  # repr: NaN is NaN, and 1e-5 is 0.00001
            raise ConfigError(name, f"given twice with different values: --set {name}={spelled[name]} and "
                              f"--set {name}={text}; give it once")
        out[name], spelled[name] = value, text
    return out


def parse_renames(items: list[str]) -> dict[str, str]:
    """`["embed_src.=src_tok_emb.embedding."]` -> `{"embed_src.": "src_tok_emb.embedding."}`."""
    from conformance.core.errors import InputError

    out: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old:
            raise InputError("--rename", f"{item!r} must look like OLD=NEW (a key prefix and its new name)")
        if old in out and out[old] != new:
            raise InputError("--rename", f"{old!r} is renamed twice ({out[old]!r} and {new!r}); give it once")
        out[old] = new
    return out


def run(args: argparse.Namespace) -> int:
    from conformance.core import checkpoint
    from conformance.convert import convert_arrays, rename_prefixes
    from conformance.convert.readers import read_source
    from conformance.convert.system_files import convert_system_file
    from conformance.core.errors import InputError
    from conformance.cli.progress import Status
    from conformance.convert.engine import PaddingWarning
    from conformance.convert.errors import AmbiguousLayoutError, LayoutError, NoMatchingLayoutError, TensorError
    from conformance.core.errors import CheckpointError

    from conformance.convert import sharded

    src, dst = Path(args.src), Path(args.dst)
    if getattr(args, "to", None) == ONNX:
        return export_onnx(src, dst, args)
    if getattr(args, "to", None) == CTRANSLATE2:
        return export_ctranslate2(src, dst, args)
    if getattr(args, "to", None) in sharded.KINDS:
        return export_sharded(src, dst, args)
    if getattr(args, "quantization", None):
        raise InputError("--quantization", "chooses how CTranslate2 stores the weights: give it with --to ctranslate2")
    if getattr(args, "taps", False):
        raise InputError("--taps", "adds graph outputs to an ONNX export: give it with --to onnx")
    if getattr(args, "to", None):
        return export(src, dst, args.to, parse_sets(args.sets), force=getattr(args, "force", False))
    if dst.suffix.lower() != ".safetensors":
        raise CheckpointError(dst, "a rosetta checkpoint is a .safetensors file; name the output *.safetensors")
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise CheckpointError(dst, "is the input file; converting never overwrites its input")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    if dst.is_dir():
        raise CheckpointError(dst, "is a directory; name the checkpoint file to write")
    check_destination(dst, getattr(args, "force", False))
    if checkpoint.is_checkpoint(src):
        return resave(src, dst, args)
    if sharded.kind(src) == "orbax" or sharded.has_config(src):  # a foreign DCP directory goes by its layout below
        return import_sharded(src, dst, args)
    overrides = parse_sets(args.sets)
    renames = parse_renames(args.renames)
    from conformance.convert.hf_folder import config_beside, convert_folder, is_hf_folder

    beside = config_beside(src)
    if beside is not None and args.layout is not None and not _reads_folders(args.layout):
        raise CheckpointError(src, f"sits beside {beside}, which describes the model; it converts with that config "
                              f"(the layout its model_type names), not --layout {args.layout}: move the file out of "
                              "the folder to convert it on its own")
    status = Status("rosetta convert")
    try:
        with warnings.catch_warnings(record=True) as caught, status:
            warnings.simplefilter("always", PaddingWarning)
            status(f"reading {src}")
            if is_hf_folder(src):
                if (args.layout is not None and not _reads_folders(args.layout)) or args.key or renames:
                    raise CheckpointError(src, "a model folder converts with the layout its config.json's model_type "
                                          "names (hf-marian, hf-bart, ...), no --key and no --rename")
                result = convert_folder(src, dtype=args.dtype, layout=args.layout, **overrides)
            else:
                arrays, system = read_source(src, key=args.key)  # system: a checkpoint with its own options
                if renames:
                    try:
                        arrays = rename_prefixes(arrays, renames)
                    except KeyError as exc:
                        raise InputError("--rename", exc.args[0]) from None
                if beside is not None:
                    result = convert_folder(src.parent, dtype=args.dtype, weights=arrays, source_file=src.name,
                                            layout=args.layout, **overrides)
                elif system is not None:
                    system.arrays = arrays
                    result = convert_system_file(system, layout=args.layout, dtype=args.dtype,
                                                 notes={"source_file": src.name}, **overrides)
                else:
                    result = convert_arrays(arrays, args.layout, dtype=args.dtype, notes={"source_file": src.name},
                                            **overrides)
    except (LayoutError, NoMatchingLayoutError, AmbiguousLayoutError, TensorError) as exc:
        # Nothing has been written: the checkpoint is built in memory and saved only at the end.
        print(f"rosetta convert: error: {flagged(exc)}", file=sys.stderr)
        return 2
    with status:
        status(f"writing {dst}")
        checkpoint.save(dst, result.config, result.params)
        status("a trial forward pass (NumPy, 3 padded rows)")
        trial = trial_run(result.config, result.params)
    total = sum(int(v.size) for v in result.params.values())
    dtypes = sorted({v.dtype.name for v in result.params.values()})
    print(f"{src} -> {dst}")
    for line in result.decisions:
        if not line.startswith("WARNING:"):  # said on stderr below
            print(f"  {line}")
    print(f"  config: {result.config.summary()}")
    print(f"  {len(result.params)} parameters, {total:,} values, {'/'.join(dtypes)}")
    problems = [str(w.message) for w in caught if issubclass(w.category, PaddingWarning)]
    problems += trial
    for problem in problems:
        print(f"rosetta convert: warning: {problem}", file=sys.stderr)
    if not problems:
        print("  trial forward pass (NumPy, 3 padded rows): every logit finite")
    return 0


def flagged(error: Exception) -> Exception:
    """A cast's overflow as the command line asked for it: with the --dtype flag the user typed."""
    from conformance.convert.engine import CastOverflowError
    from conformance.convert.errors import TensorError

    if isinstance(error, CastOverflowError):
        return TensorError(error.key, f"{error.problem} than --dtype {error.dtype}")
    return error


def check_destination(dst: Path, force: bool) -> None:
    """Refuse, before any work, an output that exists (unless `force`) or whose directory cannot
    be written: said after a long conversion, either would waste it."""
    from conformance.core.errors import CheckpointError

    if dst.exists() and not force:
        raise CheckpointError(dst, "already exists; pass --force to replace it (the new file is written beside it "
                              "and renamed over it only once complete)")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(dst, f"cannot write: permission denied on the directory {str(parent)!r}")


def resave(src: Path, dst: Path, args: argparse.Namespace) -> int:
    """`rosetta convert model.safetensors out.safetensors [--dtype D]` with a rosetta checkpoint in:
    its config is stored in it, so nothing is detected or set; it is loaded (every check of
    `checkpoint.load`), cast when --dtype is given (an overflow is refused by key) and saved."""
    from conformance.core import checkpoint
    from conformance.convert.engine import CastOverflowError, cast
    from conformance.core.errors import InputError

    given = [flag for flag, value in (("--layout", args.layout), ("--set", args.sets), ("--rename", args.renames),
                                      ("--key", args.key)) if value]
    if given:
        raise InputError(given[0], f"{src} is a rosetta checkpoint, whose config is stored in it: there is no layout to "
                         f"choose and nothing to set or rename; convert it with --dtype only (or none)")
    config, params = checkpoint.load(src)
    stored = next(iter(params.values())).dtype.name
    if args.dtype and args.dtype != stored:
        try:
            params = {key: cast(value, args.dtype, key) for key, value in params.items()}
        except CastOverflowError as exc:
            raise flagged(exc) from None
    checkpoint.save(dst, config, params)
    problems = trial_run(config, params)
    total = sum(int(v.size) for v in params.values())
    print(f"{src} -> {dst}")
    print(f"  a rosetta checkpoint: " + (f"cast {stored} -> {args.dtype}" if args.dtype and args.dtype != stored
                                         else f"re-saved as stored ({stored})"))
    print(f"  config: {config.summary()}")
    print(f"  {len(params)} parameters, {total:,} values, {next(iter(params.values())).dtype.name}")
    for problem in problems:
        print(f"rosetta convert: warning: {problem}", file=sys.stderr)
    if not problems:
        print("  trial forward pass (NumPy, 3 padded rows): every logit finite")
    return 0


def _reads_folders(layout_name: str) -> bool:
    """Whether a layout (a built-in name or a TOML file) reads Hugging Face folders (has `[hf]`)."""
    from conformance.convert import load_layout

    return load_layout(layout_name).hf is not None


def trial_run(config, params) -> list[str]:
    """One small forward pass of the converted model on the NumPy backend: a model whose logits
    are not finite was converted with a wrong switch (often pad_id or mask_fill), and it is better
    said now than found at the first real batch. Returns the problems found (none: [])."""
    import numpy as np

    import impl_numpy
    from conformance.check.report import fixed_batch

    src, tgt = fixed_batch(config)
    # In the stored dtype where NumPy has it: float32 overflows where float64 would not.
    stored = next(iter(params.values())).dtype.name
    with np.errstate(all="ignore"):
        stored = stored if stored in ("float32", "float64") else "float32"
        model = impl_numpy.Model(config, params, dtype=stored)
        logits = np.asarray(model(src, tgt).logits)
    bad = logits.size - int(np.isfinite(logits).sum())
    if not bad:
        return []
    rows = sorted({int(r) for r in np.argwhere(~np.isfinite(logits))[:, 0]})
    return [f"a trial forward pass on 3 padded rows (pad_id={config.pad_id}) gave {bad} of {logits.size} logits that are "
            f"NaN or infinite (rows {', '.join(map(str, rows))}) computed in {stored}: "
            "check pad_id, mask_fill and norm_placement (--set), and the weights' magnitudes"]


TORCH_SUFFIXES = (".pt", ".pth", ".bin")
ONNX = "onnx"  # `--to onnx`: graphs, not a layout (docs/deployment.md)


def export_onnx(src: Path, dst: Path, args: argparse.Namespace) -> int:
    """`rosetta convert model.safetensors DIR --to onnx [--taps]`: a new directory with the
    encoder and decoder graphs of `conformance.check.onnx_export`, traced by torch's exporter from
    impl_torch's model in float32, the directory made whole or not at all."""
    from conformance.core import checkpoint
    from conformance.core.errors import CheckpointError, InputError

    given = [flag for flag, value in (("--layout", args.layout), ("--set", args.sets), ("--rename", args.renames),
                                      ("--key", args.key), ("--force", getattr(args, "force", False)),
                                      ("--quantization", getattr(args, "quantization", None))) if value]
    if given:
        raise InputError(given[0], "--to onnx exports a rosetta checkpoint as it is stored, into a new directory: "
                         "nothing to choose, set, rename or replace")
    if args.dtype not in (None, "float32"):
        raise InputError("--dtype", f"--to onnx exports float32 graphs only, not {args.dtype}")
    if dst.exists():
        raise CheckpointError(dst, "already exists; the ONNX graphs go into a new directory: name one that "
                              "does not exist")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    try:
        import onnxscript  # noqa: F401 - torch's exporter needs it, and says so only after tracing
        from conformance.check import onnx_export
    except ImportError as exc:
        raise InputError("--to", f"exporting to ONNX needs torch, onnx and onnxscript ({exc}): "
                         "pip install 'rosetta-transformer[torch,onnx]'") from None
    config, params = checkpoint.load(src)
    graphs = onnx_export.export_bytes(config, params, "float32", taps=args.taps)  # impl_torch's Model, traced
    with checkpoint.atomic_directory(dst) as folder:
        folder.mkdir()
        written = [folder / onnx_export.ENCODER_FILE, folder / onnx_export.DECODER_FILE]
        for path, graph in zip(written, graphs):
            path.write_bytes(graph)
    print(f"{src} -> {dst} (ONNX opset {onnx_export.OPSET}, float32{', with taps' if args.taps else ''}: "
          f"{', '.join(path.name for path in written)})")
    print(f"  config: {config.summary()}")
    return 0


CTRANSLATE2 = "ctranslate2"  # `--to ctranslate2`: CTranslate2's converter, through a Hugging Face Marian, T5 or BART folder


def export_ctranslate2(src: Path, dst: Path, args: argparse.Namespace) -> int:
    """`rosetta convert model.safetensors DIR --to ctranslate2 [--quantization T]`: the checkpoint
    as a Hugging Face folder of its family (`--to hf-marian`, `hf-t5` or `hf-bart`:
    `ctranslate2_check.family_of`), converted by CTranslate2's own
    TransformersConverter into a new directory, made whole or not at all
    (`conformance.check.ctranslate2_check.convert`)."""
    from conformance.check import ctranslate2_check
    from conformance.core import checkpoint
    from conformance.core.errors import InputError

    given = [flag for flag, value in (("--layout", args.layout), ("--set", args.sets), ("--rename", args.renames),
                                      ("--key", args.key), ("--force", getattr(args, "force", False)),
                                      ("--dtype", args.dtype), ("--taps", getattr(args, "taps", False))) if value]
    if given:
        raise InputError(given[0], "--to ctranslate2 converts a rosetta checkpoint as it is stored, into a new "
                         "directory: choose the stored type with --quantization; nothing to set, rename or replace")
    ctranslate2_check.require()
    config, params = checkpoint.load(src)
    quantization = getattr(args, "quantization", None) or "float32"
    ctranslate2_check.convert(config, params, dst, quantization)
    family = ctranslate2_check.family_of(config, params).layout
    print(f"{src} -> {dst} (CTranslate2 model, {quantization} weights, through a Hugging Face {family} folder)")
    print(f"  config: {config.summary()}")
    return 0


def import_sharded(src: Path, dst: Path, args: argparse.Namespace) -> int:
    """`rosetta convert DIR out.safetensors [--dtype D]` with a PyTorch Distributed Checkpoint or a
    rosetta Orbax directory in: its config is stored beside the tensors, which are read, checked
    and written one at a time (`conformance.convert.sharded.to_safetensors`)."""
    from conformance.cli.progress import Status
    from conformance.convert import sharded
    from conformance.convert.engine import CastOverflowError
    from conformance.core.errors import InputError
    from conformance.core.params import param_shapes

    source = sharded.open_source(src)  # an Orbax directory whose config item is not rosetta's is refused here
    given = [flag for flag, value in (("--layout", args.layout), ("--set", args.sets), ("--rename", args.renames),
                                      ("--key", args.key)) if value]
    if given:
        raise InputError(given[0], f"{src} is a sharded checkpoint in rosetta's own names with its config stored "
                         "beside it: there is no layout to choose and nothing to set or rename; convert it with "
                         "--dtype only (or none)")
    status = Status("rosetta convert")
    with status:
        status(f"reading {src} one tensor at a time")
        try:
            config, total = sharded.to_safetensors(source, dst, args.dtype, progress=status)
        except CastOverflowError as exc:
            raise flagged(exc) from None
    print(f"{src} -> {dst}")
    print(f"  a {'PyTorch Distributed Checkpoint' if sharded.kind(src) == 'dcp' else 'rosetta Orbax checkpoint'}, "
          "read one tensor at a time" + (f", cast to {args.dtype}" if args.dtype else ""))
    print(f"  config: {config.summary()}")
    print(f"  {len(param_shapes(config))} parameters, {total:,} values")
    return 0


def export_sharded(src: Path, dst: Path, args: argparse.Namespace) -> int:
    """`rosetta convert model.safetensors DIR --to dcp|orbax`: the checkpoint as a new PyTorch
    Distributed Checkpoint or Orbax directory under its own names, with its config, which
    `impl_torch.load_distributed` / `impl_jax.load_sharded` read onto any mesh."""
    from conformance.convert import sharded
    from conformance.core import checkpoint
    from conformance.core.errors import CheckpointError, InputError

    given = [flag for flag, value in (("--layout", args.layout), ("--set", args.sets), ("--rename", args.renames),
                                      ("--key", args.key), ("--force", getattr(args, "force", False)),
                                      ("--dtype", args.dtype), ("--taps", getattr(args, "taps", False)),
                                      ("--quantization", getattr(args, "quantization", None))) if value]
    if given:
        raise InputError(given[0], f"--to {args.to} writes a rosetta checkpoint as it is stored, under its own names, "
                         "into a new directory: nothing to choose, set, rename, cast or replace")
    if dst.exists():
        raise CheckpointError(dst, "already exists; a sharded checkpoint goes into a new directory: name one that "
                              "does not exist")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    config, params = checkpoint.load(src)
    sharded.write(dst, args.to, config, params)
    what = "PyTorch Distributed Checkpoint" if args.to == "dcp" else "Orbax checkpoint (impl_jax.save_state's form)"
    print(f"{src} -> {dst} ({what}, rosetta's parameter names)")
    print(f"  config: {config.summary()}")
    return 0


def export(src: Path, dst: Path, layout_name: str, target: dict[str, Any], force: bool = False) -> int:
    """`rosetta convert model.safetensors OUT --to LAYOUT`: a rosetta checkpoint out to a foreign
    layout. A nested (Flax) tree goes to a .msgpack file or an Orbax directory; a flat state
    dict to a .safetensors file (its keys only, no rosetta metadata) or a PyTorch .pt file (a
    plain dict of tensors, which `torch.load(weights_only=True)` reads)."""
    from conformance.core import checkpoint
    from conformance.convert import export_state_dict, load_layout
    from conformance.convert.engine import unflatten
    from conformance.convert import trees
    from conformance.core.errors import CheckpointError

    layout = load_layout(layout_name)
    suffix = dst.suffix.lower()  # OUT.SAFETENSORS is a safetensors file, as checkpoint.save reads the name
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise CheckpointError(dst, "is the input file; converting never overwrites its input")
    if dst.is_dir() or (dst.exists() and suffix == ""):
        raise CheckpointError(dst, "already exists; a directory is never replaced: name a new one")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")
    folder = layout.hf is not None  # a directory is a Hugging Face model folder; for Flax, Orbax
    if suffix in TORCH_SUFFIXES and layout.nested:
        raise CheckpointError(dst, f"a PyTorch state dict is flat, and the {layout.name} system's parameters are a "
                              "Flax tree: name the output *.msgpack, *.safetensors, or a new directory (Orbax)")
    if suffix not in (".msgpack", ".safetensors", "") + TORCH_SUFFIXES:
        raise CheckpointError(dst, f"name the output *.msgpack, *.safetensors, {'*.pt, ' if not layout.nested else ''}"
                              f"or a new directory ({'a Hugging Face model folder' if folder else 'Orbax'})")
    check_destination(dst, force)
    config, params = checkpoint.load(src)
    exported = export_state_dict(config, params, layout, **target)
    tree = exported if layout.nested else unflatten(exported)
    problems: list[str] = []
    if suffix == ".msgpack":
        trees.write_msgpack(dst, tree)
        kind = "Flax msgpack"
    elif suffix == ".safetensors":
        flat = trees.flatten(tree) if layout.nested else exported
        checkpoint.write_tensors(dst, flat, {})
        kind = "safetensors"
    elif suffix in TORCH_SUFFIXES:
        write_torch(dst, exported)
        kind = "PyTorch state dict: a dict of tensors, torch.load(path, weights_only=True) reads it"
    elif folder:
        from conformance.convert.hf_folder import write_folder

        problems = write_folder(dst, config, exported, layout)
        kind = f"Hugging Face folder: {', '.join(sorted(p.name for p in dst.iterdir()))}"
    else:
        trees.write_orbax(dst, tree)
        kind = "Orbax checkpoint"
    print(f"{src} -> {dst} ({kind}, layout {layout.name})")
    print(f"  config: {config.summary()}")
    for problem in problems:
        print(f"rosetta convert: warning: {problem}", file=sys.stderr)
    return 0


def write_torch(dst: Path, state: dict[str, np.ndarray]) -> None:
    """A flat state dict as a PyTorch file of plain tensors (no module, no pickled class: what
    `torch.load(weights_only=True)` reads and `load_state_dict` takes), written atomically."""
    import io

    from conformance.cli.common import write_outputs
    from conformance.core.errors import CheckpointError

    try:
        import torch
    except ImportError:
        raise CheckpointError(dst, "writing a PyTorch file needs PyTorch (pip install torch); or name the output "
                              "*.safetensors, which torch reads with safetensors.torch.load_file") from None
    from conformance.convert.arrays import as_torch

    tensors = {key: as_torch(np.array(value)) for key, value in state.items()}  # copies: torch.save keeps whole storages
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    write_outputs({str(dst): (dst, buffer.getvalue())})
