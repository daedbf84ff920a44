"""Whisper decoding speed: impl_torch's `generate` beside transformers' and faster-whisper's engine.

    python benchmarks/bench_whisper.py                    # whisper-base sizes, batch 4, 64 new tokens, 2 threads
    python benchmarks/bench_whisper.py --quick            # a small config (a smoke run)
    python benchmarks/bench_whisper.py --repeats 5 --threads 2

The same weights everywhere: a random float32 `WhisperForConditionalGeneration` of openai/whisper-base's
sizes (d_model 512, 8 heads, 6 + 6 layers, d_ff 2048, 80 mel bins, a 3000-frame window, 51865 ids),
every weight jittered off transformers' initialisation, read into this project's config and
parameters by `conformance.convert.from_hf`; CTranslate2 (faster-whisper's engine,
`ctranslate2.models.Whisper`, float32) runs the model `rosetta convert --to ctranslate2` writes of
them. The same input for each: a whole window of standard-normal features per row, the decoder
started from <|startoftranscript|> <|notimestamps|>, greedy, the end of text suppressed so every row
runs every step (`whisper_contenders`' docstring says how each engine is told). Each call is the
whole `generate`: the encoder on the window, then the decoding steps.

Speed: each contender in its own spawned process (`whisper_contenders`; torch and CTranslate2 in
one process slow each other), its first call timed apart (the warm-up: on the CPU nothing is
recorded on a second call, as CUDA graphs are in bench_generate.py), then the repeats
interleaved (each repeat starts with the next contender, so load on the shared machine falls on all
alike), the median of the repeats reported with its ratio to transformers' time (the median of the
per-repeat ratios). The ids are compared with transformers' (float32: a near-tie could flip one;
reported, not hidden). The machine's load average is printed before and after.

Target (issue 54): impl_torch <= 1.0x transformers; CTranslate2's ratio as measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # whisper_contenders, found by the spawned workers too

from whisper_contenders import BASE, CONTENDERS, NAMES, QUICK, InWorker, stamp, whisper  # noqa: E402

SETTLE = 0.1  # seconds of rest before each timed call: the last contender's OpenMP threads stop spinning


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"of {', '.join(CONTENDERS)}")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine (default 2)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    chosen = [c for c in args.contenders.split(",") if c]
    if unknown := set(chosen) - set(CONTENDERS):
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    import multiprocessing

    import torch

    from conformance.convert import from_hf

    sizes = QUICK if args.quick else BASE
    print(f"sizes: {sizes}")
    print(f"machine: {platform.processor() or platform.machine()}, {load()} at the start; torch {torch.__version__}, "
          f"{args.threads} threads per engine")
    scratch = tempfile.TemporaryDirectory(prefix="bench-whisper-ct2-")
    folder = Path(scratch.name) / "model"
    if "ct2" in chosen:  # converted here, once; the CTranslate2 worker only loads it
        from conformance.check.ctranslate2.target import convert

        started = time.perf_counter()
        config, params = from_hf(whisper(sizes))
        convert(config, params, folder, verify=False)  # the ids below are compared with transformers' anyway
        del config, params
        stamp(f"converted to CTranslate2 in {time.perf_counter() - started:.1f} s")
    context = multiprocessing.get_context("spawn")
    workers, failed = {}, True
    try:
        for contender in chosen:
            workers[contender] = InWorker(context, contender, sizes, args.batch, args.new_tokens, args.threads, folder)
        for contender in chosen:
            stamp(f"{contender}: {workers[contender].ready()}")
        first = {}
        for contender in chosen:
            time.sleep(SETTLE)
            _, first[contender] = workers[contender].run()
            stamp(f"first call {contender}: {first[contender]:.2f} s")
        times = {c: [] for c in chosen}
        ids = {}
        for r in range(args.repeats):
            for contender in chosen[r % len(chosen):] + chosen[:r % len(chosen)]:
                time.sleep(SETTLE)
                ids[contender], seconds = workers[contender].run()
                times[contender].append(seconds)
            stamp(f"repeat {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in chosen))
        failed = False
    finally:
        for worker in workers.values():
            worker.close(now=failed)
        scratch.cleanup()
    reference = "hf" if "hf" in chosen else chosen[0]
    n_tokens = args.batch * args.new_tokens
    print(f"\nbatch {args.batch}, {2 * sizes['max_source_positions']} frames, {args.new_tokens} new tokens, greedy, "
          f"float32, cpu, {args.threads} threads; each contender in its own process; median of {args.repeats} "
          f"interleaved repeats; {load()} at the end")
    for contender in chosen:
        print(f"  {contender:<6} {NAMES[contender]}")
    print(f"{'contender':<10} {'seconds':>8} {'tok/s':>8} {'x ' + reference:>9} {'first call s':>13}  ids")
    for contender in chosen:
        seconds = statistics.median(times[contender])
        ratio = statistics.median(a / b for a, b in zip(times[contender], times[reference]))
        same = [f"{int((ids[contender] == ids[o]).all(1).sum()) if ids[contender].shape == ids[o].shape else 0}/"
                f"{args.batch} rows equal {o}'s" for o in chosen if o != contender]
        print(f"{contender:<10} {seconds:>8.3f} {n_tokens / seconds:>8.1f} {ratio:>8.2f}x {first[contender]:>13.2f}  "
              + ", ".join(same))
    print("\ntarget (issue 54): impl_torch <= 1.0x transformers; CTranslate2 (faster-whisper's engine, float32) "
          "as measured")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
