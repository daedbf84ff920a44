"""Training-step speed: impl_torch, impl_jax and impl_numpy against a plain torch.nn.Transformer.

    python benchmarks/bench_train.py                      # the base config of the paper, CPU, float32
    python benchmarks/bench_train.py --quick              # a small config and few repeats (a smoke run)
    python benchmarks/bench_train.py --device cuda --dtype bfloat16
    python benchmarks/bench_train.py --contenders impl_torch,nn.Transformer --profile
    python benchmarks/bench_train.py --contenders impl_torch,nn.Transformer --ops --batch 2
    python benchmarks/bench_train.py --contenders "impl_torch,nn.Transformer compiled,impl_torch compiled"

One training step = forward, the loss of docs/training.md (cross-entropy, ignore_index = pad_id,
label smoothing 0.1), backward, and the paper's Adam with its schedule. Base config (d_model 512,
8 heads, d_ff 2048, 6+6 layers, vocab 32000), batch 8, source and target length 64, padded rows.

    impl_torch            impl_torch.train_step(model, impl_torch.Adam(...), ...); on CUDA its loss and
                          gradients are replayed from a CUDA graph (impl_torch/graphs.py)
    impl_torch eager      the same with the graphs switched off (`impl_torch.graphs.switched_off()`): on the CPU
                          the same as impl_torch
    impl_jax              impl_jax.train_step(...): compiled; the compile (the first step) is
                          excluded from the step times and reported on its own line
    impl_numpy float32    impl_numpy.train_step(...): the hand-written backward pass and Adam
    nn.Transformer        PyTorch's own encoder-decoder with the same weights (benchmarks/bench_forward.py),
                          every parameter trained (its embeddings too, as in ours),
                          F.cross_entropy, torch.optim.Adam + LambdaLR: the baseline
    nn.Transformer compiled   the same under `torch.compile` (default mode; on CUDA also
                          `nn.Transformer compiled max-autotune` and `... reduce-overhead`); its
                          first step, the compile, is timed apart
    impl_torch compiled   impl_torch after `model.compile()` (not by default)

`--device cpu|cuda` puts every torch contender (and impl_jax, on its GPU backend) on that device;
without one the run stops with the reason. `--dtype float32|bfloat16`: bfloat16 is mixed
precision, ours as `dtype=bfloat16, param_dtype=float32` (float32 parameters, Adam and gradients;
bfloat16 compute) against nn.Transformer under `torch.autocast(bfloat16)`; impl_numpy has no
bfloat16 and is left out with the reason.

Calls are interleaved (each round runs every contender once, in a rotating order) so that load
from other processes hits all alike; the report prints every round's ratios to nn.Transformer,
then each median time and the median of the per-round ratios, against the targets of issue 28:
impl_torch <= 1.0x, impl_jax <= 1.0x (and issue 13's NumPy float32 <= 3x). `--profile` prints
torch.profiler's most expensive operators of one impl_torch step and one baseline step. `--ops`
counts the torch ops of one step of each torch contender, the loss and gradients apart from the
optimizer: host dispatches (top-level aten ops: called from Python, or by autograd's engine in the
backward pass) and kernels (ops dispatched, less views). A step bound by the host, as on a GPU at
batch 32, costs about that, and the counts do not depend on the device or the batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import TorchTransformer, workload  # noqa: E402

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from conformance import init_params  # noqa: E402
from conformance.core.training import paper_lrate  # noqa: E402

BASELINE = "nn.Transformer"
TARGETS = {"impl_torch": 1.0, "impl_jax": 1.0, "impl_numpy float32": 3.0}
EPSILON = 0.1


def batch_of(config, batch: int, src_len: int, tgt_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    src = rng.integers(2, config.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(2, config.tgt_vocab_size, size=(batch, tgt_len + 1))
    for row in range(batch):  # padded rows: a quarter to all of the length is real
        src[row, rng.integers(src_len // 4, src_len + 1):] = config.pad_id
        tgt[row, rng.integers(tgt_len // 4, tgt_len + 2):] = config.pad_id
    labels = np.where(tgt[:, 1:] == config.pad_id, config.pad_id, tgt[:, 1:])
    return src, tgt[:, :-1].copy(), labels


def contenders(config, params, src, tgt, labels, device: str, dtype: str, wanted):
    """{name: zero-argument callable running one training step to completion} and {name: why not}."""
    entries, skipped = {}, {}
    mixed = dtype == "bfloat16"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def torch_model():
        if mixed:
            return impl_torch.Model(config, params, "bfloat16", device=device, param_dtype="float32")
        return impl_torch.Model(config, params, "float32", device=device)

    if "impl_torch" in wanted:
        model = torch_model()
        optimizer = impl_torch.Adam(model, config.d_model)
        entries["impl_torch"] = lambda: float(impl_torch.train_step(model, optimizer, src, tgt, labels,
                                                                    label_smoothing=EPSILON))
        grads = {}
        PARTS["impl_torch"] = (
            lambda: grads.update(model.loss_and_grads(src, tgt, labels, label_smoothing=EPSILON)[1]),
            lambda: optimizer.step(grads))

    if "impl_torch eager" in wanted:
        eager = torch_model()
        eager_opt = impl_torch.Adam(eager, config.d_model)

        def eager_step():
            with impl_torch.graphs.switched_off():
                return float(impl_torch.train_step(eager, eager_opt, src, tgt, labels, label_smoothing=EPSILON))

        entries["impl_torch eager"] = eager_step

    for name, mode in [(BASELINE, None)] + [(compiled_name(m), m) for m in COMPILE_MODES[device]]:
        if name in wanted:
            entries[name] = reference_step(name, mode, name != BASELINE, config, params, src, tgt, labels, device, mixed)

    if "impl_torch compiled" in wanted:
        compiled = torch_model()
        compiled.compile()  # nn.Module.compile: torch.compile of its forward, in place
        compiled_opt = impl_torch.Adam(compiled, config.d_model)
        entries["impl_torch compiled"] = first_call("impl_torch compiled", lambda: float(impl_torch.train_step(
            compiled, compiled_opt, src, tgt, labels, label_smoothing=EPSILON)))

    if "impl_jax" in wanted:
        try:
            import jax

            import impl_jax
        except ImportError as exc:
            skipped["impl_jax"] = f"not importable: {exc}"
        else:
            platform = "gpu" if device == "cuda" else "cpu"
            try:
                jdevice = jax.devices(platform)[0]
            except RuntimeError as exc:
                skipped["impl_jax"] = f"no JAX {platform} device: {exc}"
            else:
                with jax.default_device(jdevice):
                    if mixed:
                        jmodel = impl_jax.Model(config, params, "bfloat16", param_dtype="float32")
                    else:
                        jmodel = impl_jax.Model(config, params, "float32")
                    jopt = impl_jax.Adam(jmodel, config.d_model)
                    stats = impl_jax.compile_stats()
                    started = time.perf_counter()
                    float(impl_jax.train_step(jmodel, jopt, src, tgt, labels, label_smoothing=EPSILON))  # compiles
                    first = time.perf_counter() - started
                    after = impl_jax.compile_stats()
                    started = time.perf_counter()
                    float(impl_jax.train_step(jmodel, jopt, src, tgt, labels, label_smoothing=EPSILON))
                    second = time.perf_counter() - started
                COMPILE["impl_jax"] = (f"impl_jax compile (excluded from the step times): first step {first:.1f} s "
                                       f"wall against {second:.2f} s for the second, so about "
                                       f"{first - second:.1f} s of compile; {after['compiles'] - stats['compiles']} "
                                       f"executables, {after['compile_seconds'] - stats['compile_seconds']:.1f} s "
                                       f"in XLA's compiler")
                print(COMPILE["impl_jax"])

                def jax_step():
                    with jax.default_device(jdevice):
                        loss = impl_jax.train_step(jmodel, jopt, src, tgt, labels, label_smoothing=EPSILON)
                    return float(loss)  # blocks until the step is done

                entries["impl_jax"] = jax_step

    if "impl_numpy float32" in wanted:
        if device != "cpu" or mixed:
            skipped["impl_numpy float32"] = "NumPy runs float32 on the CPU only"
        else:
            nmodel = impl_numpy.Model(config, params, "float32")
            nopt = impl_numpy.Adam(nmodel, config.d_model)
            entries["impl_numpy float32"] = lambda: float(impl_numpy.train_step(nmodel, nopt, src, tgt, labels,
                                                                                label_smoothing=EPSILON))
    for name, run in entries.items():  # each contender's steps end on the host (float(loss)); sync the rest
        entries[name] = (lambda run: lambda: (run(), sync()))(run)
    return entries, skipped


def reference_step(name, mode, compiled: bool, config, params, src, tgt, labels, device: str, mixed: bool):
    """One training step of nn.Transformer with our weights: F.cross_entropy, torch.optim.Adam with
    the paper's schedule (LambdaLR), under autocast(bfloat16) when `mixed`. `compiled`: the module
    under `torch.compile(mode=mode)` (forward and backward compiled; the loss and Adam eager, as a
    user who compiles the model runs it); its first step (the compile) is timed apart."""
    baseline = TorchTransformer(config, params).float().to(device)
    baseline.requires_grad_(True)  # its embeddings too (from_pretrained freezes them): ours trains all
    base_opt = torch.optim.Adam(baseline.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    schedule = torch.optim.lr_scheduler.LambdaLR(base_opt, lambda e: paper_lrate(e + 1, config.d_model))
    module = torch.compile(baseline, mode=mode) if compiled else baseline
    src_t, tgt_t, labels_t = (torch.from_numpy(x).to(device) for x in (src, tgt, labels))

    def plain_loss():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mixed):
            logits = module(src_t, tgt_t)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_t.reshape(-1),
                                   ignore_index=config.pad_id, label_smoothing=EPSILON)
        base_opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    def plain_update():
        base_opt.step()
        schedule.step()

    def plain_step():
        loss = plain_loss()
        plain_update()
        return float(loss.detach())  # blocks until the step is done

    PARTS[name] = (plain_loss, plain_update)
    return first_call(name, plain_step) if compiled else plain_step


def first_call(name: str, step):
    """`step` after its first call, whose wall time (a compile) is kept and printed apart."""
    started = time.perf_counter()
    step()
    COMPILE[name] = f"{name}: first step (compile) {time.perf_counter() - started:.1f} s, excluded from the step times"
    print(COMPILE[name], flush=True)
    return step


COMPILE_MODES = {"cpu": (None,), "cuda": (None, "max-autotune", "reduce-overhead")}


def compiled_name(mode) -> str:
    return f"{BASELINE} compiled" + (f" {mode}" if mode else "")


COMPILE: dict[str, str] = {}
PARTS: dict[str, tuple] = {}  # torch contender: (loss and gradients, optimizer update), run in this order
COMPILED = tuple(compiled_name(m) for m in COMPILE_MODES["cuda"])
ALL = ("impl_torch", "impl_torch eager", "impl_torch compiled", BASELINE, *COMPILED, "impl_jax", "impl_numpy float32")


def profile(entries, device: str, rows: int = 15) -> None:
    """torch.profiler's most expensive operators (self CPU time) of one step of each torch contender."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for name in ("impl_torch", BASELINE):
        if name in entries:
            with torch_profile(activities=activities) as prof:
                entries[name]()
            key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            print(f"--- {name}: one step, by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=rows))


def count_ops(function) -> tuple[int, int]:
    """(host dispatches, kernels) of one call: torch.profiler's top-level aten ops (called from
    Python, or by autograd's engine in the backward pass; `ops_per_step.count_ops`), and the ops
    that reach a kernel (every op dispatched, nested ones included, less views and aliases: on a
    GPU each is a launch or a host-device copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ops_per_step import count_ops as profiled

    class Kernels(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (func.is_view or func.__name__.split(".")[0] in ("detach", "alias", "lift_fresh")):
                Kernels.count += 1
            return func(*args, **(kwargs or {}))

    top, _ = profiled(function)
    with Kernels():
        function()
    return top, Kernels.count


def report_ops(device: str) -> None:
    """Ops of one step of each torch contender, by part (counted twice: profiler, then dispatch)."""
    print(f"{'ops of one step':<22}{'loss and gradients':>26}{'optimizer':>22}{'step':>22}   (host dispatches / kernels)")
    for name, (loss, update) in PARTS.items():
        counted = [count_ops(loss), count_ops(update)]
        total = tuple(map(sum, zip(*counted)))
        print(f"{name:<22}" + "".join(f"{f'{top} / {kernels}':>22}" for top, kernels in counted + [total]))
    if device == "cpu":
        print(f"(on the CPU, {BASELINE}'s torch.optim.Adam takes its for-loop over the tensors; on CUDA its default "
              "is foreach, fewer ops: compare the loss-and-gradients column across devices)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small config and few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: dtype bfloat16 with param_dtype float32, against torch.autocast(bfloat16)")
    parser.add_argument("--contenders", default=",".join(name for name in ALL if name not in ("impl_torch eager", "impl_torch compiled")),
                        help=f"comma-separated, from {', '.join(ALL)} ({BASELINE} is always run; by default all "
                             "but impl_torch eager and impl_torch compiled; the CUDA compile modes on CUDA only)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 8; --quick 4)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables, then time")
    parser.add_argument("--ops", action="store_true",
                        help="count the torch ops of one step of each torch contender (host dispatches, kernels), then time")
    args = parser.parse_args(argv)
    wanted = set(args.contenders.split(",")) | {BASELINE}
    if unknown := wanted - set(ALL):
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(ALL)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (torch.cuda.is_available() is False); nothing measured")
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config, batch, src_len, tgt_len = workload(args.quick)
    batch = args.batch or batch
    rounds = args.rounds or (3 if args.quick else 7)
    params = init_params(config, seed=0, dtype=np.float32)
    src, tgt, labels = batch_of(config, batch, src_len, tgt_len)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"config d_model={config.d_model} layers={config.n_encoder_layers}+{config.n_decoder_layers} "
          f"vocab={config.tgt_vocab_size}; batch {batch}, lengths {src_len}/{tgt_len}; {args.dtype}; "
          f"torch {torch.__version__}, {where}; {(labels != config.pad_id).sum()} of {labels.size} labels count")
    entries, skipped = contenders(config, params, src, tgt, labels, args.device, args.dtype, wanted)
    for name, run in entries.items():  # warm-up (allocator, first-call paths; impl_torch's graph, recorded
        run()                           # at the second call of its shapes)
        run()
    if args.profile:
        profile(entries, args.device)
    if args.ops:
        report_ops(args.device)
    times = {name: [] for name in entries}
    names = list(entries)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            started = time.perf_counter()
            entries[name]()
            times[name].append(time.perf_counter() - started)
        print(f"round {r + 1}: " + ", ".join(f"{name} {times[name][-1] / times[BASELINE][-1]:.2f}x"
                                              for name in names if name != BASELINE)
              + f" (nn.Transformer {times[BASELINE][-1] * 1e3:.0f} ms)", flush=True)
    compiled = compiled_name(None) if compiled_name(None) in times else BASELINE
    print(f"{'contender':<38}{'median step':>14}{'ratio to ' + BASELINE:>26}{'x ' + compiled:>28}{'target':>10}")
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(times[name], times[BASELINE]))
        to_compiled = statistics.median(t / b for t, b in zip(times[name], times[compiled]))
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"<= {target:.1f}x " + ("met" if ratio <= target else "MISSED"))
        print(f"{name:<38}{statistics.median(times[name]) * 1e3:>11.1f} ms{ratio:>25.2f}x{to_compiled:>27.2f}x{verdict:>16}")
    print(f"(load average {__import__('os').getloadavg()[0]:.2f}; ratios are medians of per-round ratios)")
    for line in COMPILE.values():
        print(line)
    for name, reason in skipped.items():
        print(f"{name:<22} skipped: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
