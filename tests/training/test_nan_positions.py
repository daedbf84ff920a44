"""Where a `-inf` mask fill makes logits NaN, and what training does about it.

`conformance.core.inputs.nan_positions` predicts, from the ids alone, which logits the forward pass
gives as NaN. It must equal the float64 NumPy oracle's NaN positions on every drawn config and
padded batch. The loss refuses a label that counts at such a position, with the same `InputError`
from every backend: the oracle's loss there is NaN, while PyTorch's and JAX's loss mode (weights 0
for a query with no key, docs/training.md) would give a finite number, and the two must not
silently disagree.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import impl_jax
import impl_numpy
import impl_torch
from conformance import InputError, init_params
from conformance.core.inputs import nan_positions
from conformance.suite.strategies import any_configs, cases
from batches import small

NEG_INF_CONFIGS = any_configs().map(lambda config: config.replace(mask_fill=-math.inf))


@given(case=cases(st.one_of(NEG_INF_CONFIGS, any_configs())))
def test_predicted_nan_positions_are_the_oracles(case):
    with np.errstate(all="ignore"):
        logits = impl_numpy.Model(case.config, case.params(), "float64")(case.src_ids, case.tgt_ids).logits
    np.testing.assert_array_equal(nan_positions(case.config, case.src_ids, case.tgt_ids), np.isnan(logits).any(-1),
                                  err_msg=case.config.summary())


def test_the_prediction_sees_each_way_nan_spreads():
    """One case per rule, so a predictor that forgets one fails here by name."""
    src, tgt = np.array([[3, 4, 0]]), np.array([[1, 5, 6, 0]])
    base = small("default", mask_fill=-math.inf, n_encoder_layers=1, n_decoder_layers=1)
    assert not nan_positions(base, src, tgt).any()  # keys-only padding: every query has a key
    # Source padding on the queries too: the padded query is NaN, and cross-attention spreads it.
    assert nan_positions(base.replace(src_pad_mask="both"), src, tgt).all()
    # Query-side target padding: the padded queries alone with one decoder layer, everything with two.
    queries = base.replace(tgt_pad_mask="queries")
    assert nan_positions(queries, src, tgt).tolist() == [[False, False, False, True]]
    assert nan_positions(queries.replace(n_decoder_layers=2), src, tgt).all()
    # A source row of padding only: its memory is NaN.
    assert nan_positions(base, np.array([[0, 0, 0]]), tgt).all()
    # A finite fill never makes NaN.
    assert not nan_positions(base.replace(mask_fill=-1e9, src_pad_mask="both"), src, tgt).any()


def build(backend, config, params):
    if backend == "jax":
        with impl_jax.enable_x64():
            return impl_jax.Model(config, params, "float64")
    return {"numpy": impl_numpy, "torch": impl_torch}[backend].Model(config, params, "float64")


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_a_label_where_the_logits_are_nan_is_the_same_input_error(backend):
    config = small("default", mask_fill=-math.inf, tgt_pad_mask="queries", n_encoder_layers=1, n_decoder_layers=1)
    src, tgt = np.array([[3, 4, 0]]), np.array([[1, 5, 6, 0]])
    model = build(backend, config, init_params(config, seed=0))
    with pytest.raises(InputError) as raised:
        with impl_jax.enable_x64():
            model.loss_and_grads(src, tgt, np.array([[5, 6, 7, 8]]))
    assert raised.value.argument == "labels"
    assert "1 label(s) count where the logits are NaN, first at (row 0, position 3)" in str(raised.value)
    with impl_jax.enable_x64():
        loss, _ = model.loss_and_grads(src, tgt, np.array([[5, 6, 7, 0]]))  # the same labels, NaN one as pad
    assert math.isfinite(float(loss))
