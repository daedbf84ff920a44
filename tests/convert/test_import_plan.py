"""An import decides its plan once (issue 42): each foreign key is matched against a layout once.

Detection tries every built-in layout, so a key is matched once per layout tried; the winner's
check is the plan, not matched again before the tensors are transformed.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.cli import main as cli_main
from conformance.convert import convert_arrays, export_state_dict, import_state_dict, planner
from conformance.convert.planner import check_keys, plan_import
from conformance.core import checkpoint

OVERRIDES = {"pad_id": 29, "n_heads": 4}


@pytest.fixture(scope="module")
def marian_state_dict():
    config = preset("hf-marian", n_encoder_layers=2, n_decoder_layers=2, d_model=16, n_heads=4, d_ff=24,
                    src_vocab_size=30, tgt_vocab_size=30, max_len=20, pad_id=29)
    return export_state_dict(config, init_params(config, dtype=np.float32), "hf-marian")


@pytest.fixture
def match_counts(monkeypatch):
    """(layout name, foreign key) -> how many times `planner.match_key` matched it."""
    counts: collections.Counter = collections.Counter()
    match_key = planner.match_key

    def counting(layout, key, switches=None):
        counts[(layout.name, key)] += 1
        return match_key(layout, key, switches)

    monkeypatch.setattr(planner, "match_key", counting)
    return counts


def _assert_matched_once(counts, keys, layout="hf-marian"):
    __tracebackhide__ = True
    again = {k: n for k, n in counts.items() if n > 1}
    assert not again, f"keys matched more than once against a layout: {dict(list(again.items())[:3])} ..."
    assert {key for name, key in counts if name == layout} == set(keys), f"not every key was matched against {layout}"


@pytest.mark.parametrize("layout", [None, "hf-marian"], ids=["auto-detected", "named"])
def test_python_api_matches_each_key_once(marian_state_dict, match_counts, layout):
    config, _ = import_state_dict(marian_state_dict, layout, **OVERRIDES)
    assert config.n_encoder_layers == 2
    _assert_matched_once(match_counts, marian_state_dict)


def test_cli_matches_each_key_once(marian_state_dict, match_counts, tmp_path, capsys):
    src = tmp_path / "marian.safetensors"
    checkpoint.write_tensors(src, marian_state_dict, {})
    match_counts.clear()
    assert cli_main(["convert", str(src), str(tmp_path / "out.safetensors"), "--set", "pad_id=29",
                     "--set", "n_heads=4"]) == 0
    assert "layout: hf-marian (auto-detected)" in capsys.readouterr().out
    _assert_matched_once(match_counts, marian_state_dict)


def test_plan_is_what_a_fresh_check_gives(marian_state_dict):
    """Detection's check, reused as the plan, is the check the engine used to make again."""
    plan = plan_import(marian_state_dict, None, OVERRIDES)
    fresh = check_keys(plan.layout, marian_state_dict, plan.overrides)
    assert plan.detected and plan.layout.name == "hf-marian"
    assert (plan.check.effective, plan.check.aliases, plan.check.dropped, plan.check.layers, plan.check.missing,
            plan.check.unexpected) == (fresh.effective, fresh.aliases, fresh.dropped, fresh.layers, fresh.missing,
                                       fresh.unexpected)
    a = convert_arrays(marian_state_dict, None, **OVERRIDES)
    b = convert_arrays(marian_state_dict, "hf-marian", **OVERRIDES)
    assert a.config == b.config and a.decisions[1:] == b.decisions[1:]
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
