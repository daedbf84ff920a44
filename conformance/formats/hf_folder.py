"""Hugging Face model folders: config.json (+ generation_config.json) beside the weights
(`conformance.convert.hf_folder`), and a weights file of such a folder given on its own.

    read           convert_folder: config.json's model_type picks the layout; the weights are
                   model.safetensors, its sharded index, pytorch_model.bin, its sharded index
                   (pytorch_model.bin.index.json), or Flax msgpack (one file or sharded)
    write          `--to hf-<family>` with no suffix: write_folder (config.json, generation_config.json,
                   model.safetensors) that the family's from_pretrained loads
    verify         transformers' from_pretrained on the written folder (`hf_runtime`, eager attention,
                   in the stored dtype): no weight missing; every parameter and config field it then
                   holds, read back through the layout (`from_hf`), the checkpoint's; its logits on
                   the probe with its attention_mask, computed in float32, the float64 oracle's within
                   the float32 tolerance (float32: transformers computes parts of a float64 model
                   in float32, T5LayerNorm's variance and the sinusoid tables among them). With
                   --set (a changed copy of the family) transformers' own class is not the model:
                   the folder is read back through the layout instead, and the output says so
    verify_source  an import of a folder: the folder itself run by transformers beside the oracle
                   on the converted parameters, the same way; this is what catches a config.json
                   read wrong. A folder of Flax weights only, which transformers 5 does not
                   read, is said not to have been run; one that transformers refuses or that
                   raises while it runs fails the check, as a written one would.
"""

from __future__ import annotations

from pathlib import Path

from conformance.formats import verify
from conformance.formats.base import (Format, Options, Read, Written, check_export, conversion_read,
                                      conversion_warnings)
from conformance.formats.hf_runtime import run_folder

# The weights files transformers' from_pretrained reads (a Flax folder's msgpack it does not, since 5.0).
TORCH_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _reads_folders(layout_name: str) -> bool:
    """Whether a layout (a built-in name or a TOML file) reads Hugging Face folders (has `[hf]`)."""
    from conformance.convert import load_layout

    return load_layout(layout_name).hf is not None


class HFFolder(Format):
    name = "Hugging Face model folder"

    def recognises(self, path: Path) -> bool:
        from conformance.convert.hf_folder import config_beside, is_hf_folder

        return is_hf_folder(path) or config_beside(path) is not None

    def writes(self, options: Options, dst: Path) -> bool:
        from conformance.convert import LayoutError, load_layout

        if options.to is None or dst.suffix != "":
            return False
        try:
            return load_layout(options.to).hf is not None
        except LayoutError:  # an unknown name: state_dict's refusal says so
            return False

    def check_input(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.convert.hf_folder import config_beside, is_hf_folder
        from conformance.core.errors import CheckpointError

        options.overrides(), options.rename_map()  # a bad --set or --rename is said before the folder is read
        beside = None if is_hf_folder(src) else config_beside(src)
        if beside is not None and options.layout is not None and not _reads_folders(options.layout):
            raise CheckpointError(src, f"sits beside {beside}, which describes the model; it converts with that config "
                                  f"(the layout its model_type names), not --layout {options.layout}: move the file out "
                                  "of the folder to convert it on its own")

    def read(self, src: Path, options: Options, progress) -> Read:
        from conformance.convert import read_state_dict, rename_prefixes
        from conformance.convert.hf_folder import convert_folder, is_hf_folder
        from conformance.core.errors import CheckpointError, InputError

        overrides, renames = options.overrides(), options.rename_map()
        with conversion_warnings() as caught:
            progress(f"reading {src}")
            if is_hf_folder(src):
                if (options.layout is not None and not _reads_folders(options.layout)) or options.key or renames:
                    raise CheckpointError(src, "a model folder converts with the layout its config.json's model_type "
                                          "names (hf-marian, hf-bart, ...), no --key and no --rename")
                result = convert_folder(src, dtype=options.dtype, layout=options.layout, **overrides)
            else:
                arrays = read_state_dict(src, key=options.key)
                if renames:
                    try:
                        arrays = rename_prefixes(arrays, renames)
                    except KeyError as exc:
                        raise InputError("--rename", exc.args[0]) from None
                result = convert_folder(src.parent, dtype=options.dtype, weights=arrays, source_file=src.name,
                                        layout=options.layout, **overrides)
        return conversion_read(result, caught)

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.formats.base import check_destination

        check_export(src, dst, options)
        check_destination(dst, options.force)

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.convert import export_state_dict, load_layout
        from conformance.convert.hf_folder import write_folder

        layout = load_layout(options.to)
        exported = export_state_dict(read.config, read.params, layout, **options.overrides())
        problems = write_folder(staged, read.config, exported, layout)
        kind = f"Hugging Face folder: {', '.join(sorted(p.name for p in staged.iterdir()))}"
        return Written(title=f"{kind}, layout {layout.name}", warnings=problems)

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        from conformance.convert import load_layout
        from conformance.convert.hf_folder import convert_folder

        layout = load_layout(options.to)
        if options.sets:  # a changed copy of the family: transformers' own class is not it
            progress("reading the written folder back")
            again = convert_folder(staged, **options.overrides())
            differs = verify.round_trip(read.config, read.params, again.config, again.params)
            runtime = f"read back through layout {layout.name}"
            if differs:
                return [verify.failed(runtime, differs)]
            return [verify.passed(runtime, "every parameter and switch as the checkpoint's"),
                    verify.not_run(f"transformers' {layout.hf.architectures[0]} was not run: --set says your copy of "
                                   "the system computes otherwise")]
        progress("checking the written folder with transformers")
        return [run_folder(staged, layout, read.config, read.params, "the written folder")]

    def verify_source(self, src: Path, read: Read, options: Options, progress) -> list:
        from conformance.convert.hf_folder import is_hf_folder

        if options.sets:
            return [verify.not_run(f"{src} was not run by transformers: --set changed what the folder's config.json "
                                   "says, so its own system is not the converted model")]
        if not is_hf_folder(src):
            return [verify.not_run(f"the folder beside {src.name} was not run by transformers: the file was converted "
                                   "on its own, and the folder's other files may hold other weights")]
        if not any((src / name).is_file() for name in TORCH_WEIGHTS):
            return [verify.not_run(f"{src} was not run by transformers: it holds Flax weights only, which "
                                   "transformers 5 does not read")]
        progress(f"running {src} with transformers beside the converted model")
        return [run_folder(src, read.layout, read.config, read.params, "the source folder")]


FORMAT = HFFolder()
