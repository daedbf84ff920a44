"""The suite's padding draws have teeth (issue 58): OpenNMT-py's encoder mask, planted in a copy of
the NumPy backend (`breaks.PADDING_BREAKS["mask as wide as the longest row (OpenNMT-py)"]`: read from the
row lengths, as wide as the longest row), agrees with the oracle on the only batches the suite
drew before, trailing padding in a batch as wide as its longest row, and fails on each kind the
strategies draw now: left and interior padding, a batch wider than its longest row. The
covering rows hold each of them under `ci` (`covering.PADDING_SWITCHES`), and the forward
property fails the copy (tests/suite/test_has_teeth.py runs it with the other classic breaks).
"""

from __future__ import annotations

import numpy as np
import pytest

from breaks import PADDING_BREAKS, broken_copy
from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.presets import preset
from conformance.suite import runner
from conformance.suite.assertions import assert_tensors_close
from conformance.suite.covering import covering_cases, seen_values
from conformance.suite.strategies import Case

OPENNMT = "mask as wide as the longest row (OpenNMT-py)"
CONFIG = preset("paper", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                src_vocab_size=20, tgt_vocab_size=20, max_len=8)
PAD = CONFIG.pad_id
TARGET_IDS = np.array([[3, 4, 5, 6, 7], [3, 8, 9, 10, PAD]])
BATCHES = {  # source batches (2, 5), pad id 0
    "trailing, as wide as the longest row": np.array([[5, 6, 7, 8, 9], [5, 6, 7, PAD, PAD]]),
    "leading": np.array([[5, 6, 7, 8, 9], [PAD, PAD, 5, 6, 7]]),
    "interior": np.array([[5, 6, 7, 8, 9], [5, PAD, PAD, 6, 7]]),
    "wider than the longest row": np.array([[5, 6, 7, 8, PAD], [5, 6, 7, PAD, PAD]]),
}


@pytest.fixture(scope="module")
def planted():
    backend, edits, patches = PADDING_BREAKS[OPENNMT]
    name = broken_copy(OPENNMT, backend, edits, patches)
    yield Target(name, "cpu", "float64")
    backends.unregister_backend(name)


def differs(target: Target, src_ids: np.ndarray) -> str | None:
    """The planted copy's first difference from the oracle on this batch (None: it agrees)."""
    case = Case(config=CONFIG, seed=3, scale=1.0, src_ids=src_ids, tgt_ids=TARGET_IDS)
    try:
        assert_tensors_close(runner.run(target, case), runner.oracle(case), target, CONFIG)
    except (AssertionError, ValueError) as exc:  # a mask narrower than the scores does not broadcast
        return str(exc).splitlines()[0]
    return None


def test_the_planted_mask_passes_trailing_padding_as_wide_as_the_longest_row(planted):
    assert differs(planted, BATCHES["trailing, as wide as the longest row"]) is None


@pytest.mark.parametrize("kind", [k for k in BATCHES if not k.startswith("trailing")])
def test_the_planted_mask_fails_every_other_kind_the_suite_draws(planted, kind):
    problem = differs(planted, BATCHES[kind])
    assert problem is not None, f"{OPENNMT} agreed with the oracle on {kind} padding"
    print(f"{kind}: {problem[:200]}")


def test_the_covering_rows_hold_every_padding_kind_and_a_wider_batch():
    seen = set().union(*(seen_values(case) for case in covering_cases()))
    for kind in ("leading", "interior", "trailing", "whole-row", "all-but-one", "none"):
        assert ("src padding", kind) in seen and ("tgt padding", kind) in seen, kind
    assert {("src width", "wider"), ("tgt width", "wider"), ("src width", "longest row")} <= seen
    # A target row that starts with the pad id (Marian's and BART's decoder inputs) in every case.
    assert all((case.tgt_ids[:, 0] == case.config.pad_id).any() for case in covering_cases())

