"""impl_jax/flat.py: the model flattened once and kept between calls gives exactly what flattening
it on every call gives, whatever is changed in the model between two calls."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

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


def test_a_change_made_while_the_record_is_built_is_seen(monkeypatch):
    """Another thread's change landing between the record's flatten and its end: the record is
    checked once built, so it is not kept (planted here deterministically)."""
    model = recorded_model()
    flat.forget()
    flat.flattened(model)  # seen once again: the next call builds the record
    original = jax.tree.flatten
    layer = model.encoder.layers[0].ffn.linear1

    def flatten_then_change(tree, is_leaf=None, **kwargs):
        out = original(tree, is_leaf=is_leaf, **kwargs)
        if is_leaf is not None and tree is model:
            layer.weight = other_param(layer.weight)
        return out

    monkeypatch.setattr(jax.tree, "flatten", flatten_then_change)
    flat.record(model)
    monkeypatch.setattr(jax.tree, "flatten", original)
    assert_as_flattening(model)


def test_records_go_by_identity_not_equality():
    """Two modules that compare equal (a user's `__eq__`) are two models with two records."""

    class Equal(nnx.Module):
        def __init__(self, value):
            self.w = nnx.Param(jnp.full((2,), value))

        def __eq__(self, other):
            return isinstance(other, Equal)

        def __hash__(self):
            return 0

    a, b = Equal(1.0), Equal(5.0)
    for _ in range(3):
        flat.flattened(a)
    assert flat.record(a) is not None
    assert float(flat.flattened(b).leaves[0][0]) == 5.0
    assert_as_flattening(b)


def test_a_model_that_refers_to_itself_is_not_recorded_and_is_freed():
    """A static attribute that could refer back to the model (a bound method of its own) would
    keep the model alive through its record: such a model is flattened every call instead."""

    class Parent(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.act = self.identity

        def identity(self, x):
            return x

    model = Parent()
    for _ in range(3):
        assert_as_flattening(model)
    assert flat.record(model) is None
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_model_that_could_not_be_recorded_is_tried_again(monkeypatch):
    monkeypatch.setattr(flat, "RETRY_AFTER", 3)
    model = recorded_model()
    model.extra = nnx.data(jnp.ones(3))
    assert flat.record(model) is None
    del model.extra
    calls = 0
    while flat.record(model) is None:
        calls += 1
        assert calls <= 3, "retried after RETRY_AFTER calls"
    assert_as_flattening(model)


@pytest.mark.parametrize("change", ["a variable's class", "a module's attribute dict", "the model's attribute dict"])
def test_changes_behind_nnx_are_seen(change):
    model = recorded_model()
    linear = model.encoder.layers[0].ffn.linear1
    if change == "a variable's class":
        linear.weight.__class__ = nnx.BatchStat
    elif change == "a module's attribute dict":
        object.__setattr__(linear, "__dict__", dict(vars(linear)))
        vars(linear)["weight"] = other_param(linear.weight)
    else:
        object.__setattr__(model, "__dict__", dict(vars(model)))
        vars(model)["precision"] = "default"
    assert_as_flattening(model)


def test_a_variable_holding_two_arrays_when_the_record_is_built_is_not_recorded():
    model = recorded_model()
    flat.forget()
    model.decoder.layers[0].ffn.linear2.bias.set_value((jnp.zeros(2), jnp.ones(2)))
    for _ in range(3):
        assert_as_flattening(model)
    assert flat.record(model) is None


class Inner(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))


class Outer(nnx.Module):
    def __init__(self):
        self.inner = Inner()


def test_a_model_freed_while_the_table_is_in_use_does_not_deadlock():
    """A record can hold the last reference to another recorded model (the old submodule, replaced):
    freeing that record runs the other model's weak-reference callback inside `forget`, which once
    waited on the lock `forget` held. Run on a thread so that a hang fails instead of freezing."""
    outer = Outer()
    for _ in range(2):
        flat.flattened(outer)
        flat.flattened(outer.inner)
    outer.inner = Inner()  # the old inner is held only by outer's record now
    done = threading.Thread(target=flat.forget, daemon=True)
    done.start()
    done.join(timeout=30)
    assert not done.is_alive(), "forget() deadlocked in a weak-reference callback"


@dataclasses.dataclass(eq=False)
class Lazy:
    size: int = 2
    table: list = dataclasses.field(init=False)  # never set: reading it raises


def helper(x):
    return x


def test_static_attributes_that_are_not_plain_data_are_refused_without_raising():
    class Holding(nnx.Module):
        def __init__(self, static):
            self.w = nnx.Param(jnp.ones(2))
            self.static = static

    lazy = Holding(Lazy())  # reading its unset field raises: refused, not raised
    owner = Holding(None)
    config = Lazy()
    config.table = []
    config.owner = owner  # stored beside the dataclass's fields: could keep the model alive
    owner.static = config
    offset = 1.0
    closure = Holding(lambda x: x + offset)
    for model in (lazy, owner, closure):
        for _ in range(3):
            assert_as_flattening(model)
        assert flat.record(model) is None
    plain = Holding(helper)  # a module-level function refers to no instance
    for _ in range(3):
        assert_as_flattening(plain)
    assert flat.record(plain) is not None
    alive = weakref.ref(owner)
    del owner, config
    gc.collect()
    assert alive() is None
