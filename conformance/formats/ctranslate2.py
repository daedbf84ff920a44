"""`--to ctranslate2`: a CTranslate2 model directory, written by CTranslate2's own converter through
a Hugging Face folder of the checkpoint's family (`conformance.check.ctranslate2.target`;
docs/deployment.md).

    write    target.write: the family's folder, TransformersConverter, --quantization
    verify   CTranslate2 loads the written directory (`target.verified`): score_batch log p per
             target position and translate_batch greedy ids beside the float64 oracle on the probes
             (the padded rows, and a row as long as the model takes); float32 weights are held to the
             float32 row and equal ids, quantized weights are measured and printed, not held (said
             so). Beam search is `rosetta check`'s to compare. A features source (Whisper):
             WhisperLoader, a `ctranslate2.models.Whisper`, its encode output and each greedy step's
             logits from Whisper's prompt beside the oracle on a whole window
             (`conformance.check.ctranslate2.whisper`)
"""

from __future__ import annotations

from pathlib import Path

from conformance.formats import verify
from conformance.formats.base import Format, Options, Read, Written, check_new_directory

NAME = "ctranslate2"  # the --to name


class CTranslate2Directory(Format):
    name = "CTranslate2 model directory"

    def writes(self, options: Options, dst: Path) -> bool:
        return options.to == NAME

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.check.ctranslate2.model import checked_compute_types, require
        from conformance.core.errors import InputError

        given = options.given("layout", "sets", "renames", "key", "force", "dtype", "taps")
        if given:
            raise InputError(given[0], "--to ctranslate2 converts a rosetta checkpoint as it is stored, into a new "
                             "directory: choose the stored type with --quantization; nothing to set, rename or replace")
        require()
        checked_compute_types(options.quantization or "float32", "--quantization")
        check_new_directory(dst, "a CTranslate2 model goes")

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.check.ctranslate2 import target
        from conformance.check.ctranslate2.model import require

        quantization = options.quantization or "float32"
        family = target.family_of(read.config, read.params)
        target.representable(read.config, read.params, family)
        target.write(require(), read.config, read.params, staged, quantization, family)
        return Written(title=f"CTranslate2 model, {quantization} weights, through a Hugging Face {family.layout} folder")

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        from conformance.check.ctranslate2 import target
        from conformance.check.ctranslate2.report import WhisperRow

        large = verify.too_large(read.config, read.params, "the written model")
        if large is not None:
            return [large]
        progress("checking the written model with CTranslate2")
        reports = target.verified(read.config, read.params, staged, progress=progress)
        what, report = reports[-1]
        runtime = f"{report.version} ({report.calls})"
        names = " and ".join(name for name, _ in reports)
        if not report.checked:
            rows = [r.rows[0] for _, r in reports if r.rows]
            error = "logits" if rows and isinstance(rows[0], WhisperRow) else "log p"
            measured = (f"largest |{error} error| {max(r.max_error for r in rows):.1e}, greedy ids equal: "
                        f"{', '.join(f'{share:.0%}' for r in rows for share in r.agreement.values())}") if rows else ""
            return [verify.not_run(f"weights stored as {'+'.join(report.weight_dtypes)}: CTranslate2 ran the written "
                                   f"model beside the float64 oracle on {names}, measured, not held ({measured}); "
                                   "only float32 weights have a tolerance (docs/deployment.md)")]
        if not report.passed:
            return [verify.failed(runtime, target.divergence(report, what, read.config))]
        rows = [next(r for r in each.rows if r.held is not None) for _, each in reports]
        if isinstance(rows[0], WhisperRow):
            row = rows[0]
            return [verify.passed(runtime, f"the encoder output within {row.encoder_limit:.1e} (largest "
                                           f"{row.encoder_error:.1e}) and each step's logits within {row.limit:.1e} "
                                           f"(largest {row.max_error:.1e}) of the float64 oracle on {names} of "
                                           f"3 rows, greedy ids from the prompt {report.prompt} equal")]
        limits = " and ".join(f"{r.limit:.1e}" for r in rows)
        return [verify.passed(runtime, f"log p within {limits} of the float64 oracle on {names} (largest "
                                       f"{max(r.max_error for r in rows):.1e}), greedy ids equal")]

FORMAT = CTranslate2Directory()
