"""A folder whose config.json names no model_type, or one no layout reads, is refused on the
file, saying what it lacks (issue 56, item 14): before, the refusal read `ModelConfig.model_type:
... says model_type None`, blaming a field ModelConfig does not have."""

from __future__ import annotations

import json

import pytest

from conformance.cli import main
from conformance.convert import from_hf_folder
from conformance.core.errors import CheckpointError


def folder_with(tmp_path, config: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_config_without_model_type_is_refused_on_its_file_naming_what_it_lacks(tmp_path):
    folder = folder_with(tmp_path, {"d_model": 16, "vocab_size": 11})
    with pytest.raises(CheckpointError) as info:
        from_hf_folder(folder)
    message = str(info.value)
    assert info.value.path == str(folder / "config.json"), info.value.path
    assert message.startswith(f"{folder / 'config.json'}: names no model_type"), message
    assert "None" not in message and "ModelConfig" not in message, message
    assert "bart (hf-bart)" in message, message  # what it could say


def test_an_unknown_model_type_is_named_with_the_ones_read(tmp_path, capsys):
    folder = folder_with(tmp_path, {"model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="says model_type 'gpt2'; no built-in layout reads it") as info:
        from_hf_folder(folder)
    assert not str(info.value).startswith("ModelConfig"), str(info.value)
    assert main(["convert", str(folder), str(tmp_path / "out.safetensors")]) != 0
    err = capsys.readouterr().err
    assert "says model_type 'gpt2'" in err and "ModelConfig.model_type" not in err, err


def test_a_layout_given_for_a_config_without_model_type_says_so(tmp_path):
    folder = folder_with(tmp_path, {"d_model": 16})
    with pytest.raises(CheckpointError, match="names no model_type .*, but layout hf-bart reads model_type bart"):
        from_hf_folder(folder, layout="hf-bart")
