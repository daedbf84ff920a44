"""The NumPy backward pass (the gradient oracle) against finite differences and PyTorch autograd.

In float64, for every preset and every switch, on a padded batch: the last source row is all
padding (its labels are all pad, so it does not count), trailing target padding, and with a
`-inf` fill and query-side padding the forward has NaN rows that must not poison anything.

"Relative" here is per parameter: max |got - expected| / max(max |expected|, 1e-3 x the largest
gradient of the model). The floor matters for gradients that are exactly 0 in exact arithmetic
(the key-projection bias: softmax ignores a constant added to a row of scores), where both sides
are rounding noise of 1e-17 and a plain ratio would compare noise with noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import impl_numpy
from batches import SRC, TGT, features_like, small
from conformance import PRESETS, InputError, param_shapes
from impl_numpy.backward import cross_entropy

TOLERANCE = 1e-8  # the "done when": 1e-8 relative, float64
EPS = 0.1  # the paper's label smoothing

# Switches no preset sets, each combined with others so that every value of every switch is seen.
SWITCHES = {
    "gelu, stored table, std-eps, tied only": dict(activation="gelu", position="table", layer_norm_form="std-eps",
                                                    tie_output=True, output_bias=False, final_logits_bias=True),
    "gelu-tanh, split sinusoid, pre-LN, no biases": dict(activation="gelu-tanh", position="sinusoid-split",
                                                         norm_placement="pre", qkv_bias=False, out_proj_bias=False),
    "silu, -inf, query padding, table, unscaled": dict(activation="silu", mask_fill=-math.inf, tgt_pad_mask="queries",
                                                       position="table", scale_embedding=False,
                                                       cross_attn_src_mask=False, final_decoder_norm=True),
    "fast variance, t2t, padding on both sides, logits / sqrt(D)": dict(
        layer_norm_form="fast-variance", position="sinusoid-t2t", src_pad_mask="both", tgt_pad_mask="both",
        scale_logits=True, share_embeddings=True, tie_output=True),
    "GLU with tanh, attention temperature (AlgoPerf WMT variants)": dict(activation="tanh", ffn_glu=True,
                                                                          attention_temp=2.5, norm_placement="pre"),
    "-1e4 fill, no target padding mask, pad 1": dict(mask_fill=-1e4, tgt_pad_mask="none", pad_id=1,
                                                     share_embeddings=True, final_encoder_norm=True),
}
CONFIGS = {**{f"preset {name}": (name, {}) for name in sorted(PRESETS)},
           **{f"switches: {label}": ("default", changes) for label, changes in SWITCHES.items()}}


def tiny(name: str, changes: dict | None = None, **more):
    """A one-layer config. Its final_logits_bias is trained: frozen (the Hugging Face presets'
    `freeze_final_logits_bias`), it gets a zero gradient by design, not the loss's derivative that
    these tests compare (tests/training/test_final_logits_bias_frozen.py checks the frozen one)."""
    return small(name, n_encoder_layers=1, n_decoder_layers=1,
                 **{**(changes or {}), "freeze_final_logits_bias": False, **more})


def batch(config):
    """The shared padded batch in the config's pad id, and labels (the next target token, pad
    after the end). The last source row is all padding: with a -inf fill its whole batch element is
    NaN, so its labels are all pad (a fully padded label row)."""
    pad = config.pad_id
    src = np.where(SRC == 0, pad, np.where(SRC == pad, 11, SRC))
    if config.source == "features":  # Whisper's: log-mel features, no padding (no row is NaN)
        src = features_like(config, len(SRC), 4)
    tgt = np.where(TGT == 0, pad, np.where(TGT == pad, 12, TGT))
    labels = np.concatenate([tgt[:, 1:], np.full((len(tgt), 1), pad)], axis=1)
    labels[-1] = pad
    return src, tgt, labels


def relative_errors(got: dict, expected: dict, everything: dict | None = None,
                    floor_fraction: float = 1e-3) -> dict[str, float]:
    """Per parameter; `everything` is the whole gradient the floor is taken from (default: expected)."""
    floor = floor_fraction * max(float(np.abs(v).max()) for v in (everything or expected).values())
    return {name: float(np.abs(got[name] - expected[name]).max()) / max(float(np.abs(expected[name]).max()), floor)
            for name in expected}


def assert_gradients_close(got: dict, expected: dict, what: str, everything: dict | None = None,
                           floor_fraction: float = 1e-3) -> None:
    errors = relative_errors(got, expected, everything, floor_fraction)
    name = max(errors, key=errors.get)
    print(f"{what}: worst {errors[name]:.2e} relative ({name})")
    assert errors[name] <= TOLERANCE, f"{what}: {name!r} off by {errors[name]:.2e} relative (tolerance {TOLERANCE:g})"


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_gradients_match_finite_differences(label):
    """Fourth-order central differences, (f(-2h) - 8 f(-h) + 8 f(h) - f(2h)) / 12h with h = 1e-4:
    truncation O(h^4) and rounding ~1e-16 x |loss| / h, both far below 1e-8 of a gradient. Per
    parameter, the coordinate with the largest analytic gradient and one drawn at random. (h = 1e-3
    would be more accurate for smooth activations, but ReLU's kink then falls inside the stencil
    for a few coordinates: measured, errors up to 4e-2.)"""
    config = tiny(*CONFIGS[label])
    src, tgt, labels = batch(config)
    model = impl_numpy.Model(config)
    loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=EPS)
    assert set(grads) == set(param_shapes(config))

    def loss_now() -> float:
        return float(cross_entropy(model(src, tgt).logits, labels, config.pad_id, EPS)[0])

    assert loss_now() == float(loss)
    rng = np.random.default_rng(0)
    h = 1e-4
    numeric, analytic = {}, {}
    for name, value in model.params.items():  # the arrays the model computes with, edited in place
        assert grads[name].shape == value.shape and grads[name].dtype == value.dtype
        picks = {int(np.argmax(np.abs(grads[name]))), int(rng.integers(value.size))}
        numeric[name], analytic[name] = [], []
        for flat in sorted(picks):
            index = np.unravel_index(flat, value.shape)
            original = value[index]
            values = []
            for step in (-2, -1, 1, 2):
                value[index] = original + step * h
                values.append(loss_now())
            value[index] = original
            numeric[name].append((values[0] - 8 * values[1] + 8 * values[2] - values[3]) / (12 * h))
            analytic[name].append(grads[name][index])
    numeric = {k: np.array(v) for k, v in numeric.items()}
    analytic = {k: np.array(v) for k, v in analytic.items()}
    # The floor from the whole gradient (the samples may miss its largest entries), at 1e-2 of
    # it: the differences' own rounding is ~1e-16 x |loss| x 18 / 12h, measured up to 1e-11 of
    # the largest gradient, so an entry below 1e-3 of it cannot be checked to 1e-8 this way
    # (the exactly-zero key bias measured 1.03e-8 against a 1e-3 floor). PyTorch checks them.
    assert_gradients_close(analytic, numeric, f"{label}: NumPy backward vs finite differences", grads, 1e-2)


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_gradients_match_torch_autograd(label):
    """PyTorch float64 autograd through impl_torch.Model and F.cross_entropy itself.

    With a -inf fill, PyTorch's autograd cannot give the reference: a fully masked row is NaN and
    its backward computes 0 x NaN = NaN into every weight. The reference then runs the same
    weights with a fill of -1e9, which changes nothing that reaches the loss (a row with at least
    one key left has exactly 0 weight on masked keys in float64: exp(-1e9) underflows), while its
    fully masked rows become finite and, being uncounted, get exactly 0 gradient."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import impl_torch

    config = tiny(*CONFIGS[label])
    src, tgt, labels = batch(config)
    model = impl_numpy.Model(config)
    loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=EPS)

    reference = config.replace(mask_fill=-1e9) if math.isinf(config.mask_fill) else config
    torch_model = impl_torch.Model(reference, model.params, "float64")
    logits = torch_model(torch.tensor(src), torch.tensor(tgt)).logits
    torch_loss = F.cross_entropy(logits.reshape(-1, config.tgt_vocab_size), torch.tensor(labels).reshape(-1),
                                 ignore_index=config.pad_id, label_smoothing=EPS)
    torch_loss.backward()
    torch_grads = {name: p.grad.numpy() for name, p in torch_model.named_parameters()}
    assert set(torch_grads) == set(grads)
    assert abs(float(loss) - torch_loss.item()) <= TOLERANCE * abs(torch_loss.item()), (float(loss), torch_loss.item())
    assert_gradients_close(grads, torch_grads, f"{label}: NumPy backward vs PyTorch autograd")


def test_nan_rows_are_selected_out():
    """-inf fill with query-side padding and an all-padding source row: the logits have NaN rows,
    the loss and every gradient are finite, and equal those of the batch without the dead rows'
    positions (the padded positions contribute nothing, not even 0 x NaN)."""
    config = tiny("llmhub", tgt_pad_mask="queries")
    src, tgt, labels = batch(config)
    model = impl_numpy.Model(config)
    assert np.isnan(model(src, tgt).logits).any(), "the batch no longer produces NaN rows"
    loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=EPS)
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())
    # Drop the dead batch element: the same loss and gradients.
    kept_loss, kept = model.loss_and_grads(src[:-1], tgt[:-1], labels[:-1], label_smoothing=EPS)
    assert abs(kept_loss - loss) <= 1e-14
    assert_gradients_close(grads, kept, "dead batch element dropped")


def test_a_counted_nan_row_is_refused():
    """A label that counts at a position the forward leaves NaN would make the loss NaN: refused,
    naming where (tests/training/test_nan_positions.py has the rule and the other backends)."""
    config = tiny("llmhub")
    src, tgt, labels = batch(config)
    labels[-1, 0] = 5  # the all-padding source row's element is NaN throughout
    with pytest.raises(InputError, match="count where the logits are NaN") as raised:
        impl_numpy.Model(config).loss_and_grads(src, tgt, labels)
    assert raised.value.argument == "labels"


def test_float32_gradients_keep_their_dtype():
    config = tiny("default")
    src, tgt, labels = batch(config)
    loss, grads = impl_numpy.Model(config, dtype="float32").loss_and_grads(src, tgt, labels, label_smoothing=EPS)
    assert loss.dtype == np.float32
    assert {g.dtype for g in grads.values()} == {np.dtype("float32")}


@pytest.mark.parametrize("labels, smoothing, problem", [
    (lambda l: l[:, :-1], 0.0, "expected the shape of tgt_ids"),
    (lambda l: l.astype(np.float64), 0.0, "integer dtype"),
    (lambda l: np.where(l == 3, 16, l), 0.0, "label 16 out of range"),
    (lambda l: np.where(l == 3, -100, l), 0.0, "negative label -100"),
    (lambda l: np.zeros_like(l), 0.0, "no label counts"),
    (lambda l: l, 1.0, "must lie in [0, 1)"),
    (lambda l: l, -0.1, "must lie in [0, 1)"),
    (lambda l: l, math.nan, "must lie in [0, 1)"),
    (lambda l: l, True, "must be a float in [0, 1)"),
    (lambda l: l, "0.1", "must be a float in [0, 1)"),
])
def test_bad_training_arguments_are_refused(labels, smoothing, problem):
    config = tiny("default")
    src, tgt, good = batch(config)
    with pytest.raises(InputError) as caught:
        impl_numpy.Model(config).loss_and_grads(src, tgt, labels(good), label_smoothing=smoothing)
    assert caught.value.argument == ("labels" if smoothing == 0.0 else "label_smoothing")
    assert problem in caught.value.problem
