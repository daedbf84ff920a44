"""Every runtime check of `rosetta convert` reads every position the model takes (up to
`verify.LONGEST`), not only the seven of `fixed_batch`'s padded rows: a second batch, one row with
no padding as long as the model takes (`conformance.formats.verify.probes`). A fault in a position
table's later rows (CTranslate2's BART, ONNX's graphs) used to land verified.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.cli import main
from conformance.core import checkpoint
from conformance.formats import verify
from thorough import thorough_only


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("family, max_len", [("hf-bart", 40), ("hf-whisper", 24), ("hf-bart", 4 * verify.LONGEST)])
def test_the_probes_read_every_position_up_to_the_cap(family, max_len):
    sizes = dict(src_vocab_size=19, tgt_vocab_size=19, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                 n_decoder_layers=1, max_len=max_len)
    config = preset(family, **sizes, **({"n_mels": 4} if family == "hf-whisper" else {}))
    batches = verify.probes(config)
    longest = min(max_len, verify.LONGEST)
    (short, *_), (what, src, tgt) = batches
    assert short == verify.PROBE and len(batches) == 2
    assert tgt.shape == (1, longest) and (tgt != config.pad_id).all(), "the long row has no padding"
    if family == "hf-whisper":  # a features source: the whole window, as the encoders take it
        assert src.shape == (1, config.n_mels, 2 * config.source_len) and what == f"a row of {longest} target tokens"
    else:
        assert src.shape == (1, longest) and (src != config.pad_id).all() and what == f"a row of {longest} tokens"
    # a runtime that adds tokens of its own asks for less (CTranslate2: the decoder's start token)
    assert verify.probes(config, target=longest - 1)[1][2].shape == (1, longest - 1)


def test_a_short_model_needs_no_second_batch():
    config = preset("hf-bart", src_vocab_size=19, tgt_vocab_size=19, d_model=8, n_heads=2, d_ff=8,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=6)
    assert [what for what, _, _ in verify.probes(config)] == [verify.PROBE]


def test_ctranslate2_a_fault_in_the_later_rows_of_a_position_table_is_found(tmp_path, capsys, monkeypatch):
    """BART's decoder table zeroed from row 20 (position 18) on its way to CTranslate2's converter:
    the padded rows never reach it; the long row does, and the failure names the position and the
    switches that act by position."""
    pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed")
    pytest.importorskip("transformers", reason="CTranslate2's converter loads the folder with transformers")
    from conformance.check.ctranslate2 import target

    config, params = target.example_model(seed=0, layout="hf-bart")
    assert config.max_len > 20 and config.position_offset == 2
    path = tmp_path / "bart.safetensors"
    checkpoint.save(path, config, params)
    write = target.write

    def planted(ctranslate2, config, params, out, quantization, family):
        broken = dict(params)
        broken["decoder.position.table"] = np.array(params["decoder.position.table"])
        broken["decoder.position.table"][20:] = 0.0
        return write(ctranslate2, config, broken, out, quantization, family)

    monkeypatch.setattr(target, "write", planted)
    status, printed, err = run(capsys, "convert", path, tmp_path / "ct2", "--to", "ctranslate2")
    assert status == 1 and printed == "", err
    assert "on a row of" in err and "log p beyond" in err and "from position 18" in err, err
    assert "positions 0-17 agree, so what acts by position differs: position, position_offset" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bart.safetensors"]


@thorough_only("a third ONNX export (tens of seconds); the long row's machinery is shared with the CTranslate2 "
               "variant above, and tests/runtimes/test_onnx_verify_on_write.py plants an export fault in CI")
def test_onnx_a_fault_in_the_later_rows_of_a_position_table_is_found(tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")
    pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
    from conformance.check.onnx import export

    config = preset("hf-bart", src_vocab_size=19, tgt_vocab_size=19, d_model=16, n_heads=2, d_ff=16,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=24, pad_id=1)
    path = tmp_path / "bart.safetensors"
    checkpoint.save(path, config, init_params(config, seed=0, dtype=np.float32))
    export_bytes = export.export_bytes

    def planted(config, params, *args, **kwargs):
        broken = dict(params)
        broken["decoder.position.table"] = np.array(params["decoder.position.table"])
        broken["decoder.position.table"][12:] = 0.0  # positions 10 and later
        return export_bytes(config, broken, *args, **kwargs)

    monkeypatch.setattr(export, "export_bytes", planted)
    status, printed, err = run(capsys, "convert", path, tmp_path / "graphs", "--to", "onnx")
    assert status == 1 and printed == "", err
    assert "on a row of 24 tokens, first diverging tensor logits" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bart.safetensors"]
