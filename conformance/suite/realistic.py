"""What the realistic properties share (`test_forward_realistic.py`, `test_half_precision_long.py`):
the bounded `ci` sample and the oracle comparison at a case's tolerance."""

from hypothesis import assume, settings

from conformance.check import backends
from conformance.check.tolerances import case_tolerance, in_domain
from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.profiles import full_size
from conformance.suite.strategies import realistic_in_domain

# The dtypes the realistic property runs in. A compiling backend (`backends.compiles`) compiles
# every new (config, shape): it runs the realistic small cases at float32 only, and no long case (a
# 2048-token compile per example) except under `scale`. Its float64 path shares the float32 code;
# numpy and torch cover it at full length. (`estimate` counts the runs of a drawn example by it.)
REALISTIC_DTYPES = ("float64", "float32")


def bounded_sample(examples: int):
    """Under the `ci` profile, at most `examples` drawn examples; other profiles keep their own count."""
    def decorate(test):
        if settings._current_profile == "ci":
            return settings(max_examples=min(examples, settings().max_examples))(test)
        return test

    return decorate


def check_against_the_oracle(target, case, tol=None):
    """The forward comparison, at `tol` or else the tolerance for the case's size."""
    # Under the `scale` profile every case is long, and its few full-size examples are worth a compile each.
    assume(not (backends.compiles(target.backend) and case.config.max_len > 16 and not full_size()))
    assume(in_domain(target.dtype, case.scale) and realistic_in_domain(target.dtype, case))
    expected = runner.oracle(case)
    got = runner.run(target, case)
    if tol is None:
        tol = case_tolerance(target.dtype, case.config, case.src_ids.shape[1], case.tgt_ids.shape[1], target.device)
    assert_tensors_close(got, expected, target, case.config, tol=tol)
