"""Property: on long sequences, half precision still agrees with the oracle.

Sequences of 512-2048 tokens with seeded weights at scale 1 (`strategies.long_seeded_cases`; the
domain where the table makes a half-precision claim, `strategies.realistic_in_domain`): positions
far out in the table and sums over thousands of keys, where a float16 position table or a softmax
sum accumulated in float16 gives itself away (tests/suite/test_realistic_teeth.py). Every profile
runs the 2048-token anchor first (`strategies.long_anchor_case`). The tolerance is a measured row
of its own (`tolerances.LONG_HALF_TOLERANCES`, docs/tolerances.md): the table's half-precision row
is 20x what a correct backend shows here. Under `scale`, full-size seeded models at the size law,
on an accelerator.
"""

import pytest
from hypothesis import given

from conformance.check import backends
from conformance.check.tolerances import long_half_tolerance
from conformance.suite.profiles import full_size
from conformance.suite.covering import covering_long_cases
from conformance.suite.realistic import bounded_sample, check_against_the_oracle
from conformance.suite.strategies import long_anchor_case, long_seeded_cases, shared_examples, with_examples

# Drawn examples under `ci`, after the anchor.
CI_EXAMPLES = 1
# bfloat16 has float16's code path with a shorter mantissa: float16 is where long sums and long
# positions show, at a third of the CI time.
DTYPES = ("float16",)


@pytest.mark.dtypes(*DTYPES)
@bounded_sample(CI_EXAMPLES)
@shared_examples
@with_examples([long_anchor_case(), *covering_long_cases()])
@given(case=long_seeded_cases())
def test_long_sequences_match_the_oracle_in_half_precision(target, case):
    if backends.compiles(target.backend) and not full_size():
        pytest.skip(f"{target.label}: long sequences run on compiling backends under `scale` only (a compile per length)")
    if full_size() and target.device == "cpu":
        pytest.skip(f"{target.label}: half precision at full size runs on an accelerator; on CPU a d_model 1024 "
                    "model over 1024 tokens took over 7 minutes per example (docs/tolerances.md)")
    # Small long models have a measured row of their own; full-size ones the size law.
    check_against_the_oracle(target, case, None if full_size() else long_half_tolerance(target.dtype, target.device,
                                                                                      case.config.source))
