"""impl_torch against the float64 NumPy oracle: every preset, sampled configs, every tensor.

Each comparison covers the logits, every attention block's weights and every intermediate, in
forward order, so a failure names the first tensor that diverged. float32 and float64 both run
the explicit path (weights returned) and the fast path (fused SDPA, no weights).
"""

import math

import numpy as np
import pytest
from hypothesis import given

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
import impl_torch.model  # noqa: E402
from conformance import PRESETS, init_params, param_shapes, preset  # noqa: E402
from conformance.check.compare import assert_close  # noqa: E402
from conformance.core.presets import FLOAT32_MIN  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.core.output import forward_order, tensors_of  # noqa: E402
from conformance.suite.strategies import cases  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402


DTYPES = ("float32", "float64")
SMALL = dict(src_vocab_size=20, tgt_vocab_size=20, d_model=16, n_heads=2, d_ff=32,
             n_encoder_layers=2, n_decoder_layers=2, max_len=8)


def hostile_batch(config):
    """`fixed_batch`'s rows (no padding, trailing, all but one) plus a source row that is all
    padding: its queries have no key, so a -inf fill must give NaN and a finite fill a mean."""
    src, tgt = fixed_batch(config)
    empty = src[:1] if config.source == "features" else np.full((1, src.shape[1]), config.pad_id)  # features: no padding
    src = np.concatenate([src, empty])
    tgt = np.concatenate([tgt, tgt[:1]])
    return src, tgt


def assert_matches_oracle(config, params, src, tgt, dtype, *, return_attention=True):
    """Every tensor of one torch call against the oracle; returns the oracle's tensors."""
    __tracebackhide__ = True
    expected = tensors_of(impl_numpy.Model(config, params)(src, tgt))
    model = impl_torch.Model(config, params, dtype=getattr(torch, dtype))
    with torch.inference_mode():
        got = tensors_of(model(src, tgt, return_attention=return_attention))
    names = [n for n in forward_order(config) if return_attention or not n.endswith((".self", ".cross"))]
    assert sorted(got) == sorted(names), f"torch returned {sorted(set(got) ^ set(names))} differently from {names}"
    path = "explicit" if return_attention else "fast"
    for name in names:
        assert got[name].dtype == getattr(torch, dtype), f"{name} came back as {got[name].dtype}"
        assert_close(got[name], expected[name], tolerance(dtype), tensor=name, backend=f"torch ({path} path)",
                     dtype=dtype, config=config)
    return expected


@pytest.mark.parametrize("return_attention", [True, False], ids=["explicit", "fast"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_matches_the_oracle(name, dtype, return_attention):
    config = preset(name, **SMALL) if name != "default" else preset(name)
    params = init_params(config, seed=3)
    src, tgt = hostile_batch(config)
    expected = assert_matches_oracle(config, params, src, tgt, dtype, return_attention=return_attention)
    # The all-padding source row really is hostile: NaN under -inf, finite under a finite fill.
    assert np.isnan(expected["logits"][-1]).all() == math.isinf(config.mask_fill)
    assert np.isfinite(expected["logits"][:-1]).all()


# Every value of every switch at least once, whatever the sampled configs below happen to draw.
SWITCH_VALUES = [
    ("norm_placement", "pre"), ("final_encoder_norm", True), ("final_decoder_norm", True),
    ("layer_norm_eps", 1e-12), ("layer_norm_form", "std-eps"), ("scale_embedding", False),
    ("position", "sinusoid-split"), ("position", "table"), ("share_embeddings", True), ("tie_output", True),
    ("qkv_bias", False), ("out_proj_bias", False), ("mask_fill", -math.inf), ("mask_fill", -1e4),
    ("mask_fill", FLOAT32_MIN), ("tgt_pad_mask", "queries"), ("cross_attn_src_mask", False), ("pad_id", 1),
    ("activation", "gelu"), ("activation", "gelu-tanh"), ("activation", "silu"), ("output_bias", False),
    ("final_logits_bias", True),
]


@pytest.mark.parametrize("field, value", SWITCH_VALUES, ids=[f"{f}={v}" for f, v in SWITCH_VALUES])
def test_every_switch_value_matches_the_oracle(field, value):
    config = preset("default", **{field: value})
    params = init_params(config, seed=5)
    src, tgt = hostile_batch(config)
    for dtype in DTYPES:
        for return_attention in (True, False):
            assert_matches_oracle(config, params, src, tgt, dtype, return_attention=return_attention)


@given(case=cases())
def test_sampled_configs_match_the_oracle(case):
    params = case.params()
    for dtype in DTYPES:
        for return_attention in (True, False):
            assert_matches_oracle(case.config, params, case.src_ids, case.tgt_ids, dtype,
                                  return_attention=return_attention)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_state_dict_keys_are_exactly_the_canonical_names(name):
    # A stored table where the preset allows one (UMT5's per-layer relative tables need relative positions).
    table = {} if PRESETS[name].get("relative_bias_per_layer") else {"position": "table"}
    config = preset(name, **SMALL, **table) if name != "default" else preset(name)
    model = impl_torch.Model(config, dtype=torch.float32)
    state = model.state_dict()
    assert set(state) == set(param_shapes(config)) and len(state) == len(param_shapes(config))
    for key, shape in param_shapes(config).items():
        assert tuple(state[key].shape) == shape, key
    # Shared and tied tables are one tensor, not copies.
    if config.share_embeddings:
        assert model.decoder.embedding is None
    if config.tie_output:
        assert model.output.weight is None


def test_sinusoid_is_a_buffer_outside_the_state_dict():
    config = preset("paper", **SMALL)
    model = impl_torch.Model(config, dtype=torch.float64)
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"encoder.position.table", "decoder.position.table"}
    assert not set(buffers) & set(model.state_dict())
    # load_state_dict is strict both ways: an extra key or a missing key is refused.
    state = model.state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict({**state, "encoder.position.table": buffers["encoder.position.table"]})
    state.pop("encoder.embedding.weight")
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(state)


def test_default_params_and_dtype_follow_numpy():
    """`params=None` draws `init_params(config)` (float64), and the dtype defaults to theirs."""
    config = preset("default")
    model = impl_torch.Model(config)
    assert model.dtype == torch.float64 and model.device.type == "cpu"
    for key, value in init_params(config).items():
        assert np.array_equal(model.state_dict()[key].numpy(), value), key


def swap_sin_and_cos(monkeypatch):
    original = impl_torch.model.position_table

    def swapped(config, length=None):
        table = original(config, length)
        rows, d_model = table.shape
        if config.position == "sinusoid-interleaved":  # (L, D/2, [sin, cos]) -> (L, D/2, [cos, sin])
            return table.reshape(rows, d_model // 2, 2)[:, :, ::-1].reshape(rows, d_model)
        return np.concatenate([table[:, d_model // 2:], table[:, : d_model // 2]], axis=1)

    monkeypatch.setattr(impl_torch.model, "position_table", swapped)


def layer_norm_eps_ten_times_too_large(monkeypatch):
    original = impl_torch.model.LayerNorm.__init__

    def init(self, config, dtype):
        original(self, config, dtype)
        self.eps *= 10

    monkeypatch.setattr(impl_torch.model.LayerNorm, "__init__", init)


def heads_split_in_the_wrong_order(monkeypatch):
    def split_heads(self, x):
        batch, length, d_model = x.shape
        x = x.view(batch, length, d_model // self.n_heads, self.n_heads)  # (B, L, K, H): wrong
        return x.permute(0, 3, 1, 2)  # (B, H, L, K)

    monkeypatch.setattr(impl_torch.model.MultiHeadAttention, "split_heads", split_heads)


def softmax_over_the_wrong_axis(monkeypatch):
    monkeypatch.setattr(impl_torch.model, "softmax", lambda scores: torch.softmax(scores, dim=-2))


BREAKS = [
    (swap_sin_and_cos, "float32"), (swap_sin_and_cos, "float64"),
    # Ten times the epsilon moves a LayerNorm output by ~eps / var ~ 1e-5 relative here: far
    # beyond float64's tolerance, but below float32's, which cannot see this break at all.
    (layer_norm_eps_ten_times_too_large, "float64"),
    (heads_split_in_the_wrong_order, "float32"), (heads_split_in_the_wrong_order, "float64"),
    (softmax_over_the_wrong_axis, "float32"), (softmax_over_the_wrong_axis, "float64"),
]


@pytest.mark.parametrize("break_backend, dtype", BREAKS, ids=[f"{f.__name__}-{d}" for f, d in BREAKS])
def test_a_broken_backend_is_caught(break_backend, dtype, monkeypatch):
    """The comparison has teeth: each deliberate break of impl_torch fails it."""
    break_backend(monkeypatch)
    config = preset("default")
    src, tgt = hostile_batch(config)
    with pytest.raises(AssertionError, match="differs from the float64 oracle"):
        assert_matches_oracle(config, init_params(config, seed=1), src, tgt, dtype)
