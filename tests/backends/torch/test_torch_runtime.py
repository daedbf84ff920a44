"""impl_torch as an ordinary torch.nn.Module: masks, inference mode, dtypes, devices, compile,
precision settings, and encode/decode.
"""

import math
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
import impl_torch.model  # noqa: E402
from conformance import init_params, param_shapes, preset  # noqa: E402
from conformance.check.compare import assert_close  # noqa: E402
from conformance.core.config import PAD_MASK_SIDES  # noqa: E402
from conformance.core.positions import sinusoid_table  # noqa: E402
from conformance.core.output import tensors_of  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
SRC = np.array([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10], [0, 0, 0, 0, 0]])
TGT = np.array([[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0]])


def run(model, *args, **kwargs):
    with torch.inference_mode():
        return tensors_of(model(*args, **kwargs))


def assert_identical(a, b, what):
    __tracebackhide__ = True
    assert list(a) == list(b), what
    for name in a:
        x, y = a[name].detach().cpu(), b[name].detach().cpu()
        assert x.dtype == y.dtype and torch.equal(x.isnan(), y.isnan()), f"{what}: {name}"
        assert torch.equal(x.nan_to_num(), y.nan_to_num()), f"{what}: {name} differs"


@given(batch=st.integers(1, 3), src_len=st.integers(1, 6), tgt_len=st.integers(1, 6), pad_id=st.integers(0, 1),
       side=st.sampled_from(PAD_MASK_SIDES), seed=st.integers(0, 1000), as_tensor=st.booleans())
def test_masks_equal_numpy_exactly(batch, src_len, tgt_len, pad_id, side, seed, as_tensor):
    config = preset("default", tgt_pad_mask=side, pad_id=pad_id)
    rng = np.random.default_rng(seed)
    src, tgt = rng.integers(0, 3, (batch, src_len)), rng.integers(0, 3, (batch, tgt_len))
    expected = impl_numpy.make_masks(config, src, tgt)
    got = impl_torch.make_masks(config, *((torch.from_numpy(src), torch.from_numpy(tgt)) if as_tensor else (src, tgt)))
    for g, e in zip(got, expected):
        assert g.dtype == torch.bool and g.shape == e.shape and np.array_equal(g.numpy(), e)
    assert np.array_equal(impl_torch.causal_mask(tgt_len).numpy(), impl_numpy.causal_mask(tgt_len))
    assert np.array_equal(impl_torch.padding_mask(src, pad_id).numpy(), impl_numpy.padding_mask(src, pad_id))


def test_inference_mode_no_grad_and_autograd_agree():
    # Bit for bit at this vocabulary (one OUTPUT_BLOCK); beyond it autograd's output product is one
    # GEMM, the blocks' values to rounding (impl_torch/blocks.py).
    model = impl_torch.Model(preset("llmhub"), dtype=torch.float32)
    inference = run(model, SRC, TGT)
    assert all(t.is_inference() for t in inference.values())
    with torch.no_grad():
        no_grad = tensors_of(model(SRC, TGT))
    with_grad = tensors_of(model(SRC, TGT))
    assert with_grad["logits"].requires_grad
    assert_identical(inference, no_grad, "inference_mode vs no_grad")
    assert_identical(inference, with_grad, "inference_mode vs autograd")


def test_repeated_calls_and_encode_decode_are_bitwise_identical():
    model = impl_torch.Model(preset("pre-ln-tutorial"), dtype=torch.float32)
    for return_attention in (True, False):
        first = run(model, SRC, TGT, return_attention=return_attention)
        assert_identical(first, run(model, SRC, TGT, return_attention=return_attention), "a second call")
        with torch.inference_mode():
            encoded = model.encode(SRC, return_attention=return_attention)
            split = tensors_of(model.decode(TGT, encoded, return_attention=return_attention))
        assert_identical(first, split, "encode + decode")


@pytest.mark.parametrize("target", ["float32", "float16", "bfloat16"])
def test_to_dtype_equals_building_in_that_dtype(target):
    """`.to(dtype)` of a float64 model == a model built in that dtype (the cast goes the same
    way for the parameters and the sinusoid buffer), and it still follows the oracle."""
    config = preset("paper")
    params = init_params(config, seed=2)
    moved = impl_torch.Model(config, params, dtype=torch.float64).to(getattr(torch, target))
    if target == "float32":  # float64 -> float16 by torch rounds twice; NumPy's cast does not
        assert_identical(run(moved, SRC, TGT), run(impl_torch.Model(config, params, dtype=torch.float32), SRC, TGT), ".to")
    assert moved.dtype == getattr(torch, target)
    assert {b.dtype for b in moved.buffers()} == {getattr(torch, target)}
    expected = tensors_of(impl_numpy.Model(config, params)(SRC, TGT))
    for return_attention in (True, False):
        got = run(moved, SRC, TGT, return_attention=return_attention)
        for name, value in got.items():
            assert value.dtype == getattr(torch, target), name
            assert_close(value, expected[name], tolerance(target), tensor=name, backend="torch", dtype=target, config=config)


@pytest.mark.parametrize("form", ["sinusoid-interleaved", "sinusoid-split"])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_half_precision_sinusoid_is_the_float64_table_cast_once(target, form):
    """The buffer holds `sinusoid_table(...).astype(dtype)`, bit for bit, as NumPy and JAX do:
    torch's own float64 -> float16 cast rounds through float32 (19 values differ at 512 x 512)."""
    config = preset("paper", max_len=512, d_model=512, position=form)
    expected = sinusoid_table(config.max_len, config.d_model, form).astype(
        ml_dtypes.bfloat16 if target == "bfloat16" else target)
    table = impl_torch.model.Positions(config, getattr(torch, target), length=config.max_len).table
    assert table.dtype == getattr(torch, target)
    np.testing.assert_array_equal(impl_torch.to_numpy(table).view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_std_eps_layer_norm_rounds_once_in_half_precision(target):
    """The std-eps affine `normed * weight + bias` runs in float32 and is cast once, as JAX does:
    each output is the exact (float64) result rounded to the dtype, up to float32's own error.
    Casting `normed` before the affine rounds three times and misses by up to ~1.5 ulp."""
    dtype = getattr(torch, target)
    config = preset("annotated-transformer", d_model=64, n_heads=4)
    assert config.layer_norm_form == "std-eps"
    norm = impl_torch.model.LayerNorm(config, dtype)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(1 + 0.5 * rng.standard_normal(64)))
        norm.bias.copy_(torch.from_numpy(0.5 * rng.standard_normal(64)))
    x = torch.from_numpy(3 * rng.standard_normal((32, 64))).to(dtype)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == dtype
    # The oracle's formula in float64 on the very same (rounded) inputs.
    x64, weight, bias = (t.double().numpy() for t in (x, norm.weight.detach(), norm.bias.detach()))
    centered = x64 - x64.mean(-1, keepdims=True)
    std = np.sqrt((centered * centered).sum(-1, keepdims=True) / 63)
    scaled = centered / (std + config.layer_norm_eps) * weight
    exact = scaled + bias
    info = torch.finfo(dtype)
    ulp = info.eps * 2.0 ** np.maximum(np.floor(np.log2(np.abs(exact) + 1e-300)), math.log2(info.tiny))
    # float32's own error (~1e-7 of the terms) may tip a value that sits on a rounding midpoint.
    slack = 1e-6 * (np.abs(scaled) + np.abs(bias))
    error = np.abs(got.double().numpy() - exact)
    assert (error <= 0.5 * ulp + slack).all(), f"max error {(error / ulp).max():.2f} ulp"


def test_half_precision_keeps_a_finite_fill_finite():
    """-1e9 does not exist in float16 (max 65504): the scores are filled in float32, so a row
    without keys is the uniform mean, not NaN."""
    config = preset("from-scratch")  # -1e9 fill, target padding on the queries: empty rows
    model = impl_torch.Model(config, dtype=torch.float16)
    out = run(model, SRC, TGT)
    assert all(t.isfinite().all() for t in out.values())
    weights = out["encoder.0.self"][2]  # the all-padding source row
    assert torch.equal(weights, torch.full_like(weights, 1 / SRC.shape[1]))


def test_full_precision_sets_and_restores_the_switches():
    before = impl_torch.precision_settings()
    with impl_torch.full_precision():
        inside = impl_torch.precision_settings()
        assert inside["float32_matmul_precision"] == "highest"
        assert inside["cuda.matmul.allow_tf32"] is False and inside["cudnn.allow_tf32"] is False
        assert inside["cuda.matmul.allow_fp16_reduced_precision_reduction"] is False
    assert impl_torch.precision_settings() == before


def test_full_precision_when_the_program_uses_the_new_precision_api():
    """Once `fp32_precision` is set, PyTorch refuses to read the legacy flags; full_precision
    then switches the new properties instead. Run apart: the switch is process-wide."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    script = textwrap.dedent("""
        import torch, impl_torch
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
        before = impl_torch.precision_settings()
        assert before["cuda.matmul.fp32_precision"] == "tf32", before
        with impl_torch.full_precision():
            inside = impl_torch.precision_settings()
            assert inside["cuda.matmul.fp32_precision"] == "ieee", inside
            assert inside["cudnn.conv.fp32_precision"] == "ieee", inside
        assert impl_torch.precision_settings() == before, (impl_torch.precision_settings(), before)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@CUDA
def test_cuda_matches_cpu_and_the_oracle():
    config = preset("llmhub")
    params = init_params(config, seed=4)
    expected = tensors_of(impl_numpy.Model(config, params)(SRC, TGT))
    with impl_torch.full_precision():
        for dtype in ("float32", "float64"):
            cpu = impl_torch.Model(config, params, dtype=getattr(torch, dtype))
            moved = impl_torch.Model(config, params, dtype=getattr(torch, dtype)).to("cuda")
            assert moved.device.type == "cuda"
            for return_attention in (True, False):
                got = run(moved, SRC, TGT, return_attention=return_attention)
                on_cpu = run(cpu, SRC, TGT, return_attention=return_attention)
                for name, value in got.items():
                    assert value.device.type == "cuda", name
                    assert torch.equal(value.isnan().cpu(), on_cpu[name].isnan()), name
                    assert_close(value, expected[name], tolerance(dtype, "cuda"), tensor=name, backend="torch",
                                 device="cuda", dtype=dtype, config=config)


def compile_skip_reason():
    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:  # the inductor backend needs a C++ compiler and its Python deps
        return f"torch.compile unavailable: {exc}"
    return None


@pytest.mark.skipif(compile_skip_reason() is not None, reason=str(compile_skip_reason()))
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("fill", [-math.inf, -1e9], ids=["minus-inf-fill", "finite-fill"])
def test_torch_compile_matches_eager(fill):
    """One small compile per fill (about 30 s cold on two cores; inductor caches it afterwards):
    the fast path, including both branches of the empty-row fix-up (NaN for a -inf fill, the mean
    of v for a finite one), compiled == eager == the oracle, NaN positions bit for bit."""
    config = preset("llmhub", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                    src_vocab_size=12, tgt_vocab_size=12, max_len=8, mask_fill=fill)
    model = impl_torch.Model(config, dtype=torch.float32)
    src, tgt = torch.from_numpy(SRC), torch.from_numpy(TGT)  # source row 2 is all padding
    compiled = torch.compile(model)
    eager = run(model, src, tgt, return_attention=False)
    got = run(compiled, src, tgt, return_attention=False)
    assert list(got) == list(eager)
    assert eager["logits"][2].isnan().all() == math.isinf(fill) and not eager["logits"][:2].isnan().any()
    expected = tensors_of(impl_numpy.Model(config, init_params(config))(SRC, TGT))
    for name, value in got.items():
        assert torch.equal(value.isnan(), eager[name].isnan()), name
        torch.testing.assert_close(value.nan_to_num(), eager[name].nan_to_num(), rtol=1e-5, atol=1e-5)
        assert_close(value, expected[name], tolerance("float32"), tensor=name, backend="torch (compiled)",
                     dtype="float32", config=config)
    with pytest.raises(ValueError, match="src_ids: token id 12 out of range"):
        compiled(torch.tensor([[1, 12]]), tgt[:1])


def test_model_is_an_ordinary_module():
    config = preset("paper")
    model = impl_torch.Model(config, dtype=torch.float32)
    names = {name for name, _ in model.named_modules()}
    assert {"encoder.layers.0.self_attn.q_proj", "decoder.layers.1.cross_attn", "output"} <= names
    # One trainable parameter per canonical key: the shared embedding is registered once.
    parameters = dict(model.named_parameters())
    assert sorted(parameters) == sorted(param_shapes(config))
    assert all(p.requires_grad and p.is_leaf for p in parameters.values())
    # There is no dropout: train() and eval() compute the same thing.
    evaluated = run(model.eval(), SRC, TGT)
    assert_identical(run(model.train(), SRC, TGT), evaluated, "train() vs eval()")
