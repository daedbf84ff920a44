"""A foreign state dict through a layout: a weights file (`.safetensors` without rosetta's
metadata, `.pt`/`.pth`/`.bin`, `.npz`, Flax `.msgpack`), an Orbax directory or a foreign PyTorch
Distributed Checkpoint (`conformance.convert.readers`), in the key space of a built-in layout or a
layout file of the user's.

    read     read_source, --rename, then the layout (--layout, else the one whose keys fit); a
             training checkpoint that carries its options (OpenNMT-py's, fairseq's: a layout's
             [checkpoint] table) converts with the switches those options give
    write    `--to LAYOUT` to a file (a flat layout: .safetensors or .pt/.pth/.bin; a nested one:
             .msgpack or .safetensors) or, with no suffix, an Orbax directory (a nested layout)
    verify   the written output read back as `rosetta convert` reads it, through the layout, with
             the checkpoint's sizes and the switches the layout cannot read from tensors: every
             parameter and switch the checkpoint's, bit for bit. The system the layout describes is
             not run (no installed library holds torch-nn-transformer's tutorial model, Flax's
             examples/wmt or AlgoPerf's): the output says so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.formats import verify
from conformance.formats.base import (Format, Options, Read, Written, check_destination, check_export,
                                      conversion_read, conversion_warnings)

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class StateDict(Format):
    name = "foreign state dict"

    def recognises(self, path: Path) -> bool:
        return True  # the last entry of the registry: what no other format recognises is read here

    def writes(self, options: Options, dst: Path) -> bool:
        return options.to is not None

    def check_input(self, src: Path, dst: Path, options: Options) -> None:
        options.overrides(), options.rename_map()  # a bad --set or --rename is said before the file is read

    def read(self, src: Path, options: Options, progress) -> Read:
        from conformance.convert import convert_arrays, rename_prefixes
        from conformance.convert.readers import read_source
        from conformance.convert.system_files import convert_system_file
        from conformance.core.errors import InputError

        overrides, renames = options.overrides(), options.rename_map()
        with conversion_warnings() as caught:
            progress(f"reading {src}")
            # system: a training checkpoint that carries its own options (OpenNMT-py's, fairseq's)
            arrays, system = read_source(src, key=options.key)
            if renames:
                try:
                    arrays = rename_prefixes(arrays, renames)
                except KeyError as exc:
                    raise InputError("--rename", exc.args[0]) from None
            if system is not None:
                system.arrays = arrays
                result = convert_system_file(system, layout=options.layout, dtype=options.dtype,
                                             notes={"source_file": src.name}, **overrides)
            else:
                result = convert_arrays(arrays, options.layout, dtype=options.dtype, notes={"source_file": src.name},
                                        **overrides)
        return conversion_read(result, caught)

    def verify_source(self, src: Path, read: Read, options: Options, progress) -> list:
        if read.layout is not None and read.layout.bundle is not None:  # it names its system: openai-whisper's
            from conformance.formats.own_loader import run_own_loader

            return [run_own_loader(src, read.layout.name, read, "the source file", progress)]
        return [verify.not_run(f"the system that saved {src.name} was not run: a state dict names no system to load "
                               f"it into (its keys chose layout {read.layout.name})")]

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.convert import load_layout
        from conformance.core.errors import CheckpointError

        check_export(src, dst, options)
        layout = load_layout(options.to)
        suffix = dst.suffix.lower()  # OUT.SAFETENSORS is a safetensors file, as checkpoint.save reads the name
        if suffix in TORCH_SUFFIXES and layout.nested:
            raise CheckpointError(dst, f"a PyTorch state dict is flat, and the {layout.name} system's parameters are a "
                                  "Flax tree: name the output *.msgpack, *.safetensors, or a new directory (Orbax)")
        if suffix not in (".msgpack", ".safetensors", "") + TORCH_SUFFIXES:
            folder = layout.hf is not None
            raise CheckpointError(dst, f"name the output *.msgpack, *.safetensors, "
                                  f"{'*.pt, ' if not layout.nested else ''}or a new directory "
                                  f"({'a Hugging Face model folder' if folder else 'Orbax'})")
        check_destination(dst, options.force)

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.convert import export_state_dict, load_layout, trees
        from conformance.convert.engine import unflatten
        from conformance.core import checkpoint

        layout = load_layout(options.to)
        suffix = dst.suffix.lower()
        exported = export_state_dict(read.config, read.params, layout, **options.overrides())
        tree = exported if layout.nested else unflatten(exported)
        if suffix == ".msgpack":
            trees.write_msgpack(staged, tree)
            kind = "Flax msgpack"
        elif suffix == ".safetensors":
            checkpoint.write_tensors(staged, trees.flatten(tree) if layout.nested else exported, {})
            kind = "safetensors"
        elif suffix in TORCH_SUFFIXES:
            write_torch(staged, exported)
            kind = "PyTorch state dict: a dict of tensors, torch.load(path, weights_only=True) reads it"
        else:
            trees.write_orbax(staged, tree)
            kind = "Orbax checkpoint"
        return Written(title=f"{kind}, layout {layout.name}")

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        from conformance.convert import import_state_dict, load_layout, read_state_dict
        from conformance.convert.layout import SIZE_FIELDS
        from conformance.core.errors import ConfigError

        progress(f"reading {staged.name} back through its layout")
        layout = load_layout(options.to)
        runtime = f"read back through layout {layout.name}"
        config = read.config
        # What no tensor says is given, as a user converting the file gives it: the sizes, the
        # switches the user sets (free, required), those a family's config.json would carry,
        # and those of the changed copy (--set).
        carried = {name for spec in layout.hf.fields for name in spec.to} if layout.hf else set()
        acts = config.canonical()  # d_head and max_source_len as the tensors give them, not as 0
        told = {name: acts[name] for name in SIZE_FIELDS | layout.free | layout.required | carried}
        told.update(options.overrides())
        try:
            state = read_state_dict(staged)
            again_config, again = import_state_dict(state, layout, **told)
        except (ConfigError, ValueError) as exc:
            return [verify.failed(runtime, f"{staged.name} does not read back: {type(exc).__name__}: {exc}")]
        differs = verify.round_trip(config, read.params, again_config, again)
        if differs:
            return [verify.failed(runtime, differs)]
        verdicts = [verify.passed(runtime, "every parameter and switch as the checkpoint's, bit for bit")]
        if layout.hf is not None and not layout.nested and not options.sets:
            verdicts.append(run_in_transformers(state, layout, read, progress))
        else:
            why = "--set says your copy of it computes otherwise" if options.sets else "no installed library holds it"
            verdicts.append(verify.not_run(f"the {layout.name} system itself was not run: {why}"))
        return verdicts


def run_in_transformers(state, layout, read: Read, progress) -> verify.Verdict:
    """A Hugging Face family's state dict written as a file: its tensors in a folder of that family
    (the config.json an export writes), loaded by transformers beside the oracle."""
    import tempfile

    from conformance.convert.hf_folder import write_folder
    from conformance.formats.hf_runtime import run_folder

    progress(f"running the written tensors in transformers' {layout.hf.architectures[0]}")
    with tempfile.TemporaryDirectory(prefix="rosetta-verify-") as scratch:
        folder = Path(scratch) / "folder"
        write_folder(folder, read.config, state, layout)
        return run_folder(folder, layout, read.config, read.params, "the written tensors")


def write_torch(dst: Path, state: dict[str, np.ndarray]) -> None:
    """A flat state dict as a PyTorch file of plain tensors (no module, no pickled class: what
    `torch.load(weights_only=True)` reads and `load_state_dict` takes), written atomically."""
    from conformance.convert.arrays import as_torch

    _torch_module(dst)
    # copies: torch.save keeps whole storages
    write_torch_object(dst, {key: as_torch(np.array(value)) for key, value in state.items()})


def write_torch_object(dst: Path, obj) -> None:
    """`obj` (tensors in dicts, plain numbers) as a PyTorch file, written atomically."""
    import io

    from conformance.core.checkpoint import atomic_write

    torch = _torch_module(dst)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(dst, [buffer.getvalue()])


def _torch_module(dst: Path):
    from conformance.core.errors import CheckpointError

    try:
        import torch
    except ImportError:
        raise CheckpointError(dst, "writing a PyTorch file needs PyTorch (pip install torch); or name the output "
                              "*.safetensors, which torch reads with safetensors.torch.load_file") from None
    return torch


FORMAT = StateDict()
