"""`param_dtype`: parameters stored in one dtype, computed in another (Flax's `param_dtype` /
`dtype` split), in all three backends.

Widening float32 -> float64 is exact, so a float64 model holding float32 parameters must give,
bit for bit, what the float64 model built from the same float32 values gives: every attention
map, every intermediate, the logits, the loss, generated tokens; and its gradients are the
float64 ones rounded once to float32. Narrowing at use (float32 parameters, float16 compute) must
equal narrowing up front (the float16 model built from the same float32 values). The batch has
padding on both sides (a source row that is all padding); the two configs, whose vocabulary spans
three blocks of the output projection, hold a stored position table, shared and tied embeddings and a final_logits_bias (Marian), and a sinusoid, an untied
output with its bias and the std-eps LayerNorm (the Annotated Transformer).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from conformance import InputError, init_params
from conformance.check import backends
from conformance.core.params import OUTPUT_BLOCK
from batches import SRC, TGT, small
from xla_emitters import run_with_xla_emitters, xla_test_settings_on

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")
jax = pytest.importorskip("jax", reason="the JAX backend needs jax")

import impl_jax  # noqa: E402
import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from impl_jax import model as jax_model  # noqa: E402
from impl_numpy import model as numpy_model  # noqa: E402
from impl_torch import model as torch_model  # noqa: E402

PACKAGES = {"numpy": impl_numpy, "torch": impl_torch, "jax": impl_jax}
MODEL_FILES = {"numpy": numpy_model, "torch": torch_model, "jax": jax_model}
# Three blocks of the output projection, the last one partial (`Output`: each block is widened
# where it is used, and a GEMM's rounding can depend on its width).
VOCAB = dict(src_vocab_size=2 * OUTPUT_BLOCK + 5, tgt_vocab_size=2 * OUTPUT_BLOCK + 5)
CONFIGS = {  # 1+1 layers: every layer kind once, and JAX compiles in seconds
    # a stored position table, shared and tied embeddings, final_logits_bias
    "marian-table": small("hf-marian", position="table", n_encoder_layers=1, n_decoder_layers=1, **VOCAB),
    # a sinusoid, an untied output with its bias, the std-eps LayerNorm
    "annotated": small("annotated-transformer", n_encoder_layers=1, n_decoder_layers=1, **VOCAB),
}
MARIAN = CONFIGS["marian-table"]


def target(backend: str, device: str):
    """`(backend, device)` as a test parameter, skipped with the reason where the device is absent
    (`backends.present_devices` decides, as for the suite)."""
    absent = device not in backends.present_devices(backend)
    return pytest.param(backend, device, id=f"{backend}-{device}", marks=pytest.mark.skipif(
        absent, reason=backends.accelerator_skip_reason(backend)))


# Each backend on each of its devices; the accelerators skip here with the reason.
TARGETS = [target(backend, device) for backend in ("numpy", "torch", "jax") for device in backends.device_kinds(backend)]
# Narrowing at use: float32 parameters in a half-precision compute (NumPy runs float32/64 only:
# float64 parameters in a float32 compute).
NARROW = [
    pytest.param("numpy", "cpu", "float32", "float64", id="numpy-float32<-float64"),
    pytest.param("torch", "cpu", "float16", "float32", id="torch-float16<-float32"),
    pytest.param("torch", "cpu", "bfloat16", "float32", id="torch-bfloat16<-float32"),
    pytest.param("jax", "cpu", "float16", "float32", id="jax-float16<-float32"),
    pytest.param("jax", "cpu", "bfloat16", "float32", id="jax-bfloat16<-float32"),
]


def values(config, dtype) -> dict[str, np.ndarray]:
    """The seeded parameters of `config`, rounded once to `dtype`."""
    return {k: v.astype(dtype) for k, v in init_params(config).items()}


def widened(params) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in params.items()}


@contextlib.contextmanager
def scope(backend: str, device: str = "cpu"):
    """JAX with 64-bit on and `device` the default; nothing for the others."""
    if backend != "jax":
        yield
        return
    with jax.default_device(jax.devices(device)[0]), impl_jax.enable_x64():
        yield


def build(backend, device, config, params, dtype, **kwargs):
    return PACKAGES[backend].Model(config, params, dtype, device=device, **kwargs)


def host(backend, x) -> np.ndarray:
    """A result as a host array, float64 for the comparison (exact from every float dtype)."""
    array = PACKAGES[backend].to_numpy(x)
    return array.astype(np.float64) if array.dtype != np.float64 else array


def dtype_of(backend, x) -> str:
    return str(x.dtype).removeprefix("torch.")


def stored(backend, model) -> dict[str, object]:
    """The model's own parameter storage by canonical name (no copies)."""
    if backend == "torch":
        return dict(model.named_parameters())
    return dict(model.params)


def assert_same_bits(backend, got, expected, name: str, dtype: str) -> None:
    __tracebackhide__ = True
    assert dtype_of(backend, got) == dtype, f"{name}: {dtype_of(backend, got)}, not {dtype}"
    assert dtype_of(backend, expected) == dtype, name
    a, b = host(backend, got), host(backend, expected)
    assert a.shape == b.shape, name
    assert np.array_equal(a, b, equal_nan=True), f"{name}: {np.nanmax(np.abs(a - b))} apart"


def assert_outputs_equal(backend, out, ref, dtype: str) -> None:
    __tracebackhide__ = True
    assert list(out.attention) == list(ref.attention) and list(out.intermediates) == list(ref.intermediates)
    for name in ref.attention:
        assert_same_bits(backend, out.attention[name], ref.attention[name], name, dtype)
    for name in ref.intermediates:
        assert_same_bits(backend, out.intermediates[name], ref.intermediates[name], name, dtype)
    assert_same_bits(backend, out.logits, ref.logits, "logits", dtype)


def forward(backend, model):
    if backend == "torch":
        with torch.no_grad():
            return model(SRC, TGT)
    return model(SRC, TGT)


# -- 1. float64 compute, float32 storage: the float64 model's numbers, bit for bit --------------


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("backend, device", TARGETS)
def test_float32_params_in_float64_equal_the_float64_model(backend, device, name):
    config = CONFIGS[name]
    p32 = values(config, np.float32)
    with scope(backend, device):
        mixed = build(backend, device, config, p32, "float64", param_dtype="float32")
        plain = build(backend, device, config, widened(p32), "float64")
        assert dtype_of(backend, mixed) == "float64" and str(mixed.param_dtype).removeprefix("torch.") == "float32"
        assert {dtype_of(backend, v) for v in stored(backend, mixed).values()} == {"float32"}
        assert_outputs_equal(backend, forward(backend, mixed), forward(backend, plain), "float64")
        if backend == "torch":  # the fused attention path (no weights) reads the parameters too
            with torch.no_grad():
                fast, ref = (m(SRC, TGT, return_attention=False).logits for m in (mixed, plain))
            assert_same_bits(backend, fast, ref, "logits (fused attention)", "float64")


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_the_output_weight_is_widened_one_block_at_a_time(backend, name, monkeypatch):
    """No read of a parameter widens more than one block of the output projection (D x
    OUTPUT_BLOCK): the whole (D, V) weight in float64 would be the largest temporary of a forward
    pass at a real vocabulary, and of every decoding step. JAX runs its traceable forward here, so
    that every `cast` is seen (jit would replay a cached executable without calling it)."""
    config = CONFIGS[name]
    module = MODEL_FILES[backend]
    widened_sizes = []

    def recording_cast(w, dtype):
        widened_sizes.append(int(np.prod(w.shape)))
        return original(w, dtype)

    original = module.cast
    monkeypatch.setattr(module, "cast", recording_cast)
    with scope(backend):
        model = build(backend, "cpu", config, values(config, np.float32), "float64", param_dtype="float32")
        if backend == "jax":
            model.traceable_forward(SRC, TGT)
        else:
            forward(backend, model)
    block = config.d_model * OUTPUT_BLOCK
    assert widened_sizes and config.d_model * config.tgt_vocab_size > block
    assert max(widened_sizes) == block  # the full blocks, and nothing larger


@pytest.mark.parametrize("name", CONFIGS)
def test_xla_widens_the_output_weight_a_block_at_a_time(name):
    """What XLA compiles, not only what is traced: a float64 JAX decoder of float32 parameters
    needs fewer temporaries than the widened output weight alone (XLA's `memory_analysis()`).
    Measured 1.3 MB against 4.2 MB, untied and tied. Unrolled or concatenated blocks, XLA widens
    them all at once; a tied embedding transposed whole before the loop, it copies whole (3.4 MB)."""
    from impl_jax import compiled, host

    vocab = 4 * OUTPUT_BLOCK + 5
    config = dataclasses.replace(CONFIGS[name], src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=64,
                                 n_heads=4, d_ff=96)
    with scope("jax"):
        model = build("jax", "cpu", config, values(config, np.float32), "float64", param_dtype="float32")
        encoded = model.encode(SRC)
        padding = host.Padding(config, model.buckets, src_len=SRC.shape[1], tgt_len=TGT.shape[1])
        args = (padding.ids(TGT, "tgt"), padding.mask(jax_model.target_mask(config, TGT), queries="tgt", keys="tgt"),
                padding.memory(encoded.memory), padding.mask(encoded.src_mask, keys="src"), padding.real("tgt"),
                padding.real("src"))
        lowered = compiled.lower(model, jax_model.Model._decode, args, model.device, return_attention=True)
        temporaries = lowered.compile().memory_analysis().temp_size_in_bytes
    widened = config.d_model * config.tgt_vocab_size * 8
    assert temporaries < widened / 2, (temporaries, widened)


@pytest.mark.parametrize("vocab", [5, OUTPUT_BLOCK, 2 * OUTPUT_BLOCK, 2 * OUTPUT_BLOCK + 5])
@pytest.mark.parametrize("vocab_axis", [1, 0], ids=["stored", "tied"])
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_the_product_in_blocks_is_the_whole_product(backend, vocab_axis, vocab):
    """Every block lands in its place, the last partial one included, for W_out as stored (D, V)
    and for a tied embedding (V, D): float32 storage in a float64 product gives y @ W_out to
    float64 rounding, and (torch with autograd recording, JAX differentiated: one GEMM) the
    gradients y^T g and g W_out^T, the weight's rounded to its float32 storage."""
    rng = np.random.default_rng(vocab)
    y, g = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 3, vocab))
    w_out = rng.standard_normal((16, vocab)).astype(np.float32)  # (D, V)
    weight = w_out if vocab_axis == 1 else np.ascontiguousarray(w_out.T)
    expected = y @ w_out.astype(np.float64)
    d_y, d_w_out = g @ w_out.T.astype(np.float64), np.einsum("btd,btv->dv", y, g)
    d_weight = (d_w_out if vocab_axis == 1 else d_w_out.T).astype(np.float32)
    module = MODEL_FILES[backend]

    def product(y, weight, vocab_axis):  # through the model's own `cast` (impl_*/blocks.py)
        return module.product_in_blocks(y, weight, vocab_axis, module.cast)

    if backend == "numpy":
        got, grads = product(y, weight, vocab_axis), None
    elif backend == "torch":
        ty, tw = torch.tensor(y, requires_grad=True), torch.tensor(weight, requires_grad=True)
        with torch.no_grad():
            without_graph = product(ty, tw, vocab_axis).numpy()
        out = product(ty, tw, vocab_axis)
        out.backward(torch.tensor(g))
        got, grads = out.detach().numpy(), (ty.grad.numpy(), tw.grad.numpy())
        # With autograd recording the product is one GEMM (impl_torch/blocks.py): the blocks' values
        # to float64 rounding, bit for bit when there is one block.
        if vocab <= OUTPUT_BLOCK:
            assert np.array_equal(without_graph, got), "torch: the in-place block and the one GEMM differ"
        np.testing.assert_allclose(without_graph, got, rtol=0, atol=1e-13 * np.abs(got).max(), err_msg="blocks")
    else:
        with scope("jax"):
            jy, jw = jax.numpy.asarray(y), jax.numpy.asarray(weight)
            blocked = np.asarray(product(jy, jw, vocab_axis))  # the blocks in their loop
            out, pull_back = jax.vjp(lambda a, b: product(a, b, vocab_axis), jy, jw)
            got, grads = np.asarray(out), tuple(np.asarray(x) for x in pull_back(jax.numpy.asarray(g)))
        # Differentiated, the product is one GEMM (impl_jax/blocks.py): the blocks' values to
        # float64 rounding, and each block must land in its place.
        np.testing.assert_allclose(blocked, expected, rtol=0, atol=1e-13 * np.abs(expected).max(), err_msg="jax blocks")
        np.testing.assert_allclose(blocked, got, rtol=0, atol=1e-13 * np.abs(got).max(), err_msg="jax blocks")
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-13 * np.abs(expected).max(), err_msg=backend)
    if grads is not None:
        assert grads[1].dtype == np.float32 and grads[1].shape == weight.shape, backend
        np.testing.assert_allclose(grads[0], d_y, rtol=0, atol=1e-13 * np.abs(d_y).max(), err_msg=backend)
        np.testing.assert_allclose(grads[1], d_weight, rtol=2 ** -23, atol=0, err_msg=backend)


# -- 2. gradients: the float64 gradient rounded once to float32 --------------------------------


# JAX compiles a loss per config and parameter dtype (seconds each): the Marian config only, whose
# shared, tied embedding is the parameter read in the most places.
GRAD_CASES = [pytest.param(*target.values, name, id=f"{target.id}-{name}", marks=target.marks)
              for target in TARGETS for name in CONFIGS if target.values[0] != "jax" or name == "marian-table"]


@pytest.mark.parametrize("backend, device, name", GRAD_CASES)
def test_gradients_come_in_the_parameter_dtype(backend, device, name):
    if backend == "jax" and device == "cpu" and xla_test_settings_on():
        # A claim about XLA's own code generation (tests/xla_emitters.py): under the test run's
        # loop emitters the two programs round the gradients that are 0 in exact arithmetic (the
        # key projections' biases, softmax ignores a constant added to every key) to different
        # noise of about 1e-18; every other gradient stays bit for bit there too.
        run_with_xla_emitters(f"import test_param_dtype as t; t.check_gradients_in_the_parameter_dtype('jax', 'cpu', {name!r})")
    else:
        check_gradients_in_the_parameter_dtype(backend, device, name)


def check_gradients_in_the_parameter_dtype(backend, device, name):
    config = CONFIGS[name]
    p32 = values(config, np.float32)
    labels = np.where(TGT == config.pad_id, config.pad_id, (TGT + 1) % config.tgt_vocab_size)
    with scope(backend, device):
        mixed = build(backend, device, config, p32, "float64", param_dtype="float32")
        plain = build(backend, device, config, widened(p32), "float64")
        loss, grads = mixed.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
        ref_loss, ref_grads = plain.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1)
        assert float(loss) == float(ref_loss) and dtype_of(backend, loss) == "float64"
        assert list(grads) == list(ref_grads)
        scale = max(float(np.abs(PACKAGES[backend].to_numpy(g)).max()) for g in ref_grads.values())
        for key, grad in grads.items():
            assert dtype_of(backend, grad) == "float32", key
            expected = PACKAGES[backend].to_numpy(ref_grads[key]).astype(np.float32)  # rounded once
            got = PACKAGES[backend].to_numpy(grad)
            if backend == "jax" and device != "cpu":
                # On a GPU, XLA fuses the two programs (float32 parameters widened at each use,
                # float64 ones) differently, so their float64 sums round differently: measured on
                # an H200, the key projection's bias gradient, whose true value is 0 (softmax
                # ignores a constant added to every key), came out as float64 rounding noise of
                # about 1e-19, of other signs. Rounded to float32, the rest may then differ by an
                # ulp where a float64 value sits at a float32 rounding boundary.
                np.testing.assert_allclose(got, expected, rtol=2 ** -23, atol=1e-12 * scale, err_msg=key)
            else:
                assert np.array_equal(got, expected), f"{key}: {np.max(np.abs(got - expected))} apart"
        assert any(np.any(PACKAGES[backend].to_numpy(g) != 0) for g in grads.values())


@pytest.mark.parametrize("backend, device", TARGETS)
def test_an_optimizer_step_updates_the_stored_dtype(backend, device):
    """train_step on a float64-compute model with float32 storage updates float32 values, exactly
    as the same optimizer updates a float32 model given the same (float32) gradients."""
    p32 = values(MARIAN, np.float32)
    labels = np.where(TGT == MARIAN.pad_id, MARIAN.pad_id, (TGT + 1) % MARIAN.tgt_vocab_size)
    package = PACKAGES[backend]
    with scope(backend, device):
        mixed = build(backend, device, MARIAN, p32, "float64", param_dtype="float32")
        twin = build(backend, device, MARIAN, p32, "float32")  # the optimizer's float32 reference
        optimizer, twin_optimizer = package.Adam(mixed, d_model=16), package.Adam(twin, d_model=16)
        _, grads = mixed.loss_and_grads(SRC, TGT, labels)  # what train_step hands the optimizer
        package.train_step(mixed, optimizer, SRC, TGT, labels)
        twin_optimizer.step(grads)
        assert dtype_of(backend, mixed) == "float64"
        after, expected = stored(backend, mixed), stored(backend, twin)
        for key, value in after.items():
            assert dtype_of(backend, value) == "float32", key
            got = package.to_numpy(value)
            assert np.array_equal(got, package.to_numpy(expected[key])), key
        assert any(not np.array_equal(package.to_numpy(v), p32[k]) for k, v in after.items())


# -- 3. narrowing at use equals narrowing up front ----------------------------------------------


@pytest.mark.parametrize("backend, device, dtype, param_dtype", NARROW)
def test_cast_at_use_equals_cast_up_front(backend, device, dtype, param_dtype):
    params = values(MARIAN, param_dtype)
    with scope(backend, device):
        mixed = build(backend, device, MARIAN, params, dtype, param_dtype=param_dtype)
        plain = build(backend, device, MARIAN, params, dtype)  # the core rounds them once, up front
        assert {dtype_of(backend, v) for v in stored(backend, mixed).values()} == {param_dtype}
        assert_outputs_equal(backend, forward(backend, mixed), forward(backend, plain), dtype)


# One JAX case: each is two loss compiles.
NARROW_GRADS = [case for case in NARROW if case.id != "jax-bfloat16<-float32"]


@pytest.mark.parametrize("backend, device, dtype, param_dtype", NARROW_GRADS)
def test_narrow_compute_gradients_are_the_narrow_models_widened(backend, device, dtype, param_dtype):
    """Gradients computed in the narrow dtype and returned in the wider param_dtype: exactly the
    narrow model's gradients (built from the same values, rounded up front), widened."""
    params = values(MARIAN, param_dtype)
    labels = np.where(TGT == MARIAN.pad_id, MARIAN.pad_id, (TGT + 1) % MARIAN.tgt_vocab_size)
    package = PACKAGES[backend]
    with scope(backend, device):
        mixed = build(backend, device, MARIAN, params, dtype, param_dtype=param_dtype)
        plain = build(backend, device, MARIAN, params, dtype)
        loss, grads = mixed.loss_and_grads(SRC, TGT, labels)
        ref_loss, ref_grads = plain.loss_and_grads(SRC, TGT, labels)
        assert float(loss) == float(ref_loss)
        for key, grad in grads.items():
            assert dtype_of(backend, grad) == param_dtype, key
            expected = package.to_numpy(ref_grads[key]).astype(param_dtype)  # widening: exact
            assert np.array_equal(package.to_numpy(grad), expected), key


# -- 4. the default: no param_dtype, no change ---------------------------------------------------


@pytest.mark.parametrize("backend, device", TARGETS)
def test_default_stores_the_parameters_in_dtype(backend, device):
    p64 = values(MARIAN, np.float64)
    model = build(backend, device, MARIAN, p64, "float32")
    assert dtype_of(backend, model) == "float32"
    assert str(model.param_dtype).removeprefix("torch.") == "float32"
    assert {dtype_of(backend, v) for v in stored(backend, model).values()} == {"float32"}
    cast = MODEL_FILES[backend].cast
    for value in stored(backend, model).values():  # the helper is the identity then: no copy
        assert cast(value, value.dtype) is value


def test_torch_compute_dtype_follows_the_parameters_without_param_dtype():
    model = impl_torch.Model(MARIAN, values(MARIAN, np.float32), "float32").to(torch.float16)
    assert model.dtype == model.param_dtype == torch.float16
    with torch.no_grad():
        assert model(SRC, TGT).logits.dtype == torch.float16


def test_torch_to_dtype_recasts_only_the_storage_when_param_dtype_is_given():
    """With `param_dtype` the compute dtype is fixed: `.to(torch.float16)` rounds the stored values
    to float16 and the model still computes in float64, sinusoid included (computed again in
    float64, not widened from float16): the float64 model of the float16-rounded values."""
    config = CONFIGS["annotated"]  # a sinusoid buffer
    p32 = values(config, np.float32)
    model = impl_torch.Model(config, p32, "float64", param_dtype="float32").to(torch.float16)
    assert model.dtype == torch.float64 and model.param_dtype == torch.float16
    assert model.encoder.position.table.dtype == torch.float64
    assert "encoder.position.table" not in model.state_dict()
    reference = impl_torch.Model(config, widened({k: v.astype(np.float16) for k, v in p32.items()}), "float64")
    assert_outputs_equal("torch", forward("torch", model), forward("torch", reference), "float64")


# -- 5. memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, device", TARGETS)
def test_float32_storage_holds_half_the_bytes_of_float64(backend, device):
    p32 = values(MARIAN, np.float32)

    def nbytes(model) -> int:
        if backend == "torch":
            return sum(p.numel() * p.element_size() for p in model.parameters())
        return sum(v.nbytes for v in model.params.values())

    with scope(backend, device):
        mixed = build(backend, device, MARIAN, p32, "float64", param_dtype="float32")
        plain = build(backend, device, MARIAN, widened(p32), "float64")
        assert nbytes(mixed) * 2 == nbytes(plain) > 0


# -- 6. errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", PACKAGES)
def test_an_unsupported_param_dtype_is_the_dtype_error_naming_param_dtype(backend):
    params = values(MARIAN, np.float32)
    with pytest.raises(InputError) as bad_dtype:
        build(backend, "cpu", MARIAN, params, "int32")
    for wrong in ("int32", "float8"):
        with pytest.raises(InputError) as caught:
            build(backend, "cpu", MARIAN, params, "float32", param_dtype=wrong)
        supported = ", ".join(PACKAGES[backend].SUPPORTED_DTYPES)
        assert caught.value.argument == "param_dtype"
        assert str(caught.value) == f"param_dtype: the {backend} backend cannot run {wrong}; it supports {supported}"
        assert caught.value.problem == bad_dtype.value.problem.replace("int32", wrong)
    if backend == "numpy":  # float16 is a dtype the other backends support, not this one
        with pytest.raises(InputError, match="param_dtype: the numpy backend cannot run float16"):
            build(backend, "cpu", MARIAN, params, "float32", param_dtype="float16")


@pytest.mark.parametrize("backend", PACKAGES)
def test_a_parameter_infinite_in_the_compute_dtype_is_refused_by_name(backend):
    """1e39 is a finite float64 and an infinite float32: stored in float64, computed in float32,
    it would be infinite at use. (Stored in float32 and computed in float64 it is refused at the
    storage's cast, as before.)"""
    p64 = values(MARIAN, np.float64)
    p64["decoder.layers.0.ffn.linear1.bias"][3] = 1e39
    with scope(backend):
        with pytest.raises(InputError) as caught:
            build(backend, "cpu", MARIAN, p64, "float32", param_dtype="float64")
    assert caught.value.argument == "params"
    assert str(caught.value) == ("params: parameter 'decoder.layers.0.ffn.linear1.bias' has 1 NaN or infinite "
                                 "value(s) out of 24 once cast to float32, the compute dtype")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_float32_parameters_infinite_in_float16_are_refused_by_name(backend):
    p32 = values(MARIAN, np.float32)
    p32["encoder.position.table"][0, 1] = 1e5  # finite in float32, infinite in float16
    with pytest.raises(InputError, match=r"params: parameter 'encoder.position.table' has 1 NaN or infinite "
                                         r"value\(s\) out of 128 once cast to float16, the compute dtype"):
        build(backend, "cpu", MARIAN, p32, "float16", param_dtype="float32")
    with scope(backend):  # widening cannot overflow: the same values build in float64
        build(backend, "cpu", MARIAN, p32, "float64", param_dtype="float32")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_float64_parameters_that_overflow_float16_through_float32_are_refused(backend):
    """torch and XLA round float64 to float16 through float32: 65519.999 is 65504 rounded once and
    infinite rounded twice (65520 in float32, a tie that rounds up). The check rounds as they do."""
    with np.errstate(over="ignore"):
        assert np.isfinite(np.float16(65519.999)) and not np.isfinite(np.float16(np.float32(65519.999)))
    p64 = values(MARIAN, np.float64)
    p64["encoder.position.table"][0, 1] = 65519.999
    with scope(backend):
        with pytest.raises(InputError, match=r"'encoder.position.table' has 1 NaN or infinite value\(s\) out of 128 "
                                             r"once cast to float16"):
            build(backend, "cpu", MARIAN, p64, "float16", param_dtype="float64")


def test_jax_float64_parameters_need_x64_at_every_call():
    """Without x64, jit would narrow float64 parameters to float32 silently: refused by name."""
    with impl_jax.enable_x64():
        model = impl_jax.Model(MARIAN, values(MARIAN, np.float64), "float32", param_dtype="float64")
        model(SRC, TGT)
    with pytest.raises(InputError, match="param_dtype: float64 needs 64-bit JAX"):
        model(SRC, TGT)
    with pytest.raises(InputError, match="param_dtype: float64 needs 64-bit JAX"):
        impl_jax.Model(MARIAN, values(MARIAN, np.float64), "float32", param_dtype="float64")


# -- 7. generate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, device", TARGETS)
def test_greedy_tokens_and_scores_equal_the_float64_model(backend, device):
    p32 = values(MARIAN, np.float32)
    with scope(backend, device):
        mixed = build(backend, device, MARIAN, p32, "float64", param_dtype="float32")
        plain = build(backend, device, MARIAN, widened(p32), "float64")
        src = SRC[:2]  # generate refuses SRC's third row, padding only (docs/decoding.md)
        ids, scores = mixed.generate(src, 6, 2, 3, return_scores=True)
        ref_ids, ref_scores = plain.generate(src, 6, 2, 3, return_scores=True)
        package = PACKAGES[backend]
        assert np.array_equal(package.to_numpy(ids), package.to_numpy(ref_ids))
        assert np.array_equal(package.to_numpy(scores), package.to_numpy(ref_scores))


# -- save and load ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", PACKAGES)
def test_save_writes_the_stored_values_and_load_passes_param_dtype(backend, tmp_path):
    from conformance.core import checkpoint

    p32 = values(MARIAN, np.float32)
    path = tmp_path / "m.safetensors"
    with scope(backend):
        model = build(backend, "cpu", MARIAN, p32, "float64", param_dtype="float32")
        PACKAGES[backend].save(model, path)
        _, saved = checkpoint.load(path)
        assert all(saved[k].dtype == np.float32 and np.array_equal(saved[k], p32[k]) for k in p32)
        loaded = PACKAGES[backend].load(path, "float64", param_dtype="float32")
        assert dtype_of(backend, loaded) == "float64"
        assert str(loaded.param_dtype).removeprefix("torch.") == "float32"


def test_jax_orbax_state_keeps_the_stored_values_and_passes_param_dtype(tmp_path):
    p32 = values(MARIAN, np.float32)
    with impl_jax.enable_x64():
        model = impl_jax.Model(MARIAN, p32, "float64", param_dtype="float32")
        impl_jax.save_state(model, tmp_path / "state")
        loaded = impl_jax.load_state(tmp_path / "state", "float64", param_dtype="float32")
        assert loaded.dtype == np.float64 and loaded.param_dtype == np.float32
        assert all(np.array_equal(np.asarray(v), p32[k]) and v.dtype == np.float32 for k, v in loaded.params.items())
