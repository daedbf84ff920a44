"""`impl_jax.save_state` / `load_state`: the NNX model through an Orbax checkpoint directory."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint", reason="save_state writes Orbax checkpoints")
impl_jax = pytest.importorskip("impl_jax", reason="the JAX backend")

from conformance import init_params, preset  # noqa: E402
from conformance.core.errors import CheckpointError  # noqa: E402


def test_save_state_load_state_round_trip_is_bit_exact(tmp_path):
    config = preset("flax-wmt", d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1, n_decoder_layers=1, max_len=8,
                    notes={"origin": "test"})
    model = impl_jax.Model(config, init_params(config, seed=1, dtype=np.float32))
    impl_jax.save_state(model, tmp_path / "ckpt")
    again = impl_jax.load_state(tmp_path / "ckpt")
    assert again.config == config and again.config.notes == {"origin": "test"} and again.dtype == model.dtype
    assert list(again.params) == list(model.params)
    for name, value in model.params.items():
        assert np.array_equal(np.asarray(again.params[name]), np.asarray(value)), name
    with pytest.raises(CheckpointError, match="already exists"):
        impl_jax.save_state(model, tmp_path / "ckpt")


def test_load_state_refuses_what_is_not_a_save_state_directory(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(CheckpointError, match="other.*not a save_state checkpoint"):
        impl_jax.load_state(tmp_path / "other")
    with pytest.raises(CheckpointError, match="missing"):
        impl_jax.load_state(tmp_path / "missing")
