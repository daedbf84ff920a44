"""Your own backend's adapter, given by its file, under the suite and the tools (issue 45):
a held pad id keeps every drawn case valid, nothing of the run is lost under pytest-xdist, a
broken adapter is one line, `check` and `compare` refuse adapters, an adapter path may hold a
"/", held switches take every allowed value, two adapter.py files are two adapters, and a name
an adapter returns that rosetta does not know fails.

The adapters are tests/fixtures/own_backend/by_path/held.py (impl_numpy behind the protocol).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conformance.check.targets import adapter as adapter_module
from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.config import ModelConfig
from conformance.core.generation.settings import resolve
from conformance.core.errors import InputError
from conformance.core.inputs import nan_positions
from conformance.core.presets import preset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "own_backend" / "by_path"
HELD = FIXTURES / "held.py"


def adapter_target(factory: str, dtype: str = "float64") -> Target:
    name = f"{HELD}:{factory}"
    backends.register_adapter(name)
    return Target(name, "cpu", dtype)


def rosetta(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROSETTA_", "HYPOTHESIS_", "PYTEST_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "conformance.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    print(done.stdout[-5000:], done.stderr[-3000:])
    return done


# 1. A held pad id: the drawn case is the same case under the held config.

QUICK = settings(max_examples=25, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


def test_a_held_pad_id_keeps_each_generation_case_valid():
    from conformance.suite import runner
    from conformance.suite.strategies import generation_cases

    target = adapter_target("pad_one")

    @QUICK
    @given(gcase=generation_cases())
    def check(gcase):
        held = runner.for_target(target, gcase)
        config, case = held.case.config, held.case
        assert config.pad_id == 1
        # The start token, the end token and the options are valid under the held config (the
        # review's InputError "bos_id: is the pad id 1" came from here).
        resolve(config, held.max_len, held.bos_id, held.eos_id, **held.arguments())
        assert config.pad_id not in (held.bos_id, held.eos_id)
        assert dict(held.options).get("forced_bos_id") != config.pad_id
        for word in dict(held.options).get("bad_words_ids", ()):
            assert config.pad_id not in word
        # Padding stays padding: where the drawn source had the drawn pad id, the held one.
        np.testing.assert_array_equal(case.src_ids == 1, gcase.case.src_ids == gcase.case.config.pad_id)
        assert not nan_positions(config, case.src_ids, np.full((len(case.src_ids), 1), held.bos_id)).any()

    check()


def test_a_held_pad_id_keeps_forward_and_training_cases_valid():
    from conformance.suite import runner
    from conformance.suite.covering import covering_training_cases
    from conformance.suite.strategies import training_cases

    target = adapter_target("pad_one")

    def valid(training, drawn):
        held = runner.for_target(target, training)
        config, case = held.case.config, held.case
        assert config.pad_id == 1
        for ids, old in ((case.src_ids, drawn.case.src_ids), (case.tgt_ids, drawn.case.tgt_ids),
                         (held.labels, drawn.labels)):
            np.testing.assert_array_equal(ids == 1, old == drawn.case.config.pad_id)
        # Labels count only where the held config's logits are finite and the decoder input real.
        may_count = (case.tgt_ids != 1) & ~nan_positions(config, case.src_ids, case.tgt_ids)
        assert (held.labels[~may_count] == 1).all()
        assert (held.labels != 1).any()

    for training in covering_training_cases():
        try:
            valid(training, training)
        except BaseException as exc:  # hypothesis' reject() outside a test: a case no held config admits
            if type(exc).__name__ != "UnsatisfiedAssumption":
                raise

    @QUICK
    @given(training=training_cases())
    def check(training):
        valid(training, training)

    check()


def test_the_generate_property_passes_on_a_plain_model_holding_pad_id_1():
    """The review's reproduction: impl_numpy behind the protocol, with `switches = {"pad_id": 1}`."""
    from conformance.suite.test_generate import test_generate_chooses_the_oracles_ids

    test_generate_chooses_the_oracles_ids(target=adapter_target("pad_one"))


# 2 and 5. Under pytest-xdist, from a path with a "/".

def test_a_run_under_xdist_that_checked_nothing_fails(tmp_path):
    done = rosetta("conformance", "--backends", "numpy", "--devices", "cuda", "--", "-n", "1", cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "nothing was checked" in done.stdout
    assert f"numpy/cpu/float32: {backends.DESELECTED}" in done.stdout


def test_the_adapter_report_survives_xdist_and_a_path_with_a_slash(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "held.py").write_text(HELD.read_text())
    name = "./mine/held.py:hidden"
    done = rosetta("conformance", "--backends", name, "--", "-n", "1", "-k",
                   "test_every_tensor_matches_the_oracle and not trained or test_masks_equal", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    out = done.stdout
    assert f"adapter {name}: offers forward, intermediates, generate, loss_and_grads" in out
    assert f"skipped: {name}/cpu/float32: adapter: test_masks_equal_the_oracle_exactly is not in the adapter" in out
    assert f"{name}/cpu/float32: not exposed by intermediates, so not compared: " in out and "encoder.0.self" in out
    row = next(line for line in out.splitlines() if line.strip().startswith(f"{name}/cpu/float32 "))
    assert [int(n) for n in row.split()[1:4]] == [1, 0, 1], row


def test_the_report_reads_a_label_whose_adapter_path_has_a_slash(monkeypatch):
    from conformance.suite import pytest_plugin
    from conformance.suite.adapter_targets import adapter_report

    target = adapter_target("pad_one")
    monkeypatch.setenv("ROSETTA_BACKENDS", target.backend)
    reason = f"{target.label}: adapter: test_masks_equal_the_oracle_exactly is not in the adapter protocol"
    assert f"    skipped: {reason}" in adapter_report({target.label: {reason}}, {})
    monkeypatch.setattr(pytest_plugin, "OUTCOMES", {target.label: {"passed": 2}})
    assert pytest_plugin.results_table({})[0].startswith("  target (cpu)")


# 3. A broken adapter is one line, exit 2.

def test_a_held_switch_value_that_is_no_config_value_is_refused():
    with pytest.raises(adapter_module.AdapterError, match="activation.*'rleu'"):
        backends.register_adapter(f"{HELD}:bad_switch")


@pytest.mark.parametrize("factory, says", [("fails", "the user's constructor is broken"), ("bad_switch", "rleu")])
def test_an_adapter_that_cannot_build_is_one_line_and_exit_2(factory, says, tmp_path):
    done = rosetta("conformance", "--backends", f"{HELD}:{factory}", cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr
    assert "INTERNALERROR" not in done.stdout + done.stderr


# 4. check and compare refuse adapters.

def test_check_refuses_an_adapter_in_one_line(tmp_path):
    done = rosetta("check", "--backends", f"{HELD}:pad_one", cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--backends" in done.stderr and "rosetta conformance" in done.stderr


def test_compare_refuses_an_adapter():
    from conformance.check.foreign.report import backend_names as _backend_names

    with pytest.raises(InputError, match="rosetta conformance"):
        _backend_names(f"numpy,{HELD}:pad_one")


# 6. Held values: a drawn value outside them becomes any of them, not always the first.

def test_a_drawn_value_outside_the_held_ones_may_become_each_of_them():
    from conformance.suite.strategies.model_configs import switch_values

    bases = [preset("default", d_model=8, n_heads=2, d_ff=d_ff, n_encoder_layers=layers, n_decoder_layers=1,
                    src_vocab_size=8, tgt_vocab_size=8, max_len=8) for d_ff in (8, 16, 32, 64) for layers in (1, 2)]
    for name, values in switch_values().items():
        if len(values) < 3:
            continue
        allowed, outside = values[:2], values[2:]
        chosen = set()
        for base in bases:
            for value in outside:
                try:
                    config = base.replace(**{name: value})
                except ValueError:
                    continue
                held = adapter_module.conform(config, {name: allowed})
                chosen.add(getattr(held, name))
                assert held == adapter_module.conform(config, {name: allowed})  # the same every time
        assert chosen == set(allowed), (name, chosen)


# 7. Two adapter.py files are two adapters.

def test_two_files_of_one_name_are_two_adapters():
    a = adapter_module.load_factory(f"{FIXTURES / 'a' / 'adapter.py'}:build")
    b = adapter_module.load_factory(f"{FIXTURES / 'b' / 'adapter.py'}:build")
    assert (a(None, None, None), b(None, None, None)) == ("a", "b")


# 8. A name rosetta does not know fails, named.

def test_an_intermediate_of_an_unknown_name_fails_naming_it():
    config = ModelConfig(src_vocab_size=9, tgt_vocab_size=9, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                         n_decoder_layers=1, max_len=8)
    from conformance.core.params import init_params

    model = backends.build(adapter_target("typo"), config, init_params(config, seed=0))
    ids = np.array([[2, 3, 4]])
    with pytest.raises(adapter_module.AdapterError, match="encoder.0.self_atn"):
        model(ids, ids)
