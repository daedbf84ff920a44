"""Property: every backend's device search follows the reference search's rules on a scripted decoder.

The generate property (test_generate.py) draws its steps from random models: flat next-token
distributions, rare ties, end tokens at random. Here the decoder is a script whose logits
hypothesis draws directly (`strategies.scripted`): peaked steps, exact and near ties, early, late
and absent end tokens, long confident continuations. On each drawn script, every search rule runs
in the backend's own device search (`decode.search_steps`: the driver its `generate` runs, over
the script's step instead of the model's) and in the reference (`conformance.core.generation.search.search`):
greedy search, Hugging Face's beam rule under each early_stopping (False, True, "never") and
Flax's, with both length-penalty forms (`SEARCHES`), at a drawn penalty, every beam's hypothesis
returned (so the ranking of the finished list shows). No model takes part: a difference is the
search's. A backend without `decode.search_steps` (a user's adapter) is skipped by name.

A float64 target searches in float64: the ids are the reference's exactly and the scores to
1e-12. A float32 target searches in float32 (as a float32 model's generate does) on the script
rounded to float32, which the reference reads too, and is held to the rules themselves, with the
allowances of test_generate.py (`Allowance`): every returned row is a hypothesis (no banned id,
the end token last, then padding, or max_len tokens without it), its score is its path's
recomputed in float64 within 4 x (n + 1) x atol x scale (over the length penalty), and each
source's hypotheses come best first. Greedy search: each id is within 2 x atol x scale of the
best logit after the row's own prefix. Beam search: where the ids part from the reference, the
reference had a close call at the parting step or later (where beam search decides that token);
and each source's best hypothesis is no worse than the reference's less the allowance (not under
early_stopping=True, where a tie broken the other way may stop a row at a worse list). Where the
ids agree, the scores are the reference's to 1e-5. float16 and bfloat16 models search in float32
too: not run again.

Shapes are fixed: a compiling backend (JAX) compiles each of the seven searches once per dtype
(under `ci`, float64 only).

One script in six is drawn as a late overtake (`strategies.scripted.late_overtakes`): the case
where Flax's stopping bound decides, a beam that stays open and, divided by a longer length,
beats every finished hypothesis after a bound read at its own length would have stopped. Every
profile runs one first (`late_overtake_script`), and the run records, from the reference's trace,
that the case was met (`late_overtake`): test_coverage.py fails a target that passed without it.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings

from conformance.check import backends
from conformance.check.backends import Target
from conformance.check.tolerances import tolerance
from conformance.core.generation.search import log_softmax, penalty, search
from conformance.suite import runner
from conformance.suite.covering import RECORDER
from conformance.suite.strategies import with_examples
from conformance.suite.strategies.scripted import (BATCH, BOS, EOS, MAX_LEN, PAD, VOCAB, Script, late_overtake,
                                                   late_overtake_script, scripted_step, scripts)

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
@with_examples([late_overtake_script()], "script")
@given(script=scripts())
def test_device_search_follows_the_reference_rules(target, script):
    search_steps = search_steps_of(target)
    dtype = "float64" if target.dtype == "float64" else "float32"
    table = script.table.astype(dtype)  # the decoder's logits, in the search dtype
    seen = Script(table=table.astype(np.float64), length_penalty=script.length_penalty)
    RECORDER.note(target.label, ())  # the property ran here: test_coverage.py checks what it met
    for options in SEARCHES:
        options = dict(options, length_penalty=script.length_penalty, banned_ids=(PAD,))
        got = scripted_search(target, search_steps, table, options, dtype)
        trace: list[dict] = []
        expected = search(lambda tokens, parents: seen.logits(tokens), BATCH, MAX_LEN, BOS, EOS, PAD, trace=trace,
                          **options)
        if options.get("beam_rule") == "flax" and late_overtake(trace, expected[0]):
            RECORDER.note(target.label, {("scripted case", "flax late overtake")})
        assert_same_search(got, expected, trace, target, options, seen)


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
    from conformance.core.generation.settings import resolve

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


def assert_same_search(got, expected, trace: list[dict], target: Target, options: dict, seen: Script) -> None:
    """The reference's ids and scores in float64; in float32 the rules' checks (module docstring)."""
    __tracebackhide__ = True
    (ids, scores), (ref_ids, ref_scores) = got, expected
    how = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "banned_ids")
    same = ids.shape == ref_ids.shape and (ids == ref_ids).all()
    if target.dtype == "float64":
        if not same:
            row, step = parting(ids, ref_ids)
            raise AssertionError(
                f"{target.label}: the device search chose other ids than the reference at step {step}, row {row} "
                f"({how}): got {ids[row].tolist()}, reference {ref_ids[row].tolist()}")
        assert_close_scores(scores, ref_scores, 1e-12, ids, target, how)
        return
    allowance = Allowance(seen, target)
    assert_valid_hypotheses(ids, scores, seen, allowance, target, options, how)
    if options.get("num_beams", 1) == 1:
        assert_greedy_choices(ids, seen, allowance, target, how)
    else:
        if not same:
            row, step = parting(ids, ref_ids)
            closest, allowed = closest_call(trace, row // options.get("num_return_sequences", 1), step, allowance)
            if closest > allowed:
                raise AssertionError(
                    f"{target.label}: the device search chose other ids than the reference at step {step}, row {row} "
                    f"({how}): got {ids[row].tolist()}, reference {ref_ids[row].tolist()}; the reference's closest "
                    f"score gap from that step on is {closest:.3g}, more than the {target.dtype} allowance "
                    f"{allowed:.3g}")
        if options.get("early_stopping") is not True:
            assert_near_best(ids, ref_ids, ref_scores, seen, allowance, target, options, how)
    if same:
        assert_close_scores(scores, ref_scores, 1e-5, ids, target, how)


def assert_close_scores(scores, ref_scores, rtol: float, ids, target: Target, how: str) -> None:
    __tracebackhide__ = True
    bad = ~np.isclose(scores, ref_scores, rtol=rtol, atol=0.0)
    if bad.any():
        row = int(np.argmax(bad))
        raise AssertionError(f"{target.label}: the device search's score of row {row} is {scores[row]!r}, the "
                             f"reference's {ref_scores[row]!r} (rtol {rtol:g}; {how}); ids {ids[row].tolist()}")


def parting(ids: np.ndarray, ref_ids: np.ndarray) -> tuple[int, int]:
    """(row, step) of the earliest token where the device's ids part from the reference's, the
    shorter result read as padded."""
    width = max(ids.shape[1], ref_ids.shape[1])
    padded = [np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=PAD) for a in (ids, ref_ids)]
    rows, steps = np.nonzero(padded[0] != padded[1])
    first = int(np.argmin(steps))
    return int(rows[first]), int(steps[first])


class Allowance:
    """test_generate.py's float32 allowances on a script: atol of the target's dtype times the
    logit scale, max(1, largest finite |logit|). A choice at one step (greedy) may be 2 x atol x
    scale off the best (a log-probability moves by twice a logit's error); a score summed over n
    tokens moves by 4 x (n + 1) x atol x scale (as beam search's gaps), divided as the score is by
    the length penalty."""

    def __init__(self, seen: Script, target: Target):
        self.seen, self.atol = seen, tolerance(target.dtype, target.device).atol
        finite = np.where(np.isfinite(seen.table), np.abs(seen.table), 0.0)
        self.scales = np.maximum(1.0, finite.reshape(len(finite), -1).max(axis=1))  # (B,) per source row

    def choice(self, logits: np.ndarray) -> float:
        return 2.0 * self.atol * float(np.maximum(1.0, np.abs(logits[np.isfinite(logits)]).max()))

    def score(self, source: int, length: int, divisor: float) -> float:
        return 4.0 * (length + 1) * self.atol * float(self.scales[source]) / abs(divisor)

    def gap(self, source_scale: float, step: int) -> float:
        return 4.0 * (step + 1) * self.atol * source_scale


def hypothesis_of(row: np.ndarray) -> tuple[int, bool] | None:
    """(length, ended) of a returned row: tokens then the end token then padding, or MAX_LEN
    tokens without the end token; None for any other row (a banned pad id within, an end token
    followed by more tokens, a row cut short)."""
    ends = np.flatnonzero(row == EOS)
    length = int(ends[0]) + 1 if len(ends) else len(row)
    body, rest = row[:length], row[length:]
    if (body == PAD).any() or (rest != PAD).any() or (not len(ends) and length != MAX_LEN):
        return None
    return length, bool(len(ends))


def path_score(seen: Script, source: int, row: np.ndarray, length: int, ended: bool, options: dict
               ) -> tuple[float, float]:
    """(score, divisor) of a hypothesis recomputed in float64 from the script the search read:
    the sum of its tokens' log-probabilities (a log-softmax over every id, banned ones too, as
    the search takes it before the bans) over the length penalty, or, for Flax's rule, a row
    that never ended, the plain sum (its open beam)."""
    summed, previous = 0.0, BOS
    for t, token in enumerate(row[:length]):
        summed += float(log_softmax(seen.table[source, t, previous])[token])
        previous = token
    divisor = 1.0 if options.get("beam_rule") == "flax" and not ended else \
        float(penalty(length, options["length_penalty"], options["length_penalty_form"]))
    return summed / divisor, divisor


def assert_valid_hypotheses(ids, scores, seen: Script, allowance: Allowance, target: Target, options: dict,
                            how: str) -> None:
    """Every returned row is a hypothesis (`hypothesis_of`), the result is as wide as its longest,
    each score is its path's, recomputed in float64, within the allowance, and each source's
    hypotheses come best first."""
    __tracebackhide__ = True
    returned = options.get("num_return_sequences", 1)
    lengths = []
    for r, row in enumerate(ids):
        found = hypothesis_of(row)
        if found is None:
            raise AssertionError(f"{target.label}: the device search returned row {r} = {row.tolist()} ({how}): not "
                                 f"a hypothesis (tokens other than the pad id {PAD}, then the end token {EOS} and "
                                 f"padding, or {MAX_LEN} tokens without it)")
        length, ended = found
        lengths.append(length)
        expected, divisor = path_score(seen, r // returned, row, length, ended, options)
        allowed = allowance.score(r // returned, length, divisor)
        if not abs(scores[r] - expected) <= allowed:
            raise AssertionError(f"{target.label}: the device search's score of row {r} is {scores[r]!r}, its path's "
                                 f"{expected!r} recomputed in float64, more than the allowance {allowed:.3g} apart "
                                 f"({how}); ids {row.tolist()}")
    if ids.shape[1] != max(lengths):
        raise AssertionError(f"{target.label}: the device search's result is {ids.shape[1]} tokens wide, its longest "
                             f"hypothesis {max(lengths)} ({how})")
    ranked = scores.reshape(-1, returned)
    if (np.diff(ranked, axis=1) > 0).any():
        source = int(np.argmax((np.diff(ranked, axis=1) > 0).any(axis=1)))
        raise AssertionError(f"{target.label}: the device search returned source row {source}'s hypotheses out of "
                             f"order, scores {ranked[source].tolist()} ({how})")


def assert_greedy_choices(ids, seen: Script, allowance: Allowance, target: Target, how: str) -> None:
    """Greedy search: each token is the best logit after the row's own prefix (the pad id
    banned), or within the allowance of it."""
    __tracebackhide__ = True
    for b, row in enumerate(ids):
        length, _ = hypothesis_of(row)
        previous = BOS
        for t, token in enumerate(row[:length]):
            logits = seen.table[b, t, previous].copy()
            allowed = allowance.choice(logits)
            logits[PAD] = -np.inf
            short = float(logits.max() - logits[token])
            if short > allowed:
                raise AssertionError(
                    f"{target.label}: greedy search chose id {int(token)} at step {t}, row {b} ({how}), "
                    f"{short:.3g} below the best logit (id {int(np.argmax(logits))}), more than the allowance "
                    f"{allowed:.3g}; ids {row.tolist()}")
            previous = token


def assert_near_best(ids, ref_ids, ref_scores, seen: Script, allowance: Allowance, target: Target, options: dict,
                     how: str) -> None:
    """Each source's best hypothesis scores no worse than the reference's best, less the
    allowance. (Not under early_stopping=True: there a tie broken the other way may stop a row at
    a worse first finished list, as the rule allows.) A Flax row that returned an open beam where
    the other returned a finished one is not compared (a plain sum against a penalized one)."""
    __tracebackhide__ = True
    returned = options.get("num_return_sequences", 1)
    for source in range(BATCH):
        r = source * returned
        (length, ended), (ref_length, ref_ended) = hypothesis_of(ids[r]), hypothesis_of(ref_ids[r])
        if ended != ref_ended and options.get("beam_rule") == "flax":
            continue
        score, divisor = path_score(seen, source, ids[r], length, ended, options)
        _, ref_divisor = path_score(seen, source, ref_ids[r], ref_length, ref_ended, options)
        allowed = max(allowance.score(source, length, divisor), allowance.score(source, ref_length, ref_divisor))
        if score < ref_scores[r] - allowed:
            raise AssertionError(
                f"{target.label}: the device search's best hypothesis of source row {source} scores {score:.6g} "
                f"(recomputed in float64), the reference's {ref_scores[r]:.6g}: worse by more than the allowance "
                f"{allowed:.3g} ({how}); got {ids[r].tolist()}, reference {ref_ids[r].tolist()}")


def closest_call(trace: list[dict], source: int, step: int, allowance: Allowance) -> tuple[float, float]:
    """The reference's closest call of a source row from `step` on (a beam search decides the
    token at position j at step j or later: which beams survive, and which finished hypotheses
    are ranked first) and its allowance, as (gap, allowance) of the step nearest to its
    allowance. A parting after the reference's last step reads that step (where it stopped)."""
    closest, allowed = np.inf, 0.0
    first = min(step, len(trace) - 1)
    for s, record in enumerate(trace[first:], start=first):
        gap, gap_allowed = float(record["gap"][source]), allowance.gap(float(record["scale"][source]), s)
        if gap - gap_allowed < closest - allowed:
            closest, allowed = gap, gap_allowed
    return closest, allowed
