"""The check every format makes of what it wrote, before it is renamed into place.

The probes are two batches (`probes`): `conformance.check.report.fixed_batch`'s three rows,
padded three ways (none, trailing, all but one token), and one row as long as the model takes
(min(max_len, source_len), at most LONGEST tokens), which reads the positions a short row never
reaches: a position table's later rows, the relative buckets of distant positions. The oracle is
the float64 NumPy model on the parameters the conversion holds in memory, as `rosetta check`
runs it. What runs the output is the system that
will read it (transformers, ONNX Runtime, CTranslate2, torch DCP, Orbax, our own loader); its
result is compared with the oracle's at the tolerance of the dtype it computes in
(`conformance.check.tolerances`). Where it exposes every tensor, the first one out of tolerance
is named with the switches that act there (`conformance.check.switches`); where it exposes only
parameters and a config, the first parameter or field that differs is named.

Each check ends in a `Verdict`: passed, failed (with the first divergence), not run (and why: a
runtime that is not installed, a model above the memory budget) or skipped (`--no-verify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from conformance.core.config import ModelConfig

# The probes live beside the check's batches (a check room, CTranslate2's, runs them too).
from conformance.check.probes import LONGEST, PROBE, probe, probe_names, probes  # noqa: F401


@dataclass(frozen=True)
class Verdict:
    """One check of an output. `passed`: True, False, or None when it was not run (`why` says
    why) or skipped. `runtime`: what ran it; `says`: the result, one line; `divergence`: on a
    failure, where the output first parts from the oracle and the switches acting there."""

    passed: bool | None
    runtime: str = ""
    says: str = ""
    divergence: str = ""
    skipped: bool = False

    def line(self) -> str:
        if self.skipped:
            return "  not verified: --no-verify skipped the check of what was written"
        if self.passed is None:
            return f"  not verified: {self.says}"
        if self.passed:
            return f"  verified: {self.runtime}: {self.says}"
        return f"  FAILED: {self.runtime}: {self.divergence}"


def passed(runtime: str, says: str) -> Verdict:
    return Verdict(True, runtime, says)


def failed(runtime: str, divergence: str) -> Verdict:
    return Verdict(False, runtime, divergence=divergence)


def not_run(why: str) -> Verdict:
    return Verdict(None, says=why)


def skipped() -> Verdict:
    return Verdict(None, skipped=True)


def logits_on_probes(config: ModelConfig, params: Mapping[str, Any], run, dtype: str,
                     batches=None) -> tuple[bool, str, tuple[np.ndarray, np.ndarray] | None]:
    """`run(src, tgt)` -> logits (an array), beside the oracle's on every probe (`probes`) within
    `dtype`'s tolerance: (within on all, what to say, the (src, tgt) where it first was not)."""
    from conformance.check.compare import compare
    from conformance.check.tolerances import tolerance

    batches = probes(config) if batches is None else batches
    largest = 0.0
    for what, src, tgt in batches:
        expected = oracle(config, params, src, tgt)["logits"]
        actual = np.asarray(run(src, tgt), dtype=np.float64)
        within, says = logits_within(actual, expected, dtype, probe=what)
        if not within:
            return False, says, (src, tgt)
        largest = max(largest, compare(actual, expected, tolerance(dtype, "cpu")).max_abs)
    tol = tolerance(dtype, "cpu")
    return True, (f"logits within {tol.atol:.0e} x scale of the float64 oracle on {probe_names(batches)} (max abs "
                  f"error {largest:.1e})"), None


def stored(params: Mapping[str, Any]) -> str:
    return np.asarray(next(iter(params.values()))).dtype.name


def oracle(config: ModelConfig, params: Mapping[str, Any], src_ids, tgt_ids) -> dict[str, np.ndarray]:
    """Every tensor of the float64 NumPy model on `params` (widened where used, as `rosetta check` does)."""
    import impl_numpy
    from conformance.check.plan import stored_dtype
    from conformance.core.output import tensors_of

    model = impl_numpy.Model(config, dict(params), dtype="float64",
                             param_dtype=stored_dtype(stored(params), "float64", impl_numpy.SUPPORTED_DTYPES))
    with np.errstate(all="ignore"):
        return tensors_of(model(src_ids, tgt_ids))


def first_tensor(actual: Mapping[str, Any], expected: Mapping[str, np.ndarray], config: ModelConfig,
                 dtype: str, device: str = "cpu") -> str | None:
    """Where `actual` first leaves the oracle's tolerance for `dtype`, in forward order, with the
    switches that act there; None when every tensor both have is within it."""
    from conformance.check.compare import compare
    from conformance.check.switches import switches_at
    from conformance.check.tolerances import tolerance
    from conformance.core.output import forward_order

    tol = tolerance(dtype, device)
    for name in forward_order(config):
        if name not in actual or name not in expected:
            continue
        result = compare(actual[name], expected[name], tol)
        if not result.passed:
            acting = switches_at(name, config)
            return (f"first diverging tensor {name} (held to the {dtype} tolerance, atol {tol.atol:g}): "
                    f"{result.describe()}" + (f"; switches acting there: {', '.join(acting)}" if acting else ""))
    return None


def logits_within(actual, expected: np.ndarray, dtype: str, device: str = "cpu", probe: str = PROBE) -> tuple[bool, str]:
    """(within the tolerance, what to say) for logits alone (a runtime without taps) on `probe`."""
    from conformance.check.compare import compare
    from conformance.check.tolerances import tolerance

    tol = tolerance(dtype, device)
    result = compare(actual, expected, tol)
    if result.passed:
        return True, (f"logits within {tol.atol:.0e} x scale of the float64 oracle on {probe} (max abs error "
                      f"{result.max_abs:.1e})")
    where = result.first_violation_at or result.first_nan_mismatch_at or result.max_abs_at
    return False, (f"on {probe}, the logits leave the {dtype} tolerance first at (row, position, id) {where}: "
                   f"{result.describe()}")


def config_differs(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    """The fields that change what the model computes and differ, at the values they act with
    (`ModelConfig.canonical`: d_head 0 is d_model / n_heads); notes and training-only switches do
    not count."""
    from conformance.convert.engine import TRAINING_ONLY

    mine_all, other_all = ours.canonical(), theirs.canonical()
    out = []
    for name, mine in mine_all.items():
        if name in TRAINING_ONLY:
            continue
        other = other_all[name]
        if repr(mine) != repr(other):  # repr: NaN equals NaN
            out.append(f"{name}={other!r} where the checkpoint has {mine!r}")
    return out


def reference_cast(value, dtype: str | None) -> np.ndarray:
    """`value` in `dtype` (None: as it is) by NumPy's `astype` alone, round to nearest even
    (ml_dtypes' for bfloat16): what a check holds a conversion's cast to. Written apart from
    `conformance.convert.engine.cast` on purpose, so that a fault there cannot agree with itself."""
    value = np.asarray(value)
    if dtype is None:
        return value
    import ml_dtypes

    return value.astype(np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype))


def params_differ(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """The first parameter (in the checkpoint's order) missing, extra, or not equal bit for bit
    (in the checkpoint's dtype) in `theirs`; None when every one is."""
    missing = [key for key in ours if key not in theirs]
    if missing:
        return f"parameter {missing[0]} is missing ({len(missing)} in all)"
    extra = [key for key in theirs if key not in ours]
    if extra:
        return f"parameter {extra[0]} is not the checkpoint's ({len(extra)} in all)"
    for key, mine in ours.items():
        mine, other = np.asarray(mine), np.asarray(theirs[key])
        if mine.shape != other.shape:
            return f"parameter {key} has shape {other.shape}, the checkpoint's {mine.shape}"
        other = other.astype(mine.dtype) if other.dtype != mine.dtype else other
        if mine.tobytes() != other.tobytes():
            wide_mine, wide_other = mine.astype(np.float64), other.astype(np.float64)
            gap = np.abs(wide_other - wide_mine)
            gap = np.where(np.isnan(gap), np.inf, gap)
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(gap)), gap.shape)) if gap.size else ()
            count = int(np.count_nonzero(gap))
            return (f"parameter {key} differs in {count} of {mine.size} values (largest at {at}: "
                    f"{wide_other[at]:.6g} where the checkpoint has {wide_mine[at]:.6g})")
    return None


def round_trip(ours_config: ModelConfig, ours: Mapping[str, Any], theirs_config: ModelConfig | None,
               theirs: Mapping[str, Any]) -> str | None:
    """The first field or parameter that a reading back gives otherwise than the checkpoint; None if none."""
    if theirs_config is not None:
        fields = config_differs(ours_config, theirs_config)
        if fields:
            return "read back, the config says " + "; ".join(fields)
    return params_differ(ours, theirs)


def fits_in_memory(config: ModelConfig, bytes_per_value: float, copies: float) -> tuple[bool, str]:
    """Whether `copies` more copies of the model, at `bytes_per_value`, fit in the memory available
    now (MemAvailable), beside what is already held: a check's own budget. Returns (fits, the
    numbers, said)."""
    from conformance.check.plan import available_memory
    from conformance.core.memory import size_words
    from conformance.core.params import param_shapes

    values = sum(int(np.prod(shape)) for shape in param_shapes(config).values())
    needed = int(values * bytes_per_value * copies)
    free = available_memory()
    if free is None:
        return True, "memory available unknown"
    return needed <= free, f"about {size_words(needed)} needed, {size_words(free)} available"


def itemsize(params: Mapping[str, Any]) -> int:
    return np.asarray(next(iter(params.values()))).dtype.itemsize


def too_large(config: ModelConfig, params: Mapping[str, Any], what: str) -> Verdict | None:
    """A `not_run` verdict when a runtime's own copy of the model (`what` loads it) would not fit
    beside what is held: the check is not made rather than made to swap or be killed."""
    fits, words = fits_in_memory(config, max(4, itemsize(params)), copies=2.0)
    return None if fits else not_run(f"{what} was not loaded: its copy of the model would not fit in memory beside "
                                     f"this one ({words})")


def runtime_version(module: str) -> str:
    try:
        from importlib.metadata import version

        return f"{module} {version(module)}"
    except Exception:  # noqa: BLE001 - a version is a nicety of the message
        return module
