"""Meta-tests of the covering designs (issue 24): every property runs every switch value.

`conformance/suite/test_coverage.py` checks a real suite run from what its properties recorded;
these tests show that check working: a property run records what it ran and covers every value,
a property whose examples miss one value fails by that value's name, every property carries the
covering examples, and a switch added to `ModelConfig` joins the covering rows without an edit.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from dataclasses import dataclass

import pytest
from hypothesis import Phase, given, settings

import conformance.suite
from conformance.check.backends import Target
from conformance.core import config as config_module
from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError
from conformance.suite import covering
from conformance.suite.strategies import model_configs as configs_module
from conformance.suite.covering import coverage_problems, covering_cases, recording
from conformance.suite.strategies import cases, with_examples
from conformance.suite.strategies.ids import batch_width, padding_kinds

import conformance.suite.test_masks as masks

TARGET = Target("numpy", "cpu", "float32")
MASKS = "test_masks_equal_the_oracle_exactly"
# Properties whose config is fixed by design: they vary the bad input, not the model; or they run
# no model at all (the scripted decoder's search rules: its step logits are drawn, not computed).
FIXED_CONFIG = {"test_errors", "test_search_rules"}


def suite_properties():
    """(module name, property) for every property of the suite."""
    for info in pkgutil.iter_modules(conformance.suite.__path__):
        if not info.name.startswith("test_") or info.name in FIXED_CONFIG | {"test_coverage"}:
            continue
        module = importlib.import_module(f"conformance.suite.{info.name}")
        for name, prop in inspect.getmembers(module):
            if name.startswith("test_") and hasattr(prop, "hypothesis"):
                yield info.name, prop


def explicit_cases(prop):
    """The `Case` of each explicit example of a property (a training or decoding case's own)."""
    for example in prop.hypothesis_explicit_examples:
        (value,) = example.kwargs.values()
        yield getattr(value, "case", value)


@pytest.fixture(autouse=True)
def fresh_switches():
    yield
    clear_caches()


def clear_caches():
    configs_module.switch_values.cache_clear()
    covering.covering_configs.cache_clear()
    covering.covering_cases.cache_clear()


def test_every_property_carries_examples_covering_every_switch_value():
    found = list(suite_properties())
    assert len(found) >= 12, f"only {len(found)} properties found"
    for module, prop in found:
        seen = set().union(*(covering.seen_values(case) for case in explicit_cases(prop)))
        assert not covering.missed(prop.__name__, seen), f"{module}: {covering.missed(prop.__name__, seen)}"


def test_a_property_run_records_every_switch_value():
    with recording(MASKS) as seen:
        masks.test_masks_equal_the_oracle_exactly(target=TARGET)
    assert set(seen) == {(MASKS, TARGET.label)}
    assert coverage_problems(seen) == []


@pytest.mark.parametrize("switch, value", [("activation", "gelu"), ("layer_norm_form", "std-eps"),
                                           ("mask_fill", float("-inf")), ("masked_scores", "added"),
                                           ("empty_rows", "zeros"), ("src padding", "whole-row"),
                                           ("src padding", "leading"), ("tgt padding", "interior"),
                                           ("src width", "wider")])
def test_a_property_that_misses_a_value_fails_naming_it(switch, value):
    """The masks property, given only the covering examples, with one value taken out (another value
    of that switch in its place, each row of a padding kind replaced by the batch's first row, or the
    last position of each row made real), and no drawn ones."""
    def without(case):
        pad = case.config.pad_id
        if switch in ("src padding", "tgt padding"):  # each row of that kind replaced by the first row
            side = "src_ids" if switch == "src padding" else "tgt_ids"
            ids = getattr(case, side).copy()
            for r, row in enumerate(ids):
                if value in padding_kinds(row, pad):
                    ids[r] = ids[0]
            return dataclasses.replace(case, **{side: ids})
        if switch == "src width":  # a wider batch's first row given a real last token: as wide as its longest row
            src = case.src_ids.copy()
            if batch_width(src, pad) == "wider":
                src[0, -1] = src[0, 0]
            return dataclasses.replace(case, src_ids=src)
        if getattr(case.config, switch) != value:
            return case
        for other in (v for v in configs_module.switch_values()[switch] if v != value):  # one this config takes
            try:
                return dataclasses.replace(case, config=case.config.replace(**{switch: other}))
            except ConfigError:
                continue
        raise AssertionError(f"no other value of {switch} fits {case.config.summary()}")

    examples = [without(case) for case in covering_cases()]
    narrow = settings(phases=[Phase.explicit], database=None)(
        with_examples(examples)(given(case=cases())(masks.test_masks_equal_the_oracle_exactly.hypothesis.inner_test)))
    with recording(MASKS) as seen:
        narrow(target=TARGET)
    problems = coverage_problems(seen)
    assert problems == [f"{MASKS} on {TARGET.label} missed {switch}={value!r}"], problems


def test_values_are_read_from_the_config_module():
    values = configs_module.switch_values()
    switches = {f.name for f in dataclasses.fields(ModelConfig)} - set(configs_module.NOT_SWITCHES)
    assert set(values) == switches
    assert values["activation"] == config_module.ACTIVATIONS
    assert values["position"] == config_module.POSITIONS
    assert values["src_pad_mask"] == config_module.SRC_PAD_MASK_SIDES
    assert values["qkv_bias"] == (False, True)
    for name, options in values.items():
        assert len(options) >= 2, f"{name}: a switch with one value {options} is not covered"


def test_a_new_activation_joins_the_covering_rows(monkeypatch):
    monkeypatch.setattr(config_module, "ACTIVATIONS", (*config_module.ACTIVATIONS, "tanh"))
    clear_caches()
    assert configs_module.switch_values()["activation"][-1] == "tanh"
    assert "tanh" in {c.activation for c in covering.covering_configs()}


@dataclass(frozen=True)
class WithNewSwitches(ModelConfig):
    """ModelConfig with switches of the kinds the AlgoPerf issue adds (a bool, a number)."""

    glu: bool = False
    attention_temperature: float = 1.0


def test_new_fields_join_the_covering_rows(monkeypatch):
    base = WithNewSwitches(**{f.name: getattr(configs_module.BASE, f.name) for f in dataclasses.fields(ModelConfig)})
    monkeypatch.setattr(configs_module, "ModelConfig", WithNewSwitches)
    monkeypatch.setattr(configs_module, "BASE", base)
    clear_caches()
    values = configs_module.switch_values()
    assert values["glu"] == (False, True)
    assert values["attention_temperature"] == (1.0, 2.0)
    rows = covering.covering_configs()
    assert {c.glu for c in rows} == {False, True}
    assert {c.attention_temperature for c in rows} == {1.0, 2.0}
    # The drawn configs draw them too.
    drawn = []

    @settings(max_examples=30, database=None)
    @given(config=configs_module.configs())
    def draw(config):
        drawn.append(config)

    draw()
    assert {c.glu for c in drawn} == {False, True} and len({c.attention_temperature for c in drawn}) == 2


def test_half_precision_gradients_are_excused_only_what_their_domain_leaves_out():
    """The gradient property's half-precision legs never see ReLU (their kink exclusion) or
    attention temperature 4 (`tolerances.in_gradient_domain`): excused in those dtypes only, and
    nothing else is."""
    gradients = "conformance/suite/test_gradients.py::test_gradients_match_the_oracle"
    every = {(name, value) for name, options in covering.all_switch_values().items() for value in options}
    seen = every - {("activation", "relu"), ("attention_temp", 4.0)}
    for dtype in ("float16", "bfloat16"):
        assert coverage_problems({(f"{gradients}[t]", f"torch/cpu/{dtype}"): seen}) == []
        assert coverage_problems({(f"{gradients}[t]", f"torch/cpu/{dtype}"): seen - {("activation", "gelu")}}) == [
            f"{gradients}[t] on torch/cpu/{dtype} missed activation='gelu'"]
    assert coverage_problems({(f"{gradients}[t]", "torch/cpu/float32"): seen}) == [
        f"{gradients}[t] on torch/cpu/float32 missed attention_temp=4.0, activation='relu'"]


SEARCH_RULES = "conformance/suite/test_search_rules.py::test_device_search_follows_the_reference_rules"
REALISTIC = "conformance/suite/test_forward_realistic.py::test_every_tensor_matches_the_oracle_at_trained_scale"


def test_the_scripted_property_must_meet_a_late_overtake():
    """The scripted-decoder property runs no model: what it must meet is Flax's late overtake
    (issue 56), recorded from the reference's trace; a run without one fails by name."""
    assert coverage_problems({(f"{SEARCH_RULES}[t]", "torch/cpu/float64"): set()}) == [
        f"{SEARCH_RULES}[t] on torch/cpu/float64 missed scripted case='flax late overtake'"]
    assert coverage_problems({(f"{SEARCH_RULES}[t]", "torch/cpu/float64"):
                              {("scripted case", "flax late overtake")}}) == []


def test_the_scripted_property_records_the_late_overtake_of_its_explicit_script():
    import conformance.suite.test_search_rules as rules

    prop = rules.test_device_search_follows_the_reference_rules
    narrow = settings(phases=[Phase.explicit], database=None)(
        with_examples([rules.late_overtake_script()], "script")(given(script=rules.scripts())(prop.hypothesis.inner_test)))
    with recording("test_device_search_follows_the_reference_rules") as seen:
        narrow(target=Target("numpy", "cpu", "float64"))
    assert coverage_problems(seen) == [], seen


def test_the_realistic_property_must_meet_every_layer_norm_form_with_large_mean_rows():
    """Under ci the realistic property's covering rows give rows of a large mean to every LayerNorm
    form (issue 56): its explicit examples hold them, and a run that missed one fails by name."""
    import conformance.suite.test_forward_realistic as realistic

    seen = set().union(*(covering.seen_values(case) for case in explicit_cases(
        realistic.test_every_tensor_matches_the_oracle_at_trained_scale)))
    assert {("large-mean rows", form) for form in covering.LARGE_MEAN_FORMS} <= seen
    everything = {(name, value) for name, values in covering.expected_values(REALISTIC.split("::")[-1]).items()
                  for value in values} - {("large-mean rows", "std-eps")}
    assert coverage_problems({(f"{REALISTIC}[t]", "torch/cpu/float32"): everything}) == [
        f"{REALISTIC}[t] on torch/cpu/float32 missed large-mean rows='std-eps'"]
