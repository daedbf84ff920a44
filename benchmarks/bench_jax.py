"""Forward-pass speed and compile time of impl_jax, next to torch.nn.Transformer.

    python benchmarks/bench_jax.py             # the base config of the paper, CPU, float32
    python benchmarks/bench_jax.py --quick     # the small config only, few rounds (a smoke run)
    python benchmarks/bench_jax.py --compile   # compile times per entry point, fresh processes

`--compile` (with `--quick`: the small config) runs benchmarks/compile_child.py in fresh
processes and prints, per entry point (the forward pass, one training step, `generate`), the
first call's wall time split into tracing and XLA, its CPU time, and the compile's CPU time (the
first call's CPU time less the second call's: tracing, XLA and first-call overheads, steadier
than wall time on a loaded machine), for the layer stacks unrolled (ROSETTA_JAX_SCAN=0) and
scanned (impl_jax/stacks.py) side by side: each cold (an empty persistent cache) and then from
the persistent cache a first process filled (a second process). The processes alternate,
`--repeats` times, so that the machine's load hits every setting alike; the medians are printed.

    python benchmarks/bench_jax.py --compile --against /path/to/other/checkout --stacks unrolled --cold-only

`--against DIR` adds the same processes run on another checkout of this project (its directory
first on PYTHONPATH, e.g. a `git worktree add --detach` of an older commit), interleaved with this
tree's, and prints this tree's compile time as a ratio of that one's; `--stacks` keeps one layout
and `--cold-only` skips the persistent-cache processes and runs the cold ones with no persistent
cache at all, as a user who never enabled it compiles (a cold process with the cache on also
writes every executable to it).

Workloads: the base config (d_model 512, 8 heads, d_ff 2048, 6+6 layers, vocab 32000, post-LN,
PyTorch's translation-tutorial preset) on a batch of 8 source and target sequences of length 64,
and a small config (d_model 128, 4 heads, d_ff 512, 2+2 layers, vocab 1000, batch 4, length 32).
With `--compile`, `--preset NAME` applies those sizes to another preset (`flax-wmt`: pre-LN).

For each workload the script reports
    - compile time: the first call of a new shape traces and compiles `_encode` and `_decode`
      (`impl_jax.compile_stats()` splits tracing/lowering from XLA compilation), separately for
      return_attention=False and True, which are different executables;
    - steady state: calls after compilation, each blocked until its result is ready, interleaved
      round by round with torch.nn.Transformer (same sizes, the same masks as PyTorch's tutorial,
      its own random weights: this is a timing, the equal-computation check is against the
      float64 NumPy oracle below), so that load from other processes hits both alike;
    - medians, the median of the per-round ratios to nn.Transformer, and GFLOP/s of the matrix
      products (counted analytically), next to a plain matmul's GFLOP/s in JAX and torch.

To add impl_jax to benchmarks/bench_forward.py, append its contenders there:

    from bench_jax import jax_contenders
    entries += [Contender(name, run) for name, run in jax_contenders(config, params, src, tgt)]

Each `run()` computes one forward pass to completion (`block_until_ready`) and returns the logits;
the first call compiles, so run each once before timing (bench_forward's warm-up does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import impl_jax
import impl_numpy
from conformance import PRESETS, init_params, preset
from conformance.core.config import ADDED_FIELDS, ModelConfig

BASELINE = "nn.Transformer"


# -- Workloads ---------------------------------------------------------------------------------


def workloads(quick: bool, family: str = "torch-nn-transformer") -> list[tuple[str, ModelConfig, int, int, int]]:
    """(label, config, batch, source length, target length); `family`: the preset the sizes are
    applied to (its norm placement, norm form, masks and biases)."""
    small = ("small", preset(family, d_model=128, n_heads=4, d_ff=512, n_encoder_layers=2,
                             n_decoder_layers=2, src_vocab_size=1000, tgt_vocab_size=1000, max_len=32), 4, 32, 32)
    base = ("base", preset(family, d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6,
                           n_decoder_layers=6, src_vocab_size=32000, tgt_vocab_size=32000, max_len=64), 8, 64, 64)
    return [small] if quick else [small, base]


def forward_flops(config: ModelConfig, batch: int, src_len: int, tgt_len: int) -> int:
    """Floating-point operations of the forward pass's matrix products (2 per multiply-add); the
    same count as benchmarks/bench_forward.py. Elementwise work is left out."""
    d, f, v = config.d_model, config.d_ff, config.tgt_vocab_size
    s, t = batch * src_len, batch * tgt_len  # rows of the flattened (B*L, D) activations
    encoder_layer = 2 * (4 * s * d * d) + 2 * (2 * s * src_len * d) + 2 * (2 * s * d * f)
    decoder_layer = 2 * (4 * t * d * d) + 2 * (2 * t * tgt_len * d)  # masked self-attention
    decoder_layer += 2 * (2 * t * d * d + 2 * s * d * d) + 2 * (2 * t * src_len * d)  # cross
    decoder_layer += 2 * (2 * t * d * f)
    return config.n_encoder_layers * encoder_layer + config.n_decoder_layers * decoder_layer + 2 * t * d * v


def batch_of(config: ModelConfig, batch: int, src_len: int, tgt_len: int, seed: int = 0):
    """Full-length rows of real tokens (ids >= 2 are never padding for pad_id 0 or 1): every
    implementation does the same work, and the padding masks are built and applied regardless."""
    rng = np.random.default_rng(seed)
    return (rng.integers(2, config.src_vocab_size, size=(batch, src_len)),
            rng.integers(2, config.tgt_vocab_size, size=(batch, tgt_len)))


# -- impl_jax ----------------------------------------------------------------------------------


def jax_contenders(config: ModelConfig, params, src: np.ndarray, tgt: np.ndarray,
                   model: impl_jax.Model | None = None) -> list[tuple[str, Callable[[], Any]]]:
    """(name, run) pairs: run() is one impl_jax forward pass, blocked until the logits are ready."""
    model = model if model is not None else impl_jax.Model(config, params, dtype="float32")

    def fast():
        return jax.block_until_ready(model(src, tgt, return_attention=False).logits)

    def explicit():
        out = model(src, tgt)
        jax.block_until_ready(out.attention)
        return jax.block_until_ready(out.logits)

    return [("impl_jax fast", fast), ("impl_jax explicit", explicit)]


def compile_times(model: impl_jax.Model, src: np.ndarray, tgt: np.ndarray) -> dict[str, dict[str, float]]:
    """Seconds of the first call of this shape, per return_attention setting: wall time (tracing,
    compiling and one run) and the tracing and XLA parts reported by `impl_jax.compile_stats`."""
    results = {}
    for return_attention in (False, True):
        before = impl_jax.compile_stats()
        start = time.perf_counter()
        jax.block_until_ready(model(src, tgt, return_attention=return_attention).logits)
        wall = time.perf_counter() - start
        after = impl_jax.compile_stats()
        results[f"return_attention={return_attention}"] = {
            "first call": wall,
            "trace+lower": after["trace_seconds"] - before["trace_seconds"],
            "xla compile": after["compile_seconds"] - before["compile_seconds"],
            "executables": after["compiles"] - before["compiles"],
        }
    return results


# -- torch.nn.Transformer ----------------------------------------------------------------------


def torch_contender(config: ModelConfig, src: np.ndarray, tgt: np.ndarray) -> tuple[str, Callable[[], Any]] | None:
    """nn.Transformer with embeddings, positions and output projection, masks as in PyTorch's
    translation tutorial; None (with a note) if torch is not installed."""
    try:
        import torch
    except ImportError as exc:
        print(f"  ({BASELINE} skipped: {exc})")
        return None
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
    d, scale = config.d_model, math.sqrt(config.d_model)
    torch.manual_seed(0)
    src_embedding = torch.nn.Embedding(config.src_vocab_size, d)
    tgt_embedding = torch.nn.Embedding(config.tgt_vocab_size, d)
    positions = torch.randn(config.max_len, d)
    transformer = torch.nn.Transformer(d, config.n_heads, config.n_encoder_layers, config.n_decoder_layers,
                                       config.d_ff, dropout=0.0, batch_first=True).eval()
    generator = torch.nn.Linear(d, config.tgt_vocab_size)
    src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt)

    def run():
        with torch.inference_mode():
            x = src_embedding(src_t) * scale + positions[: src_t.shape[1]]
            y = tgt_embedding(tgt_t) * scale + positions[: tgt_t.shape[1]]
            causal = torch.ones(tgt_t.shape[1], tgt_t.shape[1], dtype=torch.bool).triu(1)  # True = may NOT attend
            src_pad, tgt_pad = src_t == config.pad_id, tgt_t == config.pad_id
            y = transformer(x, y, tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                            memory_key_padding_mask=src_pad)
            return generator(y)

    return BASELINE, run


# -- Timing ------------------------------------------------------------------------------------


def interleaved(entries: list[tuple[str, Callable[[], Any]]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call, per contender; round r runs the contenders rotated by r places."""
    for _ in range(warmup):
        for _, run in entries:
            run()
    times: dict[str, list[float]] = {name: [] for name, _ in entries}
    for r in range(rounds):
        order = entries[r % len(entries):] + entries[: r % len(entries)]
        for name, run in order:
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def matmul_gflops(m: int, k: int, n: int, repeats: int = 20) -> dict[str, float]:
    """Median GFLOP/s of one float32 (m, k) @ (k, n) product, in JAX (HIGHEST) and torch."""
    a = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
    b = np.random.default_rng(2).standard_normal((k, n), dtype=np.float32)
    product = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    runs = {"jax": lambda: product(ja, jb).block_until_ready()}
    try:
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        runs["torch"] = lambda: ta @ tb
    except ImportError:
        pass
    rates = {}
    for name, run in runs.items():
        for _ in range(3):
            run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        rates[name] = 2 * m * k * n / statistics.median(times) / 1e9
    return rates


def oracle_error(model: impl_jax.Model, params, src: np.ndarray, tgt: np.ndarray) -> float:
    """max |logits - float64 NumPy oracle| / max(1, max |oracle|): the timed computation is the model."""
    oracle = impl_numpy.Model(model.config, {k: np.asarray(v, np.float64) for k, v in params.items()})
    expected = oracle(src, tgt).logits
    got = np.asarray(model(src, tgt, return_attention=False).logits, dtype=np.float64)
    return float(np.abs(got - expected).max()) / max(1.0, float(np.abs(expected).max()))


# -- Compile times, fresh processes -----------------------------------------------------------

ENTRY_POINTS = ("forward", "train step", "generate")


HERE = Path(__file__).resolve().parents[1]  # this checkout


def child(config: ModelConfig, batch: int, src_len: int, tgt_len: int, *, scan: bool, cache: str,
          tree: Path = HERE) -> dict:
    """One fresh process's report (benchmarks/compile_child.py) with the stacks and cache given,
    importing impl_jax from `tree` (this checkout unless another is named)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR",)}
    env.update(ROSETTA_JAX_SCAN="1" if scan else "0", ROSETTA_JAX_CACHE=cache, ROSETTA_JAX_QUIET="1",
               PYTHONPATH=os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]))
    # A field added since an older checkout was cut (ADDED_FIELDS) is left out where it keeps its
    # default, the behaviour that checkout has, so that --against can reach back before it.
    default = ModelConfig()
    stored = {name: value for name, value in config.to_dict().items()
              if not (name in ADDED_FIELDS and value == getattr(default, name))}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_child.py")),
                           json.dumps(stored), str(batch), str(src_len), str(tgt_len)],
                          env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"compile_child failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for entry in ENTRY_POINTS:  # the compile's CPU time: the first call's less the second call's
        report[entry]["compile cpu"] = report[entry]["cpu"] - report[entry].get("again cpu", float("nan"))
    return report


def compile_report(config: ModelConfig, batch: int, src_len: int, tgt_len: int, repeats: int, *,
                   stacks: tuple[str, ...] = ("unrolled", "scanned"), against: Path | None = None,
                   cold_only: bool = False) -> None:
    """Cold and persistent-cache compile times per entry point, per stack layout, and per checkout
    with `against`; every setting runs once per repeat, in turn."""
    trees = {"this": HERE} if against is None else {"this": HERE, "against": against.resolve()}
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for repeat in range(repeats):
        for label in stacks:
            # every other repeat in the reverse order (ABBA), so that neither checkout always goes first
            for name, tree in (list(trees.items()) if repeat % 2 == 0 else list(trees.items())[::-1]):
                with tempfile.TemporaryDirectory(prefix="rosetta-jax-cache-") as directory:
                    # cold-only: no persistent cache at all, as a user who never enabled it compiles
                    # (writing the executables costs the base forward 0.4-0.9 CPU s more)
                    for cache in ("cold",) if cold_only else ("cold", "cached"):
                        runs.setdefault((name, label, cache), []).append(
                            child(config, batch, src_len, tgt_len, scan=label == "scanned",
                                  cache="" if cold_only else directory, tree=tree))
    if against is not None:
        print(f"'this': {HERE}\n'against': {trees['against']}")
    print(f"first call of each entry point, seconds (median of {repeats} fresh processes each; "
          f"'cached': a second process with the persistent cache the first one filled; "
          f"'compile CPU': the first call's CPU time less the second call's):")
    print(f"  {'entry point':<12}{'tree':<9}{'stacks':<10}{'cache':<8}{'first call':>11}{'= trace':>9}{'+ XLA':>8}"
          f"{'+ run etc.':>11}{'CPU s':>8}{'compile CPU':>12}{'compiles':>10}{'loaded':>8}{'2nd call':>10}")

    def median(reports, entry, key):
        return statistics.median(r[entry].get(key, float("nan")) for r in reports)

    for entry in ENTRY_POINTS:
        for (name, label, cache), reports in runs.items():
            parts = {key: median(reports, entry, key) for key in
                     ("first", "trace", "xla", "cpu", "compile cpu", "compiles", "loaded", "again")}
            rest = parts["first"] - parts["trace"] - parts["xla"]
            print(f"  {entry:<12}{name:<9}{label:<10}{cache:<8}{parts['first']:>11.2f}{parts['trace']:>9.2f}"
                  f"{parts['xla']:>8.2f}{rest:>11.2f}{parts['cpu']:>8.2f}{parts['compile cpu']:>12.2f}"
                  f"{parts['compiles']:>10.0f}{parts['loaded']:>8.0f}{parts['again']:>10.2f}")
    for entry in ENTRY_POINTS:
        if len(stacks) == 2:
            ratios = [median(runs[("this", "scanned", "cold")], entry, key) /
                      median(runs[("this", "unrolled", "cold")], entry, key) for key in ("first", "cpu")]
            print(f"  {entry}: scanned / unrolled, cold first call: {ratios[0]:.2f}x wall, {ratios[1]:.2f}x CPU time")
        if against is not None:
            for label in stacks:
                cold = {name: runs[(name, label, "cold")] for name in trees}
                ratios = [median(cold["this"], entry, key) / median(cold["against"], entry, key)
                          for key in ("first", "cpu", "compile cpu")]
                ratios.append((median(cold["this"], entry, "trace") + median(cold["this"], entry, "xla")) /
                              (median(cold["against"], entry, "trace") + median(cold["against"], entry, "xla")))
                print(f"  {entry} ({label}): this / against, cold: first call {ratios[0]:.2f}x wall, "
                      f"{ratios[1]:.2f}x CPU; compile {ratios[2]:.2f}x CPU, trace + XLA {ratios[3]:.2f}x wall")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small config only, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15, or 5 with --quick)")
    parser.add_argument("--no-torch", action="store_true", help=f"skip {BASELINE}")
    parser.add_argument("--compile", action="store_true", help="compile times per entry point in fresh processes")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per setting with --compile")
    parser.add_argument("--against", type=Path, default=None, metavar="DIR",
                        help="with --compile: also run the processes on another checkout (DIR first on PYTHONPATH), "
                             "interleaved, and print ratios")
    parser.add_argument("--stacks", choices=("both", "unrolled", "scanned"), default="both",
                        help="with --compile: the layer-stack layouts to time (default both)")
    parser.add_argument("--cold-only", action="store_true", help="with --compile: skip the persistent-cache processes")
    parser.add_argument("--preset", default="torch-nn-transformer", choices=sorted(PRESETS),
                        help="with --compile: the preset the base and small sizes are applied to (default: "
                             "torch-nn-transformer, post-LN; flax-wmt is pre-LN)")
    args = parser.parse_args(argv)
    if args.preset != "torch-nn-transformer" and not args.compile:
        parser.error("--preset applies to --compile only (the steady-state rounds run nn.Transformer's preset)")
    rounds = args.rounds or (5 if args.quick else 15)
    if args.compile:
        label, config, batch, src_len, tgt_len = workloads(args.quick, args.preset)[-1]
        print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} logical CPUs, load average "
              f"{os.getloadavg()[0]:.2f}\n== {label}: {config.summary()}; batch {batch}, lengths {src_len}/{tgt_len}")
        stacks = ("unrolled", "scanned") if args.stacks == "both" else (args.stacks,)
        compile_report(config, batch, src_len, tgt_len, args.repeats, stacks=stacks, against=args.against,
                       cold_only=args.cold_only)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        return

    print(f"jax {jax.__version__}, {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    with impl_jax.full_precision():
        print("precision: " + ", ".join(f"{k}={v}" for k, v in impl_jax.precision_settings().items()))
        for label, config, batch, src_len, tgt_len in workloads(args.quick):
            print(f"\n== {label}: {config.summary()}; batch {batch}, source length {src_len}, target length {tgt_len}")
            flops = forward_flops(config, batch, src_len, tgt_len)
            print(f"forward pass: {flops / 1e9:.2f} GFLOP in matrix products (counted analytically)")
            params = init_params(config, seed=0, dtype=np.float32)
            src, tgt = batch_of(config, batch, src_len, tgt_len)
            model = impl_jax.Model(config, params, dtype="float32")

            print("compile time of a new shape (seconds):")
            for setting, parts in compile_times(model, src, tgt).items():
                print(f"  {setting:<24} first call {parts['first call']:6.2f}  = "
                      f"trace+lower {parts['trace+lower']:5.2f}"
                      f" + XLA {parts['xla compile']:5.2f} ({parts['executables']} executables) + one run")
            error = oracle_error(model, params, src, tgt)
            print(f"logits vs the float64 NumPy oracle (max abs error / max |logit|): {error:.1e}")

            entries = jax_contenders(config, params, src, tgt, model=model)
            baseline = None if args.no_torch else torch_contender(config, src, tgt)
            if baseline is not None:
                entries.append(baseline)
            rates_before = matmul_gflops(batch * tgt_len, config.d_model, config.d_ff)
            times = interleaved(entries, rounds=rounds, warmup=2)
            rates_after = matmul_gflops(batch * tgt_len, config.d_model, config.d_ff)

            print(f"steady state, {rounds} interleaved rounds (load average now {os.getloadavg()[0]:.2f}):")
            header = f"ratio vs {BASELINE}" if baseline is not None else ""
            print(f"  {'contender':<20}{'median ms':>11}{'min ms':>9}{header:>26}{'GFLOP/s':>9}")
            for name, seconds in times.items():
                median = statistics.median(seconds)
                ratio = (f"{statistics.median(s / b for s, b in zip(seconds, times[BASELINE])):>25.3f}x"
                         if baseline is not None else " " * 26)
                print(f"  {name:<20}{median * 1e3:>11.1f}{min(seconds) * 1e3:>9.1f}{ratio}{flops / median / 1e9:>9.1f}")
            rows, d = batch * tgt_len, config.d_model
            for name in rates_before:
                print(f"  plain matmul ({rows}x{d}) @ ({d}x{config.d_ff}) in {name}: {rates_before[name]:.1f} GFLOP/s "
                      f"before, {rates_after[name]:.1f} after the rounds")
    print("\n" + "compile stats: " + ", ".join(f"{k}={v}" for k, v in impl_jax.compile_stats().items()))


if __name__ == "__main__":
    main()
