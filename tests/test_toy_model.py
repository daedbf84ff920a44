"""The built-in default: a trained digit-reversal model, greedy decoding in every backend, pictures."""

import struct

import numpy as np
import pytest

import impl_numpy
from conformance import InputError, backends, checkpoint, toy
from conformance.backends import Target
from conformance.cli import main
from conformance.compare import to_numpy
from conformance.defaults import DEFAULT_CHECKPOINT, default_model


def test_the_default_checkpoint_is_shipped_small_and_self_describing():
    assert DEFAULT_CHECKPOINT.exists(), "run examples/train_toy.py to create it"
    assert DEFAULT_CHECKPOINT.stat().st_size <= 2_000_000
    config, params = checkpoint.load(DEFAULT_CHECKPOINT)
    assert config.notes["task"] == toy.TASK
    assert config.tgt_vocab_size == toy.VOCAB_SIZE and config.pad_id == toy.PAD
    assert default_model()[2].startswith("built-in default")


@pytest.fixture(scope="module")
def generated():
    """Greedy outputs of every installed backend on the held-out set (float32, CPU)."""
    config, params, _ = default_model()
    src = toy.held_out()
    results = {}
    for name, reason in backends.availability().items():
        if reason:
            continue
        model = backends.build(Target(name, "cpu", "float32"), config, params)
        if name == "jax":  # bound the compiles: one per bucket, not one per prefix length
            import impl_jax

            model = impl_jax.Model(config, params, dtype="float32", buckets=(4, 8, 16))
        results[name] = to_numpy(model.generate(src, max_len=config.max_len, bos_id=toy.BOS, eos_id=toy.EOS))
    return src, results


def test_trained_default_reaches_95_percent_on_held_out_inputs(generated):
    src, results = generated
    for name, tokens in results.items():
        accuracy = toy.exact_match(tokens, src)
        assert accuracy >= 0.95, f"{name}: held-out exact match {accuracy:.3f} < 0.95"


def test_every_backend_decodes_identical_tokens(generated):
    src, results = generated
    assert "numpy" in results and len(results) >= 2, f"only {sorted(results)} installed"
    reference = results["numpy"]
    for name, tokens in results.items():
        assert tokens.shape == reference.shape, name
        rows = np.flatnonzero((tokens != reference).any(axis=1))
        assert rows.size == 0, f"{name} decodes differently from numpy in {rows.size} rows, first {rows[:1]}"


def test_generate_refuses_bad_arguments():
    config, params, _ = default_model()
    model = impl_numpy.Model(config, params)
    src = np.array([toy.encode_text("123")])
    for kwargs, argument in ((dict(max_len=0), "max_len"), (dict(max_len=config.max_len + 1), "max_len"),
                             (dict(bos_id=-1), "bos_id"), (dict(eos_id=config.tgt_vocab_size), "eos_id")):
        call = dict(max_len=5, bos_id=toy.BOS, eos_id=toy.EOS) | kwargs
        with pytest.raises(InputError) as info:
            model.generate(src, **call)
        assert info.value.argument == argument


def test_rosetta_generate_prints_the_reversal(capsys):
    for backend in ("numpy", "torch", "jax"):
        if backends.availability([backend])[backend]:
            continue
        assert main(["generate", "--src", "3 1 4 1 5", "--backend", backend]) == 0
        assert capsys.readouterr().out.strip() == "5 1 4 1 3", backend


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_rosetta_attention_draws_every_layer_and_head(tmp_path, capsys):
    out = tmp_path / "attn.png"
    assert main(["attention", "--src", "3 1 4 1 5 9", "--out", str(out)]) == 0
    config, _, _ = default_model()
    blocks = config.n_encoder_layers + 2 * config.n_decoder_layers
    # One 2.6-inch panel per head and block at 100 dpi, plus a margin.
    assert png_size(out) == (int((2.6 * config.n_heads + 0.6) * 100), int((2.6 * blocks + 0.6) * 100))
    assert "blocks" in capsys.readouterr().out


def test_rosetta_check_plot_draws_the_errors(tmp_path):
    out = tmp_path / "check.png"
    assert main(["check", "--backends", "numpy", "--plot", str(out)]) == 0
    width, height = png_size(out)
    assert height == 480 and width >= 800
