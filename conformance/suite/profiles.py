"""Hypothesis profiles, registered once for the project's tests and the conformance suite.

    ci        derandomized, bounded example counts, no deadline (shared, noisy machines)
    thorough  thousands of examples, random seeds
    scale     full-size models: the realistic property (`test_forward_realistic.py`) draws
              d_model 512-1024, 6+6 layers, vocab 32000 and lengths 128-1024 (`full_size()`,
              read by `conformance.suite.strategies.any_realistic_cases`); three examples per
              property, derandomized, no shrinking and no example database (each example costs a
              minute; a shrink, or a replay of the examples an earlier run saved, would run
              hundreds). The other properties keep their small strategies, with three
              examples each. `rosetta conformance --profile scale` prints an estimate of its time
              first and a line per full-size model run. Never loaded by default: CI does not run it.

Pick one with `--hypothesis-profile NAME` or `HYPOTHESIS_PROFILE=NAME`; the default is `ci`.
Failing examples print their reproduction blob (`@reproduce_failure`) in every profile.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

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
# Examples per property under `scale`; `conformance.cli.conformance_suite` multiplies its estimate by it.
SCALE_EXAMPLES = 3
settings.register_profile(
    "scale",
    derandomize=True,
    max_examples=SCALE_EXAMPLES,
    deadline=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.generate],
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FULL_SIZE_PROFILES = frozenset({"scale"})


def full_size() -> bool:
    """Whether the active hypothesis profile asks for full-size models (read when an example is drawn)."""
    return settings._current_profile in FULL_SIZE_PROFILES


def ci_profile() -> bool:
    """Whether the active hypothesis profile is `ci` (CI runs it; the others may run a test's
    long or redundant variants too)."""
    return settings._current_profile == "ci"


def ci_or_every(every: tuple, ci: tuple) -> tuple:
    """`ci` under the `ci` profile (a test's redundant variants left out for CI's time), else `every`."""
    return ci if ci_profile() else every


def load_default_profile(pytest_config=None) -> None:
    """Load `--hypothesis-profile` if given, else `$HYPOTHESIS_PROFILE` (default `ci`), now: the
    properties are decorated when collection imports them, and a decorator that reads the profile
    (`bounded_sample`) must see the chosen one, not hypothesis' own later load (under `scale`, the
    realistic property was decorated with the `ci` settings: six examples, and shrinking)."""
    chosen = pytest_config.getoption("hypothesis_profile", None) if pytest_config is not None else None
    settings.load_profile(chosen if chosen is not None else os.environ.get("HYPOTHESIS_PROFILE", "ci"))
