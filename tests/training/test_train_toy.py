"""examples/train_toy.py --backend numpy|torch|jax: the toy trains through the shared training API
in every backend, and in float64 the runs stay together step by step (same seeded batches, same
seeded weights). The claim: losses within 1e-10 relative, parameters within 1e-9 after the steps.

A few steps at batch 8 here (the whole CI budget); the 50-step run of the issue is the same call
(`python examples/train_toy.py --backend jax --steps 50`), measured in docs/training.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from conformance.check.training import host_params

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_toy.py"
STEPS, BATCH = 12, 8


def script():
    spec = importlib.util.spec_from_file_location("train_toy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def torch_run():
    return script().train_in("torch", STEPS, batch=BATCH, log=lambda line: None)


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_the_toy_trains_the_same_in_every_backend_in_float64(backend, torch_run):
    reference_model, reference_losses = torch_run
    assert reference_losses[-1] < reference_losses[0], "the toy must actually train"
    model, losses = script().train_in(backend, STEPS, batch=BATCH, log=lambda line: None)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-10, err_msg=f"{backend} losses vs torch")
    if backend == "jax":
        from impl_jax import enable_x64

        with enable_x64():
            params = host_params(model)
    else:
        params = host_params(model)
    expected = host_params(reference_model)
    worst = max(float(np.abs(params[name] - expected[name]).max()) for name in expected)
    assert worst <= 1e-9, f"{backend}: parameters {worst:.2e} from torch's after {STEPS} steps"
