"""The ids of transformers' Whisper `generate` (short form), reproduced by every backend in float64.

A tiny random `WhisperForConditionalGeneration` (the 64-id vocabulary laid out as a multilingual
Whisper's, tests/fixtures/optimum_whisper_onnx: end of text 45, start of transcript 46, <|en|> 47,
<|de|> 48, transcribe 50, no-timestamps 54, timestamps 55-63), every norm, bias and weight
jittered and the end of text's row of the tied token table made larger (so that rows end at
different steps), with that fixture's generation_config.json (a forced prompt that leaves the
language free, suppress_tokens, begin_suppress_tokens, max_initial_timestamp_index 4), saved
with `save_pretrained` and converted with `rosetta convert` (no --set). transformers' greedy and
beam 4 searches, with and without timestamps, with language "en" and with the language detected,
against `generate` on the converted checkpoint, which reads the same settings from its note.

transformers returns the sequences its Whisper `generate` post-processes into segments; the ids
compared are those of its one underlying search (`return_dict_in_generate=True` with
`force_unique_generate_call=True`: the sequences, prompt included, after the start token).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers' Whisper is a PyTorch model")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' generate")

from conformance.check import backends  # noqa: E402
from conformance.check.compare import to_numpy  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from systems.harness import BACKEND_PARAMS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "optimum_whisper_onnx"
EOS, SOT, EN, DE, TRANSCRIBE, NO_TIMESTAMPS = 45, 46, 47, 48, 50, 54
SIZES = dict(vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
             max_target_positions=16, pad_token_id=EOS, bos_token_id=EOS, eos_token_id=EOS,
             decoder_start_token_id=SOT)

# transformers' arguments for each search, and ours: the prompt it builds from language="en" is
# `prefix`; with the language detected, ours comes from the note.
SEARCHES = {
    "greedy": (dict(language="en"), dict(prefix=[EN, TRANSCRIBE, NO_TIMESTAMPS])),
    "greedy, timestamps": (dict(language="en", return_timestamps=True),
                           dict(prefix=[EN, TRANSCRIBE], return_timestamps=True)),
    "beam 4": (dict(language="en", num_beams=4), dict(prefix=[EN, TRANSCRIBE, NO_TIMESTAMPS], num_beams=4)),
    "beam 4, timestamps": (dict(language="en", num_beams=4, return_timestamps=True),
                           dict(prefix=[EN, TRANSCRIBE], num_beams=4, return_timestamps=True)),
    "greedy, language detected": ({}, {}),
    "beam 4, timestamps, language detected": (dict(num_beams=4, return_timestamps=True),
                                              dict(num_beams=4, return_timestamps=True)),
}


@functools.cache
def reference_model():
    """The random Whisper in float64 with the fixture's generation settings."""
    generation = json.loads((FIXTURE / "generation_config.json").read_text())
    generation.pop("transformers_version")
    torch.manual_seed(1)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**SIZES)).eval()
    model.generation_config = transformers.GenerationConfig(**generation)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.encoder.embed_positions.weight":  # Whisper's sinusoid, never trained
                continue
            noise = torch.randn(p.shape, generator=generator)
            if p.ndim == 1:
                p.add_(0.2 * noise)
            else:
                p.add_(3.0 * noise / math.sqrt(max(1, p[0].numel())))
        model.model.decoder.embed_tokens.weight[EOS] *= 2.0
    return model.double()


@functools.cache
def features() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(4, SIZES["num_mel_bins"], 2 * SIZES["max_source_positions"]))


@functools.cache
def transformers_ids(search: str) -> np.ndarray:
    """transformers' sequences after the start token (the prompt, then what it generated)."""
    with torch.no_grad():
        out = reference_model().generate(torch.from_numpy(features()), return_dict_in_generate=True,
                                         force_unique_generate_call=True, **SEARCHES[search][0])
    return out.sequences[:, 1:].numpy()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_whisper")
    reference_model().float().save_pretrained(folder / "model")
    reference_model().double()
    out = folder / "tiny.safetensors"
    assert main(["convert", str(folder / "model"), str(out)]) == 0
    return checkpoint.load(out)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_generate_gives_the_ids_of_transformers_whisper(converted, backend, search):
    config, params = converted
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        ours = to_numpy(model.generate(features(), **SEARCHES[search][1])).astype(np.int64)
    theirs = transformers_ids(search)
    assert ours.shape == theirs.shape and (ours == theirs).all(), (
        f"{backend}, {search}:\nours {ours.tolist()}\ntransformers' {theirs.tolist()}")


def test_the_searches_bite():
    """The model decodes as a test of the rules needs: rows end at different steps or not at all,
    the languages detected differ, timestamps come in pairs, and beam search chooses otherwise."""
    ids = {search: transformers_ids(search) for search in SEARCHES}
    ends = {int((row != EOS).sum()) for rows in ids.values() for row in rows}
    assert len(ends) >= 3, ends
    assert set(ids["greedy, language detected"][:, 0].tolist()) == {EN, DE}
    stamped = np.concatenate([ids["greedy, timestamps"], ids["beam 4, timestamps"]])
    assert any(((row >= NO_TIMESTAMPS + 1).sum() >= 3) for row in stamped), stamped
    assert (ids["greedy"] != ids["beam 4"]).any() and (ids["greedy, timestamps"] != ids["beam 4, timestamps"]).any()


def test_the_no_speech_probability_is_transformers(converted):
    """`return_no_speech_prob`: the probability of the no-speech id (no-timestamps - 1) at the start
    token's position, as transformers' WhisperNoSpeechDetection computes it from the decoder's
    logits on the start token (NumPy, float64)."""
    config, params = converted
    target = backends.Target("numpy", "cpu", "float64")
    model = backends.build(target, config, params)
    _, no_speech = model.generate(features(), max_len=4, return_no_speech_prob=True)
    with torch.no_grad():
        logits = reference_model()(torch.from_numpy(features()),
                                   decoder_input_ids=torch.full((len(features()), 1), SOT)).logits[:, 0]
    np.testing.assert_allclose(no_speech, logits.softmax(-1)[:, NO_TIMESTAMPS - 1].numpy(), rtol=1e-12, atol=0)
