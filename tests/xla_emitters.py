"""A claim about XLA:CPU's own code generation, checked in a process of its own.

The project's test run compiles XLA:CPU at LLVM level 0 and with its older loop emitters
(tests/conftest.py: the whole run takes about two thirds of the time). Those write some kernels
differently from XLA's defaults, so two programs that XLA's defaults compile to the same
arithmetic may differ there in the last bits. A test of such a bit-for-bit claim runs its check
here, in a CPU-only subprocess with neither setting: XLA as users run it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from rooms import pythonpath

# The XLA flags tests/conftest.py adds to the test run (without their values).
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters"
OPT_LEVEL = "--xla_backend_optimization_level"
TEST_RUN_FLAGS = (LOOP_EMITTERS, OPT_LEVEL)


def xla_test_settings_on() -> bool:
    """Whether this process compiles with either of the test run's settings (XLA_FLAGS names one)."""
    return any(flag in os.environ.get("XLA_FLAGS", "") for flag in TEST_RUN_FLAGS)


def run_with_xla_emitters(code: str, timeout: float = 300) -> str:
    """Run `code` in a fresh Python on the CPU at XLA's own settings (the checkout, tests/ and its
    rooms importable); fail with its stderr if it fails; return its standard output."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(TEST_RUN_FLAGS)]
    environment = {**os.environ, "XLA_FLAGS": " ".join(flags), "ROSETTA_JAX_QUIET": "1", "JAX_PLATFORMS": "cpu",
                   "PYTHONPATH": pythonpath()}
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
