"""Measure the GPU rows of the tolerance table in one call: `python benchmarks/gpu_half_precision.py`.

docs/tolerances.md's GPU rows repeat the CPU rows: no GPU was lent when they were set. On a
machine with torch CUDA and/or JAX GPU, this script measures what those rows must cover, the way
the CPU rows were measured (`python -m conformance.suite.measure`): the suite's tame examples and
its long seeded sequences, every GPU target against the float64 NumPy oracle on the CPU, with
TF32 off (the suite's `full_precision`, checked here before anything runs). It prints, per dtype
and GPU target, the worst normalised error, the table's GPU atol and the margin between them,
as rows to paste into docs/tolerances.md, and exits 1 if a measured error exceeds its GPU row (a
row the GPU does not honour), 2 if there is no GPU to measure on.

    python benchmarks/gpu_half_precision.py                       # float16, bfloat16 (and float32), ~10 min on an H100
    python benchmarks/gpu_half_precision.py --examples 50 --long-examples 5   # a quick look
    python benchmarks/gpu_half_precision.py --save gpu_rows.json

The examples are the CPU measurement's (`--seed`, default 100, as docs/tolerances.md's runs), so a
GPU row can be compared with its CPU row example for example. JAX compiles every new shape: on
a GPU tens of seconds each (issue 24); `--backends torch` measures torch CUDA alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GPU_DEVICES = "cuda,gpu"


def gpu_targets(names: list[str]) -> list[str]:
    """The GPU device kinds present for the requested backends ("cuda" torch, "gpu" JAX)."""
    from conformance.check import backends

    present = []
    for name, reason in backends.availability(names).items():
        if reason is None:
            present += [f"{name}/{d}" for d in backends.present_devices(name) if d != "cpu"]
    return present


def precision_check(names: list[str]) -> list[str]:
    """The reduced-precision switches still on inside the suite's `full_precision` (none, or TF32 is not off)."""
    from conformance.check import backends
    from conformance.suite.runner import precision_problems

    problems = []
    for name in names:
        with backends.full_precision(name):
            problems += [f"{name}: {p}" for p in precision_problems(backends.precision_settings(name))]
    return problems


def rows(result: dict, tolerance_of) -> tuple[list[str], bool]:
    """Markdown rows `| target | measured worst | atol | margin | tensor |` (the atol of the target's
    device kind: the GPU row on a GPU) and whether any row is exceeded."""
    out, exceeded = [], False
    for label, (error, tensor, config) in sorted(result["worst"].items()):
        backend, device, dtype = label.split("/")
        atol = tolerance_of(dtype, device).atol
        margin = atol / error if error else float("inf")
        exceeded |= error > atol
        flag = "  EXCEEDS THE ROW" if error > atol else ""
        out.append(f"| {label} | {error:.2e} | {atol:g} | {margin:.1f}x | {tensor} |{flag}")
    for label, (error, tensor, _) in sorted(result["pairs"].items()):
        out.append(f"| pair {label} | {error:.2e} | | | {tensor} |")
    return out, exceeded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float16,bfloat16,float32", help="float32 shows TF32 is off")
    parser.add_argument("--backends", default="numpy,torch,jax",
                        help="numpy: the CPU oracle only; GPU targets are torch/jax")
    parser.add_argument("--examples", type=int, default=250, help="tame examples (`cases`)")
    parser.add_argument("--long-examples", type=int, default=30, help="long seeded examples (512-2048 tokens), float16")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--save", help="write the measurements to this JSON file")
    parser.add_argument("--devices", default=GPU_DEVICES,
                        help="the device kinds measured (cpu only to try the script without a GPU: the CPU rows)")
    args = parser.parse_args(argv)

    from conformance.check import backends

    names = backends.requested_backends(args.backends)
    found = gpu_targets(names)
    if not found and args.devices == GPU_DEVICES:
        print("no GPU here: torch.cuda.is_available() is False and jax.devices('gpu') found none; "
              "the GPU rows stay unmeasured (docs/tolerances.md)", file=sys.stderr)
        return 2
    problems = precision_check(names)
    if problems:
        print(f"full_precision() leaves reduced precision on, nothing measured: {problems}", file=sys.stderr)
        return 1
    before = os.environ.get("ROSETTA_DEVICES")
    os.environ["ROSETTA_DEVICES"] = args.devices  # the GPU targets; the oracle is always numpy on the CPU
    try:
        return measure_all(args, names, found)
    finally:
        if before is None:
            os.environ.pop("ROSETTA_DEVICES", None)
        else:
            os.environ["ROSETTA_DEVICES"] = before


def measure_all(args, names: list[str], found: list[str]) -> int:
    """The measurement, with $ROSETTA_DEVICES selecting the devices measured."""
    from conformance.check import backends
    from conformance.check.tolerances import long_half_tolerance, tolerance
    from conformance.suite.measure import measure

    print(f"devices {args.devices}; GPU targets present: {found}; versions: {[backends.version(n) for n in names]}")
    saved, exceeded = {}, False
    plans = [("cases", args.examples, args.dtypes.split(","), tolerance),
             ("long-seeded", args.long_examples, ["float16"], long_half_tolerance)]
    for strategy, examples, dtypes, tolerance_of in plans:
        if examples <= 0:
            continue
        result = measure(examples, dtypes, names, args.seed, strategy)
        print(f"\n{strategy}: {result['examples']} examples in {result['seconds']:.0f} s (seed {args.seed})")
        print("| target | measured worst | atol | margin | tensor |\n| --- | --- | --- | --- | --- |")
        lines, over = rows(result, tolerance_of)
        print("\n".join(lines))
        for label, n in result["nan_mismatch"].items():
            print(f"NaN positions differ from the oracle's in {n} tensors on {label}")
            over = True
        exceeded |= over
        saved[strategy] = {k: v for k, v in result.items() if k != "skipped"}
    if args.save:
        Path(args.save).write_text(json.dumps(saved, indent=1, default=str))
    print("\nresult:", "a GPU row is exceeded: widen it only with this measurement quoted in docs/tolerances.md"
          if exceeded else "every GPU row holds; quote these rows and margins in docs/tolerances.md")
    return 1 if exceeded else 0


if __name__ == "__main__":
    raise SystemExit(main())
