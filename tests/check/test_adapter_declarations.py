"""What an adapter declares beyond its switches (issue 58, docs/own-backend.md), each seen doing its
work on a planted model (tests/fixtures/own_backend/declarations.py: impl_numpy behind the protocol)
and refused in one line when it can never hold:

- switches that move together (a combination): a model with both attention biases or neither
  fails every split the suite draws, and passes once the combination is declared;
- frozen parameters: a model that never trains final_logits_bias fails the gradient property,
  and passes once it is declared, skipped by name;
- its searches: a generate with greedy and Hugging Face's beam search only fails on Flax's rule
  and on sampling, and passes once it declares those two, which are then all it is given;
- known differences, in the adapter or in a file: an acknowledged one is reported apart with its
  shrunk example and fails nothing, a second one is still found in the same run, and without
  acknowledgements each distinct first-diverging tensor is reported, not only the first.

The report counts each property's examples (ran / rejected) and lists the oracle's row.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.check import adapter as adapter_module
from conformance.check import backends
from conformance.check.targets.adapter import AdapterError, SEARCHES, conform
from conformance.check.targets.declarations import PADDING_KINDS, WIDTHS
from conformance.check.backends import Target
from conformance.core.config import ModelConfig
from conformance.suite import runner
from conformance.suite.strategies.ids import PADDING_PATTERNS, WIDTHS as SUITE_WIDTHS

import conformance.suite.test_forward as forward
import conformance.suite.test_generate as generate
import conformance.suite.test_gradients as gradients

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "own_backend"
DECLARATIONS = FIXTURES / "declarations.py"


def target(factory: str, dtype: str = "float64") -> Target:
    name = f"{DECLARATIONS}:{factory}"
    backends.register_adapter(name)
    return Target(name, "cpu", dtype)


def adapter_with(**attributes):
    def build(config, params, dtype):
        raise AssertionError("never built")

    for name, value in attributes.items():
        setattr(build, name, value)
    return adapter_module.Adapter("probe.py:build", build)


# -- Combinations -----------------------------------------------------------------------------------


def test_a_held_combination_moves_its_fields_together():
    held = {("qkv_bias", "out_proj_bias"): [(True, True), (False, False)]}
    for qkv in (False, True):
        for out in (False, True):
            config = conform(ModelConfig(qkv_bias=qkv, out_proj_bias=out), held)
            assert config.qkv_bias == config.out_proj_bias
            if qkv == out:
                assert (config.qkv_bias, config.out_proj_bias) == (qkv, out)  # a listed one stays as drawn


@pytest.mark.parametrize("switches, says", [
    ({("qkv_bias", "out_proj_bias"): [(True,)]}, "a combination gives one value per field"),
    ({("qkv_bias", "out_proj_bias"): [(True, True)], "qkv_bias": True}, "more than once"),
    ({("activation", "ffn_glu"): [("rleu", False)]}, "no config can have"),
    ({("d_model", "ffn_glu"): [(8, False)]}, "not ModelConfig switches"),
])
def test_a_combination_no_config_can_have_is_refused(switches, says):
    with pytest.raises(AdapterError, match=says):
        adapter_with(switches=switches)


def test_the_forward_property_fails_a_split_combination_and_passes_a_declared_one():
    with pytest.raises(Exception, match="both attention biases or neither"):
        forward.test_every_tensor_matches_the_oracle(target=target("together_undeclared"))
    forward.test_every_tensor_matches_the_oracle(target=target("together"))


# -- Frozen parameters -------------------------------------------------------------------------------


def test_frozen_parameters_are_skipped_by_name_and_only_when_declared():
    with pytest.raises(AssertionError, match=r"did not return \['final_logits_bias'\]"):
        gradients.test_gradients_match_the_oracle(target=target("frozen_bias_undeclared"))
    gradients.test_gradients_match_the_oracle(target=target("frozen_bias"))
    config = ModelConfig(final_logits_bias=True)
    assert runner.frozen_parameters(target("frozen_bias"), config) == {"final_logits_bias"}
    assert runner.frozen_parameters(Target("numpy", "cpu", "float64"), config) == set()


def test_a_frozen_name_no_config_has_is_refused():
    with pytest.raises(AdapterError, match="no canonical parameter"):
        adapter_with(frozen=("final_logit_bias",))
    assert adapter_with(frozen=("*.position.table",)).is_frozen("encoder.position.table")


# -- Searches ------------------------------------------------------------------------------------


def test_the_generate_property_draws_only_the_searches_declared(monkeypatch):
    with pytest.raises(Exception, match="greedy and Hugging Face's beam search only"):
        generate.test_generate_chooses_the_oracles_ids(target=target("hf_searches_undeclared"))
    ran = []
    real = runner.generate

    def noting(t, gcase):
        ran.append(runner.search_of(gcase.options))
        return real(t, gcase)

    monkeypatch.setattr(runner, "generate", noting)
    generate.test_generate_chooses_the_oracles_ids(target=target("hf_searches"))
    assert set(ran) == {"greedy", "beam"}, ran  # every flax, openai and sampling case became one of them


def test_whisper_decoding_reaches_only_an_adapter_that_declares_it():
    """A Whisper covering case (a features source with a Whisper note, openai's rule): an adapter
    without the "openai" search gets it without the note and the Whisper options, one with it
    (undeclared: every search) as drawn."""
    from conformance.suite.covering import covering_generation_cases
    from conformance.suite.strategies.generation import WHISPER_OPTIONS

    gcase = next(g for g in covering_generation_cases() if dict(g.options).get("beam_rule") == "openai")
    held = runner.for_target(target("hf_searches"), gcase)
    assert "generation" not in held.case.config.notes
    assert not {k for k, _ in held.options} & {*WHISPER_OPTIONS, "patience"}, held.options
    assert runner.search_of(held.options) in ("greedy", "beam")
    whole = runner.for_target(target("hf_searches_undeclared"), gcase)
    assert whole.options == gcase.options and whole.case.config.notes == gcase.case.config.notes


def test_an_unknown_search_is_refused():
    with pytest.raises(AdapterError, match="must be some of"):
        adapter_with(searches=("greedy", "beam-search"))
    assert adapter_with().searches == SEARCHES  # undeclared: it runs rosetta's, every one


# -- Known differences ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry, says", [
    (dict(tensor="logits"), "reason required"),
    (dict(tensor="logits", reason="r", when={"colour": "red"}), "neither one of"),
    (dict(tensor="logits", reason="r", when={"dtype": "float8"}), "can never hold"),
    (dict(tensor="logits", reason="r", when={"src_padding": "left"}), "can never hold"),
    (dict(tensor="logits", reason="r", when={"activation": "rleu"}), "can never hold"),
])
def test_a_known_difference_that_can_never_hold_is_refused(entry, says):
    with pytest.raises(AdapterError, match=says):
        adapter_with(known_differences=[entry])


def test_the_conditions_name_the_suite_s_padding_kinds():
    assert PADDING_KINDS == PADDING_PATTERNS and WIDTHS == SUITE_WIDTHS


def conformance(factory: str, tmp_path: Path, *pytest_args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROSETTA_", "HYPOTHESIS_", "PYTEST_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "conformance.cli", "conformance", "--backends",
                           f"{DECLARATIONS}:{factory}", "--", "-k", "every_tensor_matches_the_oracle and not trained",
                           *pytest_args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout[-6000:], done.stderr[-2000:])
    return done


@pytest.mark.parametrize("factory, xdist", [("known", ()), ("known_in_a_file", ("-n", "1"))])
def test_an_acknowledged_difference_is_reported_apart_with_its_shrunk_example(factory, xdist, tmp_path):
    """In the adapter and in a file; in one process and under pytest-xdist, whose worker sends what
    it acknowledged and counted to the controller that prints the report."""
    done = conformance(factory, tmp_path, *xdist)
    assert done.returncode == 0, done.stdout[-3000:]
    section = done.stdout.split("acknowledged differences (not failures)")[1]
    assert "first difference at logits, acknowledged: logits when final_logits_bias=True" in section
    assert "this library adds its bias twice" in section
    assert "final_logits_bias" in section and "case=Case(" in section  # the example hypothesis shrank it to
    # The counts of what ran: the covering examples and the drawn ones, none rejected here.
    counts = done.stdout.split("examples per property and target (ran / rejected)")[1].splitlines()
    assert any(line.split()[0] == "every_tensor_matches_the_oracle" and "/ 0" in line for line in counts), counts
    assert "numpy/cpu/float64 (the oracle)" in done.stdout


def test_a_second_difference_is_still_found_beside_an_acknowledged_one(tmp_path):
    done = conformance("known_and_another", tmp_path)
    assert done.returncode == 1
    assert "acknowledged differences (not failures)" in done.stdout and "at logits, acknowledged" in done.stdout
    found = done.stdout.split("differences found on adapter targets")[1].splitlines()[1]
    assert "test_every_tensor_matches_the_oracle" in found and "logits" not in found.split(":")[-1], found
    assert "layer_norm_eps" not in found  # a tensor's name, not a switch
    assert "FAILED" in done.stdout


def test_without_acknowledgements_each_distinct_first_difference_is_reported(tmp_path):
    done = conformance("unknown_two", tmp_path)
    assert done.returncode == 1
    found = done.stdout.split("differences found on adapter targets")[1].splitlines()[1]
    tensors = [t.strip() for t in found.split(": ", 1)[1].split(",")]
    assert "logits" in tensors and len(tensors) >= 2, found  # the bias at the logits, and the epsilon before it
