"""Decoding speed against transformers' `generate`, and the KV cache against the plain loop.

    python benchmarks/bench_generate.py                    # base size, batch 8, 64 new tokens, CPU
    python benchmarks/bench_generate.py --quick            # a small config (a smoke run)
    python benchmarks/bench_generate.py --contenders hf,torch,jax --repeats 3
    python benchmarks/bench_generate.py --cache            # cached vs uncached, batch 1, 128 new tokens
    python benchmarks/bench_generate.py --device cuda      # torch and transformers on CUDA, JAX on its GPU
    python benchmarks/bench_generate.py --contenders hf,hf-static,ct2,ct2-int8,torch --threads 2   # issue 44's CPU run
    python benchmarks/bench_generate.py --contenders ct2,torch --threads 2 --same-process   # all in one process

The same weights everywhere: a random `MarianMTModel` (transformers) of the base size (d_model
512, 8 heads, d_ff 2048, 6+6 layers, vocab 32000, float32) is read into this project's config and
parameters by `conformance.convert.from_hf_marian` (the hf-marian layout), and every backend is
built from those. The sources (length 32, no padding) and the settings are the same for every
contender; the end token is banned, so no row stops early and every contender does the same work
(HF: `bad_words_ids=[[eos]]`, `max_length` = new tokens + 1, since it counts the start token).

Speed: greedy and beam 4, after two untimed calls of each (impl_torch records its CUDA graphs on
the second call of a shape), each contender timed in turn within every repeat (interleaved, so load
on the shared machine affects all alike), the median of the repeats reported with its ratio to
transformers' time. JAX is compiled first (one call per setting), its compile time printed apart.
The ids are compared with transformers' (float32: a near-tie could flip one; reported, not hidden).

Each contender runs in its own process (a spawned worker that builds its own copy of the same
weights and its own model, and times each call itself), as each engine runs when deployed;
CTranslate2's loads the model this process converted and never imports torch. Measured
on 2026-11-28 (2-core Xeon, torch 2.13 CPU, ctranslate2 4.8.5, `--threads 2`): in one process, once
a CTranslate2 Translator had run (and while it lived), torch's 2-thread ops slowed for good
(`torch.mm` (8, 512) x (512, 2048), 300 times, 0.034 s -> 0.074 s; impl_torch greedy at base size,
batch 8, 64 tokens, 1.30 s -> 2.15 s), and CTranslate2 beside torch was slower too (greedy 1.94 s ->
2.18 s): CTranslate2 ships its own libgomp beside torch's, two OpenMP runtimes with live thread pools
in one process (deleting the Translator undid it; with one torch thread nothing slowed, and
`OMP_WAIT_POLICY=PASSIVE` gave torch the slow numbers from the start). `--same-process` builds every
contender in this one process, the earlier arrangement, to reproduce that interference; the table's
header says which arrangement ran. Either way each timed call starts after a rest (`SETTLE`), once
the threads of the contender before it have stopped spinning.

Contenders (`--contenders`, comma-separated):

    hf          transformers' `generate`, eager, its default dynamic cache
    hf-static   transformers' documented fast path: `cache_implementation="static"` with its forward
                compiled by `generate` itself (`compile_config=CompileConfig(...)`: on CUDA
                `mode="reduce-overhead", fullgraph=True`, CUDA graphs; on the CPU the default mode,
                which `generate` compiles there only when told to, `_compile_all_devices`)
    ct2         CTranslate2 float32 on a model converted from the same weights
                (`conformance.check.ctranslate2_check.convert`, what `rosetta convert --to ctranslate2`
                runs); float16 on CUDA
    ct2-int8    the same model quantized to int8 (int8_float16 on CUDA): not the same arithmetic,
                reported apart, its ids compared all the same
    torch, jax, numpy   this project's backends

Every contender's first call (its compile, where it has one) is timed and printed apart. Token ids
follow Marian's released checkpoints: the pad id is the last (V - 1), with a zero embedding row, and
the decoder starts from it; the end id is 0. The end and pad ids are banned everywhere
(CTranslate2: `min_decoding_length` = `max_decoding_length` = new tokens, and its vocabulary has no
pad), so every row runs all its steps.

Cache (`--cache`): greedy at batch 1 for 128 new tokens, `use_cache=True` against
`use_cache=False` (the whole decoder over the whole prefix per token), per backend, interleaved.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from conformance.check.compare import to_numpy

BASE = dict(vocab_size=32000, d_model=512, heads=8, d_ff=2048, layers=6, max_position_embeddings=512)
QUICK = dict(vocab_size=1000, d_model=64, heads=4, d_ff=128, layers=2, max_position_embeddings=256)
EOS = 0  # Marian's; its pad id is the last (V - 1) and the decoder starts from it: `ids(sizes)`
# Seconds of rest before each timed call: the OpenMP threads of the contender that ran last spin on
# after its call (torch's libgomp, about 20-30 ms measured here), and a call started at once shares
# the cores with them (CTranslate2 after impl_torch, --quick, 2 threads: 0.09-0.21 s against 0.025 s).
SETTLE = 0.1


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
        from conformance.check.ctranslate2_check import convert

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
    import impl_jax

    return impl_jax.Model(config, params, "float32", device="gpu" if device == "cuda" else device)


def timed(function):
    """(result as a host array, seconds), waiting for the device to finish."""
    started = time.perf_counter()
    result = to_numpy(function())  # a host copy: torch's and JAX's queues drained
    return result, time.perf_counter() - started


def machine(device: str) -> str:
    import torch

    line = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.2f} (shared: numbers move with the load); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if device == "cuda":
        line += f"; device {torch.cuda.get_device_name()}"
    return line


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

    def run(self, num_beams: int) -> tuple[np.ndarray, float]:
        return timed(lambda: self.decode(num_beams))

    def close(self, now: bool = False) -> None:
        self.decode = None  # a Translator's threads end with it


def worker(connection, contender: str, sizes: dict, args, src: np.ndarray, folder) -> None:
    """A contender's process: its own copy of the weights and its own model, then one timed call per
    beam count received, answered with (ids, seconds), until None (or the parent is gone).

    CTranslate2's worker loads the model the parent converted into `folder` and never imports torch:
    deployed, CTranslate2 runs without torch's OpenMP runtime beside its own (with torch loaded to
    build the weights, its greedy and beam-4 calls took about 5% longer here)."""
    import signal
    import sys
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent too, which ends its workers
    try:
        if contender.startswith("ct2"):
            threads = args.threads or os.cpu_count()
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
            connection.send(("ran",) + timed(lambda: decode(num_beams)))
    except Exception:
        connection.send(("error", traceback.format_exc()))


class InWorker:
    """A contender in its own spawned process (`worker`), asked over a pipe."""

    def __init__(self, context, contender: str, sizes: dict, args, src, folder):
        self.contender = contender
        self.connection, child = context.Pipe()
        self.process = context.Process(target=worker, args=(child, contender, sizes, args, src, folder),
                                       name=f"bench_generate {contender}")
        self.process.start()
        child.close()  # the worker's end lives in the worker only, so its exit reads as the pipe's end
        self.reason, self.started = None, time.perf_counter()

    def ready(self) -> None:
        _, self.reason, threads = self.receive("its model")
        note = f"skipped: {self.reason}" if self.reason else f"ready, {threads}"
        stamp(f"{self.contender} (process {self.process.pid}) {note}, {time.perf_counter() - self.started:.1f} s "
              "after its start")

    def run(self, num_beams: int) -> tuple[np.ndarray, float]:
        try:
            self.connection.send(num_beams)
        except OSError:  # a worker that has ended: `receive` says how
            pass
        _, result, seconds = self.receive(f"a call with {num_beams} beams")
        return result, seconds

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


def speed(args, sizes, hf_model, config, params) -> None:
    import multiprocessing
    import tempfile
    from pathlib import Path

    pad = ids(sizes)[0]
    chosen = [c for c in args.contenders.split(",") if c]
    if unknown := set(chosen) - set(CONTENDERS):
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    rng = np.random.default_rng(0)
    src = rng.integers(2, pad, size=(args.batch, args.src_len))  # no end or pad id in a source
    settings = [("greedy", 1), ("beam 4", 4)]
    arrangement = "all contenders in one process" if args.same_process else "each contender in its own process"
    stamp(f"arrangement: {arrangement}")
    scratch = tempfile.TemporaryDirectory(prefix="bench-generate-ct2-")
    folder = Path(scratch.name) / "model"  # CTranslate2 converted into it once (here, or by --same-process's first ct2)
    contenders, failed = {}, True
    try:
        if args.same_process:
            hf_model.to(args.device)
            for contender in chosen:
                contenders[contender] = InProcess(contender, args, sizes, src, hf_model, config, params, folder)
        else:
            context = multiprocessing.get_context("spawn")  # a fresh interpreter: no thread pool inherited
            if any(c.startswith("ct2") and not ct2_unavailable(args.device, ct2_compute_type(c, args.device))
                   for c in chosen):
                from conformance.check.ctranslate2_check import convert

                convert(config, params, folder)  # here, once: CTranslate2's workers only load it
            for contender in chosen:
                contenders[contender] = InWorker(context, contender, sizes, args, src, folder)
            for contender in chosen:
                contenders[contender].ready()
        skipped = {c: contenders[c].reason for c in chosen if contenders[c].reason}
        chosen = [c for c in chosen if c not in skipped]
        first, times, out = schedule(args, chosen, settings, contenders)
        failed = False
    finally:
        for contender in contenders.values():
            contender.close(now=failed)
        scratch.cleanup()
    reference = "hf-static" if args.reference == "hf-static" and "hf-static" in chosen else (
        "ct2" if args.reference == "ct2" and "ct2" in chosen else ("hf" if "hf" in chosen else chosen[0]))
    n_tokens = args.batch * args.new_tokens
    print(f"\nbatch {args.batch}, source {args.src_len}, {args.new_tokens} new tokens, float32 (ct2 on CUDA: "
          f"float16), {args.device}; {arrangement}; median of {args.repeats} interleaved repeats; load average "
          f"{os.getloadavg()[0]:.2f}; ratios are medians of per-repeat ratios to {reference}")
    print(f"{'setting':<8} {'contender':<10} {'seconds':>8} {'tok/s':>8} {'x ' + reference:>12} {'x hf':>7} "
          f"{'first call s':>13}  ids")
    for name, _ in settings:
        for contender in chosen:
            seconds = statistics.median(times[contender, name])

            def ratio(to):
                if to not in chosen:
                    return "-"
                return f"{statistics.median(a / b for a, b in zip(times[contender, name], times[to, name])):.2f}x"

            print(f"{name:<8} {contender:<10} {seconds:>8.3f} {n_tokens / seconds:>8.1f} {ratio(reference):>12} "
                  f"{ratio('hf'):>7} {first[contender, name]:>13.1f}  {agreement(out, chosen, contender, name)}")
    for contender, reason in skipped.items():
        print(f"{contender:<10} skipped: {reason}")
    print("\ntargets (issue 44): impl_torch greedy and beam 4 <= 1.0x CTranslate2 float32 (CPU) and <= 1.0x "
          "transformers' compiled static-cache generate (GPU)")


def schedule(args, chosen: list[str], settings, contenders: dict):
    """First calls (timed apart), second untimed calls, then the interleaved repeats: (first, times, ids)."""
    # The first call of each contender and setting, timed apart: the compile of JAX and of the
    # compiled transformers step, and every contender's allocation and kernel selection.
    first = {}
    for name, beams in settings:
        for contender in chosen:
            time.sleep(SETTLE)
            _, first[contender, name] = contenders[contender].run(beams)
            stamp(f"first call {contender} {name}: {first[contender, name]:.1f} s")
    # A second untimed call: impl_torch on CUDA records its CUDA graphs on the second call of a shape
    # (impl_torch/graphs.py), transformers' reduce-overhead records its own then.
    for name, beams in settings:
        for contender in chosen:
            contenders[contender].run(beams)
    times = {(c, name): [] for c in chosen for name, _ in settings}
    out = {}
    for r in range(args.repeats):
        for name, beams in settings:
            order = chosen[r % len(chosen):] + chosen[: r % len(chosen)]
            for contender in order:
                time.sleep(SETTLE)
                out[contender, name], seconds = contenders[contender].run(beams)
                times[contender, name].append(seconds)
            stamp(f"repeat {r + 1}, {name}: " + ", ".join(f"{c} {times[c, name][-1]:.3f} s" for c in chosen))
    return first, times, out


def agreement(out: dict, chosen: list[str], contender: str, name: str) -> str:
    """Rows whose ids equal each other contender's ("8/8 vs hf"); float32 near-ties may flip one."""
    parts = []
    for other in chosen:
        if other == contender:
            continue
        a, b = out[contender, name], out[other, name]
        same = int((a == b).all(1).sum()) if a.shape == b.shape else 0
        parts.append(f"{same}/{a.shape[0]} {other}")
    return "same rows: " + ", ".join(parts)


def stamp(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


CONTENDERS = ("hf", "hf-static", "ct2", "ct2-int8", "torch", "jax", "numpy")


def cache(args, sizes, config, params) -> None:
    chosen = [c for c in args.contenders.split(",") if c in ("torch", "jax", "numpy")]
    pad, bos, eos = ids(sizes)
    rng = np.random.default_rng(1)
    src = rng.integers(2, pad, size=(1, args.src_len))
    new_tokens = args.cache_tokens
    models = {}
    for contender in chosen:
        models[contender] = build(contender, config, params, args.device)
        if contender == "jax":  # the uncached JAX loop compiles per prefix length without buckets
            import impl_jax

            models[contender, "uncached"] = impl_jax.Model(config, params, "float32", buckets=(32, 64, 128))
    for contender in chosen:  # warm-up: JAX compiles, torch allocates (and records its CUDA graphs on a second call)
        for _ in range(2):
            models[contender].generate(src, new_tokens, bos, eos, banned_ids=[eos, pad])
        models.get((contender, "uncached"), models[contender]).generate(src, new_tokens, bos, eos,
                                                                       banned_ids=[eos, pad], use_cache=False)
    times = {(c, mode): [] for c in chosen for mode in ("cached", "uncached")}
    for _ in range(args.repeats):
        for contender in chosen:
            for mode in ("cached", "uncached"):
                model = models.get((contender, mode), models[contender])
                _, seconds = timed(lambda: model.generate(src, new_tokens, bos, eos, banned_ids=[eos, pad],
                                                          use_cache=mode == "cached"))
                times[contender, mode].append(seconds)
    print(f"\ncache: batch 1, source {args.src_len}, {new_tokens} new tokens, greedy, float32, {args.device}; "
          f"median of {args.repeats} interleaved repeats")
    print(f"{'backend':<8} {'cached s':>9} {'uncached s':>11} {'uncached/cached':>16}")
    for contender in chosen:
        cached_s = statistics.median(times[contender, "cached"])
        uncached_s = statistics.median(times[contender, "uncached"])
        print(f"{contender:<8} {cached_s:>9.3f} {uncached_s:>11.3f} {uncached_s / cached_s:>15.1f}x")
    print("\ntarget (issue 29): cached >= 5x faster than uncached at batch 1 for 128 new tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config")
    parser.add_argument("--contenders", default="hf,torch,jax",
                        help=f"comma-separated, of {', '.join(CONTENDERS)} (default hf,torch,jax)")
    parser.add_argument("--reference", default="hf", choices=("hf", "hf-static", "ct2"),
                        help="the contender the main ratio column is to (hf when the chosen one is not run)")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (and CTranslate2's); default torch's")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--same-process", action="store_true",
                        help="every contender in this one process (the earlier arrangement: two OpenMP runtimes "
                             "interfere), instead of each in its own")
    parser.add_argument("--cache", action="store_true", help="cached against uncached instead (batch 1)")
    parser.add_argument("--cache-tokens", type=int, default=128)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "run on a machine with a GPU, or leave --device out for the CPU")
    from conformance.convert import from_hf_marian

    sizes = QUICK if args.quick else BASE
    hf_model = marian(sizes, "cpu")  # moved to the device by `--same-process` only; the workers build their own
    config, params = from_hf_marian(hf_model)
    print(f"config: d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, "
          f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, vocab {config.tgt_vocab_size} "
          "(a random MarianMTModel, read by from_hf_marian)")
    print(machine(args.device))
    if args.cache:
        cache(args, sizes, config, params)
    else:
        speed(args, sizes, hf_model, config, params)


if __name__ == "__main__":
    main()
