"""Whisper in transformers (`WhisperForConditionalGeneration`), against transformers itself.

A tiny random model with every norm, bias and convolution jittered, saved with `save_pretrained`:
it converts with no --set (every size and switch from config.json), gives transformers' logits in
float64 (NumPy) and within the float32 tolerance in each backend, its float64 `loss_and_grads`
equals transformers' autograd on a padded batch, and `--to hf-whisper` writes a folder that
`from_pretrained` loads with the same logits. The FlaxWhisper (transformers 4.x) msgpack fixture
converts with Flax's logits. Log-mel features have no padding; the decoder rows are padded.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers' Whisper is a PyTorch model")
transformers = pytest.importorskip("transformers", reason="the model is built by transformers")

from pathlib import Path  # noqa: E402

from conformance.check.tolerances import gradient_tolerance, tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import export_state_dict, from_hf, from_hf_folder  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import ConfigError  # noqa: E402
from systems.harness import BACKEND_PARAMS, run_backend  # noqa: E402

import impl_numpy  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]
FLAX_FIXTURE = ROOT / "tests" / "fixtures" / "hf_flax" / "whisper"
# 4 encoder positions (8 frames) beside 10 decoder positions: the two tables differ in length.
SIZES = dict(vocab_size=60, num_mel_bins=5, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=4,
             max_target_positions=10, pad_token_id=59, bos_token_id=58, eos_token_id=59, decoder_start_token_id=58)


def jitter_(model, seed: int) -> None:
    """Every parameter moved off its initialisation (norm scales around 1, biases around 0, every
    weight by 0.1 / sqrt(fan_in)), the encoder's sinusoid table included: a swapped scale and bias,
    a dropped bias or a table read the wrong way round changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.ndim == 1:
                p.add_(0.2 * noise)
            else:
                p.add_(0.3 * noise / math.sqrt(max(1, p[0].numel())))


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(the transformers model in float64, its save_pretrained folder)."""
    config = transformers.WhisperConfig(**SIZES, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    jitter_(model, 54)
    folder = tmp_path_factory.mktemp("whisper") / "tiny-whisper"
    model.save_pretrained(folder)
    return model.double(), folder


def batch():
    """Features (2, 5, 8): transformers takes exactly 2 * max_source_positions frames. Target rows:
    one real, one padded at the end (transformers' decoder is causal, as ours with tgt_pad_mask none)."""
    features = np.random.default_rng(0).uniform(-1.0, 1.5, size=(2, 5, 8))
    tgt = np.array([[58, 3, 4, 5, 6], [58, 7, 8, 59, 59]])
    return features, tgt


def hf_logits(model, features, tgt) -> np.ndarray:
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return model(input_features=torch.tensor(features, dtype=dtype), decoder_input_ids=torch.tensor(tgt)).logits.numpy()


def test_a_saved_folder_converts_with_no_set_and_so_does_the_live_model(whisper, tmp_path, capsys):
    model, folder = whisper
    out = tmp_path / "tiny.safetensors"
    assert main(["convert", str(folder), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layout: hf-whisper" in printed and "every logit finite" in printed
    config, _ = checkpoint.load(out)
    assert (config.source, config.n_mels, config.max_source_len, config.max_len) == ("features", 5, 4, 10)
    assert (config.key_bias, config.qkv_bias, config.position, config.pad_id) == (False, True, "table", 59)
    live, _ = from_hf(model)
    assert live.replace(notes={}) == config.replace(notes={})


def test_float64_logits_equal_transformers(whisper):
    model, folder = whisper
    config, params = from_hf_folder(folder)
    features, tgt = batch()
    ours = impl_numpy.Model(config, params, "float64")(features, tgt).logits
    assert np.abs(ours - hf_logits(model, features, tgt)).max() < 1e-12


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_float32_backends_match_transformers(whisper, backend):
    model, folder = whisper
    config, params = from_hf_folder(folder)
    features, tgt = batch()
    theirs = hf_logits(model, features, tgt)
    ours = run_backend(backend, config, params, features.astype(np.float32), tgt)
    tol = tolerance("float32")
    assert np.abs(ours - theirs).max() <= tol.atol * max(1.0, np.abs(theirs).max())


def test_float64_gradients_equal_transformers_autograd(whisper):
    """loss_and_grads against transformers' own loss (labels padded with -100 there, pad_id here)
    and autograd, every parameter, the encoder's frozen sinusoid table included (its gradient
    asked for explicitly: transformers sets requires_grad False on it)."""
    model, folder = whisper
    config, params = from_hf_folder(folder, dtype="float64")
    features, tgt = batch()
    labels = np.array([[3, 4, 5, 6, 59], [7, 8, 59, 59, 59]])  # the pad id: not counted
    loss, grads = impl_numpy.Model(config, params).loss_and_grads(features, tgt, labels)

    model.zero_grad()
    model.model.encoder.embed_positions.weight.requires_grad_(True)
    try:
        out = model(input_features=torch.tensor(features), decoder_input_ids=torch.tensor(tgt),
                    labels=torch.tensor(np.where(labels == config.pad_id, -100, labels)))
        out.loss.backward()
        theirs = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
    finally:
        model.model.encoder.embed_positions.weight.requires_grad_(False)
    ours = export_state_dict(config, grads, "hf-whisper")  # our gradients under transformers' names
    tol = gradient_tolerance("float64")
    assert abs(float(loss) - out.loss.item()) <= tol.atol
    assert set(ours) - {"proj_out.weight"} <= set(theirs)
    for name, value in ours.items():
        if name == "proj_out.weight":  # tied: its gradient is in the token table's
            continue
        scale = max(1.0, float(np.abs(theirs[name]).max()))
        assert np.abs(value - theirs[name]).max() <= tol.atol * scale, name


def test_export_folder_loads_in_transformers_with_the_same_logits(whisper, tmp_path, capsys):
    model, folder = whisper
    ckpt = tmp_path / "tiny.safetensors"
    assert main(["convert", str(folder), str(ckpt)]) == 0
    out = tmp_path / "exported"
    assert main(["convert", str(ckpt), str(out), "--to", "hf-whisper"]) == 0
    capsys.readouterr()
    back = transformers.WhisperForConditionalGeneration.from_pretrained(out).double().eval()
    features, tgt = batch()
    config, params = checkpoint.load(ckpt)
    ours = impl_numpy.Model(config, params, "float64")(features, tgt).logits
    assert np.abs(hf_logits(back, features, tgt) - ours).max() < 1e-12
    written = json.loads((out / "config.json").read_text())
    assert (written["max_source_positions"], written["max_target_positions"], written["num_mel_bins"]) == (4, 10, 5)


def test_a_sharded_safetensors_folder_converts(whisper, tmp_path):
    model, folder = whisper
    sharded = tmp_path / "sharded"
    model.float().save_pretrained(sharded, max_shard_size="20KB")
    model.double()
    assert (sharded / "model.safetensors.index.json").is_file()
    a, pa = from_hf_folder(folder)
    b, pb = from_hf_folder(sharded)
    assert a.replace(notes={}) == b.replace(notes={})
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_the_flax_msgpack_fixture_converts_with_flax_logits():
    """FlaxWhisperForConditionalGeneration (transformers 4.46.3) saved as flax_model.msgpack: no
    --set, and Flax's float64 logits where the decoder input is real (with a decoder mask, Flax
    numbers its padded positions -1, which reads the table's last row: tests/fixtures/hf_flax/whisper)."""
    config, params = from_hf_folder(FLAX_FIXTURE)
    reference = np.load(FLAX_FIXTURE / "reference.npz")
    real = reference["decoder_attention_mask"].astype(bool)
    features, tgt = reference["input_features"], reference["decoder_input_ids"]
    ours = impl_numpy.Model(config, params, "float64")(features.astype(np.float64), tgt).logits
    assert np.abs(ours - reference["logits_float64"])[real].max() < 1e-12
    ours32 = run_backend("torch", config, params, features, tgt)
    tol = tolerance("float32")
    assert np.abs(ours32 - reference["logits"])[real].max() <= tol.atol * max(1.0, np.abs(reference["logits"]).max())
    assert json.loads(config.notes["generation"])["forced_decoder_ids"] == [[1, None], [2, 50]]


def test_what_the_layout_cannot_express_is_named(whisper, tmp_path):
    model, folder = whisper
    untied = tmp_path / "untied"
    untied.mkdir()
    for name in ("model.safetensors", "generation_config.json"):
        (untied / name).write_bytes((folder / name).read_bytes())
    data = json.loads((folder / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**data, "tie_word_embeddings": False}))
    with pytest.raises(ConfigError) as raised:
        from_hf_folder(untied)
    assert raised.value.field == "tie_output"


def test_compare_reads_a_live_whisper_with_its_config(whisper):
    import conformance

    model, _ = whisper
    features, tgt = batch()
    report = conformance.compare(model, "hf-whisper", features, tgt, backends=(),
                                 run=lambda m, s, t: m(input_features=s, decoder_input_ids=t, output_attentions=True))
    assert report.first_divergence is None
    assert report.told["max_source_len"] == 4 and report.told["n_mels"] == 5
    compared = [name for (name, _), cell in report.cells.items() if cell.comparison is not None]
    assert "encoder.embeddings" in compared and "decoder.0.cross" in compared and "logits" in compared
