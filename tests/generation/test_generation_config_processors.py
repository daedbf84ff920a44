"""The logits processors that published seq2seq generation configs use (issue 56, item 3):
repetition_penalty, encoder_repetition_penalty, encoder_no_repeat_ngram_size,
exponential_decay_length_penalty, suppress_tokens and begin_suppress_tokens, renormalize_logits.

- The reference's processors (conformance/core/generation/processors.py) against transformers'
  own processor classes on the same rows, float64, bit for bit.
- The device search (conformance/core/generation/device.py, pipeline.py) against the reference on
  the synthetic logits of tests/generation/test_device_search.py, ties included, in NumPy, torch and JAX,
  under greedy search, both beam rules and sampling.
- Every backend's `generate` against transformers' `generate` itself on the ported Marian model
  (float64, padded sources), greedy and beam 4, each processor checked to change transformers'
  own ids; and read from the checkpoint's generation note with no argument passed.
- The arguments (the note, explicit ones winning, one InputError per bad value everywhere) and the
  warning that names what is still not applied, at every `generate`.
"""

from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest

from conformance import InputError
from conformance.check import backends
from conformance.check.tolerances import tolerance
from conformance.core.generation import device as device_search
from conformance.core.generation.device import NumpyOps, processor_data
from conformance.core.generation.note import GenerationWarning, generation_note
from conformance.core.generation.processors import decay_factor
from conformance.core.generation.search import search
from conformance.core.generation.settings import resolve
from conformance.core.presets import preset
from systems.harness import BACKEND_PARAMS
from test_device_search import BOS, EOS, PAD as SYNTHETIC_PAD, ROWS, VOCAB as SYNTHETIC_VOCAB, logits_of, table
import test_generate_processors as processors_test  # noqa: E402 (the synthetic searches, with a source)
from test_generate_processors import BASES, SEARCHES, same  # noqa: E402

# -- The reference's processors against transformers' classes -------------------------------------


def test_the_reference_processors_are_transformers_own():
    """Each processor of `processors.PIPELINE` against its transformers class on random rows (the
    start token first, sources with padding), float64: the same numbers, -inf and NaN included."""
    torch = pytest.importorskip("torch")
    from transformers.generation import logits_process as hf

    from conformance.core.generation.processors import Processors, processed

    rng = np.random.default_rng(3)
    for t in range(1, 7):
        tokens = rng.integers(0, 6, size=(4, t))
        sources = rng.integers(0, 6, size=(2, 5))
        sources[1, 3:] = 0  # padding, which transformers reads as ids
        per_row = np.repeat(sources, 2, axis=0)  # two decoder rows (beams) per source
        cases = [
            (hf.RepetitionPenaltyLogitsProcessor(1.7), dict(repetition_penalty=1.7)),
            (hf.RepetitionPenaltyLogitsProcessor(0.6), dict(repetition_penalty=0.6)),
            (hf.EncoderRepetitionPenaltyLogitsProcessor(1.3, torch.from_numpy(sources)),
             dict(encoder_repetition_penalty=1.3, encoder_ids=per_row)),
            (hf.ExponentialDecayLengthPenalty((1, 1.6), 4, input_ids_seq_length=1),
             dict(exponential_decay_length_penalty=(1, 1.6))),
            (hf.SuppressTokensLogitsProcessor([1, 4]), dict(suppress_tokens=(1, 4))),
            (hf.SuppressTokensAtBeginLogitsProcessor([0, 4], begin_index=1), dict(begin_suppress_tokens=(0, 4))),
            (hf.SuppressTokensAtBeginLogitsProcessor([0, 4], begin_index=2),
             dict(begin_suppress_tokens=(0, 4), begin_suppress_step=1)),
            (hf.LogitNormalization(), dict(renormalize_logits=True)),
        ] + [(hf.EncoderNoRepeatNGramLogitsProcessor(n, torch.from_numpy(sources)),
              dict(encoder_no_repeat_ngram_size=n, encoder_ids=per_row)) for n in (1, 2, 3)]
        for processor, options in cases:
            scores = rng.normal(size=(4, 6))
            scores[0, 4] = -np.inf  # a banned end token stays banned under the decay
            expected = processor(torch.from_numpy(tokens), torch.from_numpy(scores.copy())).numpy()
            got = processed(scores.copy(), tokens, t - 1, Processors(max_len=20, eos_id=4, **options))
            if isinstance(processor, hf.LogitNormalization):  # torch's fused log-softmax rounds its own way
                np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-14, err_msg=str(t))
            else:
                assert np.array_equal(got, expected, equal_nan=True), (type(processor).__name__, options, t)


# -- The device search against the reference -------------------------------------------------------

SOURCE = np.array([[6, 4, 1, 3, 4], [6, 5, 6, 0, 0], [4, 4, 6, 3, 0]])  # (ROWS, S), padded with 0; row 0 holds a 3-gram the search makes
PROCESSORS = [
    dict(repetition_penalty=1.8), dict(repetition_penalty=0.5),
    dict(encoder_repetition_penalty=1.6), dict(encoder_repetition_penalty=0.4),
    *(dict(encoder_no_repeat_ngram_size=n) for n in (1, 2, 3)),
    dict(exponential_decay_length_penalty=(1, 1.9)),
    # multipliers beyond float32 from step 2 (1e30 ** 2) and beyond float64 from step 2 (1e200 ** 2): inf there
    dict(exponential_decay_length_penalty=(0, 1e30)), dict(exponential_decay_length_penalty=(0, 1e200)),
    dict(exponential_decay_length_penalty=(0, 1e200), renormalize_logits=True),  # a certain end, renormalized
    dict(suppress_tokens=(3, 6)),
    dict(begin_suppress_tokens=(3, EOS, 5)),
    dict(begin_suppress_tokens=(3, 4), forced_bos_id=4),  # the forced id banned a step later: step 1
    dict(renormalize_logits=True),
    dict(renormalize_logits=True, suppress_tokens=(5,), no_repeat_ngram_size=2),
    # all of them, with the earlier processors
    dict(repetition_penalty=1.4, encoder_repetition_penalty=1.2, encoder_no_repeat_ngram_size=2,
         exponential_decay_length_penalty=(2, 1.3), suppress_tokens=(6,), begin_suppress_tokens=(EOS,),
         renormalize_logits=True, no_repeat_ngram_size=3, min_length=3, bad_words_ids=((BOS, 3),)),
]


def synthetic_settings():
    for (max_len, base), search_options, processors in itertools.product(BASES, SEARCHES, PROCESSORS):
        yield max_len, {**base, **search_options, **processors}


def reference(settings, values, max_len: int):
    return processors_test.reference(settings, values, max_len, SOURCE)


def device(ops, settings, values, max_len: int, as_array, to_numpy=np.asarray):
    return processors_test.device(ops, settings, values, max_len, as_array, to_numpy, SOURCE)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_numpy_device_search_applies_them_as_the_reference(kind):
    values = table(kind)
    for max_len, settings in synthetic_settings():
        same(device(NumpyOps(), settings, values, max_len, lambda name, value: value), reference(settings, values,
                                                                                                 max_len), settings)


@pytest.mark.parametrize("kind", ["ties", "continuous"])
def test_torch_device_search_applies_them_as_the_reference(kind):
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table(kind)
    for max_len, settings in synthetic_settings():
        got = device(Ops("cpu"), settings, values, max_len,
                     lambda name, value: value if isinstance(value, int) else torch.as_tensor(value),
                     to_numpy=lambda a: a.cpu().numpy())
        same(got, reference(settings, values, max_len), settings)


@pytest.mark.xdist_group("eager-jax-search")
def test_jax_device_search_applies_them_as_the_reference():
    """Eager JAX, the data as arrays as the compiled search takes them. Every fifth setting (eager
    JAX dispatches op by op: 62 s for every third here): 5 and the 17 processors share no factor,
    so every processor is run, under varied searches; NumPy and torch run them all."""
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax
    from impl_jax.decode import Ops

    values = table("ties")
    with impl_jax.enable_x64():
        for max_len, settings in list(synthetic_settings())[::5]:
            got = device(Ops(None), settings, values, max_len, lambda name, value: jnp.asarray(value))
            same(got, reference(settings, values, max_len), settings)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def float32_settings():
    """`synthetic_settings` that a float32 search can follow: all but beam searches where the end
    token may win and a decay's multiplier is finite in float64 but past float32 (there the
    float64 search ranks hypotheses scored near 1e60, which float32 turns into a certain end: a
    different search, not a rounding of the same one)."""
    for max_len, settings in synthetic_settings():
        decay = settings.get("exponential_decay_length_penalty")
        past_float32 = decay is not None and decay_factor(decay, max_len - 1) > FLOAT32_MAX
        beams = settings["num_beams"] > 1 or settings.get("beam_rule") == "flax"
        if not (past_float32 and beams and EOS not in settings.get("banned_ids", ())):
            yield max_len, settings


def same_in_float32(got, expected, settings):
    """The ids of the float64 reference; the scores within float32's tolerance (the table's
    atol x max(1, |score|)) where the reference's fit float32 at all."""
    (ids, scores), (ref_ids, ref_scores) = got, expected
    assert ids.shape == ref_ids.shape and (ids == ref_ids).all(), (settings, ids, ref_ids)
    assert not np.isnan(scores).any(), (settings, scores)
    if np.all(np.abs(ref_scores) < FLOAT32_MAX):
        atol = tolerance("float32").atol * np.maximum(1.0, np.abs(ref_scores))
        assert np.all(np.abs(scores - ref_scores) <= atol), (settings, scores, ref_scores)


def as_float32(name, value):
    """The NumPy search's data in float32 (ints and masks as they are), as impl_numpy passes it."""
    return value.astype(np.float32) if isinstance(value, np.ndarray) and value.dtype.kind == "f" else value


def test_numpy_device_search_applies_them_in_float32():
    """The float32 search on continuous logits (no near-ties) gives the reference's ids: a
    decay whose multiplier overflows float32 is inf there, and the end token certain, not a NaN
    on every other id."""
    values = table("continuous")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no overflow nor NaN on the way
        for max_len, settings in float32_settings():
            same_in_float32(device(NumpyOps(), settings, values, max_len, as_float32),
                            reference(settings, values, max_len), settings)


def test_torch_device_search_applies_them_in_float32():
    torch = pytest.importorskip("torch")
    from impl_torch.decode import Ops

    values = table("continuous")
    for max_len, settings in float32_settings():
        got = device(Ops("cpu"), settings, values, max_len,
                     lambda name, value: value if isinstance(value, int) else torch.as_tensor(as_float32(name, value)),
                     to_numpy=lambda a: a.cpu().numpy())
        same_in_float32(got, reference(settings, values, max_len), settings)


@pytest.mark.xdist_group("eager-jax-search")
def test_jax_device_search_applies_the_overflowing_decays_in_float32():
    """Eager JAX in float32, the decay whose multiplier overflows float32 only (eager JAX
    dispatches op by op: about 15 s here, 36 s for all three overflowing ones; NumPy and torch run every
    setting, and every backend's compiled search meets it in
    `test_a_decay_past_float32_gives_the_float32_ids_of_transformers`)."""
    jnp = pytest.importorskip("jax.numpy")
    from impl_jax.decode import Ops

    values = table("continuous")
    for max_len, settings in float32_settings():
        if settings == {**settings, "exponential_decay_length_penalty": (0, 1e30)}:
            got = device(Ops(None), settings, values, max_len, lambda name, value: jnp.asarray(as_float32(name, value)))
            same_in_float32(got, reference(settings, values, max_len), settings)


def test_the_synthetic_settings_reach_what_they_test():
    """Each processor changes the reference's ids on these logits under some search."""
    values = table("continuous")
    for processors in PROCESSORS:
        changed = []
        for (max_len, base), search_options in itertools.product(BASES, SEARCHES):
            plain = reference({**base, **search_options}, values, max_len)[0]
            ids = reference({**base, **search_options, **processors}, values, max_len)[0]
            changed.append(ids.shape != plain.shape or (ids != plain).any())
        assert any(changed), processors


# -- Against transformers' generate ----------------------------------------------------------------

torch_module = pytest.importorskip("torch", reason="Marian is a PyTorch model")
pytest.importorskip("transformers", reason="the reference is transformers' generate")

import functools  # noqa: E402

from conformance.check.compare import to_numpy  # noqa: E402
from test_generate_hf import MAX_LENGTH, ported, reference_model, source  # noqa: E402
from test_generate_processors import hf_generate, same_ids  # noqa: E402


def ngram_source() -> np.ndarray:
    """The padded batch with the model's favourite runs in two sources (12 12 12; 26 23), so that
    their n-grams bite."""
    src = source().copy()
    src[0, 2:5] = [12, 12, 12]
    src[2, :2] = [26, 23]
    return src


# The random Marian model (tests/generation/test_generate_hf.py) repeats 12, 26 and 23; each processor below
# changes transformers' own ids over its base (checked: `test_each_setting_changes_transformers_ids`).
# (label, the source, transformers' base arguments, the processor's, as transformers names them)
SETTINGS = [
    ("repetition_penalty=1.8", source, {}, dict(repetition_penalty=1.8)),
    ("repetition_penalty=0.6", source, {}, dict(repetition_penalty=0.6)),
    ("encoder_repetition_penalty=1.8", source, {}, dict(encoder_repetition_penalty=1.8)),
    ("encoder_repetition_penalty=0.5", source, {}, dict(encoder_repetition_penalty=0.5)),
    ("encoder_no_repeat_ngram_size=1", source, {}, dict(encoder_no_repeat_ngram_size=1)),
    ("encoder_no_repeat_ngram_size=2", ngram_source, dict(min_new_tokens=4), dict(encoder_no_repeat_ngram_size=2)),
    ("exponential_decay_length_penalty=(2, 1.6)", source, {}, dict(exponential_decay_length_penalty=(2, 1.6))),
    ("suppress_tokens", source, {}, dict(suppress_tokens=[12, 26])),
    ("begin_suppress_tokens", source, {}, dict(begin_suppress_tokens=[12, 26])),
    # A forced first token moves the suppression to the second step (transformers' begin_index).
    ("begin_suppress_tokens after a forced first token", source, dict(forced_bos_token_id=26),
     dict(begin_suppress_tokens=[26, 23])),
    # The log-softmax after a ban: beam scores change (greedy's arg-max cannot).
    ("renormalize_logits", source, dict(no_repeat_ngram_size=2), dict(renormalize_logits=True)),
    ("all of them", source, dict(no_repeat_ngram_size=3, forced_bos_token_id=12),
     dict(repetition_penalty=1.4, encoder_repetition_penalty=1.3, encoder_no_repeat_ngram_size=3,
          exponential_decay_length_penalty=(3, 1.4), suppress_tokens=[17], begin_suppress_tokens=[26],
          renormalize_logits=True)),
]
OURS = {"forced_bos_token_id": "forced_bos_id"}  # our names where they differ


@functools.cache
def transformers_ids(label: str, num_beams: int, with_processor: bool = True) -> np.ndarray:
    _, src, base, processor = next(setting for setting in SETTINGS if setting[0] == label)
    return hf_generate(reference_model(), src(), max_length=MAX_LENGTH, num_beams=num_beams, **base,
                       **(processor if with_processor else {}))


def our_generate(backend: str, src, config, params, **options) -> np.ndarray:
    generation = reference_model().generation_config
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        return to_numpy(model.generate(src, MAX_LENGTH - 1, generation.decoder_start_token_id,
                                       generation.eos_token_id, forced_eos=True, **options)).astype(np.int64)


def test_each_setting_changes_transformers_ids():
    """So that each comparison below can fail: the processor changes transformers' ids over its
    base, greedy or beam 4 (renormalize_logits only beam search's: an arg-max is unchanged by it)."""
    for label, *_ in SETTINGS:
        changed = [not np.array_equal(transformers_ids(label, beams), transformers_ids(label, beams, False))
                   for beams in (1, 4)]
        assert any(changed), f"{label} changes nothing here"
        assert all(changed) or label == "renormalize_logits", (label, changed)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_processors_give_the_ids_of_transformers(backend, num_beams):
    config, params = ported()
    for label, src, base, processor in SETTINGS:
        options = {OURS.get(name, name): value for name, value in {**base, **processor}.items()}
        ids = our_generate(backend, src(), config, params, num_beams=num_beams, **options)
        same_ids(ids, transformers_ids(label, num_beams), f"{backend}, num_beams={num_beams}, {label}")


# A decay whose multiplier overflows float32 (1e5 ** 8 = 1e40): with the end token suppressed, the
# search runs on past it (transformers adds +inf to the end token alone); with the end token
# banned below 9 tokens, the end token wins at step 9, where its score is +inf (transformers) or
# the end is certain (here).
FLOAT32_DECAYS = [dict(exponential_decay_length_penalty=(0, 1e5), suppress_tokens=[0]),
                  dict(exponential_decay_length_penalty=(0, 1e5), min_new_tokens=9)]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_decay_past_float32_gives_the_float32_ids_of_transformers(backend):
    import copy

    model = copy.deepcopy(reference_model()).float()
    model.generation_config.forced_eos_token_id = None
    generation = model.generation_config
    assert generation.eos_token_id == 0  # suppress_tokens=[0] above suppresses the end token
    config, params = ported()
    params = {name: np.asarray(value, np.float32) for name, value in params.items()}
    target = backends.Target(backend, "cpu", "float32")
    ours = backends.build(target, config, params)
    for options in FLOAT32_DECAYS:
        expected = hf_generate(model, source(), max_length=14, num_beams=1, **options)
        plain = hf_generate(model, source(), max_length=14, num_beams=1,
                            **{**options, "exponential_decay_length_penalty": None})
        assert not np.array_equal(expected, plain) or "suppress_tokens" in options, options  # the decay bites
        ids = to_numpy(ours.generate(source(), 13, generation.decoder_start_token_id, generation.eos_token_id,
                                     forced_eos=False, **options)).astype(np.int64)
        same_ids(ids, expected, f"{backend} float32, {options}")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_decay_past_float64_gives_the_ids_of_transformers_not_an_overflow_error(backend):
    """1e10 ** 31 is past float64: transformers computes the multiplier only at the steps it
    reaches (the end token wins at once); the search's table of every step holds inf there."""
    options = dict(exponential_decay_length_penalty=(0, 1e10))
    expected = hf_generate(reference_model(), source(), max_length=40, num_beams=1, **options)
    config, params = ported()
    generation = reference_model().generation_config
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ids = to_numpy(backends.build(target, config, params).generate(
            source(), 39, generation.decoder_start_token_id, generation.eos_token_id, **options)).astype(np.int64)
    same_ids(ids, expected, f"{backend}, {options}")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_the_processors_from_the_generation_note_give_the_ids_of_transformers(backend):
    """A model whose generation_config sets them all: transformers applies it when generate gets
    no argument, and so does ours from the checkpoint's note as `from_hf` writes it."""
    import copy

    from conformance.convert import from_hf

    model = copy.deepcopy(reference_model())
    _, _, base, processor = SETTINGS[-1]
    model.generation_config.update(num_beams=4, max_length=MAX_LENGTH, **base, **processor)
    expected = hf_generate(model, source())
    config, params = from_hf(model)
    note = generation_note(config)
    assert {name: note[name] for name in processor} == {
        name: list(value) if isinstance(value, tuple) else value for name, value in processor.items()}
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ids = to_numpy(backends.build(target, config, params).generate(source())).astype(np.int64)
    same_ids(ids, expected, f"{backend}, from the note")


def test_greedy_traces_the_gap_of_the_logits_its_arg_max_reads():
    """The suite excuses a float32 parting at a near-tie of what the search chose on: greedy's
    arg-max reads the processed logits, which a penalty or the decay ranks otherwise than the
    processed log-probabilities (here a gap of 1e-9 between the logits, of ~0.7 between the
    log-probabilities)."""
    row = np.array([2.0, 1.0 + 1e-9, -5.0, -5.0, -5.0])  # (V,): the same logits at every step
    cases = [  # (options, bos, eos, the step whose gap is 1e-9 between the processed logits)
        (dict(repetition_penalty=2.0), 0, 4, 0),  # id 0 (the start token) 2.0 / 2 = 1.0
        (dict(encoder_repetition_penalty=0.5, src_ids=np.array([[0, 3]])), 4, 3, 0),  # 2.0 x 0.5 = 1.0
        (dict(exponential_decay_length_penalty=(0, 2.0)), 4, 2, 1),  # the end token at step 1: 2 x (1 + 5e-10)
    ]
    for options, bos, eos, step in cases:
        logits = row.copy()
        if "exponential_decay_length_penalty" in options:
            logits[eos] = 1.0 + 5e-10
        trace = []
        search(lambda tokens, parents: np.tile(logits, (len(tokens), 1)), 1, 3, bos, eos, 3, trace=trace, **options)
        np.testing.assert_allclose(trace[step]["gap"], [1e-9], rtol=1e-6, err_msg=str(options))


def test_a_renormalized_row_with_every_id_banned_stays_banned():
    """transformers' LogitNormalization makes such a row NaN; here it stays -inf, as any row whose
    every id is banned (docs/decoding.md), in the reference and in every adapter."""
    from conformance.core.generation.device import renormalized
    from conformance.core.generation.processors import Processors, processed

    scores = np.array([[-np.inf, -np.inf, -np.inf], [0.5, -np.inf, 1.0]])
    expected = np.array([[-np.inf] * 3, [0.5 - np.logaddexp(0.5, 1.0), -np.inf, 1.0 - np.logaddexp(0.5, 1.0)]])
    got = processed(scores.copy(), np.zeros((2, 1), dtype=np.int64), 0,
                    Processors(max_len=4, eos_id=2, renormalize_logits=True))
    np.testing.assert_allclose(got, expected, rtol=1e-15)
    np.testing.assert_allclose(renormalized(NumpyOps(), scores.copy()), expected, rtol=1e-15)


# -- A converted folder, end to end: convert, then rosetta generate ---------------------------------


def bart_with(tmp_path, **generation):
    """A tiny BART folder whose generation_config.json sets `generation` (tests/convert/test_hf_families.py)."""
    from test_hf_families import build

    model = build("bart")
    model.generation_config.update(max_length=12, num_beams=1, **generation)
    model.save_pretrained(tmp_path / "bart")
    return model, tmp_path / "bart"


def test_a_folder_setting_them_converts_without_a_warning_and_generates_transformers_ids(tmp_path, capsys):
    """The issue's walk: repetition_penalty and exponential_decay_length_penalty in
    generation_config.json gave a "generation warning:" at convert time, and `rosetta generate`
    then said nothing and gave other ids than transformers'. Now both are applied from the note."""
    from conformance.cli import main
    from test_hf_families import batch
    from test_hf_generate_families import differ, hf_summary_ids

    model, folder = bart_with(tmp_path, repetition_penalty=1.5, exponential_decay_length_penalty=(3, 1.8))
    assert main(["convert", str(folder), str(tmp_path / "bart.safetensors")]) == 0
    out, err = capsys.readouterr()
    assert "generation warning" not in out + err and "warning" not in err, (out, err)
    from conformance.core import checkpoint

    config, _ = checkpoint.load(tmp_path / "bart.safetensors")
    src, _, _ = batch("bart")
    expected = hf_summary_ids(model, config, src)
    plain = hf_summary_ids(model, config, src, repetition_penalty=1.0, exponential_decay_length_penalty=None)
    assert differ(expected, plain), "the two settings change nothing here"
    ids = ";".join(",".join(str(int(i)) for i in row) for row in src)
    assert main(["generate", str(tmp_path / "bart.safetensors"), "--src", ids, "--backend", "numpy"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err, err
    eos = json.loads(config.notes["generation"])["eos_token_id"]
    rows = [" ".join(str(int(t)) for t in (row[: list(row).index(eos)] if eos in row else row)) for row in expected]
    assert out.splitlines() == rows, (out, rows)


def test_what_is_still_not_applied_is_warned_on_stderr_at_convert_and_at_every_generate(tmp_path, capsys):
    from conformance.cli import main
    from conformance.core import checkpoint

    _, folder = bart_with(tmp_path, guidance_scale=2.0)
    assert main(["convert", str(folder), str(tmp_path / "bart.safetensors")]) == 0
    out, err = capsys.readouterr()
    assert "guidance_scale" not in out, out  # on stderr, not among the decisions on stdout
    assert "rosetta convert: warning:" in err and "guidance_scale=2.0" in err, err
    config, params = checkpoint.load(tmp_path / "bart.safetensors")
    model = backends.build(backends.Target("numpy", "cpu", "float32"), config, params)
    src = np.array([[5, 6, 7, 2], [8, 2, 1, 1]])
    for _ in range(2):  # every call, not once per process
        with pytest.warns(GenerationWarning, match="guidance_scale=2.0") as caught:
            model.generate(src)
        assert len([w for w in caught if issubclass(w.category, GenerationWarning)]) == 1
    assert main(["generate", str(tmp_path / "bart.safetensors"), "--src", "5,6,7,2;8,2"]) == 0
    err = capsys.readouterr().err
    assert "rosetta generate: warning: the checkpoint's generation settings set guidance_scale=2.0" in err, err
    with warnings.catch_warnings():  # a checkpoint that records nothing unapplied: no warning
        warnings.simplefilter("error", GenerationWarning)
        backends.build(backends.Target("numpy", "cpu", "float32"), config.replace(notes={}), params).generate(
            src, 4, 2, 2)


# -- Arguments: the note, explicit ones winning, one error everywhere --------------------------------

SIZES = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1,
             n_decoder_layers=2, max_len=12)


def noted(config, **recorded):
    return config.replace(notes={**config.notes, "generation": json.dumps(recorded)})


def test_the_note_carries_them_and_explicit_arguments_win():
    config = noted(preset("paper", **SIZES), decoder_start_token_id=1, eos_token_id=2, repetition_penalty=1.3,
                   encoder_repetition_penalty=0.8, encoder_no_repeat_ngram_size=2,
                   exponential_decay_length_penalty=[3, 1.2], suppress_tokens=[4, 5], begin_suppress_tokens=[6],
                   renormalize_logits=True)
    note = generation_note(config)
    assert note["exponential_decay_length_penalty"] == [3, 1.2] and note["suppress_tokens"] == [4, 5]
    settings = resolve(config)
    assert (settings.repetition_penalty, settings.encoder_repetition_penalty, settings.encoder_no_repeat_ngram_size,
            settings.exponential_decay_length_penalty, settings.suppress_tokens, settings.begin_suppress_tokens,
            settings.renormalize_logits) == (1.3, 0.8, 2, (3, 1.2), (4, 5), (6,), True)
    assert settings.begin_suppress_step == 0 and resolve(config, forced_bos_id=7).begin_suppress_step == 1
    off = resolve(config, repetition_penalty=1.0, encoder_repetition_penalty=1, encoder_no_repeat_ngram_size=0,
                  exponential_decay_length_penalty=False, suppress_tokens=[], begin_suppress_tokens=(),
                  renormalize_logits=False)
    assert off == resolve(preset("paper", **SIZES), 11, 1, 2)  # the plain defaults: every one off
    assert resolve(config, suppress_tokens=[9]).suppress_tokens == (9,)


BAD_OPTIONS = [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.5), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty="1.2"), "repetition_penalty"),
    (dict(encoder_repetition_penalty=0), "encoder_repetition_penalty"),
    (dict(encoder_no_repeat_ngram_size=-1), "encoder_no_repeat_ngram_size"),
    (dict(encoder_no_repeat_ngram_size=2.0), "encoder_no_repeat_ngram_size"),
    (dict(exponential_decay_length_penalty=1.5), "exponential_decay_length_penalty"),
    (dict(exponential_decay_length_penalty=(1, 2, 3)), "exponential_decay_length_penalty"),
    (dict(exponential_decay_length_penalty=(-1, 1.5)), "exponential_decay_length_penalty"),
    (dict(exponential_decay_length_penalty=(1, 0.0)), "exponential_decay_length_penalty"),
    (dict(exponential_decay_length_penalty=(1.0, 1.5)), "exponential_decay_length_penalty"),
    (dict(suppress_tokens=[13]), "suppress_tokens"),
    (dict(suppress_tokens=5), "suppress_tokens"),
    (dict(begin_suppress_tokens=[-1]), "begin_suppress_tokens"),
    (dict(begin_suppress_tokens=[[1, 2]]), "begin_suppress_tokens"),
    (dict(renormalize_logits=1), "renormalize_logits"),
    # a forced token suppressed: every id of its step -inf (transformers' GenerationConfig.validate refuses it)
    (dict(forced_bos_id=4, suppress_tokens=[5, 4]), "suppress_tokens"),
    (dict(forced_eos=True, suppress_tokens=[2]), "suppress_tokens"),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bad_arguments_get_the_same_error_everywhere(backend):
    config = preset("paper", **SIZES)
    src = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
    oracle = backends.build(backends.Target("numpy", "cpu", "float32"), config, None)
    for options, argument in BAD_OPTIONS:
        call = dict(max_len=5, bos_id=1, eos_id=2) | options
        with pytest.raises(InputError) as info:
            model.generate(src, **call)
        assert info.value.argument == argument, (options, info.value)
        assert str(info.value) == str(pytest.raises(InputError, oracle.generate, src, **call).value)


def test_suppressing_a_forced_token_is_refused_as_transformers_refuses_it():
    """transformers' GenerationConfig.validate raises a ValueError when suppress_tokens holds the
    forced first (or end) token; `generate` raises the InputError on suppress_tokens, and runs
    where transformers runs (the end token suppressed without forced_eos, another id forced)."""
    generation = reference_model().generation_config
    for hf_options, ours in [(dict(forced_bos_token_id=26), dict(forced_bos_id=26)),
                             (dict(forced_eos_token_id=generation.eos_token_id), dict(forced_eos=True))]:
        suppressed = [17, hf_options.get("forced_bos_token_id", generation.eos_token_id)]
        with pytest.raises(ValueError, match="is also in `suppress_tokens`"):
            hf_generate(reference_model(), source(), max_length=MAX_LENGTH, suppress_tokens=suppressed, **hf_options)
        config, params = ported()
        model = backends.build(backends.Target("numpy", "cpu", "float64"), config, params)
        with pytest.raises(InputError, match="forcing a token while suppressing it") as info:
            model.generate(source(), MAX_LENGTH - 1, suppress_tokens=suppressed, **ours)
        assert info.value.argument == "suppress_tokens"
    model.generate(source(), MAX_LENGTH - 1, suppress_tokens=[generation.eos_token_id], forced_eos=False)
    model.generate(source(), MAX_LENGTH - 1, suppress_tokens=[26], forced_bos_id=12, forced_eos=False)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_bad_value_from_the_generation_note_says_it_came_from_the_note(backend):
    """The same InputError on the same argument as when passed, and the message says where the
    value came from (the call passed nothing that is wrong)."""
    note = dict(decoder_start_token_id=1, eos_token_id=2, max_length=6)
    src = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
    for recorded, argument in [(dict(suppress_tokens=[40]), "suppress_tokens"),
                               (dict(begin_suppress_tokens=[13]), "begin_suppress_tokens"),
                               (dict(suppress_tokens=[2], forced_eos_token_id=2), "suppress_tokens"),
                               (dict(exponential_decay_length_penalty=[1, -2.0]), "exponential_decay_length_penalty"),
                               (dict(early_stopping="sometimes", num_beams=2), "early_stopping"),
                               (dict(min_new_tokens=-1), "min_new_tokens")]:
        config = noted(preset("paper", **SIZES), **note, **recorded)
        model = backends.build(backends.Target(backend, "cpu", "float32"), config, None)
        with pytest.raises(InputError) as info:
            model.generate(src)
        assert info.value.argument == argument, (recorded, info.value)
        assert "came from the checkpoint's \"generation\" note" in str(info.value), str(info.value)
        oracle = backends.build(backends.Target("numpy", "cpu", "float32"), config, None)
        assert str(info.value) == str(pytest.raises(InputError, oracle.generate, src).value)
        explicit = {argument: recorded[argument]} if argument in recorded else {}
        if explicit and argument != "early_stopping":  # the same value passed: the plain message
            with pytest.raises(InputError) as passed:
                model.generate(src, **explicit)
            assert "generation\" note" not in str(passed.value), str(passed.value)


def test_jax_compiles_one_search_for_every_penalty_and_token_list_of_one_shape():
    pytest.importorskip("jax")
    import impl_jax

    config = preset("paper", **SIZES)
    src = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
    model = backends.build(backends.Target("jax", "cpu", "float32"), config, None)
    shape = dict(encoder_no_repeat_ngram_size=2, renormalize_logits=True)
    model.generate(src, 6, 1, 2, num_beams=2, repetition_penalty=1.2, encoder_repetition_penalty=1.3,
                   exponential_decay_length_penalty=(1, 1.5), suppress_tokens=[3], begin_suppress_tokens=[4], **shape)
    impl_jax.reset_stats()
    model.generate(src, 6, 1, 2, num_beams=2, repetition_penalty=0.7, encoder_repetition_penalty=0.9,
                   exponential_decay_length_penalty=(3, 2.0), suppress_tokens=[5, 6], begin_suppress_tokens=[8, 9],
                   **shape)
    assert impl_jax.compile_stats()["compiles"] == 0, impl_jax.compile_stats()


# -- The suite --------------------------------------------------------------------------------------


def test_the_covering_rows_run_every_processor_under_every_search():
    """The generate property's covering rows (run under `ci`) hold each processor of shipped
    generation configs, under Hugging Face's greedy and beam search and under Flax's rule."""
    from conformance.suite.covering import covering_generation_cases
    from conformance.suite.strategies.generation import shipped_processors  # noqa: F401 (what draws them)

    names = ("repetition_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
             "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "renormalize_logits")
    seen = set()
    for gcase in covering_generation_cases():
        options = dict(gcase.options)
        kind = "flax" if options.get("beam_rule") == "flax" else "greedy" if options["num_beams"] == 1 else "beam"
        seen |= {(name, kind) for name in names if name in options}
        resolve(gcase.case.config, gcase.max_len, gcase.bos_id, gcase.eos_id, **gcase.arguments())  # valid
    assert seen >= {(name, "flax") for name in names}, sorted(seen)
    assert {name for name, kind in seen if kind != "flax"} == set(names), sorted(seen)


def test_the_drawn_processors_are_valid_arguments():
    """The suite's processor draws never suppress the forced first token (refused, as transformers
    refuses it), nor anything else `resolve` refuses: on a small vocabulary, where they overlap
    often."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from conformance.suite.strategies.generation import processor_options

    config = preset("paper", **{**SIZES, "tgt_vocab_size": 5, "src_vocab_size": 5})

    @settings(max_examples=150, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.booleans().flatmap(lambda sampling: processor_options(5, config.pad_id, 1, 2, sampling=sampling)))
    def valid(options):
        resolve(config, 6, 1, 2, **dict(options))

    valid()


def test_source_ids_outside_the_target_vocabulary_are_left_alone():
    """Separate vocabularies: a source id the target vocabulary lacks is neither penalized nor
    banned (no target id has it), in the reference and on the device alike."""
    wide = np.array([[6, 9, 4, 1, 9], [8, 8, 0, 0, 0], [4, 12, 6, 3, 0]])  # ids 8, 9 and 12 >= VOCAB 7
    values = table("continuous")
    for settings in (dict(num_beams=1, encoder_repetition_penalty=0.5, encoder_no_repeat_ngram_size=1),
                     dict(num_beams=2, encoder_repetition_penalty=1.7, encoder_no_repeat_ngram_size=2)):
        per = settings["num_beams"]
        expected = search(lambda tokens, parents: logits_of(tokens, per, values), ROWS, 6, BOS, EOS, SYNTHETIC_PAD,
                          src_ids=wide, **settings)
        config = preset("paper", src_vocab_size=SYNTHETIC_VOCAB, tgt_vocab_size=SYNTHETIC_VOCAB, max_len=6,
                        pad_id=SYNTHETIC_PAD)  # resolve reads the target vocabulary only
        resolved = resolve(config, 6, BOS, EOS, **settings)
        rules, ops = device_search.rules_of(resolved), NumpyOps()
        mask = np.zeros(SYNTHETIC_VOCAB, dtype=bool)
        got = device_search.run(ops, rules, lambda state, i: logits_of(device_search.prefix(ops, rules, state, i), per,
                                                                      values),
                                ROWS, BOS, EOS, SYNTHETIC_PAD, mask, 1.0, np.float64, lambda *a: [x.item() for x in a],
                                1, None, True, processor_data(resolved, lambda name, value: value, wide,
                                                              SYNTHETIC_VOCAB))
        same(got, expected, settings)
