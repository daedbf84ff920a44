"""`generate` from a converted folder, with no special id passed, gives transformers' ids (issue 42).

BART, mBART, M2M100, Pegasus and Marian first; T5, T5 v1.1 and mT5 at the end.

For each family with an `[hf]` layout, the tiny random model of tests/test_hf_families.py gets the
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
    return out[:, 1:].numpy()


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
                 "mt5": dict(max_length=12, no_repeat_ngram_size=2)}


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
    from test_hf_t5 import PAD, batch as t5_batch, float64_variance

    model, config, params = converted_t5(name, str(tmp_path_factory.getbasetemp()))
    src, _, _ = t5_batch()
    with float64_variance(), torch.no_grad():
        out = copy.deepcopy(model).double().generate(input_ids=torch.from_numpy(src),
                                                     attention_mask=torch.from_numpy(src != PAD).long(),
                                                     num_beams=num_beams, do_sample=False)
    assert (out[:, 0] == 0).all()
    expected = out[:, 1:].numpy()
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ours = backends.build(target, config, {k: v.astype(np.float64) for k, v in params.items()})
        ids = to_numpy(ours.generate(src, num_beams=num_beams)).astype(np.int64)
    where = f"{name}, {backend}, num_beams={num_beams}"
    assert ids.shape == expected.shape and (ids == expected).all(), f"{where}:\nours {ids.tolist()}\nHF   {expected.tolist()}"
