"""The ids of transformers' `MarianMTModel.generate`, reproduced by every backend on the ported model.

The Marian model is random and built offline (tests/convert/test_hf_marian.py), in float64 so that
no near-tie of scores can flip a choice; its final_logits_bias favours the end token a little,
so that hypotheses end at different steps and the finished-hypothesis bookkeeping, the length
penalty and the stopping rule all matter. The special ids are the model's own: decoder start =
pad, eos, forced EOS; the source batch has padding. docs/decoding.md maps the arguments.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="Marian is a PyTorch model")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' generate")

from conformance.check import backends  # noqa: E402
from conformance.check.compare import to_numpy  # noqa: E402
from conformance.convert import from_hf_marian  # noqa: E402
from systems.harness import BACKEND_PARAMS, padded_batch  # noqa: E402
from test_hf_marian import PAD, VOCAB, marian  # noqa: E402

MAX_LENGTH = 12  # Hugging Face's max_length, which counts the decoder start token
EOS_BOOST = 3.0  # added to final_logits_bias[eos]: ends at varied steps instead of never


@functools.cache
def reference_model():
    model = copy.deepcopy(marian()).double()
    with torch.no_grad():
        # The randomised bias is large enough to pick one token at every step; a small one leaves
        # the choice to the decoder, and the end token a fair chance.
        bias = torch.from_numpy(np.random.default_rng(7).normal(0.0, 0.1, VOCAB))
        model.final_logits_bias[0] = bias
        model.final_logits_bias[0, model.generation_config.eos_token_id] += EOS_BOOST
    return model


@functools.cache
def ported():
    config, params = from_hf_marian(reference_model())
    return config, params


def source() -> np.ndarray:
    src, _ = padded_batch(PAD, VOCAB, VOCAB)
    return src  # (3, 9): rows of 9, 5 and 2 real tokens, then padding


def hf_generate(src, banned=False, **options):
    model = reference_model()
    extra = {"bad_words_ids": [[PAD]]} if banned else {}
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src != PAD).long(),
                             max_length=MAX_LENGTH, do_sample=False, return_dict_in_generate=True,
                             output_scores=True, **extra, **options)
    start = model.generation_config.decoder_start_token_id
    assert (out.sequences[:, 0] == start).all()
    scores = None if options.get("num_beams", 1) == 1 else out.sequences_scores.numpy()
    return out.sequences[:, 1:].numpy(), scores


# (num_beams, length_penalty, early_stopping, banned pad): greedy, then beam search over the options.
SETTINGS = [
    (1, 1.0, False, False),
    (1, 1.0, False, True),
    (2, 1.0, False, False),
    (3, 0.0, "never", True),
    (4, 2.0, True, False),
    (4, -0.5, False, True),
    (4, 1.0, "never", False),
]


def our_generate(backend: str, src, num_beams, length_penalty, early_stopping, banned, use_cache=True):
    config, params = ported()
    generation = reference_model().generation_config
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        ids, scores = model.generate(
            src, MAX_LENGTH - 1, generation.decoder_start_token_id, generation.eos_token_id, num_beams=num_beams,
            length_penalty=length_penalty, early_stopping=early_stopping, use_cache=use_cache,
            forced_eos=generation.forced_eos_token_id is not None, banned_ids=[PAD] if banned else (),
            return_scores=True)
        return to_numpy(ids).astype(np.int64), to_numpy(scores)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_generate_gives_the_ids_of_transformers(backend):
    src = source()
    seen_lengths = set()
    for num_beams, length_penalty, early_stopping, banned in SETTINGS:
        options = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
        expected, expected_scores = hf_generate(src, banned=banned, **options)
        ids, scores = our_generate(backend, src, num_beams, length_penalty, early_stopping, banned)
        where = f"{backend}, num_beams={num_beams}, length_penalty={length_penalty}, early_stopping={early_stopping}, banned pad={banned}"
        assert ids.shape == expected.shape and (ids == expected).all(), f"{where}:\nours {ids.tolist()}\nHF   {expected.tolist()}"
        if expected_scores is not None:  # Hugging Face sums in float32
            np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5, err_msg=where)
        seen_lengths.update(int((row != PAD).sum()) for row in ids)
    # The EOS boost works: hypotheses end early and late, so the bookkeeping was exercised.
    assert len(seen_lengths) >= 3, seen_lengths


def test_uncached_loop_gives_the_same_ids():
    src = source()
    for setting in (SETTINGS[0], SETTINGS[4]):
        cached = our_generate("numpy", src, *setting)
        plain = our_generate("numpy", src, *setting, use_cache=False)
        assert (cached[0] == plain[0]).all(), setting
        np.testing.assert_allclose(cached[1], plain[1], rtol=1e-12)
