"""`conformance.compare` on MLCommons AlgoPerf's WMT Transformer (tests/systems/algoperf_torch.py and
algoperf_flax.py), in its four workload variants (base, post-LN, GLU with tanh, attention
temperature 4.0), through the `[taps]` of the layouts algoperf-wmt-torch and algoperf-wmt-flax.

The temperature is a constructor argument no tensor records: it is passed as `attention_temp=4.0`
(docs/algoperf.md). Pre-LN and post-LN compute a sublayer's residual output in different modules:
the layouts tap each with `when = { norm_placement = ... }`.

- clean, float32: the user's column and NumPy's and PyTorch's agree with the oracle in every
  variant of both; JAX runs beside one (the Flax base variant: one compile; test_algoperf.py runs
  the JAX backend on every variant's logits against the systems);
- planted bugs, each at the first tensor it touches with the switch that explains it: a wrong
  LayerNorm epsilon in encoder layer 1, an embedding scale AlgoPerf does not have (it has
  `scale_embedding=False`, so the planted bug is an extra sqrt(D), the missing-scale bug's
  mirror), a source mask that ignores padding, a swapped sin/cos (the t2t split sinusoid);
- grads=True, float64: every gradient agrees with PyTorch autograd (all variants) and with
  `jax.grad` (one variant: a backward pass compiles), and a gradient scaled by 1.5 on one
  parameter is found on that parameter.

Why the PyTorch model's float64 runs have an unpadded source. AlgoPerf adds a float mask of
-1e10 to the scores. In float32 `s - 1e10` rounds to -1e10 (a fill; mask_fill=-1e10 in the
preset), so a fully masked row (a padded source position: src_pad_mask="both") is uniform in
both models. In float64 it is not a fill: a padded source row keeps softmax(s) while ours is
uniform, a true float64 difference at positions no real output reads. The float32 runs keep the
padding (the mask bug needs it); the float64 ones (a wrong epsilon moves the tensors by ~5e-6,
under float32's tolerance) use a full-length source. Their masks are built in float64 as well
(`float64_masks`): the system builds them float32 whatever `.double()` does, and PyTorch 2.x's
CPU scaled_dot_product_attention was measured to give a different result (max |diff| ~2.5 on
this model) for float64 queries with a float32 additive mask of this shape.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the AlgoPerf PyTorch system is a torch.nn model")
# One worker with tests/convert/test_algoperf.py: both build and run the same AlgoPerf Flax
# and torch models, whose eager ops and compiled programs the second file then finds ready
# (measured: the two files in two processes 42.0 CPU-s, in one 33.4, imports included).
pytestmark = pytest.mark.xdist_group("algoperf")

pytest.importorskip("flax", reason="the AlgoPerf Flax system is a flax.linen model")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import conformance  # noqa: E402
from conformance.check import backends as backend_registry  # noqa: E402
from systems import algoperf_flax, algoperf_torch  # noqa: E402
from systems.harness import ids  # noqa: E402
from test_algoperf import D, HEADS, MAX_LEN, VARIANTS, VOCAB, batch, flax_source, told, torch_source  # noqa: E402
from test_side_by_side import assert_found, intercepted, swapped  # noqa: E402

TORCH, FLAX = "algoperf-wmt-torch", "algoperf-wmt-flax"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def installed(*names: str) -> list[str]:
    return [b for b in names if backend_registry.availability([b])[b] is None]


def labels_for(tgt: np.ndarray) -> np.ndarray:
    """AlgoPerf's loss: the targets themselves (the decoder embeds them shifted), padding (0) not counted."""
    return tgt.copy()


def full_source() -> np.ndarray:
    """A source without padding (see the module's docstring), the targets stay padded."""
    return ids(0, VOCAB, [9, 9, 9], 9, seed=5)


@pytest.fixture
def float64_masks(monkeypatch):
    """AlgoPerf's additive masks built in float64 for a `.double()` model (the system builds them float32)."""
    def float_mask(allowed, nhead):
        masked = torch.repeat_interleave(torch.logical_not(allowed), repeats=nhead, dim=0)
        return torch.zeros_like(masked, dtype=torch.float64).masked_fill_(masked, algoperf_torch.MASKED)

    monkeypatch.setattr(algoperf_torch, "float_mask", float_mask)


def torch_compare(model, variant, src=None, tgt=None, **options):
    if src is None:
        src, tgt, _ = batch()
    return conformance.compare(model, TORCH, src, tgt, n_heads=HEADS, **told(variant), **options)


def flax_model(variant: str, dtype: str):
    c, params = flax_source(variant)
    if dtype == "float64":
        c = dataclasses.replace(c, dtype=jnp.float64)
        params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    return c, (algoperf_flax.Transformer(c), {"params": params})


def flax_compare(model, variant, **options):
    src, tgt, _ = batch()
    return conformance.compare(model, FLAX, src, tgt, max_len=MAX_LEN, **told(variant), **options)


def exposed(report) -> set[str]:
    return {t for t in report.tensors if report.cells[(t, report.yours.label)].unavailable is None}


SUBLAYERS = {"encoder.embeddings", "encoder.0.self_attn", "encoder.1.ffn", "encoder.output", "decoder.embeddings",
             "decoder.0.self_attn", "decoder.1.cross_attn", "decoder.1.ffn", "logits"}


# -- clean ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_clean_torch_agrees_in_every_variant(variant):
    report = torch_compare(torch_source(variant), variant, backends=installed("numpy", "torch"))
    assert report.first_divergence is None and report.ok, str(report)
    assert SUBLAYERS | {"decoder.output"} <= exposed(report), str(report)
    assert report.config.attention_temp == (4.0 if variant == "attention-temp" else 1.0)
    # Attention weights stay inside F.scaled_dot_product_attention: not exposed, not guessed.
    assert "encoder.0.self" in report.unexposed() and "not exposed" in str(report)


@pytest.mark.parametrize("variant", VARIANTS)
def test_clean_flax_agrees_in_every_variant(variant):
    _, model = flax_model(variant, "float32")
    names = ["numpy", "torch", "jax"] if variant == "base" else ["numpy", "torch"]
    report = flax_compare(model, variant, backends=installed(*names))
    assert report.first_divergence is None and report.ok, str(report)
    assert len(report.targets) == 1 + len(installed(*names))
    assert SUBLAYERS <= exposed(report), str(report)
    if variant == "post-ln":  # its decoder output goes straight into shared_embedding.attend
        why = report.unexposed()["decoder.output"]
        assert "only when norm_placement = 'pre'" in why and "this model: norm_placement = 'post'" in why, why
    else:
        assert "decoder.output" in exposed(report)


def test_a_wrong_temperature_is_found_at_the_first_attention():
    """Converted without attention_temp=4.0 (no tensor records it): the first attention sublayer diverges."""
    src, tgt, _ = batch()
    report = conformance.compare(torch_source("attention-temp"), TORCH, src, tgt, n_heads=HEADS, backends=())
    assert_found(report, "encoder.0.self_attn", "attention_temp")


def test_torch_in_float64_parts_from_ours_only_at_padded_source_positions(float64_masks):
    """The docstring's claim: AlgoPerf's additive -1e10 is no fill in float64, so the clean model's
    encoder differs from ours exactly where a source position is padding (every key masked)."""
    import impl_numpy
    from conformance.check.foreign.taps import capture
    from conformance.convert import convert_arrays, load_layout
    from conformance.core.output import tensors_of

    model = copy.deepcopy(torch_source("base")).double()
    src, tgt, shifted = batch()
    layout = load_layout(TORCH)
    converted = convert_arrays({k: v.numpy() for k, v in model.state_dict().items()}, layout, n_heads=HEADS)
    ours = tensors_of(impl_numpy.Model(converted.config, converted.params, dtype="float64")(src, shifted))
    theirs = capture(model, layout, ["encoder.0.self_attn"], lambda m, s, t: m(s, t), src, tgt,
                     converted.config.to_dict()).values["encoder.0.self_attn"]
    error = np.abs(theirs - np.asarray(ours["encoder.0.self_attn"])).max(axis=-1)
    padded = src == 0
    assert error[~padded].max() < 1e-12 and error[padded].min() > 1e-3, error
    report = torch_compare(model, "base", src, tgt, backends=())
    assert report.first_divergence == "encoder.0.self_attn", str(report)


# -- planted bugs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_wrong_layer_norm_epsilon_is_found_at_its_layer(variant, float64_masks):
    model = copy.deepcopy(torch_source(variant)).double()
    _, tgt, _ = batch()
    # norm2 opens (pre-LN) or closes (post-LN) encoder layer 1's feed-forward sublayer.
    assert torch_compare(model, variant, full_source(), tgt, backends=()).first_divergence is None
    model.encoder.encoder.layers[1].norm2.eps = 1e-5
    assert_found(torch_compare(model, variant, full_source(), tgt, backends=()), "encoder.1.ffn", "layer_norm_eps")


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_extra_embedding_scale_is_found_at_the_embeddings(variant):
    model = copy.deepcopy(torch_source(variant))
    # The logits read shared_embedding.weight directly: only the lookups are scaled.
    model.shared_embedding.register_forward_hook(lambda m, a, out: out * math.sqrt(D))
    assert_found(torch_compare(model, variant, backends=()), "encoder.embeddings", "scale_embedding")


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_mask_that_ignores_padding_is_found_at_the_first_attention(variant):
    model = copy.deepcopy(torch_source(variant))

    def unmask(module, args, kwargs):
        return args, {**kwargs, "attn_mask": torch.zeros_like(kwargs["attn_mask"])}

    model.encoder.encoder.layers[0].self_attn.register_forward_pre_hook(unmask, with_kwargs=True)
    assert_found(torch_compare(model, variant, backends=()), "encoder.0.self_attn", "src_pad_mask")


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_swapped_sin_cos_is_found_at_the_embeddings(variant):
    model = copy.deepcopy(torch_source(variant))
    # One pos_encoder serves both stacks; the encoder calls it first. The t2t sinusoid is split.
    model.pos_encoder.register_forward_hook(lambda m, a, out: a[0] + swapped(out - a[0], "split"))
    assert_found(torch_compare(model, variant, backends=()), "encoder.embeddings", "position")


def layer_norm(eps):
    """Flax's LayerNorm (the fast variance, E[x^2] - E[x]^2) at another epsilon."""
    def replace(next_fun, args, kwargs, module):
        x, p = args[0], module.variables["params"]
        mean = x.mean(-1, keepdims=True)
        var = (x * x).mean(-1, keepdims=True) - mean * mean
        return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]
    return replace


@pytest.mark.parametrize("variant", VARIANTS)
def test_flax_planted_bugs_are_found(variant, monkeypatch):
    """float64; each bug alone, found at its tensor (so every tensor before it agrees)."""
    _, model = flax_model(variant, "float64")
    # LayerNorm_1 of encoder block 1 opens (pre-LN) or closes (post-LN) its feed-forward sublayer.
    wrong_eps = intercepted("encoder.encoderblock_1.LayerNorm_1", layer_norm(1e-5))
    assert_found(flax_compare(model, variant, backends=(), run=wrong_eps), "encoder.1.ffn", "layer_norm_eps")

    scaled = intercepted("shared_embedding", lambda f, a, k, m: f(*a, **k) * np.sqrt(D))  # attend is not __call__
    assert_found(flax_compare(model, variant, backends=(), run=scaled), "encoder.embeddings", "scale_embedding")

    unmasked = intercepted("encoder.encoderblock_0.MultiHeadDotProductAttention_0",
                           lambda f, a, k, m: f(*a, **{**k, "mask": None}))
    assert_found(flax_compare(model, variant, backends=(), run=unmasked), "encoder.0.self_attn", "src_pad_mask")

    original = algoperf_flax.sinusoid_table
    monkeypatch.setattr(algoperf_flax, "sinusoid_table",
                        lambda max_len, d: np.concatenate([original(max_len, d)[..., d // 2:],
                                                           original(max_len, d)[..., : d // 2]], axis=-1))
    assert_found(flax_compare(model, variant, backends=()), "encoder.embeddings", "position")


# -- backward -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_gradients_agree_with_autograd_and_a_planted_bug_is_found(variant, float64_masks):
    model = copy.deepcopy(torch_source(variant)).double()
    _, tgt, _ = batch()
    report = torch_compare(model, variant, full_source(), tgt, backends=(), grads=True, labels=labels_for(tgt),
                           label_smoothing=0.1)
    assert report.first_divergence is None and report.ok, str(report)
    assert sorted(row.key for row in report.grads) == sorted(k for k, _ in model.named_parameters()), str(report)
    assert max(row.error for row in report.grads) < 1e-12, str(report)  # float64 against float64

    key = "decoder.decoder.layers.1.linear1.weight"
    dict(model.named_parameters())[key].register_hook(lambda g: g * 1.5)
    report = torch_compare(model, variant, full_source(), tgt, backends=(), grads=True, labels=labels_for(tgt))
    assert report.first_divergence is None and report.first_bad_grad == key, str(report)
    assert [row.key for row in report.grads if not row.passed] == [key]
    assert f"first gradient out of tolerance: {key}" in str(report)


def test_flax_gradients_agree_with_jax_grad_and_a_planted_bug_is_found():
    """The GLU variant (Dense_0 activated, Dense_1 the gate, Dense_2 out); one compiled backward pass.

    float32, the system's dtype: AlgoPerf's Flax decoder casts its output to float32 before
    `shared_embedding.attend`, so even a float64 model's logits (and every gradient, ~2e-9 off,
    measured) carry float32 rounding, over float64's 1e-11 gradient tolerance."""
    variant = "glu-tanh"
    _, model = flax_model(variant, "float32")
    _, tgt, _ = batch()

    @jax.custom_vjp
    def scaled_grad(x):
        return x

    scaled_grad.defvjp(lambda x: (x, None), lambda _, g: (1.5 * g,))
    key = "decoder.encoderdecoderblock_1.MlpBlock_0.Dense_1.kernel"  # the gate

    def buggy(bound, src_ids, tgt_ids):
        module, variables = bound.unbind()
        params = jax.tree_util.tree_map(lambda x: x, dict(variables["params"]))
        block = params["decoder"]["encoderdecoderblock_1"]
        mlp = {**block["MlpBlock_0"], "Dense_1": {**block["MlpBlock_0"]["Dense_1"],
                                                  "kernel": scaled_grad(block["MlpBlock_0"]["Dense_1"]["kernel"])}}
        params["decoder"] = {**params["decoder"], "encoderdecoderblock_1": {**block, "MlpBlock_0": mlp}}
        return module.apply({"params": params}, src_ids, tgt_ids)

    report = flax_compare(model, variant, backends=(), grads=True, labels=labels_for(tgt), run=buggy,
                          label_smoothing=0.1)
    assert report.first_divergence is None and report.first_bad_grad == key, str(report)
    assert [row.key for row in report.grads if not row.passed] == [key]
    assert len(report.grads) == len(jax.tree_util.tree_leaves(model[1]["params"]))
    assert report.loss_error <= report.loss_allowed
    assert report.yours.dtype == "float32"
