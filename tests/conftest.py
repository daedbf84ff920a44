"""Shared configuration for the project's own tests."""

import os

# Tiny models: a second intra-op thread only adds synchronisation, and on a loaded 2-core machine
# it made a torch forward pass up to 100x slower (4 ms -> 0.5 s, measured). Set before any
# framework is imported; a user's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from conformance.profiles import load_default_profile


def pytest_configure(config):
    load_default_profile(config)
