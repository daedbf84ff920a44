"""`conformance.compare(..., grads=True)`: the user's loss and every parameter's gradient, by its
own autograd (torch) or `jax.grad` (Flax), beside the float64 oracle's hand-written backward pass
exported to the user's keys through the layout, in backward order.

The loss is ours (docs/training.md) on the user's logits: logits that do not fit the labels are a
divergence at the logits (`backward_divergence`), not an error of the user's code; the user's
backward pass raising is (`backward_error`, with its own frames), kept apart from a forward that
could not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.check.foreign import taps as foreign
from conformance.check.tolerances import gradient_tolerance
from conformance.check.training import backward_order, scaled_error
from conformance.check.foreign.user_code import describe, user_traceback
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError


@dataclass
class GradRow:
    """One of the user's parameters: its gradient against the oracle's, exported to its key."""

    key: str
    canonical: tuple[str, ...]
    error: float
    allowed: float

    @property
    def passed(self) -> bool:
        return self.error <= self.allowed


def _foreign_names(config: ModelConfig, layout, export) -> dict[str, tuple[str, ...]]:
    """foreign key -> the canonical parameters it holds, found by exporting a probe whose every
    canonical parameter is filled with its own number (transposes and splits keep the numbers)."""
    from conformance.core.params import param_shapes

    shapes = param_shapes(config)
    # Position tables stay 0 (no number): a system keeps them as one buffer, not a parameter.
    numbers = {name: float(n + 1) for n, name in enumerate(shapes) if not name.endswith("position.table")}
    probe = {name: np.full(shape, numbers.get(name, 0.0)) for name, shape in shapes.items()}
    by_number = {v: k for k, v in numbers.items()}
    exported = _flat(export(config, probe, layout, **_as_converted(config, layout)))
    return {key: tuple(by_number[v] for v in np.unique(value) if v in by_number) for key, value in exported.items()}


def _as_converted(config: ModelConfig, layout) -> dict[str, Any]:
    """Export back to the very model that was converted: a stored position table stays a table
    (where the system would recompute it on load, Marian, the export otherwise refuses)."""
    return {"position": config.position} if layout.stores_positions() else {}


def _flat(state) -> dict[str, np.ndarray]:
    return foreign._flatten(state) if any(isinstance(v, dict) for v in state.values()) else dict(state)


def compare_grads(result, model, layout, config, params, run, src_ids, tgt_ids, ours_tgt, labels,
                  label_smoothing, export) -> None:
    """Fill `result` (a SideBySide) with the user's loss and gradients beside the oracle's, or with
    why they were not compared: `backward_divergence` (logits that do not fit the labels) or
    `backward_error` and `backward_traceback` (the user's backward pass raised)."""
    import impl_numpy

    if labels.shape != ours_tgt.shape:
        raise InputError("labels", f"must have the targets' shape {ours_tgt.shape}, got {labels.shape}")
    reference = impl_numpy.Model(config, params, dtype="float64")
    ref_loss, ref_grads = reference.loss_and_grads(src_ids, ours_tgt, labels, label_smoothing=label_smoothing)
    # A system's position buffer has no gradient of its own (it is not a parameter there): its
    # exported gradient is left at zero, and no user gradient is compared with it.
    ref_grads = {k: (np.zeros_like(v) if k.endswith("position.table") else np.asarray(v, np.float64))
                 for k, v in ref_grads.items()}
    exported = _flat(export(config, ref_grads, layout, **_as_converted(config, layout)))
    names = _foreign_names(config, layout, export)
    try:
        loss, grads = foreign.foreign_loss_and_grads(model, run, src_ids, tgt_ids, labels, pad_id=config.pad_id,
                                                     label_smoothing=label_smoothing)
    except foreign.LogitsShapeError as exc:  # the loss is ours: its logits' shape is a divergence
        result.backward_divergence = str(exc)
        return
    except Exception as exc:  # noqa: BLE001 - the user's backward pass failing, with its own frames
        result.backward_error, result.backward_traceback = describe(exc), user_traceback(exc)
        return
    allowed = gradient_tolerance(result.yours.dtype, result.yours.device).atol
    order = {name: n for n, name in enumerate(backward_order(config))}
    rows = []
    for key, grad in grads.items():
        canonical = names.get(key, ())
        if key not in exported:
            rows.append((-1, GradRow(key, canonical, float("inf"), allowed)))
            continue
        error = scaled_error(np.asarray(grad, np.float64), exported[key].reshape(np.shape(grad)))
        rows.append((min((order[c] for c in canonical), default=len(order)), GradRow(key, canonical, error, allowed)))
    result.grads = [row for _, row in sorted(rows, key=lambda pair: pair[0])]
    result.loss, result.reference_loss, result.loss_allowed = loss, float(ref_loss), allowed
