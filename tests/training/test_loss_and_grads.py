"""`loss_and_grads` in PyTorch (autograd) and JAX (`nnx.value_and_grad`, jit-compiled): the same
loss as `torch.nn.functional.cross_entropy` itself, the same gradients in float64, padded rows
selected out (a NaN there poisons nothing), the same errors, bounded compilation.

Compiling the value-and-grad of a model costs seconds per config on this machine, so the configs
here are 1+1-layer versions of the presets and every test shares one batch shape.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import impl_jax
import impl_numpy
import impl_torch
from conformance import InputError, init_params, param_shapes
from impl_jax import enable_x64
from batches import small

# Padding at the end of rows on both sides, in every row of the target; no source row is all
# padding (that row's memory is NaN under a -inf fill, so its loss is honestly NaN).
SRC = np.array([[3, 4, 5, 1, 0, 0], [6, 7, 8, 9, 10, 1], [5, 0, 0, 0, 0, 0]])
TGT = np.array([[2, 3, 4, 0, 0], [2, 1, 6, 7, 8], [2, 3, 0, 0, 0]])

PRESETS = ["default", "llmhub", "from-scratch", "pre-ln-tutorial", "hf-marian"]


def tiny(name: str, **changes):
    return small(name, n_encoder_layers=1, n_decoder_layers=1, **changes)


def labels_for(config, tgt=TGT) -> np.ndarray:
    """The next token at each real target position; pad_id where the target is padding."""
    labels = np.roll(tgt, -1, axis=1)
    labels[:, -1] = 9
    return np.where(tgt == config.pad_id, config.pad_id, labels)


def torch_reference(model, src, tgt, labels, epsilon):
    """The loss of the contract, literally: PyTorch's cross_entropy over every position."""
    logits = model(src, tgt).logits
    vocab = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, vocab), torch.as_tensor(labels).reshape(-1),
                           ignore_index=model.config.pad_id, label_smoothing=epsilon)
    return loss


def assert_grads_close(expected: dict, actual: dict, rtol: float, what: str):
    assert list(actual) == list(expected), f"{what}: keys differ"
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, g in expected.items():
        np.testing.assert_allclose(np.asarray(actual[name]), g, rtol=rtol, atol=rtol * scale,
                                   err_msg=f"{what}: gradient of {name}")


def grads_numpy(grads: dict) -> dict:
    return {name: np.asarray(g.detach().cpu() if isinstance(g, torch.Tensor) else g) for name, g in grads.items()}


# Every preset, and the switches AlgoPerf's WMT variants add on top of theirs.
GRADIENT_CASES = {**{name: (name, {}) for name in PRESETS},
                  "algoperf GLU-tanh, attention_temp 4": ("algoperf-wmt-flax",
                                                          dict(ffn_glu=True, activation="tanh", attention_temp=4.0))}


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_torch_and_jax_gradients_agree_in_float64(name):
    preset_name, changes = GRADIENT_CASES[name]
    config = tiny(preset_name, **changes)
    params = init_params(config)
    labels = labels_for(config)
    model = impl_torch.Model(config, params, "float64")
    loss, grads = model.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
    assert list(grads) == list(param_shapes(config))
    for key, shape in param_shapes(config).items():
        assert tuple(grads[key].shape) == tuple(shape) and grads[key].dtype == torch.float64, key
    # The loss is PyTorch's own cross_entropy (ignore_index, label_smoothing) on the forward's logits.
    reference = torch_reference(model, SRC, TGT, labels, 0.1).detach()
    assert abs(float(loss) - float(reference)) <= 1e-13 * abs(float(reference))
    with enable_x64():
        jmodel = impl_jax.Model(config, params, "float64")
        jloss, jgrads = jmodel.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
    assert isinstance(jloss, jax.Array) and jloss.shape == () and all(isinstance(g, jax.Array) for g in jgrads.values())
    assert abs(float(jloss) - float(loss)) <= 1e-13 * abs(float(loss))
    assert_grads_close(grads_numpy(grads), grads_numpy(jgrads), 1e-11, f"{name}: jax vs torch float64")
    assert all(np.asarray(jgrads[k]).dtype == np.float64 for k in jgrads)


def test_nan_rows_are_selected_out_not_multiplied_by_zero():
    """-inf fill + query-side target padding: the forward's padded rows are NaN (0 / 0), yet the
    loss and every gradient are finite, and equal those of the same model with a finite fill
    (whose padded rows are finite and, padding being at the end, reach no counted token)."""
    config = tiny("from-scratch", mask_fill=float("-inf"))
    finite = tiny("from-scratch", mask_fill=-1e9)
    params = init_params(config)
    labels = labels_for(config)
    model = impl_torch.Model(config, params, "float64")
    assert torch.isnan(model(SRC, TGT).logits).any(), "the case must really produce NaN rows"
    loss, grads = model.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
    reference_model = impl_torch.Model(finite, params, "float64")
    reference = torch_reference(reference_model, SRC, TGT, labels, 0.1)
    named = dict(reference_model.named_parameters())
    expected = dict(zip(named, torch.autograd.grad(reference, list(named.values()))))
    expected = {key: expected[key] for key in param_shapes(config)}
    reference = reference.detach()
    assert abs(float(loss) - float(reference)) <= 1e-13 * abs(float(reference))
    assert_grads_close(grads_numpy(expected), grads_numpy(grads), 1e-12, "torch, NaN rows vs finite fill")
    # The forward of the model is unchanged by the loss (inference keeps its NaN rows).
    assert torch.isnan(model(SRC, TGT).logits).any()
    with enable_x64():
        jmodel = impl_jax.Model(config, params, "float64")
        assert np.isnan(np.asarray(jmodel(SRC, TGT).logits)).any()
        jloss, jgrads = jmodel.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
        assert np.isnan(np.asarray(jmodel(SRC, TGT).logits)).any()
    assert abs(float(jloss) - float(reference)) <= 1e-13 * abs(float(reference))
    assert_grads_close(grads_numpy(expected), grads_numpy(jgrads), 1e-11, "jax, NaN rows vs finite fill")


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_jax_cross_entropy_is_the_numpy_loss_and_its_gradient(epsilon):
    """impl_jax.loss.cross_entropy, the loss with its own written gradient, against the NumPy
    backward's `cross_entropy` (the same two equations, by another hand) in float64, with NaN
    logits in the positions that do not count: the loss and its gradient stay finite there, and
    that gradient is exactly 0. The incoming cotangent scales it, and the gradient with respect
    to ε is the loss's slope in ε (the loss is linear in ε, so a central difference is exact up
    to rounding)."""
    from impl_jax.loss import cross_entropy
    from impl_numpy.backward import cross_entropy as numpy_cross_entropy

    rng = np.random.default_rng(0)
    pad_id = 1
    labels = rng.integers(0, 11, size=(3, 5))
    labels[0, 3:] = pad_id
    labels[2, :] = pad_id  # a row that does not count at all
    labels[1, 0] = 10  # the last class
    logits = rng.normal(scale=3.0, size=(3, 5, 11))
    logits[labels == pad_id] = np.nan
    expected_loss, expected_grad = numpy_cross_entropy(logits, labels, pad_id, epsilon)
    with enable_x64():
        jlogits, jlabels, counted = (jax.numpy.asarray(x) for x in (logits, labels, labels != pad_id))
        loss, pull_back = jax.vjp(lambda z, e: cross_entropy(z, jlabels, counted, e), jlogits, jax.numpy.float64(epsilon))
        grad, d_epsilon = (np.asarray(x) for x in pull_back(jax.numpy.float64(2.5)))
        h = 1e-3
        slope = (float(cross_entropy(jlogits, jlabels, counted, epsilon + h))
                 - float(cross_entropy(jlogits, jlabels, counted, epsilon - h))) / (2 * h)
    loss = float(loss)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    assert abs(loss - float(expected_loss)) <= 1e-14 * abs(float(expected_loss))
    assert np.all(grad[labels == pad_id] == 0)
    np.testing.assert_allclose(grad, 2.5 * expected_grad, rtol=0, atol=1e-15)
    assert abs(float(d_epsilon) - 2.5 * slope) <= 1e-10 * abs(slope)


def test_jax_cross_entropy_keeps_float32_gradients_accurate_at_large_logits():
    """The softmax of the backward pass is exp(shifted - lse) of the shifted logits, so logits far
    from 0 (here about 200, where a float32 ulp is 1.5e-5) cost no accuracy. Measured over 20
    seeds: at most 3.3e-7 of the largest gradient from the float64 oracle of the same (float32)
    logits; computed as exp(z - (max + lse)) it was 7.3e-6."""
    from impl_jax.loss import cross_entropy
    from impl_numpy.backward import cross_entropy as numpy_cross_entropy

    for seed in range(20):
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, 500, size=(4, 6))
        labels[0, 3:] = 1
        logits = (rng.normal(scale=10.0, size=(4, 6, 500)) + 200).astype(np.float32)
        _, expected = numpy_cross_entropy(logits.astype(np.float64), labels, 1, 0.1)
        grad = np.asarray(jax.grad(cross_entropy)(jax.numpy.asarray(logits), jax.numpy.asarray(labels),
                                                  jax.numpy.asarray(labels != 1), np.float32(0.1)))
        assert grad.dtype == np.float32
        np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-6 * np.abs(expected).max(), err_msg=f"seed {seed}")


def test_jax_loss_compiles_once_per_shape_not_per_epsilon():
    config = tiny("default")
    model = impl_jax.Model(config, init_params(config), "float32")
    labels = labels_for(config)
    model.loss_and_grads(SRC, TGT, labels)
    before = impl_jax.compile_stats()["compiles"]
    loss_a, _ = model.loss_and_grads(SRC, TGT, labels, label_smoothing=0.0)
    loss_b, _ = model.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
    assert impl_jax.compile_stats()["compiles"] == before
    assert float(loss_a) != float(loss_b)


BAD = [
    ("labels", lambda labels: labels[:, :-1], "expected the shape of tgt_ids"),
    ("labels", lambda labels: labels.astype(np.float32), "integer dtype"),
    ("labels", lambda labels: np.where(labels > 0, 16, labels), "out of range"),
    ("labels", lambda labels: np.where(labels >= 0, -1, labels), "negative label"),
    ("labels", lambda labels: np.zeros_like(labels), "no label counts"),
]


@pytest.mark.parametrize("argument,change,words", BAD, ids=[words for _, _, words in BAD])
def test_bad_labels_get_the_same_error_from_every_backend(argument, change, words):
    config = tiny("default")
    params = init_params(config)
    labels = change(labels_for(config))
    for model in (impl_numpy.Model(config, params, "float32"), impl_torch.Model(config, params, "float32"),
                  impl_jax.Model(config, params, "float32")):
        with pytest.raises(InputError, match=words) as error:
            model.loss_and_grads(SRC, TGT, labels)
        assert error.value.argument == argument


@pytest.mark.parametrize("epsilon", [-0.1, 1.5, "0.1", True])
def test_bad_label_smoothing_is_an_input_error(epsilon):
    config = tiny("default")
    params = init_params(config)
    for model in (impl_torch.Model(config, params, "float32"), impl_jax.Model(config, params, "float32")):
        with pytest.raises(InputError) as error:
            model.loss_and_grads(SRC, TGT, labels_for(config), label_smoothing=epsilon)
        assert error.value.argument == "label_smoothing"


def test_bad_ids_are_checked_as_by_forward():
    config = tiny("default")
    params = init_params(config)
    for model in (impl_torch.Model(config, params, "float32"), impl_jax.Model(config, params, "float32")):
        with pytest.raises(InputError) as error:
            model.loss_and_grads(SRC + 100, TGT, labels_for(config))
        assert error.value.argument == "src_ids"


def test_torch_reads_numpy_ids_and_labels_on_the_host_not_back_from_the_device(monkeypatch):
    """The checks of `loss_and_grads` read NumPy ids and labels where they were given: copying the
    uploaded ids back (`.cpu()`) is a device sync per step on a GPU. Tensors given are checked
    the same way, with the same results and the same refusals."""
    config = tiny("default", mask_fill=float("-inf"))
    model = impl_torch.Model(config, init_params(config), "float32")
    labels = labels_for(config)
    reads = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(self.shape) or real_cpu(self, *a, **k))
    loss, grads = model.loss_and_grads(SRC, TGT, labels)
    assert reads == [], f"loss_and_grads copied tensors of shapes {reads} back to the host"
    as_tensors = [torch.as_tensor(a) for a in (SRC, TGT, labels)]
    loss_t, grads_t = model.loss_and_grads(*as_tensors)
    assert float(loss_t) == float(loss)
    assert all(torch.equal(grads_t[name], grads[name]) for name in grads)
    # An all-padding source row under a -inf fill: its labels count where the logits are NaN,
    # refused from NumPy and from tensors alike.
    src = SRC.copy()
    src[0] = config.pad_id
    for given in ((src, TGT, labels), [torch.as_tensor(a) for a in (src, TGT, labels)]):
        with pytest.raises(InputError, match="logits are NaN") as error:
            model.loss_and_grads(*given)
        assert error.value.argument == "labels"
    with pytest.raises(InputError, match="integer dtype"):
        model.loss_and_grads(SRC, TGT, torch.as_tensor(labels, dtype=torch.bfloat16))
