"""Comparing a backend's tensors with the oracle, and saying exactly where they differ.

`compare` measures; `assert_close` fails with a message that names the backend, device, dtype,
config, tensor, the largest absolute and relative errors and where they occurred. Both accept
NumPy arrays, torch tensors and JAX arrays (converted by duck typing, without importing either
framework).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.check.tolerances import Tolerance


def to_numpy(x: Any) -> np.ndarray:
    """Any backend's array as a float64 (or bool/int) NumPy array on the host."""
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.double()
        return x.numpy()
    x = np.asarray(x)
    if x.dtype.kind in "fV" or x.dtype.name == "bfloat16":
        x = x.astype(np.float64)
    return x


@dataclass
class Comparison:
    """How `actual` differs from `expected`; `passed` is the verdict under the tolerance."""

    passed: bool
    max_abs: float = 0.0
    max_abs_at: tuple[int, ...] | None = None
    max_rel: float = 0.0
    max_rel_at: tuple[int, ...] | None = None
    violations: int = 0
    first_violation_at: tuple[int, ...] | None = None
    nan_mismatches: int = 0
    first_nan_mismatch_at: tuple[int, ...] | None = None
    shape_problem: str | None = None
    scale: float = 1.0
    # (actual, expected) at max_abs_at and at first_nan_mismatch_at: both values, not just the gap.
    values_at_max_abs: tuple[float, float] | None = None
    values_at_nan_mismatch: tuple[float, float] | None = None

    def describe(self) -> str:
        if self.shape_problem:
            return self.shape_problem
        parts = [
            f"max abs error {self.max_abs:.3e} at {self.max_abs_at}{_values(self.values_at_max_abs)} "
            f"(tensor scale {self.scale:.3g})",
            f"max rel error {self.max_rel:.3e} at {self.max_rel_at}",
        ]
        if self.violations:
            parts.append(f"{self.violations} element(s) out of tolerance, first at {self.first_violation_at}")
        if self.nan_mismatches:
            parts.append(f"{self.nan_mismatches} NaN position(s) differ, first at {self.first_nan_mismatch_at}"
                         f"{_values(self.values_at_nan_mismatch)}")
        return "; ".join(parts)


def _values(pair: tuple[float, float] | None) -> str:
    return "" if pair is None else f" (got {pair[0]:.9g}, expected {pair[1]:.9g})"


def _index(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat_index, shape))


def tensor_scale(expected: np.ndarray) -> float:
    """max(1, largest finite |value|): the magnitude that `atol` is measured against."""
    finite = np.abs(expected[np.isfinite(expected)])
    return max(1.0, float(finite.max())) if finite.size else 1.0


def compare(actual: Any, expected: Any, tol: Tolerance) -> Comparison:
    """Elementwise `|actual - expected| <= atol * scale + rtol * |expected|`, where `scale` is
    max(1, the tensor's largest |expected|); NaN only where expected is NaN.

    A float computation's error is proportional to the magnitudes it combines, not to each
    element's own size: a small element of a large residual stream carries the rounding of the
    large ones. Scaling `atol` by the tensor's magnitude states that directly.
    """
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        return Comparison(passed=False, shape_problem=f"shape {a.shape} differs from the oracle's {e.shape}")
    if a.dtype == np.bool_ or e.dtype == np.bool_ or a.dtype.kind in "iu":
        diff = a != e
        count = int(diff.sum())
        first = _index(int(np.argmax(diff)), a.shape) if count else None
        return Comparison(passed=count == 0, violations=count, first_violation_at=first,
                          max_abs=float(count > 0), max_abs_at=first,
                          values_at_max_abs=(float(a[first]), float(e[first])) if count else None)
    a, e = a.astype(np.float64), e.astype(np.float64)
    scale = tensor_scale(e)
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    nan_diff = nan_a != nan_e
    both = ~(nan_a | nan_e)
    with np.errstate(invalid="ignore", over="ignore"):
        abs_err = np.where(both, np.abs(a - e), 0.0)
        abs_err = np.where(both & (a == e), 0.0, abs_err)  # equal infinities are not an error
        rel_err = np.where(both, abs_err / np.maximum(np.abs(e), np.finfo(np.float64).tiny), 0.0)
        bad = both & ~(abs_err <= tol.atol * scale + tol.rtol * np.abs(e))
    result = Comparison(passed=not bad.any() and not nan_diff.any(), scale=scale)
    if a.size:
        i = int(np.argmax(abs_err))
        result.max_abs, result.max_abs_at = float(abs_err.flat[i]), _index(i, a.shape)
        result.values_at_max_abs = (float(a.flat[i]), float(e.flat[i]))
        j = int(np.argmax(rel_err))
        result.max_rel, result.max_rel_at = float(rel_err.flat[j]), _index(j, a.shape)
    if bad.any():
        result.violations = int(bad.sum())
        result.first_violation_at = _index(int(np.argmax(bad)), a.shape)
    if nan_diff.any():
        result.nan_mismatches = int(nan_diff.sum())
        k = int(np.argmax(nan_diff))
        result.first_nan_mismatch_at = _index(k, a.shape)
        result.values_at_nan_mismatch = (float(a.flat[k]), float(e.flat[k]))
    return result


ORACLE = "the float64 oracle"


def assert_close(
    actual: Any,
    expected: Any,
    tol: Tolerance,
    *,
    tensor: str,
    backend: str,
    device: str = "cpu",
    dtype: str = "",
    config: Any = None,
    against: str = ORACLE,
) -> Comparison:
    """Fail with a message that says who differs from what (`against`), where, and by how much."""
    __tracebackhide__ = True
    result = compare(actual, expected, tol)
    if not result.passed:
        summary = config.summary() if hasattr(config, "summary") else config
        raise AssertionError(
            f"{backend} on {device} ({dtype}) differs from {against} in {tensor!r}: "
            f"{result.describe()} [tolerance atol={tol.atol:g}, rtol={tol.rtol:g}]; config: {summary}"
        )
    return result
