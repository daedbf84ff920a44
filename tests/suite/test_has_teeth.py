"""Meta-tests: the conformance properties catch deliberately broken copies of a backend.

Each break is a small edit to a private copy of a backend's `model.py` — the kind of mistake a
port makes — registered as an extra backend. The properties then run against it exactly as they
run against a real backend, and at least one must fail. The oracle stays the pristine NumPy
model. A break whose text no longer occurs in the model file fails loudly, so these tests follow
the code as it changes.

The classic port bugs (`BREAKS`) are caught by comparing tensors with the oracle. Every other
property earns its place with a break of its own (`PROPERTY_BREAKS`) that it catches and the
oracle comparison does not.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from breaks import BREAKS, FLOAT32_PROPERTY_BREAKS, PADDING_BREAKS, PROPERTY_BREAKS, broken_copy, first_failure_only
from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.errors import InputError

import conformance.suite.test_forward as forward
import conformance.suite.test_fully_masked as fully_masked
import conformance.suite.test_masks as masks

PROPERTIES = {
    "every tensor matches the oracle": forward.test_every_tensor_matches_the_oracle,
    "masks equal the oracle": masks.test_masks_equal_the_oracle_exactly,
    "fully masked rows follow the fill": fully_masked.test_fully_masked_rows_follow_the_fill,
}


@pytest.mark.parametrize("name", sorted({**BREAKS, **PADDING_BREAKS}))
def test_the_suite_catches(name):
    backend, edits, patches = {**BREAKS, **PADDING_BREAKS}[name]
    registered = broken_copy(name, backend, edits, patches)
    # float64, so that a small break (an epsilon) is far above the tolerance.
    target = Target(registered, "cpu", "float64")
    caught = {}
    try:
        for label, prop in PROPERTIES.items():
            try:
                with first_failure_only(prop):
                    prop(target=target)
            # A failed comparison; a broken copy's own error (a mask narrower than its scores fails
            # to broadcast, as OpenNMT-py's does); a copy that refuses the oracle's valid input;
            # several explicit examples failing apart at once.
            except (AssertionError, ValueError, InputError, ExceptionGroup) as exc:
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


def the_property(module: str):
    """The one test function of a property file (one property per file)."""
    tests = [f for name, f in inspect.getmembers(importlib.import_module(f"conformance.suite.{module}"))
             if name.startswith("test_") and callable(f)]
    assert len(tests) == 1, f"conformance/suite/{module}.py should hold one property, has {len(tests)}"
    return tests[0]


def run_property(module: str, targets: list[Target]) -> None:
    """Run a property on the given targets (two for the pairwise property)."""
    prop = the_property(module)
    if "target_pair" in inspect.signature(prop.hypothesis.inner_test).parameters:
        prop(target_pair=tuple(targets))
    else:
        (target,) = targets
        prop(target=target)


def registered_copies(name: str, copies) -> list[str]:
    return [broken_copy(f"{name} {i}", backend, edits, patches) for i, (backend, edits, patches) in enumerate(copies)]


@pytest.mark.parametrize("name", sorted(PROPERTY_BREAKS))
def test_each_property_catches_its_own_break(name):
    module, copies = PROPERTY_BREAKS[name]
    registered = registered_copies(name, copies)
    targets = [Target(r, "cpu", "float64") for r in registered]
    try:
        # Invisible to the oracle comparison: each copy, alone, matches the oracle...
        for target in targets:
            forward.test_every_tensor_matches_the_oracle(target=target)
        # ...and the property made for it fails.
        with pytest.raises(AssertionError) as caught, first_failure_only(the_property(module)):
            run_property(module, targets)
    finally:
        for r in registered:
            backends.unregister_backend(r)
    print(f"{name}: caught by conformance/suite/{module}.py: {str(caught.value).splitlines()[0][:300]}")


@pytest.mark.parametrize("module", sorted({module for module, _ in PROPERTY_BREAKS.values()}))
def test_pristine_copies_pass_the_property(module):
    """The same copies without their edit pass, so the break, not the copying, is what fails."""
    copies = next(copies for m, copies in PROPERTY_BREAKS.values() if m == module)
    registered = registered_copies(f"pristine {module}", [(backend, [], {}) for backend, _, _ in copies])
    try:
        run_property(module, [Target(r, "cpu", "float64") for r in registered])
    finally:
        for r in registered:
            backends.unregister_backend(r)


# What the float32 leg of test_search_rules must name for each float32-only break: the rule broken,
# not a parting from the reference (which a close call may excuse).
FLOAT32_CATCHES = {"float32 greedy search ties ids within a 0.2 margin": "greedy search chose id"}


@pytest.mark.parametrize("name", sorted(FLOAT32_PROPERTY_BREAKS))
def test_each_float32_leg_catches_its_own_break(name):
    """A float32-only mistake: the property's float64 leg passes the copy, its float32 leg fails
    it, and names the rule broken (`FLOAT32_CATCHES`)."""
    module, copies = FLOAT32_PROPERTY_BREAKS[name]
    registered = registered_copies(name, copies)
    try:
        run_property(module, [Target(r, "cpu", "float64") for r in registered])
        with pytest.raises(AssertionError) as caught, first_failure_only(the_property(module)):
            run_property(module, [Target(r, "cpu", "float32") for r in registered])
    finally:
        for r in registered:
            backends.unregister_backend(r)
    first = str(caught.value).splitlines()[0]
    assert FLOAT32_CATCHES[name] in first, f"{name!r} was caught, but not by its rule: {first[:300]}"
    print(f"{name}: caught by conformance/suite/{module}.py in float32: {first[:300]}")


@pytest.mark.parametrize("module", sorted({module for module, _ in FLOAT32_PROPERTY_BREAKS.values()}))
def test_pristine_copies_pass_the_float32_leg(module):
    """The same copies without their edit pass the float32 leg."""
    copies = next(copies for m, copies in FLOAT32_PROPERTY_BREAKS.values() if m == module)
    registered = registered_copies(f"pristine float32 {module}", [(backend, [], {}) for backend, _, _ in copies])
    try:
        run_property(module, [Target(r, "cpu", "float32") for r in registered])
    finally:
        for r in registered:
            backends.unregister_backend(r)
