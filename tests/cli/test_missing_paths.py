"""A path that is not there is named as missing (issue 56 item 5), not as a file of an unknown
type or a MODULE:FACTORY without WEIGHTS."""

from __future__ import annotations

import pytest

from conformance.cli import main


def refused(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("name", ["nothere", "nothere.pt", "nothere/"])
def test_convert_names_a_missing_input(tmp_path, capsys, name):
    src = tmp_path / "models" / name
    err = refused(capsys, "convert", src, tmp_path / "out.safetensors")
    assert err.strip() == f"rosetta convert: error: {src}: no such file or directory", err
    assert "unknown file type" not in err and list(tmp_path.iterdir()) == []


def test_a_missing_input_with_a_suffix_convert_does_not_read_says_both(tmp_path, capsys):
    err = refused(capsys, "convert", tmp_path / "model.onnx", tmp_path / "out.safetensors")
    assert "model.onnx: no such file or directory" in err and "unknown file type '.onnx'" in err, err


def test_compare_names_a_missing_model(tmp_path, capsys):
    model = tmp_path / "rt" / "missing-ct2"
    err = refused(capsys, "compare", model, tmp_path / "models" / "t5")
    assert f"{model}: no such file or directory" in err and "needs WEIGHTS" not in err, err
