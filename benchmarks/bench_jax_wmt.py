"""impl_jax against a plain linen copy of Flax `examples/wmt`: cold compile and each call after, of
the forward or of a training step.

    python benchmarks/bench_jax_wmt.py                 # the forward, base size, batch 32, lengths 128, fresh processes
    python benchmarks/bench_jax_wmt.py --quick         # a small config (a smoke run)
    python benchmarks/bench_jax_wmt.py --repeats 2
    python benchmarks/bench_jax_wmt.py --step --batch 8 --length 64   # a training step (issue 28's CPU sizes)
    python benchmarks/bench_jax_wmt.py --cublas --same-precision --repeats 3   # issue 44's GPU comparison

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
precision is like for like; the default-precision row shows what TF32 buys.

`--step`: one training step instead of the forward, without dropout, label smoothing 0.1. The
linen copy's is `examples/wmt` train.py's `train_step` on one device (no pmap, so no
`pmean`/`psum`; no dropout, no dynamic scale): `jax.value_and_grad` of the weighted label-smoothed
cross-entropy over the non-padding targets, `optax.adamw` with wmt's betas (0.9, 0.98), eps 1e-9,
weight decay 0 and its warmup-then-rsqrt schedule, and the step's metrics (loss without smoothing,
accuracy, denominator, learning rate), in one jitted function that donates the parameters and
the optimizer state, as wmt's pmap does. impl_jax's is
its public `impl_jax.train_step(model, impl_jax.Adam(model, d_model), src, tgt, labels,
label_smoothing=0.1)`: loss, gradients and the paper's Adam (betas (0.9, 0.98), eps 1e-9) in one
executable, the ids and labels checked on the host.

`--cublas`: the linen copy's processes get `XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`, the
product engine impl_jax picks for itself on a GPU (cuBLAS, no autotuning: cold compiles of seconds,
not a minute), so that both run the same GEMMs; without it the linen copy takes XLA's defaults.
`--same-precision`: leave out the default-precision row (TF32), timing only the like-for-like pair.
With `--repeats` > 1 the settings run in a rotating order, and the per-call ratio is the median of
the per-repeat ratios.

`--host`: the host's part of a forward call, the two contenders in one process, interleaved (issue
44: on an H100 impl_jax's call spent 7.1 ms on the host against linen's 1.6 ms). At a tiny config
(d_model 16, 1+1 layers, vocab 64, batch 4, lengths 8: `--host-size`, or `quick`/`base`) the device
work is negligible, so a call's time is almost all host work, on any machine. Both at precision
"highest", the same ids (row 0 half padding). Each of `--rounds` rounds runs `--calls` calls of
each contender, in a rotating order; per round the median host time (until the call returns) and
wall time (until `block_until_ready`); the ratio printed is the median of the per-round ratios.
Because the machine may be shared and loaded, the function calls per call are counted too
(`sys.setprofile`: Python functions, and functions implemented in C such as builtins), a figure
no load changes. A third row, "impl_jax, one executable", is the same call with
`impl_jax.one_executable_forward()` on (the encoder and the decoder traced as one program;
off by default).

    python benchmarks/bench_jax_wmt.py --host                       # tiny, 15 rounds of 200 calls
    python benchmarks/bench_jax_wmt.py --host --host-size base --rounds 5 --calls 10"""

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


SIZES = {
    "tiny": dict(vocab=64, d=16, heads=2, ff=32, layers=1, batch=4, length=8),  # `--host`: device work negligible
    "quick": dict(vocab=1000, d=128, heads=4, ff=512, layers=2, batch=4, length=32),
    "base": dict(vocab=32000, d=512, heads=8, ff=2048, layers=6, batch=32, length=128),
}


def sizes(quick: bool | str, batch: int | None = None, length: int | None = None) -> dict:
    """The sizes by name ("tiny", "quick", "base"), or (a bool) quick or base."""
    s = SIZES[quick if isinstance(quick, str) else "quick" if quick else "base"]
    return {**s, "batch": batch or s["batch"], "length": length or s["length"]}


def inputs(s: dict):
    """The same padded batch for every contender: (src, tgt), int32, ids in [3, vocab), row 0 half
    padding (pad id 0 on both sides) so that the masks take part."""
    import numpy as np

    rng = np.random.default_rng(0)
    src = rng.integers(3, s["vocab"], size=(s["batch"], s["length"])).astype(np.int32)
    tgt = rng.integers(3, s["vocab"], size=(s["batch"], s["length"])).astype(np.int32)
    src[0, s["length"] // 2:] = 0
    tgt[0, s["length"] // 2:] = 0
    return src, tgt


def linen_forward(s: dict):
    """The linen copy's forward at sizes `s`: a function of (src, tgt) running one jitted `apply`."""
    import jax

    from tests.systems import flax_wmt

    config = flax_wmt.WmtConfig(vocab_size=s["vocab"], output_vocab_size=s["vocab"], emb_dim=s["d"],
                                num_heads=s["heads"], num_layers=s["layers"], qkv_dim=s["d"],
                                mlp_dim=s["ff"], max_len=max(256, s["length"]))
    params = jax.device_put(flax_wmt.init(config, seed=0))
    module = flax_wmt.Transformer(config)
    forward = jax.jit(lambda p, i, t: module.apply({"params": p}, i, t))
    return (lambda src, tgt: forward(params, src, tgt)), (flax_wmt, config, params)


def impl_jax_model(s: dict):
    """impl_jax's model at sizes `s` (the flax-wmt preset, float32, precision highest)."""
    import numpy as np

    import impl_jax
    from conformance import init_params, preset

    config = preset("flax-wmt", d_model=s["d"], n_heads=s["heads"], d_ff=s["ff"], n_encoder_layers=s["layers"],
                    n_decoder_layers=s["layers"], src_vocab_size=s["vocab"], tgt_vocab_size=s["vocab"],
                    max_len=max(256, s["length"]))
    return impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32), dtype="float32")


def count_calls(run, calls: int) -> dict:
    """Function calls per call of `run` (its result waited for), by `sys.setprofile`: Python
    functions ("python") and functions implemented in C ("c": builtins, methods of C types, jit's
    C++ dispatch). Counted, not timed: the same on a loaded machine as on an idle one."""
    import jax

    counts = {"call": 0, "c_call": 0}

    def profile(frame, event, arg):
        if event in counts:
            counts[event] += 1

    jax.block_until_ready(run())  # anything lazy (a first call's record) is done before counting
    sys.setprofile(profile)
    try:
        for _ in range(calls):
            jax.block_until_ready(run())
    finally:
        sys.setprofile(None)
    return {"python": counts["call"] / calls, "c": counts["c_call"] / calls}


def host_part(size: str, rounds: int, calls: int) -> None:
    """`--host`: impl_jax's forward call against the linen copy's jitted apply, in this process,
    interleaved (see the module docstring)."""
    import jax

    if str(HERE) not in sys.path:  # tests.systems and impl_jax, as the children's PYTHONPATH gives them
        sys.path.insert(0, str(HERE))
    jax.config.update("jax_default_matmul_precision", "highest")  # the linen copy at impl_jax's precision
    s = sizes(size)
    src, tgt = inputs(s)
    apply, _ = linen_forward(s)
    model = impl_jax_model(s)
    import impl_jax

    def forward(in_one: bool):
        def run():  # the switch set in the call, whatever ROSETTA_JAX_ONE_EXECUTABLE says
            with impl_jax.one_executable_forward(in_one):
                return model(src, tgt, return_attention=False).logits
        return run

    contenders = {"wmt linen, jitted apply": lambda: apply(src, tgt),
                  "impl_jax model(src, tgt)": forward(False), "impl_jax, one executable": forward(True)}
    names = list(contenders)
    for name, run in contenders.items():  # the compiles, and a few calls to warm every path
        start = time.perf_counter()
        jax.block_until_ready(run())
        print(f"  {name}: first call {time.perf_counter() - start:.2f} s", flush=True)
        for _ in range(5):
            jax.block_until_ready(run())
    measured: dict[str, dict[str, list[float]]] = {n: {"host": [], "wall": []} for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, host_times, wall_times = contenders[name], [], []
            for _ in range(calls):
                start = time.perf_counter()
                out = run()  # returns once the host has dispatched the call's work
                host_times.append(time.perf_counter() - start)
                jax.block_until_ready(out)
                wall_times.append(time.perf_counter() - start)
            measured[name]["host"].append(statistics.median(host_times))
            measured[name]["wall"].append(statistics.median(wall_times))
    counted = {name: count_calls(contenders[name], min(calls, 20)) for name in names}
    print(f"\nforward per call, d_model {s['d']}, {s['layers']}+{s['layers']} layers, vocab {s['vocab']}, "
          f"batch {s['batch']}, lengths {s['length']}, float32 at precision highest, on {jax.devices()[0]}; "
          f"medians over {rounds} rounds of {calls} calls each, interleaved")
    print(f"{'':<28}{'host (returned)':>17}{'wall (blocked)':>17}{'Python calls':>14}{'C calls':>10}")
    for name in names:
        print(f"{name:<28}{statistics.median(measured[name]['host']) * 1e3:>14.3f} ms"
              f"{statistics.median(measured[name]['wall']) * 1e3:>14.3f} ms"
              f"{counted[name]['python']:>14.1f}{counted[name]['c']:>10.1f}")
    theirs = measured[names[0]]
    for name in names[1:]:
        for part in ("host", "wall"):
            ratios = [a / b for a, b in zip(measured[name][part], theirs[part])]
            print(f"{name} / linen, {part}: {statistics.median(ratios):.2f}x (median of {rounds} per-round ratios; "
                  f"range {min(ratios):.2f}-{max(ratios):.2f}x)")


def linen_step(flax_wmt, config, params, label_smoothing: float):
    """`examples/wmt` train.py's train_step on one device, without dropout: (params, opt_state,
    step, inputs, targets) -> (params, opt_state, metrics), jitted with the parameters and the
    optimizer state donated (wmt's pmap donates its train state); and the optimizer state to start."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    def schedule(count, learning_rate=0.0625, warmup=1000):  # wmt's linear warmup, then rsqrt
        return jnp.where(count < warmup, learning_rate * count / warmup,
                         learning_rate * (jnp.maximum(count, 1) / warmup) ** -0.5)

    optimizer = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    module = flax_wmt.Transformer(config)

    def cross_entropy(logits, targets, weights, smoothing):  # compute_weighted_cross_entropy
        vocab = logits.shape[-1]
        confidence = 1.0 - smoothing
        low = (1.0 - confidence) / (vocab - 1)
        constant = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
        soft = jnp.where(jax.nn.one_hot(targets, vocab) > 0, confidence, low)
        loss = -jnp.sum(soft * jax.nn.log_softmax(logits), axis=-1) - constant
        return (loss * weights).sum(), weights.sum()

    def step(params, opt_state, count, inputs, targets):
        weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)

        def loss_fn(p):
            logits = module.apply({"params": p}, inputs, targets)
            loss, weight_sum = cross_entropy(logits, targets, weights, label_smoothing)
            return loss / weight_sum, logits

        (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # compute_metrics: its cross-entropy at its default smoothing, 0
        loss, denominator = cross_entropy(logits, targets, weights, 0.0)
        accuracy = (jnp.equal(jnp.argmax(logits, -1), targets) * weights).sum()
        return params, opt_state, {"loss": loss, "accuracy": accuracy, "denominator": denominator,
                                   "learning_rate": schedule(count)}

    return jax.jit(step, donate_argnums=(0, 1)), optimizer.init(params)


def child(setting: str, quick: bool, calls: int, train: bool = False, batch: int | None = None,
          length: int | None = None) -> dict:
    """Runs in a fresh process: builds one model, times its first call and `calls` more."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    s = sizes(quick, batch, length)
    src, tgt = inputs(s)  # a padded row: the masks take part (pad id 0 in both)
    if setting.startswith("wmt"):
        apply, (flax_wmt, config, params) = linen_forward(s)

        def run():
            return apply(src, tgt)

        if train:
            step, state = linen_step(flax_wmt, config, params, 0.1)
            held = {"params": params, "opt": state, "count": 0}

            def run():  # noqa: F811 (the step replaces the forward)
                held["params"], held["opt"], metrics = step(held["params"], held["opt"], np.int32(held["count"]),
                                                            src, tgt)
                held["count"] += 1
                return held["params"], metrics
    else:
        import impl_jax

        model = impl_jax_model(s)
        config = model.config

        def run():
            return model(src, tgt, return_attention=False).logits

        if train:
            optimizer = impl_jax.Adam(model, config.d_model)
            # the next token (3 at the end, never pad_id) where the target is real; pad_id where it is padding
            labels = np.where(tgt == config.pad_id, config.pad_id, np.maximum(np.roll(tgt, -1, axis=1), 3))

            def run():  # noqa: F811 (the step replaces the forward)
                return impl_jax.train_step(model, optimizer, src, tgt, labels, label_smoothing=0.1)  # the loss
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
    parser.add_argument("--calls", type=int, help="calls timed after the first (default 20, or 200 a round with --host)")
    parser.add_argument("--step", action="store_true", help="a training step instead of the forward")
    parser.add_argument("--batch", type=int, help="the batch (default: 32, or 4 with --quick)")
    parser.add_argument("--length", type=int, help="source and target lengths (default: 128, or 32 with --quick)")
    parser.add_argument("--cublas", action="store_true",
                        help="the linen copy with --xla_gpu_enable_triton_gemm=false, as impl_jax compiles on a GPU")
    parser.add_argument("--same-precision", action="store_true", help="only the two rows at precision highest")
    parser.add_argument("--host", action="store_true",
                        help="the forward call's host part, both contenders in this process, interleaved")
    parser.add_argument("--host-size", choices=tuple(SIZES), default="tiny", help="the sizes for --host (default tiny)")
    parser.add_argument("--rounds", type=int, default=15, help="--host: rounds (each runs --calls calls of each)")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("batch", "calls", "repeats", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.length is not None and args.length < 2:
        parser.error("--length must be at least 2 (the first row's second half is padding, and a label must count)")
    args.calls = args.calls or (200 if args.host else 20)
    if args.host:
        if args.step or args.batch or args.length or args.quick:
            parser.error("--host takes --host-size, --rounds and --calls only")
        host_part(args.host_size, args.rounds, args.calls)
        return
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.calls, args.step, args.batch, args.length)))
        return
    settings = SETTINGS[1:] if args.same_precision else SETTINGS
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for repeat in range(args.repeats):
        for setting in settings[repeat % len(settings):] + settings[:repeat % len(settings)]:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("JAX_COMPILATION_CACHE_DIR", "ROSETTA_JAX_CACHE", "JAX_DEFAULT_MATMUL_PRECISION")}
            env.update(ROSETTA_JAX_QUIET="1", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
            if setting == "wmt linen, highest":
                env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
            if args.cublas and setting.startswith("wmt"):
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false").strip()
            command = [sys.executable, __file__, "--child", setting, "--calls", str(args.calls)]
            command += ["--quick"] * args.quick + ["--step"] * args.step
            command += [f"--{name}={getattr(args, name)}" for name in ("batch", "length") if getattr(args, name)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=HERE)
            if done.returncode != 0:
                raise SystemExit(f"{setting} failed:\n{done.stderr[-3000:]}")
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  [{time.strftime('%H:%M:%S')}] repeat {repeat + 1}, {setting}: {runs[setting][-1]}", flush=True)
    s = sizes(args.quick, args.batch, args.length)
    what = "training step (label smoothing 0.1, Adam)" if args.step else "forward"
    print(f"\n{what}, d_model {s['d']}, {s['layers']}+{s['layers']} layers, vocab {s['vocab']}, batch {s['batch']}, "
          f"lengths {s['length']}, float32, on {runs[SETTINGS[-1]][0]['device']}; medians of {args.repeats} "
          f"fresh processes, no persistent cache{'; linen with --xla_gpu_enable_triton_gemm=false' if args.cublas else ''}")
    print(f"{'':<30}{'cold first call':>18}{'each call after':>18}{'of which host':>16}")
    for setting in settings:
        first = statistics.median(r["first"] for r in runs[setting])
        each = statistics.median(r["each"] for r in runs[setting])
        host = statistics.median(r["host"] for r in runs[setting])
        print(f"{setting:<30}{first:>16.2f} s{each * 1e3:>15.2f} ms{host * 1e3:>13.2f} ms")
    ours, theirs = runs[SETTINGS[2]], runs[SETTINGS[1]]
    print(f"impl_jax / wmt linen at the same precision (highest): cold "
          f"{statistics.median(r['first'] for r in ours) / statistics.median(r['first'] for r in theirs):.2f}x, "
          f"each call {statistics.median(r['each'] for r in ours) / statistics.median(r['each'] for r in theirs):.2f}x "
          f"(median of per-repeat ratios {statistics.median(a['each'] / b['each'] for a, b in zip(ours, theirs)):.2f}x; "
          f"host part {statistics.median(r['host'] for r in ours) * 1e3:.2f} against "
          f"{statistics.median(r['host'] for r in theirs) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
