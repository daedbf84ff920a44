"""Meta-tests for the realistic sample: the bugs that trained-scale numbers and long sequences
show (tests/breaks.py `REALISTIC_BREAKS`) fail the `ci` profile's realistic property, and those
marked `tame_misses` pass the old tame strategies: the realistic sample is what catches them.
"""

from __future__ import annotations

import importlib

import pytest

from breaks import REALISTIC_BREAKS, broken_copy, first_failure_only, realistic_property_module
from conformance.check import backends
from conformance.check.backends import Target

import conformance.suite.test_forward as forward


def realistic_property(dtype: str):
    """The realistic property that runs a dtype: half precision has its own (long sequences)."""
    module = importlib.import_module(f"conformance.suite.{realistic_property_module(dtype)}")
    return next(f for name, f in vars(module).items() if name.startswith("test_") and callable(f))


@pytest.mark.parametrize("name", sorted(REALISTIC_BREAKS))
def test_the_realistic_sample_catches(name):
    backend, dtype, edits, patches, tame_misses = REALISTIC_BREAKS[name]
    registered = broken_copy(name, backend, edits, patches)
    target = Target(registered, "cpu", dtype)
    try:
        if tame_misses:
            forward.test_every_tensor_matches_the_oracle(target=target)  # the tame strategies alone pass
        else:
            with pytest.raises(AssertionError), first_failure_only(forward.test_every_tensor_matches_the_oracle):
                forward.test_every_tensor_matches_the_oracle(target=target)  # said so: keep the table honest
        with pytest.raises(AssertionError) as caught, first_failure_only(realistic_property(dtype)):
            realistic_property(dtype)(target=target)
    finally:
        backends.unregister_backend(registered)
    print(f"{name}: caught by the realistic sample: {str(caught.value).splitlines()[0][:300]}")


@pytest.mark.parametrize("backend, dtype", sorted({(b, d) for b, d, *_ in REALISTIC_BREAKS.values()}))
def test_pristine_copies_pass_the_realistic_sample(backend, dtype):
    registered = broken_copy(f"pristine realistic {backend} {dtype}", backend, [], {})
    try:
        realistic_property(dtype)(target=Target(registered, "cpu", dtype))
    finally:
        backends.unregister_backend(registered)
