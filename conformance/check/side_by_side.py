"""`conformance.compare`: the user's own model beside ours, tensor by tensor, forward and backward.

    report = conformance.compare(model, "from-scratch", src_ids, tgt_ids)
    report.first_divergence        # "encoder.1.ffn": where the user's model first leaves tolerance
    print(report)                  # the `rosetta check` table with the user's model as a column

The user's weights go through the layout (`conformance.convert`) into our model; the float64
NumPy oracle and our backends run on the same batch (`report.run_check`, the `rosetta check`
engine); the user's model runs once, and the layout's `[taps]` say where it computes each
canonical tensor (`conformance.check.taps`). The user's column is compared with the oracle under
the tolerance of the user's own dtype, as a backend's is: the first tensor out of tolerance is
where the two models part, and the switches acting there are named.

With `grads=True` the loss and every parameter's gradient by the user's own autograd (torch) or
`jax.grad` (Flax) are compared with the oracle's hand-written backward pass, exported to the
user's keys through the layout, in backward order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from conformance.check import backends as backend_registry
from conformance.check import taps as foreign
from conformance.check.compare import compare as compare_arrays
from conformance.check.plan import stored_dtype
from conformance.check.report import Cell, Report, default_targets, run_check
from conformance.check.side_by_side_grads import GradRow, compare_grads
from conformance.check.switches import switches_at
from conformance.check.tolerances import tolerance
from conformance.check.user_code import describe, user_traceback
from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError, InputError
from conformance.core.output import forward_order, tensors_of

YOURS = "yours"


@dataclass
class SideBySide(Report):
    """A `rosetta check` report with the user's model as a column, and its gradients when asked."""

    layout: str = ""
    yours: backend_registry.Target | None = None
    batch_axis: int = 0  # the layout's [taps] batch_axis: where the user's tensors keep the batch
    command = "rosetta compare"  # the picture's title (plots.plot_check)
    loss: float | None = None
    reference_loss: float | None = None
    loss_allowed: float | None = None
    grads: list[GradRow] = field(default_factory=list)
    # What the conversion did not read from the weights: the layout's defaults it assumed (one
    # line each, as `rosetta convert` prints them), and what a live model's config gave.
    assumed: list[str] = field(default_factory=list)
    told: dict[str, Any] = field(default_factory=dict)
    told_by: str = ""
    # The user's model could not run: its own frames of the traceback (`user_traceback`).
    failure: str = ""
    # With grads: the user's backward pass raised (the error, its frames), kept apart from a
    # forward that could not run; or its logits do not fit the labels, a divergence at the logits.
    backward_error: str = ""
    backward_traceback: str = ""
    backward_divergence: str = ""

    @property
    def first_divergence(self) -> str | None:
        """The canonical tensor where the user's model first leaves tolerance, in forward order."""
        first = self.first_failure(self.yours)
        return first[0] if first else None

    @property
    def diverges(self) -> bool:
        """The user's model computes something else than the oracle, forward or backward."""
        return bool(self.first_divergence or self.first_bad_grad or self.backward_divergence)

    @property
    def first_bad_grad(self) -> str | None:
        """The user's key of the first parameter whose gradient leaves tolerance, in backward order."""
        return next((row.key for row in self.grads if not row.passed), None)

    @property
    def loss_error(self) -> float | None:
        if self.loss is None:
            return None
        if not np.isfinite(self.loss):
            return float("inf")
        return abs(self.loss - self.reference_loss) / max(1.0, abs(self.reference_loss))

    @property
    def ok(self) -> bool:
        """Every column (the user's and our backends') agrees with the oracle, and so do the loss
        and gradients when they were compared."""
        loss_ok = self.loss is None or self.loss_error <= self.loss_allowed
        backward_ok = not (self.backward_error or self.backward_divergence)
        return self.passed and loss_ok and backward_ok and self.first_bad_grad is None

    @property
    def could_not_run(self) -> bool:
        return self.yours.label in self.errors

    def unexposed(self) -> dict[str, str]:
        return {tensor: cell.unavailable for (tensor, label), cell in self.cells.items()
                if label == self.yours.label and cell.unavailable is not None}

    def to_text(self) -> str:
        text = super().to_text().replace("rosetta check:", "rosetta compare:", 1)
        lines = [text, ""]
        if self.told:
            lines.append(f"read from {self.told_by}: " + ", ".join(f"{k}={v!r}" for k, v in sorted(self.told.items())))
        if self.assumed:
            lines.append("assumed (the tensors do not tell them):")
            lines += [f"  {line}" for line in self.assumed]
        unexposed = self.unexposed()
        if unexposed:
            lines.append(f"not exposed by your model ({len(unexposed)} tensors; not compared, never guessed):")
            lines += [f"  {tensor}: {why}" for tensor, why in unexposed.items()]
        first = self.first_divergence
        if first:
            cell = self.cells[(first, self.yours.label)]
            values = {**ModelConfig().to_dict(), **self.config.to_dict()}
            acting = ", ".join(f"{name} = {values[name]!r}" for name in switches_at(first, self.config))
            lines.append(f"first divergence: {first} (your model against the oracle: "
                         f"{cell.error or cell.comparison.describe()})")
            axes = self.swapped_axes(first)
            if axes:
                lines.append(f"  {axes}")
            lines += [f"  switches that act there, as converted: {acting or '(none: look at the weights)'}",
                      f"  their values and origins for this layout: `rosetta layouts {self.layout}`; "
                      "if yours differ, convert with that switch set (--set NAME=VALUE, or NAME=VALUE here)"]
        elif self.could_not_run:
            lines.append(f"your model could not run: {self.errors[self.yours.label]}")
            if self.failure:
                lines.append(self.failure)
        else:
            lines.append("first divergence: none; your model agrees with the oracle at every exposed tensor")
        if self.backward_divergence:
            lines += ["", f"backward: not compared: {self.backward_divergence}"]
        elif self.backward_error:
            lines += ["", f"backward: your model's backward pass failed: {self.backward_error}"]
            lines += [self.backward_traceback] if self.backward_traceback else []
        if self.loss is not None:
            verdict = "ok" if self.loss_error <= self.loss_allowed else "FAIL"
            lines += ["", f"backward: your loss {self.loss:.12g}, the oracle's {self.reference_loss:.12g}, "
                      f"error {self.loss_error:.2e} (allowed {self.loss_allowed:.0e}) {verdict}",
                      "gradients, in backward order (your key <- canonical; max |yours - oracle| / max(1, max |oracle|)):"]
            width = max(len(row.key) for row in self.grads) if self.grads else 0
            for row in self.grads:
                lines.append(f"  {row.key:<{width}}  {row.error:.2e}  {'ok' if row.passed else 'FAIL'}  "
                             f"<- {', '.join(row.canonical)}")
            bad = self.first_bad_grad
            lines.append(f"first gradient out of tolerance: {bad}" if bad else
                         "every gradient within tolerance" if self.grads else "no gradient compared")
        verdict = ("ok" if self.ok else "DIVERGES" if self.diverges else
                   "ERROR (your model could not run)" if self.could_not_run else
                   "ERROR (your model's backward pass failed)" if self.backward_error else "FAIL")
        lines.append(f"result: {verdict}")
        return "\n".join(lines)

    __str__ = to_text

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.update({
            "layout": self.layout, "yours": self.yours.label, "first_divergence": self.first_divergence,
            "switches_at_divergence": list(switches_at(self.first_divergence, self.config)) if self.first_divergence
            else [],
            "not_exposed": self.unexposed(), "ok": self.ok, "assumed": list(self.assumed),
            "read_from_model_config": dict(self.told),
            "batch_axis_hint": self.swapped_axes(self.first_divergence) if self.first_divergence else None,
            "your_model_error": self.errors.get(self.yours.label), "your_traceback": self.failure or None,
            "backward_error": self.backward_error or None, "backward_traceback": self.backward_traceback or None,
            "backward_divergence": self.backward_divergence or None,
        })
        if self.loss is not None:
            out["backward"] = {
                "loss": self.loss, "reference_loss": self.reference_loss, "loss_error": self.loss_error,
                "allowed": self.loss_allowed, "first_bad_grad": self.first_bad_grad,
                "grads": [{"key": r.key, "canonical": list(r.canonical), "error": r.error, "allowed": r.allowed,
                           "passed": r.passed} for r in self.grads],
            }
        return out

    def swapped_axes(self, tensor: str) -> str | None:
        """When the user's `tensor` is the oracle's shape with its first two axes swapped: the
        layout read the model along the wrong batch axis, which no switch explains."""
        cell = self.cells.get((tensor, self.yours.label))
        if cell is None or cell.comparison is None or cell.comparison.shapes is None:
            return None
        theirs, ours = cell.comparison.shapes
        if len(theirs) < 2 or theirs[:2] != ours[1::-1] or theirs[2:] != ours[2:]:
            return None
        now = self.batch_axis
        return (f"your model's tensors are read with their batch on axis {now} (the layout's [taps] batch_axis = "
                f"{now}), and this one has its first two axes swapped: yours is "
                f"{'batch-first' if now == 1 else 'sequence-first'}; use a layout that extends {self.layout} with "
                f"`[taps] batch_axis = {1 - now}`")

    def plot(self, path) -> tuple[int, int]:
        """The `rosetta check` picture (plots.plot_check), the user's model as one of its lines."""
        from conformance.check.plots import plot_check

        return plot_check(self, path)


def _backend_names(backends: Any) -> list[str]:
    if backends is None or isinstance(backends, str):
        if isinstance(backends, str) and not backends.strip():
            return []
        try:
            names = backend_registry.requested_backends(backends)
        except ValueError as exc:
            raise InputError("backends", str(exc)) from None
        backend_registry.refuse_adapters(names, "backends")
        return names
    names = list(backends)
    unknown = [n for n in names if n not in backend_registry.BACKENDS]
    if unknown:
        raise InputError("backends", f"unknown backend(s) {unknown}; expected some of {list(backend_registry.BACKENDS)}")
    return names


def _default_run(model, src_ids, tgt_ids):
    return model(src_ids, tgt_ids)


def _ids(name: str, ids) -> np.ndarray:
    array = np.asarray(foreign.to_numpy_exact(ids))
    if array.dtype.kind not in "iu" or array.ndim != 2:
        raise InputError(name, f"must be a (B, L) array of integer token ids, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def shift_right(tgt_ids: np.ndarray) -> np.ndarray:
    """A 0 in front, the last id dropped: what a shift-right system embeds for `tgt_ids`."""
    return np.pad(tgt_ids, ((0, 0), (1, 0)))[:, :-1]


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
    `[hf]` table (empty for a layout without one, or a model without a transformers config)."""
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
            or a `(module, variables)` pair; or an nnx.Module.
        layout: a built-in layout name, a layout TOML file or a `Layout`, as for
            `conformance.convert.import_state_dict`; its `[taps]` say where the model computes
            each tensor.
        src_ids, tgt_ids: (B, S) and (B, T) integer ids, the batch both models run on (with
            padding, to exercise the masks). With a layout whose decoder shifts its targets
            itself (`decoder_input = "shift-right"`), `tgt_ids` are the targets the user's model
            takes, and ours is given them shifted.
        run: `run(model, src_ids, tgt_ids) -> logits` (or an object with `.logits`), how the
            user's model is called, with ids as that framework's arrays; default
            `model(src_ids, tgt_ids)`.
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
            oracle's own input from the layer below (`conformance.check.stream`, `rosetta check
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
    from conformance.convert import export_state_dict, load_layout

    layout = load_layout(layout)
    run = run or _default_run
    src_ids, tgt_ids = _ids("src_ids", src_ids), _ids("tgt_ids", tgt_ids)
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
    shifted = layout.tap_options["decoder_input"] == "shift-right"
    ours_tgt = shift_right(tgt_ids) if shifted else tgt_ids

    names = _backend_names(backends)
    targets, skipped = default_targets(names, [dtype]) if names else ([], {})
    source = f"your model through layout {layout.name}"
    oracle = None
    if targets and stream:
        from conformance.check.stream import Weights, run_streamed

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
                        assumed=[line for line in conversion.decisions if "(the layout's default" in line])
    result.targets = [yours, *result.targets]

    if not targets:
        progress("oracle (numpy/cpu/float64)")
    if oracle is None:
        oracle = _oracle(config, params, src_ids, ours_tgt)
    real = tgt_ids != config.pad_id if shifted else None
    tol = tolerance(yours.dtype, yours.device)
    progress(f"your model ({yours.label})")
    try:
        captured = foreign.capture(model, layout, result.tensors, run, src_ids, tgt_ids, config.to_dict())
    except Exception as exc:  # noqa: BLE001 - the user's code failing is reported with its own frames
        result.errors[yours.label] = describe(exc)
        result.failure = user_traceback(exc)
        return result
    if captured is not None:
        if "logits" not in captured.values and "logits" not in captured.unavailable:
            captured.values["logits"] = captured.logits
        for tensor in result.tensors:
            if tensor in captured.values:
                ours, theirs = oracle[tensor], captured.values[tensor]
                if real is not None and tensor.startswith(("decoder.", "logits")):
                    ours, theirs = _at(ours, real, tensor), _at(theirs, real, tensor)
                result.cells[(tensor, yours.label)] = Cell(comparison=compare_arrays(theirs, ours, tol))
            else:
                why = captured.unavailable.get(tensor) or foreign.not_applying(layout, tensor, config.to_dict()) or (
                    f"the layout {layout.name} has no tap for it")
                result.cells[(tensor, yours.label)] = Cell(unavailable=why)

    if grads:
        progress("gradients: your model's autograd and the oracle's backward pass")
        compare_grads(result, model, layout, config, params, run, src_ids, tgt_ids, ours_tgt,
                      _ids("labels", labels), label_smoothing, export_state_dict)
    return result


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


def _oracle(config: ModelConfig, params, src_ids, tgt_ids) -> dict[str, np.ndarray]:
    import impl_numpy

    # The parameters as converted, widened where used (exact): no float64 copy of every weight.
    held = stored_dtype(np.asarray(next(iter(params.values()))).dtype.name, "float64",
                        backend_registry.dtypes("numpy"))
    with backend_registry.forward_only("numpy"):
        out = impl_numpy.Model(config, params, dtype="float64", param_dtype=held)(src_ids, tgt_ids)
    return {name: np.asarray(value) for name, value in tensors_of(out).items()}


def _at(value, real: np.ndarray, tensor: str):
    """The positions of a decoder tensor whose target is real: (N, ...) from (B, T, ...), or
    from (B, H, T, S) attention weights."""
    value = np.asarray(value)
    if value.ndim == 4:
        value = np.swapaxes(value, 1, 2)
    if value.shape[:2] != real.shape:
        return value  # a shape problem, which compare() names
    return value[real]
