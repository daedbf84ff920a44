"""`rosetta conformance` and `pytest --pyargs conformance.suite` work from any directory.

The suite's options, hypothesis profiles and header live in `conformance/suite/pytest_plugin.py`. A
conftest inside the package is read early only when `conformance` is a path under the current
directory, so from anywhere else the plugin must be named (`-p conformance.suite.pytest_plugin`), as
`rosetta conformance` does. Each run here is a fresh process, started in an empty directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.check import backends

ROOT = Path(__file__).resolve().parents[2]
HEADER = "rosetta conformance: hypothesis profile"


def run(argv: list[str], cwd: Path, **settings: str) -> subprocess.CompletedProcess:
    """`python argv` in `cwd`, without this run's ROSETTA_, HYPOTHESIS_ and PYTEST_ variables
    (`settings` adds the ones a test sets itself)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROSETTA_", "HYPOTHESIS_", "PYTEST_"))}
    env.update(settings, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:], done.stderr[-3000:])
    return done


def rosetta(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run(["-m", "conformance.cli", *args], cwd)


def test_rosetta_conformance_runs_from_another_directory(tmp_path):
    done = rosetta("conformance", "--backends", "numpy", "--devices", "cpu", "--", "-k", "masks", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"{HEADER} 'ci'" in done.stdout
    assert "numpy: numpy" in done.stdout
    summary = done.stdout.strip().splitlines()[-1]  # pytest's last line (the results table heads a "failed" column)
    assert " passed" in summary and " failed" not in summary, summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the run left files in the user's directory"


def test_rosetta_conformance_finds_the_thorough_profile_from_another_directory(tmp_path):
    done = rosetta("conformance", "--profile", "thorough", "--backends", "numpy", "--", "--collect-only", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"{HEADER} 'thorough'" in done.stdout


def test_pytest_on_the_installed_suite_from_another_directory(tmp_path):
    """The README's command for the installed suite."""
    done = run(["-m", "pytest", "-p", "no:cacheprovider", "-p", "conformance.suite.pytest_plugin",
                "--pyargs", "conformance.suite.test_masks", "--backends", "numpy", "--devices", "cpu"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert HEADER in done.stdout


@pytest.mark.parametrize("where", ["the repository", "elsewhere"])
def test_the_conftest_loads_the_plugin_when_nobody_named_it(where, tmp_path):
    """Without `-p` (and without this repository's addopts), the package's conftest registers
    the plugin: from the repository before the options are parsed, from elsewhere in time to
    parametrize the properties."""
    settings = {}
    if where == "the repository":
        argv, cwd = ["conformance/suite/test_masks.py", "--backends", "numpy"], ROOT
    else:
        # The backends through the plugin's environment variable: an option would be unknown to
        # pytest until the plugin is registered. NumPy only, as in the repository's case (all three
        # backends, selected with -k numpy, imported torch and JAX for nothing: 6.2 CPU-s, not 1.6).
        argv, cwd, settings = ["--pyargs", "conformance.suite.test_masks"], tmp_path, {"ROSETTA_BACKENDS": "numpy"}
    done = run(["-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", *argv], cwd, **settings)
    assert done.returncode == 0, done.stderr
    result = done.stdout.strip().splitlines()[-1]
    assert " passed" in result and "skipped" not in result and "failed" not in result, result


@pytest.mark.parametrize("argv", [["--backends", "numpy", "--devices", "cuda"],
                                  ["--backends", "numpy", "--devices", "cpu", "--", "-k", "sdpa_kernel"]],
                         ids=["numpy-on-cuda", "a-property-with-no-target-asked-for"])
def test_a_run_that_checked_no_target_fails_and_says_why(argv, tmp_path):
    """Issue 45, item 2: every item skipped is not a pass. The run exits 1, as `rosetta check`
    does when nothing was checked, and names each target asked for and why it did not run."""
    done = rosetta("conformance", *argv, cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "nothing was checked" in done.stdout
    assert "asked for: backends numpy" in done.stdout
    if "cuda" in argv:
        assert f"numpy/cpu/float32: {backends.DESELECTED}" in done.stdout
    else:
        assert "test_each_sdpa_kernel_matches_the_oracle: no target asked for can run it" in done.stdout
