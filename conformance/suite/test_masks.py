"""Property: every backend's mask helpers build exactly the oracle's boolean masks.

(That a model given those masks explicitly computes what it computes from the ids alone is its
own property, in test_explicit_masks.py.)
"""

import numpy as np
import pytest
from hypothesis import given

from conformance.suite import runner
from conformance.check.backends import Target
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples


@pytest.mark.dtypes("float32")
@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_masks_equal_the_oracle_exactly(target, case):
    expected_src, expected_tgt = runner.masks(Target("numpy", "cpu", "float64"), case)
    src_mask, tgt_mask = runner.masks(target, case)
    for name, got, expected in (("src_mask", src_mask, expected_src), ("tgt_mask", tgt_mask, expected_tgt)):
        assert got.dtype == np.bool_, f"{target.backend}.make_masks: {name} has dtype {got.dtype}, not bool"
        assert got.shape == expected.shape, f"{target.backend}.make_masks: {name} shape {got.shape} != {expected.shape}"
        diff = np.argwhere(got != expected)
        assert diff.size == 0, (
            f"{target.backend}.make_masks: {name} differs from the oracle at {len(diff)} position(s), first "
            f"{tuple(diff[0])}; config {case.config.summary()}"
        )

