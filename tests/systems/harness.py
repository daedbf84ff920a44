"""What the converter tests share: batches with padding, running a backend, comparing with a source.

The bar (issue 5): a converted model reproduces its source system's float32 logits within an
absolute 1e-5, and NaN exactly where the source has NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import backends
from conformance.compare import Comparison, compare, to_numpy
from conformance.tolerances import Tolerance

SOURCE_TOLERANCE = Tolerance(atol=1e-5, rtol=0.0)
BACKENDS = ["numpy", "torch", "jax"]


def backend_param(name: str):
    """A pytest param for a backend that skips, naming the reason, when it cannot be imported."""
    reason = backends.availability([name])[name]
    marks = [pytest.mark.skip(reason=f"impl_{name} {reason}")] if reason else []
    return pytest.param(name, marks=marks, id=name)


BACKEND_PARAMS = [backend_param(name) for name in BACKENDS]


def ids(pad: int, vocab: int, lengths: list[int], length: int, seed: int, first: list[int] | None = None) -> np.ndarray:
    """(B, L) ids: row r has `lengths[r]` real tokens (never `pad`), then padding."""
    rng = np.random.default_rng(seed)
    real = np.array([i for i in range(vocab) if i != pad])
    out = np.full((len(lengths), length), pad, dtype=np.int64)
    for row, n in enumerate(lengths):
        out[row, :n] = rng.choice(real, n)
    return out


def padded_batch(pad: int, src_vocab: int, tgt_vocab: int, seed: int = 0, fully_masked: bool = False):
    """(src, tgt) ids where every padding rule matters: full rows, short rows, a one-token target.

    With `fully_masked`, three more rows produce fully masked attention rows: an all-padding
    source and a target that starts with padding. Batch elements never interact, so one call
    checks both kinds (and a backend that compiles per shape compiles once).
    """
    src_lengths, tgt_lengths = [9, 5, 2], [7, 4, 1]
    if fully_masked:
        src_lengths, tgt_lengths = src_lengths + [6, 0, 3], tgt_lengths + [5, 3, 2]
    src, tgt = ids(pad, src_vocab, src_lengths, 9, seed), ids(pad, tgt_vocab, tgt_lengths, 7, seed + 1)
    if fully_masked:
        tgt[3, 0] = pad
    return src, tgt


def run_backend(backend: str, config, params, src, tgt, dtype: str = "float32", **call) -> np.ndarray:
    """Logits of the converted model on one backend, as a NumPy array of `dtype`."""
    target = backends.Target(backend, "cpu", dtype)
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        logits = model(src, tgt, **call).logits
    return to_numpy(logits).astype(dtype)


def assert_matches_source(ours: np.ndarray, source: np.ndarray, what: str) -> Comparison:
    """|ours - source| <= 1e-5 everywhere, NaN exactly where the source has NaN."""
    __tracebackhide__ = True
    result = compare(ours, source, SOURCE_TOLERANCE)
    assert result.passed, f"{what}: {result.describe()} [bar: atol {SOURCE_TOLERANCE.atol:g}]"
    return result
