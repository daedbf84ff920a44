"""Hypothesis profiles, registered once for the project's tests and the conformance suite.

    ci        derandomized, bounded example counts, no deadline (shared, noisy machines)
    thorough  thousands of examples, random seeds

Pick one with `--hypothesis-profile NAME` or `HYPOTHESIS_PROFILE=NAME`; the default is `ci`.
Failing examples print their reproduction blob (`@reproduce_failure`) in every profile.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def load_default_profile(pytest_config=None) -> None:
    """Load `$HYPOTHESIS_PROFILE` (default `ci`) unless `--hypothesis-profile` chose one."""
    chosen = pytest_config.getoption("hypothesis_profile", None) if pytest_config is not None else None
    if chosen is None:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
