"""Where a decoding step's time goes in impl_torch's `generate` on this CPU: per step, the decoder's
products, the output projection, attention, the rest of the step, the search, and the dispatch
overhead (issue 57).

    python benchmarks/step_profile.py --threads 1
    python benchmarks/step_profile.py --threads 2 --tokens 32
    ROSETTA_TORCH_PACKED_STEP=0 python benchmarks/step_profile.py --threads 1   # MKL's products
    PYTHONPATH=/path/to/an/older/tree python benchmarks/step_profile.py           # that tree's impl_torch

The weights and the call are `bench_generate.py`'s: a random base-size MarianMTModel read by
`conformance.convert.from_hf_marian`, batch 8, source 32, the end and pad ids banned so that every
row runs every step, float32, greedy and beam 4.

Two measurements per setting:

- wall (and cpu, the process's CPU time, every thread's): `generate` with `--tokens` new tokens
  and with `--short`, without the profiler, the fastest of `--repeats` (other work on a shared
  machine only ever adds time); per step = (long - short) / (tokens - short), so the encoder and
  the start cancel;
- by op: `generate` of `--tokens` under `torch.profiler` (CPU), the quickest of `--profiles`
  calls, each top-level op's time on
  the calling thread (with 2 threads, the op's span while its OpenMP team works) sorted into the
  step's parts by where it ran (`decode.advance`: the step; `decode.reorder_cache`: beam search's
  reorder; `generate`'s own ops: the search) and, inside the step, by op and shape: the output
  projection (any op on V-wide rows: the product, its biases), the decoder's products (addmm, mm,
  oneDNN's linear), attention (the fused kernel), the rest (LayerNorm, activations, adds, views,
  the cache writes). Per step = the run's total over its steps. The encoder and `start_cache` are
  printed apart, once per call.

dispatch = wall per step - (step + reorder + search ops per step): the host's time between ops
(Python, the dispatcher, module calls), where no op runs. The profiler adds its own time to each
op, so the op columns are a little high and dispatch a little low; the shares are what to read.
A shared machine moves every number: the load average is printed, and only columns of one run compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PARTS = ("gemm", "output", "attention", "step other", "reorder", "search")


def machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/cpuinfo") as info:
            avx512 = " avx512f" in info.read()
    except OSError:
        avx512 = None
    return f"{model}, AVX-512 {'yes' if avx512 else 'no' if avx512 is not None else '?'}, {os.cpu_count()} cores"


def classify(event) -> str | None:
    """The part of a step an op (a profiler event, top-level among aten/oneDNN ops) belongs to."""
    where, parent = None, event.cpu_parent
    while parent is not None:
        if parent.name in ("encode", "start_cache", "output", "step", "reorder"):
            where = parent.name
            break
        parent = parent.cpu_parent
    if where in ("encode", "start_cache", "output", "reorder"):
        return where
    if where is None:
        return "search"
    name = event.name
    if name in ("aten::addmm", "aten::mm", "aten::linear", "mkldnn::_linear_pointwise", "aten::matmul", "mkl::_mkl_linear"):
        return "gemm"
    if "scaled_dot_product" in name:
        return "attention"
    return "step other"


def by_part(prof) -> dict[str, float]:
    """Milliseconds per part (`PARTS`, and the encoder and start_cache) of one profiled call: each
    top-level op (not nested in another op) by where it ran."""
    totals = dict.fromkeys(PARTS + ("encode", "start_cache"), 0.0)
    ops = ("aten::", "mkldnn::", "mkl::")
    for event in prof.events():
        if not event.name.startswith(ops):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(ops):
            parent = parent.cpu_parent
        if parent is None:  # an op nested inside another is counted in it
            totals[classify(event)] += event.cpu_time_total / 1e3
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--profiles", type=int, default=2, help="profiled calls, the quickest kept")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(args.threads)
    import impl_torch
    from conformance.convert import from_hf_marian
    from generate_contenders import BASE, ids, marian

    decode = impl_torch.decode  # loaded with the backend (model.py imports it)
    packed = getattr(impl_torch, "packed", None)  # None in a tree from before issue 57

    hf = marian(BASE, "cpu")
    config, params = from_hf_marian(hf)
    del hf
    model = impl_torch.Model(config, params, "float32")
    pad, bos, eos = ids(BASE)
    src = np.random.default_rng(0).integers(2, pad, size=(8, 32))

    def ranged(name, function):
        def run(*a, **k):
            with record_function(name):
                return function(*a, **k)
        return run

    decode.advance = ranged("step", decode.advance)
    decode.start_cache = ranged("start_cache", decode.start_cache)
    decode.reorder_cache = ranged("reorder", decode.reorder_cache)
    model.encode = ranged("encode", model.encode)
    model.logits = ranged("output", model.logits)  # the step's output projection and its biases

    def call(beams: int, tokens: int):
        return model.generate(src, tokens, bos, eos, num_beams=beams, banned_ids=[eos, pad])

    state = "absent (a tree from before issue 57)" if packed is None else (
        "on" if packed.ENABLED else "off (ROSETTA_TORCH_PACKED_STEP=0)")
    print(f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; impl_torch from "
          f"{os.path.dirname(impl_torch.__file__)}, packed products {state}; load average {os.getloadavg()[0]:.2f}")
    print(f"base Marian (random), batch 8, source 32, float32; wall and cpu: ({args.tokens} - {args.short} new tokens) "
          f"/ {args.tokens - args.short}, fastest of {args.repeats}; ops: one profiled call of {args.tokens} tokens")
    print(f"{'setting':<8} {'wall ms/step':>12} {'cpu ms/step':>11} " + " ".join(f"{p:>10}" for p in PARTS)
          + f" {'dispatch':>9} {'encoder ms':>11} {'start ms':>9}")
    for beams in (int(b) for b in args.beams.split(",")):
        for tokens in (args.short, args.tokens):
            call(beams, tokens)  # warm-up: allocations, packing
        walls, cpus = {}, {}
        for tokens in (args.short, args.tokens):
            times, cpu = [], []
            for _ in range(args.repeats):
                started, cpu_started = time.perf_counter(), time.process_time()
                call(beams, tokens)
                times.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)
            walls[tokens], cpus[tokens] = min(times), min(cpu)  # other work only ever adds time
        wall = (walls[args.tokens] - walls[args.short]) / (args.tokens - args.short)
        cpu = (cpus[args.tokens] - cpus[args.short]) / (args.tokens - args.short)
        totals = None
        for _ in range(args.profiles):  # the quickest profiled call: other work only ever adds time
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                call(beams, args.tokens)
            run = by_part(prof)
            if totals is None or sum(run.values()) < sum(totals.values()):
                totals = run
        per_step = {p: totals[p] / args.tokens for p in PARTS}
        dispatch = 1e3 * wall - sum(per_step.values())
        name = "greedy" if beams == 1 else f"beam {beams}"
        print(f"{name:<8} {1e3 * wall:>12.2f} {1e3 * cpu:>11.2f} " + " ".join(f"{per_step[p]:>10.2f}" for p in PARTS)
              + f" {dispatch:>9.2f} {totals['encode']:>11.1f} {totals['start_cache']:>9.1f}")


if __name__ == "__main__":
    main()
