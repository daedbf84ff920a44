"""A checkpoint file run by its own system's loader beside the float64 oracle: the check of a
bundled checkpoint (openai-whisper's `{"dims", "model_state_dict"}`), written (`formats.bundle`)
or read (`formats.state_dict`, for a source that names its system).

May import what `conformance.formats` may.
"""

from __future__ import annotations

from pathlib import Path

from conformance.formats import verify
from conformance.formats.base import Read


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
