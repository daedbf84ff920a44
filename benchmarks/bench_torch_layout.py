"""Is impl_torch's weight layout a lever for its training step? Products timed alone, side by side.

    python benchmarks/bench_torch_layout.py               # CPU, float32, 40 rounds
    python benchmarks/bench_torch_layout.py --rounds 80 --device cuda

impl_torch stores each weight as the paper writes it, W (d_in, d_out), and multiplies
`F.linear(x, W.T, b)`; nn.Transformer stores (d_out, d_in) and multiplies `F.linear(x, W, b)`, so
the two hand BLAS the same product with other transpositions (docs/training.md). For each linear
shape of the base model (d_model 512, d_ff 2048) on (8, 64, d_in) inputs, one forward and backward
(`.backward(dy)`: the input's, the weight's and the bias's gradients) is timed for

    ours         W (d_in, d_out), F.linear(x, W.T, b): what impl_torch does
    (out, in)    W (d_out, d_in), F.linear(x, W, b): nn.Transformer's layout
    copy         ours with W.T.contiguous() under autograd: the (out, in) layout bought per call

and the query, key and value projections as three 512 -> 512 products against one packed
512 -> 1536 product (nn.Transformer's `in_proj_weight`). Calls are interleaved round by round, so
that load from other processes hits every variant alike; the report prints median times and each
variant's median per-round ratio to ours.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Leaves(list):
    """The tensors a set of variants differentiates with respect to, made here so that their
    gradients can be cleared between calls."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.device, self.dtype = device, dtype

    def new(self, *shape: int) -> torch.Tensor:
        self.append(torch.randn(*shape, device=self.device, dtype=self.dtype, requires_grad=True))
        return self[-1]

    def constant(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    def clear_grads(self) -> None:
        for leaf in self:
            leaf.grad = None


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, leaves: Leaves) -> dict[str, list[float]]:
    """Seconds per call of each variant, `rounds` rounds of one call each, after two warm-ups.
    Every gradient in `leaves` is cleared before each call, outside the timing, as a training step
    starts from none: a call writes its gradients and accumulates into nothing."""
    for run in (*variants.values(), *variants.values()):
        leaves.clear_grads()
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            leaves.clear_grads()
            sync(leaves.device)
            start = time.perf_counter()
            run()
            sync(leaves.device)
            times[name].append(time.perf_counter() - start)
    return times


def report(title: str, times: dict[str, list[float]], reference: str) -> None:
    ratios = {name: statistics.median(t / r for t, r in zip(values, times[reference])) for name, values in times.items()}
    cells = ", ".join(f"{name} {statistics.median(values) * 1e3:.2f} ms ({ratios[name]:.2f}x)"
                      for name, values in times.items())
    print(f"  {title}: {cells}")


def linear_variants(d_in: int, d_out: int, leaves: Leaves) -> dict[str, Callable[[], None]]:
    ours, theirs, bias = leaves.new(d_in, d_out), leaves.new(d_out, d_in), leaves.new(d_out)
    x = leaves.new(8, 64, d_in)
    dy = leaves.constant(8, 64, d_out)
    return {
        "ours": lambda: F.linear(x, ours.T, bias).backward(dy),
        "(out, in)": lambda: F.linear(x, theirs, bias).backward(dy),
        "copy": lambda: F.linear(x, ours.T.contiguous(), bias).backward(dy),
    }


def qkv_variants(d_model: int, leaves: Leaves) -> dict[str, Callable[[], None]]:
    x = leaves.new(8, 64, d_model)
    weights, biases = [leaves.new(d_model, d_model) for _ in range(3)], [leaves.new(d_model) for _ in range(3)]
    packed, packed_bias = leaves.new(3 * d_model, d_model), leaves.new(3 * d_model)
    dys = [leaves.constant(8, 64, d_model) for _ in range(3)]
    dy_packed = torch.cat(dys, -1)

    def three():
        outputs = [F.linear(x, w.T, b) for w, b in zip(weights, biases)]
        torch.autograd.backward(outputs, dys)

    return {"three": three, "packed": lambda: F.linear(x, packed, packed_bias).backward(dy_packed)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    dtype = getattr(torch, args.dtype)
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda (optionally cuda:N), got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {device}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{args.rounds} interleaved rounds; median time (median per-round ratio to the first variant)")
    for d_in, d_out in ((512, 512), (512, 2048), (2048, 512)):
        leaves = Leaves(device, dtype)
        variants = linear_variants(d_in, d_out, leaves)
        report(f"{d_in} -> {d_out}", interleaved(variants, args.rounds, leaves), "ours")
    leaves = Leaves(device, dtype)
    variants = qkv_variants(512, leaves)
    report("q, k, v 512 -> 512", interleaved(variants, args.rounds, leaves), "three")

if __name__ == "__main__":
    main()
