"""Property: without attention weights (the fast path: SDPA in torch), results still follow the
config and `attention` is None (the runner checks it), including the NaN of a fully masked row under a -inf fill and its uniform average under
a finite fill. At every dtype: in float16 and bfloat16 torch's fused kernel is a different
kernel again."""

import pytest
from hypothesis import assume, given

from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.core.output import forward_order
from conformance.suite.covering import covering_cases
from conformance.suite.strategies import cases, shared_examples, with_examples
from conformance.check.tolerances import in_domain


@pytest.mark.ci_compiling_dtypes("float32", "float64", "float16")
@shared_examples
@with_examples(covering_cases())
@given(case=cases())
def test_fast_path_matches_the_oracle(target, case):
    assume(in_domain(target.dtype, case.scale))
    expected = runner.oracle(case)
    got = runner.run(target, case, return_attention=False)
    assert not any(name.endswith((".self", ".cross")) for name in got), "attention returned when not requested"
    names = [n for n in forward_order(case.config) if not n.endswith((".self", ".cross"))]
    assert_tensors_close(got, expected, target, case.config, what=" (fast path)", names=names)
