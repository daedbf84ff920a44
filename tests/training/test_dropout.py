"""Dropout (section 5.4, P_drop = 0.1) in the three backends: masks drawn once from a NumPy seed
(`conformance.core.dropout`) and passed explicitly, so a step with dropout is the same computation
everywhere; off by default, and all-keep masks at rate 0 change no bit of the forward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import impl_jax
import impl_numpy
import impl_torch
from conformance import InputError, init_params
from conformance.core.dropout import Dropout, draw_dropout, dropout_sites
from impl_jax import enable_x64
from batches import small

SRC = np.array([[3, 4, 5, 1, 0, 0], [6, 7, 8, 9, 10, 1], [5, 0, 0, 0, 0, 0]])
TGT = np.array([[2, 3, 4, 0, 0], [2, 1, 6, 7, 8], [2, 3, 0, 0, 0]])
LABELS = np.array([[3, 4, 9, 0, 0], [1, 6, 7, 8, 9], [3, 9, 0, 0, 0]])


def config():
    return small("default", n_encoder_layers=1, n_decoder_layers=1)


def to_numpy(x):
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)


def test_masks_are_drawn_once_from_a_seed():
    cfg = config()
    a, b = draw_dropout(cfg, 3, 6, 5, seed=7), draw_dropout(cfg, 3, 6, 5, seed=7)
    assert list(a.masks) == dropout_sites(cfg) == [
        "encoder.embeddings", "encoder.0.self_attn", "encoder.0.ffn",
        "decoder.embeddings", "decoder.0.self_attn", "decoder.0.cross_attn", "decoder.0.ffn"]
    assert all((a.masks[s] == b.masks[s]).all() for s in a.masks)
    assert a.masks["encoder.0.ffn"].shape == (3, 6, cfg.d_model) and a.masks["decoder.0.ffn"].shape == (3, 5, cfg.d_model)
    kept = np.mean(np.concatenate([m.ravel() for m in a.masks.values()]))
    assert 0.85 < kept < 0.95  # rate 0.1
    assert any((a.masks[s] != draw_dropout(cfg, 3, 6, 5, seed=8).masks[s]).any() for s in a.masks)


def test_the_three_forwards_with_dropout_agree_in_float64():
    cfg = config()
    params = init_params(cfg)
    drop = draw_dropout(cfg, *SRC.shape, TGT.shape[1], seed=1)
    reference = impl_numpy.Model(cfg, params, "float64")(SRC, TGT, dropout=drop).logits
    plain = impl_numpy.Model(cfg, params, "float64")(SRC, TGT).logits
    assert np.abs(reference - plain).max() > 1e-3, "the masks must change the logits"
    torch_logits = to_numpy(impl_torch.Model(cfg, params, "float64")(SRC, TGT, dropout=drop).logits)
    torch_fast = to_numpy(impl_torch.Model(cfg, params, "float64")(SRC, TGT, dropout=drop, return_attention=False).logits)
    with enable_x64():
        jax_logits = to_numpy(impl_jax.Model(cfg, params, "float64")(SRC, TGT, dropout=drop).logits)
        bucketed = to_numpy(impl_jax.Model(cfg, params, "float64", buckets=(8,))(SRC, TGT, dropout=drop).logits)
    for name, logits in (("torch", torch_logits), ("torch fast path", torch_fast), ("jax", jax_logits),
                         ("jax bucketed", bucketed)):
        np.testing.assert_allclose(logits, reference, rtol=0, atol=1e-12 * max(1, np.abs(reference).max()),
                                   err_msg=name)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_keep_everything_at_rate_0_changes_no_bit(backend):
    cfg = config()
    package = {"numpy": impl_numpy, "torch": impl_torch, "jax": impl_jax}[backend]
    model = package.Model(cfg, init_params(cfg), "float32")
    keep = Dropout(0.0, {site: np.ones_like(m) for site, m in draw_dropout(cfg, 3, 6, 5).masks.items()})
    off = to_numpy(model(SRC, TGT).logits)
    on = to_numpy(model(SRC, TGT, dropout=keep).logits)
    assert off.tobytes() == on.tobytes()


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_the_three_gradients_with_dropout_agree_in_float64(placement):
    """The NumPy backward through the dropout masks (impl_numpy/backward.py) against autograd
    (torch) and nnx.value_and_grad (JAX), post-LN and pre-LN: the same masks, the same numbers."""
    cfg = config().replace(norm_placement=placement)
    params = init_params(cfg)
    drop = draw_dropout(cfg, *SRC.shape, TGT.shape[1], seed=2)
    loss, grads = impl_torch.Model(cfg, params, "float64").loss_and_grads(SRC, TGT, LABELS, label_smoothing=0.1,
                                                                           dropout=drop)
    plain, _ = impl_torch.Model(cfg, params, "float64").loss_and_grads(SRC, TGT, LABELS, label_smoothing=0.1)
    assert abs(float(loss) - float(plain)) > 1e-6
    with enable_x64():
        jloss, jgrads = impl_jax.Model(cfg, params, "float64").loss_and_grads(SRC, TGT, LABELS, label_smoothing=0.1,
                                                                               dropout=drop)
    assert abs(float(jloss) - float(loss)) <= 1e-13 * abs(float(loss))
    scale = max(float(np.abs(to_numpy(g)).max()) for g in grads.values())
    for name, g in grads.items():
        np.testing.assert_allclose(to_numpy(jgrads[name]), to_numpy(g), rtol=1e-11, atol=1e-11 * scale, err_msg=name)
    nloss, ngrads = impl_numpy.Model(cfg, params, "float64").loss_and_grads(SRC, TGT, LABELS, label_smoothing=0.1,
                                                                            dropout=drop)
    assert abs(float(nloss) - float(loss)) <= 1e-13 * abs(float(loss))
    for name, g in grads.items():
        np.testing.assert_allclose(ngrads[name], to_numpy(g), rtol=1e-11, atol=1e-11 * scale, err_msg=name)


def bad_masks():
    cfg = config()
    drop = draw_dropout(cfg, 3, 6, 5)
    masks = dict(drop.masks)
    yield "missing site", Dropout(0.1, {k: v for k, v in masks.items() if k != "encoder.0.ffn"}), "no mask"
    yield "wrong shape", Dropout(0.1, {**masks, "encoder.0.ffn": masks["encoder.0.ffn"][:, :5]}), "has shape"
    yield "not boolean", Dropout(0.1, {**masks, "encoder.0.ffn": masks["encoder.0.ffn"].astype(np.float32)}), "boolean"
    yield "rate 1", dataclasses.replace(drop, rate=1.0), r"\[0, 1\)"
    yield "not a Dropout", masks, "expected a conformance.core.dropout.Dropout"


@pytest.mark.parametrize("case", list(bad_masks()), ids=lambda case: case[0])
def test_bad_dropout_is_the_same_input_error_everywhere(case):
    _, dropout, words = case
    cfg = config()
    for package in (impl_numpy, impl_torch, impl_jax):
        with pytest.raises(InputError, match=words) as error:
            package.Model(cfg, init_params(cfg), "float32")(SRC, TGT, dropout=dropout)
        assert error.value.argument == "dropout"
