"""A real OpenNMT-py 3.5 checkpoint converts with no --set, and gives OpenNMT-py's own logits (issue 53).

tests/fixtures/opennmt_py/ was made by tests/fixtures/make_opennmt_fixture.py in a throwaway venv
with OpenNMT-py 3.5.1: its ModelSaver's .pt ({"model", "generator", "vocab", "opt": an
argparse.Namespace, "optim"}), and OpenNMT-py's own float32 and float64 logits (its translator's
loader, `load_test_model`, then `model.generator(dec_out)`) on a right-padded batch, in
reference.npz. OpenNMT-py is not installed here: the test holds our backends to those numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the checkpoint is a PyTorch file")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the shared helpers beside the rooms

from conformance.check.compare import compare  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import read_state_dict  # noqa: E402
from conformance.convert.readers import read_source  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import CheckpointError, ConfigError  # noqa: E402
from systems.harness import BACKEND_PARAMS, run_backend  # noqa: E402

import impl_numpy  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "opennmt_py"
CHECKPOINT = FIXTURE / "model_step_1.pt"
REFERENCE = np.load(FIXTURE / "reference.npz")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("onmt") / "onmt.safetensors"
    assert main(["convert", str(CHECKPOINT), str(out)]) == 0
    return checkpoint.load(out)


def test_converts_with_no_set_reading_opt_and_the_vocabularies(converted, capsys):
    config, params = converted
    assert config.notes["converted_from"] == "opennmt-py"
    assert (config.n_heads, config.d_model, config.d_ff, config.n_encoder_layers, config.n_decoder_layers) == (2, 8, 16, 2, 2)
    assert (config.src_vocab_size, config.tgt_vocab_size, config.max_len) == (24, 32, 5000)  # padded to multiples of 8
    assert config.norm_placement == "pre" and config.final_encoder_norm and config.final_decoder_norm
    assert not (config.qkv_bias or config.out_proj_bias or config.ffn_bias or config.share_embeddings or config.tie_output)
    assert config.output_bias and config.position == "table" and config.mask_fill == -1e18 and config.pad_id == 1
    assert config.layer_norm_eps == 1e-6 and config.tgt_pad_mask == "keys" and config.scale_embedding
    generation = json.loads(config.notes["generation"])
    assert generation == {"bos_token_id": 2, "decoder_start_token_id": 2, "eos_token_id": 3, "pad_token_id": 1}
    assert (int(REFERENCE["pad_id"]), int(REFERENCE["bos_id"]), int(REFERENCE["eos_id"])) == (1, 2, 3)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_float32_logits_equal_opennmt_pys_own(converted, backend):
    config, params = converted
    ours = run_backend(backend, config, params, REFERENCE["src"], REFERENCE["tgt"])
    result = compare(ours, REFERENCE["logits_float32"], tolerance("float32"))
    assert result.passed, f"{backend}: {result.describe()}"


def test_float64_logits_equal_opennmt_pys_up_to_its_float32_softmax(converted):
    """OpenNMT-py's attention computes `scores.float()` and the softmax in float32 whatever the
    model's dtype: its float64 logits are ours up to float32 rounding of the attention weights
    (measured 7.7e-8 here), and nowhere near a switch's error (a wrong one is 1e-2 and more)."""
    config, params = converted
    ours = impl_numpy.Model(config, {k: v.astype(np.float64) for k, v in params.items()}, dtype="float64")(
        REFERENCE["src"], REFERENCE["tgt"]).logits
    error = np.abs(ours - REFERENCE["logits_float64"]).max()
    assert error <= 1e-6, error
    assert error > 1e-12, "the float32 island is gone: OpenNMT-py's float64 forward changed?"
    wrong = impl_numpy.Model(config.replace(scale_embedding=False), {k: v.astype(np.float64) for k, v in params.items()},
                             dtype="float64")(REFERENCE["src"], REFERENCE["tgt"]).logits
    assert np.abs(wrong - REFERENCE["logits_float64"]).max() > 1e-2


def test_the_unpickler_builds_only_the_classes_the_file_needs(tmp_path):
    """The file's opt is an argparse.Namespace: PyTorch's restricted unpickler is allowed exactly
    that class, because the opennmt-py layout's [checkpoint] names it; a file that needs any other
    class is refused before anything of it runs, naming the class."""
    assert sorted(torch.serialization.get_unsafe_globals_in_checkpoint(CHECKPOINT)) == ["argparse.Namespace"]
    arrays = read_state_dict(CHECKPOINT)
    assert "generator.weight" in arrays and "encoder.embeddings.make_embedding.pe.pe" in arrays
    with torch.serialization.safe_globals([argparse.Namespace]):
        original = torch.load(CHECKPOINT, weights_only=True)
    crafted = dict(original, extra=Crafted())
    torch.save(crafted, tmp_path / "crafted.pt")
    with pytest.raises(CheckpointError, match="refused") as refused:
        read_state_dict(tmp_path / "crafted.pt")
    assert "Crafted" in str(refused.value) and not Crafted.built


def test_an_option_the_layout_cannot_express_is_named(tmp_path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        original = torch.load(CHECKPOINT, weights_only=True)
    opt = argparse.Namespace(**vars(original["opt"]))
    opt.max_relative_positions = 20
    torch.save(dict(original, opt=opt), tmp_path / "relative.pt")
    with pytest.raises(ConfigError, match="max_relative_positions=20") as info:
        read_source(tmp_path / "relative.pt")
    assert info.value.field == "position"


class Crafted:
    built = False

    def __setstate__(self, state):
        Crafted.built = True  # would run on unpickling: it must never be reached


def test_the_fixture_script_checked_the_taps_and_the_island_against_opennmt_py():
    """make_opennmt_fixture.py ran `conformance.compare` on OpenNMT-py's own model (where
    OpenNMT-py is installed): every tapped tensor agreed in float32, and in float64 every tensor
    after the first attention sat at float32 rounding, labelled as the layout's island. Its reports
    are kept beside the checkpoint; this reads what they recorded."""
    float64 = (FIXTURE / "compare_float64.txt").read_text()
    float32 = (FIXTURE / "compare_float32.txt").read_text()
    assert float64.rstrip().endswith("result: ok") and float32.rstrip().endswith("result: ok")
    assert "logits: float32 island in the attention softmax: expected" in float64
    assert "not exposed" not in float64 and "not exposed" not in float32
