"""impl_torch's training step replayed from a CUDA graph against the same step run eagerly, at a
realistic size on a CUDA device: losses, gradients and parameters compared bit for bit, and the
memory each keeps.

    python benchmarks/train_graphs.py                         # base config, batch 32, lengths 64, 4 steps
    python benchmarks/train_graphs.py --dtypes float32 --steps 8

For each dtype (float32; bfloat16 with float32 parameters), three models from the same weights take
the same training steps (`loss_and_grads`, then `impl_torch.Adam.step`) on different padded
batches: one with the graphs (impl_torch/graphs.py: eager at the first call of a shape, recorded
at the second, replayed after), one eager (`impl_torch.graphs.switched_off()`), and a second eager one, which
says whether the GPU's kernels are deterministic run to run (if not, bit-for-bit equality cannot be
expected and the differences are printed). tests/backends/torch/test_torch_train_graphs.py makes the same
comparison at a small size. Without CUDA the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import workload  # noqa: E402
from bench_train import EPSILON, batch_of  # noqa: E402

import impl_torch  # noqa: E402
from conformance import init_params  # noqa: E402

DTYPES = {"float32": ("float32", None), "bfloat16": ("bfloat16", "float32")}
GIB = 2 ** 30


def steps(config, params, dtype: str, batches, graphed: bool):
    """(every step's loss and gradients, the parameters after, a line on memory) of one model."""
    compute, stored = DTYPES[dtype]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = impl_torch.Model(config, params, compute, device="cuda", param_dtype=stored)
    optimizer = impl_torch.Adam(model, config.d_model)
    taken = []
    for src, tgt, labels in batches:
        if graphed:
            loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=EPSILON)
        else:
            with impl_torch.graphs.switched_off():
                loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=EPSILON)
        taken.append({"loss": loss.clone(), **{name: g.clone() for name, g in grads.items()}})
        optimizer.step(grads)
    del loss, grads
    torch.cuda.synchronize()
    rooms = len(model.__dict__.get("_train_rooms", {}))
    kept = sum(t.numel() * t.element_size() for step in taken for t in step.values())  # this script's copies
    memory = (f"{rooms} graph(s); held after the steps {(torch.cuda.memory_allocated() - base - kept) / GIB:.2f} GiB "
              f"(the model, Adam's moments and the graph's pool; not this script's {kept / GIB:.2f} GiB of copies), "
              f"peak {(torch.cuda.max_memory_allocated() - base) / GIB:.2f} GiB (with the copies so far)")
    after = {name: t.clone() for name, t in model.state_dict().items()}
    impl_torch.graphs.release(model)
    return taken, after, memory


def compare(a, b) -> str:
    (steps_a, params_a, _), (steps_b, params_b, _) = a, b
    same = all(torch.equal(x[k], y[k]) for x, y in zip(steps_a, steps_b) for k in x)
    same_params = all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    worst = max(float((x[k].double() - y[k].double()).abs().max()) for x, y in zip(steps_a, steps_b) for k in x)
    worst_param = max(float((params_a[k].double() - params_b[k].double()).abs().max()) for k in params_a)
    return (f"losses and gradients of every step {'bit for bit' if same else 'DIFFER'}, parameters after "
            f"{'bit for bit' if same_params else 'DIFFER'} (largest difference {worst:.3g}; "
            f"parameters {worst_param:.3g})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, from float32, bfloat16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): CUDA graphs need one; nothing compared")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    config, _, src_len, tgt_len = workload(False)
    params = init_params(config, seed=0, dtype=np.float32)
    batches = [batch_of(config, args.batch, src_len, tgt_len, seed=seed) for seed in range(args.steps)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; base config, batch {args.batch}, "
          f"lengths {src_len}/{tgt_len}, {args.steps} steps")
    failed = False
    for dtype in args.dtypes.split(","):
        runs = {kind: steps(config, params, dtype, batches, kind == "graphed")
                for kind in ("graphed", "eager", "eager again")}
        for kind, (_, _, memory) in runs.items():
            print(f"{dtype:<9} {kind:<12} {memory}")
        deterministic = compare(runs["eager again"], runs["eager"])
        print(f"{dtype:<9} eager again against eager: {deterministic}")
        print(f"{dtype:<9} graphed against eager:     {compare(runs['graphed'], runs['eager'])}")
        failed |= "DIFFER" in compare(runs["graphed"], runs["eager"]) and "DIFFER" not in deterministic
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
