"""Property: at the numbers trained models produce, every tensor still agrees with the oracle.

The same comparison as `test_forward.py`, on `realistic_cases` (trained-like weights: embedding
offsets with row |mean| / std of 300-1000, outlier dimensions 50-1000x the typical size, LayerNorm
gains far from 1, attention logits of 50-150) and `long_cases` (max_len 512 or 2048). These are the
inputs where a cancelling LayerNorm variance or an unshifted softmax give themselves away
(tests/suite/test_realistic_teeth.py). Every profile runs the anchor cases first
(`strategies.trained_anchor_cases`, `long_anchor_case`: one per phenomenon, at its extreme), then
draws; the `ci` profile draws a bounded sample (`CI_EXAMPLES`); the `scale` profile draws
full-size models instead (`strategies.scale_cases`). The tolerance is the table's up to the sizes
it was measured at, and grows beyond them by the measured law (`tolerances.scaled_tolerance`);
docs/tolerances.md says where each number comes from.

Half precision makes no claim at trained-scale numbers (`strategies.realistic_in_domain`): it is
checked on long sequences with seeded weights, `test_half_precision_long.py`.
"""

import pytest
from hypothesis import given

from conformance.check import backends
from conformance.suite.covering import covering_realistic_cases
from conformance.suite.realistic import REALISTIC_DTYPES, bounded_sample, check_against_the_oracle
from conformance.suite.strategies import any_realistic_cases, long_anchor_case, shared_examples, trained_anchor_cases, with_examples

# Drawn examples under `ci`, after the anchors: a bounded sample for CI.
CI_EXAMPLES = 6
DTYPES = REALISTIC_DTYPES


@pytest.mark.dtypes(*DTYPES)
@bounded_sample(CI_EXAMPLES)
@shared_examples
@with_examples([*trained_anchor_cases(), long_anchor_case(), *covering_realistic_cases()])
@given(case=any_realistic_cases())
def test_every_tensor_matches_the_oracle_at_trained_scale(target, case):
    if backends.compiles(target.backend) and target.dtype != "float32":
        pytest.skip(f"{target.label}: realistic cases run on compiling backends at float32 only (compile cost)")
    check_against_the_oracle(target, case)
