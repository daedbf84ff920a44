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

Beside each wall time, the CPU time of the contender's process during the call (every thread's,
`timed_cpu`), with its own ratio column: on a machine that other work shares, a call's wall time
includes the time its threads waited for a core, its CPU time does not. With one thread the CPU time
is the call's work; with two it also counts the time an OpenMP runtime's idle threads spin (both
torch's and CTranslate2's do), and with `--same-process` every contender's threads in the process.

Each contender runs in its own spawned process by default, `--same-process` builds every contender
in this one process (the earlier arrangement, plus the rest below); why, with the OpenMP interference measured on
2026-11-28: `generate_contenders`' docstring. The table's header says which arrangement ran. Either
way each timed call starts after a rest (`SETTLE`), once the threads of the contender before it
have stopped spinning.

Contenders (`--contenders`, comma-separated):

    hf          transformers' `generate`, eager, its default dynamic cache
    hf-static   transformers' documented fast path: `cache_implementation="static"` with its forward
                compiled by `generate` itself (`compile_config=CompileConfig(...)`: on CUDA
                `mode="reduce-overhead", fullgraph=True`, CUDA graphs; on the CPU the default mode,
                which `generate` compiles there only when told to, `_compile_all_devices`)
    ct2         CTranslate2 float32 on a model converted from the same weights
                (`conformance.check.ctranslate2.target.convert`, what `rosetta convert --to ctranslate2`
                runs); float16 on CUDA
    ct2-int8    the same model quantized to int8 (int8_float16 on CUDA): not the same arithmetic,
                reported apart, its ids compared all the same
    torch, jax, numpy   this project's backends
    torch-int8  impl_torch with its encoder's and decoder's Linears quantised by torch.ao's dynamic
                int8 quantisation (`generate_contenders.int8_linears`), the pair of ct2-int8: not the
                float32 arithmetic, reported apart, its ids compared all the same (CPU only)

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

# The contenders and where they run, re-exported: tests and ops_per_step.py import them from here.
from generate_contenders import (BASE, EOS, QUICK, InProcess, InWorker, build, ct2_compute_type, ct2_generate,
                                 ct2_translator, ct2_unavailable, decoder, hf_generate, ids, marian, stamp,
                                 timed, timed_cpu, worker)

__all__ = ["BASE", "EOS", "QUICK", "InProcess", "InWorker", "build", "ct2_compute_type", "ct2_generate",
           "ct2_translator", "ct2_unavailable", "decoder", "hf_generate", "ids", "marian", "stamp", "timed",
           "timed_cpu", "worker", "SETTLE", "CONTENDERS", "machine", "speed", "schedule", "agreement", "cache", "main"]

# Seconds of rest before each timed call: the OpenMP threads of the contender that ran last spin on
# after its call (torch's libgomp, about 20-30 ms measured here), and a call started at once shares
# the cores with them (CTranslate2 after impl_torch, --quick, 2 threads: 0.09-0.21 s against 0.025 s).
SETTLE = 0.1


def machine(device: str) -> str:
    import torch

    line = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.2f} (shared: numbers move with the load); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if device == "cuda":
        line += f"; device {torch.cuda.get_device_name()}"
    return line


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
                from conformance.check.ctranslate2.target import convert

                convert(config, params, folder)  # here, once: CTranslate2's workers only load it
            for contender in chosen:
                contenders[contender] = InWorker(context, contender, sizes, args, src, folder)
            for contender in chosen:
                contenders[contender].ready()
        skipped = {c: contenders[c].reason for c in chosen if contenders[c].reason}
        chosen = [c for c in chosen if c not in skipped]
        first, times, cpu, out = schedule(args, chosen, settings, contenders)
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
          f"{'cpu s':>7} {'cpu x ' + reference:>12} {'first call s':>13}  ids")
    for name, _ in settings:
        for contender in chosen:
            seconds = statistics.median(times[contender, name])

            def ratio(to, table=times):
                if to not in chosen:
                    return "-"
                return f"{statistics.median(a / b for a, b in zip(table[contender, name], table[to, name])):.2f}x"

            print(f"{name:<8} {contender:<10} {seconds:>8.3f} {n_tokens / seconds:>8.1f} {ratio(reference):>12} "
                  f"{ratio('hf'):>7} {statistics.median(cpu[contender, name]):>7.3f} {ratio(reference, cpu):>12} "
                  f"{first[contender, name]:>13.1f}  {agreement(out, chosen, contender, name)}")
    for contender, reason in skipped.items():
        print(f"{contender:<10} skipped: {reason}")
    print("\ntargets (issues 44, 57): impl_torch greedy and beam 4 <= 1.0x CTranslate2 float32 (CPU, at --threads 1 "
          "and 2, ids equal) and <= 1.0x transformers' compiled static-cache generate (GPU)")


def schedule(args, chosen: list[str], settings, contenders: dict):
    """First calls (timed apart), second untimed calls, then the interleaved repeats: (first, times,
    CPU times, ids)."""
    # The first call of each contender and setting, timed apart: the compile of JAX and of the
    # compiled transformers step, and every contender's allocation and kernel selection.
    first = {}
    for name, beams in settings:
        for contender in chosen:
            time.sleep(SETTLE)
            _, first[contender, name], _ = contenders[contender].run(beams)
            stamp(f"first call {contender} {name}: {first[contender, name]:.1f} s")
    # A second untimed call: impl_torch on CUDA records its CUDA graphs on the second call of a shape
    # (impl_torch/graphs.py), transformers' reduce-overhead records its own then.
    for name, beams in settings:
        for contender in chosen:
            contenders[contender].run(beams)
    times = {(c, name): [] for c in chosen for name, _ in settings}
    cpu = {(c, name): [] for c in chosen for name, _ in settings}
    out = {}
    for r in range(args.repeats):
        for name, beams in settings:
            order = chosen[r % len(chosen):] + chosen[: r % len(chosen)]
            for contender in order:
                time.sleep(SETTLE)
                out[contender, name], seconds, cpu_seconds = contenders[contender].run(beams)
                times[contender, name].append(seconds)
                cpu[contender, name].append(cpu_seconds)
            stamp(f"repeat {r + 1}, {name}: " + ", ".join(f"{c} {times[c, name][-1]:.3f} s" for c in chosen))
    return first, times, cpu, out


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


CONTENDERS = ("hf", "hf-static", "ct2", "ct2-int8", "torch", "torch-int8", "jax", "numpy")


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
    args.threads = torch.get_num_threads()  # every worker's (CTranslate2's intra-op threads too): this process's
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
