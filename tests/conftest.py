"""Shared configuration for the project's own tests."""

import os

# Tiny models: a second intra-op thread only adds synchronisation, and on a loaded 2-core machine
# it made a torch forward pass up to 100x slower (4 ms -> 0.5 s, measured). Set before any
# framework is imported; a user's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc
import shutil
import subprocess
import sys
import tempfile

# XLA:CPU compiles dominate this test run's time (about half of it: ~3500 compiles, most of the
# tests build their own small configs and shapes). Three settings for the project's test run only,
# set here, before any test module imports JAX (this file is loaded at startup, before the
# suite's modules are collected; `rosetta conformance` and a user's programs never read it), and
# inherited by the xdist workers and the CLI subprocesses:
#
# - XLA:CPU's LLVM back end at optimisation level 0 (`ROSETTA_TEST_XLA_OPT_LEVEL`, default "0";
#   "default" leaves XLA's own): the same HLO, fusions and algebraic passes, with LLVM's code
#   optimisations off. Measured on this 2-core machine: the suite's float64 gradient property
#   compiled its 8 covering configs in 22.5 s of XLA time instead of 40.8 s, and every test
#   passed at either level; tolerances are those measured at the default level. CI's README step
#   2 (`rosetta check`) still runs every backend at the default level.
# - XLA:CPU's loop emitters instead of its MLIR fusion emitters
#   (`--xla_cpu_use_fusion_emitters=false`; `ROSETTA_TEST_XLA_FUSION_EMITTERS=1` keeps XLA's
#   default): the same fused HLO, each fusion's kernel written by the older emitter, which skips
#   the MLIR lowering pipeline. Measured on this machine, a float64 `loss_and_grads` of a 3+3
#   layer config: 6.6-7.9 s of XLA compile at level 0, 3.6-4.9 s with the loop emitters. The
#   kernels may contract multiplies and adds differently (last-bit differences, within every
#   tolerance). A JAX whose XLA no longer knows the flag is asked once, in a subprocess, and
#   then runs without it.
# - one JAX persistent compilation cache for the whole session (`ROSETTA_TEST_JAX_CACHE`: a
#   directory to use and keep, "0" for none; default a fresh temporary directory, deleted at the
#   end), so that an executable one xdist worker or CLI subprocess compiled is loaded by the
#   others. The tests of the cache itself (tests/backends/jax/test_jax_compile.py) set their own
#   directories and strip these variables from their subprocesses.
from xla_emitters import LOOP_EMITTERS, OPT_LEVEL  # the flags this file adds, named once
from rooms import room_folders

# Every room's folder on the path (tests/rooms.py): a test module may import another room's
# builders by bare name, whichever files a run selects. After the folders pytest itself prepends.
sys.path.extend(str(folder) for folder in room_folders() if str(folder) not in sys.path)


def _xla_flags_with(flag: str) -> str:
    """XLA_FLAGS as set now, with `flag` after them."""
    return f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _xla_accepts(flag: str) -> bool:
    """Whether this JAX's XLA:CPU starts with `flag` in XLA_FLAGS (an unknown flag aborts it)."""
    env = {**os.environ, "XLA_FLAGS": _xla_flags_with(flag), "JAX_PLATFORMS": "cpu"}
    try:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                               capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


if os.environ.get("ROSETTA_TEST_XLA_OPT_LEVEL", "0") != "default" and OPT_LEVEL not in os.environ.get("XLA_FLAGS", ""):
    level = os.environ.get("ROSETTA_TEST_XLA_OPT_LEVEL", "0")
    os.environ["XLA_FLAGS"] = _xla_flags_with(f"{OPT_LEVEL}={level}")
if os.environ.get("ROSETTA_TEST_XLA_FUSION_EMITTERS", "0") != "1" and LOOP_EMITTERS not in os.environ.get("XLA_FLAGS", ""):
    if _xla_accepts(f"{LOOP_EMITTERS}=false"):
        os.environ["XLA_FLAGS"] = _xla_flags_with(f"{LOOP_EMITTERS}=false")
    else:  # the xdist workers and subprocesses need not ask again
        os.environ["ROSETTA_TEST_XLA_FUSION_EMITTERS"] = "1"
_OWN_CACHE = None
if os.environ.get("ROSETTA_TEST_JAX_CACHE", "") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if os.environ.get("ROSETTA_TEST_JAX_CACHE"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["ROSETTA_TEST_JAX_CACHE"]
    else:
        _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rosetta-test-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import pytest
from hypothesis import settings

from conformance.suite.profiles import load_default_profile


def pytest_configure(config):
    # In the project's own test run, a failing property stops at its first failure. Hypothesis'
    # default goes on through every other explicit (covering) example to report each distinct
    # bug, and the meta-tests that plant a break (tests/breaks.py) fail on purpose: each of those
    # examples is a model build and, on a compiling backend, a compile. Measured alone: the
    # planted break of tests/runtimes/test_torch_compiled.py 47 -> 13 CPU-seconds, the 57 tests of
    # the teeth files that catch a break 92 -> 74. `rosetta conformance` keeps hypothesis' default.
    for name in ("ci", "thorough", "scale"):
        settings.register_profile(name, settings.get_profile(name), report_multiple_bugs=False)
    load_default_profile(config)


def pytest_collection_finish(session):
    """Everything imported and built by collection (torch, JAX, the test modules: millions of
    objects) moves to the garbage collector's permanent generation, so that each later full
    collection, automatic or `rosetta check`'s between large models, scans only what the tests
    create. Measured on four gc-heavy test files with two workers: 4m20s of CPU time down to
    3m47s. What collection built lives for the whole run anyway."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """The session's own JAX cache directory goes with the process that made it (the xdist
    workers inherit its path, so only the controller, or a run without xdist, made one)."""
    if _OWN_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
