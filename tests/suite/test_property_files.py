"""The suite's shape: one property per file, and every property has a planted break it catches.

One property per file keeps a failure's file name a statement of what broke. The error contract
(`test_errors.py`) is the one file with several tests: they are one property, "every backend
refuses the same bad input with the same `InputError`", at its three entry points (a call, the
parameters, the dtype), sharing one config and one way of catching the reference error.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from breaks import PROPERTY_BREAKS, REALISTIC_BREAKS, realistic_property_module

SUITE = Path(importlib.import_module("conformance.suite").__file__).parent
PROPERTY_FILES = sorted(p.stem for p in SUITE.glob("test_*.py"))
SEVERAL_ENTRY_POINTS = {"test_errors"}  # see the module docstring
CAUGHT_BY_THE_ORACLE_COMPARISON = {"test_forward", "test_masks", "test_fully_masked"}  # BREAKS, in tests/suite/test_has_teeth.py
# Properties whose planted break needs a setting the teeth runner cannot give (a CUDA-only property
# run on the CPU's kernels, a meta-test fed a property that missed a value): the test that plants it.
PLANTED_ELSEWHERE = {
    "test_sdpa_kernels": ("test_gpu_parts", "test_the_sdpa_property_fails_on_a_wrong_fast_path"),
    "test_coverage": ("test_covering_designs", "test_a_property_that_misses_a_value_fails_naming_it"),
    "test_sharded": ("test_sharded_property", "test_the_property_names_the_first_divergence_of_each_break"),
}


def properties_of(module: str) -> list[str]:
    return [name for name, f in inspect.getmembers(importlib.import_module(f"conformance.suite.{module}"))
            if name.startswith("test_") and callable(f)]


@pytest.mark.parametrize("module", PROPERTY_FILES)
def test_one_property_per_file(module):
    tests = properties_of(module)
    if module in SEVERAL_ENTRY_POINTS:
        assert len(tests) >= 1
    else:
        assert len(tests) == 1, f"conformance/suite/{module}.py holds {len(tests)} properties: {tests}"


def test_every_property_has_a_break_to_catch():
    planted = {module for module, _ in PROPERTY_BREAKS.values()}
    planted |= {realistic_property_module(dtype) for _, dtype, *_ in REALISTIC_BREAKS.values()}  # tests/suite/test_realistic_teeth.py
    missing = set(PROPERTY_FILES) - planted - CAUGHT_BY_THE_ORACLE_COMPARISON - SEVERAL_ENTRY_POINTS - set(PLANTED_ELSEWHERE)
    assert not missing, f"no planted break shows that these properties catch anything: {sorted(missing)}"


@pytest.mark.parametrize("module", sorted(PLANTED_ELSEWHERE))
def test_a_break_planted_elsewhere_is_planted(module):
    test_module, test = PLANTED_ELSEWHERE[module]
    assert module in PROPERTY_FILES, f"{module} is no longer a property file: drop it from PLANTED_ELSEWHERE"
    assert callable(getattr(importlib.import_module(test_module), test, None)), f"tests/*/{test_module}.py has no {test}"
