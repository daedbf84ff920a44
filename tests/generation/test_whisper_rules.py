"""Whisper's decoding rules in the shared search (issue 54): the forced prompt, the timestamp rules,
the no-speech probability and openai-whisper's beam search (docs/whisper.md, "Decoding").

- The reference's timestamp rules (conformance/core/generation/processors.py) against
  transformers' `WhisperTimeStampLogitsProcessor` and openai-whisper's `ApplyTimestampRules` on
  the same random rows, float64: the same ids banned.
- The note's prompt and length (`note.whisper_prompt`, `whisper_max_len`) against transformers'
  `_retrieve_init_tokens` and `_set_max_new_tokens_and_length` on the same generation configs.
- The device search (conformance/core/generation/device.py, pipeline.py) against the reference on
  the synthetic logits of tests/generation/test_device_search.py, ties included, in NumPy, torch
  and JAX: the ids, the scores and the no-speech probabilities, under every search rule.
- The arguments: one InputError per bad value, the same from every backend; the note's
  settings, explicit ones winning; one JAX program for every prompt, language and bound of a
  shape. The systems' own ids: tests/generation/test_generate_openai_whisper.py and
  test_generate_hf_whisper.py.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from conformance import InputError
from conformance.check import backends
from conformance.core.config import ModelConfig
from conformance.core.generation import device as device_search
from conformance.core.generation.device import NumpyOps, processor_data
from conformance.core.generation.note import generation_note, unapplied_generation, whisper_max_len, whisper_prompt
from conformance.core.generation.processors import Processors, Timestamps, processed
from conformance.core.generation.search import search, uniforms
from conformance.core.generation.settings import resolve
from systems.harness import BACKEND_PARAMS
from test_device_search import logits_of, table

# A synthetic vocabulary laid out as Whisper's: pad 0, start 1, end 2, text 3-9, three languages,
# the task, the no-speech id, the no-timestamps id, then eight timestamps.
PAD, BOS, EOS, EN, DE, FR, TRANSCRIBE, NO_SPEECH, NO_TIMESTAMPS = 0, 1, 2, 10, 11, 12, 13, 14, 15
VOCAB, ROWS, MAX_LEN = 24, 3, 8
NOTE = {"decoder_start_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "no_timestamps_token_id": NO_TIMESTAMPS,
        "forced_decoder_ids": [[1, None], [2, TRANSCRIBE]], "lang_to_id": {"<|en|>": EN, "<|de|>": DE, "<|fr|>": FR},
        "task_to_id": {"transcribe": TRANSCRIBE}, "max_initial_timestamp_index": 2, "max_new_tokens": 5,
        "suppress_tokens": [NO_SPEECH], "begin_suppress_tokens": [EOS]}


def noted(**fields) -> ModelConfig:
    note = {**NOTE, **fields}
    return ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, max_len=MAX_LEN + 2, pad_id=PAD,
                       notes={"generation": json.dumps({k: v for k, v in note.items() if v is not None})})


# -- The timestamp rules against transformers' and openai-whisper's ------------------------------


def random_rows(rng, rows: int, prompt: int, generated: int) -> np.ndarray:
    """(rows, 1 + prompt + generated) decoder inputs, the generated ids half timestamps, half text."""
    head = np.tile([BOS] + [EN, TRANSCRIBE, 3][:prompt], (rows, 1))
    body = np.where(rng.random((rows, generated)) < 0.5, rng.integers(NO_TIMESTAMPS + 1, VOCAB, (rows, generated)),
                    rng.integers(3, NO_TIMESTAMPS + 1, (rows, generated)))
    return np.concatenate([head, body], axis=1)


@pytest.mark.parametrize("max_initial", [None, 0, 3])
def test_the_timestamp_rules_are_transformers_and_openai_whispers(max_initial):
    """Random rows after prompts of 0-3 tokens, 0-6 generated ids (timestamps, text, the end),
    scores made to favour timestamps or text: the reference bans what both systems ban."""
    torch = pytest.importorskip("torch")
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    whisper_decoding = pytest.importorskip("whisper.decoding")

    class Tokenizer:  # what ApplyTimestampRules reads of openai's
        no_timestamps, timestamp_begin, eot = NO_TIMESTAMPS, NO_TIMESTAMPS + 1, EOS

    rng = np.random.default_rng(54)
    forced = 0
    for prompt, generated, bias in itertools.product(range(4), range(7), (-3.0, 0.0, 3.0)):
        tokens = random_rows(rng, 6, prompt, generated)
        scores = rng.normal(size=(6, VOCAB)) * 2.0
        scores[:, NO_TIMESTAMPS + 1:] += bias  # timestamps favoured or not: the forced-timestamp rule both ways
        processors = Processors(max_len=MAX_LEN, eos_id=EOS, timestamps=Timestamps(
            begin=NO_TIMESTAMPS + 1, no_timestamps=NO_TIMESTAMPS, max_initial=max_initial, sample_begin=1 + prompt))
        ours = processed(scores.copy(), tokens, tokens.shape[1] - 1, processors)
        config = GenerationConfig(no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS,
                                  max_initial_timestamp_index=max_initial)
        theirs = WhisperTimeStampLogitsProcessor(config, begin_index=1 + prompt)(
            torch.from_numpy(tokens), torch.from_numpy(scores)).numpy()
        openai = torch.from_numpy(scores.copy())
        whisper_decoding.ApplyTimestampRules(Tokenizer(), 1 + prompt, max_initial).apply(openai, torch.from_numpy(tokens))
        assert (np.isneginf(ours) == np.isneginf(theirs)).all(), (prompt, generated, tokens)
        assert (np.isneginf(ours) == np.isneginf(openai.numpy())).all(), (prompt, generated, tokens)
        np.testing.assert_array_equal(ours[~np.isneginf(ours)], scores[~np.isneginf(ours)])
        forced += int(np.isneginf(ours[:, 3:NO_TIMESTAMPS]).all(axis=1).sum())
    assert forced > 20  # the rows where text was banned: pairs, the first step, timestamps forced


# -- The note's prompt and length against transformers' -------------------------------------------

GENERATION_CONFIGS = [
    {},
    {"return_timestamps": True},
    {"forced_decoder_ids": [[1, EN], [2, TRANSCRIBE]]},
    {"forced_decoder_ids": [[1, EN], [2, TRANSCRIBE]], "return_timestamps": True},
    {"forced_decoder_ids": [[1, EN], [2, TRANSCRIBE], [3, NO_TIMESTAMPS]], "return_timestamps": True},
    {"forced_decoder_ids": [[2, TRANSCRIBE]], "lang_to_id": None, "task_to_id": None},
    {"forced_decoder_ids": [[1, None], [2, TRANSCRIBE]], "lang_to_id": None},
    {"forced_decoder_ids": None, "language": "de"},
    {"forced_decoder_ids": None, "language": "<|fr|>", "return_timestamps": True},
    {"forced_decoder_ids": [[1, NO_TIMESTAMPS]], "lang_to_id": None, "task_to_id": None},
]


@pytest.mark.parametrize("fields", GENERATION_CONFIGS, ids=[json.dumps(f) for f in GENERATION_CONFIGS])
def test_the_note_prompt_is_transformers(fields):
    """transformers' Whisper `generate` builds its init tokens from the generation config; with the
    language left free it detects one at the start token, which our prompt leaves as None (the
    transformers model here stands in for that step: a detection is replaced by None)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    note = {k: v for k, v in {**NOTE, **fields}.items() if v is not None}
    generation = transformers.GenerationConfig(**note)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=1,
        decoder_attention_heads=1, encoder_ffn_dim=8, decoder_ffn_dim=8, num_mel_bins=4, max_source_positions=2,
        max_target_positions=MAX_LEN + 2, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS))
    timestamps = bool(note.get("return_timestamps"))
    model.detect_language = lambda **kwargs: torch.full((1,), -7)  # stands for the detected language
    generation.return_timestamps = timestamps
    init = model._retrieve_init_tokens(torch.zeros((1, 4, 4)), batch_size=1, generation_config=generation,
                                       config=model.config, num_segment_frames=4, kwargs={})[0].tolist()
    expected = tuple(None if token == -7 else token for token in init[1:])
    assert whisper_prompt(note, timestamps) == expected
    config = noted(**fields)
    assert resolve(config, return_timestamps=timestamps).prefix == expected  # the note's prompt, prefix= unset
    for lengths in ({"max_new_tokens": 3}, {"max_new_tokens": None, "max_length": 6}, {"max_new_tokens": None}):
        generation = transformers.GenerationConfig(**{**note, **lengths})
        decoder_input_ids = torch.zeros((1, len(init)), dtype=torch.long)
        model._set_max_new_tokens_and_length(model.config, decoder_input_ids, generation)
        total = (generation.max_new_tokens + len(init) if generation.max_new_tokens is not None else
                 generation.max_length if generation.max_length is not None else len(init) + 20)
        ours = whisper_max_len(config, {**{"max_length": None}, **lengths}, len(expected))
        assert ours == min(total, config.max_len) - 1, (lengths, total, ours)


# -- The device search against the reference, on synthetic logits ---------------------------------

SEARCHES = [dict(num_beams=1), dict(num_beams=3, early_stopping="never"), dict(num_beams=2, early_stopping=True),
            dict(num_beams=2, beam_rule="flax"), dict(num_beams=3, beam_rule="openai"),
            dict(num_beams=3, beam_rule="openai", patience=2.0, length_penalty=0.6, length_penalty_form="gnmt"),
            dict(num_beams=2, beam_rule="openai", patience=0.5),
            dict(num_beams=1, do_sample=True, seed=4, num_return_sequences=2, top_k=4)]
WHISPER = [dict(prefix=(), return_timestamps=False), dict(prefix=(), return_timestamps=True),
           dict(return_timestamps=True), dict(return_timestamps=False, max_initial_timestamp_index=0),
           dict(prefix=(DE, TRANSCRIBE), return_timestamps=True, max_initial_timestamp_index=5),
           dict(prefix=(None,), return_timestamps=True, min_new_tokens=2, exponential_decay_length_penalty=(1, 1.5))]


def synthetic_settings():
    for search_options, whisper in itertools.product(SEARCHES, WHISPER):
        yield {**search_options, **whisper, "return_no_speech_prob": True, "return_scores": True,
               "banned_ids": (PAD,)}


def rows_per_source(settings) -> int:
    return settings.get("num_return_sequences", 1) if settings.get("do_sample") else settings["num_beams"]


def reference(settings, values):
    resolved = resolve(noted(), **settings)
    return search(lambda tokens, parents: logits_of(tokens, rows_per_source(settings), values), ROWS,
                  resolved.max_len, BOS, EOS, PAD, **resolved.search_options())


def device(ops, settings, values, as_array, to_numpy=np.asarray):
    """The device search on the synthetic logits, with `settings` resolved as generate does."""
    resolved = resolve(noted(), **settings)
    rules, per = device_search.rules_of(resolved), rows_per_source(settings)
    mask = np.zeros(VOCAB, dtype=bool)
    mask[list(resolved.banned_ids)] = True
    dtype = as_array("scores", np.zeros((), np.float64)).dtype
    sampling = None
    if rules.do_sample:
        sampling = {"uniforms": as_array("uniforms", uniforms(resolved.seed, resolved.max_len, ROWS * per)),
                    **{name: getattr(resolved, name) for name in ("temperature", "top_k", "top_p")}}

    def step(state, i):
        return as_array("logits", logits_of(to_numpy(device_search.prefix(ops, rules, state, i)), per, values))

    records: dict = {}
    ids, scores = device_search.run(
        ops, rules, step, ROWS, BOS, EOS, PAD, as_array("banned", mask), resolved.length_penalty, dtype,
        lambda *arrays: [to_numpy(a).item() for a in arrays], resolved.num_return_sequences, sampling, True,
        processor_data(resolved, as_array, None, VOCAB), records=records)
    return to_numpy(ids), to_numpy(scores), to_numpy(records["no_speech_prob"])


def same(got, expected, settings):
    (ids, scores, no_speech), (ref_ids, ref_scores, ref_no_speech) = got, expected
    assert ids.shape == ref_ids.shape and (ids == ref_ids).all(), (settings, ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-14, atol=0, err_msg=str(settings))
    np.testing.assert_allclose(no_speech, ref_no_speech, rtol=1e-14, atol=0, err_msg=str(settings))


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_numpy_device_search_applies_whispers_rules_as_the_reference(kind):
    values = table(kind, vocab=VOCAB)
    for settings in synthetic_settings():
        same(device(NumpyOps(), settings, values, lambda name, value: value), reference(settings, values), settings)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_torch_device_search_applies_whispers_rules_as_the_reference(kind):
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table(kind, vocab=VOCAB)
    for settings in synthetic_settings():
        got = device(Ops("cpu"), settings, values,
                     lambda name, value: value if isinstance(value, int) else torch.as_tensor(value),
                     to_numpy=lambda a: a.cpu().numpy())
        same(got, reference(settings, values), settings)


@pytest.mark.xdist_group("eager-jax-search")
def test_jax_device_search_applies_whispers_rules_as_the_reference():
    """Eager JAX, the data as arrays as the compiled search takes them (every seventh setting: eager
    JAX dispatches op by op; 7 and the 6 Whisper settings share no factor, so the seven settings
    run cover every Whisper setting, beside seven of the eight searches)."""
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    from impl_jax.decode import Ops

    values = table("ties", vocab=VOCAB)
    with impl_jax.enable_x64():
        for i, settings in enumerate(synthetic_settings()):
            if i % 7 == 0:
                got = device(Ops(None), settings, values, lambda name, value: jnp.asarray(value))
                same(got, reference(settings, values), settings)


def test_the_synthetic_settings_reach_what_they_test():
    """On these logits the timestamps change the ids, the openai rule chooses otherwise than
    Hugging Face's, and the detected language is not always the same."""
    values = table("continuous", vocab=VOCAB)
    plain = dict(prefix=(), return_timestamps=False)
    assert (reference({**plain, "num_beams": 1}, values)[0] != reference({**plain, "num_beams": 1,
                                                                          "return_timestamps": True}, values)[0]).any()
    hf = reference({**plain, "num_beams": 3}, values)[0]
    openai = reference({**plain, "num_beams": 3, "beam_rule": "openai"}, values)[0]
    assert hf.shape != openai.shape or (hf != openai).any()
    languages = {int(reference({"num_beams": 1}, table("continuous", seed, VOCAB))[0][0, 0]) for seed in range(6)}
    assert len(languages) > 1, languages


# -- The arguments ---------------------------------------------------------------------------------

BAD_OPTIONS = [
    (dict(prefix=[EOS]), "prefix"),
    (dict(prefix=[PAD]), "prefix"),
    (dict(prefix=[VOCAB]), "prefix"),
    (dict(prefix="10"), "prefix"),
    (dict(prefix=[1.5]), "prefix"),
    (dict(prefix=[EN, TRANSCRIBE, NO_TIMESTAMPS], return_timestamps=True), "prefix"),
    (dict(prefix=[EN], forced_bos_id=3), "forced_bos_id"),
    (dict(return_timestamps=1), "return_timestamps"),
    (dict(max_initial_timestamp_index=-1), "max_initial_timestamp_index"),
    (dict(max_initial_timestamp_index=1.0), "max_initial_timestamp_index"),
    (dict(return_no_speech_prob="yes"), "return_no_speech_prob"),
    (dict(patience=1.0), "patience"),
    (dict(beam_rule="openai", num_beams=2, patience=0.2), "patience"),
    (dict(beam_rule="openai", num_beams=2, patience=float("nan")), "patience"),
    (dict(beam_rule="openai", num_beams=2, early_stopping=True), "early_stopping"),
    (dict(beam_rule="openai", num_beams=2, num_return_sequences=2), "num_return_sequences"),
    (dict(beam_rule="openai", do_sample=True), "beam_rule"),
    (dict(max_len=3), "max_len"),
]
WITHOUT_NOTE = [(dict(return_timestamps=True), "return_timestamps"), (dict(return_no_speech_prob=True),
                                                                      "return_no_speech_prob"),
                (dict(prefix=[None, TRANSCRIBE]), "prefix")]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bad_arguments_get_the_same_error_everywhere(backend):
    features = np.random.default_rng(0).normal(size=(2, 4, 4))
    config = noted().replace(source="features", n_mels=4, max_source_len=2, d_model=8, n_heads=2, d_ff=16,
                             n_encoder_layers=1, n_decoder_layers=1, position="table", key_bias=False)
    bare = config.replace(notes={})
    for config, cases in ((config, BAD_OPTIONS), (bare, WITHOUT_NOTE)):
        model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
        oracle = backends.build(backends.Target("numpy", "cpu", "float32"), config, None)
        for options, argument in cases:
            call = dict(bos_id=BOS, eos_id=EOS) | options
            with pytest.raises(InputError) as info:
                model.generate(features, **call)
            assert info.value.argument == argument, (options, info.value)
            assert str(info.value) == str(pytest.raises(InputError, oracle.generate, features, **call).value)


def test_the_note_gives_whispers_settings_and_explicit_arguments_win():
    config = noted()
    settings = resolve(config)
    assert settings.prefix == (None, TRANSCRIBE, NO_TIMESTAMPS) and not settings.return_timestamps
    assert settings.language_ids == (EN, DE, FR) and settings.max_initial_timestamp_index == 2
    assert settings.max_len == 3 + 5  # the prompt, then max_new_tokens
    assert settings.begin_suppress_step == 3 and settings.suppress_tokens == (NO_SPEECH,)
    stamped = resolve(config, return_timestamps=True)
    assert stamped.prefix == (None, TRANSCRIBE) and stamped.max_len == 2 + 5
    mine = resolve(config, prefix=[DE], max_initial_timestamp_index=4, return_timestamps=True, max_len=6)
    assert (mine.prefix, mine.language_ids, mine.max_initial_timestamp_index, mine.max_len) == ((DE,), (), 4, 6)
    assert resolve(config, prefix=()).prefix == () and resolve(config, prefix=()).begin_suppress_step == 0
    assert generation_note(config)["prefixes"] == {False: (None, TRANSCRIBE, NO_TIMESTAMPS), True: (None, TRANSCRIBE)}


def test_whispers_generation_fields_are_applied_and_the_fallback_named():
    """forced_decoder_ids and return_timestamps are applied (no warning); the temperature
    fallback's thresholds change transformers' output and are named."""
    assert unapplied_generation({"forced_decoder_ids": [[1, None], [2, 50359]], "return_timestamps": True}) == {}
    assert set(unapplied_generation({"no_speech_threshold": 0.6, "logprob_threshold": -1.0,
                                     "compression_ratio_threshold": 1.35})) == {
        "no_speech_threshold", "logprob_threshold", "compression_ratio_threshold"}


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_generate_returns_ids_scores_and_the_no_speech_probability(backend):
    """ids, scores and each row's no-speech probability, in that order, the ids the same without
    the scores; the probability is the decoder's softmax at the start token (openai-whisper's
    `no_speech_probs`, read before the suppressions ban the no-speech id)."""
    features = np.random.default_rng(0).normal(size=(2, 4, 4))
    config = noted().replace(source="features", n_mels=4, max_source_len=2, d_model=8, n_heads=2, d_ff=16,
                             n_encoder_layers=1, n_decoder_layers=1, position="table", key_bias=False)
    target = backends.Target(backend, "cpu", "float64")
    with backends.dtype_scope(target):
        model = backends.build(target, config, None)
        ids, scores, no_speech = model.generate(features, num_beams=2, return_scores=True, return_no_speech_prob=True)
        assert ids.shape[0] == 2 and scores.shape == (2,) and no_speech.shape == (2,)
        ids_only, no_speech_again = model.generate(features, num_beams=2, return_no_speech_prob=True)
        with backends.forward_only(backend):
            first = np.asarray(model(features, np.full((2, 1), BOS)).logits, dtype=np.float64)[:, -1]  # (2, V)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_only))
    np.testing.assert_array_equal(np.asarray(no_speech), np.asarray(no_speech_again))
    probs = np.exp(first - first.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(no_speech), (probs / probs.sum(axis=-1, keepdims=True))[:, NO_SPEECH],
                               rtol=1e-10)  # the raw softmax at the start token, before any suppression


def test_jax_compiles_one_search_for_every_prompt_language_and_bound():
    """The prompt, the languages, the timestamps' ids and bound are data (pipeline.data_of): one
    program for each search rule and shape, whatever their values."""
    pytest.importorskip("jax")
    import impl_jax

    features = np.random.default_rng(0).normal(size=(2, 4, 4))
    config = noted().replace(source="features", n_mels=4, max_source_len=2, d_model=8, n_heads=2, d_ff=16,
                             n_encoder_layers=1, n_decoder_layers=1, position="table", key_bias=False)
    model = impl_jax.Model(config, None)
    for rule in ("hf", "openai"):
        model.generate(features, max_len=7, num_beams=2, beam_rule=rule, prefix=[None, TRANSCRIBE],
                       return_timestamps=True, max_initial_timestamp_index=1)
        impl_jax.reset_stats()
        model.generate(features, max_len=7, num_beams=2, beam_rule=rule, prefix=[DE], return_timestamps=True,
                       max_initial_timestamp_index=3)
        model.generate(features, max_len=7, num_beams=2, beam_rule=rule, prefix=[EN, TRANSCRIBE, 3],
                       return_timestamps=True)
        assert impl_jax.compile_stats()["compiles"] == 0, (rule, impl_jax.compile_stats())
