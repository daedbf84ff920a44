"""CTranslate2 (`rosetta convert --to ctranslate2`, `conformance.check.ctranslate2.target`), run in
CTranslate2 itself.

A tiny seeded Marian (`ctranslate2_check.example_model`: the pad id last with a zero row, as
CTranslate2's Marian loader assumes) goes through the path a user takes: a Hugging Face Marian
folder, then CTranslate2's TransformersConverter. On padded rows, in float32 its greedy and beam-4
ids equal our `generate`'s and its `score_batch` log-probabilities are the float64 oracle's within
the float32 tolerance; int8 (and bfloat16 where CTranslate2 has kernels for it) is measured, not held
to equality. A tiny T5 (relative position bias, RMSNorm, a tied head scaled by d_model^-1/2) and a
tiny BART (offset positions, embedding LayerNorm) go the same way, each through its own family's
folder and CTranslate2 loader, the family chosen from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# One worker under `--dist loadgroup`: the module's fixture (exports, subprocesses) is paid once, not per worker.
pytestmark = pytest.mark.xdist_group("ctranslate2")

pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed: "
                    "pip install 'rosetta-transformer[ctranslate2]'")
pytest.importorskip("torch", reason="CTranslate2's converter loads the Hugging Face folder with transformers' torch model")
pytest.importorskip("transformers", reason="CTranslate2's converter loads the folder with transformers")

import ctranslate2  # noqa: E402

from conformance.check.ctranslate2 import target as ctranslate2_check  # noqa: E402

from conformance.check.ctranslate2 import compare as ctranslate2_compare
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import ConfigError, InputError  # noqa: E402

MAX_LEN = 16  # enough for rows that end at the first step and rows that reach the limit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config, params = ctranslate2_check.example_model(seed=0)
    path = tmp_path_factory.mktemp("ct2") / "marian.safetensors"
    checkpoint.save(path, config, params)
    return path, config, params


@pytest.fixture(scope="module")
def converted(saved):
    """`rosetta convert marian.safetensors DIR --to ctranslate2`, once for the module."""
    path, _, _ = saved
    folder = path.parent / "marian-ct2"
    assert main(["convert", str(path), str(folder), "--to", "ctranslate2"]) == 0
    return folder


@pytest.fixture(scope="module")
def report(saved, converted):
    _, config, params = saved
    src, tgt = fixed_batch(config)
    return ctranslate2_check.check(config, params, src, tgt, compute_types=("float32", "int8", "bfloat16"),
                                   max_len=MAX_LEN, model_dir=converted)


def test_convert_writes_a_ctranslate2_model_atomically(converted):
    assert (converted / "model.bin").is_file()
    config = json.loads((converted / "config.json").read_text())
    assert config["eos_token"] == "0"
    # Nothing but the model is left beside it (the staging and the Hugging Face folder are gone).
    assert sorted(p.name for p in converted.parent.iterdir()) == ["marian-ct2", "marian.safetensors"]
    ctranslate2.Translator(str(converted), compute_type="float32")  # CTranslate2 loads it


def test_float32_ids_equal_ours_greedy_and_beam4(report):
    row = report.rows[0]
    assert row.compute_type == "float32"
    assert row.agreement == {1: 1.0, 4: 1.0}, report.table()
    assert row.first_split == {1: None, 4: None}, report.table()
    # The report says how the two searches were lined up: a user running defaults meets the difference.
    assert "min_decoding_length=0" in report.table() and "early_stopping=True" in report.table()


def test_float32_log_probs_within_the_float32_tolerance(report):
    row = report.rows[0]
    tol = tolerance("float32", "cpu")
    assert row.position_error.shape == (7,)  # 6 target positions and the appended end token
    assert row.max_error <= tol.atol, (f"ctranslate2/cpu/float32 score_batch log p: max abs error {row.max_error:.2e} "
                                       f"> {tol.atol:.0e}; per position {row.position_error}")
    assert row.max_error > 0  # a different engine, computed in float32: not the oracle's own numbers


def test_int8_and_bfloat16_are_measured(report):
    measured = {row.compute_type: row for row in report.rows}
    assert "int8" in measured
    for row in measured.values():
        assert np.all(np.isfinite(row.position_error)), report.table()
        assert set(row.agreement) == {1, 4} and all(0.0 <= a <= 1.0 for a in row.agreement.values())
    assert measured["int8"].max_error > report.rows[0].max_error  # quantized weights move the log-probs
    if "bfloat16" in ctranslate2.get_supported_compute_types("cpu"):
        assert "bfloat16" in measured
    else:
        assert "no bfloat16 kernels" in report.skipped["bfloat16"]
    assert "| int8 |" in report.table()


def test_the_check_refuses_what_the_marian_loader_would_change():
    config, params = ctranslate2_check.example_model()
    with pytest.raises(ConfigError, match="pad_id must be 31"):
        ctranslate2_check.representable(config.replace(pad_id=0), params)
    started = config.replace(notes={"generation": json.dumps({"decoder_start_token_id": 3, "eos_token_id": 0})})
    with pytest.raises(ConfigError, match="starts it from 3"):
        ctranslate2_check.representable(started, params)
    params["encoder.embedding.weight"][31] = 0.5
    with pytest.raises(ConfigError, match="zero embedding"):
        ctranslate2_check.representable(config, params)
    with pytest.raises(InputError, match="followed by padding only"):
        ctranslate2_compare.token_rows(np.array([[3, 31, 4]]), 31, "src_ids")
    with pytest.raises(InputError, match="compute_types"):
        ctranslate2_check.check(config, params, np.array([[3]]), np.array([[4]]), compute_types=["int4"])


def test_convert_cli_refusals(saved, tmp_path, capsys):
    path, config, params = saved

    def refused(*argv: str) -> str:
        capsys.readouterr()
        assert main(["convert", str(path), *argv]) == 2
        return capsys.readouterr().err

    assert "--quantization" in refused(str(tmp_path / "a.safetensors"), "--quantization", "int8")
    assert "--layout" in refused(str(tmp_path / "b"), "--to", "ctranslate2", "--layout", "hf-marian")
    (tmp_path / "exists").mkdir()
    assert "already exists" in refused(str(tmp_path / "exists"), "--to", "ctranslate2")
    # A config CTranslate2's Marian spec cannot hold is refused by the switch, before anything is written.
    path = tmp_path / "pad0.safetensors"
    checkpoint.save(path, config.replace(pad_id=0), params)
    assert "pad_id must be 31" in refused(str(tmp_path / "c"), "--to", "ctranslate2")
    assert not (tmp_path / "c").exists()


def test_convert_cli_quantization_int8(saved, tmp_path):
    path, _, _ = saved
    folder = tmp_path / "int8"
    assert main(["convert", str(path), str(folder), "--to", "ctranslate2", "--quantization", "int8"]) == 0
    translator = ctranslate2.Translator(str(folder))  # the stored type is its default compute type
    assert translator.compute_type.startswith("int8")


def test_an_interrupted_conversion_leaves_nothing(saved, tmp_path, monkeypatch):
    path, _, _ = saved

    def interrupted(self, output_dir, **kwargs):
        (Path(output_dir)).mkdir()
        (Path(output_dir) / "model.bin").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(ctranslate2.converters.TransformersConverter, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["convert", str(path), str(tmp_path / "ct2"), "--to", "ctranslate2"])
    assert list(tmp_path.iterdir()) == []


# T5 and BART: `rosetta convert --to ctranslate2` picks the family from the checkpoint. The T5's seed
# is one whose greedy ids change token part-way (a random T5 tends to repeat one token).
OTHER_FAMILIES = {"hf-t5": 4, "hf-bart": 0}


@pytest.fixture(scope="module", params=sorted(OTHER_FAMILIES))
def family_report(request, tmp_path_factory):
    layout = request.param
    config, params = ctranslate2_check.example_model(seed=OTHER_FAMILIES[layout], layout=layout)
    path = tmp_path_factory.mktemp(layout) / "model.safetensors"
    checkpoint.save(path, config, params)
    folder = path.parent / "ct2"
    assert main(["convert", str(path), str(folder), "--to", "ctranslate2"]) == 0
    src, tgt = fixed_batch(config)
    assert np.any(src == config.pad_id) and np.any(tgt == config.pad_id)  # padded rows
    report = ctranslate2_check.check(config, params, src, tgt, compute_types=("float32", "int8_float32"),
                                     max_len=MAX_LEN, model_dir=folder)
    return layout, config, report


def test_t5_and_bart_float32_ids_equal_ours_greedy_and_beam4(family_report):
    layout, _, report = family_report
    row = report.rows[0]
    assert row.compute_type == "float32"
    assert row.agreement == {1: 1.0, 4: 1.0} and row.first_split == {1: None, 4: None}, f"{layout}\n{report.table()}"
    tol = tolerance("float32", "cpu")
    assert 0 < row.max_error <= tol.atol, f"ctranslate2/cpu/float32 {layout} score_batch log p\n{report.table()}"
    assert report.banned == () and report.pad_mass == 0.0  # T5's and BART's loaders keep every id


def test_t5_and_bart_int8_float32_is_measured(family_report):
    layout, _, report = family_report
    quantized = report.rows[1]
    assert quantized.compute_type == "int8_float32" and np.all(np.isfinite(quantized.position_error))
    assert quantized.max_error > report.rows[0].max_error, f"{layout}\n{report.table()}"


def test_the_family_is_read_from_the_checkpoint():
    for layout in ("hf-marian", *OTHER_FAMILIES):
        config, params = ctranslate2_check.example_model(layout=layout)
        assert ctranslate2_check.family_of(config, params).layout == layout
    from conformance import init_params
    from conformance.core.presets import preset

    config = preset("hf-mbart", qkv_bias=False)  # no q/k/v biases: no family here expresses it
    with pytest.raises(ConfigError, match="no family CTranslate2 converts expresses this model") as refused:
        ctranslate2_check.family_of(config, init_params(config, seed=0))
    assert all(layout in str(refused.value) for layout in ("hf-marian", "hf-t5", "hf-bart"))
    with pytest.raises(InputError, match="CTranslate2 is checked through the layouts"):
        ctranslate2_check.family_of(config, {}, layout="hf-mt5")
