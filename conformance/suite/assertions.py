"""Assertion helpers for the properties: compare every tensor in forward order, fail on the first.

Hidden from tracebacks (`__tracebackhide__`), so a failure points at the property and the
message says which backend, device, dtype, config and tensor diverged, and by how much.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from conformance.check.backends import Target
from conformance.check.compare import ORACLE, assert_close
from conformance.core.config import ModelConfig
from conformance.core.output import forward_order
from conformance.check.tolerances import Tolerance, tolerance


def compared(what: str) -> tuple[str, str]:
    """A property's `what` -> (what qualifies the backend, what it is compared against).

        ""                              -> ("", "the float64 oracle")
        " (fast path)"                  -> (" (fast path)", "the float64 oracle")
        " vs torch/cpu/float32"         -> ("", "torch/cpu/float32")
        " (encode+decode vs forward)"   -> (" (encode+decode)", "forward")
    """
    text = what.strip()
    bracketed = text.startswith("(") and text.endswith(")")
    inner = text[1:-1] if bracketed else text
    mine, sep, theirs = f" {inner}".partition(" vs ")
    if not sep:
        return what, ORACLE
    mine = mine.strip()
    return (f" ({mine})" if bracketed else f" {mine}") if mine else "", theirs.strip()


def assert_tensors_close(
    got: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    target: Target,
    config: ModelConfig,
    *,
    what: str = "",
    tol: Tolerance | None = None,
    names: list[str] | None = None,
) -> None:
    """Every tensor of `expected` (in forward order) is in `got` and within tolerance.

    `what` says what is compared when it is not the float64 oracle: " vs torch/cpu/float32", or
    " (encode+decode vs forward)" (see `compared`).
    """
    __tracebackhide__ = True
    qualifier, against = compared(what)
    tol = tol or tolerance(target.dtype, target.device)
    order = names or [n for n in forward_order(config) if n in expected]
    missing = [n for n in order if n not in got]
    if missing:
        raise AssertionError(f"{target.label}{what} did not return {missing[:5]}")
    for name in order:
        try:
            assert_close(got[name], expected[name], tol, tensor=name, backend=target.backend + qualifier,
                         device=target.device, dtype=target.dtype, config=config, against=against)
        except AssertionError as error:
            error.tensor = name  # the first tensor that differs (conformance.suite.differences)
            raise


def assert_bitwise_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], target: Target, what: str) -> None:
    __tracebackhide__ = True
    assert list(a) == list(b), f"{target.label}: {what}: different tensor names"
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if x.shape != y.shape or x.tobytes() != y.tobytes():
            diff = np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64))) if x.shape == y.shape else "shape"
            raise AssertionError(f"{target.label}: {what}: {name!r} differs bitwise (max diff {diff})")


def processor_stretch(options: dict, max_len: int) -> float:
    """How far the processors can stretch a score's error (docs/decoding.md): a repetition penalty
    p multiplies a score by p or 1 / p, so its error by up to max(p, 1 / p), and the source's
    likewise; the end token's exponential decay adds |s| x (factor^k - 1), so up to factor^k with
    k the most steps after its start; a renormalization adds its normaliser's error (x 2)."""
    stretch = 1.0
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        penalty = options.get(name, 1.0)
        stretch *= max(penalty, 1.0 / penalty)
    if options.get("exponential_decay_length_penalty"):
        start, factor = options["exponential_decay_length_penalty"]
        stretch *= max(1.0, factor ** max(max_len - 1 - start, 0))
    return stretch * (2.0 if options.get("renormalize_logits") else 1.0)
class IdsDiffer(AssertionError):
    """Generated ids that part from the oracle's beyond the allowance: the difference is at `ids`."""

    tensor = "ids"


def assert_ids_match(got: np.ndarray, expected: np.ndarray, trace: list[dict], target: Target, gcase) -> None:
    """Generated ids equal the oracle's (float64), or first differ at a step of a row where the
    oracle's search had a close call within the allowance (see conformance/suite/test_generate.py).
    The message names the step, the row and the oracle's closest score gap."""
    __tracebackhide__ = True
    config = gcase.case.config
    if got.shape == expected.shape and (got == expected).all():
        return
    width = min(got.shape[1], expected.shape[1])
    differs = (got[:, :width] != expected[:, :width])
    if differs.any():
        rows, steps = np.nonzero(differs)
        first = int(np.argmin(steps))
        row, step = int(rows[first]), int(steps[first])
    else:  # one stopped where the other went on
        row, step = 0, width
    options = dict(gcase.options)
    beams = options["num_beams"]
    tol = tolerance(target.dtype, target.device)
    stretch = processor_stretch(options, gcase.max_len)
    # The closest call of that row at or before the step, and its allowance.
    closest, allowed_at = np.inf, 0.0
    for s, record in enumerate(trace[:step + 1]):
        if options.get("do_sample"):  # the cumulative distribution moves by up to twice a logit's error / T
            per_step = 2.0 / options.get("temperature", 1.0)
        elif beams == 1 and options.get("beam_rule", "hf") == "hf":
            per_step = 2.0
        else:
            per_step = 4.0 * (s + 1)
        allowance = stretch * per_step * tol.atol * float(record["scale"][row])
        gap = float(record["gap"][row])
        if gap - allowance < closest - allowed_at:
            closest, allowed_at = gap, allowance
    within = target.dtype != "float64" and closest <= allowed_at
    how = ", ".join(f"{k}={options[k]!r}" for k in ("num_beams", "beam_rule", "do_sample") if k in options)
    if not within:
        raise IdsDiffer(
            f"{target.label}: generate chose other ids than the float64 oracle at step {step}, row {row} "
            f"({how}): got {got[row].tolist()}, oracle {expected[row].tolist()}; the oracle's "
            f"closest score gap up to that step is {closest:.3g}"
            + ("" if target.dtype == "float64" else f", more than the {target.dtype} allowance {allowed_at:.3g}")
            + f"; options {dict(gcase.options)}; config: {config.summary()}")


def assert_no_speech_match(got: np.ndarray | None, expected: np.ndarray | None, target: Target, gcase) -> None:
    """Each source row's no-speech probability (Whisper's, `return_no_speech_prob`) within the
    dtype's tolerance of the oracle's: a softmax of the start position's logits, read before any
    choice, so it is compared as a tensor, at a logit's error (a probability p moves by about
    p x twice a logit's error, which atol and rtol bound). Nothing where the case asks for none."""
    __tracebackhide__ = True
    if expected is None:
        return
    assert got is not None, f"{target.label}: generate returned no no-speech probabilities (return_no_speech_prob=True)"
    try:
        assert_close(got, expected, tolerance(target.dtype, target.device), tensor="no_speech_prob",
                     backend=target.backend, device=target.device, dtype=target.dtype, config=gcase.case.config)
    except AssertionError as error:
        error.tensor = "no_speech_prob"
        raise
