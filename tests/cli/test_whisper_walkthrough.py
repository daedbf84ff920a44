"""docs/whisper.md's walkthrough, "is my faster-whisper conversion right?", run as written: every
command of its code blocks, in order, in a scratch directory beside the repository's docs/, with
`rosetta` and `ct2-transformers-converter` the installed commands. Each exits 0, but the ones the
page marks `# exits 1` (a stale conversion, found at the decoder); what the page quotes of their
output is checked in the output they print.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("ctranslate2")  # conversions, beside the other CTranslate2 tests

pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed")
pytest.importorskip("transformers", reason="docs/whisper_tiny.py builds the model with transformers")
pytest.importorskip("tokenizers", reason="docs/whisper_tiny.py writes a tokenizer")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "whisper.md"
COMMANDS = ("python docs/", "ct2-transformers-converter ", "rosetta ")


def walkthrough() -> list[tuple[str, int]]:
    """(command, the exit status the page gives it) for each command line of the walkthrough."""
    text = PAGE.read_text()
    start = text.index("## Walkthrough: is my faster-whisper conversion right?")
    section = text[start:text.index("\n## ", start + 1)]
    found = []
    for line in section.splitlines():
        if line.startswith("    ") and line.strip().startswith(COMMANDS):
            command, _, comment = line.strip().partition("#")
            status = int(re.search(r"exits (\d)", comment).group(1)) if "exits" in comment else 0
            found.append((command.strip(), status))
    return found


def test_the_walkthrough_lists_its_commands():
    commands = [c for c, _ in walkthrough()]
    assert commands[0] == "python docs/whisper_tiny.py whisper-tiny"
    assert "rosetta compare whisper-tiny-ct2 whisper-tiny-tuned" in commands and len(commands) == 10, commands


def test_every_command_runs_as_written(tmp_path):
    bin_dir = Path(sys.executable).parent
    for tool in ("rosetta", "ct2-transformers-converter"):
        if shutil.which(tool, path=str(bin_dir)) is None and shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed as a command (pip install -e '.[ctranslate2]')")
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    printed = {}
    for command, status in walkthrough():
        run = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == status, f"{command}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        printed[command] = run.stdout
    assert "ctranslate2: ok" in printed["rosetta compare whisper-tiny-ct2 whisper-tiny"]
    stale = printed["rosetta compare whisper-tiny-ct2 whisper-tiny-tuned"]
    float32 = next(line for line in stale.splitlines() if line.startswith("| float32 |"))
    # The encoder agrees (its error a float32 one), the logits part from the first generated position.
    assert float(float32.split("|")[2]) < 1e-5 and "FAIL: logits beyond" in float32 and "position 0" in float32, stale
    assert "verified: ctranslate2" in printed["rosetta convert tiny.safetensors tiny-ct2 --to ctranslate2"]
    assert "ctranslate2: ok" in printed["rosetta check tiny.safetensors --backends numpy,ctranslate2 --dtypes float32"]
