"""A failing comparison says what was compared with what, and shows both values where it failed."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conformance.suite.assertions import assert_tensors_close
from conformance.check.backends import Target
from conformance.check.compare import compare
from conformance.core.presets import preset
from conformance.check.tolerances import tolerance

ROOT = Path(__file__).resolve().parents[2]
CONFIG = preset("default", d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1)
TARGET = Target("torch", "cpu", "float32")


def failure(what: str) -> str:
    got, expected = {"logits": np.array([[0.25, 1.5]])}, {"logits": np.array([[0.25, 1.0]])}
    with pytest.raises(AssertionError) as info:
        assert_tensors_close(got, expected, TARGET, CONFIG, what=what, names=["logits"])
    return str(info.value)


@pytest.mark.parametrize("what, says", [
    ("", "torch on cpu (float32) differs from the float64 oracle in 'logits'"),
    (" (fast path)", "torch (fast path) on cpu (float32) differs from the float64 oracle in 'logits'"),
    (" vs jax/cpu/float32", "torch on cpu (float32) differs from jax/cpu/float32 in 'logits'"),
    (" (encode+decode vs forward)", "torch (encode+decode) on cpu (float32) differs from forward in 'logits'"),
])
def test_the_message_names_what_was_compared(what, says):
    message = failure(what)
    assert message.startswith(says), message
    if " vs " in what:
        assert "oracle" not in message, message


def test_the_message_shows_both_values_at_the_largest_error():
    message = failure("")
    assert "max abs error 5.000e-01 at (0, 1) (got 1.5, expected 1)" in message, message


def test_a_nan_mismatch_shows_both_values_where_it_first_occurs():
    result = compare(np.array([0.5, np.nan, 0.25]), np.array([0.5, 0.125, np.nan]), tolerance("float64"))
    assert not result.passed
    assert "2 NaN position(s) differ, first at (1,) (got nan, expected 0.125)" in result.describe()


def test_the_tolerance_doc_points_only_inside_the_repository():
    text = (ROOT / "docs" / "tolerances.md").read_text()
    for ref in re.findall(r"`(\.\./[^`]+)`|\]\((\.\./[^)]+)\)", text):
        path = (ROOT / "docs" / (ref[0] or ref[1])).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"docs/tolerances.md points at {path}"
    assert "both values" in text
