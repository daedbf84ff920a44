"""The two attention paths of impl_torch: the fast path (fused SDPA) gives what the config says.

SDPA returns 0 for a query with no key to attend to; the config says NaN (0 / 0) for a -inf
fill and the plain mean of the values for a finite fill. A NaN that enters attention spreads as
`weights @ v` spreads it (0 * NaN = NaN). These tests check both paths against each other and
against the NumPy oracle's attention function, first on raw tensors, then through whole models.

NaN enters attention only as whole positions (a NaN row of the residual stream makes that
position's q, k and v NaN in every head), so the raw-tensor inputs inject it that way.
"""

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
import impl_torch.model  # noqa: E402
from conformance import init_params, preset  # noqa: E402
from conformance.check.compare import assert_close, to_numpy  # noqa: E402
from conformance.core.output import tensors_of  # noqa: E402
from conformance.suite.strategies import FILLS, cases, configs  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402


MASK_SHAPES = ("keys", "rows", "per-head", "queries")  # (B,1,1,Tk) (B,1,Tq,Tk) (B,H,Tq,Tk) (B,1,Tq,1)


@st.composite
def attention_inputs(draw):
    """q, k, v (float64 NumPy), a boolean mask with some rows forced empty, NaN positions, a fill."""
    batch, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tq, tk, dim = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 4, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([0.5, 1.0, 4.0]))
    q, k, v = (scale * rng.standard_normal((batch, heads, length, dim)) for length in (tq, tk, tk))
    kind = draw(st.sampled_from(MASK_SHAPES))
    shape = {"keys": (batch, 1, 1, tk), "rows": (batch, 1, tq, tk), "per-head": (batch, heads, tq, tk),
             "queries": (batch, 1, tq, 1)}[kind]
    mask = rng.random(shape) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    if draw(st.booleans()):  # at least one query of batch row 0 with no key at all
        mask[0, ..., draw(st.integers(0, shape[2] - 1)), :] = False
    for b, position in draw(st.lists(st.tuples(st.integers(0, batch - 1), st.integers(0, tk - 1)), max_size=2)):
        k[b, :, position], v[b, :, position] = math.nan, math.nan
    for b, position in draw(st.lists(st.tuples(st.integers(0, batch - 1), st.integers(0, tq - 1)), max_size=2)):
        q[b, :, position] = math.nan
    return q, k, v, mask, draw(st.sampled_from(FILLS))


def as_torch(arrays, dtype):
    return [torch.from_numpy(a).to(dtype) if a.dtype != np.bool_ else torch.from_numpy(a) for a in arrays]


def assert_same(got, expected, dtype, what):
    """NaN in exactly the same places (bitwise), everything else within the dtype's tolerance."""
    __tracebackhide__ = True
    got, expected = to_numpy(got), to_numpy(expected)
    nan_got, nan_expected = np.isnan(got), np.isnan(expected)
    if not np.array_equal(nan_got, nan_expected):
        where = tuple(int(i) for i in np.argwhere(nan_got != nan_expected)[0])
        raise AssertionError(f"{what}: NaN positions differ, first at {where} (got NaN: {bool(nan_got[where])})")
    assert_close(got, expected, tolerance(str(dtype).removeprefix("torch.")), tensor=what, backend="torch",
                 dtype=str(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@given(inputs=attention_inputs())
def test_both_attention_paths_follow_the_oracle_on_raw_tensors(inputs, dtype):
    q, k, v, mask, fill = inputs
    expected_heads, expected_weights = impl_numpy.scaled_dot_product_attention(q, k, v, mask, fill)
    tq, tk, tv, tmask = as_torch([q, k, v, mask], dtype)
    heads, weights = impl_torch.scaled_dot_product_attention(tq, tk, tv, tmask, fill)
    assert_same(weights, expected_weights, dtype, f"explicit weights (fill {fill})")
    assert_same(heads, expected_heads, dtype, f"explicit output (fill {fill})")
    fast = impl_torch.fast_attention(tq, tk, tv, tmask, fill)
    assert_same(fast, heads, dtype, f"fast output vs explicit (fill {fill})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@given(inputs=attention_inputs())
def test_both_paths_give_the_loss_rule_and_its_gradients_on_raw_tensors(inputs, dtype):
    """`empty_rows=0.0`, the rule `loss_and_grads` passes: the fused path's output and its
    gradients for q, k and v are the explicit path's (no NaN enters: a loss forward has none)."""
    q, k, v, mask, fill = inputs
    q, k, v = (np.nan_to_num(a, nan=0.5) for a in (q, k, v))
    upstream = torch.from_numpy(np.random.default_rng(1).standard_normal(q.shape[:3] + (v.shape[-1],))).to(dtype)
    results = []
    for path in ("explicit", "fast"):
        tq, tk, tv = (t.requires_grad_() for t in as_torch([q, k, v], dtype))
        tmask = torch.from_numpy(mask)
        if path == "explicit":
            heads, _ = impl_torch.scaled_dot_product_attention(tq, tk, tv, tmask, fill, empty_rows=0.0)
        else:
            heads = impl_torch.fast_attention(tq, tk, tv, tmask, fill, empty_rows=0.0)
        grads = torch.autograd.grad((heads * upstream).sum(), (tq, tk, tv))
        results.append((heads.detach(), *grads))
    for name, fast, explicit in zip(("output", "dq", "dk", "dv"), results[1], results[0]):
        assert not explicit.isnan().any(), name
        assert_same(fast, explicit, dtype, f"fast vs explicit {name}, empty_rows=0 (fill {fill})")


def test_fully_masked_rows_nan_for_minus_inf_and_uniform_for_a_finite_fill():
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 2, 3, 4))) for _ in range(3))
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    mask[1, :, 2, :] = False  # batch 1, query 2: no key
    for fill in (-math.inf, -1e9, -1e4):
        heads, weights = impl_torch.scaled_dot_product_attention(q, k, v, mask, fill)
        fast = impl_torch.fast_attention(q, k, v, mask, fill)
        if math.isinf(fill):
            assert weights[1, :, 2].isnan().all() and heads[1, :, 2].isnan().all() and fast[1, :, 2].isnan().all()
        else:
            assert torch.equal(weights[1, :, 2], torch.full((2, 3), 1 / 3, dtype=torch.float64))
            torch.testing.assert_close(fast[1, :, 2], v[1].mean(dim=-2), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(heads[1, :, 2], v[1].mean(dim=-2), rtol=1e-12, atol=1e-12)
        # Every other row is an ordinary softmax, identical between the paths.
        assert not weights[0].isnan().any() and not fast[0].isnan().any()
        torch.testing.assert_close(fast[0], heads[0], rtol=1e-12, atol=1e-12)
        # The kernel alone would have given 0 there: the fix-up is what the test sees.
        raw = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.equal(raw[1, :, 2], torch.zeros_like(raw[1, :, 2]))


SDPA = torch.nn.functional.scaled_dot_product_attention


def kernel_that_skips_masked_keys(q, k, v, attn_mask=None, scale=None):
    """A stand-in for fused kernels that never read a key masked for the whole block: masked
    keys contribute exactly nothing, not 0 * v (so a NaN value there does not spread)."""
    keep = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).any(dim=-2)[..., None]  # (B, H, Tk, 1)
    return SDPA(q, k.where(keep, 0), v.where(keep, 0), attn_mask=attn_mask, scale=scale)


def test_nan_values_spread_even_when_the_kernel_skips_masked_keys(monkeypatch):
    q, k, v = (torch.randn(1, 1, 2, 4, dtype=torch.float64) for _ in range(3))
    k, v = torch.cat([k, torch.full_like(k[:, :, :1], math.nan)], dim=2), torch.cat([v, torch.full_like(v[:, :, :1], math.nan)], dim=2)
    mask = torch.tensor([True, True, False])[None, None, None, :]  # key 2 (NaN) masked for everyone
    heads, _ = impl_torch.scaled_dot_product_attention(q, k, v, mask, -1e9)
    assert heads.isnan().all()  # the explicit path: weight 0 times NaN
    monkeypatch.setattr(impl_torch.model.F, "scaled_dot_product_attention", kernel_that_skips_masked_keys)
    assert not kernel_that_skips_masked_keys(q, k, v, attn_mask=mask).isnan().any()
    assert impl_torch.fast_attention(q, k, v, mask, -1e9).isnan().all()


def kernel_with_nan_empty_rows(q, k, v, attn_mask=None, scale=None):
    """A stand-in for kernels whose empty rows are 0 / 0 = NaN, in the forward and the backward."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~attn_mask, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def test_the_kernel_never_sees_an_empty_row(monkeypatch):
    """Teeth for `mask | empty`: with a kernel that is NaN on empty rows (forward and backward),
    the loss rule's output and gradients stay those of the explicit path."""
    q, k, v = (torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
    mask[1, :, 2, :] = False
    heads, _ = impl_torch.scaled_dot_product_attention(q, k, v, mask, -math.inf, empty_rows=0.0)
    expected = torch.autograd.grad(heads.sum(), (q, k, v))
    monkeypatch.setattr(impl_torch.model.F, "scaled_dot_product_attention", kernel_with_nan_empty_rows)
    assert kernel_with_nan_empty_rows(q, k, v, attn_mask=mask).isnan().any()
    fast = impl_torch.fast_attention(q, k, v, mask, -math.inf, empty_rows=0.0)
    torch.testing.assert_close(fast, heads, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(fast.sum(), (q, k, v)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def with_empty_rows(case):
    """A whole source row of padding: the encoder and cross-attention get queries with no key (a
    features source has no padding: its case is left as drawn)."""
    if case.config.source == "features":
        return case
    src = case.src_ids.copy()
    src[-1, :] = case.config.pad_id
    return type(case)(case.config, case.seed, case.scale, src, case.tgt_ids)


def run_both_paths(config, params, src, tgt, dtype):
    model = impl_torch.Model(config, params, dtype=dtype)
    with torch.inference_mode():
        explicit = tensors_of(model(src, tgt))
        fast = tensors_of(model(src, tgt, return_attention=False))
    return explicit, fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@given(case=cases(configs(max_layers=2)).map(with_empty_rows))
def test_fast_path_equals_explicit_path_through_whole_models(case, dtype):
    explicit, fast = run_both_paths(case.config, case.params(), case.src_ids, case.tgt_ids, dtype)
    assert set(fast) == {n for n in explicit if not n.endswith((".self", ".cross"))}
    for name, value in fast.items():
        assert_same(value, explicit[name], dtype, f"{name} (fast vs explicit; {case.config.summary()})")
    if case.config.source == "features":  # log-mel features have no padding: no empty row to check
        return
    # The empty source row follows the config in the explicit weights: zeros, else the fill's row.
    empty = explicit["encoder.0.self"][-1]  # (H, S, S)
    if case.config.empty_rows == "zeros":
        assert torch.equal(empty, torch.zeros_like(empty))
    elif math.isinf(case.config.mask_fill):
        assert empty.isnan().all()
    else:
        assert torch.equal(empty, torch.full_like(empty, 1 / empty.shape[-1]))


@pytest.mark.parametrize("fill", [-math.inf, -1e9], ids=["-inf", "-1e9"])
def test_raw_sdpa_without_the_fix_ups_would_be_caught(fill, monkeypatch):
    """Teeth: a fast path that trusts SDPA on empty rows differs from the explicit path."""
    config = preset("from-scratch", mask_fill=fill, tgt_pad_mask="queries", d_model=16, n_heads=2, d_ff=32,
                    src_vocab_size=12, tgt_vocab_size=12, max_len=8)
    src = np.array([[3, 4, 5, 0], [0, 0, 0, 0]])
    tgt = np.array([[2, 3, 0], [4, 5, 6]])
    monkeypatch.setattr(impl_torch.model, "fast_attention",
                        lambda q, k, v, mask, fill, **_: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    explicit, fast = run_both_paths(config, init_params(config), src, tgt, torch.float64)
    with pytest.raises(AssertionError):
        for name, value in fast.items():
            assert_same(value, explicit[name], torch.float64, name)
