"""Measure the gradient errors the gradient tolerance table must cover:
`python -m conformance.suite.measure_gradients`.

Draws training examples from the strategy the gradient property uses (`training_cases`), and
records the worst normalised error of the loss and of every parameter's gradient against the
float64 NumPy oracle,

    e = max |actual - oracle| / scale,  scale = max(1, max |oracle| of that gradient)

(the quantity `atol` bounds, as for the forward table). Each target is measured on the examples
the property holds it to: below float64, examples whose ReLU inputs come within the target
dtype's forward tolerance of the kink are left out (`runner.relu_kink_distance`), and half
precision is measured only in its domain (`in_gradient_domain`: weight scale <= 1, attention
temperature <= 1); the count printed is of the examples measured, per target. Targets: every
CPU target of `--backends` whose `Model` has `loss_and_grads`, at the dtypes of `--dtypes`
(float32 and float64 unless asked; a backend that cannot run a dtype is listed with the error
its `Model` raises), plus, with
`--torch-autograd`, PyTorch's own autograd through `impl_torch.Model` and `F.cross_entropy`
(float32 and float64), the reference a port's gradients are expected to follow. A -inf fill runs
that reference with -1e9 (docs/training.md: PyTorch's autograd turns fully masked rows into
0 x NaN; the finite fill changes no counted position).

`--sweep` measures instead how the error grows with size (docs/tolerances.md, "Gradients in half
precision"): one seeded model per point of three one-factor sweeps around d_model 32, 16 tokens,
2 layers a side, and the upper-envelope power law e <= c * D^a * L^b * N^g per dtype, fitted as
`benchmarks/tolerance_law.py` fits the forward laws.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings

from conformance.check import backends
from conformance.check.backends import Target
from conformance.check.compare import tensor_scale
from conformance.check.tolerances import in_gradient_domain, tolerance
from conformance.core.errors import InputError
from conformance.suite import runner
from conformance.suite.measure import fit_law
from conformance.suite.strategies import Case, TrainingCase, training_cases

DTYPES = ("float64", "float32", "float16", "bfloat16")


def error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual.astype(np.float64) - expected).max()) / tensor_scale(expected)


def torch_autograd(training, dtype: str) -> dict[str, np.ndarray]:
    import torch
    import torch.nn.functional as F

    impl_torch = backends.import_backend("torch")  # its surface (conformance.core.surface), by name

    case = training.case
    config = case.config.replace(mask_fill=-1e9) if math.isinf(case.config.mask_fill) else case.config
    with impl_torch.full_precision():
        model = impl_torch.Model(config, case.params(), dtype)
        logits = model(torch.tensor(case.src_ids), torch.tensor(case.tgt_ids)).logits
        loss = F.cross_entropy(logits.reshape(-1, config.tgt_vocab_size), torch.tensor(training.labels).reshape(-1),
                               ignore_index=config.pad_id, label_smoothing=training.label_smoothing)
        loss.backward()
    return {"loss": loss.detach().numpy(), **{n: p.grad.numpy() for n, p in model.named_parameters()}}


def measured(dtype: str, case, kink: float) -> bool:
    """Whether the gradient property holds a target of `dtype` to `case`, whose ReLU inputs stay
    `kink` from 0 (`runner.relu_kink_distance`): in the gradient domain (`in_gradient_domain`),
    and below float64 with ReLU inputs further from the kink than the dtype's forward tolerance."""
    return (in_gradient_domain(dtype, case.config, case.scale)
            and (dtype == "float64" or kink > tolerance(dtype).atol))


def measure(examples: int, seed: int, targets: list[Target], autograd: bool) -> dict:
    worst: dict[str, tuple[float, str, str]] = defaultdict(lambda: (0.0, "", ""))
    counts: dict[str, int] = defaultdict(int)
    drawn = 0

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(training=training_cases())
    def probe(training):
        nonlocal drawn
        drawn += 1
        runs = [(t.label, t.dtype, lambda t=t: runner.gradients(t, training)) for t in targets]
        if autograd:
            runs += [(f"torch autograd/{d}", d, lambda d=d: torch_autograd(training, d))
                     for d in ("float32", "float64")]
        kink = runner.relu_kink_distance(training.case)
        runs = [run for run in runs if measured(run[1], training.case, kink)]
        if not runs:
            return
        expected = runner.gradients(runner.ORACLE, training)
        for label, _, run in runs:
            counts[label] += 1
            got = run()
            for name, value in expected.items():
                e = error(got[name], value)
                if not e <= worst[label][0]:  # NaN counts as worst
                    worst[label] = (e, name, training.case.config.summary())

    import hypothesis

    started = time.perf_counter()
    hypothesis.seed(seed)(probe)()
    return {"drawn": drawn, "examples": dict(counts), "seconds": time.perf_counter() - started, "worst": dict(worst)}


# -- How the error grows with size (--sweep) ---------------------------------------------------
# Post-LN "paper" models with GELU (ReLU's kink would put whole units' contributions into the
# error: see `measured`), seeded weights at scale 1 (half precision's domain), batches of two
# full-length rows, label smoothing 0.1; each sweep varies one factor around SWEEP_BASE.
SWEEP_BASE = {"d_model": 32, "length": 16, "depth": 2}
SWEEPS = {"d_model": (16, 32, 64, 128, 256), "length": (4, 16, 64, 256), "depth": (1, 2, 4, 6)}
SWEEP_VOCAB = 256


def sweep_points() -> list[dict[str, int]]:
    """The base point and every sweep point, each once."""
    out = []
    for name, values in SWEEPS.items():
        out += [point for point in ({**SWEEP_BASE, name: v} for v in values) if point not in out]
    return out


def sweep_case(point: dict[str, int], seed: int) -> TrainingCase:
    from conformance.core.presets import preset

    d, length, depth = point["d_model"], point["length"], point["depth"]
    config = preset("paper", d_model=d, n_heads=max(2, d // 32), d_ff=4 * d, activation="gelu",
                    n_encoder_layers=depth, n_decoder_layers=depth, max_len=length,
                    src_vocab_size=SWEEP_VOCAB, tgt_vocab_size=SWEEP_VOCAB)
    rng = np.random.default_rng([seed, d, length, depth])
    src, tgt, labels = rng.integers(1, SWEEP_VOCAB, size=(3, 2, length))  # pad_id 0 never drawn
    return TrainingCase(case=Case(config=config, seed=seed, scale=1.0, src_ids=src, tgt_ids=tgt),
                        labels=labels, label_smoothing=0.1)


def sweep(targets: list[Target], seeds: list[int]) -> list[dict]:
    rows = []
    for point in sweep_points():
        started = time.perf_counter()
        worst: dict[str, float] = {}
        for seed in seeds:
            training = sweep_case(point, seed)
            expected = runner.gradients(runner.ORACLE, training)
            for target in targets:
                got = runner.gradients(target, training)
                e = max(error(got[name], value) for name, value in expected.items())
                worst[target.label] = max(worst.get(target.label, 0.0), e)
        rows.append({**point, **worst})
        print(f"  {point}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
              + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", default="float32,float64", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--backends", default="numpy,torch,jax")
    parser.add_argument("--torch-autograd", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="the size sweep and its law instead of drawn examples")
    parser.add_argument("--seeds", type=int, default=2, help="--sweep: models per point")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        parser.error(f"--dtypes: unknown {unknown}; known: {', '.join(DTYPES)}")
    try:
        names = backends.requested_backends(args.backends)
    except ValueError as exc:
        parser.error(str(exc))
    targets, skipped = gradient_targets(names, dtypes)
    for label, reason in skipped.items():
        print(f"skipped {label}: {reason}")
    if args.sweep:
        rows = sweep(targets, list(range(args.seeds)))
        for dtype in dtypes:
            errors = [max([v for k, v in r.items() if k.endswith(f"/{dtype}")], default=0.0) for r in rows]
            if any(errors):
                c, a, b, g = fit_law(rows, errors)
                print(f"{dtype}: e <= {c:.2g} * D^{a:.2f} * L^{b:.2f} * N^{g:.2f}  (worst {max(errors):.2e})")
        return 0
    result = measure(args.examples, args.seed, targets, args.torch_autograd)
    print(f"{result['drawn']} examples drawn in {result['seconds']:.0f} s")
    for label, (e, name, config) in sorted(result["worst"].items()):
        print(f"{label:<26} {e:12.3e}  ({result['examples'][label]} examples)  {name} / {config}")
    return 0


def gradient_targets(names: list[str], dtypes: list[str]) -> tuple[list[Target], dict[str, str]]:
    """The CPU targets of `names` x `dtypes` that run `loss_and_grads` (not the oracle itself), and
    why each other one is left out: an uninstalled backend, one without `loss_and_grads`, or the
    typed error its `Model` raises for a dtype it cannot run."""
    targets, skipped = [], {}
    for name in names:
        for dtype in dtypes:
            target = Target(name, "cpu", dtype)
            if target == runner.ORACLE:
                continue
            try:
                if not runner.has_gradients(target):
                    skipped[target.label] = "the backend has no loss_and_grads"
                    continue
            except ImportError as exc:
                skipped[target.label] = f"not installed ({exc})"
                continue
            refused = refusal(target)
            if refused:
                skipped[target.label] = refused
            else:
                targets.append(target)
    return targets, skipped


def refusal(target: Target) -> str | None:
    """The error a one-layer model of `target` raises when built, as "InputError: ..."; None when it builds."""
    from conformance.core.config import ModelConfig
    from conformance.core.params import init_params

    config = ModelConfig(src_vocab_size=8, tgt_vocab_size=8, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                         n_decoder_layers=1, max_len=4)
    try:
        backends.build(target, config, init_params(config))
    except InputError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
