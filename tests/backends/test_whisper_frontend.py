"""A features source (Whisper's front end) in every backend: its equations, its errors, its mask.

The suite compares the three backends with the oracle on drawn features configs; these tests pin
what the suite takes as given: the oracle's front end is PyTorch's own Conv1d and exact GELU (what
openai-whisper and transformers run), a key bias is invisible (why Whisper has none), bad features
get the same typed error, word for word, from every backend, and a source mask over the encoder's
positions means the same everywhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError, InputError
from conformance.core.params import init_params
from systems.harness import BACKEND_PARAMS

import impl_numpy

# Whisper's switches at a tiny size: 6 encoder positions (12 frames) beside 8 decoder positions.
CONFIG = ModelConfig(source="features", n_mels=3, max_source_len=6, max_len=8, src_vocab_size=20, tgt_vocab_size=20,
                     d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, norm_placement="pre",
                     final_encoder_norm=True, final_decoder_norm=True, position="table", key_bias=False,
                     activation="gelu", tie_output=True, output_bias=False, tgt_pad_mask="none", pad_id=0)
TGT = np.array([[1, 2, 3], [4, 5, 0]])


def features(frames: int = 8, batch: int = 2, mels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, mels, frames))


def build(backend: str, config: ModelConfig = CONFIG, params=None, dtype: str = "float64"):
    from conformance.check import backends

    target = backends.Target(backend, "cpu", dtype)
    return target, backends.build(target, config, params if params is not None else init_params(config))


def test_the_oracles_front_end_is_torchs_conv1d_and_exact_gelu():
    """openai-whisper's AudioEncoder and transformers' WhisperEncoder: gelu(conv1(x)), gelu(conv2(.)),
    Conv1d(k=3, padding=1), the second with stride 2; our kernel (3, C_in, C_out) is theirs reversed."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    params = init_params(CONFIG)
    x = features(frames=12)
    out = impl_numpy.Model(CONFIG, params)(x, TGT)
    conv1 = torch.nn.Conv1d(3, 16, kernel_size=3, padding=1).double()
    conv2 = torch.nn.Conv1d(16, 16, kernel_size=3, stride=2, padding=1).double()
    with torch.no_grad():
        for conv, name in ((conv1, "conv1"), (conv2, "conv2")):
            conv.weight.copy_(torch.tensor(params[f"encoder.frontend.{name}.weight"].transpose(2, 1, 0)))
            conv.bias.copy_(torch.tensor(params[f"encoder.frontend.{name}.bias"]))
        h1 = F.gelu(conv1(torch.tensor(x)))  # (B, D, F)
        h2 = F.gelu(conv2(h1))  # (B, D, F / 2)
    np.testing.assert_allclose(out.intermediates["encoder.conv1"], h1.numpy().transpose(0, 2, 1), rtol=0, atol=1e-13)
    np.testing.assert_allclose(out.intermediates["encoder.conv2"], h2.numpy().transpose(0, 2, 1), rtol=0, atol=1e-13)
    # No embedding scale on a features source (transformers computes embed_scale and never applies it).
    table = params["encoder.position.table"][:6]
    expected = h2.numpy().transpose(0, 2, 1) + table
    np.testing.assert_allclose(out.intermediates["encoder.embeddings"], expected, rtol=0, atol=1e-13)
    scaled = CONFIG.replace(scale_embedding=True)
    again = impl_numpy.Model(scaled, params)(x, TGT).intermediates["encoder.embeddings"]
    np.testing.assert_array_equal(again, out.intermediates["encoder.embeddings"])


def test_a_key_bias_changes_no_output():
    """q . (k + b) = q . k + q . b, and q . b is the same for every key of a query: the softmax
    cancels it, so a model with a key bias computes what the model without it does (why Whisper
    leaves it out; key_bias is a fact of the key space, not of the numbers)."""
    params = init_params(CONFIG)
    with_bias = CONFIG.replace(key_bias=True)
    biased = init_params(with_bias, seed=3)
    biased.update(params)  # the same weights, plus a random key bias in every attention
    assert any(k.endswith("k_proj.bias") for k in biased)
    x = features()
    a, b = impl_numpy.Model(CONFIG, params)(x, TGT), impl_numpy.Model(with_bias, biased)(x, TGT)
    for name, value in a.intermediates.items():
        np.testing.assert_allclose(b.intermediates[name], value, rtol=0, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-12)


BAD_FEATURES = {
    "integers": (np.zeros((2, 3, 8), dtype=np.int64), "floating dtype"),
    "rank 2": (np.zeros((2, 8)), "of rank 3"),
    "wrong n_mels": (np.zeros((2, 4, 8)), "got 4 mel channels"),
    "no frames": (np.zeros((2, 3, 0)), "frames=0"),
    "odd frames": (np.zeros((2, 3, 7)), "frames=7 is odd"),
    "more frames than the table": (np.zeros((2, 3, 14)), "more than the 6 rows"),
    "NaN": (np.where(np.eye(8)[None, :3], np.nan, 0.0).repeat(2, axis=0), "must be finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_FEATURES))
def test_bad_features_get_the_same_error_everywhere(case):
    """The same InputError, argument and message, from every backend (checked on the host, before
    any framework runs: JAX would not fail on a wrong shape the same way, or at all on a NaN)."""
    from conformance.check import backends

    bad, words = BAD_FEATURES[case]
    messages = {}
    for backend in ("numpy", "torch", "jax"):
        if backends.availability([backend])[backend]:
            continue
        _, model = build(backend, dtype="float32")
        with pytest.raises(InputError) as raised:
            model(bad, TGT)
        assert raised.value.argument == "src_ids"
        messages[backend] = str(raised.value)
    assert len(set(messages.values())) == 1, messages
    assert words in next(iter(messages.values()))


def test_the_switches_refuse_what_a_features_source_cannot_be():
    with pytest.raises(ConfigError) as raised:
        CONFIG.replace(share_embeddings=True)
    assert raised.value.field == "share_embeddings"
    with pytest.raises(ConfigError) as raised:
        CONFIG.replace(src_vocab_size=21)
    assert raised.value.field == "src_vocab_size"
    with pytest.raises(ConfigError) as raised:
        ModelConfig(max_source_len=16)  # an ids source has one length, max_len
    assert raised.value.field == "max_source_len"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_source_mask_narrows_the_encoder_positions(backend):
    """A features source has no padding: its mask attends every one of its S = frames / 2
    positions, and an explicit (B, 1, 1, S) mask narrows them as for ids: the masked positions get
    no weight in the encoder's or the decoder's attention, the same in every backend."""
    from conformance.check import backends
    from conformance.check.compare import to_numpy

    x = features()
    mask = np.ones((2, 1, 1, 4), dtype=bool)
    mask[1, ..., 2:] = False  # the second row's last two positions (its last 4 frames)
    oracle = impl_numpy.Model(CONFIG, init_params(CONFIG))(x, TGT, src_mask=mask)
    assert (oracle.attention["decoder.0.cross"][1, ..., 2:] == 0).all()
    assert (oracle.attention["encoder.0.self"][1, ..., 2:] == 0).all()
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, CONFIG, init_params(CONFIG))
        got = model(x, TGT, src_mask=mask)
        np.testing.assert_allclose(to_numpy(got.logits), oracle.logits, rtol=0, atol=1e-12)
        derived = to_numpy(model.make_masks(x, TGT)[0])
        assert derived.shape == (2, 1, 1, 4) and derived.all()
        with pytest.raises(InputError) as raised:
            model(x, TGT, src_mask=np.ones((2, 1, 1, 8), dtype=bool))  # frames, not positions
        assert raised.value.argument == "src_mask"


def test_jax_buckets_pad_the_frames_without_changing_the_real_positions():
    """impl_jax pads a features source's frames with zeros up to twice its bucket: the
    convolutions pad with zero frames anyway, so the real positions are unchanged."""
    pytest.importorskip("jax")
    import impl_jax

    params = init_params(CONFIG)
    x = features(frames=6)  # 3 positions, padded to the bucket 4
    plain = impl_jax.Model(CONFIG, params, "float32")(x, TGT)
    bucketed = impl_jax.Model(CONFIG, params, "float32", buckets=(4,))(x, TGT)
    for name, value in plain.intermediates.items():
        assert np.asarray(bucketed.intermediates[name]).shape == np.asarray(value).shape, name
        np.testing.assert_allclose(np.asarray(bucketed.intermediates[name]), np.asarray(value), rtol=0, atol=1e-6)
    assert math.isfinite(float(np.asarray(bucketed.logits).sum()))


@pytest.mark.parametrize("argument,value", [("encoder_repetition_penalty", 1.4), ("encoder_no_repeat_ngram_size", 2)])
def test_the_processors_that_read_source_ids_are_refused_for_features(argument, value):
    """transformers' two source processors read the source's token ids; log-mel features have
    none: `generate` refuses them by name, the same from every backend, before any search (a
    device search fed the features as ids failed with a broadcasting ValueError)."""
    from conformance.check import backends

    messages = {}
    for backend in ("numpy", "torch", "jax"):
        if backends.availability([backend])[backend]:
            continue
        _, model = build(backend, dtype="float32")  # float64 JAX needs x64; the refusal comes first
        with pytest.raises(InputError) as raised:
            model.generate(features(frames=12), max_len=3, bos_id=1, eos_id=2, **{argument: value})
        assert raised.value.argument == argument
        messages[backend] = str(raised.value)
    assert len(set(messages.values())) == 1, messages
    assert "log-mel features" in next(iter(messages.values()))
