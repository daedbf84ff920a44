"""impl_jax's host work per call (impl_jax/compiled.py, `placed`): the NumPy ids and masks go to
jit as they are, which transfers them in C++, instead of one `jax.device_put` each first; a
forward stays two executables; the numbers are the same bit for bit either way."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend")
impl_jax = pytest.importorskip("impl_jax", reason="the JAX backend")

from conformance import init_params  # noqa: E402
from impl_jax import compiled  # noqa: E402
from tests.batches import SRC, TGT, small  # noqa: E402

CONFIG = small()


def model(seed: int = 0):
    return impl_jax.Model(CONFIG, init_params(CONFIG, seed=seed, dtype=np.float32))


def spy_on_placed(monkeypatch) -> list[list[tuple[str, bool]]]:
    """Each compiled call's arguments: (type name, handed to jit as the same object)."""
    seen: list[list[tuple[str, bool]]] = []
    original = compiled.placed

    def spy(args, device, anchor=()):
        out = original(args, device, anchor)
        seen.append([(type(a).__name__, b is a) for a, b in zip(args, out)])
        return out

    monkeypatch.setattr(compiled, "placed", spy)
    return seen


def test_a_forward_is_two_executables_that_take_the_numpy_inputs_as_they_are(monkeypatch):
    m = model()
    m(SRC, TGT, return_attention=False)  # compiles
    seen = spy_on_placed(monkeypatch)
    calls = compiled.compile_stats()["calls"]
    m(SRC, TGT, return_attention=False)
    assert compiled.compile_stats()["calls"] - calls == 2, "a forward runs the encoder's and the decoder's executables"
    assert len(seen) == 2
    host_arrays = [same for args in seen for name, same in args if name == "ndarray"]
    assert len(host_arrays) >= 4, seen  # the ids and the masks of both sides
    assert all(host_arrays), f"a NumPy argument was put with jax.device_put before jit: {seen}"


def test_numpy_arguments_are_put_on_the_device_when_nothing_pins_the_call_there():
    device = jax.devices()[0]
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    (put,) = compiled.placed((ids,), device)  # no model, no committed argument: jit could run anywhere
    assert isinstance(put, jax.Array) and put.committed and put.sharding == compiled._single_device_sharding(device)
    anchor = [jax.device_put(np.zeros(2, np.float32), device)]
    masks = {"a": np.ones((2, 3), bool)}
    got = compiled.placed((ids, masks, None), device, anchor)
    assert got[0] is ids and got[1] is masks and got[2] is None
    uncommitted = jax.numpy.asarray(ids)  # a JAX array not committed to the device is still put
    assert compiled.placed((uncommitted,), device, anchor)[0].committed


def test_the_numbers_are_the_same_bit_for_bit_with_device_put_first(monkeypatch):
    m = model(seed=3)

    def forward(to_jit: bool) -> dict[str, np.ndarray]:
        monkeypatch.setattr(compiled, "HOST_ARRAYS_TO_JIT", to_jit)
        out = m(SRC, TGT)  # the logits, every intermediate and attention map
        return {"logits": np.asarray(out.logits), **{k: np.asarray(v) for k, v in out.intermediates.items()},
                **{k: np.asarray(v) for k, v in out.attention.items()}}

    want, got = forward(False), forward(True)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"jax float32 cpu {name}")


def test_a_training_step_takes_its_numpy_inputs_as_they_are_and_gives_the_same_numbers(monkeypatch):
    labels = np.where(TGT == CONFIG.pad_id, CONFIG.pad_id, TGT)
    results, seen = [], []
    for to_jit in (False, True):
        monkeypatch.setattr(compiled, "HOST_ARRAYS_TO_JIT", to_jit)
        if to_jit:
            seen = spy_on_placed(monkeypatch)
        m = model(seed=4)
        loss = float(impl_jax.train_step(m, impl_jax.Adam(m, CONFIG.d_model), SRC, TGT, labels, label_smoothing=0.1))
        results.append((loss, {name: np.asarray(value) for name, value in m.params.items()}))
    host_arrays = [same for args in seen for name, same in args if name == "ndarray"]
    assert len(host_arrays) >= 3 and all(host_arrays), seen  # the ids, the labels and the masks
    (loss_put, params_put), (loss_jit, params_jit) = results
    assert loss_jit == loss_put
    for name, value in params_put.items():
        np.testing.assert_array_equal(params_jit[name], value, err_msg=f"jax float32 cpu {name} after one step")


def test_an_explicit_mask_is_copied_so_a_caller_changing_it_after_the_call_changes_nothing():
    """JAX's dispatch is asynchronous and its host transfers may share the NumPy array's memory:
    the checked mask every backend uses is a copy of the caller's (conformance.core.inputs.host_mask)."""
    from conformance.core.inputs import host_mask

    mask = np.ones((2, 1, 1, 5), dtype=bool)
    checked = host_mask("src_mask", mask, ((2, 1, 1, 5), "(B, 1, 1, S)"), np.ones((2, 1, 1, 5), dtype=bool))
    assert not np.shares_memory(checked, mask)
    mask[:] = False
    assert checked.all()
