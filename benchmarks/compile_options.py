"""XLA compile options against the default: compile CPU time side by side, and whether the numbers move.

    python benchmarks/compile_options.py --option xla_backend_optimization_level=1
    python benchmarks/compile_options.py --quick --float64 --option xla_llvm_disable_expensive_passes=true
    python benchmarks/compile_options.py --repeats 3 --option A=1 --option B=true

Each setting (the default, then every `--option NAME=VALUE`, one setting each) runs in a fresh
process, `--repeats` times in turn, so that the machine's load hits all alike. A process builds
impl_jax.Model (the base config of benchmarks/bench_jax.py, batch 8, lengths 64; `--quick`: its
small config) and compiles, through `Lowered.compile(compiler_options)`, the programs a first call
compiles: `_encode` and `_decode` (the forward, return_attention=False) and the fused training
step (`impl_jax.train._fused_step`: loss, gradients and the paper's Adam; here without buffer
donation, so that it can run twice). It times each compile with `time.process_time()` (CPU time,
steadier than wall time on a shared machine; wall time is printed too), runs each program once
and keeps every output: the memory, the logits and every intermediate of the forward, the loss,
the updated parameters and Adam's moments of the step. The report gives the median compile times
per setting, their ratio to the default's, and, per setting, whether every output equals the
default's bit for bit (else how many differ, and the largest difference). Some rows have a row
padded, so the masks take part. `--float64` runs the float64 model (64-bit JAX).

An option is one of XLA's `DebugOptions` fields that JAX accepts as a compile option; an unknown
one fails with "No such compile option".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROGRAMS = ("encode", "decode", "train step")


def child(quick: bool, float64: bool, options: dict, out: str) -> None:
    """Compile and run the three programs with `options`; print one JSON line, save outputs to `out`."""
    import jax

    if float64:
        jax.config.update("jax_enable_x64", True)
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_jax import workloads

    import impl_jax
    from conformance import init_params

    compiled, Model = impl_jax.compiled, impl_jax.Model  # the executables' cache and the compiled methods

    label, config, batch, src_len, tgt_len = workloads(quick)[-1]
    rng = np.random.default_rng(0)
    src = rng.integers(2, config.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(2, config.tgt_vocab_size, size=(batch, tgt_len))
    src[0, -5:] = config.pad_id  # padded rows: the masks take part
    tgt[1, -7:] = config.pad_id
    labels = np.roll(tgt, -1, axis=1)
    model = impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32),
                           dtype="float64" if float64 else "float32")
    optimizer = impl_jax.Adam(model, config.d_model)
    train = impl_jax.train  # loaded with the optimizer: the fused step's traced function
    device = model.device
    times, outputs = {}, {}

    def compile_and_run(name, method, static, model_arg, args):
        start, cpu = time.perf_counter(), time.process_time()
        lowered = compiled._JIT.lower(method, tuple(sorted(static.items())), compiled.STACKS, model_arg, *args)
        traced, traced_cpu = time.perf_counter(), time.process_time()
        executable = lowered.compile(options)
        times[name] = {"trace wall": traced - start, "trace cpu": traced_cpu - cpu,
                       "xla wall": time.perf_counter() - traced, "xla cpu": time.process_time() - traced_cpu}
        return jax.block_until_ready(executable(model_arg, *args))

    src_ids, tgt_ids = model._ids("src_ids", src, config.src_vocab_size), model._ids("tgt_ids", tgt, config.tgt_vocab_size)
    src_mask, tgt_mask = model.make_masks(src_ids, tgt_ids)
    memory, _, intermediates = compile_and_run("encode", Model._encode, {"return_attention": False}, model,
                                               jax.device_put((src_ids, src_mask, None), device))
    outputs["memory"] = memory
    outputs.update({f"intermediates.{k}": v for k, v in intermediates.items()})
    logits, _, intermediates = compile_and_run("decode", Model._decode, {"return_attention": False}, model,
                                               jax.device_put((tgt_ids, tgt_mask, memory, src_mask, None, None), device))
    outputs["logits"] = logits
    outputs.update({f"intermediates.{k}": v for k, v in intermediates.items()})

    args, static = model._loss_args(src, tgt, labels, 0.1, None)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    static = dict(graphdef=graphdef, d_model=optimizer.d_model, warmup=optimizer.warmup, b1=optimizer.betas[0],
                  b2=optimizer.betas[1], eps=optimizer.eps, **static)
    loss, params, state = compile_and_run("train step", train._fused_step, static, None,
                                          jax.device_put((params, optimizer.state, rest, *args), device))
    outputs["loss"] = loss
    outputs.update({"param." + ".".join(map(str, path)): v[...] for path, v in nnx.to_flat_state(params)})
    outputs.update({f"adam.{i}": leaf for i, leaf in enumerate(jax.tree.leaves(state))})
    np.savez(out, **{k: np.asarray(v) for k, v in outputs.items()})
    print(json.dumps(times))


def parse_option(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, {"true": True, "false": False}.get(value.lower(), value)


def compare(reference: str, other: str) -> str:
    a, b = np.load(reference), np.load(other)
    differ = [k for k in a.files if k not in b.files or not np.array_equal(a[k], b[k], equal_nan=True)]
    if not differ:
        return f"bit for bit ({len(a.files)} outputs)"
    largest = max(float(np.nanmax(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
                  for k in differ if k in b.files)
    return f"DIFFER: {len(differ)} of {len(a.files)} outputs, largest difference {largest:.2e} (e.g. {differ[0]})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small config")
    parser.add_argument("--float64", action="store_true", help="the float64 model (64-bit JAX)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="one setting to compare with the default (repeatable: one setting each)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per setting (default 2)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.quick, args.float64, json.loads(args.child), args.out)
        return

    settings = {"default": {}}
    for text in args.option:
        name, value = parse_option(text)
        settings[f"{name}={value}"] = {name: value}
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    print(f"{'small' if args.quick else 'base'} config, {'float64' if args.float64 else 'float32'}, "
          f"{os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f}")
    times: dict[str, list[dict]] = {label: [] for label in settings}
    with tempfile.TemporaryDirectory(prefix="compile-options-") as directory:
        for repeat in range(args.repeats):
            for i, (label, options) in enumerate(settings.items()):
                out = os.path.join(directory, f"{i}-{repeat}.npz")
                command = [sys.executable, __file__, "--child", json.dumps(options), "--out", out]
                command += ["--quick"] * args.quick + ["--float64"] * args.float64
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"  {label}: failed: {done.stderr.strip().splitlines()[-1]}")
                    continue
                times[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
        reference = os.path.join(directory, "0-0.npz")
        print(f"compile seconds, median of {args.repeats} fresh processes (CPU time; wall in brackets), "
              f"and the outputs against the default's:")
        for i, (label, reports) in enumerate(settings.items()):
            reports = times[label]
            if not reports:
                continue
            line = []
            for program in PROGRAMS:
                cpu = statistics.median(r[program]["xla cpu"] for r in reports)
                wall = statistics.median(r[program]["xla wall"] for r in reports)
                default = statistics.median(r[program]["xla cpu"] for r in times["default"])
                line.append(f"{program} XLA {cpu:.2f} ({wall:.2f}) = {cpu / default:.2f}x")
            trace = statistics.median(sum(r[p]["trace cpu"] for p in PROGRAMS) for r in reports)
            verdict = "the reference" if i == 0 else compare(reference, os.path.join(directory, f"{i}-0.npz"))
            print(f"  {label}: " + "; ".join(line) + f"; tracing {trace:.2f}; {verdict}")
            if i == 0 and len(reports) > 1:  # the default against itself: run-to-run agreement
                print(f"    default, second process: {compare(reference, os.path.join(directory, '0-1.npz'))}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
