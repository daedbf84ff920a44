"""`rosetta convert --to onnx` checks the graphs it wrote in ONNX Runtime itself before they land
(issue 53): a planted export fault exits 1, names where the graphs first part from the float64
oracle, and leaves nothing. With --taps the first diverging tensor is named with the switches
acting there; without, the logits, and how to find the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

# One worker under `--dist loadgroup`: exports are paid once, beside the other ONNX tests.
pytestmark = pytest.mark.xdist_group("onnx")

pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")
pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
pytest.importorskip("torch", reason="the graphs are exported from impl_torch")

from breaks import planted_in_the_export  # noqa: E402
from thorough import thorough_only  # noqa: E402
from conformance import init_params  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.config import ModelConfig  # noqa: E402

CONFIG = ModelConfig(src_vocab_size=17, tgt_vocab_size=19, d_model=16, n_heads=4, d_ff=24, n_encoder_layers=1,
                     n_decoder_layers=2, max_len=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx-verify") / "model.safetensors"
    checkpoint.save(path, CONFIG, init_params(CONFIG, seed=5, dtype=np.float32))
    return path


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("taps", [True, pytest.param(False, marks=thorough_only(
    "a second planted export, without taps (tens of seconds); the graphs without taps are checked in CI by "
    "tests/runtimes/test_onnx_compare.py's export, and a planted fault by the taps variant"))], ids=["taps", "no-taps"])
def test_a_planted_export_fault_exits_1_names_the_divergence_and_leaves_nothing(saved, tmp_path, capsys, taps):
    out = tmp_path / "graphs"
    with planted_in_the_export("source mask input ignored"):
        status, printed, err = run(capsys, "convert", saved, out, "--to", "onnx", *(["--taps"] if taps else []))
    assert status == 1 and printed == "", err
    assert f"{out}: not written: onnxruntime" in err, err
    if taps:  # the graph ignores its src_mask: the encoder's first self-attention is where it shows
        assert "first diverging tensor encoder.0.self" in err and "src_pad_mask" in err, err
    else:
        assert "first diverging tensor logits" in err and "--backends numpy,onnxruntime" in err, err
    assert list(tmp_path.iterdir()) == [], "a failed check left the graphs (or their staging) behind"
