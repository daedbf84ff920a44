"""The JAX backend against the float64 NumPy oracle: every preset, sampled configs, the key space,
encode/decode, checkpoints bit for bit, compile caching.

Compiling is the expensive part here (about a second per encoder or decoder on this 2-core
machine), so the tests share shapes: every preset runs on the same (SRC, TGT) batch, and executables
are cached across models of the same config (see `impl_jax.compiled`).
"""

from __future__ import annotations

import contextlib

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import impl_jax
import impl_numpy
from conformance import PRESETS, InputError, init_params, param_shapes
from conformance.core import checkpoint
from conformance.check.compare import assert_close
from conformance.suite.strategies import cases, configs
from conformance.check.tolerances import tolerance
from impl_jax.model import Sinusoid
from batches import SRC, TGT, features_like, small


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# Every test that computes runs on each device kind present; here, the CPU.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.skipif(
        not has_gpu(), reason="no JAX GPU device: jax.devices('gpu') found none")),
]


@contextlib.contextmanager
def on(device: str, dtype: str = "float32"):
    """Run on `device`, with 64-bit JAX turned on only when `dtype` is float64."""
    with jax.default_device(jax.devices(device)[0]):
        with impl_jax.enable_x64() if dtype == "float64" else contextlib.nullcontext():
            yield


def assert_matches_oracle(out, oracle, config, dtype: str, device: str):
    """Logits, every attention block and every intermediate, in the oracle's order and dtype."""
    __tracebackhide__ = True
    tol = tolerance(dtype, device)
    kwargs = dict(backend="jax", device=device, dtype=dtype, config=config)
    assert list(out.attention) == list(oracle.attention)
    assert list(out.intermediates) == list(oracle.intermediates)
    for name, expected in [*oracle.attention.items(), *oracle.intermediates.items(), ("logits", oracle.logits)]:
        got = out.logits if name == "logits" else {**out.attention, **out.intermediates}[name]
        assert isinstance(got, jax.Array), name
        assert got.dtype == np.dtype(dtype), f"{name}: {got.dtype}"
        assert_close(got, expected, tol, tensor=name, **kwargs)


# -- Against the oracle -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_match_the_oracle(name, dtype, device):
    config = small(name)
    params = init_params(config, seed=1)
    src = features_like(config) if config.source == "features" else SRC  # Whisper's: log-mel features
    oracle = impl_numpy.Model(config, params)(src, TGT)
    with on(device, dtype):
        out = impl_jax.Model(config, params, dtype=dtype)(src, TGT)
        assert_matches_oracle(out, oracle, config, dtype, device)


# Each example compiles twice; the suite's covering rows already give JAX every switch value
# under ci (conformance/suite/test_coverage.py), so ci draws 8 here, thorough 666.
SAMPLED_EXAMPLES = max(8, settings().max_examples // 3)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=SAMPLED_EXAMPLES)
@given(case=cases(configs(max_layers=1)), dtype=st.sampled_from(["float32", "float64"]))
def test_sampled_configs_match_the_oracle(case, dtype, device):
    """Every switch drawn independently. Each example is a new config, so it compiles; one dtype
    per example and one layer per stack keep that to two small compiles."""
    params = case.params()
    oracle = impl_numpy.Model(case.config, params)(case.src_ids, case.tgt_ids)
    with on(device, dtype):
        out = impl_jax.Model(case.config, params, dtype=dtype)(case.src_ids, case.tgt_ids)
        assert_matches_oracle(out, oracle, case.config, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["hf-marian", "annotated-transformer"])
def test_half_precision_matches_the_oracle_at_its_own_tolerance(name, dtype, device):
    config = small(name)
    params = init_params(config, seed=1)
    oracle = impl_numpy.Model(config, params)(SRC[:2], TGT[:2])
    with on(device, dtype):
        out = impl_jax.Model(config, params, dtype=dtype)(SRC[:2], TGT[:2])
        assert_matches_oracle(out, oracle, config, dtype, device)


# -- The key space ----------------------------------------------------------------------------


def flat_params(model) -> dict[str, tuple]:
    return {".".join(map(str, path)): tuple(v[...].shape)
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flattened_param_state_is_exactly_the_canonical_key_space(name):
    for config in (small(name), small(name, position="table", relative_bias_per_layer=False, n_encoder_layers=1,
                                      n_decoder_layers=0)):
        model = impl_jax.Model(config)
        assert flat_params(model) == param_shapes(config)
        # Shared and tied tables are one Param each, not copies.
        assert len(jax.tree.leaves(nnx.state(model, nnx.Param))) == len(param_shapes(config))
        others = nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))
        tables = {"encoder.position.table", "decoder.position.table"}
        if config.position == "relative":  # T5's bucket of every key-minus-query offset, precomputed
            tables = {"encoder.position.buckets", "decoder.position.buckets"}
        expected_constants = set() if config.position == "table" else tables
        assert {".".join(map(str, path)) for path, _ in others} == expected_constants
        assert all(isinstance(v, Sinusoid) for _, v in others)


@given(config=configs())
def test_flattened_param_state_matches_for_sampled_configs(config):
    model = impl_jax.Model(config)
    assert flat_params(model) == param_shapes(config)
    assert set(model.params) == set(param_shapes(config))


def test_params_are_the_given_values_and_equal_checkpoint_names():
    config = small("paper")
    params = init_params(config, dtype=np.float32)
    model = impl_jax.Model(config, params)
    assert list(model.params) == list(param_shapes(config))  # checkpoint order
    for name, value in model.params.items():
        np.testing.assert_array_equal(np.asarray(value), params[name])


# -- Checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_checkpoint_to_jax_to_checkpoint_is_bit_exact(tmp_path, dtype):
    config = small("hf-marian", position="table")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    source, copy = tmp_path / "source.safetensors", tmp_path / "copy.safetensors"
    checkpoint.save(source, config, init_params(config, seed=3, dtype=np_dtype))
    with on("cpu", dtype):
        model = impl_jax.load(source)
        assert model.dtype == np.dtype(np_dtype)
        impl_jax.save(model, copy)
    assert copy.read_bytes() == source.read_bytes()


def test_load_casts_on_request(tmp_path):
    config = small()
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, config, init_params(config))  # float64 on disk
    model = impl_jax.load(path, dtype="float32")  # no x64 needed for a float32 model
    assert model.dtype == np.float32
    expected = init_params(config)
    for name, value in model.params.items():
        np.testing.assert_array_equal(np.asarray(value), expected[name].astype(np.float32))


def test_params_may_be_jax_arrays():
    config = small()
    params = {k: jax.numpy.asarray(v) for k, v in init_params(config, dtype=np.float32).items()}
    a = impl_jax.Model(config, params)(SRC, TGT).logits
    b = impl_jax.Model(config, {k: np.asarray(v) for k, v in params.items()})(SRC, TGT).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- The call ---------------------------------------------------------------------------------


def test_output_names_and_shapes():
    out = impl_jax.Model(small())(SRC, TGT)
    B, S, T_ = SRC.shape[0], SRC.shape[1], TGT.shape[1]
    assert out.logits.shape == (B, T_, 16)
    assert {k: v.shape for k, v in out.attention.items()} == {
        "encoder.0.self": (B, 2, S, S), "encoder.1.self": (B, 2, S, S),
        "decoder.0.self": (B, 2, T_, T_), "decoder.0.cross": (B, 2, T_, S),
        "decoder.1.self": (B, 2, T_, T_), "decoder.1.cross": (B, 2, T_, S),
    }
    assert list(out.attention) == ["encoder.0.self", "encoder.1.self", "decoder.0.self", "decoder.0.cross",
                                   "decoder.1.self", "decoder.1.cross"]
    assert list(out.intermediates) == [
        "encoder.embeddings", "encoder.0.self_attn", "encoder.0.ffn", "encoder.1.self_attn", "encoder.1.ffn",
        "encoder.output", "decoder.embeddings", "decoder.0.self_attn", "decoder.0.cross_attn", "decoder.0.ffn",
        "decoder.1.self_attn", "decoder.1.cross_attn", "decoder.1.ffn", "decoder.output",
    ]


def test_encode_then_decode_equals_the_forward():
    config = small("pre-ln-tutorial")
    model = impl_jax.Model(config)
    full = model(SRC, TGT)
    encoded = model.encode(SRC)
    assert encoded.memory.shape == (3, 6, 16) and encoded.src_mask.shape == (3, 1, 1, 6)
    step = model.decode(TGT, encoded)
    np.testing.assert_array_equal(np.asarray(step.logits), np.asarray(full.logits))
    assert list(step.intermediates) == list(full.intermediates)
    assert list(step.attention) == list(full.attention)
    for key in full.attention:
        np.testing.assert_array_equal(np.asarray(step.attention[key]), np.asarray(full.attention[key]))


def test_masks_equal_the_numpy_masks_exactly():
    for side in ("keys", "queries"):
        for pad_id in (0, 1):
            config = small(tgt_pad_mask=side, pad_id=pad_id)
            expected = impl_numpy.make_masks(config, SRC, TGT)
            # NumPy ids give host masks; JAX ids (on the device, or traced) give JAX masks.
            for src, tgt in ((SRC, TGT), (jax.numpy.asarray(SRC), jax.numpy.asarray(TGT))):
                got = impl_jax.make_masks(config, src, tgt)
                for g, e in zip(got, expected):
                    assert isinstance(g, type(src)) and g.dtype == np.bool_ and g.shape == e.shape
                    np.testing.assert_array_equal(np.asarray(g), e)
            traced = jax.jit(lambda s, t: impl_jax.make_masks(config, s, t))(SRC, TGT)
            for g, e in zip(traced, expected):
                np.testing.assert_array_equal(np.asarray(g), e)
    np.testing.assert_array_equal(np.asarray(impl_jax.causal_mask(4)), impl_numpy.causal_mask(4))
    np.testing.assert_array_equal(np.asarray(impl_jax.padding_mask(TGT, 1)), impl_numpy.padding_mask(TGT, 1))


def test_explicit_masks_equal_derived_masks():
    config = small()
    model = impl_jax.Model(config)
    src_mask, tgt_mask = model.make_masks(SRC, TGT)
    np.testing.assert_array_equal(np.asarray(model(SRC, TGT, src_mask, tgt_mask).logits),
                                  np.asarray(model(SRC, TGT).logits))
    # Per-head masks (B, H, ...) from NumPy arrays are accepted too.
    src_h = np.broadcast_to(np.asarray(src_mask), (3, 2, 1, 6))
    out = model(SRC, TGT, src_h, np.asarray(tgt_mask))
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(model(SRC, TGT).logits))


def test_without_attention_nothing_is_returned_and_the_rest_is_unchanged():
    config = small()
    model = impl_jax.Model(config)
    full, fast = model(SRC, TGT), model(SRC, TGT, return_attention=False)
    assert fast.attention is None
    assert list(fast.intermediates) == list(full.intermediates)
    tol = tolerance("float32")
    for name in full.intermediates:
        assert_close(fast.intermediates[name], full.intermediates[name], tol, tensor=name, backend="jax")
    assert_close(fast.logits, full.logits, tol, tensor="logits", backend="jax")
    # The executable itself returns no attention weights: they are never stored, not dropped later.
    from impl_jax import compiled
    from impl_jax.model import Model
    src_mask = impl_jax.padding_mask(SRC, config.pad_id)
    text = compiled.lower(model, Model._encode, (SRC.astype(np.int32), src_mask, None), model.device,
                          return_attention=False).as_text()
    result_line = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tensor<3x2x6x6x" not in result_line


def test_repeated_calls_give_identical_bits():
    config = small("llmhub")
    model = impl_jax.Model(config)
    a, b = model(SRC, TGT), model(SRC, TGT)
    for name in a.attention:
        assert np.asarray(a.attention[name]).tobytes() == np.asarray(b.attention[name]).tobytes()
    assert np.asarray(a.logits).tobytes() == np.asarray(b.logits).tobytes()


# -- Compilation ------------------------------------------------------------------------------


def test_compiles_once_per_shape_and_shares_across_models():
    config = small(d_ff=40)  # a config no other test compiles
    params = init_params(config, dtype=np.float32)
    impl_jax.clear_cache()  # so that the bound on live executables cannot empty it mid-test
    before = impl_jax.compile_stats()["compiles"]
    model = impl_jax.Model(config, params)
    model(SRC, TGT)
    assert impl_jax.compile_stats()["compiles"] == before + 2  # _encode and _decode
    model(SRC, TGT)
    impl_jax.Model(config, params)(SRC, TGT)  # a new model of the same config shares them
    assert impl_jax.compile_stats()["compiles"] == before + 2
    model(SRC[:, :5], TGT)  # a new source length: both recompile (the memory's shape changed)
    assert impl_jax.compile_stats()["compiles"] == before + 4
    stats = impl_jax.compile_stats()
    assert stats["compile_seconds"] > 0 and stats["trace_seconds"] > 0 and stats["calls"] >= 8


def test_live_executables_are_bounded(monkeypatch):
    """Each XLA:CPU executable holds ~60-120 memory mappings; unbounded, a long test session
    reaches vm.max_map_count and dies with SIGSEGV inside XLA. The cache is emptied at a bound."""
    from impl_jax import compiled

    config = small(d_ff=44)
    model = impl_jax.Model(config, init_params(config, dtype=np.float32))
    expected = np.asarray(model(SRC, TGT).logits)
    impl_jax.clear_cache()
    monkeypatch.setattr(compiled, "MAX_CACHED_EXECUTABLES", 4)
    evictions = impl_jax.compile_stats()["evictions"]
    for src_len in (6, 5, 4, 3):  # each new source length compiles _encode and _decode
        model(SRC[:, :src_len], TGT)
        assert impl_jax.compile_stats()["cached"] <= 4
    assert impl_jax.compile_stats()["evictions"] == evictions + 1
    before = impl_jax.compile_stats()["compiles"]
    np.testing.assert_array_equal(np.asarray(model(SRC, TGT).logits), expected)  # evicted: compiled again
    assert impl_jax.compile_stats()["compiles"] == before + 2

    # The mapping count (Linux) also triggers it: with a zero share, every compile does.
    if compiled.mapping_pressure() is None:
        pytest.skip("no /proc/self/maps here: only the count bound applies")
    monkeypatch.setattr(compiled, "MAX_CACHED_EXECUTABLES", 10_000)
    monkeypatch.setattr(compiled, "MAX_MAP_SHARE", 0.0)
    before = impl_jax.compile_stats()
    model(SRC[:, :2], TGT)  # _encode compiles, leaving the process "over" the share; so _decode
    model(SRC[:, :2], TGT)  # empties the cache first, and so does every later call
    after = impl_jax.compile_stats()
    assert (after["compiles"] - before["compiles"], after["evictions"] - before["evictions"]) == (4, 3)
    impl_jax.clear_cache()


def test_updated_params_are_used_by_the_next_call():
    config = small()
    model = impl_jax.Model(config)
    before = np.asarray(model(SRC, TGT).logits)
    model.output.bias[...] = model.output.bias[...] + 1.0
    np.testing.assert_allclose(np.asarray(model(SRC, TGT).logits), before + 1.0, rtol=0, atol=1e-5)


def test_an_explicit_mask_may_narrow_the_derived_one():
    config = small()
    model = impl_jax.Model(config)
    narrower = impl_numpy.padding_mask(SRC, 0) & np.array([True, False, True, True, True, True])
    out = model(SRC, TGT, src_mask=narrower)
    assert (np.asarray(out.attention["encoder.0.self"][:2, ..., 1]) == 0).all()
    np.testing.assert_array_equal(np.asarray(out.intermediates["encoder.embeddings"]),
                                  np.asarray(model(SRC, TGT).intermediates["encoder.embeddings"]))


def test_traceable_forward_runs_under_jit_and_vmap():
    config = small("hf-marian")
    model = impl_jax.Model(config)
    expected = model(SRC, TGT)
    out = jax.jit(lambda m, s, t: m.traceable_forward(s, t))(model, SRC, TGT)
    assert_close(out.logits, expected.logits, tolerance("float32"), tensor="logits", backend="jax (jit traceable_forward)")
    assert set(out.attention) == set(expected.attention) and set(out.intermediates) == set(expected.intermediates)
    # vmap over a leading axis of two batches: each equals its own call.
    logits = jax.vmap(lambda s, t: model.traceable_forward(s, t, return_attention=False).logits)(
        np.stack([SRC, SRC[::-1]]), np.stack([TGT, TGT[::-1]]))
    assert_close(logits[1], model(SRC[::-1], TGT[::-1]).logits, tolerance("float32"), tensor="logits",
                 backend="jax (vmap traceable_forward)")
    # The checked call refuses to be traced rather than skip its checks.
    with pytest.raises(InputError, match="^src_ids: is traced"):
        jax.jit(lambda m, s, t: m(s, t).logits)(model, SRC, TGT)
