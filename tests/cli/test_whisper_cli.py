"""The command line with a features source (Whisper): rosetta check's built-in features batch and
`--src features.npy` for check, generate and attention, and a bad --src named by its flag."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cli import main
from conformance.core import checkpoint
from conformance.core.config import ModelConfig
from conformance.core.params import init_params

import impl_numpy

CONFIG = ModelConfig(source="features", n_mels=3, max_source_len=8, max_len=8, src_vocab_size=20, tgt_vocab_size=20,
                     d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, norm_placement="pre",
                     final_encoder_norm=True, final_decoder_norm=True, position="table", key_bias=False,
                     activation="gelu", tie_output=True, output_bias=False, tgt_pad_mask="none", pad_id=0)


@pytest.fixture
def whisper(tmp_path):
    """(a features checkpoint, a .npy of log-mel features (2, n_mels, 10 frames) for it)."""
    path = tmp_path / "whisper.safetensors"
    checkpoint.save(path, CONFIG, init_params(CONFIG, dtype=np.float32))
    features = tmp_path / "features.npy"
    np.save(features, np.random.default_rng(0).standard_normal((2, 3, 10)).astype(np.float32))
    return path, features


def test_check_runs_a_built_in_features_batch(whisper, capsys):
    path, _ = whisper
    assert main(["check", str(path), "--backends", "numpy", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "encoder.conv1" in out and "encoder.conv2" in out and "every backend agrees" in out


def test_check_takes_features_from_src(whisper, capsys):
    path, features = whisper
    assert main(["check", str(path), "--backends", "numpy", "--dtypes", "float32", "--src", str(features),
                 "--tgt", "1,2,3;4,5,0"]) == 0
    assert "every backend agrees" in capsys.readouterr().out


def test_generate_and_attention_take_features_from_src(whisper, tmp_path, capsys):
    path, features = whisper
    assert main(["generate", str(path), "--src", str(features), "--bos", "1", "--eos", "2", "--max-len", "4"]) == 0
    printed = capsys.readouterr().out.split("\n")
    config, params = checkpoint.load(path)
    expected = impl_numpy.Model(config, params).generate(np.load(features), 4, 1, 2)
    assert printed[0].split() == [str(int(i)) for i in expected[0] if i != config.pad_id]
    picture = tmp_path / "attention.png"
    assert main(["attention", str(path), "--src", str(features), "--tgt", "1,2,3;4,5,6", "--out", str(picture)]) == 0
    assert picture.stat().st_size > 0


@pytest.mark.parametrize("given, words", [
    ("1,2,3;4,5,6", "a .npy file of log-mel features"),
    ("odd.npy", "frames=9 is odd"),
])
def test_a_bad_features_source_is_named_by_its_flag(whisper, tmp_path, given, words, capsys):
    path, _ = whisper
    if given.endswith(".npy"):
        np.save(tmp_path / given, np.zeros((2, 3, 9), dtype=np.float32))
        given = str(tmp_path / given)
    assert main(["check", str(path), "--backends", "numpy", "--src", given]) != 0
    err = capsys.readouterr().err
    assert "--src" in err and words in err
