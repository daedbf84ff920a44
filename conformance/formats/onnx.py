"""`--to onnx`: impl_torch's model as two ONNX graphs, encoder.onnx and decoder.onnx, traced by
torch's exporter (`conformance.check.onnx.export`; docs/deployment.md).

    write    export_bytes in float32, with --taps every tensor `rosetta check` compares as outputs
    verify   ONNX Runtime (CPU execution provider) loads the written files and runs them as the
             `onnxruntime` target does (the decoder on the whole prefix, then again with half of it
             as its cache) on the probes (`verify.probes`: the padded rows, and a row as long as the
             model takes): the logits, and with --taps every tensor, beside the float64 oracle
             within the float32 tolerance; without taps the first diverging tensor cannot be named,
             and the failure says how to find it
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.formats import verify
from conformance.formats.base import Format, Options, Read, Written, check_new_directory

NAME = "onnx"  # `--to onnx`: graphs, not a layout (docs/deployment.md)


class OnnxGraphs(Format):
    name = "ONNX graphs"

    def writes(self, options: Options, dst: Path) -> bool:
        return options.to == NAME

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.core.errors import InputError

        given = options.given("layout", "sets", "renames", "key", "force", "quantization")
        if given:
            raise InputError(given[0], "--to onnx exports a rosetta checkpoint as it is stored, into a new directory: "
                             "nothing to choose, set, rename or replace")
        if options.dtype not in (None, "float32"):
            raise InputError("--dtype", f"--to onnx exports float32 graphs only, not {options.dtype}")
        check_new_directory(dst, "the ONNX graphs go")
        try:
            import onnxscript  # noqa: F401 - torch's exporter needs it, and says so only after tracing

            from conformance.check.onnx import export  # noqa: F401
        except ImportError as exc:
            raise InputError("--to", f"exporting to ONNX needs torch, onnx and onnxscript ({exc}): "
                             "pip install 'rosetta-transformer[torch,onnx]'") from None

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.check.onnx import export as onnx_export

        graphs = onnx_export.export_bytes(read.config, read.params, "float32", taps=options.taps)  # impl_torch, traced
        staged.mkdir()
        written = [staged / onnx_export.ENCODER_FILE, staged / onnx_export.DECODER_FILE]
        for path, graph in zip(written, graphs):
            path.write_bytes(graph)
        return Written(title=f"ONNX opset {onnx_export.OPSET}, float32{', with taps' if options.taps else ''}: "
                             f"{', '.join(path.name for path in written)}")

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        from conformance.check.onnx import export as onnx_export

        try:
            import onnxruntime

            from conformance.check.onnx.runtime import PROVIDER, Model
        except ImportError as exc:
            return [verify.not_run(f"the graphs were not loaded: ONNX Runtime is not installed ({exc}); pip install "
                                   "'rosetta-transformer[onnx]'")]
        large = verify.too_large(read.config, read.params, "the written graphs")
        if large is not None:
            return [large]
        progress("checking the written graphs with ONNX Runtime")
        runtime = f"onnxruntime {onnxruntime.__version__} ({PROVIDER})"
        options_ = onnxruntime.SessionOptions()
        options_.log_severity_level = 3
        sessions = [onnxruntime.InferenceSession(str(staged / name), options_, providers=[PROVIDER])
                    for name in (onnx_export.ENCODER_FILE, onnx_export.DECODER_FILE)]
        config = read.config
        model = Model.of_sessions(config, *sessions)
        batches = verify.probes(config)
        for what, src, tgt in batches:
            expected = verify.oracle(config, read.params, src, tgt)
            with np.errstate(all="ignore"):
                out = model(src, tgt)
            actual = {**(out.attention or {}), **out.intermediates, "logits": out.logits}
            first = verify.first_tensor(actual, expected, config, "float32")
            if first is None:
                continue
            if not options.taps:
                first += ("; the graphs have no taps, so no earlier tensor can be named: `rosetta check CHECKPOINT "
                          "--backends numpy,onnxruntime` exports them with taps and names the first")
            return [verify.failed(runtime, f"on {what}, {first}")]
        tensors = "every tensor" if options.taps else "the logits"
        return [verify.passed(runtime, f"{tensors} of the written graphs (the decoder run whole, then cached) within "
                                       f"the float32 tolerance of the float64 oracle on {verify.probe_names(batches)}")]


FORMAT = OnnxGraphs()
