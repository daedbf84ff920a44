"""impl_jax's host work per call: flattening the model and transferring the NumPy inputs, each way.

    python benchmarks/bench_jax_host.py             # 6+6 layers at d_model 32: the host's part dominates
    python benchmarks/bench_jax_host.py --base      # the base config (d_model 512, vocab 32000)
    python benchmarks/bench_jax_host.py --rounds 6 --calls 40
    python benchmarks/bench_jax_host.py --only forward --batch 32 --length 128   # issue 44's GPU sizes

Each compiled call hands the model to jit; `impl_jax.flat` keeps its flattening between calls and
checks that nothing it read has changed (issue 28: on a GPU the host prepares a call while the
device waits), and the NumPy ids and masks go to jit as they are, which transfers them in C++,
instead of one `jax.device_put` each first (`impl_jax.compiled.HOST_ARRAYS_TO_JIT`, issue 44).
One process, three settings alternating for `--rounds` rounds: flattened every call with
device_put first, the kept record with device_put first, the kept record with the inputs to jit
(the default). Each is the median of `--calls` calls waited for (`block_until_ready`), and of the
calling thread's CPU time until the call returned (`time.thread_time`: the host's part, which the
machine's other load inflates far less than wall time). The calls: a forward
(`model(src, tgt, return_attention=False)`, two executables), a greedy `generate` of 8 tokens (a
cached decoding step per token) and a fused training step (`impl_jax.train_step` with
`impl_jax.Adam`). The forward of a plain linen copy of Flax `examples/wmt` (tests/systems/flax_wmt.py:
one jitted `apply`) at the same sizes runs in the same rounds, for reference. The 6+6-layer default
has the base model's structure (the same modules and variables to flatten) at a width where the
device work is small, which is the host's share of a GPU call; the ratios are per round, against
the first setting, with their range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import impl_jax  # noqa: E402
from conformance import init_params, preset  # noqa: E402


SETTINGS = {  # (impl_jax.flat.KEEP, impl_jax.compiled.HOST_ARRAYS_TO_JIT)
    "flattened, device_put": (False, False),
    "kept, device_put": (True, False),
    "kept, to jit": (True, True),
}


def main() -> None:
    flat, compiled = impl_jax.flat, impl_jax.compiled  # loaded with the backend
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", action="store_true", help="the base config instead of the narrow one")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--batch", type=int, help="default 8 with --base, else 2")
    parser.add_argument("--length", type=int, help="source and target lengths: default 64 with --base, else 8")
    parser.add_argument("--only", choices=("forward", "generate", "step"), action="append",
                        help="time only these calls (repeatable; default: all three)")
    args = parser.parse_args()
    sizes = dict(d_model=512, n_heads=8, d_ff=2048, src_vocab_size=32000, tgt_vocab_size=32000) if args.base else \
        dict(d_model=32, n_heads=4, d_ff=64, src_vocab_size=1000, tgt_vocab_size=1000)
    batch, length = args.batch or (8 if args.base else 2), args.length or (64 if args.base else 8)
    config = preset("flax-wmt", n_encoder_layers=6, n_decoder_layers=6, max_len=max(256, length), **sizes)
    model = impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32), dtype="float32")
    optimizer = impl_jax.Adam(model, config.d_model)
    rng = np.random.default_rng(0)
    src = rng.integers(3, config.src_vocab_size, size=(batch, length)).astype(np.int32)
    tgt = rng.integers(3, config.tgt_vocab_size, size=(batch, length)).astype(np.int32)
    src[0, length // 2:] = config.pad_id  # a padded row: the masks take part
    tgt[0, length // 2:] = config.pad_id
    labels = np.roll(tgt, -1, axis=1)
    entries = {
        "forward": lambda: model(src, tgt, return_attention=False).logits,
        "generate (8 tokens)": lambda: model.generate(src, max_len=9, bos_id=2, eos_id=config.tgt_vocab_size - 1),
        "training step": lambda: impl_jax.train_step(model, optimizer, src, tgt, labels),
    }
    if args.only:  # "forward", "generate", "step": a word of the entry's name
        entries = {name: run for name, run in entries.items() if set(name.split()) & set(args.only)}
    linen = linen_forward(config, src, tgt)
    for keep, to_jit in SETTINGS.values():  # compiles (each setting's argument kinds), and records the model
        flat.KEEP, compiled.HOST_ARRAYS_TO_JIT = keep, to_jit
        for run in entries.values():
            jax.block_until_ready(run()), jax.block_until_ready(run())
    jax.block_until_ready(linen()), jax.block_until_ready(linen())
    times = {name: {s: [] for s in SETTINGS} for name in entries}
    host = {name: {s: [] for s in SETTINGS} for name in entries}
    linen_times, linen_host = [], []
    for _ in range(args.rounds):
        for setting, (keep, to_jit) in SETTINGS.items():
            flat.KEEP, compiled.HOST_ARRAYS_TO_JIT = keep, to_jit
            for name, run in entries.items():
                each, cpu = timed(run, args.calls)
                times[name][setting].append(each)
                host[name][setting].append(cpu)
        each, cpu = timed(linen, args.calls)
        linen_times.append(each)
        linen_host.append(cpu)
    flat.KEEP, compiled.HOST_ARRAYS_TO_JIT = True, True
    print(f"impl_jax, d_model {config.d_model}, 6+6 layers, batch {batch}, lengths {length}, float32, "
          f"on {jax.devices()[0]}; medians of {args.calls} calls, {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':<22}{'':<24}{'each call':>12}{'host CPU':>12}{'host ratio (range)':>24}")
    first = next(iter(SETTINGS))
    for name in entries:
        for setting in SETTINGS:
            ratios = [on / off for off, on in zip(host[name][first], host[name][setting])]
            print(f"{name:<22}{setting:<24}{statistics.median(times[name][setting]) * 1e3:>9.2f} ms"
                  f"{statistics.median(host[name][setting]) * 1e3:>9.2f} ms"
                  f"{statistics.median(ratios):>13.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"{'forward, wmt linen':<46}{statistics.median(linen_times) * 1e3:>9.2f} ms"
          f"{statistics.median(linen_host) * 1e3:>9.2f} ms")


def timed(run, calls: int) -> tuple[float, float]:
    """The median wall time of `calls` calls waited for, and of the calling thread's CPU time until
    each returned (JAX runs the device work asynchronously: the host's part)."""
    each, cpu = [], []
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = run()
        cpu.append(time.thread_time() - start_cpu)
        jax.block_until_ready(out)
        each.append(time.perf_counter() - start)
    return statistics.median(each), statistics.median(cpu)


def linen_forward(config, src, tgt):
    """One jitted `apply` of the linen copy of Flax examples/wmt at the same sizes (pad id 0 in both)."""
    from tests.systems import flax_wmt

    wmt = flax_wmt.WmtConfig(vocab_size=config.src_vocab_size, output_vocab_size=config.tgt_vocab_size,
                             emb_dim=config.d_model, num_heads=config.n_heads, num_layers=config.n_encoder_layers,
                             qkv_dim=config.d_model, mlp_dim=config.d_ff, max_len=config.max_len)
    params = jax.device_put(flax_wmt.init(wmt, seed=0))
    module = flax_wmt.Transformer(wmt)
    forward = jax.jit(lambda p, i, t: module.apply({"params": p}, i, t))
    return lambda: forward(params, src, tgt)


if __name__ == "__main__":
    main()
