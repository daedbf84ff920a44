"""Property: logits, every attention block and every intermediate agree with the float64 oracle.

Checked tensor by tensor in forward order, so a failure names the first tensor that diverged.
"""

from hypothesis import assume, given

from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.differences import judged
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples
from conformance.check.tolerances import in_domain


@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_every_tensor_matches_the_oracle(target, case):
    drawn, case = case, runner.for_target(target, case)  # an adapter's: held to the switches it declares
    assume(in_domain(target.dtype, case.scale))
    expected = runner.oracle(case)
    got = runner.run(target, case)
    with judged(target, "test_every_tensor_matches_the_oracle", drawn, case):  # an adapter's known differences
        assert_tensors_close(got, expected, target, case.config, names=runner.compared_names(target, case.config, got))
