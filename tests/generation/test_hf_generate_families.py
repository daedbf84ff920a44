"""`generate` from a converted folder, with no special id passed, gives transformers' ids (issue 42).

BART, mBART, M2M100, Pegasus and Marian first; T5, T5 v1.1 and mT5 at the end.

For each family with an `[hf]` layout, the tiny random model of tests/convert/test_hf_families.py gets the
generation settings its released checkpoints carry in generation_config.json (BART's summarisation
configs: no repeated 3-gram, a forced first and last token; mBART-50 and NLLB: the target language
forced after the start token; Marian and Pegasus: a forced end token), is saved with
`save_pretrained`, and converted with no --set. Then, in float64 (so that no near-tie of scores
decides an id), `model.generate(src)` in every backend, with nothing but the number of beams
passed, must give the ids of transformers' `generate(input_ids, attention_mask)`: the start token,
the end token, the forced tokens, the n-gram rule and the maximum length all come from the
checkpoint's "generation" note. The source batch is right-padded.
"""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the families are PyTorch models")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' generate")

from conformance.check import backends  # noqa: E402
from conformance.check.compare import to_numpy  # noqa: E402
from conformance.convert import from_hf_folder  # noqa: E402
from systems.harness import BACKEND_PARAMS  # noqa: E402
from test_hf_families import FAMILIES, batch, build, in_float64  # noqa: E402

# What each family's generation_config.json says in its released checkpoints (the ids are the
# tiny models' own: 5 stands in for a language code). A random model repeats one token: mBART and
# M2M100 also get the n-gram rule (size 2), so that their rows differ and the rule meets a forced token.
GENERATION = {
    "bart": dict(no_repeat_ngram_size=3, forced_bos_token_id=0, forced_eos_token_id=2, max_length=14),
    "mbart": dict(decoder_start_token_id=2, forced_bos_token_id=5, forced_eos_token_id=2, no_repeat_ngram_size=2,
                  max_length=12),
    "m2m_100": dict(forced_bos_token_id=5, no_repeat_ngram_size=2, max_length=12),
    "pegasus": dict(forced_eos_token_id=1, max_length=12),
    "plbart": dict(decoder_start_token_id=2, forced_bos_token_id=5, forced_eos_token_id=2, no_repeat_ngram_size=2,
                   max_length=12),
    "blenderbot": dict(forced_eos_token_id=2, no_repeat_ngram_size=3, max_length=12),
    "blenderbot_small": dict(forced_eos_token_id=2, no_repeat_ngram_size=2, max_length=12),
    "marian": dict(forced_eos_token_id=0, max_length=12),
}
EOS_BOOST = 2.0  # added to the end token's logit bias, where the family has one: rows end at varied steps


@functools.cache
def converted(name: str, tmp_dir: str):
    """The family's model with its generation settings, and its folder converted with no --set."""
    model = build(name)
    for key, value in GENERATION[name].items():
        setattr(model.generation_config, key, value)
    model.generation_config.num_beams = 1
    if hasattr(model, "final_logits_bias"):
        with torch.no_grad():
            model.final_logits_bias[0, model.generation_config.eos_token_id] += EOS_BOOST
    folder = f"{tmp_dir}/{name}"
    model.save_pretrained(folder)
    config, params = from_hf_folder(folder)
    return model, config, params


def hf_ids(name: str, model, config, src: np.ndarray, num_beams: int) -> np.ndarray:
    model = in_float64(name, model, config)
    pad = FAMILIES[name].pad
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src != pad).long(),
                             num_beams=num_beams, do_sample=False)
    start = model.generation_config.decoder_start_token_id
    if start is None:
        start = model.generation_config.bos_token_id
    assert (out[:, 0] == start).all()
    return after_eos_as_pad(out[:, 1:].numpy(), model.generation_config.eos_token_id, pad)


def after_eos_as_pad(ids: np.ndarray, eos: int, pad: int) -> np.ndarray:
    """transformers' beam search fills a row after its end token with `pad_token_id or eos_token_id`
    (generation/utils.py, `output_fill_value`): a pad id of 0 (Pegasus, Blenderbot) is falsy there,
    so it fills with the end token instead. What fills a finished row is no choice of the search;
    `generate` fills with the pad id, so the filler is read as the pad id here, and every id up to
    and including each row's end token is compared as it is."""
    ids = ids.copy()
    for row in ids:
        ends = np.flatnonzero(row == eos)
        if ends.size:
            row[ends[0] + 1:] = pad
    return ids


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_with_no_ids_passed_gives_transformers_ids(name, backend, num_beams, tmp_path_factory):
    model, config, params = converted(name, str(tmp_path_factory.getbasetemp()))
    note = json.loads(config.notes["generation"])
    for key, value in GENERATION[name].items():
        assert note.get(key) == value, (name, key, note)
    src, _, _ = batch(name)
    expected = hf_ids(name, model, config, src, num_beams)
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ours = backends.build(target, config, {k: v.astype(np.float64) for k, v in params.items()})
        ids = to_numpy(ours.generate(src, num_beams=num_beams)).astype(np.int64)
    where = f"{name}, {backend}, num_beams={num_beams}"
    assert ids.shape == expected.shape and (ids == expected).all(), f"{where}:\nours {ids.tolist()}\nHF   {expected.tolist()}"
    forced = GENERATION[name].get("forced_bos_token_id")
    if forced is not None:
        assert (ids[:, 0] == forced).all(), where


# -- T5, T5 v1.1 and mT5 --------------------------------------------------------------------------
# The decoder starts from the pad id 0 (config.json's decoder_start_token_id, or the layout's
# generation default where a T5Config has none); the end token is 1. transformers' float64 T5 runs
# with its LayerNorm variance in float64 (`float64_variance`: its one float32 cast removed), so
# that the ids are decided by float64 scores on both sides.

T5_GENERATION = {"t5": dict(max_length=12, no_repeat_ngram_size=2), "t5-v1_1": dict(max_length=12),
                 "mt5": dict(max_length=12, no_repeat_ngram_size=2), "umt5": dict(max_length=12, no_repeat_ngram_size=2)}


@functools.cache
def converted_t5(name: str, tmp_dir: str):
    from test_hf_t5 import build as build_t5

    model = build_t5(name)
    for key, value in T5_GENERATION[name].items():
        setattr(model.generation_config, key, value)
    model.generation_config.num_beams = 1
    model.generation_config.decoder_start_token_id = 0
    folder = f"{tmp_dir}/{name}"
    model.save_pretrained(folder)
    config, params = from_hf_folder(folder)
    return model, config, params


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", list(T5_GENERATION))
def test_t5_generate_with_no_ids_passed_gives_transformers_ids(name, backend, num_beams, tmp_path_factory):
    from test_hf_t5 import EOS, PAD, batch as t5_batch, float64_variance

    model, config, params = converted_t5(name, str(tmp_path_factory.getbasetemp()))
    src, _, _ = t5_batch()
    with float64_variance(), torch.no_grad():
        out = copy.deepcopy(model).double().generate(input_ids=torch.from_numpy(src),
                                                     attention_mask=torch.from_numpy(src != PAD).long(),
                                                     num_beams=num_beams, do_sample=False)
    assert (out[:, 0] == 0).all()
    expected = after_eos_as_pad(out[:, 1:].numpy(), EOS, PAD)
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ours = backends.build(target, config, {k: v.astype(np.float64) for k, v in params.items()})
        ids = to_numpy(ours.generate(src, num_beams=num_beams)).astype(np.int64)
    where = f"{name}, {backend}, num_beams={num_beams}"
    assert ids.shape == expected.shape and (ids == expected).all(), f"{where}:\nours {ids.tolist()}\nHF   {expected.tolist()}"


# -- BART's summarisation settings: minimum length, early stopping, length penalty ---------------
# bart-large-cnn's generation_config.json also sets min_length 56, early_stopping true, 4 beams and
# length penalty 2.0. With the tiny model's max_length of 14, a min_length of 9 (the start token
# counted, as transformers counts it for an encoder-decoder) bans the end token where rows would
# end; min_new_tokens, the same rule counted without the start token, replaces it where set.
# Everything comes from the folder: generate gets no argument (greedy: num_beams=1 only).
BART_SUMMARY = dict(no_repeat_ngram_size=3, forced_bos_token_id=0, forced_eos_token_id=2, max_length=14,
                    early_stopping=True, num_beams=4, length_penalty=2.0)
BART_MINIMUM = {"min_length": dict(min_length=9), "min_new_tokens": dict(min_new_tokens=7)}
BART_OFF = dict(min_length=0, min_new_tokens=None)  # transformers' generate with neither rule


@functools.cache
def converted_bart_summary(minimum: str, tmp_dir: str):
    model = build("bart")
    model.generation_config.update(**BART_SUMMARY, **BART_MINIMUM[minimum])
    with torch.no_grad():
        model.final_logits_bias[0, model.generation_config.eos_token_id] += EOS_BOOST
    folder = f"{tmp_dir}/bart-summary-{minimum}"
    model.save_pretrained(folder)
    config, params = from_hf_folder(folder)
    return model, config, params


def hf_summary_ids(model, config, src, **options) -> np.ndarray:
    model = in_float64("bart", model, config)
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src != FAMILIES["bart"].pad)
                             .long(), do_sample=False, **options)
    return out[:, 1:].numpy()


def differ(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape != b.shape or bool((a != b).any())


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("minimum", sorted(BART_MINIMUM))
def test_bart_summary_settings_from_the_folder_give_transformers_ids(minimum, backend, num_beams, tmp_path_factory):
    model, config, params = converted_bart_summary(minimum, str(tmp_path_factory.getbasetemp()))
    note = json.loads(config.notes["generation"])
    for key, value in {**BART_SUMMARY, **BART_MINIMUM[minimum]}.items():
        assert note.get(key) == value, (key, note)
    src, _, _ = batch("bart")
    greedy = {} if num_beams == 4 else {"num_beams": 1}
    expected = hf_summary_ids(model, config, src, **greedy)
    # Each setting changes transformers' own ids here, so that the test can fail.
    assert differ(expected, hf_summary_ids(model, config, src, **greedy, **BART_OFF)), f"{minimum} changes nothing"
    if num_beams == 4:
        assert differ(expected, hf_summary_ids(model, config, src, early_stopping=False)), \
            "early_stopping changes nothing"
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ours = backends.build(target, config, {k: v.astype(np.float64) for k, v in params.items()})
        ids = to_numpy(ours.generate(src, **greedy)).astype(np.int64)
    where = f"bart summary, {minimum}, {backend}, num_beams={num_beams}"
    assert ids.shape == expected.shape and (ids == expected).all(), f"{where}:\nours {ids.tolist()}\nHF   {expected.tolist()}"


def test_a_setting_generate_does_not_apply_is_named_in_a_warning(tmp_path):
    """sequence_bias and guidance_scale change transformers' ids here; the conversion goes on
    but warns, naming each with its value; a field at a value that changes nothing is not named.
    (repetition_penalty and suppress_tokens, named here before, are applied now:
    tests/generation/test_generation_config_processors.py.)"""
    from conformance.convert.hf_folder import convert_folder
    from conformance.core.generation.note import GenerationWarning

    model = build("bart")
    model.generation_config.update(max_length=12, num_beams=1, top_k=50)
    src, _, _ = batch("bart")
    config, _ = from_hf_folder(_saved(model, tmp_path / "plain"))
    plain = hf_summary_ids(model, config, src)
    unapplied = {"sequence_bias": [[[5], 10.0]], "guidance_scale": 2.0}
    for field, value in unapplied.items():
        assert differ(plain, hf_summary_ids(model, config, src, **{field: value})), f"{field} changes nothing"
    model.generation_config.update(**unapplied)
    folder = _saved(model, tmp_path / "unapplied")
    with pytest.warns(GenerationWarning) as caught:
        result = convert_folder(folder)
    (message,) = [str(w.message) for w in caught if issubclass(w.category, GenerationWarning)]
    assert "sequence_bias=[[[5], 10.0]]" in message and "guidance_scale=2.0" in message, message
    assert "does not" in message and "top_k" not in message, message  # top_k without do_sample changes nothing
    assert any(line.startswith("generation warning:") and "guidance_scale=2.0" in line for line in result.decisions)
    note = json.loads(result.config.notes["generation"])
    assert note["guidance_scale"] == 2.0 and "top_k" not in note
    with pytest.warns(GenerationWarning, match="guidance_scale=2.0"):  # a live model too
        from conformance.convert import from_hf
        from_hf(model)


def _saved(model, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)
