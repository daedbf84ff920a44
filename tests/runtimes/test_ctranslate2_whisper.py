"""Whisper in CTranslate2 (faster-whisper's engine, `ctranslate2.models.Whisper`), run in CTranslate2 itself.

Two conversions of tiny random Whispers, each with every weight, norm and bias jittered:
- ours: `rosetta convert whisper.safetensors DIR --to ctranslate2` of `ctranslate2_whisper.example_model()`
  (CTranslate2's TransformersConverter on an hf-whisper folder, checked on write);
- a user's: docs/whisper_tiny.py's transformers model and word-level tokenizer, converted by
  CTranslate2's TransformersConverter as `ct2-transformers-converter --model DIR` converts it.

On a whole window of three rows of features, CTranslate2's `encode` output is the float64 oracle's
encoder output within the float32 tolerance, and `generate`'s greedy ids from Whisper's prompt
(start of transcript, <|en|>, <|transcribe|>, <|notimestamps|>, given to both) are our search's,
each step's logits within tolerance; int8 is measured. A planted conversion bug is named at the
encoder output, or at the first generated position whose logits part.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest

# One worker under `--dist loadgroup`: the module's conversions are paid once, beside the other CTranslate2 tests.
pytestmark = [pytest.mark.xdist_group("ctranslate2"),
              pytest.mark.filterwarnings("ignore::conformance.core.generation.note.GenerationWarning")]

pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed: "
                    "pip install 'rosetta-transformer[ctranslate2]'")
pytest.importorskip("torch", reason="CTranslate2's converter loads the Hugging Face folder with transformers' torch model")
pytest.importorskip("transformers", reason="CTranslate2's converter loads the folder with transformers")
pytest.importorskip("tokenizers", reason="the user's folder carries a tokenizer, as ct2-transformers-converter expects")

import ctranslate2  # noqa: E402

import conformance  # noqa: E402
from conformance.check.ctranslate2 import target as ctranslate2_check  # noqa: E402
from conformance.check.ctranslate2 import whisper as ctranslate2_whisper  # noqa: E402
from conformance.check.ctranslate2.compare import compare_ctranslate2  # noqa: E402
from conformance.check.ctranslate2.model import Directory  # noqa: E402
from conformance.check.report import window_batch  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.convert.hf_folder import from_hf_folder  # noqa: E402
from conformance.core.errors import ConfigError, InputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [46, 47, 50, 54]  # <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """(checkpoint path, config, params, `rosetta convert --to ctranslate2` output)."""
    config, params = ctranslate2_whisper.example_model()
    root = tmp_path_factory.mktemp("ct2-whisper")
    path = root / "whisper.safetensors"
    checkpoint.save(path, config, params)
    converted = root / "whisper-ct2"
    assert main(["convert", str(path), str(converted), "--to", "ctranslate2"]) == 0
    return path, config, params, converted


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """(the user's transformers folder, its ct2-transformers-converter output)."""
    root = tmp_path_factory.mktemp("ct2-whisper-user")
    folder = runpy.run_path(str(ROOT / "docs" / "whisper_tiny.py"))["write"](root / "whisper-tiny")
    converted = root / "whisper-tiny-ct2"
    ctranslate2.converters.TransformersConverter(str(folder)).convert(str(converted))
    return folder, converted


def features(config) -> np.ndarray:
    return window_batch(config)[0]  # (3, n_mels, 16): a whole window, as faster-whisper pads every chunk


def test_our_conversion_is_checked_on_write(ours, capsys):
    path, config, _, converted = ours
    assert sorted(p.name for p in converted.iterdir()) == ["config.json", "model.bin", "vocabulary.json"]
    directory = Directory.read(converted)
    # CTranslate2 finds Whisper's special tokens by their spelling; the rest are spelled by id.
    assert directory.whisper and directory.target.tokens[45:56] == [
        "<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
        "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>", "<|0.00|>"]
    assert directory.config["suppress_ids_begin"] == [3, 45]  # the note's, read by WhisperLoader
    again = path.parent / "again-ct2"
    assert main(["convert", str(path), str(again), "--to", "ctranslate2"]) == 0
    out = capsys.readouterr().out
    assert "verified: ctranslate2" in out and "(encode, generate)" in out and "greedy ids from the prompt" in out, out


def test_float32_encoder_logits_and_greedy_ids_agree_int8_measured(ours):
    _, config, params, converted = ours
    report = ctranslate2_check.check(config, params, features(config), None, compute_types=("float32", "int8"),
                                     model_dir=converted)
    float32, int8 = report.rows
    assert report.passed and report.prompt == PROMPT, report.table()
    limit = tolerance("float32", "cpu").atol
    assert 0 < float32.encoder_error <= limit * float32.encoder_scale, report.table()
    assert 0 < float32.max_error <= limit * float32.scale and float32.agreement == {1: 1.0}, report.table()
    assert float32.no_speech_error is not None and float32.no_speech_error <= limit
    assert int8.held is None and int8.passed is None and int8.encoder_error > float32.encoder_error
    # The comparison can tell: the oracle's greedy rows end at different lengths, with different ids.
    oracle = conformance_oracle_ids(config, params)
    assert len({len(r) for r in oracle}) > 1 and len({tuple(r) for r in oracle}) > 1, oracle


def conformance_oracle_ids(config, params) -> list[list[int]]:
    import impl_numpy

    model = impl_numpy.Model(config, params, dtype="float64")
    encoded = model.encode(features(config), return_attention=False)
    return ctranslate2_whisper.oracle_search(model, encoded, PROMPT, 3, 13, 45, 45, config.mask_fill,
                                             {"suppress_tokens": (), "begin_suppress_tokens": ()})


def test_the_notes_suppression_is_given_to_both(ours):
    _, config, params, converted = ours
    report = ctranslate2_whisper.measure(config, params, converted, Directory.read(converted), features(config),
                                         compute_types=("float32",), rules="note")
    assert report.passed, report.table()
    assert any("suppress_tokens [1, 2, 7" in line for line in report.search), report.search


def test_rosetta_check_runs_ctranslate2_beside_the_backends(ours, capsys):
    path = ours[0]
    assert main(["check", str(path), "--backends", "numpy,ctranslate2", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "ctranslate2 (Whisper)" in out and "| float32 |" in out and "ctranslate2: ok" in out, out


def test_compare_on_the_users_conversion(user):
    folder, converted = user
    directory = Directory.read(converted)
    assert directory.target.tokens[:2] == ["w00", "w01"] and directory.target.tokens[-1] == "<|0.16|>"
    config, _ = from_hf_folder(folder)
    report = conformance.compare(str(converted), None, features(config), None, weights=str(folder),
                                 compute_types=("float32", "int8"))
    float32, int8 = report.rows
    assert report.passed and float32.agreement == {1: 1.0}, report.table()
    assert int8.held is None and int8.max_error > float32.max_error, report.table()
    loaded = ctranslate2.models.Whisper(str(converted), compute_type="float32", intra_threads=1)
    again = compare_ctranslate2(loaded, None, features(config), None, weights=str(folder), model_dir=converted)
    assert [row.compute_type for row in again.rows] == ["float32"] and again.passed, again.table()


def test_rosetta_compare_cli_on_the_users_conversion(user, tmp_path, capsys):
    folder, converted = user
    out = tmp_path / "report.json"
    assert main(["compare", str(converted), str(folder), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ctranslate2 (Whisper)" in text and "ctranslate2: ok" in text and "| int8 |" in text, text
    saved = json.loads(out.read_text())
    assert saved["passed"] and saved["model"] == "whisper" and saved["prompt"] == PROMPT


def test_a_planted_decoder_bug_is_named_at_its_first_position(ours):
    """One row of the decoder's position table zeroed in the converted weights: the prompt takes
    positions 0..3, generated position k reads row 3 + k, so row 5 parts at generated position 2."""
    path, config, params, _ = ours
    broken = {key: value.copy() for key, value in params.items()}
    broken["decoder.position.table"][5] = 0.0
    folder = path.parent / "planted-decoder-ct2"
    ctranslate2_check.convert(config, broken, folder, verify=False)
    report = compare_ctranslate2(str(folder), None, features(config), None, weights=str(path),
                                 compute_types=("float32",))
    verdict = report.rows[0].verdict()
    assert not report.passed and "from generated position 2" in verdict and "encoder" not in verdict, report.table()
    assert report.rows[0].position_error[:2].max() <= tolerance("float32", "cpu").atol, report.table()


def reversed_kernels(monkeypatch):
    """A loader that copies each Conv1d weight with its 3 taps reversed (a kernel read the wrong way round)."""
    from ctranslate2.converters import transformers as loaders

    def set_conv1d(self, spec, module):
        spec.weight = module.weight.flip(-1)
        spec.bias = module.bias

    monkeypatch.setattr(loaders.WhisperLoader, "set_conv1d", set_conv1d)


def test_a_planted_encoder_bug_in_the_users_converter_is_named_at_the_encoder(user, tmp_path, monkeypatch):
    folder, _ = user
    reversed_kernels(monkeypatch)
    converted = tmp_path / "planted-ct2"
    ctranslate2.converters.TransformersConverter(str(folder)).convert(str(converted))
    config, _ = from_hf_folder(folder)
    report = compare_ctranslate2(str(converted), None, features(config), None, weights=str(folder),
                                 compute_types=("float32",))
    assert not report.passed and report.rows[0].verdict().startswith("FAIL: the encoder output beyond"), report.table()


def test_a_planted_converter_bug_is_refused_on_write(ours, tmp_path, monkeypatch, capsys):
    path = ours[0]
    reversed_kernels(monkeypatch)
    out = tmp_path / "written-ct2"
    assert main(["convert", str(path), str(out), "--to", "ctranslate2"]) == 1
    err = capsys.readouterr().err
    assert "not written" in err and "the encoder output beyond" in err, err
    assert not out.exists()


def test_a_vocabulary_that_misspells_the_prompt_is_refused(ours, tmp_path):
    path, config, _, converted = ours
    copy = tmp_path / "misspelled-ct2"
    shutil.copytree(converted, copy)
    tokens = json.loads((copy / "vocabulary.json").read_text())
    tokens[54] = "<|notimestamp|>"
    (copy / "vocabulary.json").write_text(json.dumps(tokens))
    with pytest.raises(InputError, match=r"does not hold it; the weights' note names <\|notimestamps\|> id 54"):
        compare_ctranslate2(str(copy), None, features(config), None, weights=str(path))


def test_a_note_without_whispers_prompt_is_refused_by_name(ours, tmp_path):
    _, config, params, _ = ours
    note = json.loads(config.notes["generation"])
    del note["no_timestamps_token_id"]
    bare = dataclasses.replace(config, notes={**config.notes, "generation": json.dumps(note)})
    with pytest.raises(ConfigError, match="no_timestamps_token_id"):
        ctranslate2_check.convert(bare, params, tmp_path / "bare-ct2")
    assert not (tmp_path / "bare-ct2").exists()


def test_a_whisper_directory_is_not_compared_with_an_ids_model(ours):
    _, _, _, converted = ours
    config, params = ctranslate2_check.example_model()
    from conformance.check.report import fixed_batch

    with pytest.raises(InputError, match="WhisperSpec"):
        compare_ctranslate2(str(converted), None, *fixed_batch(config), oracle=(config, params, None))
