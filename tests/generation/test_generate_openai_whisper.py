"""The ids of openai-whisper's `decode`, reproduced by every backend's `generate` in float64.

A tiny random `whisper.model.Whisper` (a real multilingual vocabulary of 51865 ids, so that its
tokenizer numbers the special ids; every norm, bias and weight jittered) is saved as the
checkpoint `whisper.load_model` reads and converted with `rosetta convert` (no --set): the
converter derives the "generation" note from n_vocab and the decoding defaults, as openai's
tokenizer and `DecodingOptions` give them. Its token table makes a few dozen ids likely (the end
of text, some timestamps, some text), so that rows end at different steps, timestamps come in
pairs and beam search chooses otherwise than greedy search. 150 encoder positions make the
first timestamp's bound round(1.0 s / (30 s / 150)) = 5, so that the first step of a beam search
with timestamps has 6 allowed ids, each beam's num_beams + 1 proposals (openai-whisper keeps
proposals of -inf score, whose ids its torch.topk picks in no promised order: docs/whisper.md).

openai-whisper does not run in float64 as shipped (its LayerNorm and its search cast to float32,
and `decode` refuses float64 features): `openai_float64` is the patch that makes its forward and
its whole search float64, and beam search runs one audio at a time (openai/whisper PRs #2197,
#2389, #2843: a batch of several fails).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="openai-whisper is a PyTorch model")
whisper = pytest.importorskip("whisper", reason="openai-whisper (the test extra) is not installed")

import whisper.decoding as openai_decoding  # noqa: E402
from whisper.decoding import DecodingOptions, DecodingTask, decode  # noqa: E402
from whisper.model import ModelDimensions, Whisper  # noqa: E402
from whisper.tokenizer import get_tokenizer  # noqa: E402

from conformance.check import backends  # noqa: E402
from conformance.check.compare import to_numpy  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert.layout import load_layout  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.generation.note import generation_note  # noqa: E402
from systems.harness import BACKEND_PARAMS  # noqa: E402

DIMS = ModelDimensions(n_mels=8, n_audio_ctx=150, n_audio_state=16, n_audio_head=2, n_audio_layer=2, n_vocab=51865,
                       n_text_ctx=16, n_text_state=16, n_text_head=2, n_text_layer=2)
EOT, SOT, EN, TRANSCRIBE, NO_TIMESTAMPS = 50257, 50258, 50259, 50359, 50363
ROWS = 3

# openai's DecodingOptions for each search (language "en", fp16 False), and ours: the prompt
# (language, task, and without timestamps the no-timestamps id) is `prefix`.
SEARCHES = {
    "greedy, timestamps": ({}, dict(prefix=[EN, TRANSCRIBE], return_timestamps=True)),
    "greedy": (dict(without_timestamps=True), dict(prefix=[EN, TRANSCRIBE, NO_TIMESTAMPS], return_timestamps=False)),
    "beam 5, patience 1, timestamps": (dict(beam_size=5, patience=1.0),
                                       dict(prefix=[EN, TRANSCRIBE], return_timestamps=True, beam_rule="openai",
                                            num_beams=5, patience=1.0)),
    "beam 5, patience 1": (dict(beam_size=5, patience=1.0, without_timestamps=True),
                           dict(prefix=[EN, TRANSCRIBE, NO_TIMESTAMPS], return_timestamps=False, beam_rule="openai",
                                num_beams=5, patience=1.0)),
}


@contextlib.contextmanager
def openai_float64():
    """openai-whisper's forward and `decode` in float64: `Tensor.float()` (its LayerNorm's and its
    search's casts) leaves a float64 tensor alone, the audio features are not refused for their
    dtype, and its sums start as float64 zeros. Everything is put back on exit."""
    original_float, original_features = torch.Tensor.float, DecodingTask._get_audio_features
    original_dtype = torch.get_default_dtype()

    def features(self, mel):
        dims = self.model.dims
        return mel if mel.shape[-2:] == (dims.n_audio_ctx, dims.n_audio_state) else self.model.encoder(mel)

    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else original_float(self, *a, **k)
    DecodingTask._get_audio_features = features
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.Tensor.float, DecodingTask._get_audio_features = original_float, original_features
        torch.set_default_dtype(original_dtype)


def jittered(seed: int = 2) -> Whisper:
    """A random Whisper, every parameter moved off its initialisation (the decoder's position table,
    `torch.empty` in openai's __init__, drawn), the encoder's sinusoid buffer kept. Its token table
    is small but for 40 ids: the end of text (made larger still, so that rows end), the first ten
    timestamps and four later ones, and 25 text ids."""
    torch.manual_seed(0)
    model = Whisper(DIMS).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name == "decoder.positional_embedding":
                p.copy_(noise)
            elif p.ndim == 1:
                p.add_(0.2 * noise)
            else:
                p.add_(3.0 * noise / math.sqrt(max(1, p[0].numel())))
        table = model.decoder.token_embedding.weight
        table.copy_(0.05 * torch.randn(table.shape, generator=generator))
        text = np.random.default_rng(seed).choice(np.arange(100, 50000), 25, replace=False).tolist()
        likely = [EOT] + list(range(50364, 50374)) + [50364 + k for k in (20, 60, 200, 900)] + sorted(text)
        table[likely] = 0.5 * torch.randn((len(likely), table.shape[1]), generator=generator)
        table[EOT] *= 2.5
    return model


@functools.cache
def features() -> np.ndarray:
    return np.random.default_rng(2).normal(size=(ROWS, DIMS.n_mels, 2 * DIMS.n_audio_ctx))  # (3, 8, 300)


@functools.cache
def openai_model() -> Whisper:
    return jittered().double()


@functools.cache
def openai_results(search: str, **options) -> tuple:
    """openai-whisper's tokens (the ids after its prompt, without the end of text), no-speech
    probability and language for each audio, in float64, one audio at a time."""
    return openai_run(search, **options)[0]


@functools.cache
def openai_run(search: str, **options) -> tuple:
    """(`openai_results`, whether a beam of openai's beam search ever held a -inf sum: a proposal
    of a banned id, which it keeps and we drop, docs/whisper.md)."""
    options = dict(SEARCHES[search][0] if search else {}, **options)
    model = openai_model()  # built outside openai_float64, whose float64 default would draw other weights
    out, infinite = [], []
    original_update = openai_decoding.BeamSearchDecoder.update

    def update(self, tokens, logits, sum_logprobs):
        found = original_update(self, tokens, logits, sum_logprobs)
        infinite.append(bool(torch.isinf(sum_logprobs).any()))
        return found

    openai_decoding.BeamSearchDecoder.update = update
    try:
        with openai_float64():
            for row in features():
                result = decode(model, torch.from_numpy(row[None]), DecodingOptions(fp16=False, **options))[0]
                out.append((tuple(result.tokens), result.no_speech_prob, result.language))
    finally:
        openai_decoding.BeamSearchDecoder.update = original_update
    return tuple(out), any(infinite)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The rosetta checkpoint `rosetta convert` makes of the model saved as openai-whisper saves."""
    folder = tmp_path_factory.mktemp("openai_whisper")
    source, out = folder / "tiny.pt", folder / "tiny.safetensors"
    torch.save({"dims": dataclasses.asdict(DIMS), "model_state_dict": jittered().state_dict()}, source)
    assert main(["convert", str(source), str(out)]) == 0
    return checkpoint.load(out)


def generated(backend: str, config, params, **options):
    """Our float64 generate on `backend`: (each row's ids after the prompt up to the end of text,
    the whole rows, the no-speech probabilities)."""
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        ids, no_speech = model.generate(features(), return_no_speech_prob=True, **options)
    ids, no_speech = to_numpy(ids).astype(np.int64), to_numpy(no_speech).astype(np.float64)
    prompt = len(options.get("prefix", ()))
    rows = []
    for row in ids.tolist():
        row = row[prompt:] if "prefix" in options else row[2:]  # the detected language and the task
        rows.append(tuple(row[:row.index(EOT)] if EOT in row else row))
    return tuple(rows), ids, no_speech


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("search", sorted(SEARCHES))
def test_generate_gives_the_tokens_of_openai_whisper_decode(converted, backend, search):
    config, params = converted
    theirs = openai_results(search, language="en")
    ours, ids, no_speech = generated(backend, config, params, **SEARCHES[search][1])
    assert ours == tuple(tokens for tokens, _, _ in theirs), (
        f"{backend}, {search}: ours {ours}, openai-whisper's {[tokens for tokens, _, _ in theirs]}")
    np.testing.assert_allclose(no_speech, [p for _, p, _ in theirs], rtol=1e-12, atol=0)


def test_the_searches_bite():
    """The model decodes as a test of the rules needs: rows end at different steps or not at all,
    timestamps come in pairs, and the beam searches choose otherwise than the greedy ones."""
    tokens = {search: [t for t, _, _ in openai_results(search, language="en")] for search in SEARCHES}
    ends = {len(row) for rows in tokens.values() for row in rows}
    assert len(ends) >= 3 and max(ends) == DIMS.n_text_ctx // 2, ends
    pairs = [row for row in tokens["greedy, timestamps"] + tokens["beam 5, patience 1, timestamps"]
             if sum(t >= 50364 for t in row) >= 3]
    assert pairs, tokens
    assert tokens["greedy"] != tokens["beam 5, patience 1"], tokens
    assert tokens["greedy, timestamps"] != tokens["beam 5, patience 1, timestamps"], tokens
    # Where openai's beams held a proposal of -inf, our dropping it could part the ids by chance.
    assert not any(openai_run(search, language="en")[1] for search in SEARCHES if "beam" in search)


def test_the_default_decode_is_openai_whispers(converted):
    """With no argument but the features, the note the converter derived decodes as openai's
    `decode` with its defaults: the language detected at the first step, transcribe, timestamps
    (NumPy; the backends give the same ids for the same arguments above)."""
    config, params = converted
    theirs = openai_results("")  # language None: detected
    rows, ids, no_speech = generated("numpy", config, params)
    languages = get_tokenizer(True).all_language_codes
    detected = [languages[get_tokenizer(True).all_language_tokens.index(int(row[0]))] for row in ids]
    assert detected == [language for _, _, language in theirs]
    assert rows == tuple(tokens for tokens, _, _ in theirs)
    np.testing.assert_allclose(no_speech, [p for _, p, _ in theirs], rtol=1e-12, atol=0)


@pytest.mark.parametrize("n_vocab", [51865, 51864, 51866])
def test_the_derived_note_holds_openai_whispers_ids(n_vocab):
    """The note derived from n_vocab (multilingual, English-only, large-v3's 100 languages) holds
    the ids openai-whisper's tokenizer and DecodingTask use: the start of transcript, the end of
    text, the no-timestamps id (the timestamps after it, the no-speech id before it), the prompt,
    the suppressed ids (non-speech, tasks, start ids, no-speech) and the first step's blank and end."""
    dims = dataclasses.replace(DIMS, n_vocab=n_vocab)
    note = load_layout("openai-whisper").bundle.generation_note(dataclasses.asdict(dims))
    model = Whisper(dims)
    tokenizer = get_tokenizer(model.is_multilingual, num_languages=model.num_languages, language="en")
    task = DecodingTask(model, DecodingOptions(language="en" if model.is_multilingual else None))
    assert note["decoder_start_token_id"] == tokenizer.sot and note["eos_token_id"] == tokenizer.eot
    assert note["no_timestamps_token_id"] == tokenizer.no_timestamps == tokenizer.timestamp_begin - 1
    assert note["no_timestamps_token_id"] - 1 == tokenizer.no_speech
    assert note["suppress_tokens"] == list(task._get_suppress_tokens())
    assert note["begin_suppress_tokens"] == tokenizer.encode(" ") + [tokenizer.eot]
    assert note["max_initial_timestamp_index"] == round(1.0 / (30 / DIMS.n_audio_ctx))
    assert note["max_new_tokens"] == task.sample_len
    config = checkpoint_config(note, n_vocab)
    recorded = generation_note(config)
    if model.is_multilingual:
        assert {f"<|{code}|>": token for code, token in zip(tokenizer.all_language_codes,
                                                            tokenizer.all_language_tokens)} == note["lang_to_id"]
        assert recorded["prefixes"][True] == (None, tokenizer.transcribe)
        assert recorded["prefixes"][False] == (None, tokenizer.transcribe, tokenizer.no_timestamps)
    else:
        assert recorded["prefixes"][False] == tuple(tokenizer.sot_sequence_including_notimestamps[1:])
        assert recorded["prefixes"][True] == tuple(tokenizer.sot_sequence[1:]) == ()


def checkpoint_config(note: dict, n_vocab: int):
    import json

    from conformance.core.config import ModelConfig

    return ModelConfig(src_vocab_size=n_vocab, tgt_vocab_size=n_vocab, max_len=DIMS.n_text_ctx,
                       pad_id=note["eos_token_id"], notes={"generation": json.dumps(note)})
