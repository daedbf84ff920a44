"""The rosetta checkpoint: one `.safetensors` file holding the `ModelConfig` and the parameters
(`conformance.core.checkpoint`).

    read     checkpoint.load (its digest and every check), cast with --dtype when re-saved
    write    checkpoint.save; from a sharded directory, checkpoint.save_streamed one tensor at a time
    verify   the written file loaded again as every backend loads it (`checkpoint.load`: header,
             digest, config), its config and every parameter equal to the conversion's, bit for
             bit. A streamed import (a sharded directory), and a model that does not fit in
             memory a second time, are read back one parameter at a time. Where the conversion's
             parameters are only the writer's input (a re-save, cast or not; a sharded import),
             every parameter is also held to the source's, read again apart from the path that
             wrote it (safetensors alone; the directory's own library) and cast by
             `verify.reference_cast`: a fault in the reader or in the cast cannot agree with
             itself. A model read back equal is the same model in every backend; the trial
             forward pass (NumPy, in the stored dtype) then runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from conformance.formats import verify
from conformance.formats.base import Format, Options, Read, Written, check_destination

LOADER = "checkpoint.load"


class RosettaCheckpoint(Format):
    name = "rosetta checkpoint"

    def recognises(self, path: Path) -> bool:
        from conformance.core import checkpoint

        return checkpoint.is_checkpoint(path)

    def writes(self, options: Options, dst: Path) -> bool:
        return options.to is None

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.core.errors import CheckpointError, InputError

        if options.quantization:
            raise InputError("--quantization", "chooses how CTranslate2 stores the weights: give it with --to ctranslate2")
        if options.taps:
            raise InputError("--taps", "adds graph outputs to an ONNX export: give it with --to onnx")
        if dst.suffix.lower() != ".safetensors":
            raise CheckpointError(dst, "a rosetta checkpoint is a .safetensors file; name the output *.safetensors")
        if dst.exists() and src.exists() and os.path.samefile(src, dst):
            raise CheckpointError(dst, "is the input file; converting never overwrites its input")
        if not dst.parent.is_dir() and str(dst.parent):
            raise CheckpointError(dst, f"directory {dst.parent} does not exist")
        if dst.is_dir():
            raise CheckpointError(dst, "is a directory; name the checkpoint file to write")
        check_destination(dst, options.force)

    def check_input(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.core.errors import InputError

        if options.to is None and (given := options.given("layout", "sets", "renames", "key")):
            raise InputError(given[0], f"{src} is a rosetta checkpoint, whose config is stored in it: there is no "
                             "layout to choose and nothing to set or rename; convert it with --dtype only (or none)")

    def read(self, src: Path, options: Options, progress) -> Read:
        """The checkpoint as stored; re-saved (no --to), cast to --dtype (an overflow refused by key)."""
        from conformance.convert.engine import cast
        from conformance.core import checkpoint

        progress(f"reading {src}")
        config, params = checkpoint.load(src)
        if options.to is not None:
            return Read(config, params)
        stored = verify.stored(params)
        casting = options.dtype is not None and options.dtype != stored
        if casting:
            params = {key: cast(value, options.dtype, key) for key, value in params.items()}
        said = f"cast {stored} -> {options.dtype}" if casting else f"re-saved as stored ({stored})"
        return Read(config, params, lines=[f"a rosetta checkpoint: {said}"], counts=True, trial=True,
                    reference=reread_file(src, options.dtype if casting else None))

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.convert import sharded
        from conformance.core import checkpoint

        if read.params is None:  # a sharded directory, one tensor at a time
            config, read.total = sharded.to_safetensors(read.source, staged, options.dtype)
            return Written()
        checkpoint.save(staged, read.config, read.params)
        return Written()

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        progress("checking the written checkpoint")
        if read.params is None:
            return [verify_streamed(staged, read)]
        fits, words = verify.fits_in_memory(read.config, verify.itemsize(read.params), copies=1.2)
        if not fits:
            return [verify_streamed(staged, read, reason=words)]
        return [verify_whole(staged, read.config, read.params, read.reference)]


def verify_whole(path: Path, config, params, reference=None) -> verify.Verdict:
    """The file loaded as every backend loads it (`checkpoint.load`: header, digest, config); its
    config and every parameter the conversion's, bit for bit, and the source's (`reference`:
    each parameter read again apart from the write path) where given. A model is its config and
    its parameters: read back equal, it is the same model in every backend (the trial forward
    pass runs it)."""
    from conformance.core import checkpoint

    loaded_config, loaded = checkpoint.load(path)
    differs = verify.round_trip(config, params, loaded_config, loaded)
    if differs is None and reference is not None:
        differs = _against_source(loaded, reference)
    if differs:
        return verify.failed(LOADER, differs)
    also = " and as the source's, read again and cast apart from the conversion" if reference is not None else ""
    return verify.passed(LOADER, f"read back (digest, config, and every parameter bit for bit as the conversion's{also})")


def verify_streamed(path: Path, read: Read, reason: str = "") -> verify.Verdict:
    """A model checked without holding it twice: the written file's header, digest and config
    (`stream.Weights.open`, 16 MiB at a time), then each parameter read alone from it (a memory
    map) and compared with the conversion's, where it holds them, and with the source's, read
    again one tensor at a time apart from the path that wrote it (`read.reference`)."""
    from safetensors import safe_open

    from conformance.check.scale.stream import Weights
    from conformance.core.params import param_shapes

    weights = Weights.open(path)
    differs = verify.config_differs(read.config, weights.config)
    if differs:
        return verify.failed(LOADER, "read back, the config says " + "; ".join(differs))
    with safe_open(str(path), framework="numpy") as f:
        for name in param_shapes(read.config):
            value = f.get_tensor(name)
            different = None
            if read.params is not None:
                different = verify.params_differ({name: read.params[name]}, {name: value})
            if different is None and read.reference is not None:
                different = _against_source({name: value}, read.reference)
            if different:
                return verify.failed(LOADER, different)
    held = [whose for whose, given in ((" the conversion's", read.params is not None),
                                      (" the source's, read again and cast apart from the conversion",
                                       read.reference is not None)) if given]
    what = " and".join(held)
    why = f"; {reason}" if reason else ""
    return verify.passed(LOADER, f"read back one parameter at a time (digest, config, and every parameter bit for "
                                 f"bit as{what}{why})")


def _against_source(written, reference) -> str | None:
    """The first parameter of `written` that is not the source's (`reference(name)`), said so."""
    for name, value in written.items():
        different = verify.params_differ({name: reference(name)}, {name: value})
        if different:
            return f"against the source, read again: {different.replace('the checkpoint', 'the source')}"
    return None


def reread_file(src: Path, dtype: str | None):
    """Each parameter of the rosetta checkpoint `src` as the file holds it, read again with
    safetensors alone (not `checkpoint.load`, which read it for the conversion) and cast to
    `dtype` by `verify.reference_cast` (not the conversion's cast)."""
    from safetensors import safe_open

    def reference(name: str):
        with safe_open(str(src), framework="numpy") as f:
            return verify.reference_cast(f.get_tensor(name), dtype)

    return reference


def trial_run(config, params) -> list[str]:
    """One small forward pass of the converted model on the NumPy backend: a model whose logits
    are not finite was converted with a wrong switch (often pad_id or mask_fill), and it is better
    said now than found at the first real batch. Returns the problems found (none: [])."""
    import impl_numpy

    src, tgt = verify.probe(config)
    # In the stored dtype where NumPy has it: float32 overflows where float64 would not.
    stored = verify.stored(params)
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


FORMAT = RosettaCheckpoint()
