"""A fairseq transformer_wmt_en_de checkpoint converts with no --set, and gives fairseq's own logits (issue 53).

tests/fixtures/fairseq/ was made by tests/fixtures/make_fairseq_fixture.py in a throwaway venv:
`fairseq-preprocess` and `fairseq-train --arch transformer_wmt_en_de` (30 updates, tiny sizes), the
checkpoint fairseq wrote ({"args": None, "cfg": {..., "model": argparse.Namespace}, "model",
"optimizer_history", ...}), and fairseq's own float32 and float64 logits on a batch padded as
fairseq pads it (sources on the left), in reference.npz. fairseq 0.12.2 does not install on Python
3.11; the venv holds the fairseq-fixed 0.12.3.1 packaging of it (the script's docstring says why).
fairseq is not installed here: the test holds our backends to those numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the checkpoint is a PyTorch file")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the shared helpers beside the rooms

from conformance.check.compare import compare  # noqa: E402
from conformance.check.tolerances import ISLAND, tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from systems.harness import BACKEND_PARAMS, run_backend  # noqa: E402

import impl_numpy  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "fairseq"
REFERENCE = np.load(FIXTURE / "reference.npz")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("fairseq") / "fairseq.safetensors"
    assert main(["convert", str(FIXTURE / "checkpoint_last.pt"), str(out)]) == 0
    return checkpoint.load(out)


def test_converts_with_no_set_reading_cfg_model(converted):
    config, _ = converted
    assert config.notes["converted_from"] == "fairseq-transformer"
    assert (config.n_heads, config.d_model, config.d_ff, config.max_len) == (2, 16, 32, 64)
    assert (config.src_vocab_size, config.tgt_vocab_size) == (24, 32)  # fairseq's dictionaries, padded to 8
    assert config.norm_placement == "post" and not (config.final_encoder_norm or config.share_embeddings or config.tie_output)
    assert config.position == "sinusoid-fairseq" and config.position_offset == 2 and config.position_ids == "non-pad"
    assert config.mask_fill == float("-inf") and config.tgt_pad_mask == "keys" and config.pad_id == int(REFERENCE["pad_id"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_float32_logits_equal_fairseqs_own_on_left_padded_sources(converted, backend):
    config, params = converted
    ours = run_backend(backend, config, params, REFERENCE["src"], REFERENCE["tgt"])
    result = compare(ours, REFERENCE["logits_float32"], tolerance("float32"))
    assert result.passed, f"{backend}: {result.describe()}"


def test_float64_logits_equal_fairseqs_up_to_its_float32_sinusoid(converted):
    """fairseq builds its sinusoid with torch float32 kernels in a float64 model: the float64 logits
    are ours to float32 rounding (the layout's island), far from a switch's error."""
    config, params = converted
    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    ours = impl_numpy.Model(config, params64, dtype="float64")(REFERENCE["src"], REFERENCE["tgt"]).logits
    assert compare(ours, REFERENCE["logits_float64"], ISLAND).passed
    wrong = impl_numpy.Model(config.replace(position_offset=0), params64, dtype="float64")(REFERENCE["src"],
                                                                                          REFERENCE["tgt"]).logits
    assert not compare(wrong, REFERENCE["logits_float64"], tolerance("float32")).passed


def test_the_fixture_script_checked_the_taps_and_the_island_against_fairseq():
    """make_fairseq_fixture.py ran `conformance.compare` on fairseq's own model; its reports are kept."""
    float64 = (FIXTURE / "compare_float64.txt").read_text()
    float32 = (FIXTURE / "compare_float32.txt").read_text()
    assert float64.rstrip().endswith("result: ok") and float32.rstrip().endswith("result: ok")
    assert "logits: float32 island in the sinusoid table: expected" in float64
