"""Test variants that only the `thorough` (and `scale`) profiles run (conformance/suite/profiles.py).

CI runs the `ci` profile; a variant that repeats what a cheaper sibling in CI already checks, at a
cost CI cannot pay, is marked with `thorough_only(reason)`, the reason naming the sibling. Read at
import, after tests/conftest.py has loaded the profile (`pytest_configure` runs before collection).
"""

from __future__ import annotations

import pytest

from conformance.suite.profiles import ci_profile


def thorough_only(reason: str):
    """A mark that skips the test under the `ci` profile, saying why and where it runs."""
    return pytest.mark.skipif(ci_profile(), reason=f"{reason} (CI time): HYPOTHESIS_PROFILE=thorough runs it")
