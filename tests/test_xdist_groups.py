"""`pytest -n N --dist loadgroup` (CI's and the README's test command) keeps an `xdist_group` on one
worker. The project relies on it: a module's expensive fixture (an export, a subprocess, gloo
ranks) is paid once, and `rosetta conformance -- -n N` runs the suite as one group because its
coverage check reads what the properties ran in its own process. pytest 9.2 with pytest-xdist 3.8
broke it silently (pytest-dev/pytest-xdist#1386; constraints.txt pins pytest 9.1.1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xdist")

PROBE = textwrap.dedent("""
    import os
    import pytest

    pytestmark = pytest.mark.xdist_group("probe")

    @pytest.mark.parametrize("i", range(8))
    def test_where(i):
        with open(os.environ["WORKERS_FILE"], "a") as out:
            out.write(os.environ.get("PYTEST_XDIST_WORKER", "none") + "\\n")
""")


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    workers = tmp_path / "workers.txt"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", "test_probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "WORKERS_FILE": str(workers)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    seen = workers.read_text().split()
    assert len(seen) == 8 and len(set(seen)) == 1, (
        f"the group ran on workers {sorted(set(seen))}: --dist loadgroup split it (pytest {pytest.__version__})")
