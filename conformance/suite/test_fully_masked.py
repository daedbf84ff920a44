"""Property: a query with no key to attend to follows the config, not the kernel.

empty_rows "softmax" with a `-inf` fill: the row is NaN (0 / 0), in exactly the oracle's
positions, and the NaN spreads downstream exactly as in the oracle. With a finite fill: the row
is a uniform average over all keys. empty_rows "zeros": the row's weights are all 0.

A features source has no padding: its last row is emptied by an explicit source mask instead
(every one of its S positions masked), which the model reads exactly as a padded row's.
"""

import math

import numpy as np
from hypothesis import assume, given

from conformance.suite import runner
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples
from conformance.check.tolerances import in_domain, tolerance


def with_empty_rows(case):
    """Force a whole source row of padding, so the encoder and cross-attention have empty rows
    (a features source, which has no padding: unchanged, its last row masked by `empty_last_row`)."""
    if case.config.source == "features":
        return case
    src = case.src_ids.copy()
    src[-1, :] = case.config.pad_id
    return type(case)(case.config, case.seed, case.scale, src, case.tgt_ids)


def empty_last_row(case):
    """None for ids (their padding masks the row), or a features source's explicit mask
    (B, 1, 1, S): every position of the last row masked."""
    if case.config.source != "features":
        return None
    mask = np.ones((len(case.src_ids), 1, 1, case.src_ids.shape[2] // 2), dtype=bool)
    mask[-1] = False
    return mask


@shared_examples
@with_examples(covering_cases())
@given(case=cases().map(with_empty_rows))
def test_fully_masked_rows_follow_the_fill(target, case):
    assume(in_domain(target.dtype, case.scale))
    src_mask = empty_last_row(case)
    expected = runner.oracle(case) if src_mask is None else runner.run(runner.ORACLE, case, src_mask=src_mask)
    got = runner.run(target, case, src_mask=src_mask)
    tol = tolerance(target.dtype, target.device)
    for name, weights in got.items():
        nan_got, nan_expected = np.isnan(weights), np.isnan(expected[name])
        if not np.array_equal(nan_got, nan_expected):
            where = tuple(np.argwhere(nan_got != nan_expected)[0])
            raise AssertionError(
                f"{target.label}: {name!r} has NaN where the oracle does not (or vice versa), first at {where}; "
                f"mask_fill={case.config.mask_fill}, empty_rows={case.config.empty_rows!r}; "
                f"config {case.config.summary()}"
            )
    # Encoder self-attention rows of the empty source row: nothing to attend to.
    empty = got["encoder.0.self"][-1]  # (H, S, S)
    if case.config.empty_rows == "zeros":
        assert (empty == 0).all(), f"{target.label}: empty_rows 'zeros' must give zero weights, got {empty[0, 0]}"
    elif math.isinf(case.config.mask_fill):
        assert np.isnan(empty).all(), f"{target.label}: -inf fill must give NaN rows, got {empty[0, 0]}"
    else:
        uniform = 1.0 / empty.shape[-1]
        error = np.abs(empty - uniform).max()
        assert error <= tol.atol + tol.rtol * uniform, (
            f"{target.label}: a finite fill ({case.config.mask_fill}) must give uniform weights 1/{empty.shape[-1]}, "
            f"max deviation {error:.3e}"
        )
