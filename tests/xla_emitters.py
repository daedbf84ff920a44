"""A claim about XLA:CPU's own code generation, checked in a process of its own.

The project's test run compiles XLA:CPU with its older loop emitters (tests/conftest.py: the
whole run takes about two thirds of the time). Those write some kernels differently from XLA's
default fusion emitters, so two programs that XLA's defaults compile to the same arithmetic may
differ there in the last bits. A test of such a bit-for-bit claim runs its check here, in a
subprocess with the run's other flags and without the loop emitters: what users run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters"


def loop_emitters_on() -> bool:
    """Whether this process compiles with the loop emitters (XLA_FLAGS names the flag)."""
    return LOOP_EMITTERS in os.environ.get("XLA_FLAGS", "")


def run_with_xla_emitters(code: str, timeout: float = 300) -> str:
    """Run `code` in a fresh Python with XLA's own emitters (tests/ and the checkout importable);
    fail with its stderr if it fails; return its standard output."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(LOOP_EMITTERS)]
    environment = {**os.environ, "XLA_FLAGS": " ".join(flags), "ROSETTA_JAX_QUIET": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
