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
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (actual, expected) when they differ
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


# compare() works through a tensor this many elements at a time, so that its float64 temporaries
# (both operands, the errors, the masks) take about 16 MB whatever the tensor's size; a base-size
# model's logits at length 512 are 260 MB in float64 alone. (Measured on those logits: 0.64 s at
# this size, 1.15 s at 1 << 20, where the temporaries no longer fit the cache.)
CHUNK = 1 << 18


def on_host(x: Any) -> np.ndarray:
    """Any backend's array as a NumPy array on the host, in its own dtype where NumPy has it
    (a torch bfloat16 tensor comes back as float32, which holds it exactly)."""
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _chunks(*arrays: np.ndarray):
    """(offset, float64 slices of each array) over the flattened arrays, CHUNK elements at a time."""
    flat = [a.reshape(-1) for a in arrays]
    for start in range(0, flat[0].size, CHUNK):
        yield start, [f[start: start + CHUNK].astype(np.float64) for f in flat]


def tensor_scale(expected: np.ndarray) -> float:
    """max(1, largest finite |value|): the magnitude that `atol` is measured against."""
    largest = 0.0
    for _, (e,) in _chunks(np.asarray(expected)):
        finite = np.abs(e[np.isfinite(e)])
        if finite.size:
            largest = max(largest, float(finite.max()))
    return max(1.0, largest)


class _FirstMax:
    """The running np.argmax over chunks: the first largest value, a NaN counting as largest."""

    def __init__(self):
        self.value, self.index = None, None

    def offer(self, values: np.ndarray, offset: int) -> None:
        i = int(np.argmax(values))
        value = float(values[i])
        if self.value is None or (not np.isnan(self.value) and (np.isnan(value) or value > self.value)):
            self.value, self.index = value, offset + i


def compare(actual: Any, expected: Any, tol: Tolerance) -> Comparison:
    """Elementwise `|actual - expected| <= atol * scale + rtol * |expected|`, where `scale` is
    max(1, the tensor's largest |expected|); NaN only where expected is NaN.

    A float computation's error is proportional to the magnitudes it combines, not to each
    element's own size: a small element of a large residual stream carries the rounding of the
    large ones. Scaling `atol` by the tensor's magnitude states that directly. The work goes in
    chunks of `CHUNK` elements, with the same result as on the whole tensor at once.
    """
    a, e = on_host(actual), on_host(expected)
    if a.shape != e.shape:
        return Comparison(passed=False, shape_problem=f"shape {a.shape} differs from the oracle's {e.shape}",
                          shapes=(tuple(a.shape), tuple(e.shape)))
    if a.dtype == np.bool_ or e.dtype == np.bool_ or a.dtype.kind in "iu":
        diff = a != e
        count = int(diff.sum())
        first = _index(int(np.argmax(diff)), a.shape) if count else None
        return Comparison(passed=count == 0, violations=count, first_violation_at=first,
                          max_abs=float(count > 0), max_abs_at=first,
                          values_at_max_abs=(float(a[first]), float(e[first])) if count else None)
    pieces = Pieces(a.shape, tensor_scale(e), tol)
    pieces.add(a, e)
    return pieces.result()


class Pieces:
    """compare() of a tensor that arrives in consecutive pieces (in flat order: e.g. one batch row
    at a time), given the whole oracle tensor's `scale` (`tensor_scale`): `add(actual, expected)`
    for each piece, then `result()`, the Comparison compare() gives on the whole tensor. compare()
    itself is one piece, so both are the same code."""

    def __init__(self, shape: tuple[int, ...], scale: float, tol: Tolerance):
        self.shape, self.tol, self.seen = tuple(shape), tol, 0
        self.comparison = Comparison(passed=True, scale=scale)
        self.worst_abs, self.worst_rel = _FirstMax(), _FirstMax()

    def add(self, actual: Any, expected: Any) -> None:
        a, e = on_host(actual), on_host(expected)
        result, tol, scale = self.comparison, self.tol, self.comparison.scale
        for start, (a_part, e_part) in _chunks(a, e):
            offset = self.seen + start
            nan_a, nan_e = np.isnan(a_part), np.isnan(e_part)
            nan_diff = nan_a != nan_e
            both = ~(nan_a | nan_e)
            with np.errstate(invalid="ignore", over="ignore"):
                abs_err = np.where(both, np.abs(a_part - e_part), 0.0)
                abs_err = np.where(both & (a_part == e_part), 0.0, abs_err)  # equal infinities are not an error
                rel_err = np.where(both, abs_err / np.maximum(np.abs(e_part), np.finfo(np.float64).tiny), 0.0)
                bad = both & ~(abs_err <= tol.atol * scale + tol.rtol * np.abs(e_part))
            before = self.worst_abs.index
            self.worst_abs.offer(abs_err, offset)
            if self.worst_abs.index != before:  # the values there, while this piece is at hand
                k = self.worst_abs.index - offset
                result.values_at_max_abs = (float(a_part[k]), float(e_part[k]))
            self.worst_rel.offer(rel_err, offset)
            if bad.any():
                if not result.violations:
                    result.first_violation_at = _index(offset + int(np.argmax(bad)), self.shape)
                result.violations += int(bad.sum())
            if nan_diff.any():
                if not result.nan_mismatches:
                    k = int(np.argmax(nan_diff))
                    result.first_nan_mismatch_at = _index(offset + k, self.shape)
                    result.values_at_nan_mismatch = (float(a_part[k]), float(e_part[k]))
                result.nan_mismatches += int(nan_diff.sum())
        self.seen += a.size

    def result(self) -> Comparison:
        result = self.comparison
        result.passed = not result.violations and not result.nan_mismatches
        if self.seen:
            result.max_abs, result.max_abs_at = self.worst_abs.value, _index(self.worst_abs.index, self.shape)
            result.max_rel, result.max_rel_at = self.worst_rel.value, _index(self.worst_rel.index, self.shape)
        else:
            result.values_at_max_abs = None
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
