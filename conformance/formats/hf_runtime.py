"""transformers itself beside the float64 oracle: a Hugging Face folder loaded by its family's
`from_pretrained` (eager attention, in the stored dtype), every parameter and switch it then holds
read back through the layout (`conformance.convert.from_hf`), and its float32 logits on the probes
(`verify.probes`: the padded rows, and a row as long as the model takes) with its attention_mask. Float32: transformers computes parts of a float64 model in float32
(T5LayerNorm's variance, the sinusoid tables), so a float64 forward would part from the oracle by
about 1e-7 where the port is right. Used by `hf_folder` (a written folder, a source folder) and by
`state_dict` (a family's tensors written as a file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from pathlib import Path


from conformance.formats import verify


def _torch_dtype(torch, name: str):
    return {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]


def run_folder(folder: Path, layout, config, params, what: str) -> verify.Verdict:
    """`folder` loaded by transformers' `from_pretrained` and run beside the oracle on `params`
    (see the module's docstring). What transformers says while it loads and runs the folder (its
    logger's warnings, a Python warning from its forward) is part of the verdict, said once in the
    verdict's line, never printed raw on the user's stderr in transformers' own voice."""
    said: list[str] = []
    with _transformers_said(said):
        verdict = _run_folder(folder, layout, config, params, what)
    if not said:
        return verdict
    heard = "; ".join(dict.fromkeys(said))
    if verdict.passed:
        return dataclasses.replace(verdict, says=f"{verdict.says}; transformers warned on loading or running it: {heard}")
    if verdict.passed is False:
        return dataclasses.replace(verdict, divergence=f"{verdict.divergence} (transformers warned: {heard})")
    return dataclasses.replace(verdict, says=f"{verdict.says} (transformers warned: {heard})")


@contextlib.contextmanager
def _transformers_said(said: list[str]):
    """Collect into `said` the warnings transformers' logger emits (in place of its own handler on
    stderr) and the Python warnings raised meanwhile, other than from_pretrained's own (ignored
    there: loading a folder it wrote is the point) and rosetta's own (raised again after). Leaves
    the logger as it found it."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return

    class Collect(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage().strip())

    logger = hf_logging.get_logger("transformers")
    collect = Collect(level=logging.WARNING)
    handlers = [h for h in logger.handlers]
    for h in handlers:
        logger.removeHandler(h)
    logger.addHandler(collect)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        ours = [w for w in caught if w.category.__module__.startswith("conformance.")]
        said.extend(f"{w.category.__name__}: {w.message}" for w in caught if w not in ours)
        for w in ours:  # rosetta's own (a note's unapplied settings): raised again, to its own handling
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        logger.removeHandler(collect)
        for h in handlers:
            logger.addHandler(h)


def _run_folder(folder: Path, layout, config, params, what: str) -> verify.Verdict:
    try:
        import torch
        import transformers
    except ImportError as exc:
        return verify.not_run(f"{what} was not loaded: transformers with torch is not installed ({exc}); "
                              "pip install transformers 'rosetta-transformer[torch]'")
    large = verify.too_large(config, params, what)
    if large is not None:
        return large
    cls = getattr(transformers, layout.hf.architectures[0], None)
    runtime = f"{verify.runtime_version('transformers')} {layout.hf.architectures[0]}.from_pretrained"
    if cls is None:
        return verify.not_run(f"{what} was not loaded: transformers {transformers.__version__} has no "
                              f"{layout.hf.architectures[0]}")
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights: 100%" is not the conversion's to say
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = cls.from_pretrained(str(folder), dtype=_torch_dtype(torch, verify.stored(params)),
                                              attn_implementation="eager", local_files_only=True,
                                              output_loading_info=True)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as exc:
        # A folder that was read (or written) here and that its own system refuses is a finding,
        # the source's as much as the output's: a check that crashed vouched for nothing.
        return verify.failed(runtime, f"from_pretrained could not load {what}: {type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    lost = list(info.get("missing_keys", ())) + [str(k) for k in info.get("mismatched_keys", ())]
    if lost:
        says = f"from_pretrained found no weights (or weights of another shape) for {', '.join(lost[:4])}" + (
            f" and {len(lost) - 4} more" if len(lost) > 4 else "")
        if what != "the source folder":
            return verify.failed(runtime, says)
        return verify.not_run(f"{what} was not run by transformers: {says}, which it would have initialized at random")
    written = None if what == "the source folder" else folder / "config.json"
    return run_model(model.eval(), runtime, layout, config, params, what, written)


def run_model(model, runtime: str, layout, config, params, what: str, written: Path | None = None) -> verify.Verdict:
    """A loaded transformers model beside the oracle: its parameters and config read back through
    the layout (`from_hf`), its generation settings (`generation_differs`; with `written`, the
    config.json this conversion wrote, its special ids too), then its float32 logits on the probes."""
    import torch

    from conformance.convert import from_hf

    try:
        theirs_config, theirs = from_hf(model)
    except (ValueError, TypeError) as exc:
        return verify.failed(runtime, f"{what}, loaded, does not read back through layout {layout.name}: {exc}")
    differs = verify.round_trip(config, params, theirs_config, theirs) or \
        generation_differs(layout, config, theirs_config, written)
    if differs:
        return verify.failed(runtime, f"{what}, loaded: {differs}")
    model = model.float()

    def logits(src, tgt):
        with torch.no_grad():
            return call(model, torch.from_numpy(src), torch.from_numpy(tgt), config.pad_id, layout).logits.numpy()

    within, says, where = verify.logits_on_probes(config, params, logits, "float32")
    if within:
        return verify.passed(runtime, f"{what}: every parameter and switch read back as the checkpoint's, and its "
                                      f"float32 {says}")
    return verify.failed(runtime, f"{what}: {says}" + _first_tensor(model, layout, config, *where))


def generation_settings(layout, config) -> dict:
    """The generation fields (`layout.hf.generation`) a checkpoint's note records, completed as
    an export completes them (`hf_folder.folder_files`: the family's `[hf.generation_defaults]`,
    the pad id): what transformers' `generate` should find in a folder of this checkpoint."""
    import json

    recorded = json.loads(config.notes["generation"]) if config.notes.get("generation") else {}
    implied = {"pad_token_id": config.pad_id,
               **{name: getattr(config, field) for name, field in layout.hf.generation_defaults.items()}}
    return {key: recorded.get(key, implied.get(key)) for key in layout.hf.generation
            if recorded.get(key, implied.get(key)) is not None}


def generation_differs(layout, ours, theirs, written: Path | None = None) -> str | None:
    """Where the generation settings transformers loaded (`from_hf`'s note: the model's
    generation_config, which its `generate` applies) are not the checkpoint's, each side completed
    the same way (`generation_settings`); with `written` (a config.json this conversion wrote),
    also where its special ids (`layout.hf.special_ids`, read by tools that read config.json: the
    CTranslate2 converter, pipelines) are not. None when every one is."""
    import json

    mine, other = generation_settings(layout, ours), generation_settings(layout, theirs)
    for key in layout.hf.generation:
        if repr(mine.get(key)) != repr(other.get(key)):
            return (f"read back, its generation settings (generation_config) say {key}={other.get(key)!r} where the "
                    f"checkpoint's note has {mine.get(key)!r}")
    if written is not None:
        stated = json.loads(written.read_text())
        for key in layout.hf.special_ids:
            if repr(stated.get(key)) != repr(mine.get(key)):
                return (f"config.json says {key}={stated.get(key)!r} where the checkpoint's note has "
                        f"{mine.get(key)!r}")
    return None


def call(model, src_ids, tgt_ids, pad_id: int, layout):
    """A seq2seq transformers model on the probe, as its layout's `[hf.call]` says transformers' own
    users call it: token ids with the source's attention_mask from the pad id (no decoder mask: the
    families' `tgt_pad_mask` is "none"), or Whisper's log-mel features, in the model's dtype."""
    if src_ids.is_floating_point():
        src_ids = src_ids.to(next(model.parameters()).dtype)
    return model(**layout.hf.call_arguments(src_ids, tgt_ids, pad_id))


def _first_tensor(model, layout, config, src, tgt) -> str:
    """Where the model first parts from the oracle, through the layout's [taps] (conformance.compare)."""
    import torch

    from conformance.check.foreign.side_by_side import compare
    from conformance.check.switches import switches_at

    try:
        with torch.no_grad():
            report = compare(model, layout, src, tgt, run=lambda m, s, t: call(m, s, t, config.pad_id, layout), backends=(),
                             dtype="float32")
    except Exception as exc:  # noqa: BLE001 - a diagnosis that cannot run leaves the failure as it is
        return f"; the first diverging tensor could not be traced ({type(exc).__name__}: {exc})"
    first = report.first_divergence
    if first is None:
        return ""
    return f"; first diverging tensor through the layout's taps: {first} (switches acting there: " \
           f"{', '.join(switches_at(first, config)) or 'none'})"


