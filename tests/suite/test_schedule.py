"""How the suite's plugin schedules the properties under `ci` (issue 24: CI time).

- A compiling backend's item draws `CI_COMPILING_EXAMPLES` examples after the covering ones, the
  others the property's own count: read from hypothesis' own statistics of a real run.
- The properties run (device, dtype) group by group, each group in file order, the coverage check
  last, and the project's other tests keep their places; every suite item is in one xdist group.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.check.backends import Target
from conformance.suite import pytest_plugin
from conformance.suite.pytest_plugin import CI_COMPILING_EXAMPLES, SUITE, SUITE_GROUP

ROOT = Path(__file__).resolve().parents[2]


def test_a_compiling_backend_draws_fewer_examples_under_ci_and_the_others_their_own():
    pytest.importorskip("jax")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYPOTHESIS_PROFILE": "ci"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/suite/test_masks.py", "--backends", "numpy,jax",
         "--devices", "cpu", "-k", "float32", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stops = dict(re.findall(r"test_masks_equal_the_oracle_exactly\[(\w+)/cpu/float32\]:.*?"
                            r"Stopped because settings\.max_examples=(\d+)", run.stdout, re.S))
    assert stops == {"numpy": "25", "jax": str(CI_COMPILING_EXAMPLES)}, run.stdout[-3000:]


class Item(SimpleNamespace):
    def add_marker(self, marker):
        self.markers.append(marker)


def suite_item(name, target):
    key = "target_pair" if isinstance(target, tuple) else "target"
    return Item(path=SUITE / name, callspec=SimpleNamespace(params={key: target}), markers=[], name=name)


def test_properties_run_group_by_group_with_the_coverage_check_last():
    t = {(b, d): Target(b, "cpu", d) for b in ("numpy", "jax") for d in ("float32", "float64")}
    items = [
        suite_item("test_a.py", t["jax", "float32"]),
        suite_item("test_a.py", t["jax", "float64"]),
        suite_item("test_b.py", t["numpy", "float64"]),
        suite_item("test_b.py", (t["numpy", "float32"], t["jax", "float32"])),
        suite_item("test_coverage.py", None),
        suite_item("test_b.py", t["jax", "float64"]),
        Item(path=ROOT / "tests" / "test_x.py", callspec=None, markers=[], name="own"),
    ]
    order = list(items)
    pytest_plugin.pytest_collection_modifyitems(None, None, order)
    names = [(i.name, pytest_plugin.target_group(i)) for i in order]
    assert names == [
        ("test_a.py", ("cpu", "float32")), ("test_b.py", ("cpu", "float32")),
        ("test_a.py", ("cpu", "float64")), ("test_b.py", ("cpu", "float64")), ("test_b.py", ("cpu", "float64")),
        ("test_coverage.py", ("",)), ("own", ("",)),
    ]
    assert order[2] is items[1] and order[3] is items[2]  # a group keeps the file order
    for item in order[:-1]:
        assert [m.kwargs.get("name", m.args[0] if m.args else None) for m in item.markers] == [SUITE_GROUP]
    assert order[-1].markers == []
