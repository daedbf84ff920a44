"""impl_jax's forward against a plain linen copy of Flax `examples/wmt`: cold compile and each call after.

    python benchmarks/bench_jax_wmt.py                 # base size, batch 32, lengths 128, fresh processes
    python benchmarks/bench_jax_wmt.py --quick         # a small config (a smoke run)
    python benchmarks/bench_jax_wmt.py --repeats 2

Issue 28's comparison: on an H100 most of a cold float32 compile was XLA's autotuning of GEMMs at
precision `highest` (issue 28: 61 s cold, 7 s with `--xla_gpu_autotune_level=0`), which impl_jax
pins; Flax `examples/wmt` runs at JAX's default precision (TF32 passes on an H100). So the linen copy (tests/systems/flax_wmt.py: wmt's `models.py`
written again, pre-LN, the same parameter names) runs twice, at the default precision and with
`JAX_DEFAULT_MATMUL_PRECISION=highest`, and impl_jax (pinned to highest) beside them, each in a
fresh process with no persistent cache, in turn, `--repeats` times. The same sizes in all: the
base config (d_model 512, 8 heads, d_ff 2048, 6+6 layers, vocab 32000), float32. On a GPU impl_jax
compiles its float32 programs with cuBLAS products, not autotuned Triton kernels (its own choice:
`impl_jax.compiled.triton_gemm`); the linen copy takes XLA's defaults, as a user's code does
(`XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` gives it the same, docs/jax-compile.md).

Per process: the first call's wall time (tracing, compiling, running) and the median of the
following `--calls` calls, each waited for (`block_until_ready`), and of how long each call took to
return before that wait: the host's part (checks, masks, flattening the parameters, dispatching; on
a GPU the device starts on the encoder while the host still prepares the decoder, so the two overlap
in part). impl_jax's call is its public API: two executables (encoder, decoder) and the masks built
from the ids on the host; the linen copy's is one jitted `apply`. Only the comparison at the same
precision is like for like; the default-precision row shows what TF32 buys."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SETTINGS = ("wmt linen, default precision", "wmt linen, highest", "impl_jax (highest)")


def sizes(quick: bool) -> dict:
    if quick:
        return dict(vocab=1000, d=128, heads=4, ff=512, layers=2, batch=4, length=32)
    return dict(vocab=32000, d=512, heads=8, ff=2048, layers=6, batch=32, length=128)


def child(setting: str, quick: bool, calls: int) -> dict:
    """Runs in a fresh process: builds one model, times its first call and `calls` more."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    s = sizes(quick)
    rng = np.random.default_rng(0)
    src = rng.integers(3, s["vocab"], size=(s["batch"], s["length"])).astype(np.int32)
    tgt = rng.integers(3, s["vocab"], size=(s["batch"], s["length"])).astype(np.int32)
    src[0, s["length"] // 2:] = 0  # a padded row: the masks take part (pad id 0 in both)
    tgt[0, s["length"] // 2:] = 0
    if setting.startswith("wmt"):
        from tests.systems import flax_wmt

        config = flax_wmt.WmtConfig(vocab_size=s["vocab"], output_vocab_size=s["vocab"], emb_dim=s["d"],
                                    num_heads=s["heads"], num_layers=s["layers"], qkv_dim=s["d"],
                                    mlp_dim=s["ff"], max_len=max(256, s["length"]))
        params = jax.device_put(flax_wmt.init(config, seed=0))
        module = flax_wmt.Transformer(config)
        forward = jax.jit(lambda p, i, t: module.apply({"params": p}, i, t))

        def run():
            return forward(params, src, tgt)
    else:
        import impl_jax
        from conformance import init_params, preset

        config = preset("flax-wmt", d_model=s["d"], n_heads=s["heads"], d_ff=s["ff"], n_encoder_layers=s["layers"],
                        n_decoder_layers=s["layers"], src_vocab_size=s["vocab"], tgt_vocab_size=s["vocab"],
                        max_len=max(256, s["length"]))
        model = impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32), dtype="float32")

        def run():
            return model(src, tgt, return_attention=False).logits
    # Both contenders start with the device's libraries loaded: the linen copy's init above ran
    # small programs on the device, so impl_jax runs one too (a tiny matmul, its own shapes).
    jax.block_until_ready(jnp.ones((8, 8)) @ jnp.ones((8, 8)))
    start = time.perf_counter()
    jax.block_until_ready(run())
    first = time.perf_counter() - start
    times, host = [], []
    for _ in range(calls):
        start = time.perf_counter()
        out = run()  # returns once the host has dispatched the call's work (JAX runs it asynchronously)
        host.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    precision = model.precision if not setting.startswith("wmt") else str(jax.config.jax_default_matmul_precision)
    return {"first": first, "each": statistics.median(times), "host": statistics.median(host),
            "device": str(jax.devices()[0]), "precision": precision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.calls)))
        return
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for repeat in range(args.repeats):
        for setting in SETTINGS:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("JAX_COMPILATION_CACHE_DIR", "ROSETTA_JAX_CACHE", "JAX_DEFAULT_MATMUL_PRECISION")}
            env.update(ROSETTA_JAX_QUIET="1", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
            if setting == "wmt linen, highest":
                env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
            command = [sys.executable, __file__, "--child", setting, "--calls", str(args.calls)]
            done = subprocess.run(command + (["--quick"] if args.quick else []), env=env, capture_output=True,
                                  text=True, cwd=HERE)
            if done.returncode != 0:
                raise SystemExit(f"{setting} failed:\n{done.stderr[-3000:]}")
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  repeat {repeat + 1}, {setting}: {runs[setting][-1]}", flush=True)
    s = sizes(args.quick)
    print(f"\nforward, d_model {s['d']}, {s['layers']}+{s['layers']} layers, vocab {s['vocab']}, batch {s['batch']}, "
          f"lengths {s['length']}, float32, on {runs[SETTINGS[-1]][0]['device']}; medians of {args.repeats} "
          "fresh processes, no persistent cache")
    print(f"{'':<30}{'cold first call':>18}{'each call after':>18}{'of which host':>16}")
    for setting in SETTINGS:
        first = statistics.median(r["first"] for r in runs[setting])
        each = statistics.median(r["each"] for r in runs[setting])
        host = statistics.median(r["host"] for r in runs[setting])
        print(f"{setting:<30}{first:>16.2f} s{each * 1e3:>15.2f} ms{host * 1e3:>13.2f} ms")
    ours, theirs = runs[SETTINGS[2]], runs[SETTINGS[1]]
    print(f"impl_jax / wmt linen at the same precision (highest): cold "
          f"{statistics.median(r['first'] for r in ours) / statistics.median(r['first'] for r in theirs):.2f}x, "
          f"each call {statistics.median(r['each'] for r in ours) / statistics.median(r['each'] for r in theirs):.2f}x")


if __name__ == "__main__":
    main()
