"""Hugging Face's logits processors in `generate` (issue 42): forced_bos_id, no_repeat_ngram_size
and bad_words_ids of several tokens, beside the banned ids and the forced end token.

- Against transformers itself: the ids of `MarianMTModel.generate` on the random Marian model of
  tests/generation/test_generate_hf.py (float64, padded sources, greedy and beam 4), from every backend, for
  each processor and for combinations, given as arguments and read from the checkpoint's
  generation note with no argument passed. Each setting is checked to change transformers' own
  ids, so that it tests something.
- The device search (conformance/core/generation/device.py) against the reference search on the
  synthetic logits of tests/generation/test_device_search.py, ties included, in NumPy, torch and JAX.
- The arguments: the note's fields, explicit arguments winning, and one InputError per bad value,
  the same from every backend.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json

import numpy as np
import pytest
from thorough import thorough_only

from conformance import InputError
from conformance.check import backends
from conformance.check.compare import to_numpy
from conformance.core.generation import device as device_search
from conformance.core.generation.note import generation_note
from conformance.core.generation.settings import resolve
from conformance.core.generation.search import search, uniforms
from conformance.core.generation.device import NumpyOps, Rules, processor_data
from conformance.core.presets import preset
from systems.harness import BACKEND_PARAMS
from test_device_search import BOS, EOS, PAD as SYNTHETIC_PAD, ROWS, VOCAB as SYNTHETIC_VOCAB, logits_of, table

# -- Against transformers ------------------------------------------------------------------------

torch_module = pytest.importorskip("torch", reason="Marian is a PyTorch model")
pytest.importorskip("transformers", reason="the reference is transformers' generate")

from test_generate_hf import MAX_LENGTH, PAD, ported, reference_model, source  # noqa: E402

# The random Marian model's own choices (tests/generation/test_generate_hf.py): greedy repeats 12 in row 0
# and 26 26 23 23 ... in row 2, and row 1 ends at once; so each setting below changes some row.
# (label, transformers' generate arguments, ours, a decoder start token other than Marian's pad)
SETTINGS = [
    ("no_repeat_ngram_size=2", dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2), None),
    ("no_repeat_ngram_size=3", dict(no_repeat_ngram_size=3), dict(no_repeat_ngram_size=3), None),
    # From 12, as the model's favourite: the start token is part of the n-grams (12 12 is one).
    ("no_repeat_ngram_size=2, start 12", dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2), 12),
    ("forced_bos", dict(forced_bos_token_id=5), dict(forced_bos_id=5), None),
    # After the start token, 12 is banned; 23 after 26 26; the end token after 12 12; 7 always;
    # [0] (the end token alone) is dropped, as transformers drops it.
    ("bad_words_ids", dict(bad_words_ids=[[PAD, 12], [26, 26, 23], [12, 12, 0], [7], [0]]),
     dict(bad_words_ids=[[PAD, 12], [26, 26, 23], [12, 12, 0], [7], [0]]), None),
    ("all of them", dict(no_repeat_ngram_size=3, forced_bos_token_id=26, bad_words_ids=[[26, 23], [5, 5, 5]]),
     dict(no_repeat_ngram_size=3, forced_bos_id=26, bad_words_ids=[[26, 23], [5, 5, 5]]), None),
    # The end token banned while the decoder input (start token included) is shorter than 6, or
    # fewer than 5 tokens were generated; min_new_tokens replaces min_length, as in transformers
    # (applying both would ban the end token until the 9th token).
    ("min_length=6", dict(min_length=6), dict(min_length=6), None),
    ("min_new_tokens=5", dict(min_new_tokens=5), dict(min_new_tokens=5), None),
    ("min_new_tokens=5 over min_length=10", dict(min_length=10, min_new_tokens=5),
     dict(min_length=10, min_new_tokens=5), None),
    ("min_length=7 with the others", dict(min_length=7, no_repeat_ngram_size=2, forced_bos_token_id=26),
     dict(min_length=7, no_repeat_ngram_size=2, forced_bos_id=26), None),
]


def hf_generate(model, src, **options):
    import torch

    pad = model.config.pad_token_id
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src != pad).long(),
                             do_sample=False, **options)
    return out[:, 1:].numpy()


@functools.cache
def transformers_ids(label: str, num_beams: int) -> np.ndarray:
    """transformers' ids for a setting (its name, or "plain" for no processor)."""
    options, start = ({}, None) if label == "plain" else next((hf, s) for name, hf, _, s in SETTINGS if name == label)
    extra = {} if start is None else {"decoder_start_token_id": start}
    return hf_generate(reference_model(), source(), max_length=MAX_LENGTH, num_beams=num_beams, **extra, **options)


def our_generate(backend: str, config, params, *args, **options) -> np.ndarray:
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        return to_numpy(model.generate(source(), *args, **options)).astype(np.int64)


def same_ids(ids, expected, where: str) -> None:
    assert ids.shape == expected.shape and (ids == expected).all(), \
        f"{where}:\nours {ids.tolist()}\nHF   {expected.tolist()}"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_processors_give_the_ids_of_transformers(backend, num_beams):
    config, params = ported()
    generation = reference_model().generation_config
    for label, hf_options, options, start in SETTINGS:
        expected = transformers_ids(label, num_beams)
        plain = transformers_ids("plain", num_beams) if start is None else hf_generate(
            reference_model(), source(), max_length=MAX_LENGTH, num_beams=num_beams, decoder_start_token_id=start)
        assert plain.shape != expected.shape or (plain != expected).any(), f"{label} changes nothing here"
        ids = our_generate(backend, config, params, MAX_LENGTH - 1,
                           generation.decoder_start_token_id if start is None else start, generation.eos_token_id,
                           num_beams=num_beams, forced_eos=True, **options)
        same_ids(ids, expected, f"{backend}, num_beams={num_beams}, {label}")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_uncached_loop_applies_the_processors_alike(backend):
    """use_cache=False (the whole decoder over the prefix at every step) chooses the same ids."""
    pytest.importorskip(backend)
    config, params = ported()
    generation = reference_model().generation_config
    _, _, options, _ = SETTINGS[-1]
    for num_beams in (1, 4):
        call = (MAX_LENGTH - 1, generation.decoder_start_token_id, generation.eos_token_id)
        cached = our_generate(backend, config, params, *call, num_beams=num_beams, forced_eos=True, **options)
        plain = our_generate(backend, config, params, *call, num_beams=num_beams, forced_eos=True, use_cache=False,
                             **options)
        same_ids(plain, cached, f"{backend}, num_beams={num_beams}, use_cache=False")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_the_processors_from_the_generation_note_give_the_ids_of_transformers(backend):
    """A model whose generation_config sets the processors: transformers applies it when generate
    gets no argument, and so does ours from the checkpoint's note (the note as the converter
    writes it, `hf_generation_note`, with the two fields the layouts may list)."""
    from conformance.convert.sources import GENERATION_KEYS, hf_generation_note

    model = copy.deepcopy(reference_model())
    generation = model.generation_config
    generation.update(num_beams=4, max_length=MAX_LENGTH, no_repeat_ngram_size=2, forced_bos_token_id=26,
                      bad_words_ids=[[26, 23], [PAD], [12, 5, 5]])
    expected = hf_generate(model, source())
    config, params = ported()
    keys = GENERATION_KEYS + tuple(key for key in ("forced_bos_token_id", "no_repeat_ngram_size")
                                   if key not in GENERATION_KEYS)
    config = config.replace(notes={**config.notes, "generation": hf_generation_note(generation, keys)})
    same_ids(our_generate(backend, config, params), expected, f"{backend}, from the note")
    plain = transformers_ids("plain", 4)
    assert plain.shape != expected.shape or (plain != expected).any(), "the note's processors change nothing"


# The families whose generation configs set the processors: BART's summarisation config (its
# start token is the end token; bos forced first; no repeated 3-gram; forced end; 4 beams,
# length penalty 2) and mBART-50's translation config (the target language's code forced first).
# Tiny random models ported with `conformance.convert.from_hf`: the note gives everything (the
# start, end and forced ids, no_repeat_ngram_size, beams and penalty); generate gets no argument.
FAMILIES = {
    "bart": ("BartForConditionalGeneration", "BartConfig",
             dict(forced_bos_token_id=0, no_repeat_ngram_size=3, num_beams=4, length_penalty=2.0)),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig",
              dict(forced_bos_token_id=27, no_repeat_ngram_size=2, num_beams=1)),
}


@functools.cache
def family_model(family: str):
    import torch
    import transformers

    model_class, config_class, generation = FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=31, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=40,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval().double()
    with torch.no_grad():  # larger than the initialisation, so that the choices are the model's
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    model.generation_config.update(max_length=MAX_LENGTH, **generation)
    return model


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_generation_config_gives_the_ids_of_transformers(backend, family):
    from conformance.convert import from_hf

    model = family_model(family)
    src = np.array([[5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 2, 1, 1, 1, 1], [15, 16, 2, 1, 1, 1, 1, 1]])
    expected = hf_generate(model, src)
    generation = model.generation_config
    plain = hf_generate(model, src, forced_bos_token_id=None, no_repeat_ngram_size=0)
    assert plain.shape != expected.shape or (plain != expected).any(), f"{family}: the processors change nothing"
    config, params = from_hf(model)
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ours = backends.build(target, config, params)
        ids = to_numpy(ours.generate(src)).astype(np.int64)
    assert json.loads(config.notes["generation"])["no_repeat_ngram_size"] == generation.no_repeat_ngram_size
    same_ids(ids, expected, f"{backend}, {family}")


# -- The device search against the reference -----------------------------------------------------

# Every processor, alone and together, under every search (synthetic logits, VOCAB 7: n-grams
# repeat, and no_repeat_ngram_size=1 runs out of ids, every score -inf, at the last steps).
PROCESSORS = [dict(no_repeat_ngram_size=n) for n in (1, 2, 3)] + [
    dict(forced_bos_id=4),
    dict(bad_words_ids=((BOS, 3), (3, 5), (5, 5, 6), (4,), (EOS,))),
    dict(bad_words_ids=((3, 3, 3, 3, 3, 3, 3, 3, 3),)),  # longer than any sequence: never applies
    dict(no_repeat_ngram_size=2, forced_bos_id=3, bad_words_ids=((3, 4), (BOS, 3, 6))),
    dict(min_length=5),
    dict(min_new_tokens=3, no_repeat_ngram_size=2, forced_bos_id=EOS),  # the forced first token wins
    dict(min_new_tokens=4),
]
SEARCHES = [dict(num_beams=1), dict(num_beams=3, early_stopping="never"), dict(num_beams=2, early_stopping=True),
            dict(num_beams=2, beam_rule="flax", length_penalty_form="gnmt"),
            dict(num_beams=1, do_sample=True, temperature=0.7, top_k=3, top_p=0.9, seed=3, num_return_sequences=2)]
# (max_len, the other options): rows that run to the forced end token (the end id banned until
# then), and rows that end at varied steps.
BASES = [(8, dict(forced_eos=True, banned_ids=(EOS,))), (6, dict(banned_ids=(6,)))]


def synthetic_settings():
    for (max_len, base), search_options, processors in itertools.product(BASES, SEARCHES, PROCESSORS):
        if search_options.get("do_sample") and processors.get("no_repeat_ngram_size") == 1:
            continue  # a row without any id left has no distribution to draw from (transformers raises)
        yield max_len, {**base, **search_options, **processors}


def rows_per_source(settings) -> int:
    return settings.get("num_return_sequences", 1) if settings.get("do_sample") else settings["num_beams"]


def reference(settings, values, max_len: int, src_ids=None):
    """The reference search on the synthetic logits; `src_ids` (ROWS, S) for the processors that read
    a source (tests/generation/test_generation_config_processors.py)."""
    per = rows_per_source(settings)
    source = {} if src_ids is None else {"src_ids": src_ids}
    return search(lambda tokens, parents: logits_of(tokens, per, values), ROWS, max_len, BOS, EOS, SYNTHETIC_PAD,
                  **source, **settings)


def device(ops, settings, values, max_len: int, as_array, to_numpy=np.asarray, src_ids=None):
    """The device search on the synthetic logits, with `settings` resolved as generate does (and
    `src_ids`, as `reference`)."""
    config = preset("paper", src_vocab_size=SYNTHETIC_VOCAB, tgt_vocab_size=SYNTHETIC_VOCAB, max_len=max_len,
                    pad_id=SYNTHETIC_PAD)
    resolved = resolve(config, max_len, BOS, EOS, **settings)
    rules, per = device_search.rules_of(resolved), rows_per_source(settings)
    mask = np.zeros(SYNTHETIC_VOCAB, dtype=bool)
    mask[list(resolved.banned_ids)] = True
    dtype = as_array("scores", np.zeros((), np.float64)).dtype
    sampling = None
    if rules.do_sample:
        sampling = {"uniforms": as_array("uniforms", uniforms(resolved.seed, max_len, ROWS * per)),
                    **{name: getattr(resolved, name) for name in ("temperature", "top_k", "top_p")}}

    def step(state, i):
        tokens = to_numpy(device_search.prefix(ops, rules, state, i))
        return as_array("logits", logits_of(tokens, per, values))

    ids, scores = device_search.run(
        ops, rules, step, ROWS, BOS, EOS, SYNTHETIC_PAD, as_array("banned", mask), resolved.length_penalty, dtype,
        lambda *arrays: [to_numpy(a).item() for a in arrays], resolved.num_return_sequences, sampling, True,
        processor_data(resolved, as_array, src_ids, SYNTHETIC_VOCAB))
    return to_numpy(ids), to_numpy(scores)


def same(got, expected, settings, rtol: float = 1e-14):
    (ids, scores), (ref_ids, ref_scores) = got, expected
    assert ids.shape == ref_ids.shape and (ids == ref_ids).all(), (settings, ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=rtol, atol=0, err_msg=str(settings))


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_numpy_device_search_applies_the_processors_as_the_reference(kind):
    values = table(kind)
    for max_len, settings in synthetic_settings():
        got = device(NumpyOps(), settings, values, max_len, lambda name, value: value)
        same(got, reference(settings, values, max_len), settings)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_torch_device_search_applies_the_processors_as_the_reference(kind):
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table(kind)
    for max_len, settings in synthetic_settings():
        got = device(Ops("cpu"), settings, values, max_len,
                     lambda name, value: value if name == "forced_bos" else torch.as_tensor(value),
                     to_numpy=lambda a: a.cpu().numpy())
        same(got, reference(settings, values, max_len), settings)


# Eager JAX dispatches op by op: the three eager-JAX device-search tests (test_device_search.py,
# test_generate_processors.py) took 73 CPU-seconds with both tables, 57 with the tie-heavy one,
# where the lower-index rule decides. Under `ci` that one only: the continuous table runs the same
# settings through the same ops, and the NumPy and torch adapters run both tables in CI.
JAX_KINDS = ["ties", pytest.param("continuous", marks=thorough_only(
    "eager JAX on the continuous table repeats the ties run's settings and ops"))]


# On the worker of tests/generation/test_device_search.py's eager-JAX searches: the same ops at the same shapes,
# compiled once in that process (test_device_search.py's EAGER_JAX_SEARCH says what it saves).
@pytest.mark.xdist_group("eager-jax-search")
@pytest.mark.parametrize("kind", JAX_KINDS)
def test_jax_device_search_applies_the_processors_as_the_reference(kind):
    """Eager JAX, with the forced id and the table as arrays, as the compiled search takes them."""
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    from impl_jax.decode import Ops

    values = table(kind)
    with impl_jax.enable_x64():
        for max_len, settings in list(synthetic_settings())[::3]:  # eager JAX dispatches op by op
            got = device(Ops(None), settings, values, max_len, lambda name, value: jnp.asarray(value))
            same(got, reference(settings, values, max_len), settings)


def test_the_synthetic_settings_reach_what_they_test():
    """Each processor changes the reference's ids on these logits under some search, except the
    word longer than any sequence, which changes none."""
    values = table("continuous")
    for processors in PROCESSORS:
        changed = []
        for (max_len, base), search_options in itertools.product(BASES, SEARCHES):
            if search_options.get("do_sample") and processors.get("no_repeat_ngram_size") == 1:
                continue
            plain = reference({**base, **search_options}, values, max_len)[0]
            ids = reference({**base, **search_options, **processors}, values, max_len)[0]
            changed.append(ids.shape != plain.shape or (ids != plain).any())
        assert any(changed) == (processors is not PROCESSORS[5]), (processors, changed)


# -- The rules, one by one -----------------------------------------------------------------------


def test_the_reference_bans_as_transformers_processors_do():
    """`repeated_ngram_bans` and `bad_word_bans` against NoRepeatNGramLogitsProcessor and
    NoBadWordsLogitsProcessor on the same rows (the start token first)."""
    import torch
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor

    from conformance.core.generation.processors import Processors, processed as _processed

    rng = np.random.default_rng(0)
    for t in range(1, 9):
        tokens = rng.integers(0, 4, size=(6, t))  # few ids: n-grams repeat
        for n in (1, 2, 3, 4):
            scores = rng.normal(size=(6, 5))
            expected = NoRepeatNGramLogitsProcessor(n)(torch.from_numpy(tokens), torch.from_numpy(scores.copy()))
            got = _processed(scores.copy(), tokens, t - 1, Processors(max_len=20, eos_id=4, no_repeat_ngram_size=n))
            assert (got == expected.numpy()).all(), (tokens, n)
        words = [[0, 1], [1, 1, 2], [2, 0, 3, 1], [3], [4], [0, 0, 0, 0, 0, 0, 0, 0, 0, 2]]
        scores = rng.normal(size=(6, 5))
        expected = NoBadWordsLogitsProcessor(words, eos_token_id=4)(torch.from_numpy(tokens),
                                                                     torch.from_numpy(scores.copy()))
        processors = Processors(max_len=20, eos_id=4, banned_ids=(3,),
                                bad_words_ids=tuple(tuple(w) for w in words if len(w) > 1))
        assert (_processed(scores.copy(), tokens, t - 1, processors) == expected.numpy()).all(), tokens


def test_the_minimum_length_bans_as_transformers_processors_do():
    """`Processors.bans_eos` against MinLengthLogitsProcessor and MinNewTokensLengthLogitsProcessor
    (its prompt the start token: transformers' input_ids_seq_length for an encoder-decoder)."""
    import torch
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    from conformance.core.generation.processors import Processors, processed as _processed

    rng = np.random.default_rng(1)
    for t in range(1, 9):
        tokens = rng.integers(0, 5, size=(3, t))
        for minimum in range(0, 10):
            scores = rng.normal(size=(3, 5))
            expected = MinLengthLogitsProcessor(minimum, eos_token_id=4)(torch.from_numpy(tokens),
                                                                          torch.from_numpy(scores.copy()))
            got = _processed(scores.copy(), tokens, t - 1, Processors(max_len=20, eos_id=4, min_length=minimum))
            assert (got == expected.numpy()).all(), (t, minimum)
            expected = MinNewTokensLengthLogitsProcessor(1, minimum, eos_token_id=4)(torch.from_numpy(tokens),
                                                                                      torch.from_numpy(scores.copy()))
            got = _processed(scores.copy(), tokens, t - 1, Processors(max_len=20, eos_id=4, min_new_tokens=minimum))
            assert (got == expected.numpy()).all(), (t, minimum)


# -- Arguments: the note, explicit arguments, errors ----------------------------------------------

SIZES = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1,
             n_decoder_layers=2, max_len=12)


def small_source(config):
    rng = np.random.default_rng(0)
    src = rng.integers(3, config.src_vocab_size, size=(3, 6))
    src[1, 4:] = config.pad_id
    return src


def noted(config, **recorded):
    return config.replace(notes={**config.notes, "generation": json.dumps(recorded)})


def test_the_note_carries_the_processors():
    config = preset("paper", **SIZES)
    note = generation_note(noted(config, eos_token_id=2, forced_bos_token_id=5, no_repeat_ngram_size=3,
                                 bad_words_ids=[[4], [2], [6, 7], [8, 9, 10]]))
    assert note["forced_bos_id"] == 5 and note["no_repeat_ngram_size"] == 3
    assert note["banned_ids"] == [4] and note["bad_words_ids"] == [[6, 7], [8, 9, 10]]  # [2], the end, dropped
    settings = resolve(noted(config, decoder_start_token_id=1, eos_token_id=2, forced_bos_token_id=5,
                             no_repeat_ngram_size=3, bad_words_ids=[[4], [6, 7]]))
    assert (settings.forced_bos_id, settings.no_repeat_ngram_size) == (5, 3)
    assert settings.banned_ids == (4,) and settings.bad_words_ids == ((6, 7),)
    # Explicit arguments win; an explicit bad_words_ids replaces the note's whole list.
    explicit = resolve(noted(config, decoder_start_token_id=1, eos_token_id=2, forced_bos_token_id=5,
                             no_repeat_ngram_size=3, bad_words_ids=[[4], [6, 7]]),
                       forced_bos_id=False, no_repeat_ngram_size=0, bad_words_ids=[[8, 9], [10], [2]])
    assert explicit.forced_bos_id is None and explicit.no_repeat_ngram_size == 0
    assert explicit.banned_ids == (10,) and explicit.bad_words_ids == ((8, 9),)
    # min_length, min_new_tokens and early_stopping (beam_rule="hf" only) from the note.
    long = noted(config, decoder_start_token_id=1, eos_token_id=2, min_length=6, early_stopping=True)
    assert generation_note(long)["min_length"] == 6 and generation_note(long)["early_stopping"] is True
    settings = resolve(long)
    assert (settings.min_length, settings.min_new_tokens, settings.early_stopping) == (6, 0, True)
    assert resolve(long, early_stopping="never", min_length=0).early_stopping == "never"
    assert resolve(long, min_length=0).min_length == 0 and resolve(long, min_new_tokens=2).min_length == 0
    assert resolve(long, beam_rule="flax", num_beams=2).early_stopping is False
    new = noted(config, decoder_start_token_id=1, eos_token_id=2, min_length=6, min_new_tokens=3)
    assert (resolve(new).min_length, resolve(new).min_new_tokens) == (0, 3)  # it replaces min_length
    assert (resolve(new, min_length=4).min_length, resolve(new, min_length=4).min_new_tokens) == (4, 0)
    both = resolve(noted(config, decoder_start_token_id=1, eos_token_id=2, bad_words_ids=[[4], [6, 7]]),
                   banned_ids=[2], bad_words_ids=[[3]])
    assert both.banned_ids == (2, 3) and both.bad_words_ids == ()  # banned_ids may ban the end token


def test_a_model_decodes_with_the_notes_processors_unless_told_otherwise():
    config = preset("paper", **SIZES)
    src = small_source(config)
    bare = backends.build(backends.Target("numpy", "cpu", "float64"), config, None)
    model = backends.build(backends.Target("numpy", "cpu", "float64"), noted(
        config, decoder_start_token_id=1, eos_token_id=2, max_length=9, num_beams=2, forced_bos_token_id=5,
        no_repeat_ngram_size=2, bad_words_ids=[[4], [5, 6]]), None)
    processors = dict(forced_bos_id=5, no_repeat_ngram_size=2, bad_words_ids=[[4], [5, 6]])
    assert (model.generate(src) == bare.generate(src, 8, 1, 2, num_beams=2, **processors)).all()
    assert (model.generate(src, forced_bos_id=False, no_repeat_ngram_size=0, bad_words_ids=[]) ==
            bare.generate(src, 8, 1, 2, num_beams=2)).all()
    assert (model.generate(src, forced_bos_id=7) == bare.generate(src, 8, 1, 2, num_beams=2, **{
        **processors, "forced_bos_id": 7})).all()
    assert (model.generate(src, forced_bos_id=7)[:, 0] == 7).all()


BAD_OPTIONS = [
    (dict(forced_bos_id=13), "forced_bos_id"),
    (dict(forced_bos_id=-1), "forced_bos_id"),
    (dict(forced_bos_id=1.0), "forced_bos_id"),
    (dict(forced_bos_id=True), "forced_bos_id"),
    (dict(forced_bos_id=np.array([1, 2])), "forced_bos_id"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size"),
    (dict(no_repeat_ngram_size=True), "no_repeat_ngram_size"),
    (dict(bad_words_ids=3), "bad_words_ids"),
    (dict(bad_words_ids="ab"), "bad_words_ids"),
    (dict(bad_words_ids=[3, 4]), "bad_words_ids"),  # a list of ids, not of lists
    (dict(bad_words_ids=[[]]), "bad_words_ids"),
    (dict(bad_words_ids=[[1, 13]]), "bad_words_ids"),
    (dict(bad_words_ids=[[1, -1]]), "bad_words_ids"),
    (dict(bad_words_ids=[["a"]]), "bad_words_ids"),
    (dict(bad_words_ids=[[1.0, 2]]), "bad_words_ids"),
    (dict(min_length=-1), "min_length"),
    (dict(min_length=3.0), "min_length"),
    (dict(min_length=True), "min_length"),
    (dict(min_new_tokens=-2), "min_new_tokens"),
    (dict(min_new_tokens="3"), "min_new_tokens"),
    (dict(min_new_tokens=2, min_length=-1), "min_length"),  # checked even where min_new_tokens replaces it
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bad_processor_arguments_get_the_same_error_everywhere(backend):
    config = preset("paper", **SIZES)
    src = small_source(config)
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    oracle = backends.build(backends.Target("numpy", "cpu", "float32"), config, None)
    for options, argument in BAD_OPTIONS:
        call = dict(max_len=5, bos_id=1, eos_id=2) | options
        with pytest.raises(InputError) as info:
            model.generate(src, **call)
        assert info.value.argument == argument, (options, info.value)
        assert str(info.value) == str(pytest.raises(InputError, oracle.generate, src, **call).value)
    with pytest.raises(InputError) as info:  # the note's values are checked the same way
        backends.build(backends.Target(backend, "cpu", "float32"), noted(
            config, decoder_start_token_id=1, eos_token_id=2, no_repeat_ngram_size=-2), None).generate(src)
    assert info.value.argument == "no_repeat_ngram_size"


def test_jax_compiles_one_search_for_every_forced_id_and_table_of_one_shape():
    pytest.importorskip("jax")
    import impl_jax

    config = preset("paper", **SIZES)
    src = small_source(config)
    model = backends.build(backends.Target("jax", "cpu", "float32"), config, None)
    model.generate(src, 6, 1, 2, num_beams=2, forced_bos_id=3, bad_words_ids=[[3, 4], [5, 6, 7]], min_length=3)  # warm
    impl_jax.reset_stats()
    model.generate(src, 6, 1, 2, num_beams=2, forced_bos_id=8, bad_words_ids=[[8, 9], [4, 4, 4]], min_length=5)
    model.generate(src, 6, 1, 2, num_beams=2, forced_bos_id=8, bad_words_ids=[[8, 9], [4, 4, 4]], min_new_tokens=2)
    assert impl_jax.compile_stats()["compiles"] == 0, impl_jax.compile_stats()


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_rosetta_generate_passes_the_processor_flags(backend, capsys):
    """`--no-repeat-ngram-size`, `--forced-bos` and `--bad-words` reach generate (the toy model
    would print "5 1 4 1 3"); a bad value is named by its flag."""
    from conformance.check import toy
    from conformance.check.defaults import default_model
    from conformance.cli import main

    config, params, _ = default_model()
    model = backends.build(backends.Target("numpy", "cpu", "float32"), config, params)
    seven, one = toy.encode_text("71")
    ids = to_numpy(model.generate(np.array([toy.encode_text("31415")]), config.max_len, toy.BOS, toy.EOS,
                                  no_repeat_ngram_size=2, forced_bos_id=seven, bad_words_ids=[[seven, one]]))[0]
    expected = toy.decode_ids(ids)
    assert expected.startswith("7") and expected != "7 1 4 1 3", expected
    assert main(["generate", "--src", "3 1 4 1 5", "--backend", backend, "--no-repeat-ngram-size", "2",
                 "--forced-bos", str(seven), "--bad-words", f"{seven},{one}"]) == 0
    assert capsys.readouterr().out.strip() == expected
    for flag, value in (("--bad-words", "1,x"), ("--bad-words", "1,;2"), ("--no-repeat-ngram-size", "-1"),
                        ("--forced-bos", "99")):
        assert main(["generate", "--src", "3 1 4", "--backend", backend, flag, value]) == 2
        err = capsys.readouterr().err
        assert f"{flag}:" in err and "Traceback" not in err, err
