"""What every backend's training code shares, framework-free: the optimizer's host checks and
the paper's learning-rate schedule (docs/training.md). The loss's arguments (labels, label
smoothing) are checked in `conformance.core.inputs`, beside the ids.

This module is framework-free (NumPy and the standard library).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from conformance.core.errors import InputError


# The paper's optimizer (section 5.3) ----------------------------------------------------------

PAPER_BETAS = (0.9, 0.98)
PAPER_EPS = 1e-9
PAPER_WARMUP = 4000


def check_adam(d_model: Any, warmup: Any, betas: Any, eps: Any) -> tuple[int, int, tuple[float, float], float]:
    """The optimizer's arguments, the same `InputError` from every backend."""
    if isinstance(d_model, bool) or not isinstance(d_model, (int, np.integer)) or d_model <= 0:
        raise InputError("d_model", f"must be a positive int, got {d_model!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or warmup <= 0:
        raise InputError("warmup", f"must be a positive int (steps), got {warmup!r}")
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise InputError("betas", f"must be two floats in [0, 1), got {betas!r}") from None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise InputError("betas", f"must be two floats in [0, 1), got {betas!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or not math.isfinite(eps):
        raise InputError("eps", f"must be a positive finite float, got {eps!r}")
    return int(d_model), int(warmup), (beta1, beta2), float(eps)


def paper_lrate(step: int, d_model: int, warmup: int = PAPER_WARMUP) -> float:
    """lrate = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), for step = 1, 2, ... (equation 3).

    It rises linearly for `warmup` steps, peaks at step = warmup, and decays as step^-0.5."""
    if step < 1:
        raise InputError("step", f"the schedule counts steps from 1, got {step}")
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def check_grads(param_shapes: dict[str, tuple[int, ...]], names: Sequence[str], shape_of) -> None:
    """Gradients given to an optimizer step: exactly the model's parameter names, each of its
    parameter's shape (`shape_of(name)` reads the gradient's shape)."""
    given = set(names)  # a set: as lists, 260 names against 260 took 0.5-0.6 ms a step
    missing = [name for name in param_shapes if name not in given]
    unknown = [name for name in names if name not in param_shapes]
    if missing or unknown:
        raise InputError("grads", f"keys must be the model's parameter names; missing {missing[:3]}, "
                                  f"unknown {unknown[:3]}")
    for name, shape in param_shapes.items():
        if tuple(shape_of(name)) != tuple(shape):
            raise InputError("grads", f"{name} has shape {tuple(shape_of(name))}, its parameter {tuple(shape)}")


def train_step(model, optimizer, src_ids, tgt_ids, labels, *, label_smoothing: float = 0.0):
    """Forward, loss, backward (`model.loss_and_grads`) and one optimizer step (`optimizer.step`,
    any backend's `Adam`); returns the loss. Each backend exports it as its own `train_step`."""
    loss, grads = model.loss_and_grads(src_ids, tgt_ids, labels, label_smoothing=label_smoothing)
    optimizer.step(grads)
    return loss
