"""check_exportable (export_state_dict's refusal) ignores the switches that do not act under the
config (issue 58): T5's relative-position fields under a sinusoid, a d_head that is d_model /
n_heads, the way masked scores meet a -inf fill; and its message names only switches that can make
the logits differ. A switch that acts is still refused, by name."""

from __future__ import annotations

import math

import pytest

from conformance.convert import export_state_dict
from conformance.core.config import ModelConfig, computes_alike, inert_switches
from conformance.core.errors import ConfigError
from conformance.core.params import init_params
from conformance.core.presets import preset

SMALL = dict(d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1, src_vocab_size=10,
             tgt_vocab_size=10, max_len=8)


def marian(**changes) -> ModelConfig:
    return preset("hf-marian", **SMALL).replace(**changes)


@pytest.mark.parametrize("changes", [dict(relative_buckets=8, relative_max_distance=20), dict(d_head=4)])
def test_a_switch_that_does_not_act_is_not_held_against_the_export(changes):
    config = marian(**changes)
    export_state_dict(config, init_params(config), "hf-marian")  # Marian's own config computes the same


def test_the_refusal_names_only_switches_that_act():
    config = marian(relative_max_distance=20, mask_fill=-1e9)
    with pytest.raises(ConfigError) as refused:
        export_state_dict(config, init_params(config), "hf-marian")
    message = str(refused.value)
    assert "mask_fill=-1000000000.0" in message and "relative_max_distance" not in message


def test_which_switches_act():
    sinusoid, t5 = ModelConfig(), ModelConfig(position="relative")
    assert {"relative_buckets", "relative_max_distance"} <= inert_switches(sinusoid)
    assert {"position_offset", "position_ids"} <= inert_switches(t5) and "relative_buckets" not in inert_switches(t5)
    assert "masked_scores" in inert_switches(ModelConfig(mask_fill=-math.inf))
    assert "masked_scores" in inert_switches(ModelConfig(empty_rows="zeros"))
    assert "masked_scores" not in inert_switches(ModelConfig(mask_fill=-3e38))
    assert computes_alike(ModelConfig(d_model=32, n_heads=4), "d_head", 8)
    assert not computes_alike(ModelConfig(d_model=32, n_heads=4), "d_head", 4)
