"""Measure the gradient errors the gradient tolerance table must cover:
`python -m conformance.suite.measure_gradients`.

Draws training examples from the strategy the gradient property uses (`training_cases`), and
records the worst normalised error of the loss and of every parameter's gradient against the
float64 NumPy oracle,

    e = max |actual - oracle| / scale,  scale = max(1, max |oracle| of that gradient)

(the quantity `atol` bounds, as for the forward table). Examples whose ReLU inputs come within
float32's forward tolerance of the kink are left out, as the property leaves them out
(`runner.relu_kink_distance`); the count printed is of the examples measured. Targets: every backend target whose
`Model` has `loss_and_grads`, plus, with `--torch-autograd`, PyTorch's own autograd through
`impl_torch.Model` and `F.cross_entropy` (float32 and float64), the reference a port's
gradients are expected to follow. A -inf fill runs that reference with -1e9 (docs/training.md:
PyTorch's autograd turns fully masked rows into 0 x NaN; the finite fill changes no counted
position).
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
from conformance.check.tolerances import tolerance
from conformance.suite import runner
from conformance.suite.strategies import training_cases


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


def measure(examples: int, seed: int, targets: list[Target], autograd: bool) -> dict:
    worst: dict[str, tuple[float, str, str]] = defaultdict(lambda: (0.0, "", ""))
    count = 0

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(training=training_cases())
    def probe(training):
        nonlocal count
        if runner.relu_kink_distance(training.case) <= tolerance("float32").atol:
            return  # ReLU's kink within float32 rounding: the property assumes such cases away
        count += 1
        expected = runner.gradients(runner.ORACLE, training)
        results = {t.label: runner.gradients(t, training) for t in targets}
        if autograd:
            for dtype in ("float32", "float64"):
                results[f"torch autograd/{dtype}"] = torch_autograd(training, dtype)
        for label, got in results.items():
            for name, value in expected.items():
                e = error(got[name], value)
                if not e <= worst[label][0]:  # NaN counts as worst
                    worst[label] = (e, name, training.case.config.summary())

    import hypothesis

    started = time.perf_counter()
    hypothesis.seed(seed)(probe)()
    return {"examples": count, "seconds": time.perf_counter() - started, "worst": dict(worst)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-autograd", action="store_true")
    args = parser.parse_args(argv)
    targets = [t for t in (Target("numpy", "cpu", "float32"), Target("torch", "cpu", "float32"),
                           Target("torch", "cpu", "float64"), Target("jax", "cpu", "float32"),
                           Target("jax", "cpu", "float64")) if _has(t)]
    result = measure(args.examples, args.seed, targets, args.torch_autograd)
    print(f"{result['examples']} examples in {result['seconds']:.0f} s")
    for label, (e, name, config) in sorted(result["worst"].items()):
        print(f"{label:<26} {e:12.3e}  {name} / {config}")
    return 0


def _has(target: Target) -> bool:
    try:
        return runner.has_gradients(target)
    except ImportError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
