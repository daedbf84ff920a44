"""Property: each pair of backends (and devices) agree with each other directly.

Agreement with the oracle bounds the pair's difference by twice the tolerance; this property
holds them to one tolerance, which is what the measured pairwise errors support.
"""

from hypothesis import assume, given

from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples
from conformance.check.tolerances import in_domain


@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_backends_agree_pairwise(target_pair, case):
    a, b = target_pair
    assume(in_domain(a.dtype, case.scale))
    got_a = runner.run(a, case)
    got_b = runner.run(b, case)
    assert_tensors_close(got_a, got_b, a, case.config, what=f" vs {b.label}")
