"""The NumPy reference: masks, every switch is live, dtypes, fully masked rows, input errors."""

import math

import numpy as np
import pytest

import impl_numpy
import impl_numpy.model
from conformance import InputError, ModelConfig, init_params
from conformance.check.compare import assert_close
from conformance.check.tolerances import tolerance
from batches import SRC, TGT, small

T, F = True, False


def test_masks_equal_hand_written_arrays():
    src = np.array([[5, 6, 0], [7, 0, 0]])
    tgt = np.array([[2, 3, 0], [2, 0, 0]])
    expected_src = np.array([[T, T, F], [T, F, F]])[:, None, None, :]
    keys = np.array([
        [[T, F, F], [T, T, F], [T, T, F]],
        [[T, F, F], [T, F, F], [T, F, F]],
    ])[:, None]
    queries = np.array([
        [[T, F, F], [T, T, F], [F, F, F]],
        [[T, F, F], [F, F, F], [F, F, F]],
    ])[:, None]
    causal_only = np.broadcast_to(np.tril(np.ones((3, 3), bool)), (2, 1, 3, 3))
    for side, expected_tgt in (("keys", keys), ("queries", queries), ("none", causal_only)):
        config = ModelConfig(tgt_pad_mask=side, pad_id=0)
        src_mask, tgt_mask = impl_numpy.make_masks(config, src, tgt)
        assert src_mask.dtype == np.bool_ and tgt_mask.dtype == np.bool_
        np.testing.assert_array_equal(src_mask, expected_src)
        np.testing.assert_array_equal(tgt_mask, expected_tgt)
    np.testing.assert_array_equal(impl_numpy.causal_mask(3)[0, 0], np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(impl_numpy.padding_mask(np.array([[1, 2, 1]]), 1)[0, 0, 0], [F, T, F])


def logits(config, seed=0):
    return impl_numpy.Model(config, init_params(config, seed=seed))(SRC, TGT).logits


SWITCHES = [
    ("norm_placement", "post", "pre"),
    ("final_encoder_norm", False, True),
    ("final_decoder_norm", False, True),
    ("layer_norm_eps", 1e-5, 1e-6),
    ("layer_norm_eps", 1e-5, 1e-12),
    ("layer_norm_form", "standard", "std-eps"),
    ("scale_embedding", True, False),
    ("position", "sinusoid-interleaved", "sinusoid-split"),
    ("position", "sinusoid-interleaved", "table"),
    ("share_embeddings", False, True),
    ("tie_output", False, True),
    ("qkv_bias", True, False),
    ("out_proj_bias", True, False),
    ("mask_fill", -1e9, -math.inf),
    ("tgt_pad_mask", "keys", "queries"),
    ("tgt_pad_mask", "keys", "none"),
    ("cross_attn_src_mask", True, False),
    ("pad_id", 0, 1),
    ("activation", "relu", "gelu"),
    ("activation", "gelu", "gelu-tanh"),
    ("activation", "relu", "silu"),
    ("output_bias", True, False),
    ("final_logits_bias", False, True),
]


# Each switch on both a post-LN and a pre-LN base (norm_placement itself once).
SWITCH_CASES = [(norm, *switch) for switch in SWITCHES for norm in ("post", "pre")
                if not (switch[0] == "norm_placement" and norm == "pre")]


@pytest.mark.parametrize("norm, field, base_value, other_value", SWITCH_CASES, ids=lambda v: str(v))
def test_every_switch_changes_the_logits(field, base_value, other_value, norm):
    base = small(norm_placement=norm).replace(**{field: base_value})
    other = base.replace(**{field: other_value})
    a, b = logits(base), logits(other)
    assert a.shape == b.shape
    same_nan = np.array_equal(np.isnan(a), np.isnan(b))
    finite = ~(np.isnan(a) | np.isnan(b))
    diff = np.abs(a[finite] - b[finite]).max() if finite.any() else 0.0
    assert not same_nan or diff > 1e-12, f"{field}: {base_value} -> {other_value} left the logits unchanged"


def test_switch_effects_are_where_they_should_be():
    base = small()
    # A -inf fill makes exactly the all-padding source row NaN; a finite fill keeps it finite.
    assert np.isnan(logits(base.replace(mask_fill=-math.inf))[2]).all()
    assert not np.isnan(logits(base.replace(mask_fill=-math.inf))[:2]).any()
    assert np.isfinite(logits(base)).all()
    # Padding on the queries changes only the rows of padded target positions.
    keys, queries = logits(base), logits(base.replace(tgt_pad_mask="queries"))
    np.testing.assert_array_equal(keys[1, :], queries[1, :])  # no pad (pad_id 0) in row 1
    assert not np.allclose(keys[0, 3:], queries[0, 3:])
    np.testing.assert_allclose(keys[0, :3], queries[0, :3], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["default", "paper", "from-scratch", "llmhub", "hyunwoongko", "sublayer-norm",
                                  "pre-ln-tutorial", "torch-nn-transformer", "hf-marian", "annotated-transformer"])
def test_float32_agrees_with_float64_within_the_table(name):
    config = small(name)
    params = init_params(config, seed=1)
    oracle = impl_numpy.Model(config, params)(SRC, TGT)
    model32 = impl_numpy.Model(config, params, dtype=np.float32)
    out = model32(SRC, TGT)
    assert out.logits.dtype == np.float32
    tol = tolerance("float32")
    kwargs = dict(backend="numpy", dtype="float32", config=config)
    assert_close(out.logits, oracle.logits, tol, tensor="logits", **kwargs)
    assert list(out.attention) == list(oracle.attention)
    assert list(out.intermediates) == list(oracle.intermediates)
    for key in oracle.attention:
        assert out.attention[key].dtype == np.float32
        assert_close(out.attention[key], oracle.attention[key], tol, tensor=key, **kwargs)
    for key in oracle.intermediates:
        assert out.intermediates[key].dtype == np.float32, key
        assert_close(out.intermediates[key], oracle.intermediates[key], tol, tensor=key, **kwargs)


def test_output_names_and_shapes():
    config = small(n_encoder_layers=2, n_decoder_layers=1)
    out = impl_numpy.Model(config, init_params(config))(SRC, TGT)
    B, S, T_ = SRC.shape[0], SRC.shape[1], TGT.shape[1]
    assert out.logits.shape == (B, T_, 16)
    assert {k: v.shape for k, v in out.attention.items()} == {
        "encoder.0.self": (B, 2, S, S), "encoder.1.self": (B, 2, S, S),
        "decoder.0.self": (B, 2, T_, T_), "decoder.0.cross": (B, 2, T_, S),
    }
    assert list(out.intermediates) == [
        "encoder.embeddings", "encoder.0.self_attn", "encoder.0.ffn", "encoder.1.self_attn", "encoder.1.ffn",
        "encoder.output", "decoder.embeddings", "decoder.0.self_attn", "decoder.0.cross_attn", "decoder.0.ffn",
        "decoder.output",
    ]


def test_attention_weights_are_distributions_that_respect_the_mask():
    config = small(tgt_pad_mask="keys")
    out = impl_numpy.Model(config, init_params(config))(SRC[:2], TGT[:2])
    src_mask, tgt_mask = impl_numpy.make_masks(config, SRC[:2], TGT[:2])
    for key, weights in out.attention.items():
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=0, atol=1e-12)
        mask = src_mask if key.startswith("encoder") or key.endswith("cross") else tgt_mask
        assert (np.broadcast_to(~mask, weights.shape) <= (weights == 0)).all(), key


def test_fully_masked_rows_follow_the_fill():
    # Source row 2 is all padding: every encoder query in it has no key to attend to.
    finite = small(mask_fill=-1e9)
    out = impl_numpy.Model(finite, init_params(finite))(SRC, TGT)
    np.testing.assert_allclose(out.attention["encoder.0.self"][2], 1 / SRC.shape[1], rtol=0, atol=1e-15)
    infinite = finite.replace(mask_fill=-math.inf)
    out = impl_numpy.Model(infinite, init_params(infinite))(SRC, TGT)
    assert np.isnan(out.attention["encoder.0.self"][2]).all()
    assert not np.isnan(out.attention["encoder.0.self"][:2]).any()


def test_encode_then_decode_equals_the_forward():
    config = small("pre-ln-tutorial")
    model = impl_numpy.Model(config, init_params(config))
    full = model(SRC, TGT)
    encoded = model.encode(SRC)
    step = model.decode(TGT, encoded)
    np.testing.assert_array_equal(step.logits, full.logits)
    assert list(step.intermediates) == list(full.intermediates)
    for key in full.attention:
        np.testing.assert_array_equal(step.attention[key], full.attention[key])


def test_explicit_masks_equal_derived_masks():
    config = small()
    model = impl_numpy.Model(config, init_params(config))
    src_mask, tgt_mask = model.make_masks(SRC, TGT)
    np.testing.assert_array_equal(model(SRC, TGT, src_mask, tgt_mask).logits, model(SRC, TGT).logits)


def test_no_silent_promotion_in_float32():
    config = small("hf-marian", activation="gelu")
    model = impl_numpy.Model(config, init_params(config, dtype=np.float32))
    out = model(SRC, TGT)
    assert out.logits.dtype == np.float32
    assert all(v.dtype == np.float32 for v in out.intermediates.values())


BAD_INPUTS = [
    (dict(src_ids=np.array([[1, 2, 16]])), "src_ids", "out of range"),
    (dict(tgt_ids=np.array([[1, -2, 3]])), "tgt_ids", "negative"),
    (dict(src_ids=np.array([[1.0, 2.0]])), "src_ids", "integer dtype"),
    (dict(src_ids=np.array([1, 2, 3])), "src_ids", "rank 2"),
    (dict(src_ids=np.zeros((0, 3), dtype=int)), "src_ids", "empty batch"),
    (dict(tgt_ids=np.zeros((1, 0), dtype=int)), "tgt_ids", "zero-length"),
    (dict(src_ids=np.ones((1, 9), dtype=int)), "src_ids", "exceeds max_len=8"),
    (dict(src_ids=[[1, 2], [3]]), "src_ids", "rectangular"),
    (dict(tgt_ids=np.ones((2, 3), dtype=int)), "tgt_ids", "does not match"),
    (dict(src_mask=np.ones((1, 1, 1, 4), dtype=bool)), "src_mask", "(B, H, 1, S)"),
    (dict(src_mask=np.ones((1, 1, 3), dtype=bool)), "src_mask", "(B, H, 1, S)"),
    (dict(src_mask=np.ones((1, 1, 1, 3), dtype=np.int64)), "src_mask", "boolean"),
    (dict(tgt_mask=np.ones((1, 1, 3, 2), dtype=bool)), "tgt_mask", "(B, H, T, T)"),
    (dict(tgt_mask=np.ones((1, 3, 3, 3), dtype=bool)), "tgt_mask", "(B, H, T, T)"),
    (dict(src_mask=[[[[True, True, True]]], [[[True]]]]), "src_mask", "not a rectangular array"),
    (dict(tgt_mask=[[[[True], [True, True], [True, True, True]]]]), "tgt_mask", "not a rectangular array"),
]


@pytest.mark.parametrize("bad, argument, words", BAD_INPUTS, ids=[b[2] for b in BAD_INPUTS])
def test_bad_inputs_raise_input_errors_naming_the_argument(bad, argument, words):
    config = small()
    model = impl_numpy.Model(config, init_params(config))
    call = dict(src_ids=np.array([[3, 4, 5]]), tgt_ids=np.array([[2, 3, 4]]))
    call.update(bad)
    with pytest.raises(InputError) as info:
        model(**call)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"{argument}: ")
    assert words in str(info.value)


def test_bad_params_and_dtypes():
    config = small()
    params = init_params(config)
    with pytest.raises(InputError, match="dtype.*numpy backend cannot run float16"):
        impl_numpy.Model(config, params, dtype=np.float16)
    broken = dict(params)
    broken["encoder.embedding.weight"] = broken["encoder.embedding.weight"][:, :4]
    with pytest.raises(InputError, match="params.*shape"):
        impl_numpy.Model(config, broken)
    broken = dict(params)
    broken["decoder.layers.0.ffn.linear1.bias"] = np.full(24, np.inf)
    with pytest.raises(InputError, match="NaN or infinite"):
        impl_numpy.Model(config, broken)
    with pytest.raises(InputError, match="missing"):
        impl_numpy.Model(config.replace(final_encoder_norm=True), params)


def test_weights_that_overflow_the_cast_are_refused():
    """Finiteness is checked on the weights the model computes with: 1e39 is finite in float64
    and inf in float32, where it would only give inf and NaN logits."""
    config = small()
    params = init_params(config)
    params["encoder.layers.1.ffn.linear2.weight"][3, 4] = 1e39
    impl_numpy.Model(config, params)  # the control: finite in float64
    with pytest.raises(InputError) as info:
        impl_numpy.Model(config, params, dtype="float32")
    assert str(info.value) == ("params: parameter 'encoder.layers.1.ffn.linear2.weight' has 1 NaN or infinite "
                               "value(s) out of 384")


def test_decode_refuses_memory_of_another_dtype_or_shape():
    config = small()
    model = impl_numpy.Model(config, init_params(config))
    memory = model.encode(SRC).memory  # (3, 6, 16) float64
    bad = {
        "memory has dtype float32, the model computes in float64": memory.astype(np.float32),
        "memory must have shape (B, S, D=16) with 1 <= S <= max_len=8, got (3, 6, 8)": memory[..., :8],
        "memory must have shape (B, S, D=16) with 1 <= S <= max_len=8, got (3, 0, 16)": memory[:, :0],
        "memory must have shape (B, S, D=16) with 1 <= S <= max_len=8, got (3, 12, 16)": np.concatenate([memory] * 2, 1),
        "memory must have shape (B, S, D=16) with 1 <= S <= max_len=8, got (3, 16)": memory[:, 0],
    }
    for message, value in bad.items():
        with pytest.raises(InputError) as info:
            model.decode(TGT, impl_numpy.model.Encoded(memory=value, src_mask=model.make_masks(SRC, TGT)[0]))
        assert (info.value.argument, str(info.value)) == ("encoded", f"encoded: {message}")


def test_masks_that_contradict_the_ids_are_refused():
    config = small()
    model = impl_numpy.Model(config, init_params(config))
    src, tgt = np.array([[3, 4, 0]]), np.array([[2, 3, 4]])
    with pytest.raises(InputError, match=r"src_mask: contradicts the ids.*\(0, 0, 0, 2\)"):
        model(src, tgt, src_mask=np.ones((1, 1, 1, 3), bool))
    with pytest.raises(InputError, match=r"tgt_mask: contradicts the ids.*\(0, 0, 0, 1\)"):
        model(src, tgt, tgt_mask=np.ones((1, 1, 3, 3), bool))
    # Narrowing is allowed: hide one more source token from every query.
    narrower = impl_numpy.padding_mask(src, 0) & np.array([True, False, True])
    out = model(src, tgt, src_mask=narrower)
    assert (out.attention["encoder.0.self"][..., 1] == 0).all()
