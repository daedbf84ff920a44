"""Property: at the numbers trained models produce, every tensor still agrees with the oracle.

The same comparison as `test_forward.py`, on `realistic_cases` (trained-like weights: embedding
offsets with row |mean| / std of 300-1000, outlier dimensions 50-1000x the typical size, LayerNorm
gains far from 1, attention logits of 50-150) and `long_cases` (max_len 512 or 2048). These are the
inputs where a cancelling LayerNorm variance, an unshifted softmax, a low-precision position table
or a half-precision sum give themselves away (tests/test_suite_realistic_teeth.py). The `ci`
profile takes a bounded sample (`CI_EXAMPLES`); the `scale` profile draws full-size models instead
(`strategies.scale_cases`). The tolerance is the table's up to the sizes it was measured at, and
grows beyond them by the measured law (`tolerances.scaled_tolerance`); docs/tolerances.md says
where each number comes from.
"""

import pytest
from hypothesis import assume, given, settings

from conformance.check import backends
from conformance.check.tolerances import case_tolerance, in_domain
from conformance.suite import runner
from conformance.suite.profiles import full_size
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.strategies import any_realistic_cases, realistic_in_domain, shared_examples

CI_EXAMPLES = 6  # a bounded sample for CI (its seconds are not quoted in the docs yet)
# A compiling backend compiles every new (config, shape): it runs the realistic small cases at
# float32 only, and no long case (a 2048-token compile per example) except under `scale`. Its
# float64 and half paths share the float32 code; numpy and torch cover them at full length.
COMPILING = {"jax"}
# bfloat16 has float16's code path with a shorter mantissa: float16 is where long sums and long
# positions show, at a third of the CI time.
DTYPES = ("float64", "float32", "float16")


def bounded_sample(test):
    """Under the `ci` profile, at most `CI_EXAMPLES` examples; other profiles keep their own count."""
    if settings._current_profile == "ci":
        return settings(max_examples=min(CI_EXAMPLES, settings().max_examples))(test)
    return test


@pytest.mark.dtypes(*DTYPES)
@bounded_sample
@shared_examples
@given(case=any_realistic_cases())
def test_every_tensor_matches_the_oracle_at_trained_scale(target, case):
    if backends.kind(target.backend) in COMPILING and target.dtype != "float32":
        pytest.skip(f"{target.label}: realistic cases run on compiling backends at float32 only (compile cost)")
    # Under the `scale` profile every case is long, and its few full-size examples are worth a compile each.
    assume(not (backends.kind(target.backend) in COMPILING and case.config.max_len > 16 and not full_size()))
    assume(in_domain(target.dtype, case.scale) and realistic_in_domain(target.dtype, case))
    expected = runner.oracle(case)
    got = runner.run(target, case)
    tol = case_tolerance(target.dtype, case.config, case.src_ids.shape[1], case.tgt_ids.shape[1], target.device)
    assert_tensors_close(got, expected, target, case.config, tol=tol)
