"""The contenders of `benchmarks/bench_generate.py`, and where each one runs.

A contender is one engine's `generate` on the same weights: transformers' (`hf`; `hf-static`, its
static cache with the forward compiled by `generate`), CTranslate2's (`ct2`, `ct2-int8`) on a model
converted from those weights, and this project's backends (`torch`, `jax`, `numpy`; `torch-int8`, impl_torch
with torch.ao's dynamic int8 quantisation of its Linears, `int8_linears`). All are built
from one random float32 `MarianMTModel` (`marian`, seed 0) of the `BASE` or `QUICK` sizes, read into
this project's config and parameters by `conformance.convert.from_hf_marian`, with Marian's ids
(`ids`: the pad id last, the decoder starting from it, the end id `EOS`), the end and pad ids barred
so that every row runs all its steps. `decoder` turns a contender into its decode of the sources as a
function of the beam count; `timed` times one call until its ids are on the host.

Where it runs: `InWorker` (the default) starts the contender in its own spawned process, `worker`,
which builds its own copy of the same weights and its own model and times each call itself, as each
engine runs when deployed; CTranslate2's worker loads the model the parent converted and never imports
torch. `InProcess` (`--same-process`) builds it in the benchmark's own process beside the others, the
earlier arrangement (each call after the same rest). Both answer `run(num_beams)` with (ids, seconds,
CPU seconds of the contender's process, `timed_cpu`), and `close()`.

Why a process each: measured on 2026-11-28 (2-core Xeon, torch 2.13 CPU, ctranslate2 4.8.5,
`--threads 2`): in one process, once a CTranslate2 Translator had run (and while it lived), torch's
2-thread ops slowed for good (`torch.mm` (8, 512) x (512, 2048), 300 times, 0.034 s -> 0.074 s;
impl_torch greedy at base size, batch 8, 64 tokens, 1.30 s -> 2.15 s), and CTranslate2 beside torch
was slower too (greedy 1.94 s -> 2.18 s): CTranslate2 ships its own libgomp beside torch's, two OpenMP
runtimes with live thread pools in one process (deleting the Translator mostly undid it; with one torch
thread nothing slowed, and `OMP_WAIT_POLICY=PASSIVE` gave torch the slow numbers from the start).
`--same-process` reproduces that interference.

`worker` lives here, not in the benchmark script, so that a spawned child finds it by this module's
name, `generate_contenders.worker`, however the benchmark was started (run as a script, whose names
are `__main__`'s, or loaded by a test under another name); the child starts with its parent's
`sys.path`, so it imports this module from `benchmarks/` as the parent did.
"""

from __future__ import annotations

import time

import numpy as np

from conformance.check.compare import to_numpy

BASE = dict(vocab_size=32000, d_model=512, heads=8, d_ff=2048, layers=6, max_position_embeddings=512)
QUICK = dict(vocab_size=1000, d_model=64, heads=4, d_ff=128, layers=2, max_position_embeddings=256)
EOS = 0  # Marian's; its pad id is the last (V - 1) and the decoder starts from it: `ids(sizes)`


def ids(sizes: dict) -> tuple[int, int, int]:
    """(pad, start, end) for `sizes`: the pad id last, as CTranslate2's Marian loader requires."""
    pad = sizes["vocab_size"] - 1
    return pad, pad, EOS


def marian(sizes: dict, device: str):
    """A random float32 MarianMTModel of `sizes` (transformers' own initialisation, seed 0)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    pad, bos, eos = ids(sizes)
    torch.manual_seed(0)
    config = MarianConfig(vocab_size=sizes["vocab_size"], d_model=sizes["d_model"],
                          encoder_layers=sizes["layers"], decoder_layers=sizes["layers"],
                          encoder_attention_heads=sizes["heads"], decoder_attention_heads=sizes["heads"],
                          encoder_ffn_dim=sizes["d_ff"], decoder_ffn_dim=sizes["d_ff"],
                          max_position_embeddings=sizes["max_position_embeddings"], pad_token_id=pad,
                          eos_token_id=eos, decoder_start_token_id=bos, forced_eos_token_id=None)
    model = MarianMTModel(config).eval()
    with torch.no_grad():  # CTranslate2 starts the decoder from a zero embedding, the others look up the pad row
        model.get_input_embeddings().weight[pad].zero_()
    model.to(device)
    model.generation_config.bad_words_ids = None
    model.generation_config.forced_eos_token_id = None
    return model


def hf_generate(model, src, new_tokens: int, num_beams: int, banned: list[int], static: bool = False):
    """transformers' `generate`; `static`: its static cache with the forward compiled by `generate`
    (transformers' docs, "static cache and torch.compile"; `CompileConfig`)."""
    import torch

    extra = {}
    if static:
        from transformers import CompileConfig

        if model.device.type == "cuda":  # the documented fast path: CUDA graphs, one graph for the step
            extra["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        else:  # generate compiles on CUDA only unless told; CUDA graphs do not exist on the CPU
            config = CompileConfig(fullgraph=True, mode="default")
            config._compile_all_devices = True
            extra["compile_config"] = config
        extra["cache_implementation"] = "static"
    with torch.inference_mode():
        ids = model.generate(input_ids=src, attention_mask=torch.ones_like(src), max_length=new_tokens + 1,
                             min_length=0, num_beams=num_beams, do_sample=False, bad_words_ids=[[b] for b in banned],
                             length_penalty=1.0, early_stopping=False, num_return_sequences=1, **extra)
    return ids[:, 1:]


def ct2_unavailable(device: str, compute_type: str) -> str | None:
    """Why CTranslate2 cannot run `compute_type` on `device` here, or None."""
    try:
        import ctranslate2
    except ImportError as exc:
        return f"ctranslate2 not importable ({exc})"
    if device == "cuda" and not ctranslate2.get_cuda_device_count():
        return f"ctranslate2 {ctranslate2.__version__} sees no CUDA device (a CPU-only build)"
    if compute_type not in ctranslate2.get_supported_compute_types(device):
        return f"ctranslate2 {ctranslate2.__version__} has no {compute_type} kernels on this {device}"
    return None


def ct2_translator(config, params, device: str, compute_type: str, folder, threads: int | None = None):
    """A CTranslate2 Translator of `params` (converted into `folder`, unless a model is there), or the
    reason there is none; `threads`, its intra-op threads, default torch's."""
    if reason := ct2_unavailable(device, compute_type):
        return None, reason
    import ctranslate2

    if not (folder / "model.bin").exists():
        from conformance.check.ctranslate2.target import convert

        convert(config, params, folder)
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return ctranslate2.Translator(str(folder), device=device, compute_type=compute_type, intra_threads=threads,
                                  inter_threads=1), None


def ct2_compute_type(contender: str, device: str) -> str:
    """ct2: float32 (float16 on CUDA); ct2-int8: int8 (int8_float16 on CUDA)."""
    if contender == "ct2":
        return "float16" if device == "cuda" else "float32"
    return "int8_float16" if device == "cuda" else "int8"


def ct2_generate(translator, tokens: list[list[str]], new_tokens: int, num_beams: int) -> np.ndarray:
    """CTranslate2's ids (B, new_tokens): the end token barred by a minimum length of every step."""
    out = translator.translate_batch(tokens, beam_size=num_beams, max_decoding_length=new_tokens,
                                     min_decoding_length=new_tokens, length_penalty=1.0, num_hypotheses=1,
                                     return_scores=False)
    return np.array([[int(t) for t in r.hypotheses[0]] for r in out])


def build(backend: str, config, params, device: str):
    if backend == "numpy":
        import impl_numpy

        return impl_numpy.Model(config, params, "float32")
    if backend == "torch":
        import impl_torch

        return impl_torch.Model(config, params, "float32", device=device)
    if backend == "torch-int8":
        import impl_torch

        return int8_linears(impl_torch.Model(config, params, "float32", device=device))
    import impl_jax

    return impl_jax.Model(config, params, "float32", device="gpu" if device == "cuda" else device)


def int8_linears(model):
    """`model` (an impl_torch.Model on the CPU) with every Linear of its encoder and decoder quantised
    by torch.ao's dynamic quantisation (`torch.ao.quantization.quantize_dynamic`: int8 weights, one
    scale per tensor; each call quantises its input and accumulates in int32); the embeddings and
    W_out stay float32 (the steps multiply W_out packed for oneDNN, impl_torch/packed.py). The
    benchmark's `torch-int8`: not the float32 arithmetic, reported beside CTranslate2's int8, never
    a float32 default. (torch 2.13 warns that torch.ao.quantization is deprecated, for torchao.)"""
    import warnings

    import torch
    from torch import nn

    linears = {}  # each Linear of ours (W stored (d_in, d_out)) as an nn.Linear (W stored (d_out, d_in))
    for name, module in model.named_modules():
        if (type(module).__module__, type(module).__name__) == ("impl_torch.model", "Linear"):
            dense = nn.Linear(*module.weight.shape, bias=module.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(module.weight.T)
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            linears[name.replace(".", "/")] = dense
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        quantized = torch.ao.quantization.quantize_dynamic(nn.ModuleDict(linears), {nn.Linear}, dtype=torch.qint8)
    for key, module in quantized.items():
        parent, _, child = key.replace("/", ".").rpartition(".")
        setattr(model.get_submodule(parent), child, module)
    return model


def timed(function):
    """(result as a host array, seconds), waiting for the device to finish."""
    started = time.perf_counter()
    result = to_numpy(function())  # a host copy: torch's and JAX's queues drained
    return result, time.perf_counter() - started


def timed_cpu(function):
    """(result as a host array, seconds, this process's CPU seconds, every thread's), as `timed`."""
    cpu = time.process_time()
    result, seconds = timed(function)
    return result, seconds, time.process_time() - cpu


def decoder(contender: str, args, sizes: dict, src: np.ndarray, hf_model, config, params, folder,
            threads: int | None = None):
    """`contender`'s decode of `src` as a function of the beam count, or the reason there is none.
    CTranslate2 reads the model converted into `folder` (converted there first when it is not),
    with `threads` intra-op threads (default torch's)."""
    pad, bos, eos = ids(sizes)
    banned = [eos, pad]
    if contender in ("hf", "hf-static"):
        import torch

        src_torch, static = torch.as_tensor(src, device=args.device), contender == "hf-static"
        return lambda beams: hf_generate(hf_model, src_torch, args.new_tokens, beams, banned, static), None
    if contender.startswith("ct2"):
        compute = ct2_compute_type(contender, args.device)
        translator, reason = ct2_translator(config, params, args.device, compute, folder, threads)
        if reason:
            return None, reason
        tokens = [[str(i) for i in row] for row in src.tolist()]
        return lambda beams: ct2_generate(translator, tokens, args.new_tokens, beams), None
    model = build(contender, config, params, args.device)
    return lambda beams: model.generate(src, args.new_tokens, bos, eos, num_beams=beams, banned_ids=banned), None


class InProcess:
    """A contender built in this process beside the others (`--same-process`)."""

    def __init__(self, contender: str, args, sizes: dict, src, hf_model, config, params, folder):
        self.contender = contender
        self.decode, self.reason = decoder(contender, args, sizes, src, hf_model, config, params, folder)

    def run(self, num_beams: int) -> tuple[np.ndarray, float, float]:
        return timed_cpu(lambda: self.decode(num_beams))

    def close(self, now: bool = False) -> None:
        self.decode = None  # a Translator's threads end with it


def worker(connection, contender: str, sizes: dict, args, src: np.ndarray, folder) -> None:
    """A contender's process: its own copy of the weights and its own model, then one timed call per
    beam count received, answered with (ids, seconds), until None (or the parent is gone).

    CTranslate2's worker loads the model the parent converted into `folder` and never imports torch:
    deployed, CTranslate2 runs without torch's OpenMP runtime beside its own (with torch loaded to
    build the weights, its greedy and beam-4 calls took 5-8% longer here)."""
    import signal
    import sys
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent too, which ends its workers
    try:
        if contender.startswith("ct2"):
            threads = args.threads  # the parent's torch thread count when --threads is not given
            decode, reason = decoder(contender, args, sizes, src, None, None, None, folder, threads)
            threads = f"{threads} intra-op threads, torch {'imported' if 'torch' in sys.modules else 'not imported'}"
        else:
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            from conformance.convert import from_hf_marian

            hf_model = marian(sizes, "cpu")  # seed 0: the weights the parent and every other worker built
            config, params = from_hf_marian(hf_model)
            hf_model = hf_model.to(args.device) if contender in ("hf", "hf-static") else None
            decode, reason = decoder(contender, args, sizes, src, hf_model, config, params, folder)
            del hf_model, config, params
            threads = f"torch {torch.get_num_threads()} threads"
        connection.send(("ready", reason, threads))
        while decode is not None:
            try:
                num_beams = connection.recv()
            except EOFError:  # the parent has gone
                return
            if num_beams is None:
                return
            connection.send(("ran",) + timed_cpu(lambda: decode(num_beams)))
    except Exception:
        connection.send(("error", traceback.format_exc()))


class Spawned:
    """A contender in its own spawned process, running `target(child_connection, *args)`, asked over a
    pipe; `receive` gives its next answer or says how it ended, `close` ends it. `InWorker` here and
    `whisper_contenders.InWorker` are its two benchmarks' contenders."""

    def __init__(self, context, contender: str, target, args: tuple, name: str):
        self.contender = contender
        self.connection, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, *args), name=name)
        self.process.start()
        child.close()  # the worker's end lives in the worker only, so its exit reads as the pipe's end
        self.started = time.perf_counter()

    def receive(self, what: str):
        import signal
        from multiprocessing.connection import wait

        wait([self.connection, self.process.sentinel])
        try:
            message = self.connection.recv() if self.connection.poll() else None
        except EOFError:
            message = None
        if message is None:  # the process ended without an answer
            self.process.join()
            code = self.process.exitcode
            died = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
            raise SystemExit(f"the {self.contender} worker (process {self.process.pid}) ended with {died} "
                             f"before answering ({what})")
        if message[0] == "error":
            raise SystemExit(f"the {self.contender} worker failed ({what}):\n{message[1]}")
        return message

    def close(self, now: bool = False) -> None:
        """Asks the worker to finish (`now`: ends it, after an error or Ctrl-C) and waits for it."""
        if not now and self.process.is_alive():
            try:
                self.connection.send(None)
            except OSError:  # it has ended already
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.connection.close()


class InWorker(Spawned):
    """A contender in its own spawned process (`worker`), asked over a pipe."""

    def __init__(self, context, contender: str, sizes: dict, args, src, folder):
        super().__init__(context, contender, worker, (contender, sizes, args, src, folder), f"bench_generate {contender}")
        self.reason = None

    def ready(self) -> None:
        _, self.reason, threads = self.receive("its model")
        note = f"skipped: {self.reason}" if self.reason else f"ready, {threads}"
        stamp(f"{self.contender} (process {self.process.pid}) {note}, {time.perf_counter() - self.started:.1f} s "
              "after its start")

    def run(self, num_beams: int) -> tuple[np.ndarray, float, float]:
        try:
            self.connection.send(num_beams)
        except OSError:  # a worker that has ended: `receive` says how
            pass
        _, result, seconds, cpu = self.receive(f"a call with {num_beams} beams")
        return result, seconds, cpu


def stamp(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
