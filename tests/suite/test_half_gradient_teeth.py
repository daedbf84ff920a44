"""The gradient property's half-precision legs have teeth (issue 46; docs/tolerances.md,
"Gradients in half precision").

A copy of impl_torch whose gradients, in float16 and bfloat16 only, are averaged over two ranks
that should have been summed (every gradient half its value: the planted reduction bug of
benchmarks/sharded_precision.py, in one process) passes the property's float64 leg and fails its
bfloat16 leg on the table's measured bfloat16 gradient row alone. The pristine copy passes both
legs, so the break, not the copying, is what fails.

The property runs half precision outside the `ci` profile only (CI time): these tests lift that
skip for their own calls (`half_legs_on`), keeping the property's `ci` settings (5 derandomized
examples after the covering rows), so they take seconds.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from hypothesis import settings

from breaks import broken_copy, first_failure_only
from conformance.check import backends
from conformance.check.backends import Target
from conformance.suite.test_gradients import test_gradients_match_the_oracle as gradients

# impl_torch's `_loss_and_grads` returns each gradient cast to its parameter's dtype; the break
# halves it first when it was computed in half precision.
HALVED_IN_HALF = [(
    "        return loss.detach(), [cast(grad, param.dtype) for grad, param in zip(grads, params)]\n",
    "        halved = [grad / 2 if grad.dtype in (torch.float16, torch.bfloat16) else grad for grad in grads]\n"
    "        return loss.detach(), [cast(grad, param.dtype) for grad, param in zip(halved, params)]\n",
)]


@contextmanager
def half_legs_on():
    """The `thorough` profile current for the duration, so that the property does not skip its
    half-precision legs (it reads the profile at call time); its own settings stay those it was
    decorated with. The previous profile is loaded again afterwards."""
    previous = settings._current_profile
    settings.load_profile("thorough")
    try:
        yield
    finally:
        settings.load_profile(previous)


@contextmanager
def torch_copy(name: str, edits):
    registered = broken_copy(name, "torch", edits, {})
    try:
        yield registered
    finally:
        backends.unregister_backend(registered)


def test_gradients_halved_in_half_precision_fail_the_bfloat16_leg():
    with torch_copy("gradients halved in half precision", HALVED_IN_HALF) as registered, half_legs_on():
        gradients(target=Target(registered, "cpu", "float64"))  # the break is invisible above half precision
        with pytest.raises(AssertionError) as caught, first_failure_only(gradients):
            gradients(target=Target(registered, "cpu", "bfloat16"))
    first = str(caught.value).splitlines()[0]
    assert "bfloat16" in first and "gradient" in first, first[:300]
    print(f"caught in bfloat16: {first[:300]}")


def test_the_pristine_copy_passes_the_bfloat16_leg():
    with torch_copy("pristine half gradients", []) as registered, half_legs_on():
        gradients(target=Target(registered, "cpu", "bfloat16"))
