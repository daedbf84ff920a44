"""The KV cache and `generate` in every backend: cached steps equal the full-prefix decoder for
every ModelConfig switch, JAX compiles a bounded number of times, PyTorch runs under
inference_mode, and bad arguments get the same InputError everywhere. (transformers' ids:
tests/generation/test_generate_hf.py; the cross-backend property over drawn configs: conformance/suite.)
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import InputError
from conformance.check import backends
from conformance.check.compare import assert_close, to_numpy
from conformance.check.tolerances import tolerance
from conformance.core.generation.search import penalty
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


@pytest.mark.parametrize("share", [True, False], ids=["shared", "decoder-only"])
def test_torch_steps_multiply_a_copy_of_a_tied_output_weight_made_per_search(share, monkeypatch):
    """impl_torch on the CPU: a search's steps multiply by a contiguous (D, V) copy of a tied W_out
    made by `start_cache` (decode.step_output_weight). The copy is the (decoder's) embedding
    transposed, exactly; the steps' logits are the stored weight's to float rounding and the ids
    the same; a change made through `.data` (which bumps no version counter) is in the next
    search's copy; an untied W_out, ROSETTA_TORCH_STEP_OUTPUT_COPY=0, a float16 weight and a step
    recorded for a gradient take the stored weight."""
    import torch

    from impl_torch import decode

    monkeypatch.setattr(decode, "STEP_OUTPUT_COPY", True)
    config = preset("paper", **SIZES).replace(share_embeddings=share)
    assert config.tie_output
    src, tgt = batch(config)
    with backends.full_precision("torch"), torch.no_grad():  # as generate's inference_mode
        model = backends.build(backends.Target("torch", "cpu", "float64"), config, None)
        embedding = model.encoder.embedding if share else model.decoder.embedding
        encoded = model.encode(src, return_attention=False)
        copied = model.start_cache(encoded, config.max_len)
        assert copied.output_weight.is_contiguous() and torch.equal(copied.output_weight, embedding.weight.T)
        monkeypatch.setattr(decode, "STEP_OUTPUT_COPY", False)
        stored = model.start_cache(encoded, config.max_len)
        assert stored.output_weight is None
        for t in range(tgt.shape[1]):
            assert_close(to_numpy(model.decode_step(tgt[:, t], copied)), to_numpy(model.decode_step(tgt[:, t], stored)),
                         tolerance("float64"), tensor=f"step {t} logits", backend="torch", dtype="float64",
                         config=config, against="the steps with the stored weight")
        ids_stored = to_numpy(model.generate(src[:1], 8, 1, 2, num_beams=2))
        monkeypatch.setattr(decode, "STEP_OUTPUT_COPY", True)
        np.testing.assert_array_equal(to_numpy(model.generate(src[:1], 8, 1, 2, num_beams=2)), ids_stored)
        embedding.weight.data.mul_(2)
        assert torch.equal(model.start_cache(encoded, config.max_len).output_weight, embedding.weight.T)
        untied = backends.build(backends.Target("torch", "cpu", "float64"), preset("llmhub", **SIZES), None)
        assert untied.start_cache(untied.encode(src, return_attention=False), 4).output_weight is None
        half = backends.build(backends.Target("torch", "cpu", "float16"), config, None)
        assert half.start_cache(half.encode(src, return_attention=False), 4).output_weight is None
    # With autograd on, the stored weight: the step's gradient reaches the tied embedding.
    assert embedding.weight.requires_grad and torch.is_grad_enabled()
    recorded = model.start_cache(model.encode(src, return_attention=False), config.max_len)
    assert recorded.output_weight is None
    model.decode_step(tgt[:, 0], recorded).sum().backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.abs().sum() > 0


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


def oracle(config, src, max_len=8, **options):
    """The reference search (`conformance.core.generation.search.search`, float64 NumPy on the host) fed
    by the float64 NumPy model's cached steps: what every backend's device search must give."""
    from conformance.core.generation.search import search
    from conformance.core.inputs import check_generate

    settings = check_generate(config, max_len, 1, 2, **options)
    model = backends.build(backends.Target("numpy", "cpu", "float64"), config, None)
    encoded = model.encode(src, return_attention=False)
    rows = np.repeat(np.arange(len(src)), settings.rows)
    encoded = type(encoded)(memory=encoded.memory[rows], src_mask=encoded.src_mask[rows])
    cache = {"now": model.start_cache(encoded, settings.max_len)}

    def step(tokens, parents):
        if parents is not None:
            cache["now"] = model.reorder_cache(cache["now"], parents)
        return model.decode_step(tokens[:, -1], cache["now"])

    return search(step, len(src), settings.max_len, 1, 2, config.pad_id, **settings.search_options())


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3, length_penalty=0.6, length_penalty_form="gnmt"),
                                     dict(num_beams=2, early_stopping="never", use_cache=False, max_len=4),
                                     dict(num_beams=3, length_penalty=0.6, beam_rule="flax")],
                         ids=["greedy", "beam-gnmt", "beam-never-uncached", "flax-rule"])
def test_float64_backends_choose_identical_ids(options):
    """Every backend's device search (all of them in float64) gives the reference's ids, on a
    source batch with padding."""
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    out = generate_all(config, src, **options)
    reference_ids, reference_scores = oracle(config, src, **options)
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
    (dict(max_len=5.0), "max_len"),
    (dict(bos_id=1.0), "bos_id"),
    (dict(bos_id=np.array([1, 2])), "bos_id"),
    (dict(eos_id=True), "eos_id"),
    (dict(beam_rule="t5"), "beam_rule"),
    (dict(beam_rule="flax", early_stopping=True), "early_stopping"),
    (dict(num_return_sequences=0), "num_return_sequences"),
    (dict(num_return_sequences=2), "num_return_sequences"),  # greedy has one sequence per row
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(num_beams=2, beam_rule="flax", num_return_sequences=2), "num_return_sequences"),
    (dict(temperature=0.5), "temperature"),  # without do_sample
    (dict(seed=3), "seed"),
    (dict(do_sample=1), "do_sample"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, temperature=-1.0), "temperature"),
    (dict(do_sample=True, temperature=float("inf")), "temperature"),
    (dict(do_sample=True, top_k=-1), "top_k"),
    (dict(do_sample=True, top_k=2.5), "top_k"),
    (dict(do_sample=True, top_p=0.0), "top_p"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(do_sample=True, seed=-1), "seed"),
    (dict(do_sample=True, num_beams=2), "num_beams"),
    (dict(do_sample=True, beam_rule="flax"), "beam_rule"),
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
def test_beam_search_over_a_one_word_vocabulary_is_refused_by_name(backend):
    """Beam search keeps the best 2 x num_beams of num_beams x V candidates: with V = 1 there are
    too few, and every backend says so by name (it once reached the search and failed there with
    a broadcasting error). Greedy search still runs."""
    from conformance.core.config import ModelConfig

    config = ModelConfig(src_vocab_size=2, tgt_vocab_size=1, pad_id=0, max_len=8, tgt_pad_mask="none", d_model=8,
                         n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
    src = np.ones((1, 3), dtype=np.int64)
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    with pytest.raises(InputError) as info:
        model.generate(src, 4, 0, 0, num_beams=2)
    assert info.value.argument == "num_beams" and "at least 2 ids" in str(info.value), info.value
    assert to_numpy(model.generate(src, 4, 0, 0)).shape[0] == 1


def test_nan_logits_of_an_open_row_are_refused():
    """The search refuses to choose from NaN logits of a row that is still open (a fully masked
    attention row with a -inf fill), naming the step and the row."""
    from conformance.core.generation.search import search

    def step(tokens, parents):
        logits = np.zeros((len(tokens), 5))
        logits[1] = np.nan
        return logits

    with pytest.raises(InputError, match="NaN logits at step 0, row 1"):
        search(step, 2, 4, 1, 2, 0)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_pad_start_token_needs_no_target_padding_mask(backend):
    """Issue 27 item 3: a start token that is the pad id would be masked as a key by target
    padding; refused, the same everywhere, unless tgt_pad_mask="none" (Marian, Flax wmt)."""
    config = preset("llmhub", **SIZES)
    src, _ = batch(config)
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    with pytest.raises(InputError, match='decoding from the pad id needs tgt_pad_mask="none"') as info:
        model.generate(src, 4, config.pad_id, 2)
    assert info.value.argument == "bos_id"
    unmasked = backends.build(backends.Target(backend, "cpu", "float32"), config.replace(tgt_pad_mask="none"), None)
    assert to_numpy(unmasked.generate(src, 4, config.pad_id, 2)).shape[0] == 3


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_an_all_padding_source_row_is_refused(backend):
    """Issue 27 item 3: a source of padding only has nothing to translate."""
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    src[1] = config.pad_id
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    with pytest.raises(InputError, match="row 1 is all padding") as info:
        model.generate(src, 4, 1, 2)
    assert info.value.argument == "src_ids"


def test_the_two_length_penalties():
    assert penalty(4, 1.0, "hf") == 4.0 and penalty(4, 0.0, "hf") == 1.0
    assert np.isclose(penalty(7, 0.6, "gnmt"), 2.0 ** 0.6)  # ((5 + 7) / 6) ** 0.6


# -- Defaults from the generation note, integer scalars, several sequences ------------------------


def noted(config, **recorded):
    import json

    return config.replace(notes={**config.notes, "generation": json.dumps(recorded)})


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_arguments_default_to_the_generation_note_and_explicit_ones_win(backend):
    """As transformers applies a model's generation_config: what the call leaves out comes from
    the checkpoint's note (HF names; max_length counts the start token), the rest from the call."""
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        bare = backends.build(target, config, None)
        model = backends.build(target, noted(config, decoder_start_token_id=1, eos_token_id=2, num_beams=2,
                                                length_penalty=0.6, max_length=6, bad_words_ids=[[4]]), None)
        plain = bare.generate(src, 5, 1, 2, num_beams=2, length_penalty=0.6, banned_ids=[4])
        assert (to_numpy(model.generate(src)) == to_numpy(plain)).all()
        assert (to_numpy(model.generate(src, num_beams=1, banned_ids=())) == to_numpy(bare.generate(src, 5, 1, 2))).all()
        assert (to_numpy(model.generate(src, 7, 3)) == to_numpy(
            bare.generate(src, 7, 3, 2, num_beams=2, length_penalty=0.6, banned_ids=[4]))).all()
        with pytest.raises(InputError, match="has no \"generation\" note") as info:
            bare.generate(src, 5)
        assert info.value.argument == "bos_id"
        with pytest.raises(InputError) as info:
            bare.generate(src, 5, 1)
        assert info.value.argument == "eos_id"


def integer_scalars():
    """1 as an integer scalar of each installed backend."""
    scalars = [np.int64(1), np.int32(1), np.array(1)]
    try:
        import torch

        scalars.append(torch.tensor(1))
    except ImportError:
        pass
    try:
        import jax.numpy as jnp

        scalars.append(jnp.int32(1))
    except ImportError:
        pass
    return scalars


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_integer_scalars_of_every_backend_are_ids(backend):
    """Issue 27 item 7: np.int64(1), torch.tensor(1), jnp.int32(1) are ids; a float or bool
    scalar is refused, naming its type."""
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    expected = to_numpy(model.generate(src, 4, 1, 2, num_beams=2))
    for one in integer_scalars():
        got = model.generate(src, 4 * one, one, 2 * one, num_beams=2 * one, banned_ids=[3 * one])
        assert (to_numpy(got) == to_numpy(model.generate(src, 4, 1, 2, num_beams=2, banned_ids=[3]))).all(), type(one)
        assert (to_numpy(model.generate(src, 4, one, 2, num_beams=2)) == expected).all(), type(one)
    refused = [np.float64(1.0), np.bool_(True)]
    try:
        import torch

        refused += [torch.tensor(1.0), torch.tensor(True), torch.tensor([1])]
    except ImportError:
        pass
    for value in refused:
        with pytest.raises(InputError, match=type(value).__name__) as info:
            model.generate(src, 4, value, 2)
        assert info.value.argument == "bos_id"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_num_return_sequences_gives_the_best_beams_in_order(backend):
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, None)
        best, best_scores = model.generate(src, 6, 1, 2, num_beams=3, return_scores=True)
        ids, scores = model.generate(src, 6, 1, 2, num_beams=3, num_return_sequences=3, return_scores=True)
    ids, scores, best = to_numpy(ids), to_numpy(scores).reshape(3, 3), to_numpy(best)
    assert ids.shape[0] == 9
    width = best.shape[1]
    assert (ids[::3, :width] == best).all() and (ids[::3, width:] == config.pad_id).all()
    assert np.allclose(scores[:, 0], to_numpy(best_scores))
    assert (np.diff(scores, axis=1) <= 0).all(), scores  # best first
    assert len({tuple(row) for row in ids[:3]}) == 3  # three different hypotheses of row 0


# -- Sampling ----------------------------------------------------------------------------------

WARPINGS = [dict(temperature=0.7), dict(top_k=4), dict(top_p=0.8), dict(temperature=1.3, top_k=6, top_p=0.6),
            dict(top_k=1), dict(top_p=1e-6), dict(top_k=50)]


@pytest.mark.parametrize("options", WARPINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_filtered_distributions_equal_transformers_warpers(options):
    """`warp` against transformers' own TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper, applied in generate's order, on float64 logits with banned ids (-inf) and
    tied values; the filtered scores and their softmax are the same."""
    torch = pytest.importorskip("torch", reason="transformers' warpers are torch code")
    pytest.importorskip("transformers", reason="the reference is transformers itself")
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from conformance.core.generation.search import log_softmax, warp

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (6, 13))
    logits[:, 3] = -np.inf  # a banned id
    logits[1, [5, 6, 7]] = logits[1, 4]  # ties at the top
    logits[2, [8, 9]] = logits[2].max() + 1
    warpers = LogitsProcessorList()
    if options.get("temperature", 1.0) != 1.0:
        warpers.append(TemperatureLogitsWarper(options["temperature"]))
    if options.get("top_k", 0):
        warpers.append(TopKLogitsWarper(options["top_k"]))
    if options.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(options["top_p"]))
    theirs = warpers(torch.zeros((6, 1), dtype=torch.long), torch.from_numpy(logits.copy())).numpy()
    ours = warp(logits, **options)
    assert (np.isinf(ours) == np.isinf(theirs)).all(), (ours, theirs)
    np.testing.assert_allclose(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)], rtol=1e-15)
    np.testing.assert_allclose(np.exp(log_softmax(ours)), torch.from_numpy(theirs).softmax(-1).numpy(), atol=1e-15)


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    """Inverse-CDF sampling: evenly spread uniforms land on each id in proportion to its
    probability, and an id of probability 0 (between, before or after others) is never drawn."""
    from conformance.core.generation.search import draw

    probs = np.array([0.0, 0.1, 0.0, 0.25, 0.65, 0.0])
    uniforms = (np.arange(10000) + 0.5) / 10000
    ids, gaps = draw(np.tile(probs, (len(uniforms), 1)), uniforms)
    counts = np.bincount(ids, minlength=len(probs)) / len(uniforms)
    np.testing.assert_allclose(counts, probs, atol=1e-4)
    assert (gaps >= 0).all()
    assert draw(probs[None], np.array([0.0]))[0][0] == 1 and draw(probs[None], np.array([1 - 1e-16]))[0][0] == 4


SAMPLINGS = [dict(do_sample=True, seed=3), dict(do_sample=True, seed=5, temperature=0.6, top_k=5, top_p=0.9,
                                                  num_return_sequences=2)]


@pytest.mark.parametrize("options", SAMPLINGS, ids=["plain", "warped-2-each"])
def test_float64_backends_sample_identical_ids(options):
    """Every backend's device search samples the reference's ids from the same uniforms."""
    config = preset("paper", **SIZES)
    src, _ = batch(config)
    out = generate_all(config, src, **options)
    reference_ids, reference_scores = oracle(config, src, **options)
    assert reference_ids.shape[0] == 3 * options.get("num_return_sequences", 1)
    for backend, (ids, scores) in out.items():
        assert ids.shape == reference_ids.shape and (ids == reference_ids).all(), (backend, ids, reference_ids)
        np.testing.assert_allclose(scores, reference_scores, rtol=1e-9, err_msg=backend)


def test_sampling_is_the_seeds():
    """The same seed draws the same ids; other seeds draw others; the samples differ from greedy."""
    import impl_numpy

    config = preset("paper", **SIZES)
    src, _ = batch(config)
    model = impl_numpy.Model(config)
    first = model.generate(src, 8, 1, 2, do_sample=True, seed=0, num_return_sequences=4)
    assert (model.generate(src, 8, 1, 2, do_sample=True, seed=0, num_return_sequences=4) == first).all()
    others = [model.generate(src, 8, 1, 2, do_sample=True, seed=s, num_return_sequences=4) for s in (1, 2)]
    assert any(o.shape != first.shape or (o != first).any() for o in others)
    greedy = model.generate(src, 8, 1, 2)
    assert len({tuple(row) for row in first.tolist()}) > 3  # 12 samples of 3 rows are not 3 sequences
    # top_k=1 keeps only the best id: sampling is greedy search
    assert (model.generate(src, 8, 1, 2, do_sample=True, seed=0, top_k=1) == greedy).all()
