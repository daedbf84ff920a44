"""The `torch-compiled` target (conformance/check/targets/torch_compiled.py): every property of the suite
passes through the torch.compile'd model on the CPU, and a break that only the compiled code
takes is caught.

A bounded, designed subset of the `ci` profile: a property runs its covering examples (every
value of every switch and padding kind, `conformance.suite.covering`) and no drawn ones, at one
dtype it runs (float32 where it may; the gradients at float64, as the `ci` profile runs a
compiling backend's), on the CPU. The whole suite's run goes through torch.compile's `aot_eager`
backend (TorchDynamo's graphs and AOTAutograd's functionalised forward and backward, without
Inductor's C++ code generation, which costs ~25 CPU-seconds a graph on this machine); Inductor
itself runs the forward property on one covering row. Under the `ci` profile only the properties
whose graphs the forward property's compiles serve run here (`CI_PROPERTIES`); `thorough` runs
them all. `rosetta conformance --backends torch-compiled` runs the whole `ci` profile with Inductor.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from hypothesis import Phase, given, settings

import conformance.suite
from thorough import thorough_only
from breaks import broken_copy, first_failure_only
from conformance.check import backends
from conformance.check.backends import Target
from conformance.suite.covering import coverage_problems, covering_cases, recording
from conformance.suite.strategies import cases, with_examples

torch = pytest.importorskip("torch")
compiled_torch = importlib.import_module("conformance.check.targets.torch_compiled")

# One xdist worker for the whole file: the properties share the compiled graphs of the forward
# property's covering configs (TorchDynamo's cache is per process). Split across two workers, the
# forward and encode-decode properties each paid ~35 s for the same graphs; in one process the
# second takes 0.2 s.
pytestmark = pytest.mark.xdist_group("torch-compiled")

NAME = "torch-compiled"
# Properties whose examples are no model runs on the compiled code, or that run only on CUDA:
# the SDPA kernels are run on the CPU's kernels like tests/suite/test_gpu_parts.py does.
NOT_HYPOTHESIS = {"test_coverage"}


def properties():
    """(module, property function) for every property of the suite."""
    for info in pkgutil.iter_modules(conformance.suite.__path__):
        if not info.name.startswith("test_") or info.name in NOT_HYPOTHESIS:
            continue
        module = importlib.import_module(f"conformance.suite.{info.name}")
        for name, prop in inspect.getmembers(module):
            if name.startswith("test_") and callable(prop):
                yield info.name, prop


def dtype_for(prop) -> str:
    """The dtype a property runs here: float32 unless its marker leaves it out; the gradients'
    float64 (the `ci` profile's choice for a compiling backend)."""
    marks = {m.name: m.args for m in getattr(prop, "pytestmark", [])}
    if prop.__name__ == "test_gradients_match_the_oracle":
        return "float64"
    allowed = marks.get("dtypes") or ("float32",)
    return "float32" if "float32" in allowed else allowed[0]


@pytest.fixture
def compile_with(monkeypatch):
    def choose(backend: str):
        monkeypatch.setenv(compiled_torch.BACKEND_ENV, backend)
    return choose


@pytest.fixture
def covering_only():
    """Every hypothesis property that has explicit (covering) examples given those only, for the
    duration (the error properties have none: they draw bad calls on one fixed config)."""
    own = [(prop, prop._hypothesis_internal_use_settings) for _, prop in properties() if hasattr(prop, "hypothesis")]
    for prop, fixed in own:
        if getattr(prop, "hypothesis_explicit_examples", None):
            prop._hypothesis_internal_use_settings = settings(fixed, phases=[Phase.explicit], database=None)
        else:  # the error properties: as many draws as under ci, in every profile
            prop._hypothesis_internal_use_settings = settings(fixed, max_examples=25, database=None)
    yield
    for prop, fixed in own:
        prop._hypothesis_internal_use_settings = fixed


def call(prop, target: Target):
    """A property on `target` as the suite's plugin would parametrize it."""
    parameters = inspect.signature(getattr(getattr(prop, "hypothesis", None), "inner_test", prop)).parameters
    if "target_pair" in parameters:  # the compiled model against the eager one
        return prop(target_pair=(Target("torch", target.device, target.dtype), target))
    if "kernel" in parameters:
        return prop(target=target, kernel="MATH")
    return prop(target=target)


# Under `ci`, the properties whose graphs the forward property's compiles serve (the same five
# covering configs and shapes, float32): about a minute and a half of CPU in all, measured loaded.
# The others compile graphs of their own (no attention weights, explicit masks, the backward,
# each decoding step, float64, trained-scale weights): together 9 CPU-minutes (28 minutes wall on
# the loaded 2-core machine; fast_path 486 s, explicit_masks 279 s, gradients 269 s, generate
# 218 s), so they run under the `thorough` profile (`HYPOTHESIS_PROFILE=thorough pytest
# tests/runtimes/test_torch_compiled.py`: all 19 passed, one skipped as for JAX), as does the full `ci`
# profile of `rosetta conformance --backends torch-compiled`.
# test_encode_decode compiles each decoding step's graph besides (150 s of CPU, measured loaded with
# the suite beside it): thorough, as the generate property's compiled steps are.
# test_fully_masked and test_pairs (20 s together, quiet) compile graphs test_forward's rows and the
# thorough profile cover: thorough too. test_forward itself, every covering row compiled (75 s
# quiet, the most expensive test of the tree), runs under thorough; under `ci` the compiled forward
# is the one the compiled-only break below compiles and fails, on the first covering row, and
# test_masks and test_errors compile theirs.
CI_PROPERTIES = {"test_masks", "test_errors"}


@pytest.mark.parametrize("module, prop", list(properties()), ids=[m for m, _ in properties()])
def test_every_property_passes_on_the_compiled_model(module, prop, compile_with, covering_only, monkeypatch):
    if settings._current_profile == "ci" and module not in CI_PROPERTIES:
        pytest.skip(f"{module} on torch-compiled compiles graphs of its own: the thorough profile runs it "
                    "(CI time); the ci profile runs " + ", ".join(sorted(CI_PROPERTIES)))
    if module == "test_errors" and prop.__name__ == "test_bad_calls_fail_the_same_way_everywhere" \
            and settings._current_profile == "ci":
        pytest.skip("25 drawn bad calls, each a fresh compile (69 s loaded): the thorough profile runs it")
    compile_with("aot_eager")
    import conformance.suite.test_sdpa_kernels as sdpa

    monkeypatch.setattr(sdpa, "DEVICES", ("cpu", "cuda"))  # torch's kernels on the CPU, as tests/suite/test_gpu_parts.py does
    target = Target(NAME, "cpu", dtype_for(prop))
    with recording(prop.__name__) as seen:
        call(prop, target)
    if hasattr(prop, "hypothesis") and module != "test_errors":
        assert (prop.__name__, target.label) in seen, f"{module} ran nothing on {target.label}"
        assert coverage_problems(seen) == [], coverage_problems(seen)


@thorough_only("inductor's C++ kernels compile for 50-110 CPU-seconds; every CI property above runs the same "
               "graphs through aot_eager")
def test_the_forward_property_passes_under_inductor(compile_with):
    """Inductor's own kernels (fused, C++ on the CPU) on one covering row: its two graphs cost
    ~50 CPU-seconds; every row and property goes through aot_eager above."""
    compile_with("inductor")
    import conformance.suite.test_forward as forward

    inner = forward.test_every_tensor_matches_the_oracle.hypothesis.inner_test
    narrow = settings(phases=[Phase.explicit], database=None)(with_examples(covering_cases()[:1])(given(case=cases())(inner)))
    narrow(target=Target(NAME, "cpu", "float32"))
    assert "inductor" in compiled_torch.compile_stats()["backends"]


# A break only compiled code takes: the eager model is right, so only a run that really goes
# through torch.compile (not an eager fallback) can fail on it.
COMPILED_ONLY = ("torch", [(
    "    weights = softmax(scores).to(v.dtype)  # (B, H, Tq, Tk)\n",
    "    weights = softmax(scores).to(v.dtype)  # (B, H, Tq, Tk)\n"
    "    if torch.compiler.is_compiling():\n"
    "        weights = weights * 1.001\n")], {})


def compiled_copy(name: str):
    """A broken copy of impl_torch (tests/breaks.py) and the same copy compiled, both registered."""
    eager = broken_copy(name, *COMPILED_ONLY)
    module = backends.import_backend(eager)
    compiled = type(module)(f"{module.__name__}_compiled")
    compiled.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith("__")})
    compiled.Model = compiled_torch.compiled_class(module.Model)
    backends.register_backend(eager + "_compiled", compiled, like="torch")
    return eager, eager + "_compiled"


def test_a_break_only_the_compiled_model_takes_is_caught(compile_with, covering_only):
    compile_with("aot_eager")
    import conformance.suite.test_forward as forward

    eager, compiled = compiled_copy("compiled only")
    try:
        forward.test_every_tensor_matches_the_oracle(target=Target(eager, "cpu", "float32"))  # eager: right
        with pytest.raises(AssertionError) as caught, first_failure_only(forward.test_every_tensor_matches_the_oracle):
            forward.test_every_tensor_matches_the_oracle(target=Target(compiled, "cpu", "float32"))
    finally:
        backends.unregister_backend(eager)
        backends.unregister_backend(compiled)
    message = str(caught.value)
    assert message.startswith(f"{compiled} on cpu (float32) differs") and "'encoder.0.self'" in message, message[:500]


def test_a_full_cache_is_an_error_not_an_eager_fallback(compile_with, monkeypatch):
    """Past torch's recompile limit a compiled function would run eagerly: here it fails."""
    compile_with("eager")
    monkeypatch.setattr(compiled_torch, "RECOMPILE_LIMIT", 1)
    compiled_torch._compiled.cache_clear()
    torch._dynamo.reset()
    first, second = covering_cases()[:2]
    try:
        with pytest.raises(Exception, match="(?i)recompile|limit"):
            for case in (first, second):
                model = compiled_torch.Model(case.config, case.params(), "float32")
                model(case.src_ids, case.tgt_ids)
    finally:
        compiled_torch._compiled.cache_clear()
        torch._dynamo.reset()


def test_the_target_is_selectable_and_named_in_the_header(monkeypatch):
    assert "torch-compiled" in backends.known_backends() and "torch-compiled" not in backends.BACKENDS
    assert backends.requested_backends("numpy,torch-compiled") == ["numpy", "torch-compiled"]
    assert backends.kind(NAME) == "torch" and backends.compiles(NAME)
    assert backends.device_kinds(NAME) == ("cpu", "cuda")
    monkeypatch.setenv(compiled_torch.BACKEND_ENV, "aot_eager")
    assert "torch.compile backend aot_eager" in backends.version(NAME)
    monkeypatch.setenv(compiled_torch.BACKEND_ENV, "tvm")
    with pytest.raises(ValueError, match="ROSETTA_TORCH_COMPILE='tvm'"):
        compiled_torch.compile_backend()
