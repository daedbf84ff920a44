"""The report of `conformance.compare` (`SideBySide`: a `rosetta check` report with the user's
model as a column) and the small pieces every way of putting a model beside the oracle shares:
the backends asked for, the ids, the shift-right, the oracle's tensors and the decoder's real
positions. `conformance.check.foreign.side_by_side` (a live model) and `conformance.check.onnx.compare`
(ONNX graphs) both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conformance.check import backends as backend_registry
from conformance.check.foreign import taps as foreign
from conformance.check.plan import stored_dtype
from conformance.check.report import Report
from conformance.check.foreign.grads import GradRow
from conformance.check.switches import switches_at
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.output import tensors_of

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
    # How the user's model was called (in words), and whether that call gave it no padding mask
    # on a batch with padding (the default `model(src_ids, tgt_ids)`): said before any switch.
    called: str = ""
    unmasked: bool = False
    unmasked_remedy: str = ""  # how to give it its mask, where not run= (an ONNX graph: export it with one)
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

    def islands(self) -> dict[str, str]:
        """tensor -> the float32 island (the layout's `[float32_islands]` name) its error is put down to."""
        return {tensor: cell.island for (tensor, label), cell in self.cells.items()
                if label == self.yours.label and cell.island is not None}

    def unexposed(self) -> dict[str, str]:
        return {tensor: cell.unavailable for (tensor, label), cell in self.cells.items()
                if label == self.yours.label and cell.unavailable is not None}

    def to_text(self) -> str:
        text = super().to_text().replace("rosetta check:", "rosetta compare:", 1)
        lines = [text, ""]
        if self.told:
            lines.append(f"read from {self.told_by}: " + ", ".join(f"{k}={v!r}" for k, v in sorted(self.told.items())))
        if self.called:
            lines.append(f"your model was called as {self.called}")
        if self.assumed:
            lines.append("assumed (the tensors do not tell them):")
            lines += [f"  {line}" for line in self.assumed]
        unexposed = self.unexposed()
        if unexposed:
            lines.append(f"not exposed by your model ({len(unexposed)} tensors; not compared, never guessed):")
            lines += [f"  {tensor}: {why}" for tensor, why in unexposed.items()]
        islands = self.islands()
        if islands:
            from conformance.check.tolerances import ISLAND

            lines.append(f"float32 islands ({len(islands)} tensors out of float64's tolerance, within float32 rounding "
                         f"({ISLAND.atol:.2g} * scale) where your system computes a part in float32; expected, not a "
                         "divergence):")
            lines += [f"  {tensor}: float32 island in {name}: expected" for tensor, name in islands.items()]
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
            if self.unmasked:
                lines.append("  the run gave your model no padding mask, and the batch has padding: a model that masks "
                             "padding only when given a mask (an attention_mask, a key_padding_mask) parts from the "
                             "oracle here for that alone; "
                             + (self.unmasked_remedy or "call it with its mask (run=, or rosetta compare --run NAME)")
                             + " before suspecting a switch")
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
            "not_exposed": self.unexposed(), "float32_islands": self.islands(), "ok": self.ok,
            "called_as": self.called or None, "run_gave_no_padding_mask": self.unmasked, "assumed": list(self.assumed),
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


def backend_names(backends: Any) -> list[str]:
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


def as_ids(name: str, ids) -> np.ndarray:
    array = np.asarray(foreign.to_numpy_exact(ids))
    if array.dtype.kind not in "iu" or array.ndim != 2:
        raise InputError(name, f"must be a (B, L) array of integer token ids, got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def as_features(src) -> np.ndarray:
    """A features source's batch: log-mel features, a float array (B, n_mels, frames), as float64."""
    array = np.asarray(foreign.to_numpy_exact(src))
    if array.dtype.kind != "f" or array.ndim != 3:
        raise InputError("src_ids", f"must be log-mel features, a float array (B, n_mels, frames), got {array.dtype} "
                                    f"{array.shape}")
    return array.astype(np.float64)


def shift_right(tgt_ids: np.ndarray) -> np.ndarray:
    """A 0 in front, the last id dropped: what a shift-right system embeds for `tgt_ids`."""
    return np.pad(tgt_ids, ((0, 0), (1, 0)))[:, :-1]


def oracle_tensors(config: ModelConfig, params, src_ids, tgt_ids) -> dict[str, np.ndarray]:
    import impl_numpy

    # The parameters as converted, widened where used (exact): no float64 copy of every weight.
    held = stored_dtype(np.asarray(next(iter(params.values()))).dtype.name, "float64",
                        backend_registry.dtypes("numpy"))
    with backend_registry.forward_only("numpy"):
        out = impl_numpy.Model(config, params, dtype="float64", param_dtype=held)(src_ids, tgt_ids)
    return {name: np.asarray(value) for name, value in tensors_of(out).items()}


def decoder_positions(value, real: np.ndarray, tensor: str):
    """The positions of a decoder tensor whose target is real: (N, ...) from (B, T, ...), or
    from (B, H, T, S) attention weights."""
    value = np.asarray(value)
    if value.ndim == 4:
        value = np.swapaxes(value, 1, 2)
    if value.shape[:2] != real.shape:
        return value  # a shape problem, which compare() names
    return value[real]
