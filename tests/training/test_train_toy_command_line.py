"""examples/train_toy.py's command line, as a user runs it (issue 45): it writes beside the user and
never over the shipped model unless asked, refuses an existing file unless forced, takes `--out`
as `--out=PATH` too, and shows its progress from the start."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conformance.check.defaults import DEFAULT_CHECKPOINT

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_toy.py"


def script():
    spec = importlib.util.spec_from_file_location("train_toy_command_line", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_toy_writes_beside_the_user_by_default():
    module = script()
    assert module.DEFAULT_OUT == Path("toy.safetensors")
    assert module.DEFAULT_OUT.resolve() != DEFAULT_CHECKPOINT.resolve()


def test_train_toy_refuses_to_overwrite_the_shipped_model_before_training(capsys):
    before = DEFAULT_CHECKPOINT.stat().st_mtime_ns
    with pytest.raises(SystemExit) as exit_:
        script().main(["--out", str(DEFAULT_CHECKPOINT), "--steps", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "shipped" in err and "--force" in err and str(DEFAULT_CHECKPOINT) in err, err
    assert DEFAULT_CHECKPOINT.stat().st_mtime_ns == before


def test_train_toy_refuses_an_existing_file_unless_forced(tmp_path, capsys):
    out = tmp_path / "mine.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(SystemExit) as exit_:
        script().main(["--out", str(out), "--steps", "1"])
    assert exit_.value.code == 2 and "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


def test_train_toy_shows_progress_before_its_first_evaluation(tmp_path, capsys):
    out = tmp_path / "toy.safetensors"
    module = script()
    status = module.main(["--out", str(out), "--steps", str(module.PROGRESS_EVERY + 1), "--batch", "8"])
    assert status == 1 and not out.exists()  # far from the bar after so few steps: not written
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("training the toy model"), lines
    assert "thread" in lines[0], lines[0]
    progress = [line for line in lines if line.startswith(f"step {module.PROGRESS_EVERY:5d}")]
    assert len(progress) == 1 and "loss" in progress[0] and "held-out" not in progress[0], lines
    assert "held-out" in lines[-2], lines  # the check at the last step, then why nothing was written
    assert module.PROGRESS_EVERY < module.EVALUATE_EVERY


def test_train_toy_writes_an_out_given_with_an_equals_sign(tmp_path, capsys):
    script = Path(__file__).resolve().parents[2] / "examples" / "train_toy.py"
    spec = importlib.util.spec_from_file_location("train_toy_review", script)
    train_toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_toy)
    out = tmp_path / "toy.safetensors"
    assert train_toy.main(["--backend", "numpy", "--steps", "1", "--batch", "4", f"--out={out}"]) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out
