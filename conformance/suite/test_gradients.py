"""Property: the loss and every parameter's gradient agree with the float64 NumPy oracle.

`model.loss_and_grads` (docs/training.md) over drawn configs, padded batches, labels and label
smoothing, compared gradient by gradient in backward order (the output first, the embeddings
last), within the gradient tolerance table. A backend that has no `loss_and_grads` yet is
skipped with that reason. Below float64, examples whose ReLU inputs come within the forward
tolerance of the kink are assumed away: there the two precisions may legitimately take
different branches of the derivative (`runner.relu_kink_distance`).

An adapter's frozen parameters (`build.frozen`, docs/own-backend.md: those its system never trains,
as transformers never trains Marian's final_logits_bias) are skipped by name, and its model need
not return them.

Each example calls `loss_and_grads` three times on the same model, and every call must match:
twice on its labels, then once on other labels at the same positions (`relabelled`, against its
own oracle run). A backend may run a repeated step another way. impl_torch, on a CUDA device,
records the step as a CUDA graph the second time its shapes are seen (the recording runs it
once), and replays that graph on the third call's inputs, which is what every later training step
does; a recording that fails is an error here, not a quiet fall back to eager steps. JAX runs its
compiled executable again.

Compiles are the cost here: JAX compiles `loss_and_grads` (forward and backward, ~10-15 s on two
CPU cores) for every new (config, shape, dtype). So examples are few (`EXAMPLES`: 5 under `ci`),
and under `ci` a compiling backend runs them in float64 only, where the claim is tightest; its
float32 path is the same traced code. Other profiles run every dtype.

Half precision (float16, bfloat16: the table's measured half-precision gradient rows) runs
outside `ci` only, so that CI time is unchanged; the NumPy backend has no half precision. It is
held to the domain where the rows were measured (`tolerances.in_gradient_domain`: weight
scale <= 1 as for the forward, and no attention temperature above 1), and its ReLU exclusion is
its own forward tolerance, which leaves out nearly every ReLU model (docs/tolerances.md,
"Gradients in half precision").
"""

import warnings

import pytest
from hypothesis import assume, given, settings

from conformance.check import backends
from conformance.check.compare import assert_close
from conformance.check.tolerances import gradient_tolerance, tolerance
from conformance.core.params import param_shapes
from conformance.suite import runner
from conformance.suite.covering import covering_training_cases
from conformance.suite.differences import judged
from conformance.check.tolerances import HALF, in_gradient_domain
from conformance.suite.strategies import relabelled, shared_examples, training_cases, with_examples


EXAMPLES = max(5, settings().max_examples // 5)  # ci: 5; thorough: 400


@pytest.mark.dtypes("float32", "float64", *HALF)
@shared_examples
@settings(max_examples=EXAMPLES)
@with_examples(covering_training_cases(), "training")
@given(training=training_cases())
def test_gradients_match_the_oracle(target, training):
    if not runner.has_gradients(target):
        pytest.skip(f"{target.label}: backend has no loss_and_grads")
    if settings._current_profile == "ci" and backends.compiles(target.backend) and target.dtype != "float64":
        pytest.skip(f"{target.label}: under ci a compiling backend's gradients run in float64 only (compile cost)")
    if settings._current_profile == "ci" and target.dtype in HALF:
        pytest.skip(f"{target.label}: under ci gradients run in float32 and float64 only (CI time); "
                    "the other profiles run half precision")
    if target.dtype in HALF:
        try:
            gradient_tolerance(target.dtype, target.device)
        except KeyError as unmeasured:  # a GPU's half-precision gradients: no row is invented for them
            pytest.skip(f"{target.label}: {unmeasured.args[0]}")
    drawn, training = training, runner.for_target(target, training)  # an adapter's: held to its switches
    case = training.case
    assume(in_gradient_domain(target.dtype, case.config, case.scale))
    if target.dtype != "float64":
        assume(runner.relu_kink_distance(case) > tolerance(target.dtype, target.device).atol)
    other = relabelled(training)
    expected, expected_other = runner.gradients(runner.ORACLE, training, other)  # one oracle model, two calls
    tol = gradient_tolerance(target.dtype, target.device)
    with warnings.catch_warnings():  # impl_torch's step could not be recorded: the replay would go unchecked
        warnings.filterwarnings("error", message="impl_torch: recording the training step")
        results = runner.gradients(target, training, training, other)
    calls = ("", " (a second call on the same model)", " (a third call on the same model, other labels)")
    frozen = runner.frozen_parameters(target, case.config)  # an adapter's: never trained, not compared
    for call, got, want in zip(calls, results, (expected, expected, expected_other)):
        missing = sorted(set(want) - set(got) - frozen)
        if missing:
            raise AssertionError(f"{target.label}: loss_and_grads{call} did not return {missing[:5]}")
        extra = sorted(set(got) - set(want))
        if extra:
            raise AssertionError(f"{target.label}: loss_and_grads{call} returned gradients for unknown names "
                                 f"{extra[:5]}")
        for name in ["loss", *reversed(list(param_shapes(case.config)))]:
            if name in frozen:
                continue
            what = ("the loss" if name == "loss" else f"gradient {name}") + call
            with judged(target, "test_gradients_match_the_oracle", drawn, case):  # an adapter's known differences
                try:
                    assert_close(got[name], want[name], tol, tensor=what, backend=target.backend, device=target.device,
                                 dtype=target.dtype,
                                 config=f"{case.config.summary()}; label_smoothing={training.label_smoothing}")
                except AssertionError as error:
                    error.tensor = name  # the first gradient that differs ("loss" for the loss)
                    raise
