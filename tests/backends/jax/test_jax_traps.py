"""JAX's traps, each closed, each with a test that fails if it is reopened.

Every test here also shows the trap itself (a "control"): the naive JAX code on the same input
gives a plausible wrong answer. That proves the input has teeth; the assertion after it proves the
backend avoids the trap.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import impl_jax
import impl_numpy
import impl_numpy.model
from conformance import InputError, init_params
from conformance.core import checkpoint
from conformance.check.compare import assert_close, compare
from conformance.core.presets import FLOAT32_MIN
from conformance.check.tolerances import tolerance
from impl_jax import compiled
from impl_jax.model import LayerNorm, Model
from batches import SRC, TGT, small


def error_of(call) -> InputError:
    with pytest.raises(InputError) as info:
        call()
    return info.value


# -- Ids, masks, params and dtypes are checked on the host -------------------------------------

BAD_INPUTS = [
    (dict(src_ids=np.array([[1, 2, 16]])), "src_ids"),  # out of range
    (dict(tgt_ids=np.array([[1, -2, 3]])), "tgt_ids"),  # negative
    (dict(src_ids=np.array([[1.0, 2.0]])), "src_ids"),  # float ids
    (dict(src_ids=np.array([1, 2, 3])), "src_ids"),  # rank 1
    (dict(src_ids=np.zeros((0, 3), dtype=int)), "src_ids"),  # empty batch
    (dict(tgt_ids=np.zeros((1, 0), dtype=int)), "tgt_ids"),  # zero length
    (dict(src_ids=np.ones((1, 9), dtype=int)), "src_ids"),  # beyond max_len
    (dict(src_ids=[[1, 2], [3]]), "src_ids"),  # ragged
    (dict(tgt_ids=np.ones((2, 3), dtype=int)), "tgt_ids"),  # batch mismatch
    (dict(src_mask=np.ones((1, 1, 1, 4), dtype=bool)), "src_mask"),
    (dict(src_mask=np.ones((1, 1, 3), dtype=bool)), "src_mask"),
    (dict(src_mask=np.ones((1, 1, 1, 3), dtype=np.int64)), "src_mask"),
    (dict(tgt_mask=np.ones((1, 1, 3, 2), dtype=bool)), "tgt_mask"),
    (dict(tgt_mask=np.ones((1, 3, 3, 3), dtype=bool)), "tgt_mask"),
    (dict(src_ids=np.array([[3, 4, 0]]), src_mask=np.ones((1, 1, 1, 3), dtype=bool)), "src_mask"),  # sees padding
    (dict(tgt_mask=np.ones((1, 2, 3, 3), dtype=bool)), "tgt_mask"),  # sees the future
    (dict(src_mask=[[[[True, True, True]]], [[[True]]]]), "src_mask"),  # ragged
    (dict(tgt_mask=[[[[True], [True, True], [True, True, True]]]]), "tgt_mask"),  # ragged
]


def as_jax(bad: dict) -> dict:
    """The same bad input as a JAX array, where it can be one (ragged lists cannot)."""
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in bad.items()}


@pytest.mark.parametrize("kind", ["numpy", "jax"])
@pytest.mark.parametrize("bad, argument", BAD_INPUTS, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_inputs_raise_the_numpy_backends_error_word_for_word(bad, argument, kind):
    config = small()
    reference = impl_numpy.Model(config, init_params(config))
    model = impl_jax.Model(config)
    call = dict(src_ids=np.array([[3, 4, 5]]), tgt_ids=np.array([[2, 3, 4]]))
    given = as_jax(bad) if kind == "jax" else bad
    expected = error_of(lambda: reference(**{**call, **{k: np.asarray(v) if isinstance(v, jax.Array) else v
                                                        for k, v in given.items()}}))
    got = error_of(lambda: model(**{**call, **given}))
    assert (got.argument, str(got)) == (expected.argument, str(expected)) and got.argument == argument


def test_out_of_range_ids_would_be_clamped_by_jax_but_are_refused():
    config = small()
    model = impl_jax.Model(config)
    table = model.encoder.embedding.weight[...]  # (16, D)
    # The trap: JAX indexing clamps id 16 to row 15 and wraps -1 to row 15; no error, a plausible row.
    np.testing.assert_array_equal(np.asarray(table[jnp.array([16, -1])]), np.asarray(table[jnp.array([15, 15])]))
    assert not np.isnan(np.asarray(jnp.take(table, jnp.array([16]), axis=0, mode="clip"))).any()
    for ids in ([[3, 16]], [[3, -1]], jnp.array([[3, 16]]), jnp.array([[3, -1]])):
        with pytest.raises(InputError, match="src_ids: .*(out of range|negative)"):
            model.encode(ids)


def bad_params(config):
    params = init_params(config)
    shape = dict(params, **{"encoder.embedding.weight": params["encoder.embedding.weight"][:, :4]})
    inf = dict(params, **{"decoder.layers.0.ffn.linear1.bias": np.full(24, np.inf)})
    nan = dict(params, **{"output.weight": np.full((16, 16), np.nan)})
    missing = {k: v for k, v in params.items() if k != "output.bias"}
    extra = dict(params, **{"encoder.norm.weight": np.ones(16)})
    mixed = dict(params, **{"output.bias": params["output.bias"].astype(np.float32)})
    integer = {k: v.astype(np.int32) for k, v in params.items()}
    return {"shape": shape, "inf": inf, "nan": nan, "missing": missing, "extra": extra, "mixed": mixed,
            "integer": integer}


@pytest.mark.parametrize("kind", ["numpy", "jax"])
@pytest.mark.parametrize("problem", ["shape", "inf", "nan", "missing", "extra", "mixed", "integer"])
def test_bad_params_raise_the_numpy_backends_error_word_for_word(problem, kind):
    config = small()
    params = bad_params(config)[problem]
    if kind == "jax":  # float64 becomes float32 (x64 is off); "mixed" mixes float32 and bfloat16
        mixed = {np.dtype(np.float32): jnp.bfloat16} if problem == "mixed" else {}
        params = {k: jnp.asarray(v, dtype=jnp.float32 if v.dtype == np.float64 else mixed.get(v.dtype, v.dtype))
                  for k, v in params.items()}
    expected = error_of(lambda: impl_numpy.Model(config, {k: np.asarray(v) for k, v in params.items()}))
    got = error_of(lambda: impl_jax.Model(config, params, dtype="float32"))
    assert (got.argument, str(got)) == (expected.argument, str(expected)) == ("params", str(expected))


@pytest.mark.parametrize("dtype", ["int32", np.int64, "complex64", ml_dtypes.float8_e4m3fn, "bogus", object])
def test_dtypes_the_backend_cannot_run_are_refused(dtype):
    """The message of every backend (`conformance.core.inputs.check_dtype`), for names that are not
    dtypes at all too."""
    error = error_of(lambda: impl_jax.Model(small(), dtype=dtype))
    name = dtype if dtype == "bogus" else np.dtype(dtype).name
    assert (error.argument, str(error)) == (
        "dtype", f"dtype: the jax backend cannot run {name}; it supports float32, float64, float16, bfloat16")


def overflowing(config, value):
    params = init_params(config)
    params["encoder.layers.1.ffn.linear2.weight"][3, 4] = value
    return params


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_weights_that_overflow_the_cast_are_refused(kind):
    """Finiteness holds for the weights the model computes with, cast on the host or on the
    device: 1e5 is inf in float16, 1e39 is inf in float32 (the NumPy backend's error, word for word)."""
    config = small()
    convert = (lambda p: {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}) if kind == "jax" else (lambda p: p)
    expected = error_of(lambda: impl_numpy.Model(config, overflowing(config, 1e39), dtype="float32"))
    assert str(expected) == ("params: parameter 'encoder.layers.1.ffn.linear2.weight' has 1 NaN or infinite "
                             "value(s) out of 384")
    if kind == "numpy":  # float32 JAX arrays cannot hold 1e39 in the first place
        got = error_of(lambda: impl_jax.Model(config, overflowing(config, 1e39), dtype="float32"))
        assert (got.argument, str(got)) == (expected.argument, str(expected))
    for dtype, value in (("float16", 1e5), ("bfloat16", 1e39 if kind == "numpy" else 3.4e38)):
        got = error_of(lambda: impl_jax.Model(config, convert(overflowing(config, value)), dtype=dtype))
        assert (got.argument, str(got)) == (expected.argument, str(expected)), dtype
    impl_jax.Model(config, convert(overflowing(config, 6e4)), dtype="float16")  # the control: finite


# -- LayerNorm: epsilon from the config, the variance as the oracle computes it -----------------


def layer_norm_pair(config, x64: np.ndarray, dtype=np.float32):
    rng = np.random.default_rng(0)
    d = x64.shape[-1]
    params = {"n.weight": 1 + 0.2 * rng.standard_normal(d), "n.bias": 0.2 * rng.standard_normal(d)}
    expected = impl_numpy.model.LayerNorm(config, params, "n")(x64)
    norm = LayerNorm(config, {k: jnp.asarray(v, dtype=dtype) for k, v in params.items()}, "n")
    got = norm(jnp.asarray(x64, dtype=dtype))
    return got, expected, params


@pytest.mark.parametrize("form", ["standard", "std-eps"])
def test_layer_norm_keeps_its_precision_for_inputs_with_a_large_mean(form):
    config = small(layer_norm_form=form)
    rng = np.random.default_rng(1)
    # |mean| = 1000 std: the two-pass variance keeps float32 accuracy (~5e-5 here), the fast one
    # E[x^2] - E[x]^2 cancels 6 of float32's 7 digits. Exactly representable in float32.
    x = 1000.0 + rng.standard_normal((4, 64))
    x = x.astype(np.float32).astype(np.float64)
    got, expected, params = layer_norm_pair(config, x)
    tol = tolerance("float32")
    assert_close(got, expected, tol, tensor=f"LayerNorm[{form}]", backend="jax", dtype="float32")

    # The control: Flax's own LayerNorm, with the right epsilon but its default fast variance
    # E[x^2] - E[x]^2, is far off on the same float32 input (its default epsilon is 1e-6, too).
    assert nnx.LayerNorm(64, rngs=nnx.Rngs(0)).epsilon == 1e-6
    flax_norm = nnx.LayerNorm(64, epsilon=1e-5, rngs=nnx.Rngs(0))
    assert flax_norm.use_fast_variance
    flax_norm.scale[...] = jnp.asarray(params["n.weight"], jnp.float32)
    flax_norm.bias[...] = jnp.asarray(params["n.bias"], jnp.float32)
    standard = impl_numpy.model.LayerNorm(small(), params, "n")(x)  # what Flax means to compute
    assert not compare(flax_norm(jnp.asarray(x, jnp.float32)), standard, tol).passed


@pytest.mark.parametrize("form", ["standard", "std-eps"])
@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-12])
def test_layer_norm_takes_epsilon_from_the_config(form, eps):
    # A tiny spread makes epsilon visible: var ~ 1e-8, so 1e-5 and 1e-12 give different outputs.
    rng = np.random.default_rng(2)
    x = 1e-4 * rng.standard_normal((4, 32))
    config = small(layer_norm_form=form, layer_norm_eps=eps)
    with impl_jax.enable_x64():
        got, expected, _ = layer_norm_pair(config, x, dtype=np.float64)
        assert_close(got, expected, tolerance("float64"), tensor=f"LayerNorm[{form}, eps={eps}]", backend="jax",
                     dtype="float64")
        # The control: any other epsilon is visibly different on this input.
        for other in {1e-5, 1e-6, 1e-12} - {eps}:
            wrong, _, _ = layer_norm_pair(config.replace(layer_norm_eps=other), x, dtype=np.float64)
            assert not compare(wrong, expected, tolerance("float32")).passed


# -- Matmul precision ---------------------------------------------------------------------------


def test_every_matmul_in_the_compiled_program_asks_for_highest_precision():
    config = small("hf-marian")  # tied output: the logits matmul reads the embedding transposed
    model = impl_jax.Model(config)
    src, tgt = SRC.astype(np.int32), TGT.astype(np.int32)
    src_mask, tgt_mask = impl_jax.make_masks(config, src, tgt)
    memory = np.zeros((3, 6, 16), np.float32)
    texts = [
        compiled.lower(model, Model._encode, (src, src_mask, None), model.device, return_attention=True).as_text(),
        compiled.lower(model, Model._decode, (tgt, tgt_mask, memory, src_mask, None, None), model.device,
                       return_attention=False).as_text(),
    ]
    dots = [line for text in texts for line in text.splitlines() if "stablehlo.dot_general" in line]
    # Encoder layers: q, k, v, o, scores, weights x values, 2 FFN; decoder layers: twice the
    # attention, plus the FFN; then the logits.
    assert len(dots) == 2 * 8 + 2 * 14 + 1
    loose = [line.strip()[:160] for line in dots if "precision = [HIGHEST, HIGHEST]" not in line]
    assert not loose, f"matmuls without HIGHEST precision: {loose}"


def test_precision_settings_are_reported_and_full_precision_is_scoped():
    before = jax.config.jax_default_matmul_precision
    settings = impl_jax.precision_settings()
    assert settings["model_matmul_precision"].startswith("HIGHEST")
    assert settings["jax_enable_x64"] is False
    with impl_jax.full_precision():
        assert impl_jax.precision_settings()["jax_default_matmul_precision"] == "highest"
    assert jax.config.jax_default_matmul_precision == before


# -- Fully masked rows follow the config ---------------------------------------------------------


def test_minus_inf_fill_gives_nan_rows_that_spread_exactly_as_in_the_oracle():
    # Source row 2 is all padding: its encoder rows have no key. Target padding on the queries
    # blanks padded target rows too, and their NaN reaches the next layer as 0 * NaN.
    for config in (small("llmhub"), small("llmhub", tgt_pad_mask="queries")):
        params = init_params(config)
        oracle = impl_numpy.Model(config, params)(SRC, TGT)
        out = impl_jax.Model(config, params, dtype="float32")(SRC, TGT)
        assert np.isnan(np.asarray(out.attention["encoder.0.self"][2])).all()
        assert np.isnan(np.asarray(out.logits[2])).all()
        for name, expected in [*oracle.attention.items(), *oracle.intermediates.items(), ("logits", oracle.logits)]:
            got = out.logits if name == "logits" else {**out.attention, **out.intermediates}[name]
            np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(expected), err_msg=name)
        assert np.isnan(oracle.logits[0]).any() == (config.tgt_pad_mask == "queries")


def test_softmax_and_attention_follow_the_fill_on_a_fully_masked_row():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 2, 4)) for _ in range(3))
    mask = np.array([[True, False], [False, False]])[None, None]  # row 1 has no key
    for fill in (-math.inf, -1e9, -1e4, FLOAT32_MIN):
        expected_out, expected_w = impl_numpy.scaled_dot_product_attention(q, k, v, mask, fill)
        with impl_jax.enable_x64():
            out, w = impl_jax.scaled_dot_product_attention(*map(jnp.asarray, (q, k, v, mask)), fill)
            np.testing.assert_array_equal(np.isnan(np.asarray(w)), np.isnan(expected_w))
            np.testing.assert_allclose(np.asarray(w), expected_w, rtol=1e-15, atol=0)
            np.testing.assert_allclose(np.asarray(out), expected_out, rtol=1e-14, atol=1e-15)
        if math.isinf(fill):
            assert np.isnan(np.asarray(w)[0, 0, 1]).all()
        else:
            np.testing.assert_array_equal(np.asarray(w)[0, 0, 1], [0.5, 0.5])
    # The control: jax.nn.softmax's own masking turns the same row into something else.
    scores = jnp.asarray(rng.standard_normal((2, 2)))
    own = jax.nn.softmax(scores, where=jnp.asarray(mask[0, 0]))
    assert not np.allclose(np.asarray(own)[1], 0.5)


def test_fully_masked_rows_stay_nan_in_compiled_code_for_every_small_shape():
    """Compiled, the naive softmax exp(s - max) / sum gives arbitrary finite numbers instead of
    NaN for some fully masked rows: XLA:CPU folds the reduction over a single key and then
    miscompiles exp(-inf - (-inf)). `jax.nn.softmax` does the same. Every small shape and mask
    layout, jitted, must match the oracle's NaN positions and values."""
    rng = np.random.default_rng(4)
    attention = jax.jit(impl_jax.scaled_dot_product_attention, static_argnums=4)
    for heads, tq, tk in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 1, 2), (2, 3, 2), (2, 2, 3)]:
        for mask_shape in [(1, 1, 1, 1), (2, 1, 1, tk), (2, 1, tq, tk)]:
            q, k, v = (rng.standard_normal((2, heads, n, 4)).astype(np.float32) for n in (tq, tk, tk))
            mask = np.zeros(mask_shape, dtype=bool)
            mask.flat[::3] = True  # some rows see keys, some see none
            expected_out, expected_w = impl_numpy.scaled_dot_product_attention(
                *(x.astype(np.float64) for x in (q, k, v)), mask, -math.inf)
            out, w = attention(q, k, v, mask, -math.inf)
            where = f"H={heads} Tq={tq} Tk={tk} mask {mask_shape}"
            for got, expected in ((w, expected_w), (out, expected_out)):
                got = np.asarray(got)
                np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=where)
                finite = ~np.isnan(expected)
                np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-6, err_msg=where)


def test_a_single_padding_token_gives_the_oracles_nan():
    # The smallest fully masked case, found by the conformance suite: S = T = 1.
    config = small(mask_fill=-math.inf, n_encoder_layers=1, n_decoder_layers=1, cross_attn_src_mask=False)
    params = init_params(config)
    src, tgt = np.array([[0]]), np.array([[1]])
    oracle = impl_numpy.Model(config, params)(src, tgt)
    model = impl_jax.Model(config, params, dtype="float32")
    for out in (model(src, tgt), model(src, tgt, *impl_numpy.make_masks(config, src, tgt))):
        for name, expected in [*oracle.attention.items(), *oracle.intermediates.items(), ("logits", oracle.logits)]:
            got = np.asarray(out.logits if name == "logits" else {**out.attention, **out.intermediates}[name])
            np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=name)
            np.testing.assert_allclose(got[~np.isnan(got)], expected[~np.isnan(expected)], rtol=1e-4, atol=1e-4,
                                       err_msg=name)


@pytest.mark.parametrize("dtype, fill", [("float16", -1e9), ("float16", FLOAT32_MIN), ("bfloat16", FLOAT32_MIN)])
def test_half_precision_softmax_keeps_a_finite_fill_finite(dtype, fill):
    config = small(mask_fill=fill)
    # The control: the fill does not survive a cast to the half dtype (-1e9 fits bfloat16).
    with np.errstate(over="ignore"):
        assert np.isinf(np.asarray(fill).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16))
    out = impl_jax.Model(config, dtype=dtype)(SRC, TGT)
    empty = np.asarray(out.attention["encoder.0.self"][2]).astype(np.float64)  # no key to attend to
    np.testing.assert_allclose(empty, 1 / SRC.shape[1], rtol=0, atol=1e-3)
    assert not np.isnan(np.asarray(out.logits).astype(np.float64)).any()


def test_finite_fill_gives_a_uniform_average_over_all_keys():
    config = small()
    out = impl_jax.Model(config)(SRC, TGT)
    np.testing.assert_allclose(np.asarray(out.attention["encoder.0.self"][2]), 1 / SRC.shape[1], rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(out.attention["decoder.1.cross"][2]), 1 / SRC.shape[1], rtol=0, atol=1e-7)


# -- float64 needs x64, which is never switched on behind the user's back --------------------------


def test_float64_without_x64_is_refused_with_advice(tmp_path):
    if impl_jax.x64_enabled():
        pytest.skip("JAX_ENABLE_X64 is set for this process; the refusal cannot be observed")
    config = small()
    # The control: outside x64, JAX silently computes a float64 request in float32.
    with pytest.warns(UserWarning, match="truncated"):
        assert jnp.asarray(np.ones(2), dtype=jnp.float64).dtype == jnp.float32
    for make in (lambda: impl_jax.Model(config, dtype="float64"),
                 lambda: impl_jax.Model(config, init_params(config))):  # float64 params, no dtype
        error = error_of(make)
        assert error.argument == "dtype" and "impl_jax.enable_x64()" in str(error)
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, config, init_params(config))
    assert error_of(lambda: impl_jax.load(path)).argument == "dtype"
    assert impl_jax.load(path, dtype="float32").dtype == np.float32


def test_enable_x64_is_scoped_and_a_float64_model_refuses_to_run_outside_it():
    if impl_jax.x64_enabled():
        pytest.skip("JAX_ENABLE_X64 is set for this process")
    config = small()
    with impl_jax.enable_x64():
        assert impl_jax.x64_enabled()
        model = impl_jax.Model(config, init_params(config))
        assert model.dtype == np.float64
        encoded = model.encode(SRC)
        assert encoded.memory.dtype == np.float64
    assert not impl_jax.x64_enabled() and not jax.config.jax_enable_x64
    for call in (lambda: model(SRC, TGT), lambda: model.encode(SRC), lambda: model.decode(TGT, encoded)):
        error = error_of(call)
        assert error.argument == "dtype" and "enable_x64" in str(error)


def test_decode_refuses_memory_of_another_dtype_or_shape():
    """The check every backend shares (`conformance.core.inputs.check_memory`), word for word."""
    config = small()
    params = init_params(config)
    model, reference = impl_jax.Model(config, params, dtype="float32"), impl_numpy.Model(config, params, dtype="float32")
    encoded = impl_jax.Model(config, dtype="bfloat16").encode(SRC)
    memory = np.asarray(model.encode(SRC).memory)  # (3, 6, 16) float32
    for bad in (encoded.memory, memory[..., :8], memory[:, :0], memory[:, 0], np.concatenate([memory] * 2, 1)):
        expected = error_of(lambda: reference.decode(TGT, type(encoded)(memory=np.asarray(bad), src_mask=encoded.src_mask)))
        got = error_of(lambda: model.decode(TGT, type(encoded)(memory=jnp.asarray(bad), src_mask=encoded.src_mask)))
        assert (got.argument, str(got)) == (expected.argument, str(expected)) and got.argument == "encoded"
