"""Ctrl-C during a long command (issue 45, item 5): one line on stderr, exit status 130, and
nothing left behind (no temporary file, no partial output, an existing output unchanged).

Each command runs in a subprocess that interrupts itself at a chosen step: a patched function
sends the process a real SIGINT (`os.kill`, Python's own handler turns it into KeyboardInterrupt)
and waits for it. The moment is exact, so the test is not timing-dependent.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.convert import export_state_dict
from conformance.core import checkpoint

ROOT = Path(__file__).resolve().parents[2]

# The child: patch `module:attribute` so that its first call interrupts the process.
CHILD = textwrap.dedent("""
    import importlib, os, signal, sys, time

    owner = importlib.import_module(sys.argv[1])
    *path, attribute = sys.argv[2].split(".")
    for name in path:  # a class's method: "Status.__call__"
        owner = getattr(owner, name)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)  # the handler raises KeyboardInterrupt here, at once
        raise AssertionError("SIGINT was not delivered")

    setattr(owner, attribute, interrupted)
    if os.environ.get("ROSETTA_TEST_AS_MODULE"):  # `python -m conformance.cli ...`
        import runpy

        sys.argv = ["conformance.cli", *sys.argv[3:]]
        runpy.run_module("conformance.cli", run_name="__main__", alter_sys=True)
    from conformance.cli import console_main  # what the `rosetta` script runs

    sys.exit(console_main(sys.argv[3:]))
""")


def interrupt(cwd: Path, at: str, *argv: str, as_module: bool = False) -> subprocess.CompletedProcess:
    module, attribute = at.split(":")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("ROSETTA_TEST_AS_MODULE", None)
    if as_module:
        env["ROSETTA_TEST_AS_MODULE"] = "1"
    return subprocess.run([sys.executable, "-c", CHILD, module, attribute, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def assert_one_line(result: subprocess.CompletedProcess, command: str) -> None:
    assert result.returncode == 130, (result.returncode, result.stderr)
    # What the command said before the interruption (the memory plan, how --src was read) stays.
    assert result.stderr.strip().splitlines()[-1] == f"rosetta {command}: interrupted", result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr


# Each long command, interrupted inside its work: the first progress message (which a terminal
# shows as the status line) comes once the model is loaded and the run has begun.
STATUS = "conformance.cli.progress:Status.__call__"
COMMANDS = [
    ("check", ["check", "--backends", "numpy", "--dtypes", "float64", "--json", "report.json"]),
    ("generate", ["generate", "--src", "3 1 4"]),
    ("train-check", ["train-check", "--backends", "numpy", "--dtypes", "float64", "--steps", "1", "--json", "t.json"]),
]


@pytest.mark.parametrize("command, argv", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_ctrl_c_in_a_long_command_is_one_line_and_exit_130(tmp_path, command, argv):
    before = files(tmp_path)
    assert_one_line(interrupt(tmp_path, STATUS, *argv), command)
    assert files(tmp_path) == before, "an interrupted run left a file behind"


def test_ctrl_c_while_convert_writes_keeps_the_old_file_and_no_temporary(tmp_path):
    """Interrupted inside the atomic save, after the temporary file is written and before it is
    renamed: the temporary is removed, and the existing output (replaced with --force) is intact."""
    config = preset("torch-nn-transformer", src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=6)
    params = init_params(config, seed=1, dtype=np.float32)
    checkpoint.write_tensors(tmp_path / "foreign.safetensors", export_state_dict(config, params, "torch-nn-transformer"), {})
    (tmp_path / "out.safetensors").write_bytes(b"the previous checkpoint")
    before = files(tmp_path)
    result = interrupt(tmp_path, "os:fsync", "convert", "foreign.safetensors", "out.safetensors", "--force",
                       "--set", "n_heads=2", "--set", "norm_placement=post", "--set", "pad_id=1")
    assert_one_line(result, "convert")
    assert files(tmp_path) == before, "the save left a temporary file or changed the old output"


def test_python_m_conformance_cli_says_ctrl_c_in_one_line(tmp_path):
    before = files(tmp_path)
    assert_one_line(interrupt(tmp_path, STATUS, "generate", "--src", "3 1 4", as_module=True), "generate")
    assert files(tmp_path) == before


def test_the_rosetta_script_runs_console_main():
    import tomllib

    from conformance.cli import console_main

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["rosetta"].partition(":")
    assert getattr(importlib.import_module(module), name) is console_main


def test_main_called_from_python_lets_ctrl_c_stop_the_caller(monkeypatch, capsys):
    """A script that calls `main([...])` in a loop must stop at Ctrl-C, as any Python call does;
    only the command line turns it into a line and a status."""
    from conformance.cli import console_main, main
    from conformance.cli import layouts

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(layouts, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["layouts"])
    assert console_main(["layouts"]) == 130
    assert capsys.readouterr().err == "rosetta layouts: interrupted\n"
