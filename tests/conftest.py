"""Shared configuration for the project's own tests."""

import os

# Tiny models: a second intra-op thread only adds synchronisation, and on a loaded 2-core machine
# it made a torch forward pass up to 100x slower (4 ms -> 0.5 s, measured). Set before any
# framework is imported; a user's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys

import pytest

from conformance.suite.profiles import load_default_profile


def pytest_configure(config):
    load_default_profile(config)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """OMP_NUM_THREADS above covers a torch imported later; a torch already imported (collection
    imports the torch test modules) is set here, whatever the user's environment says."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
