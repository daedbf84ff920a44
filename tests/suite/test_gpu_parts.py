"""Meta-tests of the suite's GPU-only parts, run on the CPU (no GPU here: the properties' CUDA
targets are skipped with the reason, and these tests show the checks themselves work).

- Each SDPA kernel conforms on its own (conformance/suite/test_sdpa_kernels.py): run on the CPU's
  kernels, the property passes on torch and fails on a torch copy whose fast path is wrong.
- TF32 stays off: tests/breaks.py's two TF32 breaks are caught by the forward properties
  (tests/suite/test_has_teeth.py runs them); here, `runner.precision_problems` names the switch.
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


def test_a_kernel_that_refuses_every_example_is_skipped_with_torchs_reason(on_the_cpu):
    target = Target("torch", "cpu", "float64")
    with pytest.raises(pytest.skip.Exception) as skipped, sdpa.watch_examples(target, "EFFICIENT_ATTENTION"):
        sdpa_property(target=target, kernel="EFFICIENT_ATTENTION")
    assert "EFFICIENT_ATTENTION kernel ran none of the examples; torch refused each: " in str(skipped.value)
    reasons = sdpa.REFUSED[(target.label, "EFFICIENT_ATTENTION")]
    assert reasons and all(reasons), reasons  # torch's own words, one per kind of refusal
    assert any(reason in str(skipped.value) for reason in reasons)
    assert sdpa.CHECKED[(target.label, "EFFICIENT_ATTENTION")] == 0


def test_a_refused_example_does_not_stop_the_kernels_other_examples(on_the_cpu, monkeypatch):
    """A kernel that refuses some inputs is still compared on the others (on the H100 one refused
    covering row used to skip the memory-efficient kernel in half precision altogether)."""
    run = runner.run
    calls = []

    target = Target("torch", "cpu", "float32")

    def refuse_every_other_example(run_target, *args, **kwargs):  # the kernel refuses the 1st, 3rd, ... example
        # Only the kernel's runs: the oracle's go through runner.run too, when this process has
        # not cached them yet (run alone, this test used to plant its refusal in the oracle).
        if run_target == target:
            calls.append(1)
            if len(calls) % 2:
                raise RuntimeError("No available kernel. Aborting execution. (planted)")
        return run(run_target, *args, **kwargs)

    monkeypatch.setattr(runner, "run", refuse_every_other_example)
    with sdpa.watch_examples(target, "MATH"):
        sdpa_property(target=target, kernel="MATH")
    key = (target.label, "MATH")
    assert sdpa.CHECKED[key] > 0 and sdpa.REFUSED[key] == {"No available kernel. Aborting execution. (planted)"}


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
