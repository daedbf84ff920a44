"""impl_jax/flat.py: the model flattened once and kept between calls gives exactly what flattening
it on every call gives, whatever is changed in the model between two calls."""

from __future__ import annotations

import gc

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend")
impl_jax = pytest.importorskip("impl_jax", reason="the JAX backend")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from conformance import init_params  # noqa: E402
from impl_jax import flat  # noqa: E402
from tests.batches import SRC, TGT, small  # noqa: E402

CONFIG = small()


def recorded_model(seed: int = 0):
    """A model whose record exists (the first compiled call remembers it, the second records it)."""
    model = impl_jax.Model(CONFIG, init_params(CONFIG, seed=seed, dtype=np.float32))
    model(SRC, TGT, return_attention=False)
    assert flat.record(model) is not None
    return model


def assert_as_flattening(model) -> None:
    """What a call hands jit is what `jax.tree.flatten(model)` gives now: the same structure and
    the very same leaf objects, in order."""
    given = flat.flattened(model)
    leaves, treedef = jax.tree.flatten(model)
    assert given.treedef == treedef
    assert len(given.leaves) == len(leaves)
    assert all(a is b for a, b in zip(given.leaves, leaves))


def other_param(variable, scale=2.0):
    return nnx.Param(jnp.asarray(np.asarray(variable.get_raw_value()) * scale))


# Each change is made to a recorded model between two calls; "kept" says whether the record
# survives it (a value set in place) or must be rebuilt (anything that flattening reads).
CHANGES = {
    "a variable's value set in place": (lambda m: m.encoder.layers[0].ffn.linear1.weight.set_value(
        m.encoder.layers[0].ffn.linear1.weight.get_value() + 1.0), True),
    "the parameters set by nnx.update": (lambda m: nnx.update(m, jax.tree.map(lambda x: x * 0.5, nnx.state(m, nnx.Param))),
                                         True),
    "a variable's value of another shape": (lambda m: m.decoder.layers[1].ffn.linear2.bias.set_value(
        jnp.zeros((3,), jnp.float32)), True),
    "a variable's value made a pair of arrays": (lambda m: m.encoder.layers[1].ffn.linear2.bias.set_value(
        (jnp.zeros((2,), jnp.float32), jnp.ones((2,), jnp.float32))), True),
    "a variable replaced": (lambda m: setattr(m.encoder.layers[0].ffn.linear1, "weight",
                                              other_param(m.encoder.layers[0].ffn.linear1.weight)), False),
    "a submodule replaced": (lambda m: setattr(m.encoder.layers[0], "ffn", recorded_model(seed=1).encoder.layers[0].ffn),
                             False),
    "an item of a module list replaced": (lambda m: m.decoder.layers.__setitem__(
        1, recorded_model(seed=2).decoder.layers[1]), False),
    "a static attribute changed": (lambda m: setattr(m.encoder.layers[0].ffn, "activation", "gelu"), False),
    "an attribute deleted and another added": (lambda m: (delattr(m.encoder.layers[0].ffn, "activation"),
                                                          setattr(m.encoder.layers[0].ffn, "kind", "relu")), False),
    "an attribute renamed, nothing else changed": (lambda m: vars(m.encoder.layers[0].ffn).__setitem__(
        "kind", vars(m.encoder.layers[0].ffn).pop("activation")), False),
    "an attribute added, nothing else changed": (lambda m: vars(m.encoder.layers[0].ffn).__setitem__(
        "zz_note", "static"), False),
    "a variable's metadata set": (lambda m: m.encoder.embedding.weight.set_metadata(origin="test"), False),
    "a module's state flag set": (lambda m: setattr(m.encoder.layers[0]._pytree__state, "_is_setup", True), False),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_call_after_a_change_sees_what_flattening_sees(change):
    model = recorded_model()
    before = flat.record(model)
    apply, kept = CHANGES[change]
    apply(model)
    assert_as_flattening(model)
    assert (flat.record(model) is before) == kept, "a value set in place keeps the record; any other change rebuilds it"


def test_a_plain_list_in_the_model_is_recorded_and_its_changes_seen():
    model = recorded_model()
    model.extra = nnx.data([nnx.Param(jnp.ones(2))])
    assert_as_flattening(model)
    assert flat.record(model) is not None
    model.extra.append(nnx.Param(jnp.zeros(3)))  # in place: the attribute is the same list
    assert_as_flattening(model)
    model.extra[0] = nnx.Param(jnp.ones(4))
    assert_as_flattening(model)


def test_a_model_holding_a_bare_array_is_flattened_on_every_call():
    model = recorded_model()
    model.extra = nnx.data(jnp.ones(3))  # a leaf that is no variable's value: not recordable
    assert_as_flattening(model)
    assert flat.record(model) is None
    before = flat.stats()["flattens"]
    model(SRC, TGT, return_attention=False)
    assert flat.stats()["flattens"] == before + 2


def test_the_numbers_follow_a_value_set_in_place_and_equal_flattening_every_call():
    model = recorded_model()
    weight = model.decoder.layers[0].cross_attn.v_proj.weight
    weight.set_value(weight.get_value() * 0.5)
    kept_before = flat.stats()["kept"]
    kept = np.asarray(model(SRC, TGT).logits)
    assert flat.stats()["kept"] == kept_before + 2, "both executables took the model from its record"
    params = {name: np.asarray(value) for name, value in model.params.items()}
    fresh = impl_jax.Model(CONFIG, params)
    flat.KEEP = False
    try:
        again = np.asarray(model(SRC, TGT).logits)
        expected = np.asarray(fresh(SRC, TGT).logits)
    finally:
        flat.KEEP = True
    assert np.array_equal(kept, again, equal_nan=True)
    assert np.array_equal(kept, expected, equal_nan=True)


def test_the_training_step_keeps_the_record_and_updates_the_model():
    model = recorded_model()
    optimizer = impl_jax.Adam(model, CONFIG.d_model)
    labels = np.roll(TGT, -1, axis=1)
    before = {name: np.asarray(value) for name, value in model.params.items()}
    record = flat.record(model)
    impl_jax.train_step(model, optimizer, SRC, TGT, labels)
    impl_jax.train_step(model, optimizer, SRC, TGT, labels)
    assert flat.record(model) is record
    assert_as_flattening(model)
    after = {name: np.asarray(value) for name, value in model.params.items()}
    assert any(not np.array_equal(before[n], after[n]) for n in before)


def test_a_record_goes_with_its_model():
    model = recorded_model()
    count = len(flat._RECORDS)
    del model
    gc.collect()
    assert len(flat._RECORDS) == count - 1


def test_keep_off_flattens_every_call():
    model = recorded_model()
    flat.KEEP = False
    try:
        before = flat.stats()["flattens"]
        model(SRC, TGT, return_attention=False)
        assert flat.stats()["flattens"] == before + 2
    finally:
        flat.KEEP = True
