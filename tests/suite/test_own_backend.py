"""Your own backend under the suite (issue 45): an installed adapter package, found by its
`rosetta.backends` entry point, runs the `ci` profile through `rosetta conformance`.

The package (tests/fixtures/own_backend/toy_adapter.py: the NumPy model behind the adapter
protocol, and the same with a planted bug) is installed the way pip leaves a package, a module
beside a `*.dist-info` with its entry points, in a temporary directory put on PYTHONPATH: no
network, no build. The clean adapter passes; the broken one fails, the failing property named;
what the adapter does not offer (`loss_and_grads`) is skipped by name, never passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "own_backend" / "toy_adapter.py"
ENTRY_POINTS = """[rosetta.backends]
toy = toy_adapter:build
toy-broken = toy_adapter:build_broken
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding the adapter package as installed: the module and its dist-info."""
    root = tmp_path_factory.mktemp("site")
    (root / "toy_adapter").mkdir()
    shutil.copy(FIXTURE, root / "toy_adapter" / "__init__.py")
    info = root / "toy_adapter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-adapter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


def conformance(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROSETTA_", "HYPOTHESIS_", "PYTEST_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "conformance.cli", "conformance", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    print(done.stdout[-4000:], done.stderr[-2000:])
    return done


def test_the_clean_adapter_passes_and_what_it_lacks_is_skipped_by_name(site, tmp_path):
    done = conformance(site, "--backends", "toy", "--", "-ra", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "toy: adapter toy: offers forward, intermediates, generate; no loss_and_grads" in done.stdout
    for dtype in ("float32", "float64"):
        row = next(line for line in done.stdout.splitlines() if line.strip().startswith(f"toy/cpu/{dtype} "))
        passed, failed = (int(n) for n in row.split()[1:3])
        assert passed == 3 and failed == 0, row  # the forward, determinism and generate properties
        assert (f"toy/cpu/{dtype}: adapter: test_gradients_match_the_oracle needs loss_and_grads, which the "
                "adapter's model does not have") in done.stdout
    assert "toy/cpu/float32: adapter: test_masks_equal_the_oracle_exactly is not in the adapter protocol" in done.stdout


def test_the_suite_catches_a_planted_bug_in_the_adapter(site, tmp_path):
    done = conformance(site, "--backends", "toy-broken", "--", "-k", "every_tensor_matches_the_oracle and not trained",
                       cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "FAILED test_forward.py::test_every_tensor_matches_the_oracle[toy-broken/cpu/float64]" in done.stdout
    assert "toy-broken on cpu (float64) differs from the float64 oracle in '" in done.stdout


def test_an_adapter_that_is_not_installed_is_refused_in_one_line(site, tmp_path):
    done = conformance(site, "--backends", "numpy,nowhere", cwd=tmp_path)
    assert done.returncode == 2
    assert "unknown backend 'nowhere'" in done.stderr and "toy" in done.stderr and "MODULE:FACTORY" in done.stderr
    done = conformance(site, "--backends", "toy_adapter:missing", cwd=tmp_path)
    assert done.returncode == 2 and "no function 'missing'" in done.stderr, done.stderr
