"""Property: `decode(tgt, encode(src))` equals the full forward pass."""

import pytest
from hypothesis import assume, given

from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples
from conformance.check.tolerances import in_domain


@pytest.mark.ci_compiling_dtypes("float32", "float64", "float16")
@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_encode_then_decode_equals_the_forward(target, case):
    assume(in_domain(target.dtype, case.scale))
    full = runner.run(target, case)
    split = runner.run(target, case, split=True)
    # Same tolerance as against the oracle: a compiled backend may fuse the two halves
    # differently from the whole, but may not drift further than it may from the oracle.
    assert_tensors_close(split, full, target, case.config, what=" (encode+decode vs forward)")
