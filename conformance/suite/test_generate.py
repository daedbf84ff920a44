"""Property: decoding chooses the oracle's ids, or parts ways only where the oracle nearly tied.

In float64 every backend's `generate` (greedy and beam search under both beam rules, and
sampling from a seed, with the KV cache) returns exactly the float64 NumPy oracle's ids. In lower
precision two backends may choose differently, but only at a step where the oracle's search had a close call: two candidates whose order decided something
(greedy: the best two tokens; beam search: neighbours among the ranked candidates or finished
hypotheses) lying within what the dtype's tolerance lets the scores move. A logit may be off by
atol * scale (the tolerance table; scale = max(1, largest |logit|)), a log-probability by twice
that (its normaliser moves too), and a beam's score after s + 1 steps by s + 1 times that; two
compared scores may move in opposite directions. So the allowance at step s is
2 * atol * scale for greedy and 4 * (s + 1) * atol * scale for beam search. Sampling parts ways
only where the uniform lay near an edge of the cumulative distribution, or the logits near
top_k's or top_p's threshold: those move by up to twice a logit's error divided by the
temperature, so the allowance is 2 * atol * scale / temperature. Most drawn examples add
Hugging Face's logits processors (no repeated n-gram, a forced first token, bad words of several
tokens: `strategies.generation.processor_options`; and those of shipped generation configs:
repetition penalties, the source's n-grams, the end token's exponential decay, suppressed ids,
renormalization, `shipped_processors`, which every covering row holds some of); they ban, force
or rescale ids, and the allowances above read the processed scores, times how far the penalties
can stretch an error (`assertions.processor_stretch`). A features source decodes as Whisper two
times in three (`strategies.generation.as_whisper`; and the covering rows, `covering.WHISPER_ROWS`):
its config carries a Whisper generation note, and the case draws the forced prompt (the note's, or
`prefix=` with the language given or detected), the timestamp rules with a bound on the first
timestamp, the no-speech probability (compared as a tensor, within the dtype's tolerance) and,
for a beam search, openai-whisper's rule with its patience.

Examples and shapes are few (JAX compiles start_cache, the step and the reorder per shape).
"""

import pytest
from hypothesis import given, settings

from conformance.suite import runner
from conformance.suite.assertions import assert_ids_match, assert_no_speech_match
from conformance.suite.covering import covering_generation_cases
from conformance.suite.differences import judged
from conformance.suite.strategies import generation_cases, shared_examples, with_examples

EXAMPLES = max(4, settings().max_examples // 5)  # ci: 5; thorough: 400


@pytest.mark.dtypes("float32", "float64")
@shared_examples
@settings(max_examples=EXAMPLES)
@with_examples(covering_generation_cases(), "gcase")
@given(gcase=generation_cases())
def test_generate_chooses_the_oracles_ids(target, gcase):
    # An adapter's: held to the switches and to the searches it declares.
    drawn, gcase = gcase, runner.for_target(target, gcase)
    got, no_speech = runner.generate(target, gcase)
    expected, trace, expected_no_speech = runner.oracle_generate(gcase)
    with judged(target, "test_generate_chooses_the_oracles_ids", drawn, gcase.case):  # an adapter's known differences
        assert_no_speech_match(no_speech, expected_no_speech, target, gcase)
        assert_ids_match(got, expected, trace, target, gcase)
