"""docs/own-backend.md, run as written: its adapter (the page's Python block) wraps the tutorial's
`Seq2SeqTransformer` (tests/systems/torch_tutorial.py, as the user's `seq2seq.py`), and its
`rosetta conformance` command runs the `ci` profile on it, in a fresh directory.

The page says what the run finds: the forward property fails on a fully padded source row (the
oracle's NaN under a `-inf` fill, nn.Transformer's finite numbers), and on nothing else; the
attention weights are not exposed; generate and loss_and_grads are skipped by name. And that
`empty_rows = "zeros"` describes it: the same adapter holding it passes the forward property.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "own-backend.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_walkthrough_runs_as_written(tmp_path):
    (adapter,) = blocks("python")
    (tmp_path / "rosetta_adapter.py").write_text(adapter)
    shutil.copy(ROOT / "tests" / "systems" / "torch_tutorial.py", tmp_path / "seq2seq.py")
    commands = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("rosetta ")]
    assert commands == ["rosetta conformance --backends rosetta_adapter.py:build"], commands
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROSETTA_", "HYPOTHESIS_", "PYTEST_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "conformance.cli", *commands[0].split()[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    out = done.stdout
    print(out[-6000:], done.stderr[-2000:])
    label = "rosetta_adapter.py:build/cpu/float64"
    assert "adapter rosetta_adapter.py:build: offers forward, intermediates; no generate, no loss_and_grads" in out
    assert f"{label}: adapter: test_generate_chooses_the_oracles_ids needs generate" in out
    assert f"{label}: not exposed by intermediates, so not compared: " in out and "encoder.0.self" in out
    failures = [line for line in out.splitlines() if line.startswith("FAILED ")]
    if done.returncode == 0:  # a PyTorch whose attention gives NaN over a fully masked row agrees everywhere
        assert not failures
    else:  # what the page says it finds, and only that
        assert done.returncode == 1, done.stderr[-2000:]
        assert len(failures) == 1 and f"test_every_tensor_matches_the_oracle[{label}]" in failures[0], failures
        assert "NaN position(s) differ" in out
    assert {p.name for p in tmp_path.iterdir()} - {"__pycache__"} == {"rosetta_adapter.py", "seq2seq.py"}


def test_the_walkthrough_adapter_holding_empty_rows_zeros_passes(tmp_path):
    """What the page says describes nn.Transformer's fully masked rows: its adapter with
    `"empty_rows": "zeros"` added to `build.switches` passes the forward property (float64)."""
    from conformance.check import backends
    from conformance.check.backends import Target

    import conformance.suite.test_forward as forward

    (adapter,) = blocks("python")
    held = adapter + '\nbuild.switches = {**build.switches, "empty_rows": "zeros"}\n'
    (tmp_path / "zeros_adapter.py").write_text(held)
    shutil.copy(ROOT / "tests" / "systems" / "torch_tutorial.py", tmp_path / "seq2seq.py")
    name = f"{tmp_path / 'zeros_adapter.py'}:build"
    backends.register_adapter(name)
    forward.test_every_tensor_matches_the_oracle(target=Target(name, "cpu", "float64"))
