"""The paper's Adam in the three backends: NumPy written out, `torch.optim.Adam` + `LambdaLR`,
`optax.adam` with a schedule. Given the same gradients they make the same updates in float64,
step after step, through the warmup peak; the schedule is the paper's equation 3."""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import pytest
import torch

import impl_jax
import impl_jax.train
import impl_numpy
import impl_numpy.train
import impl_torch
import impl_torch.train
from conformance import InputError, init_params, param_shapes
from conformance.core.training import paper_lrate
from impl_jax import enable_x64
from batches import small

WARMUP = 3  # the schedule peaks at step 3 of the 6 below


def grads_at(config, step: int) -> dict[str, np.ndarray]:
    """Gradients drawn from a seed: large and small entries, some exact zeros (Adam's ε matters)."""
    rng = np.random.default_rng(step)
    grads = {}
    for name, shape in param_shapes(config).items():
        g = rng.normal(size=shape) * 10.0 ** rng.integers(-6, 1, size=shape)
        grads[name] = np.where(rng.random(shape) < 0.1, 0.0, g)
    return grads


def test_schedule_is_the_papers_and_peaks_at_warmup():
    lrates = [paper_lrate(step, 512, 4000) for step in range(1, 8001)]
    assert int(np.argmax(lrates)) + 1 == 4000
    assert lrates[0] == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert lrates[7999] == pytest.approx(512 ** -0.5 * 8000 ** -0.5)
    with pytest.raises(InputError):
        paper_lrate(0, 512)


def test_the_three_optimizers_make_the_same_updates_in_float64():
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    params = init_params(config)
    numpy_model = impl_numpy.Model(config, params, "float64")
    torch_model = impl_torch.Model(config, params, "float64")
    optimizers = {
        "numpy": impl_numpy.train.Adam(numpy_model, config.d_model, warmup=WARMUP),
        "torch": impl_torch.train.Adam(torch_model, config.d_model, warmup=WARMUP),
    }
    with enable_x64():
        jax_model = impl_jax.Model(config, params, "float64")
        optimizers["jax"] = impl_jax.train.Adam(jax_model, config.d_model, warmup=WARMUP)
        models = {"numpy": numpy_model, "torch": torch_model, "jax": jax_model}
        previous = {name: value.copy() for name, value in params.items()}
        for step in range(1, 7):
            grads = grads_at(config, step)
            used = {backend: opt.step(grads) for backend, opt in optimizers.items()}
            assert set(used.values()) == {paper_lrate(step, config.d_model, WARMUP)}
            after = {backend: {name: np.array(impl_torch.to_numpy(v) if backend == "torch" else v)  # copies
                               for name, v in (m.state_dict().items() if backend == "torch" else m.params.items())}
                     for backend, m in models.items()}
            for name in params:
                reference = after["numpy"][name] - previous[name]  # the update NumPy made
                assert np.abs(reference).max() > 0, f"step {step}: {name} did not move"
                for backend in ("torch", "jax"):
                    update = after[backend][name] - previous[name]
                    np.testing.assert_allclose(update, reference, rtol=1e-12, atol=1e-12 * np.abs(reference).max(),
                                               err_msg=f"step {step}, {backend}: update of {name}")
            previous = after["numpy"]


def test_the_updates_are_adams_equations():
    """One step from zero moments is lrate · g / (|g| + ε) elementwise (m̂ = g, v̂ = g²): checks the
    bias correction and where ε enters, independently of any optimizer's code."""
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    params = init_params(config)
    grads = grads_at(config, 1)
    model = impl_torch.Model(config, params, "float64")
    optimizer = impl_torch.train.Adam(model, config.d_model, warmup=WARMUP)
    optimizer.step(grads)
    lr = paper_lrate(1, config.d_model, WARMUP)
    for name, p in model.state_dict().items():
        expected = params[name] - lr * grads[name] / (np.abs(grads[name]) + 1e-9)
        np.testing.assert_allclose(p.numpy(), expected, rtol=1e-13, atol=1e-15, err_msg=name)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_bad_optimizer_arguments_are_input_errors(backend):
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    package = {"numpy": impl_numpy, "torch": impl_torch, "jax": impl_jax}[backend]
    train = {"numpy": impl_numpy.train, "torch": impl_torch.train, "jax": impl_jax.train}[backend]
    model = package.Model(config, init_params(config), "float32")
    for kwargs, argument in (({"warmup": 0}, "warmup"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1.0}, "eps")):
        with pytest.raises(InputError) as error:
            train.Adam(model, config.d_model, **kwargs)
        assert error.value.argument == argument
    optimizer = train.Adam(model, config.d_model)
    grads = {name: np.zeros(shape, np.float32) for name, shape in param_shapes(config).items()}
    grads.pop("output.bias")
    with pytest.raises(InputError, match="missing") as error:
        optimizer.step(grads)
    assert error.value.argument == "grads"


def test_torch_adam_uses_tensor_gradients_as_they_are_and_copies_anything_else():
    """impl_torch's Adam hands `loss_and_grads`' own tensors to the fused kernel as they are (three
    host dispatches each saved, docs/training.md), and converts NumPy arrays, another dtype or a
    tensor that requires grad: the same updates either way, and the given gradients unchanged."""
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    params = init_params(config)
    grads = grads_at(config, 1)
    kinds = {
        "tensors": {name: torch.tensor(g) for name, g in grads.items()},
        "numpy": grads,
        "float32 tensors": {name: torch.tensor(g, dtype=torch.float32) for name, g in grads.items()},
        "requiring grad": {name: torch.tensor(g).requires_grad_() for name, g in grads.items()},
    }
    results = {}
    for kind, given in kinds.items():
        model = impl_torch.Model(config, params, "float64")
        optimizer = impl_torch.train.Adam(model, config.d_model, warmup=WARMUP)
        seen = {}
        hook = optimizer.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: seen.update({name: p.grad for name, p in zip(optimizer.names, optimizer.params)}))
        before = {name: g.detach().clone() if isinstance(g, torch.Tensor) else g.copy() for name, g in given.items()}
        optimizer.step(given)
        hook.remove()
        shared = [seen[name] is given[name] for name in given]
        assert all(shared) if kind == "tensors" else not any(shared), kind
        for name, g in given.items():  # the optimizer changed no gradient it was given
            assert np.array_equal(impl_torch.to_numpy(g.detach()) if isinstance(g, torch.Tensor) else g,
                                  impl_torch.to_numpy(before[name]) if isinstance(g, torch.Tensor) else before[name])
        assert all(p.grad is None for p in optimizer.params), kind  # zeroed after the step
        results[kind] = {name: impl_torch.to_numpy(p).copy() for name, p in model.state_dict().items()}
    for kind in ("numpy", "requiring grad"):
        for name, value in results["tensors"].items():
            assert np.array_equal(results[kind][name], value), (kind, name)


def test_parameters_replaced_swaps_only_the_named_parameters_and_always_restores():
    """The mixed-precision loss reads compute-dtype copies through `parameters_replaced`
    (impl_torch/train.py), in place of `torch.func.functional_call`: inside the block the module
    reads each replacement, outside it its own parameters again, even after an error."""
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    model = impl_torch.Model(config, init_params(config), "float64")
    named = dict(model.named_parameters())
    target = "decoder.layers.0.cross_attn.v_proj.weight"
    replacement = torch.zeros_like(named[target])
    src, tgt = np.array([[5, 6, 7, config.pad_id]]), np.array([[2, 8, 9]])
    plain = model(src, tgt).logits
    reference = torch.func.functional_call(model, {target: replacement}, (src, tgt)).logits
    with impl_torch.train.parameters_replaced(model, {id(named[target]): replacement}):
        assert attrgetter(target)(model) is replacement
        assert all(attrgetter(name)(model) is p for name, p in named.items() if name != target)
        inside = model(src, tgt).logits
    assert torch.equal(inside, reference) and not torch.equal(inside, plain)
    with pytest.raises(RuntimeError, match="inside"):
        with impl_torch.train.parameters_replaced(model, {id(p): torch.zeros_like(p) for p in named.values()}):
            raise RuntimeError("inside")
    assert dict(model.named_parameters()) == named and all(isinstance(p, torch.nn.Parameter) for p in named.values())
    assert torch.equal(model(src, tgt).logits, plain)


def test_the_mixed_precision_loss_never_marks_a_parameter_as_requiring_grad():
    """`loss_and_grads` with a param_dtype differentiates at leaves in the compute dtype
    (`impl_torch.train.leaf_in`): a parameter already in that dtype is read through a detached
    view, so a frozen parameter stays frozen, and its gradient is still returned."""
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    model = impl_torch.Model(config, init_params(config), "float64", param_dtype="float32")
    frozen = model.output.bias
    frozen.data = frozen.data.double()  # already in the compute dtype
    frozen.requires_grad_(False)
    src, tgt = np.array([[5, 6, 7, config.pad_id]]), np.array([[2, 8, 9]])
    labels = np.array([[8, 9, config.pad_id]])
    _, grads = model.loss_and_grads(src, tgt, labels)
    assert not frozen.requires_grad and frozen.grad is None
    assert grads["output.bias"].shape == frozen.shape and float(grads["output.bias"].abs().sum()) > 0
