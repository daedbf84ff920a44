"""Measure the errors the tolerance table must cover: `python -m conformance.suite.measure`.

Draws examples from the same strategy as the conformance properties, runs every target and the
oracle, and records for each target the worst normalised error

    e = max over tensors and elements of |actual - oracle| / scale,  scale = max(1, max |oracle|)

(the quantity `atol` bounds, see `conformance.check.compare`), with the tensor and config where it
occurred, plus the worst pairwise error between targets of the same dtype. The numbers in
`conformance/check/tolerances.py` are these maxima times a safety margin, and docs/tolerances.md quotes
the run.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings

from conformance.check import backends

from conformance.suite import runner
from conformance.check.compare import tensor_scale
from conformance.check.report import default_targets
from conformance.suite.strategies import cases, long_seeded_cases
from conformance.check.tolerances import in_domain


def normalised_error(actual: np.ndarray, expected: np.ndarray) -> float:
    both = ~(np.isnan(actual) | np.isnan(expected))
    if not both.any():
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(actual[both] - expected[both])
        diff[actual[both] == expected[both]] = 0.0  # equal infinities
    return float(diff.max()) / tensor_scale(expected)


# What `--strategy` may name: the tame examples the table was measured on, and the long sequences
# with seeded weights the half-precision realistic property draws (`LONG_HALF_TOLERANCES`).
STRATEGIES = {"cases": cases, "long-seeded": long_seeded_cases}


def measure(examples: int, dtypes: list[str], names: list[str] | None, seed: int, strategy: str = "cases",
            source: str | None = None) -> dict:
    targets, skipped = default_targets(names, dtypes)
    worst: dict[str, tuple[float, str, str]] = defaultdict(lambda: (0.0, "", ""))
    pair_worst: dict[str, tuple[float, str, str]] = defaultdict(lambda: (0.0, "", ""))
    nan_mismatch: dict[str, int] = defaultdict(int)
    count = 0

    drawn = STRATEGIES[strategy]()
    if source is not None:  # one kind of source only (token ids, or log-mel features)
        drawn = drawn.filter(lambda case: case.config.source == source)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case=drawn)
    def probe(case):
        nonlocal count
        count += 1
        expected = runner.oracle(case)
        results = {}
        for target in targets:
            if not in_domain(target.dtype, case.scale):
                continue
            got = runner.run(target, case)
            results[target.label] = (target, got)
            for name, value in expected.items():
                if not np.array_equal(np.isnan(got[name]), np.isnan(value)):
                    nan_mismatch[target.label] += 1
                e = normalised_error(got[name], value)
                if e > worst[target.label][0]:
                    worst[target.label] = (e, name, case.config.summary())
        labels = sorted(results)
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                ta, tb = results[a][0], results[b][0]
                if ta.dtype != tb.dtype:
                    continue
                key = f"{a} ~ {b}"
                for name, value in results[b][1].items():
                    e = normalised_error(results[a][1][name], value)
                    if e > pair_worst[key][0]:
                        pair_worst[key] = (e, name, case.config.summary())

    import hypothesis

    started = time.perf_counter()
    probe = hypothesis.seed(seed)(probe)
    probe()
    return {"examples": count, "seconds": time.perf_counter() - started, "worst": dict(worst),
            "pairs": dict(pair_worst), "nan_mismatch": dict(nan_mismatch), "skipped": skipped,
            "versions": {t.backend: backends.version(t.backend) for t in targets}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--dtypes", default="float32,float64,float16,bfloat16")
    parser.add_argument("--backends", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="cases",
                        help="the examples to draw (default: the tame `cases` the table was measured on)")
    parser.add_argument("--source", choices=("ids", "features"), default=None,
                        help="only examples of this source (default: both, as the strategy draws them)")
    args = parser.parse_args(argv)
    names = backends.requested_backends(args.backends)
    result = measure(args.examples, args.dtypes.split(","), names, args.seed, args.strategy, args.source)
    print(f"{result['examples']} examples in {result['seconds']:.0f} s; {result['versions']}")
    print(f"{'target':<26} {'max |a-o|/scale':>16}  tensor / config")
    for label, (e, name, config) in sorted(result["worst"].items()):
        print(f"{label:<26} {e:16.3e}  {name} / {config}")
    print("pairs:")
    for label, (e, name, config) in sorted(result["pairs"].items()):
        print(f"{label:<40} {e:12.3e}  {name}")
    for label, n in result["nan_mismatch"].items():
        print(f"NaN-position mismatches for {label}: {n}")
    for label, reason in result["skipped"].items():
        print(f"skipped {label}: {reason}")
    return 0


def fit_law(rows: list[dict], errors: list[float]) -> tuple[float, float, float, float]:
    """(c, a, b, g): the upper-envelope power law e <= c * D^a * L^b * N^g over `rows` (each with
    "d_model", "length", "depth") and their `errors`: least-squares exponents (negative ones set to
    0: an error that shrinks with size is bounded by its value at the base), c raised to cover
    every point. benchmarks/tolerance_law.py fits the forward laws with it, measure_gradients the
    gradient ones."""
    X = np.array([[1.0, math.log(r["d_model"]), math.log(r["length"]), math.log(r["depth"])] for r in rows])
    y = np.log(np.maximum(np.array(errors), 1e-300))
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    coef[1:] = np.maximum(coef[1:], 0.0)
    lift = float(np.max(y - X @ coef))
    return float(math.exp(coef[0] + lift)), float(coef[1]), float(coef[2]), float(coef[3])


if __name__ == "__main__":
    raise SystemExit(main())
