"""`rosetta check CHECKPOINT --backends numpy,ctranslate2` on a model CTranslate2 cannot hold.

Any other target that cannot run here (a backend not installed, a device not present) is reported
as skipped, with the reason, while the rest runs; CTranslate2 is the same: the tensor table runs,
CTranslate2 is listed among the skipped targets with why, and the exit status is the table's. With
CTranslate2 alone, nothing was checked: exit 1, as for any check that checked nothing.
"""

from __future__ import annotations

import json

from conformance import checkpoint, init_params, preset
from conformance.cli import main

# One vocabulary for source and target is all CTranslate2's loaders register: a model with two
# sizes is one none of its families holds, whatever families it learns to convert.
CONFIG = preset("paper", share_embeddings=False, tie_output=False, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, src_vocab_size=20,
                tgt_vocab_size=24, max_len=16)


def test_a_model_ctranslate2_cannot_hold_is_skipped_and_the_rest_runs(tmp_path, capsys):
    path = tmp_path / "two-vocabularies.safetensors"
    checkpoint.save(path, CONFIG, init_params(CONFIG, seed=0))
    out = tmp_path / "check.json"
    status = main(["check", str(path), "--backends", "numpy,ctranslate2", "--dtypes", "float32", "--json", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err
    lines = captured.out.splitlines()
    skipped = next(line for line in lines if line.startswith("ctranslate2 "))
    assert "skipped: " in skipped and ("CTranslate2" in skipped.split("skipped: ", 1)[1]), skipped  # with why
    assert any(line.startswith("numpy/cpu/float32") and line.endswith("pass") for line in lines)
    assert "nothing checked" not in captured.out
    report = json.loads(out.read_text())
    assert report["passed"] and "ctranslate2" in report["skipped"]


def test_ctranslate2_alone_on_such_a_model_checked_nothing(tmp_path, capsys):
    path = tmp_path / "two-vocabularies.safetensors"
    checkpoint.save(path, CONFIG, init_params(CONFIG, seed=0))
    assert main(["check", str(path), "--backends", "ctranslate2"]) == 1
    text = capsys.readouterr().out
    assert "ctranslate2              skipped: " in text and "ctranslate2: nothing checked" in text
