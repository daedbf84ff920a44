"""Torch ops per generated token: impl_torch's cached step and device search against transformers'.

    OMP_NUM_THREADS=1 python benchmarks/ops_per_step.py                 # 6+6 layers, vocab 32000
    OMP_NUM_THREADS=1 python benchmarks/ops_per_step.py --layers 2 --vocab 1000

Why ops, not seconds: at batch 16 on a GPU a decoding step is launch-bound (issue 29: transformers
about 4.2 ms per step on an H100, impl_torch about 6.5 ms), so what a step costs there is the
number of torch ops it dispatches (each a Python -> ATen dispatch and, on CUDA, a kernel launch or
more), not its FLOPs. That number does not depend on the device, the batch or d_model, so it is
counted here on the CPU with `torch.profiler`, on a model with the base model's layers and
vocabulary (6+6 layers, vocab 32000: the output projection's blocks depend on V) but a small
d_model (64), so that it runs in seconds.

The same weights in both: a random `MarianMTModel` read by `conformance.convert.from_hf_marian`
(as in benchmarks/bench_generate.py, whose helpers this uses); the end and pad ids banned, so every
row runs every step. Per step = (ops of a call with `--long` new tokens - ops of one with
`--short`) / (long - short): the encoder, the start and the result cancel out.

Columns: `top-level`, the aten ops called from Python (each one dispatch from the host);
`all aten`, every aten op the profiler saw, nested ones included (a composite such as
aten::linear counts itself and its aten::addmm); `ms/step`, the wall time per step without the
profiler, median of `--repeats` (at this d_model it is nearly all host overhead, so it is a CPU
proxy for the launch-bound GPU step; on a loaded machine it moves, the counts do not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def count_ops(function) -> tuple[int, int]:
    """(top-level aten ops, all aten ops) of one call under the CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function()
    top = total = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        total += 1
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        top += parent is None
    return top, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from bench_generate import build, hf_generate, ids, marian
    from conformance.convert import from_hf_marian

    sizes = dict(vocab_size=args.vocab, d_model=args.d_model, heads=4, d_ff=2 * args.d_model,
                 layers=args.layers, max_position_embeddings=256)
    hf_model = marian(sizes, "cpu")
    config, params = from_hf_marian(hf_model)
    ours = build("torch", config, params, "cpu")
    pad, bos, eos = ids(sizes)  # Marian's ids, as bench_generate's: the pad id last, the end id 0
    banned = [eos, pad]
    src = np.random.default_rng(0).integers(2, pad, size=(args.batch, 16))  # no end or pad id in a source
    src_torch = torch.as_tensor(src)

    def call(contender: str, beams: int, new_tokens: int):
        if contender == "hf":
            return lambda: hf_generate(hf_model, src_torch, new_tokens, beams, banned)
        return lambda: ours.generate(src, new_tokens, bos, eos, num_beams=beams, banned_ids=banned)

    def seconds(function) -> float:
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            function()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    steps = args.long - args.short
    print(f"config: d_model {args.d_model}, {args.layers}+{args.layers} layers, vocab {args.vocab}, batch "
          f"{args.batch}, source 16, float32, cpu; per step = ({args.long} - {args.short} new tokens) / {steps}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"{'setting':<8} {'contender':<12} {'top-level':>10} {'all aten':>9} {'ms/step':>8}  x transformers (ops)")
    for name, beams in (("greedy", 1), ("beam 4", 4)):
        rows = {}
        for contender in ("hf", "impl_torch"):
            for new_tokens in (args.short, args.long):  # warm-up: first-call allocations and caches
                call(contender, beams, new_tokens)()
            short, long = count_ops(call(contender, beams, args.short)), count_ops(call(contender, beams, args.long))
            per_step = [(b - a) / steps for a, b in zip(short, long)]
            ms = (seconds(call(contender, beams, args.long)) - seconds(call(contender, beams, args.short))) / steps
            rows[contender] = per_step
            ratio = "" if contender == "hf" else f"{per_step[0] / rows['hf'][0]:.2f}x top-level"
            print(f"{name:<8} {contender:<12} {per_step[0]:>10.1f} {per_step[1]:>9.1f} {1e3 * ms:>8.2f}  {ratio}")


if __name__ == "__main__":
    main()
