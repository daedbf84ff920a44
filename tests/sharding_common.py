"""What tests/scale/test_jax_shard.py and tests/scale/test_torch_parallel.py share: the model, the
plans, the meshes each profile runs, and the tolerance table's measure. Both run their cases in a
subprocess (`python tests/scale/test_X.py`), which imports this module with tests/ on its
PYTHONPATH (tests/rooms.py)."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import settings

from conformance.check.scale.sharded import max_error  # noqa: F401 - the table's measure, defined once
from conformance.core.sharding import PLANS  # noqa: F401 - the plans, defined once

CONFIG = dict(d_model=16, n_heads=4, d_ff=32, src_vocab_size=32, tgt_vocab_size=32, n_encoder_layers=1,
              n_decoder_layers=1, max_len=16)
BATCH, SRC_LEN, TGT_LEN = 8, 6, 5


def meshes(every: tuple, ci: tuple) -> tuple:
    """The (data, model) meshes to run: the parent's choice in the subprocess ($ROSETTA_TEST_MESHES),
    else `ci` under the `ci` profile (CI time) and `every` under the others."""
    chosen = os.environ.get("ROSETTA_TEST_MESHES")
    if chosen:
        return tuple(tuple(int(n) for n in mesh.split("x")) for mesh in chosen.split(","))
    return every if settings._current_profile != "ci" else ci


def mesh_env(chosen: tuple) -> dict:
    """The environment that hands `chosen` meshes to the subprocess."""
    return {"ROSETTA_TEST_MESHES": ",".join(f"{d}x{m}" for d, m in chosen)}


def tolerance_of(name: str) -> float:
    """The float64 table's atol for a recorded tensor: the gradient row for `grad:` names."""
    from conformance.check.tolerances import gradient_tolerance, tolerance

    return (gradient_tolerance if name.startswith("grad:") else tolerance)("float64", "cpu").atol


def table_bound(reference_grad) -> float:
    """The most the gradient table allows a gradient to differ (its atol times the gradient's
    scale): the difference assumed where a fused step computes its gradients inside."""
    from conformance.check.tolerances import gradient_tolerance

    return gradient_tolerance("float64", "cpu").atol * max(1.0, float(np.max(np.abs(reference_grad))))


def adam_excess(stepped, reference, grad, reference_grad, lr: float, eps: float, *, d=None) -> float:
    """How far a stepped parameter is from the reference's beyond what Adam's first step makes of
    the difference of the gradients it was given, in the table's measure.

    The first step moves each weight by u(g) = -lr g / (|g| + eps) (m-hat = g, v-hat = g^2), whose
    slope lr eps / (|g| + eps)^2 is lr / eps = 1e7 lr near g = 0: a gradient that is zero in
    exact arithmetic (a key projection's bias: softmax ignores a shift shared by every key)
    and 1e-17 of rounding in either run moves its weight by 1e-8 lr, differently in each. So the
    step is compared after taking off that amplification of the gradient difference d:
    lr eps d / (max(|g| - d, 0) + eps)^2, elementwise. `d`: the measured |grad - reference_grad|
    unless given (`table_bound` for a fused step, whose gradients never come out): a weight whose
    gradient is well above eps still gets a bound far below the table; one whose gradient is
    rounding gets up to lr times the table / eps."""
    stepped, reference = np.asarray(stepped, np.float64), np.asarray(reference, np.float64)
    grad, reference_grad = np.asarray(grad, np.float64), np.asarray(reference_grad, np.float64)
    if d is None:
        d = np.abs(grad - reference_grad)
    amplified = lr * eps * d / (np.maximum(np.abs(reference_grad) - d, 0.0) + eps) ** 2
    excess = np.maximum(np.abs(stepped - reference) - amplified, 0.0)
    return float(np.max(excess) / max(1.0, float(np.max(np.abs(reference)))))


def step_errors(reference: dict, sharded: dict, *, fused: bool = False, skip: str | None = None) -> dict:
    """Each recorded tensor's error (`max_error`); each stepped weight's by `adam_excess`, its raw
    error kept as `raw stepped:NAME` (reported, not judged). `fused`: the step's gradients stayed
    inside (`table_bound`); `skip`: a prefix of names recorded but not compared."""
    errors = {}
    for name in reference:
        if name.startswith("stepped:"):
            weight = name[len("stepped:"):]
            grad, reference_grad = sharded[f"grad:{weight}"], reference[f"grad:{weight}"]
            errors[name] = adam_excess(sharded[name], reference[name], grad, reference_grad, reference["lr"],
                                       reference["eps"], d=table_bound(reference_grad) if fused else None)
            errors[f"raw {name}"] = max_error(sharded[name], reference[name])
        elif name not in ("lr", "eps") and not (skip and name.startswith(skip)):
            errors[name] = max_error(sharded[name], reference[name])
    return errors
