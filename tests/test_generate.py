"""The KV cache and `generate` in every backend: cached steps equal the full-prefix decoder for
every ModelConfig switch, JAX compiles a bounded number of times, PyTorch runs under
inference_mode, and bad arguments get the same InputError everywhere. (transformers' ids:
tests/test_generate_hf.py; the cross-backend property over drawn configs: conformance/suite.)
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import InputError
from conformance.check import backends
from conformance.check.compare import assert_close, to_numpy
from conformance.check.tolerances import tolerance
from conformance.core.decoding import penalty
from conformance.core.presets import preset
from systems.harness import BACKEND_PARAMS

SIZES = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1,
             n_decoder_layers=2, max_len=12)
# One preset per switch the cache must honour: shared and tied embeddings with key-side target
# padding (paper), a -inf fill (llmhub), query-side target padding with no cross mask
# (from-scratch), causal-only target masking plus final_logits_bias and a finfo.min fill (hf-marian),
# pre-LN with the std+eps LayerNorm (annotated-transformer).
PRESETS = ("paper", "llmhub", "from-scratch", "hf-marian", "annotated-transformer")
# JAX compiles four executables per preset and dtype (2-3 s each on the shared CI machine): it
# runs the three presets that hold every switch, in float64 (float32 runs the same traced code).
JAX_PRESETS = ("llmhub", "from-scratch", "hf-marian")


def batch(config, seed=0):
    """src (3, 6) with source padding; tgt (3, 7) from a start token that is not the pad id.

    With key-side target padding a pad id sits inside the prefix (the cache must mask it as a
    key). With query-side padding it cannot: a pad query has no key at all, and the full decoder
    then averages over later positions too (docs/decoding.md, "The KV cache")."""
    rng = np.random.default_rng(seed)
    pad, vocab = config.pad_id, config.tgt_vocab_size
    real = np.array([i for i in range(vocab) if i != pad])
    src = rng.choice(real, size=(3, 6))
    src[1, 4:] = pad
    src[2, 1:] = pad
    tgt = rng.choice(real, size=(3, 7))
    if config.tgt_pad_mask == "keys":
        tgt[1, 3] = pad
    return src, tgt


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cached_steps_equal_the_full_prefix_decoder(backend, dtype):
    if backend == "jax" and dtype == "float32":
        pytest.skip("JAX float32 runs the float64 test's traced code; skipped to bound compiles")
    target = backends.Target(backend, "cpu", dtype)
    tol = tolerance(dtype)
    for name in JAX_PRESETS if backend == "jax" else PRESETS:
        config = preset(name, **SIZES)
        src, tgt = batch(config)
        with backends.full_precision(backend), backends.dtype_scope(target):
            model = backends.build(target, config, None)
            encoded = model.encode(src, return_attention=False)
            full = to_numpy(model.decode(tgt, encoded, return_attention=False).logits)  # (B, T, V)
            cache = model.start_cache(encoded, config.max_len)
            for t in range(tgt.shape[1]):
                # Row t of the causal full decoder is the last row of the decoder on the prefix up to t.
                step = to_numpy(model.decode_step(tgt[:, t], cache))
                assert_close(step, full[:, t], tol, tensor=f"step {t} logits vs full prefix", backend=backend,
                             dtype=dtype, config=config, against="the full-prefix decoder")
            assert int(to_numpy(cache.length)) == tgt.shape[1]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_reorder_cache_follows_the_rows(backend):
    config = preset("paper", **SIZES)
    src, tgt = batch(config)
    src = np.repeat(src[1:2], 3, axis=0)  # beams of one row share their source (it is never reordered)
    target = backends.Target(backend, "cpu", "float32")
    with backends.full_precision(backend):
        model = backends.build(target, config, None)
        encoded = model.encode(src, return_attention=False)
        cache = model.start_cache(encoded, config.max_len)
        for t in range(3):
            model.decode_step(tgt[:, t], cache)
        rows = np.array([2, 2, 0])
        # After reordering, row i continues row rows[i]: its next logits are those of that row's prefix.
        cache = model.reorder_cache(cache, rows)
        step = to_numpy(model.decode_step(tgt[rows, 3], cache))
    with backends.full_precision(backend):
        expected = to_numpy(model(src, tgt[rows, :4], return_attention=False).logits)[:, -1]
    assert_close(step, expected, tolerance("float32"), tensor="logits after reorder", backend=backend,
                 dtype="float32", config=config, against="the full decoder on the reordered rows")


def generate_all(config, src, dtype="float64", max_len=8, **options):
    out = {}
    for param in BACKEND_PARAMS:
        backend = param.values[0]
        reason = backends.availability().get(backend)
        if reason:
            continue
        target = backends.Target(backend, "cpu", dtype)
        with backends.full_precision(backend), backends.dtype_scope(target):
            model = backends.build(target, config, None)
            ids, scores = model.generate(src, max_len, 1, 2, return_scores=True, **options)
            out[backend] = (to_numpy(ids).astype(np.int64), to_numpy(scores).astype(np.float64))
    return out


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3, length_penalty=0.6, length_penalty_form="gnmt"),
                                     dict(num_beams=2, early_stopping="never", use_cache=False, max_len=4)],
                         ids=["greedy", "beam-gnmt", "beam-never-uncached"])
def test_float64_backends_choose_identical_ids(options):
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    out = generate_all(config, src, **options)
    reference_ids, reference_scores = out["numpy"]
    assert reference_ids.shape[0] == 3 and reference_ids.shape[1] <= 8
    for backend, (ids, scores) in out.items():
        assert ids.shape == reference_ids.shape and (ids == reference_ids).all(), (backend, ids, reference_ids)
        np.testing.assert_allclose(scores, reference_scores, rtol=1e-9, err_msg=backend)


def test_generate_returns_each_backends_own_array_type():
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    kinds = {"numpy": "ndarray", "torch": "Tensor", "jax": "ArrayImpl"}
    for backend, kind in kinds.items():
        if backends.availability().get(backend):
            continue
        model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
        ids = model.generate(src, 4, 1, 2, num_beams=2)
        assert type(ids).__name__ == kind, (backend, type(ids))


def test_jax_search_is_one_compiled_call_per_shape_and_max_len():
    """The whole search is one lax.while_loop (impl_jax.decode._search): once compiled for
    (rows, source length, max_len, rules), a call runs the encoder and the search, two compiled
    calls in all, whatever the number of tokens; the ids, banned ids and length penalty are data."""
    impl_jax = pytest.importorskip("impl_jax", reason="JAX is not installed")
    config = preset("paper", **{**SIZES, "max_len": 24})
    src, _ = batch(config)
    model = impl_jax.Model(config, dtype="float32")
    # Never-ending rows (eos is banned: the search runs all 20 steps).
    model.generate(src, 20, 1, 2, num_beams=2, banned_ids=[2])  # warm: the encoder and the search
    impl_jax.reset_stats()
    ids = model.generate(src, 20, 1, 2, num_beams=2, banned_ids=[2])
    assert to_numpy(ids).shape == (3, 20)
    model.generate(src, 20, 3, 4, num_beams=2, banned_ids=[5], length_penalty=0.3)
    stats = impl_jax.compile_stats()
    assert stats["compiles"] == 0, f"the same shapes with other ids and penalty compiled again: {stats}"
    assert stats["calls"] == 4, f"each search should be two compiled calls (encode, search): {stats}"
    impl_jax.reset_stats()
    model.generate(src, 12, 1, 2, num_beams=2, banned_ids=[2])  # a new max_len: the search compiles once
    assert impl_jax.compile_stats()["compiles"] == 1, impl_jax.compile_stats()


def test_torch_generates_under_inference_mode_on_the_models_device():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import impl_torch

    config = preset("hf-marian", **SIZES)
    src, _ = batch(config)
    model = impl_torch.Model(config, dtype="float32")
    with torch.inference_mode():
        ids, scores = model.generate(src, 6, 1, 2, num_beams=2, return_scores=True)
    assert ids.device == model.device and scores.device == model.device
    assert (ids == model.generate(src, 6, 1, 2, num_beams=2)).all()


def test_torch_cuda_path_is_selected_by_device():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here; generate runs on the model's device (test_torch_generates_under_inference_mode)")
    import impl_torch

    config = preset("paper", **SIZES)
    src, _ = batch(config)
    model = impl_torch.Model(config, dtype="float32", device="cuda")
    assert model.generate(src, 6, 1, 2, num_beams=2).device.type == "cuda"


BAD_OPTIONS = [
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=2.0), "num_beams"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty="1"), "length_penalty"),
    (dict(early_stopping="always"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(use_cache=1), "use_cache"),
    (dict(length_penalty_form="wu"), "length_penalty_form"),
    (dict(forced_eos="yes"), "forced_eos"),
    (dict(banned_ids=[13]), "banned_ids"),
    (dict(banned_ids=3), "banned_ids"),
    (dict(return_scores=None), "return_scores"),
    (dict(max_len=13), "max_len"),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bad_generate_arguments_get_the_same_error_everywhere(backend):
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    for options, argument in BAD_OPTIONS:
        call = dict(max_len=5, bos_id=1, eos_id=2) | options
        with pytest.raises(InputError) as info:
            model.generate(src, **call)
        assert info.value.argument == argument, (options, info.value)
        assert str(info.value) == str(pytest.raises(InputError, backends.build(
            backends.Target("numpy", "cpu", "float32"), config, None).generate, src, **call).value)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_nan_logits_of_an_open_row_are_refused(backend):
    """A start token that is the pad id, with key-side padding and a -inf fill: the first query
    has no key, its attention is NaN, and generate says so instead of choosing from NaN (the
    device searches raise the reference's error, after their step or their while_loop)."""
    config = preset("llmhub", **SIZES)
    src, _ = batch(config)
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    with pytest.raises(InputError, match="NaN logits at step 0, row 0"):
        model.generate(src, 4, config.pad_id, 2)


def test_the_two_length_penalties():
    assert penalty(4, 1.0, "hf") == 4.0 and penalty(4, 0.0, "hf") == 1.0
    assert np.isclose(penalty(7, 0.6, "gnmt"), 2.0 ** 0.6)  # ((5 + 7) / 6) ** 0.6
