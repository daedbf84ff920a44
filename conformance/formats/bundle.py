"""A checkpoint file that bundles its config with its weights: openai-whisper's
`{"dims": asdict(ModelDimensions), "model_state_dict": state_dict}`, which `whisper.load_model(path)`
reads (`conformance.convert.bundles`; a layout with a `[bundle]` table describes the file).

    read        by `state_dict` (conformance.convert.readers.read_source: a PyTorch file whose top
                level holds the two entries a layout's `[bundle]` names is read by that table,
                never by its key names: the sizes and the padding from its config entry, no
                --layout, no --set), which runs such a source in its own loader (`run_own_loader`)
    write       `--to openai-whisper OUT.pt`: the file that system's loader reads
    verify      the written file read back as it is read here (the config and every parameter,
                bit for bit), then loaded by its system's own loader where it is installed
                (openai-whisper: `whisper.load_model`) and run beside the float64 oracle on a full
                window of features (its encoder takes no other length): logits within the float32
                tolerance (its LayerNorms compute in float32 in every model). An input is run by
                its own loader the same way before it is converted.
"""

from __future__ import annotations

from pathlib import Path

from conformance.formats import verify
from conformance.formats.base import Format, Options, Read, Written, check_destination, check_export


class Bundle(Format):
    name = "bundled checkpoint"

    def writes(self, options: Options, dst: Path) -> bool:
        from conformance.convert import LayoutError, load_layout
        from conformance.convert.bundles import TORCH_SUFFIXES

        if options.to is None or dst.suffix.lower() not in TORCH_SUFFIXES:
            return False
        try:
            return load_layout(options.to).bundle is not None
        except LayoutError:
            return False

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.convert import load_layout
        from conformance.core.errors import CheckpointError

        check_export(src, dst, options)
        if options.sets:
            raise CheckpointError(dst, f"a {load_layout(options.to).name} checkpoint states its own config: nothing "
                                  "to --set")
        check_destination(dst, options.force)

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.convert import load_layout
        from conformance.convert.bundles import bundle_of
        from conformance.formats.state_dict import write_torch_object

        layout = load_layout(options.to)
        write_torch_object(staged, bundle_of(read.config, read.params, layout))
        return Written(title=f"{layout.name} checkpoint {{{layout.bundle.config!r}, {layout.bundle.weights!r}}}")

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        from conformance.convert.readers import read_source
        from conformance.convert.system_files import convert_system_file

        progress(f"reading {staged.name} back")
        runtime = "read back as rosetta convert reads it"
        _, system = read_source(staged)
        if system is None or system.layout.bundle is None:
            return [verify.failed(runtime, f"{staged.name} is not recognised as a bundled checkpoint when read back")]
        back = convert_system_file(system, pad_id=read.config.pad_id)
        differs = verify.round_trip(read.config, read.params, back.config, back.params)
        if differs:
            return [verify.failed(runtime, differs)]
        return [verify.passed(runtime, "every parameter and its config as the checkpoint's, bit for bit"),
                run_own_loader(staged, system.layout.name, read, "the written file", progress)]


def run_own_loader(path: Path, name: str, read: Read, what: str, progress) -> verify.Verdict:
    """`path` loaded by its system's own loader and run beside the float64 oracle on `read`'s
    parameters: openai-whisper's `whisper.load_model`, on the probes (`verify.probes`: a full window
    of features, padded target rows, and a target row as long as the model takes). Other bundled systems, and a missing
    openai-whisper, are said not to have been run."""
    if name != "openai-whisper":
        return verify.not_run(f"{what} was not loaded by {name}'s own loader: no check knows that system")
    try:
        import torch
        import whisper
    except ImportError as exc:
        return verify.not_run(f"{what} was not loaded by openai-whisper: it is not installed ({exc}); "
                              "pip install --no-deps openai-whisper (README)")
    large = verify.too_large(read.config, read.params, what)
    if large is not None:
        return large
    runtime = f"{verify.runtime_version('openai-whisper')} whisper.load_model"
    progress(f"running {what} in {runtime}")
    config = read.config

    def logits(features, tgt):
        with torch.no_grad():
            return model(torch.tensor(features, dtype=torch.float32), torch.tensor(tgt)).float().numpy()

    try:
        model = whisper.load_model(str(path), device="cpu")
        ok, says, _ = verify.logits_on_probes(config, read.params, logits, "float32")
    except Exception as exc:  # noqa: BLE001 - what openai-whisper says of the file is the finding
        return verify.failed(runtime, f"it could not load or run {what}: {type(exc).__name__}: {exc}")
    return verify.passed(runtime, says) if ok else verify.failed(runtime, says)


FORMAT = Bundle()
