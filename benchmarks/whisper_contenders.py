"""The contenders of `benchmarks/bench_whisper.py`, each in its own spawned process.

A contender is one engine's greedy decode of the same log-mel features with the same weights:
transformers' `generate` (`hf`), faster-whisper's engine, CTranslate2's `ctranslate2.models.Whisper`
in float32 (`ct2`, on the model `rosetta convert --to ctranslate2` writes of those weights), and
impl_torch's `generate` (`torch`). All are built from one random float32
`WhisperForConditionalGeneration` (`whisper`, seed 0, every weight jittered off transformers'
initialisation so that its greedy rows differ), read into this project's config and parameters by
`conformance.convert.from_hf`.

The same search in each: the decoder starts from <|startoftranscript|> with <|notimestamps|> forced
after it (transformers: `decoder_input_ids` of both; CTranslate2: the prompt of both, which also keeps
its timestamp rules off; ours: `prefix`, Whisper's forced prompt, which begins the returned ids), then `new`
greedy tokens with the end of text suppressed in all three (`suppress_tokens`), so every row runs
every step, and nothing else suppressed (transformers' `GenerationMixin.generate` itself, not
Whisper's override, which would force a language and task and its own suppressions).

As `generate_contenders` (bench_generate.py) does, each contender builds its own copy of the weights
in its own process and times each call itself: CTranslate2's libgomp beside torch's slows both in one
process (measured there); CTranslate2's worker never imports torch. `worker` lives in this module,
not the script, so that a spawned child finds it by this module's name.
"""

from __future__ import annotations

import math
import time

import numpy as np

from generate_contenders import Spawned, stamp  # noqa: F401 (stamp: bench_whisper's too)

# openai/whisper-base's sizes (its config.json): 6 + 6 layers of d_model 512, 8 heads, 80 mel bins, a
# 3000-frame window, the multilingual vocabulary.
BASE = dict(vocab_size=51865, num_mel_bins=80, d_model=512, encoder_layers=6, decoder_layers=6,
            encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
            max_source_positions=1500, max_target_positions=448)
QUICK = dict(BASE, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=50)
# A multilingual Whisper's special ids (openai's tokenizer for 51865 ids, generation_config.json).
EOT, SOT, NO_TIMESTAMPS = 50257, 50258, 50363
NOTE = dict(decoder_start_token_id=SOT, bos_token_id=EOT, eos_token_id=EOT, pad_token_id=EOT,
            no_timestamps_token_id=NO_TIMESTAMPS, prev_sot_token_id=50361, is_multilingual=True,
            lang_to_id={"<|en|>": 50259}, task_to_id={"translate": 50358, "transcribe": 50359})
CONTENDERS = ("hf", "ct2", "torch")
NAMES = {"hf": "transformers' GenerationMixin.generate on WhisperForConditionalGeneration",
         "ct2": "CTranslate2's models.Whisper.generate (faster-whisper's engine), float32",
         "torch": "impl_torch's Model.generate"}
JITTER = 2.0  # a weight's noise, times 1 / sqrt(fan-in) (`whisper` says why this much)


def whisper(sizes: dict):
    """A random float32 WhisperForConditionalGeneration of `sizes`: transformers' initialisation
    (seed 0), then every weight but the encoder's sinusoid moved by 2 / sqrt(fan-in) N(0, 1) and
    every bias and norm by 0.1 N(0, 1) (a generator of seed 0: the same in every process).

    2, not less: at 0.5 / sqrt(fan-in) (and at 1) each projection shrinks what it carries, the
    decoder barely sees the encoder, and every row of the quick config greedily repeats one token,
    so equal ids would prove nothing about which row is which (measured)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(**sizes, pad_token_id=EOT, bos_token_id=EOT, eos_token_id=EOT,
                                        decoder_start_token_id=SOT, begin_suppress_tokens=None)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "model.encoder.embed_positions.weight":
                noise = torch.randn(p.shape, generator=generator)
                p.add_(0.1 * noise if p.ndim == 1 else JITTER * noise / math.sqrt(max(1, p[0].numel())))
    model.generation_config = transformers.GenerationConfig(**NOTE)
    return model


def features(sizes: dict, batch: int) -> np.ndarray:
    """(batch, n_mels, 2 * max_source_positions) standard-normal float32 features: a whole window."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, sizes["num_mel_bins"], 2 * sizes["max_source_positions"])).astype(np.float32)


def hf_decoder(model, feats: np.ndarray, new: int):
    import torch
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    config = GenerationConfig(decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, max_new_tokens=new,
                              do_sample=False, num_beams=1, suppress_tokens=[EOT])
    inputs = torch.as_tensor(feats)
    prompt = torch.tensor([[SOT, NO_TIMESTAMPS]] * len(feats))

    def decode() -> np.ndarray:
        with torch.inference_mode():
            out = GenerationMixin.generate(model, input_features=inputs, decoder_input_ids=prompt,
                                           generation_config=config)
        return out[:, 2:].numpy()
    return decode


def ct2_decoder(folder, feats: np.ndarray, new: int, threads: int):
    import ctranslate2

    from conformance.check.ctranslate2.whisper import ctranslate2_max_length

    model = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32", intra_threads=threads)
    stored = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats))
    prompt = [SOT, NO_TIMESTAMPS]

    def decode() -> np.ndarray:
        out = model.generate(stored, [prompt] * len(feats), beam_size=1, max_length=ctranslate2_max_length(new, prompt),
                             suppress_tokens=[EOT], suppress_blank=False)
        return np.array([r.sequences_ids[0] for r in out])
    return decode


def torch_decoder(config, params, feats: np.ndarray, new: int):
    import impl_torch

    model = impl_torch.Model(config, params, "float32")

    def decode() -> np.ndarray:
        ids = model.generate(feats, new + 1, SOT, EOT, prefix=[NO_TIMESTAMPS], return_timestamps=False,
                             suppress_tokens=[EOT], begin_suppress_tokens=())
        return np.asarray(ids)[:, 1:]  # after the forced <|notimestamps|>
    return decode


def timed(function) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def worker(connection, contender: str, sizes: dict, batch: int, new: int, threads: int, folder) -> None:
    """A contender's process: its own model, then one timed call per request, answered with (ids,
    seconds), until None."""
    import signal
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent too, which ends its workers
    try:
        feats = features(sizes, batch)
        if contender == "ct2":  # the parent converted the model; torch is never imported here
            decode = ct2_decoder(folder, feats, new, threads)
            where = f"{threads} intra-op threads"
        else:
            import torch

            torch.set_num_threads(threads)
            model = whisper(sizes)
            if contender == "hf":
                decode = hf_decoder(model, feats, new)
            else:
                from conformance.convert import from_hf

                config, params = from_hf(model)
                del model
                decode = torch_decoder(config, params, feats, new)
            where = f"torch {torch.get_num_threads()} threads"
        connection.send(("ready", where))
        while True:
            try:
                request = connection.recv()
            except EOFError:
                return
            if request is None:
                return
            connection.send(("ran",) + timed(decode))
    except Exception:
        connection.send(("error", traceback.format_exc()))


class InWorker(Spawned):
    """A contender in its own spawned process (`worker`), asked over a pipe (`generate_contenders.Spawned`)."""

    def __init__(self, context, contender: str, sizes: dict, batch: int, new: int, threads: int, folder):
        super().__init__(context, contender, worker, (contender, sizes, batch, new, threads, folder),
                         f"bench_whisper {contender}")

    def ready(self) -> str:
        _, where = self.receive("its model")
        return f"{where}, ready {time.perf_counter() - self.started:.1f} s after its start"

    def run(self) -> tuple[np.ndarray, float]:
        self.connection.send(True)
        _, ids, seconds = self.receive("a call")
        return ids, seconds
