"""Property: every backend's device search follows the reference search's rules on a scripted decoder.

The generate property (test_generate.py) draws its steps from random models: flat next-token
distributions, rare ties, end tokens at random. Here the decoder is a script whose logits
hypothesis draws directly (`strategies.scripted`): peaked steps, exact and near ties, early, late
and absent end tokens, long confident continuations. On each drawn script, every search rule runs
in the backend's own device search (`decode.search_steps`: the driver its `generate` runs, over
the script's step instead of the model's) and in the reference (`conformance.core.decoding.search`):
greedy search, Hugging Face's beam rule under each early_stopping (False, True, "never") and
Flax's, with both length-penalty forms (`SEARCHES`), at a drawn penalty, every beam's hypothesis
returned (so the ranking of the finished list shows). No model takes part: a difference is the
search's. A backend without `decode.search_steps` (a user's adapter) is skipped by name.

A float64 target searches in float64: the ids are the reference's exactly and the scores to
1e-12. A float32 target searches in float32 (as a float32 model's generate does) on the script
rounded to float32, which the reference reads too; it may part from the reference only at a
step where the reference had a close call within the allowance of test_generate.py (greedy
2 x atol x scale, beam search 4 x (s + 1) x atol x scale), and its scores are compared where the
ids agree. float16 and bfloat16 models search in float32 too: not run again.

Shapes are fixed: a compiling backend (JAX) compiles each of the seven searches once per dtype
(under `ci`, float64 only).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings

from conformance.check import backends
from conformance.check.backends import Target
from conformance.check.tolerances import tolerance
from conformance.core.decoding import search
from conformance.suite import runner
from conformance.suite.strategies.scripted import BATCH, BOS, EOS, MAX_LEN, PAD, VOCAB, Script, scripted_step, scripts

BEAMS = 3
# Greedy search, Hugging Face's beam rule under each early_stopping and Flax's, and each length
# penalty form with both beam rules and "never" (whose bound reads the form at max_len): seven
# programs for a compiling backend (the form is a static rule).
SEARCHES = (
    dict(num_beams=1, length_penalty_form="gnmt"),
    *(dict(num_beams=BEAMS, early_stopping=early, length_penalty_form=form, num_return_sequences=BEAMS)
      for early, form in ((False, "hf"), (True, "gnmt"), ("never", "hf"), ("never", "gnmt"))),
    *(dict(num_beams=BEAMS, beam_rule="flax", length_penalty_form=form) for form in ("hf", "gnmt")),
)
# Twice the profile's count: an example is seven searches of a 2 x 6 x 6 table, no model (milliseconds).
EXAMPLES = 2 * settings().max_examples  # ci: 50 (a compiling backend: 3, pytest_plugin); thorough: 4000


# float64 first: pytest_plugin.all_targets keeps a ci skip reason for the dtypes after the first it skips.
@pytest.mark.dtypes("float64", "float32")
@pytest.mark.ci_compiling_dtypes("float64")
@settings(max_examples=EXAMPLES)
@given(script=scripts())
def test_device_search_follows_the_reference_rules(target, script):
    search_steps = search_steps_of(target)
    dtype = "float64" if target.dtype == "float64" else "float32"
    table = script.table.astype(dtype)  # the decoder's logits, in the search dtype
    seen = Script(table=table.astype(np.float64), length_penalty=script.length_penalty)
    for options in SEARCHES:
        options = dict(options, length_penalty=script.length_penalty, banned_ids=(PAD,))
        got = scripted_search(target, search_steps, table, options, dtype)
        trace: list[dict] = []
        expected = search(lambda tokens, parents: seen.logits(tokens), BATCH, MAX_LEN, BOS, EOS, PAD, trace=trace,
                          **options)
        assert_same_search(got, expected, trace, target, options)


def search_steps_of(target: Target):
    """The backend's `search_steps` (its decode room's), or a skip that names what is missing."""
    decode = getattr(backends.import_backend(target.backend), "decode", None)
    found = getattr(decode, "search_steps", None)
    if found is None:
        pytest.skip(f"{target.label}: the backend offers no decode.search_steps (its device search over a "
                    "scripted decoder)")
    return found


def scripted_search(target: Target, search_steps, table: np.ndarray, options: dict, dtype: str):
    """(ids, scores) of the backend's device search over the script, as host arrays."""
    from conformance.check.compare import to_numpy
    from conformance.core.config import ModelConfig
    from conformance.core.decoding import resolve

    started = time.perf_counter()
    config = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, max_len=MAX_LEN, pad_id=PAD)
    generation = resolve(config, MAX_LEN, BOS, EOS, return_scores=True, **options)
    rows = options.get("num_beams", 1)
    step_data = {"table": table, "source": np.repeat(np.arange(BATCH), rows)}
    try:
        with runner.precise(target):
            ids, scores = search_steps(scripted_step, step_data, BATCH, VOCAB, PAD, generation, dtype, target.device)
            return to_numpy(ids).astype(np.int64), to_numpy(scores).astype(np.float64)
    finally:
        runner.TIMINGS[target.label] += time.perf_counter() - started


def assert_same_search(got, expected, trace: list[dict], target: Target, options: dict) -> None:
    """The reference's ids (and scores), or in float32 a parting at a close call (module docstring)."""
    __tracebackhide__ = True
    (ids, scores), (ref_ids, ref_scores) = got, expected
    returned = options.get("num_return_sequences", 1)
    how = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "banned_ids")
    same = ids.shape == ref_ids.shape and (ids == ref_ids).all()
    if not same:
        width = min(ids.shape[1], ref_ids.shape[1])
        differs = ids[:, :width] != ref_ids[:, :width]
        rows, steps = np.nonzero(differs) if differs.any() else (np.array([0]), np.array([width]))
        first = int(np.argmin(steps))
        row, step = int(rows[first]), int(steps[first])
        closest, allowed = closest_call(trace, row // returned, step, target, options)
        if target.dtype == "float64" or closest > allowed:
            raise AssertionError(
                f"{target.label}: the device search chose other ids than the reference at step {step}, row {row} "
                f"({how}): got {ids[row].tolist()}, reference {ref_ids[row].tolist()}; the reference's closest "
                f"score gap up to that step is {closest:.3g}"
                + ("" if target.dtype == "float64" else f", more than the {target.dtype} allowance {allowed:.3g}"))
        return
    rtol = 1e-12 if target.dtype == "float64" else 1e-5
    bad = ~np.isclose(scores, ref_scores, rtol=rtol, atol=0.0)
    if bad.any():
        row = int(np.argmax(bad))
        raise AssertionError(f"{target.label}: the device search's score of row {row} is {scores[row]!r}, the "
                             f"reference's {ref_scores[row]!r} (rtol {rtol:g}; {how}); ids {ids[row].tolist()}")


def closest_call(trace: list[dict], source: int, step: int, target: Target, options: dict) -> tuple[float, float]:
    """The reference's closest call of a source row up to `step` and its allowance at the target's
    dtype (test_generate.py's law), as (gap, allowance) of the step nearest to its allowance."""
    atol = tolerance(target.dtype, target.device).atol
    greedy = options.get("num_beams", 1) == 1 and options.get("beam_rule", "hf") == "hf"
    closest, allowed = np.inf, 0.0
    for s, record in enumerate(trace[:step + 1]):
        allowance = (2.0 if greedy else 4.0 * (s + 1)) * atol * float(record["scale"][source])
        gap = float(record["gap"][source])
        if gap - allowance < closest - allowed:
            closest, allowed = gap, allowance
    return closest, allowed
