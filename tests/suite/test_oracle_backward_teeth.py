"""Meta-tests: a wrong derivative in the NumPy oracle's backward pass fails the gradient property.

For each activation and each LayerNorm form (`breaks.ORACLE_BACKWARD_BREAKS`, read from the config's
value tuples), the wrong derivative is planted in impl_numpy.backward itself, as a user would
meet it: the oracle and the numpy targets share it, and `rosetta conformance --backends
numpy,torch` must fail on the torch targets. Under `ci` the gradient property runs only a few
examples; the covering rows (conformance/suite/covering.py) are what puts every activation and
every form among them. The property stops at its first failure (`first_failure_only`).
"""

import pytest

from breaks import ORACLE_BACKWARD_BREAKS, first_failure_only, planted_in_the_oracle
from conformance.check.backends import Target
from conformance.suite.test_gradients import test_gradients_match_the_oracle as gradients

TORCH = Target("torch", "cpu", "float64")


@pytest.mark.parametrize("name", sorted(ORACLE_BACKWARD_BREAKS))
def test_a_wrong_derivative_in_the_oracle_fails_the_gradient_property(name):
    pytest.importorskip("torch")
    with planted_in_the_oracle(name), first_failure_only(gradients), pytest.raises(AssertionError) as caught:
        gradients(target=TORCH)
    print(f"{name}: {str(caught.value).splitlines()[0][:200]}")


def test_the_breaks_follow_the_config():
    from conformance.core.config import ACTIVATIONS, LAYER_NORM_FORMS

    assert len(ORACLE_BACKWARD_BREAKS) == len(ACTIVATIONS) + len(LAYER_NORM_FORMS)
