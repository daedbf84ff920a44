"""The conformance suite's pytest plugin: which backends, devices and dtypes run, and the header.

    pytest --pyargs conformance                       every installed backend, every device
    pytest --pyargs conformance --backends torch,jax  a subset (or ROSETTA_BACKENDS=torch,jax)
    pytest --pyargs conformance --devices cpu         a subset of devices (or ROSETTA_DEVICES)
    pytest --pyargs conformance --hypothesis-profile thorough

A backend that is asked for but not installed, and an accelerator that is not present, appear
as skipped tests with the reason: never silently absent.
"""

from __future__ import annotations

import itertools
import os

# Tiny models: a second intra-op thread only adds synchronisation, and on a loaded 2-core machine
# it made a torch forward pass up to 100x slower (4 ms -> 0.5 s, measured). Set before any
# framework is imported; a user's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from conformance import backends
from conformance.backends import Target
from conformance.profiles import load_default_profile

DTYPES = ("float32", "float64", "float16", "bfloat16")
DEVICES = {"numpy": ("cpu",), "torch": ("cpu", "cuda"), "jax": ("cpu", "gpu")}


def pytest_addoption(parser):
    group = parser.getgroup("rosetta conformance")
    group.addoption("--backends", default=None, help="comma-separated backends to test (numpy,torch,jax)")
    group.addoption("--devices", default=None, help="comma-separated device kinds (cpu,cuda,gpu)")


def pytest_configure(config):
    config.addinivalue_line("markers", "dtypes(*names): run the property only at these dtypes")
    load_default_profile(config)
    if config.getoption("--backends", None):
        os.environ["ROSETTA_BACKENDS"] = config.getoption("--backends")
    if config.getoption("--devices", None):
        os.environ["ROSETTA_DEVICES"] = config.getoption("--devices")


def pytest_report_header(config):
    from hypothesis import settings

    lines = [f"rosetta conformance: hypothesis profile {settings._current_profile!r}"]
    for name, reason in backends.availability().items():
        if reason:
            lines.append(f"  {name}: SKIPPED ({reason})")
            continue
        present = backends.devices(name)
        with backends.full_precision(name):
            precision = backends.precision_settings(name)
        settings_text = ", ".join(f"{k}={v}" for k, v in precision.items()) or "n/a"
        lines.append(f"  {name}: {backends.version(name)}; devices {present}; precision during runs: {settings_text}")
    return lines


def all_targets(dtypes=DTYPES) -> list:
    """Every (backend, device, dtype) as a pytest param, with a skip mark and reason if it cannot run."""
    available = backends.availability()
    params = []
    for name in backends.requested_backends():
        for device in DEVICES[name]:
            for dtype in dtypes:
                if name == "numpy" and dtype != "float32":
                    continue  # numpy float64 is the oracle; numpy runs float32 and float64 only
                target = Target(name, device, dtype)
                marks = []
                if available[name]:
                    marks.append(pytest.mark.skip(reason=f"{name}: {available[name]}"))
                elif device != "cpu" and device not in backends.devices(name):
                    marks.append(pytest.mark.skip(reason=backends.accelerator_skip_reason(name)))
                params.append(pytest.param(target, id=target.label, marks=marks))
    return params


def target_pairs(dtypes=("float32", "float64")) -> list:
    """Pairs of runnable targets that should agree with each other: same dtype, different backend
    or device (e.g. torch/cpu vs jax/cpu, torch/cuda vs torch/cpu)."""
    flat = [p for p in all_targets(dtypes)]
    params = []
    for a, b in itertools.combinations(flat, 2):
        ta, tb = a.values[0], b.values[0]
        if ta.dtype != tb.dtype or (ta.backend, ta.device) == (tb.backend, tb.device):
            continue
        marks = list(a.marks) + list(b.marks)
        params.append(pytest.param((ta, tb), id=f"{ta.label}~{tb.label}", marks=marks[:1]))
    return params


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("dtypes")
    dtypes = tuple(marker.args) if marker else DTYPES
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", all_targets(dtypes))
    if "target_pair" in metafunc.fixturenames:
        metafunc.parametrize("target_pair", target_pairs(dtypes))


def pytest_terminal_summary(terminalreporter):
    from conformance.runner import TIMINGS

    if TIMINGS:
        terminalreporter.section("rosetta conformance: time per target (model build, compile and run)")
        for label, seconds in sorted(TIMINGS.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {label:<28} {seconds:7.1f} s")
        compile_report = backends.compile_report()
        for line in compile_report:
            terminalreporter.write_line(f"  {line}")
