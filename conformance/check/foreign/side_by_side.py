"""`conformance.compare`: the user's own model beside ours, tensor by tensor, forward and backward.

    report = conformance.compare(model, "from-scratch", src_ids, tgt_ids)
    report.first_divergence        # "encoder.1.ffn": where the user's model first leaves tolerance
    print(report)                  # the `rosetta check` table with the user's model as a column

The user's weights go through the layout (`conformance.convert`) into our model; the float64
NumPy oracle and our backends run on the same batch (`report.run_check`, the `rosetta check`
engine); the user's model runs once, and the layout's `[taps]` say where it computes each
canonical tensor (`conformance.check.foreign.taps`). The user's column is compared with the oracle under
the tolerance of the user's own dtype, as a backend's is: the first tensor out of tolerance is
where the two models part, and the switches acting there are named.

With `grads=True` the loss and every parameter's gradient by the user's own autograd (torch) or
`jax.grad` (Flax) are compared with the oracle's hand-written backward pass, exported to the
user's keys through the layout, in backward order.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from conformance.check import backends as backend_registry
from conformance.check.foreign import taps as foreign
from conformance.check.compare import compare as compare_arrays
from conformance.check.report import Cell, Report, default_targets, run_check
from conformance.check.foreign.grads import compare_grads
from conformance.check.foreign.report import (YOURS, SideBySide, as_features, as_ids, backend_names,
                                                   decoder_positions, oracle_tensors, shift_right)
from conformance.check.tolerances import ISLAND, tolerance
from conformance.check.foreign.user_code import describe, user_traceback
from conformance.core.errors import ConfigError, InputError
from conformance.core.output import forward_order


def _default_run(model, src_ids, tgt_ids):
    return model(src_ids, tgt_ids)


def is_transformers(model: Any) -> bool:
    """A transformers model: a class of the `transformers` package in its MRO, with a config."""
    return hasattr(getattr(model, "config", None), "to_dict") and any(
        c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def default_run(model: Any, layout, pad_id: int) -> tuple[Callable, str, bool]:
    """How the user's model is called when no `run=` is given, and that call in words: a
    transformers model by its layout's `[hf.call]` (the padding mask its tokenizer would return
    included), anything else `model(src_ids, tgt_ids)`, which gives it no mask. The third value
    says whether the call gave the model a padding mask."""
    hf = layout.hf
    if hf is not None and hf.call and is_transformers(model):
        def run(model, src_ids, tgt_ids):
            return model(**hf.call_arguments(src_ids, tgt_ids, pad_id))

        masked = any(isinstance(what, str) and what.endswith("_mask") for what in hf.call.values())
        return run, f"{hf.describe_call(pad_id)}, as the layout's [hf.call] says", masked
    return _default_run, "model(src_ids, tgt_ids) (no run= given): no padding mask", False


def _device_of(model: Any, kind: str) -> str:
    if kind == "torch":
        first = next(iter(model.parameters()), None)
        return "cpu" if first is None or first.device.type == "cpu" else first.device.type
    import jax

    return "gpu" if jax.default_backend() == "gpu" else "cpu"


def _dtype_of(state: dict[str, np.ndarray]) -> str:
    kinds = {str(v.dtype) for v in state.values() if v.dtype.kind == "f"}
    if len(kinds) != 1:
        raise InputError("model", f"parameters of one floating dtype expected, got {sorted(kinds) or 'none'}")
    return kinds.pop()


def told_by_model_config(model: Any, layout) -> dict[str, Any]:
    """The ModelConfig fields a transformers model's `model.config` gives through the layout's
    `[hf]` table, or a bundled checkpoint's system gives through its `[bundle]` table from the
    model's own config entry (openai-whisper's `model.dims`); empty for a layout with neither."""
    import dataclasses

    if layout.bundle is not None:
        dims = getattr(model, layout.bundle.config, None)
        if dims is not None:
            entry = dataclasses.asdict(dims) if dataclasses.is_dataclass(dims) else dims
            return layout.bundle.read(entry, f"{type(model).__name__}.{layout.bundle.config}")
    config = getattr(model, "config", None)
    if layout.hf is None or not hasattr(config, "to_dict"):
        return {}
    return layout.hf.read(config.to_dict(), f"{type(model).__name__}.config")


def compare(model: Any, layout: Any, src_ids, tgt_ids, *, run: Callable | None = None, dtype: str = "float32",
            backends: Any = None, grads: bool = False, labels=None, label_smoothing: float = 0.0,
            progress: Callable[[str], None] | None = None, stream: bool = False, **overrides: Any) -> SideBySide:
    """The user's own model beside ours, tensor by tensor; see the module's docstring.

    Args:
        model: a torch.nn.Module; a flax.linen module bound to its variables (`module.bind(v)`)
            or a `(module, variables)` pair; or an nnx.Module. ONNX graphs (a folder of
            encoder/decoder `.onnx` files, rosetta's or optimum's, or an (encoder, decoder) pair of
            `onnxruntime.InferenceSession`s; one `.onnx` file of a whole model, a user's own
            `torch.onnx.export`, with `inputs=` where its inputs are not transformers' names) go to `conformance.check.onnx.compare.compare_onnx`,
            which takes `weights=` (the checkpoint they were exported from) among `overrides`.
            A CTranslate2 model (a directory with model.bin and config.json, or a
            `ctranslate2.Translator` with `model_dir=` its directory) goes to
            `conformance.check.ctranslate2.compare.compare_ctranslate2`, which takes `weights=`
            (what it was converted from), `compute_types=`, `beams=`, `max_len=`, `device=` among
            `overrides` and returns a `CTranslate2Report` (log p per position, ids per search, per
            compute type; no tensor table: CTranslate2 exposes no intermediate tensors).
        layout: a built-in layout name, a layout TOML file or a `Layout`, as for
            `conformance.convert.import_state_dict`; its `[taps]` say where the model computes
            each tensor.
        src_ids, tgt_ids: (B, S) and (B, T) integer ids, the batch both models run on (with
            padding, to exercise the masks). With a layout whose decoder shifts its targets
            itself (`decoder_input = "shift-right"`), `tgt_ids` are the targets the user's model
            takes, and ours is given them shifted.
        run: `run(model, src_ids, tgt_ids) -> logits` (or an object with `.logits`), how the
            user's model is called, with ids as that framework's arrays. Default: a transformers
            model is called as its layout's `[hf.call]` says (`model(input_ids=src_ids,
            attention_mask=(src_ids != pad_id) * 1, decoder_input_ids=tgt_ids)` for every hf-*
            family), anything else as `model(src_ids, tgt_ids)`, which gives it no padding mask:
            the report then says so before it names any switch.
        dtype: the dtype our backends run in (the oracle is float64 NumPy always). The user's
            model runs as given, and its column is held to its own dtype's tolerance: pass it in
            float64 (torch `.double()`, Flax float64 params) to see what float32 rounding hides.
        backends: our backends to run beside it (names, or a comma-separated string; default:
            every installed one; `()` for none: the user's model against the oracle alone).
        grads: also compare the loss and every parameter's gradient (needs `labels`).
        labels: (B, T) target labels for the loss; labels equal to pad_id are not counted.
        label_smoothing: ε of the loss (docs/training.md).
        progress: `progress(message)` hears each step as it starts (a command's status line).
        stream: run our backends beside the oracle one layer at a time, each layer fed the
            oracle's own input from the layer below (`conformance.check.scale.stream`, `rosetta check
            --stream`), so their columns hold each layer's own error. It does not bound memory:
            the user's model and its converted parameters are held whole (the oracle and our
            backends hold one layer's copy at a time beside them), and the oracle's tensors for
            the user's column are the streamed oracle's, kept for that column.
        **overrides: ModelConfig fields for the conversion (n_heads, switches), as for
            `import_state_dict`. For a transformers model and a layout with an `[hf]` table
            (hf-marian, hf-bart, hf-t5, ...), every size and switch is read from `model.config`
            first, as `conformance.convert.from_hf` reads them: no `n_heads=` is needed, and an
            override that contradicts the config is a ConfigError naming the field.

    The report says what the conversion assumed (the layout's defaults for switches the tensors
    do not tell) and what `model.config` gave. A model that cannot run is no divergence: the
    report's `could_not_run`, with the user's own frames of the traceback (`failure`).
    """
    from conformance.check.ctranslate2 import compare as ctranslate2_compare
    from conformance.check.ctranslate2 import model as ctranslate2_model
    from conformance.check.onnx import compare as onnx_compare
    from conformance.convert import export_state_dict, load_layout

    if ctranslate2_model.is_ctranslate2(model):
        if stream:
            raise InputError("stream", "streams our backends beside a live model; a CTranslate2 model is run whole")
        if dtype != "float32":
            raise InputError("dtype", "is the dtype our backends run in; a CTranslate2 model runs in each of "
                                      "compute_types=")
        if labels is not None or label_smoothing:
            raise InputError("labels", "a CTranslate2 model has no loss or backward pass to compare")
        return ctranslate2_compare.compare_ctranslate2(model, layout, src_ids, tgt_ids, run=run, backends=backends,
                                                       grads=grads, progress=progress, **overrides)
    if onnx_compare.is_onnx(model):
        if stream:
            raise InputError("stream", "streams our backends beside a live model; ONNX graphs are compared whole")
        return onnx_compare.compare_onnx(model, layout, src_ids, tgt_ids, run=run, dtype=dtype, backends=backends,
                                         grads=grads, labels=labels, label_smoothing=label_smoothing,
                                         progress=progress, **overrides)

    layout = load_layout(layout)
    features = layout.base_switches().get("source") == "features"  # Whisper: log-mel features (B, n_mels, frames)
    src_ids, tgt_ids = as_features(src_ids) if features else as_ids("src_ids", src_ids), as_ids("tgt_ids", tgt_ids)
    if src_ids.shape[0] != tgt_ids.shape[0]:
        raise InputError("tgt_ids", f"has {tgt_ids.shape[0]} rows, src_ids {src_ids.shape[0]}")
    if grads and labels is None:
        raise InputError("labels", "grads=True compares a loss: give the (B, T) labels")
    progress = progress or (lambda message: None)
    kind = foreign.framework(model)
    state = foreign.foreign_state(model)
    progress(f"converting your weights through layout {layout.name}")
    conversion, told = convert_yours(model, layout, state, overrides)
    config, params = conversion.config, conversion.params
    if run is None:
        run, called, masked = default_run(model, layout, config.pad_id)
    else:
        called, masked = "your run function (run=)", True
    shifted = layout.tap_options["decoder_input"] == "shift-right"
    ours_tgt = shift_right(tgt_ids) if shifted else tgt_ids

    names = backend_names(backends)
    targets, skipped = default_targets(names, [dtype]) if names else ([], {})
    source = f"your model through layout {layout.name}"
    oracle = None
    if targets and stream:
        from conformance.check.scale.stream import Weights, run_streamed

        oracle = {}  # the oracle's tensors, kept for the user's column
        report = run_streamed(config, Weights.held(config, params), source, targets, skipped, src_ids, ours_tgt,
                              progress=progress, oracle_sink=lambda name, value: oracle.__setitem__(name, value))
    elif targets:
        report = run_check(config, params, source, targets, skipped, src_ids, ours_tgt, progress=progress)
    else:  # the user's model against the oracle alone
        report = Report(config=config, source=source, targets=[], tensors=forward_order(config), skipped=skipped)
    yours = backend_registry.Target(YOURS, _device_of(model, kind), _dtype_of(state))
    result = SideBySide(**{f: getattr(report, f) for f in Report.__dataclass_fields__}, layout=layout.name, yours=yours,
                        batch_axis=layout.tap_options["batch_axis"], told=told, told_by=f"{type(model).__name__}.config",
                        assumed=[line for line in conversion.decisions if "(the layout's default" in line],
                        called=called, unmasked=not masked and bool((not features and (src_ids == config.pad_id).any())
                                                                    or (tgt_ids == config.pad_id).any()))
    result.targets = [yours, *result.targets]

    if not targets:
        progress("oracle (numpy/cpu/float64)")
    if oracle is None:
        oracle = oracle_tensors(config, params, src_ids, ours_tgt)
    real = tgt_ids != config.pad_id if shifted else None
    tol = tolerance(yours.dtype, yours.device)
    progress(f"your model ({yours.label})")
    try:
        captured = foreign.capture(model, layout, result.tensors, run, src_ids, tgt_ids, config.to_dict())
    except Exception as exc:  # noqa: BLE001 - the user's code failing is reported with its own frames
        result.errors[yours.label] = describe(exc)
        result.failure = user_traceback(exc)
        return result
    within_island: dict[str, bool] = {}  # tensor out of float64's tolerance -> within float32 rounding
    if captured is not None:
        if "logits" not in captured.values and "logits" not in captured.unavailable:
            captured.values["logits"] = captured.logits
        for tensor in result.tensors:
            if tensor in captured.values:
                ours, theirs = oracle[tensor], captured.values[tensor]
                if real is not None and tensor.startswith(("decoder.", "logits")):
                    ours, theirs = decoder_positions(ours, real, tensor), decoder_positions(theirs, real, tensor)
                comparison = compare_arrays(theirs, ours, tol)
                if not comparison.passed and yours.dtype == "float64" and layout.islands:
                    within_island[tensor] = compare_arrays(theirs, ours, ISLAND).passed
                result.cells[(tensor, yours.label)] = Cell(comparison=comparison)
            else:
                why = captured.unavailable.get(tensor) or foreign.not_applying(layout, tensor, config.to_dict()) or (
                    f"the layout {layout.name} has no tap for it")
                result.cells[(tensor, yours.label)] = Cell(unavailable=why)

        label_islands(result, layout, within_island)

    if grads:
        progress("gradients: your model's autograd and the oracle's backward pass")
        compare_grads(result, model, layout, config, params, run, src_ids, tgt_ids, ours_tgt,
                      as_ids("labels", labels), label_smoothing, export_state_dict)
    return result


def label_islands(result: SideBySide, layout, within_island: dict[str, bool]) -> None:
    """Label the user's float64 tensors that a declared float32 island explains (`Cell.island`).

    An island of the layout (`[float32_islands]`) is at work when the first tensor the user's
    model exposes at or after its entry (in forward order) is out of float64's tolerance and
    within float32 rounding (`tolerances.ISLAND`) of the oracle: the float32 part rounded there.
    From that tensor on, every tensor out of float64's tolerance and within that bound is put down
    to it; one beyond it is a divergence. An island that does not show where it enters (the
    converted model computes with the very table the user's model reads) labels nothing, so a
    small real error after it (a LayerNorm epsilon) is still a divergence."""
    order = result.tensors
    exposed = [t for t in order if (cell := result.cells.get((t, result.yours.label))) is not None
               and cell.comparison is not None]
    for island in layout.islands:
        first = island.first_index(order)
        at = next((t for t in exposed if order.index(t) >= first), None) if first is not None else None
        if at is None or not within_island.get(at):
            continue
        for tensor in exposed[exposed.index(at):]:
            cell = result.cells[(tensor, result.yours.label)]
            if within_island.get(tensor):
                cell.island = island.name if cell.island is None else f"{cell.island}, {island.name}"


def convert_yours(model: Any, layout, state: dict[str, np.ndarray], overrides: dict[str, Any]):
    """(the Conversion of the user's weights, the fields its `model.config` gave): a
    transformers model's config first (`told_by_model_config`), then the caller's overrides,
    which may not contradict it."""
    from conformance.convert import convert_arrays

    told = told_by_model_config(model, layout)
    for name, value in overrides.items():
        if name in told and told[name] != value:
            raise ConfigError(name, f"{value!r} (given) contradicts the model, whose {type(model).__name__}.config gives "
                                    f"{name}={told[name]!r}")
    return convert_arrays(state, layout, **{**told, **overrides}), told
