"""impl_jax's host work per call (impl_jax/compiled.py, `placed`): the NumPy ids and masks go to
jit as they are, which transfers them in C++, instead of one `jax.device_put` each first; a
forward stays two executables; the numbers are the same bit for bit either way.

The forward's host glue reads the device once, checks the model's record in C and skips the
tree walk for plain arguments (benchmarks/bench_jax_wmt.py --host). Whatever it skips, a forward
gives the bits of `encode` then `decode` and of the unshortened paths, compiles nothing those do
not, and refuses bad inputs with the NumPy backend's errors. So does the forward as one executable
(`impl_jax.one_executable_forward()`, off by default), whose tensors equal the two executables'."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend")
impl_jax = pytest.importorskip("impl_jax", reason="the JAX backend")

from conformance import init_params  # noqa: E402
from impl_jax import compiled  # noqa: E402
from tests.batches import SRC, TGT, small  # noqa: E402
from tests.thorough import thorough_only  # noqa: E402

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


def tensors(out) -> dict[str, np.ndarray]:
    """Every tensor of a forward's output by name, as host arrays."""
    return {"logits": np.asarray(out.logits), **{f"intermediates {k}": np.asarray(v) for k, v in out.intermediates.items()},
            **{f"attention {k}": np.asarray(v) for k, v in (out.attention or {}).items()}}


def assert_same_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray], how: str) -> None:
    assert list(got) == list(want), f"{how}: other tensors, or in another order"
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, f"{how}: {name}"
        assert got[name].tobytes() == want[name].tobytes(), f"jax float32 cpu {name}: {how} changed its bits"


def test_a_forward_gives_the_bits_of_encode_then_decode_and_of_the_unshortened_paths(monkeypatch):
    m = model(seed=5)
    src_mask, tgt_mask = (np.asarray(x) for x in m.make_masks(SRC, TGT))
    src_mask = src_mask & (np.arange(SRC.shape[1]) != 1)  # an explicit mask narrower than the ids' (a masked key)
    want = tensors(m.decode(TGT, m.encode(SRC, src_mask), tgt_mask))
    assert_same_bits(tensors(m(SRC, TGT, src_mask, tgt_mask)), want, "the forward")
    sunk: dict[str, np.ndarray] = {}
    out = m(SRC, TGT, src_mask, tgt_mask, sink=lambda name, x: sunk.__setitem__(name, np.asarray(x)))
    assert out.logits is None and sunk["logits"].tobytes() == want["logits"].tobytes(), "a forward with a sink"
    for name, x in sunk.items():
        key = name if name == "logits" else f"attention {name}" if f"attention {name}" in want else f"intermediates {name}"
        assert x.tobytes() == want[key].tobytes(), f"jax float32 cpu {name}: a forward with a sink changed its bits"
    # The record off (flattened every call) and every argument put with jax.device_put first: the
    # paths before any shortcut. The same executables, so the same bits.
    monkeypatch.setattr(impl_jax.flat, "KEEP", False)
    monkeypatch.setattr(compiled, "HOST_ARRAYS_TO_JIT", False)
    assert_same_bits(tensors(m(SRC, TGT, src_mask, tgt_mask)), want, "flattening and putting every call")
    assert_same_bits(tensors(m(SRC, TGT)), tensors(m.decode(TGT, m.encode(SRC))), "the derived masks")


def test_a_forward_and_encode_then_decode_share_their_executables():
    """The source mask reaches the decoder as a JAX array from either: a NumPy array in one and a
    device array in the other would be two `_decode` executables of the same shapes."""
    from tests.batches import small as sized

    config = sized(d_ff=28)  # a config only this test compiles
    m = impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32))
    before = compiled.compile_stats()["compiles"]
    m(SRC, TGT, return_attention=False)
    assert compiled.compile_stats()["compiles"] - before == 2, "the first forward compiles _encode and _decode"
    m.decode(TGT, m.encode(SRC, return_attention=False), return_attention=False)
    m(SRC, TGT, return_attention=False)
    assert compiled.compile_stats()["compiles"] - before == 2, "encode then decode compiled a program of its own"


# Bad inputs of a forward, as (src, tgt, src_mask, tgt_mask): each must raise the NumPy backend's
# InputError, naming the same argument with the same message (impl_jax/host.py's promise).
BAD = {
    "a source id past the vocabulary": (np.where(SRC == 5, CONFIG.src_vocab_size, SRC), TGT, None, None),
    "a negative target id": (SRC, np.where(TGT == 4, -1, TGT), None, None),
    "float source ids": (SRC.astype(np.float32), TGT, None, None),
    "target ids of rank 1": (SRC, TGT[0], None, None),
    "another batch on the target side": (SRC, TGT[:2], None, None),
    "a source longer than max_len": (np.concatenate([SRC, SRC], axis=1), TGT, None, None),
    "a source mask of another length": (SRC, TGT, np.ones((3, 1, 1, 5), bool), None),
    "a target mask that is not boolean": (SRC, TGT, None, np.ones((3, 1, 5, 5), np.float32)),
    "a source mask wider than the ids allow": (SRC, TGT, np.ones((3, 1, 1, 6), bool), None),
}


@pytest.mark.parametrize("in_one", [False, True], ids=["two executables", "one executable"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_input_raises_the_numpy_backends_error(case, in_one, monkeypatch):
    import impl_numpy
    from conformance import InputError

    monkeypatch.setattr(compiled, "ONE_EXECUTABLE_FORWARD", in_one)
    src, tgt, src_mask, tgt_mask = BAD[case]
    with pytest.raises(InputError) as oracle:
        impl_numpy.Model(CONFIG, init_params(CONFIG, seed=0))(src, tgt, src_mask, tgt_mask)
    with pytest.raises(InputError) as got:
        model()(src, tgt, src_mask, tgt_mask, return_attention=False)
    assert (got.value.argument, str(got.value)) == (oracle.value.argument, str(oracle.value)), case


def one_executable_calls(how: str):
    """A model and one forward of it, by the name of what it exercises."""
    from conformance.core.dropout import draw_dropout

    m = model(seed=7)
    src_mask, tgt_mask = (np.asarray(x) for x in m.make_masks(SRC, TGT))
    src_mask = src_mask & (np.arange(SRC.shape[1]) != 1)  # narrower than the ids': a masked key
    if how == "derived masks":
        return lambda: m(SRC, TGT)
    if how == "explicit masks":
        return lambda: m(SRC, TGT, src_mask, tgt_mask)
    if how == "without attention":
        return lambda: m(SRC, TGT, return_attention=False)
    if how == "dropout":
        drop = draw_dropout(CONFIG, *SRC.shape, TGT.shape[1], rate=0.25, seed=3)
        return lambda: m(SRC, TGT, dropout=drop)
    bucketed = impl_jax.Model(CONFIG, init_params(CONFIG, seed=7, dtype=np.float32), buckets=(8,))
    return lambda: bucketed(SRC, TGT, src_mask, tgt_mask)


SIBLING = "compiles programs of their own; the derived and explicit masks run in CI"


@pytest.mark.parametrize("how", ["derived masks", "explicit masks",
                                 *(pytest.param(how, marks=thorough_only(SIBLING))
                                   for how in ("without attention", "dropout", "buckets"))])
def test_the_forward_as_one_executable_gives_the_bits_of_two(how, monkeypatch):
    """`compiled.ONE_EXECUTABLE_FORWARD`: `_encode` then `_decode` traced as one program. Every
    tensor equals the two executables' bit for bit on this CPU; a sink still takes the two."""
    call = one_executable_calls(how)
    want = tensors(call())
    monkeypatch.setattr(compiled, "ONE_EXECUTABLE_FORWARD", True)
    runs = compiled.compile_stats()["calls"]
    got = call()
    assert compiled.compile_stats()["calls"] - runs == 1, f"{how}: not one executable"
    assert_same_bits(tensors(got), want, f"one executable, {how}")
    if how == "derived masks":
        runs = compiled.compile_stats()["calls"]
        sunk: dict[str, np.ndarray] = {}
        model(seed=7)(SRC, TGT, sink=lambda name, x: sunk.__setitem__(name, np.asarray(x)))
        assert compiled.compile_stats()["calls"] - runs == 2, "a sink takes the encoder's tensors before the decoder runs"
        assert sunk["logits"].tobytes() == want["logits"].tobytes()


def test_the_record_sees_an_attribute_moved_to_the_front_of_the_next_module():
    """The record compares the modules' attributes laid end to end (impl_jax/flat.py), so it also
    compares each module's count: an attribute moved from the end of one module to the front of
    the next leaves the concatenation as it was, and flattening would read another structure."""
    from impl_jax import flat

    m = model(seed=6)
    m(SRC, TGT, return_attention=False)  # remembered, then recorded at the decoder's call
    record = flat.record(m)
    assert record is not None and record.holds(m)
    movable = lambda d: next((k for k in reversed(d) if not k.startswith("_pytree")), None)  # noqa: E731
    first, second = next((a, b) for a, b in zip(record.dicts, record.dicts[1:])
                         if movable(a) is not None and movable(a) not in b and list(a)[-1] == movable(a))
    key = movable(first)
    value, rest = first.pop(key), dict(second)
    second.clear()
    second.update({key: value, **rest})
    assert list(itertools.chain.from_iterable(record.dicts)) == record.all_keys, "the planted move is unseen by the keys"
    assert not record.holds(m), "the record held after an attribute moved between two modules"


def test_the_one_executable_switch_is_a_block_of_one_thread_and_nests():
    """`impl_jax.one_executable_forward(on)`: set inside its block for this thread only, restored
    after it whatever order other threads' blocks end in; the process default comes from
    ROSETTA_JAX_ONE_EXECUTABLE, and a word that is neither on nor off is refused."""
    import threading

    default = compiled.one_executable()
    with impl_jax.one_executable_forward():
        assert compiled.one_executable() is True
        with impl_jax.one_executable_forward(False):
            assert compiled.one_executable() is False
        assert compiled.one_executable() is True
        seen = []
        other = threading.Thread(target=lambda: seen.append(compiled.one_executable()))
        other.start()
        other.join()
        assert seen == [default]  # another thread keeps the process default
    assert compiled.one_executable() is default
    # Two threads' blocks that overlap without nesting: each sees its own, and neither leaks.
    entered, leave_first = threading.Event(), threading.Event()
    inside: list[bool] = []

    def first():
        with impl_jax.one_executable_forward(True):
            entered.set()
            leave_first.wait()
            inside.append(compiled.one_executable())

    thread = threading.Thread(target=first)
    thread.start()
    entered.wait()
    with impl_jax.one_executable_forward(False):
        leave_first.set()
        thread.join()
        inside.append(compiled.one_executable())
    assert inside == [True, False] and compiled.one_executable() is default


@pytest.mark.parametrize("word, on", [("1", True), ("on", True), ("0", False), ("off", False), ("", False),
                                      ("disabled", None)])
def test_the_environment_switch_takes_on_and_off_words_only(word, on, monkeypatch):
    monkeypatch.setenv("ROSETTA_JAX_ONE_EXECUTABLE", word)
    if on is None:
        with pytest.raises(ValueError, match="ROSETTA_JAX_ONE_EXECUTABLE='disabled'"):
            compiled._switch("ROSETTA_JAX_ONE_EXECUTABLE", "0")
    else:
        assert compiled._switch("ROSETTA_JAX_ONE_EXECUTABLE", "0") is on
