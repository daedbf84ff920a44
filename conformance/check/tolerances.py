"""The tolerance table: how far a backend's result may be from the float64 NumPy oracle.

One table, per dtype and device. A tensor passes when, elementwise,

    |actual - oracle| <= atol * scale + rtol * |oracle|,    scale = max(1, max |oracle| of the tensor)

and NaN appears in exactly the same positions (see `conformance.check.compare`). Every number here is justified by a measured
maximum error (see docs/tolerances.md for the measurement, how to repeat it, and the margin).
No test may loosen a tolerance locally.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# (dtype, device kind) -> Tolerance; device kind is "cpu" or "gpu". rtol is 0: the error of a
# float computation follows the magnitudes it combines, which `atol * scale` already states.
# Measured worst |backend - oracle| / scale (docs/tolerances.md: 10500 examples for numpy and
# torch over 12 seeds, 500 for JAX, which compiles every new shape), and the margin kept:
#   float64   torch 6.8e-14, jax 1.8e-14; pairs <= 2.6e-14                  -> 1e-12  (15x)
#   float32   numpy 2.7e-5, torch 7.6e-5, jax 7.9e-6;
#             pairs numpy~torch 5.8e-5, jax~torch 1.2e-5, jax~numpy 1.1e-5   -> 3e-4   (4x)
#   float16   torch 8.7e-3, jax 3.7e-3; pair 5.3e-3                         -> 5e-2   (5.7x)
#   bfloat16  torch 6.2e-2, jax 2.4e-2; pair 2.5e-2                         -> 2e-1   (3.2x)
# float32 was 1e-4 on a 1500-example measurement (worst 7.9e-6); ten times as many examples found
# 7.6e-5 (a peaked cross-attention row two layers deep at weight scale 2), which left a 1.3x
# margin: a thorough run would soon have cried wolf.
# GPU rows repeat the CPU rows until a GPU run measures them (TF32 is off for every comparison).
TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("float64", "cpu"): Tolerance(atol=1e-12, rtol=0.0),
    ("float64", "gpu"): Tolerance(atol=1e-12, rtol=0.0),
    ("float32", "cpu"): Tolerance(atol=3e-4, rtol=0.0),
    ("float32", "gpu"): Tolerance(atol=3e-4, rtol=0.0),
    ("float16", "cpu"): Tolerance(atol=5e-2, rtol=0.0),
    ("float16", "gpu"): Tolerance(atol=5e-2, rtol=0.0),
    ("bfloat16", "cpu"): Tolerance(atol=2e-1, rtol=0.0),
    ("bfloat16", "gpu"): Tolerance(atol=2e-1, rtol=0.0),
}


def tolerance(dtype: str, device: str = "cpu") -> Tolerance:
    """The tolerance for results computed in `dtype` on a device of kind `device`."""
    kind = "cpu" if device.split(":")[0] == "cpu" else "gpu"
    try:
        return TOLERANCES[(dtype, kind)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype!r} on {kind}; known: {sorted(TOLERANCES)}") from None


# Gradients (`loss_and_grads`, docs/training.md) against the float64 NumPy backward pass, by the
# same criterion, each gradient its own tensor. Measured with `python -m
# conformance.suite.measure_gradients --torch-autograd` (docs/tolerances.md, "Gradients"; 847
# examples over seeds 0-3):
#   float64   PyTorch autograd 7.4e-13                                       -> 1e-11  (14x)
#   float32   numpy 2.9e-4, PyTorch autograd 2.9e-4                          -> 2e-3   (7x)
# float32 gradients sit ~4x above the forward's worst: a backward pass multiplies by the same
# peaked softmax Jacobians and LayerNorm 1/std twice, once each way. Examples whose ReLU inputs
# come within the forward tolerance of 0 are left out below float64 (`runner.relu_kink_distance`).
# Half precision has no gradient row: nothing has measured it yet.
GRADIENT_TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("float64", "cpu"): Tolerance(atol=1e-11, rtol=0.0),
    ("float64", "gpu"): Tolerance(atol=1e-11, rtol=0.0),
    ("float32", "cpu"): Tolerance(atol=2e-3, rtol=0.0),
    ("float32", "gpu"): Tolerance(atol=2e-3, rtol=0.0),
}


def gradient_tolerance(dtype: str, device: str = "cpu") -> Tolerance:
    """The tolerance for gradients computed in `dtype` on a device of kind `device`."""
    kind = "cpu" if device.split(":")[0] == "cpu" else "gpu"
    try:
        return GRADIENT_TOLERANCES[(dtype, kind)]
    except KeyError:
        raise KeyError(f"no gradient tolerance for dtype {dtype!r} on {kind}; known: {sorted(GRADIENT_TOLERANCES)}") from None

# Half precision is specified for weights at the scale of a trained model (the initialiser's
# scale <= 1). At scale 2, attention scores reach magnitudes of ~50, and bfloat16's 8-bit
# mantissa moves them by ~0.2, which a sharp softmax turns into attention weights off by up to
# 0.43 (measured): bfloat16 doing what bfloat16 does, not a backend bug. float32 and float64 are
# checked at every scale.
HALF_PRECISION_MAX_WEIGHT_SCALE = 1.0


def in_domain(dtype: str, weight_scale: float) -> bool:
    """Whether the tolerance table makes a claim for results in `dtype` at this weight scale."""
    return dtype not in ("float16", "bfloat16") or weight_scale <= HALF_PRECISION_MAX_WEIGHT_SCALE
