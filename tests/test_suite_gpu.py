"""Meta-tests of the suite's GPU-only parts, run on the CPU (no GPU here: the properties' CUDA
targets are skipped with the reason, and these tests show the checks themselves work).

- Each SDPA kernel conforms on its own (conformance/suite/test_sdpa_kernels.py): run on the CPU's
  kernels, the property passes on torch and fails on a torch copy whose fast path is wrong.
- TF32 stays off: tests/breaks.py's two TF32 breaks are caught by the forward properties
  (tests/test_suite_has_teeth.py runs them); here, `runner.precision_problems` names the switch.
- JAX GPU runs state whether they are deterministic (`pytest_plugin.jax_gpu_determinism`).
"""

import pytest

from breaks import PROPERTY_BREAKS, broken_copy, first_failure_only
from conformance.check import backends
from conformance.check.backends import Target
from conformance.suite import pytest_plugin, runner
import conformance.suite.test_sdpa_kernels as sdpa

torch = pytest.importorskip("torch")
sdpa_property = sdpa.test_each_sdpa_kernel_matches_the_oracle


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(sdpa, "DEVICES", ("cpu", "cuda"))


def test_the_sdpa_property_passes_with_torchs_math_kernel_on_the_cpu(on_the_cpu):
    sdpa_property(target=Target("torch", "cpu", "float32"), kernel="MATH")


def test_the_sdpa_property_fails_on_a_wrong_fast_path(on_the_cpu):
    (backend, edits, patches), = PROPERTY_BREAKS["fast path returns 0 for fully masked rows"][1]
    registered = broken_copy("sdpa fast path", backend, edits, patches)
    try:
        with pytest.raises(AssertionError) as caught, first_failure_only(sdpa_property):
            sdpa_property(target=Target(registered, "cpu", "float64"), kernel="MATH")
    finally:
        backends.unregister_backend(registered)
    assert "MATH kernel" in str(caught.value)


def test_an_unavailable_kernel_is_skipped_with_torchs_reason(on_the_cpu):
    with pytest.raises(pytest.skip.Exception) as skipped:
        sdpa_property(target=Target("torch", "cpu", "float64"), kernel="EFFICIENT_ATTENTION")
    assert "EFFICIENT_ATTENTION kernel does not run these inputs" in str(skipped.value)


def test_precision_problems_name_tf32():
    full = {"float32_matmul_precision": "highest", "cuda.matmul.allow_tf32": False, "cudnn.allow_tf32": False,
            "cuda.matmul.fp32_precision": "ieee", "jax_default_matmul_precision": "highest"}
    assert runner.precision_problems(full) == []
    assert runner.precision_problems({**full, "cuda.matmul.allow_tf32": True}) == ["cuda.matmul.allow_tf32=True"]
    assert runner.precision_problems({**full, "float32_matmul_precision": "high"}) == ["float32_matmul_precision='high'"]
    assert runner.precision_problems({**full, "cuda.matmul.fp32_precision": "tf32"}) == ["cuda.matmul.fp32_precision='tf32'"]


def test_jax_gpu_runs_say_whether_they_are_deterministic(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert pytest_plugin.jax_gpu_determinism().startswith("deterministic")
    monkeypatch.delenv("XLA_FLAGS")
    assert pytest_plugin.jax_gpu_determinism().startswith("not forced deterministic")
