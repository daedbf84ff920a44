"""openai-whisper's checkpoint (`{"dims": ..., "model_state_dict": ...}`, what `whisper.load_model`
reads), both ways, against openai-whisper itself.

A tiny random `whisper.model.Whisper` with every norm, bias and convolution jittered, saved as its
own checkpoint: `rosetta convert tiny.pt out.safetensors` recognises it by its two entries (no
--layout, no --set: the sizes and the padding from "dims"), gives openai-whisper's logits within
the float32 tolerance (its LayerNorm and logits are float32 whatever its dtype), and
`--to openai-whisper` writes a file that `whisper.load_model` loads with the same logits.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="openai-whisper is a PyTorch model")
whisper = pytest.importorskip("whisper", reason="openai-whisper (the test extra) is not installed")

from whisper.model import ModelDimensions, Whisper  # noqa: E402

from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import import_state_dict  # noqa: E402
from conformance.convert.bundles import from_openai_whisper, read_bundle  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import CheckpointError, ConfigError  # noqa: E402
from systems.harness import BACKEND_PARAMS, run_backend  # noqa: E402

import impl_numpy  # noqa: E402

# A real multilingual vocabulary (51865): openai-whisper's tokenizer, and so the padding, need one.
DIMS = ModelDimensions(n_mels=5, n_audio_ctx=4, n_audio_state=16, n_audio_head=2, n_audio_layer=2, n_vocab=51865,
                       n_text_ctx=8, n_text_state=16, n_text_head=2, n_text_layer=2)
SOT, EOT = 50258, 50257


def jittered(seed: int = 54) -> Whisper:
    """A random Whisper, every parameter moved off its initialisation (the decoder's position
    table is `torch.empty` in openai's __init__: drawn here) and the encoder's sinusoid buffer kept."""
    torch.manual_seed(0)
    model = Whisper(DIMS).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name == "decoder.positional_embedding":
                p.copy_(0.3 * noise)
            elif p.ndim == 1:
                p.add_(0.2 * noise)
            else:
                p.add_(0.3 * noise / math.sqrt(max(1, p[0].numel())))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the model, its checkpoint file as openai-whisper's own models are saved)."""
    model = jittered()
    path = tmp_path_factory.mktemp("openai") / "tiny.pt"
    torch.save({"dims": dataclasses.asdict(DIMS), "model_state_dict": model.state_dict()}, path)
    return model, path


def batch():
    features = np.random.default_rng(0).uniform(-1.0, 1.5, size=(2, 5, 8)).astype(np.float32)  # 2 n_audio_ctx frames
    tgt = np.array([[SOT, 3, 4, 5], [SOT, 7, 8, 9]])
    return features, tgt


def openai_logits(model, features, tgt) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(features), torch.tensor(tgt)).numpy()


def within_float32(ours: np.ndarray, theirs: np.ndarray) -> bool:
    return float(np.abs(ours - theirs).max()) <= tolerance("float32").atol * max(1.0, float(np.abs(theirs).max()))


def test_the_checkpoint_converts_with_no_layout_and_no_set(saved, tmp_path, capsys):
    model, path = saved
    out = tmp_path / "tiny.safetensors"
    assert main(["convert", str(path), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layout: openai-whisper" in printed and "switches read from tiny.pt's 'dims'" in printed
    config, params = checkpoint.load(out)
    assert (config.source, config.n_mels, config.max_source_len, config.max_len, config.d_ff) == ("features", 5, 4, 8, 64)
    assert (config.pad_id, config.key_bias, config.freeze_pad_embedding) == (EOT, False, False)
    live, _ = from_openai_whisper(model)
    assert live.replace(notes={}) == config.replace(notes={})


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_logits_match_openai_whisper_within_float32(saved, backend, tmp_path, capsys):
    """float32 is openai-whisper's own: its LayerNorm runs `x.float()` and its logits are
    `.float()` whatever the model's dtype (docs/whisper.md), so the claim is float32's."""
    model, path = saved
    out = tmp_path / "tiny.safetensors"
    assert main(["convert", str(path), str(out)]) == 0
    capsys.readouterr()
    config, params = checkpoint.load(out)
    features, tgt = batch()
    theirs = openai_logits(model, features, tgt)
    assert within_float32(run_backend(backend, config, params, features, tgt), theirs)
    assert within_float32(impl_numpy.Model(config, params, "float64")(features.astype(np.float64), tgt).logits, theirs)


def test_to_openai_whisper_writes_what_load_model_loads(saved, tmp_path, capsys):
    model, path = saved
    ckpt, back = tmp_path / "tiny.safetensors", tmp_path / "back.pt"
    assert main(["convert", str(path), str(ckpt)]) == 0
    assert main(["convert", str(ckpt), str(back), "--to", "openai-whisper"]) == 0
    assert "verified: openai-whisper 20250625 whisper.load_model: logits within" in capsys.readouterr().out
    loaded = whisper.load_model(str(back), device="cpu")
    assert loaded.dims == DIMS
    features, tgt = batch()
    np.testing.assert_array_equal(openai_logits(loaded, features, tgt), openai_logits(model, features, tgt))


def test_the_file_is_read_weights_only(saved, tmp_path):
    """A pickle is a program: the checkpoint is read by torch.load(weights_only=True), and one that
    needs more than ints and tensors (a pickled ModelDimensions) is refused before it runs."""
    model, _ = saved
    path = tmp_path / "pickled.pt"
    torch.save({"dims": DIMS, "model_state_dict": model.state_dict()}, path)  # the dataclass itself
    with pytest.raises(CheckpointError, match="refused"):
        read_bundle(path)


def test_a_bare_state_dict_needs_its_padding(saved):
    """Without "dims" only the keys say it is openai-whisper's, and they do not tell the padding."""
    model, _ = saved
    with pytest.raises(ConfigError) as raised:
        import_state_dict(model.state_dict(), n_heads=2)
    assert raised.value.field == "pad_id"
    config, _ = import_state_dict(model.state_dict(), n_heads=2, pad_id=EOT)
    assert (config.notes["converted_from"], config.pad_id, config.max_source_len) == ("openai-whisper", EOT, 4)


def test_an_export_the_system_cannot_express_is_refused(saved, tmp_path, capsys):
    model, path = saved
    ckpt = tmp_path / "tiny.safetensors"
    assert main(["convert", str(path), str(ckpt)]) == 0
    config, params = checkpoint.load(ckpt)
    other = tmp_path / "other.safetensors"
    checkpoint.save(other, config.replace(pad_id=5), params)
    capsys.readouterr()
    assert main(["convert", str(other), str(tmp_path / "out.pt"), "--to", "openai-whisper"]) != 0
    assert "pad_id" in capsys.readouterr().err


def test_a_vocabulary_without_the_tokenizers_padding_is_refused_without_advising_a_set(tmp_path, capsys):
    """openai-whisper's file holds no pad_id (its tokenizer's end of text, 50256 below 51865 ids):
    a 64-id vocabulary cannot be written as one, and `--set pad_id`, which the file's format
    refuses, is not the way out the refusal names."""
    from conformance import init_params, preset

    config = preset("hf-whisper", src_vocab_size=64, tgt_vocab_size=64, pad_id=3, d_model=16, n_heads=2, d_ff=64,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=12, max_source_len=8, n_mels=8)
    checkpoint.save(tmp_path / "w.safetensors", config, init_params(config, seed=5, dtype=np.float32))
    assert main(["convert", str(tmp_path / "w.safetensors"), str(tmp_path / "w.pt"), "--to", "openai-whisper"]) == 2
    err = capsys.readouterr().err
    assert "a vocabulary of 64 ids has no id 50256" in err and "cannot be written as one" in err, err
    assert "--set pad_id" not in err, err
    assert not (tmp_path / "w.pt").exists()


def test_compare_reads_a_live_whisper_with_its_dims(saved):
    import conformance

    model, _ = saved
    features, tgt = batch()
    report = conformance.compare(model, "openai-whisper", features, tgt, backends=())
    assert report.first_divergence is None
    assert report.told["max_source_len"] == 4 and report.told["pad_id"] == EOT
    compared = [name for (name, _), cell in report.cells.items() if cell.comparison is not None]
    assert {"encoder.embeddings", "encoder.1.ffn", "decoder.1.cross_attn", "logits"} <= set(compared)
