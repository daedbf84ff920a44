"""`rosetta generate --src "5,6,2;9,2"`: rows of different lengths are padded with the
checkpoint's pad id, and stderr says which rows and with which id (issue 56, item 11)."""

from __future__ import annotations

import numpy as np

from conformance import init_params, preset
from conformance.check import backends
from conformance.check.compare import to_numpy
from conformance.cli import main
from conformance.core import checkpoint


def saved(tmp_path):
    config = preset("paper", src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1,
                    n_decoder_layers=1, max_len=8, pad_id=3)
    params = init_params(config, seed=2, dtype=np.float32)
    path = tmp_path / "model.safetensors"
    checkpoint.save(path, config, params)
    return config, params, path


def test_ragged_rows_are_padded_with_the_checkpoints_pad_id(tmp_path, capsys):
    """Before: "rows have different lengths in '5,6,2;9,2;7'; pad them with the pad id", no id named."""
    config, params, path = saved(tmp_path)
    assert main(["generate", str(path), "--src", "5,6,2;9,2;7", "--bos", "1", "--eos", "2", "--max-len", "4"]) == 0
    out, err = capsys.readouterr()
    assert "--src rows 1, 2 padded with the pad id 3 to 3 ids" in err, err
    model = backends.build(backends.Target("numpy", "cpu", "float32"), config, params)
    ids = to_numpy(model.generate(np.array([[5, 6, 2], [9, 2, 3], [7, 3, 3]]), 4, 1, 2))
    expected = [" ".join(str(int(t)) for t in (row[: np.flatnonzero(row == 2)[0]] if (row == 2).any() else row))
                for row in ids]
    assert out.splitlines() == expected, (out, expected)


def test_rectangular_rows_are_not_said_to_be_padded(capsys):
    assert main(["generate", "--src", "5,6,2;9,2,4"]) == 0
    assert "padded" not in capsys.readouterr().err


def test_a_command_that_does_not_pad_names_the_pad_id(tmp_path, capsys):
    """`rosetta run` takes the batch as given: ragged rows are refused, naming the pad id to pad them with."""
    _, _, path = saved(tmp_path)
    assert main(["run", str(path), "--backend", "numpy", "--src", "1,2;4", "--tgt", "1,2;1,2", "--out",
                 str(tmp_path / "run.npz")]) == 2
    assert "pad them with the model's pad id, 3" in capsys.readouterr().err
