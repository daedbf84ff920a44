"""The walkthrough is executable documentation: it must run, and its asserts must hold."""

import runpy
from pathlib import Path


def test_walkthrough_runs(capsys):
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "docs" / "walkthrough.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "prediction:" in printed
