"""Meta-tests: the conformance properties catch deliberately broken copies of a backend.

Each break is a small edit to a private copy of a backend's `model.py` — the kind of mistake a
port makes — registered as an extra backend. The properties then run against it exactly as they
run against a real backend, and at least one must fail. The oracle stays the pristine NumPy
model. A break whose text no longer occurs in the model file fails loudly, so these tests follow
the code as it changes.
"""

from __future__ import annotations

import pytest

from breaks import BREAKS, broken_copy
from conformance import backends
from conformance.backends import Target

import conformance.test_forward as forward
import conformance.test_fully_masked as fully_masked
import conformance.test_masks as masks

PROPERTIES = {
    "every tensor matches the oracle": forward.test_every_tensor_matches_the_oracle,
    "masks equal the oracle": masks.test_masks_equal_the_oracle_exactly,
    "fully masked rows follow the fill": fully_masked.test_fully_masked_rows_follow_the_fill,
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_the_suite_catches(name):
    backend, edits, patches = BREAKS[name]
    registered = broken_copy(name, backend, edits, patches)
    # float64, so that a small break (an epsilon) is far above the tolerance.
    target = Target(registered, "cpu", "float64")
    caught = {}
    try:
        for label, prop in PROPERTIES.items():
            try:
                prop(target=target)
            except AssertionError as exc:
                caught[label] = str(exc).splitlines()[0][:300]
    finally:
        backends.unregister_backend(registered)
    assert caught, f"no property caught the break {name!r}"
    print(f"{name}: caught by {sorted(caught)}")


def test_the_pristine_copy_passes():
    """The copying itself must not break anything, or the test above proves nothing."""
    registered = broken_copy("pristine", "numpy", [], {})
    try:
        for prop in PROPERTIES.values():
            prop(target=Target(registered, "cpu", "float64"))
    finally:
        backends.unregister_backend(registered)
