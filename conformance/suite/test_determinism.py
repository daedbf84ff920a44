"""Property: the same call gives identical bits, on the same model and on a freshly built one,
at every dtype (half precision takes other kernels, and JAX float64 another compile)."""

import pytest
from hypothesis import given

from conformance.suite import runner
from conformance.suite.assertions import assert_bitwise_equal
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples


@pytest.mark.ci_compiling_dtypes("float32", "float64", "float16")
@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_repeated_calls_are_bitwise_identical(target, case):
    first, second = runner.run(target, case, repeat=2)
    assert_bitwise_equal(first, second, target, "second call on the same model")
    rebuilt = runner.run(target, case)
    assert_bitwise_equal(first, rebuilt, target, "a freshly built model")
