"""Checkpoint formats: one module per format, one registry, and every output checked before it lands.

    from conformance.formats import Options, convert
    done = convert("opus-mt-en-de/", "opus.safetensors", Options())           # `rosetta convert` itself
    done = convert("model.safetensors", "model-ct2/", Options(to="ctranslate2"))
    print("\\n".join(done.lines))

The registry, in the order an input is recognised and an output chosen:

    rosetta      a rosetta checkpoint (.safetensors with its config)           read, written, verified
    sharded      a rosetta DCP or Orbax directory; --to dcp / --to orbax       read, written, verified
    onnx         --to onnx: encoder and decoder graphs                         written, verified
    ctranslate2  --to ctranslate2: a CTranslate2 model directory               written, verified
    hf_folder    a Hugging Face model folder (or a weights file in one);       read, written, verified
                 --to hf-<family> with no suffix
    bundle       --to openai-whisper OUT.pt: a PyTorch file bundling its       written, verified
                 config (openai-whisper's {dims, model_state_dict}); read by
                 state_dict, as every training checkpoint that states its options
    state_dict   any other weights file or directory, through a layout;        read, written, verified
                 --to LAYOUT to a file (or an Orbax directory)

Each module defines a `Format` (`conformance.formats.base`: how it is recognised as an input,
whether it writes an output, its refusals, how it is read, written and verified) and its
instance `FORMAT`. **Adding a format is one module and one line in FORMATS below**: a new
input goes before `state_dict` (the last entry, which takes whatever no other recognises), a
new `--to NAME` anywhere before it. A transformers family needs neither: a layout with an
`[hf]` table (conformance/convert/layouts/) is written and verified by `hf_folder` as it is.

`convert(src, dst, options)` reads with the input's format (a rosetta checkpoint, whatever the
format, for `--to`), writes with the output's into a hidden path beside `dst`, checks what it
wrote there (`verify`: the output loaded by what will read it, beside the float64 oracle on a
padded batch), and only then renames it into place. A check that fails raises
`conformance.core.errors.VerificationError` naming the first divergence, and nothing is left at
`dst`: nor on any other error, nor on Ctrl-C. `Options(verify=False)` (`--no-verify`) skips the
check and says so; a check whose runtime is not installed says so too.

May import: conformance.core, conformance.convert, conformance.check, and the backends and the
runtimes (transformers, onnxruntime, ctranslate2, torch, orbax) lazily. Above check, beside the
suite; only the CLI imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from conformance.formats import bundle, ctranslate2, hf_folder, onnx, rosetta, sharded, state_dict
from conformance.formats.base import Format, Options, Progress, Read, Written, parse_renames, parse_sets, staged
from conformance.formats.verify import Verdict, skipped

FORMATS: tuple[Format, ...] = (
    rosetta.FORMAT,
    sharded.FORMAT,
    onnx.FORMAT,
    ctranslate2.FORMAT,
    hf_folder.FORMAT,
    bundle.FORMAT,  # --to openai-whisper: a PyTorch file that bundles its config ({dims, model_state_dict})
    state_dict.FORMAT,  # last: reads whatever no format above recognises, writes every other --to LAYOUT
)


@dataclass
class Converted:
    """What `convert` did, as `rosetta convert` says it: `lines` on stdout, `warnings` on stderr,
    the checks made (`verdicts`)."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)


def format_of(src: Path) -> Format:
    """The format of an input, the first in FORMATS that recognises it; a path that does not
    exist is said to be missing."""
    from conformance.convert.readers import SUFFIXES
    from conformance.core.errors import CheckpointError

    if not src.exists():
        suffix = src.suffix.lower()
        unknown = (f"; and unknown file type {suffix!r}: expected one of {', '.join(SUFFIXES)}, or a directory"
                   if suffix and suffix not in SUFFIXES else "")
        raise CheckpointError(src, f"no such file or directory{unknown}")
    return next(f for f in FORMATS if f.recognises(src))


def format_for(options: Options, dst: Path) -> Format:
    """The format that writes `dst` for these options, the first in FORMATS that says it does."""
    return next(f for f in FORMATS if f.writes(options, dst))


def convert(src, dst, options: Options = Options(), progress: Progress | None = None) -> Converted:
    """Convert `src` into `dst` as `rosetta convert` does; see the module's docstring."""
    from conformance.core.errors import VerificationError

    src, dst = Path(src), Path(dst)
    progress = progress or (lambda message: None)
    writer = format_for(options, dst)
    writer.check_output(src, dst, options)
    reader = rosetta.FORMAT if options.to is not None else format_of(src)
    reader.check_input(src, dst, options)
    read = reader.read(src, options, progress)
    with staged(dst) as path:
        progress(f"writing {dst}")
        written = writer.write(path, read, options, dst)
        problems = []
        if read.trial:
            progress("a trial forward pass (NumPy, 3 padded rows)")
            problems = rosetta.trial_run(read.config, read.params)
        verdicts = checked(writer, reader, path, src, read, options, progress) if options.verify else [skipped()]
        failed = [v for v in verdicts if v.passed is False]
        if failed:
            raise VerificationError(path, f"not written: {failed[0].runtime}: {failed[0].divergence}", tuple(verdicts))
    unchecked = [f"{dst}: {verdict.line().strip()}" for verdict in verdicts if verdict.passed is None]
    return Converted(said(src, dst, read, written, problems, verdicts),
                     read.warnings + written.warnings + problems + unchecked, verdicts)


def checked(writer: Format, reader: Format, path: Path, src: Path, read: Read, options: Options,
            progress: Progress) -> list[Verdict]:
    """The writer's check of what it wrote and the reader's of its source. A loader that refuses
    or breaks on what was written fails the check, with what it said. So does a source's own
    system that is installed and raises while running the source: the conversion read it, so its
    system should run it, and a check that crashes has not vouched for anything (`--no-verify`
    skips it). Only a system that is not installed here leaves the source unchecked, and says so."""
    from conformance.formats import verify

    try:
        verdicts = writer.verify(path, read, options, progress)
    except Exception as exc:  # noqa: BLE001 - what was written could not be read back: that is the finding
        verdicts = [verify.failed(f"{writer.name} loaded", f"what was written could not be read back: "
                                  f"{type(exc).__name__}: {exc}")]
    try:
        verdicts += reader.verify_source(src, read, options, progress)
    except ImportError as exc:  # the runtime is missing: nothing ran, and the output says so
        verdicts.append(verify.not_run(f"{src} was not run by its own system: it is not installed here ({exc})"))
    except Exception as exc:  # noqa: BLE001 - the runtime raised: that is a finding, not an excuse
        verdicts.append(verify.failed(f"the source's own system, running {src.name}",
                                      f"it raised {type(exc).__name__}: {exc} (--no-verify skips this check)"))
    return verdicts


def said(src: Path, dst: Path, read: Read, written: Written, problems: list[str], verdicts: list[Verdict]) -> list[str]:
    """The lines `rosetta convert` prints, in the order it has always printed them."""
    lines = [f"{src} -> {dst}" + (f" ({written.title})" if written.title else "")]
    lines += [f"  {line}" for line in read.lines + written.lines]
    lines.append(f"  config: {read.config.summary()}")
    if read.counts:
        if read.params is not None:
            total = sum(int(v.size) for v in read.params.values())
            dtypes = sorted({np.asarray(v).dtype.name for v in read.params.values()})
            lines.append(f"  {len(read.params)} parameters, {total:,} values, {'/'.join(dtypes)}")
        else:
            from conformance.core.params import param_shapes

            lines.append(f"  {len(param_shapes(read.config))} parameters, {read.total:,} values")
    if read.trial and not problems and not read.warnings:  # a padding warning leaves the pass unsaid, as ever
        lines.append("  trial forward pass (NumPy, 3 padded rows): every logit finite")
    lines += [verdict.line() for verdict in verdicts]
    return lines


__all__ = ["FORMATS", "Converted", "Format", "Options", "Read", "Verdict", "Written", "convert", "format_for",
           "format_of", "parse_renames", "parse_sets", "staged"]
