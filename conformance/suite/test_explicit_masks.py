"""Property: passing the masks a model would derive from the ids changes nothing.

A caller who builds masks explicitly (the oracle's `make_masks`, i.e. True = may attend, at the
documented shapes) gets bit-for-bit the result of letting the model derive them: the explicit-mask
path reads masks exactly as the derived path builds them.
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
def test_explicit_masks_give_the_same_result_as_derived_masks(target, case):
    src_mask, tgt_mask = runner.masks(Target("numpy", "cpu", "float64"), case)
    derived = runner.run(target, case)
    explicit = runner.run(target, case, src_mask=src_mask, tgt_mask=tgt_mask)
    for name in derived:
        a, b = derived[name], explicit[name]
        assert np.array_equal(a, b, equal_nan=True), f"{target.label}: passing make_masks' masks changed {name!r}"
