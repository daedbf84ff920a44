"""impl_torch refuses bad input exactly as impl_numpy does: same type, same message, same blame.

Every bad input goes to both backends; the errors must agree in type, `.argument` and `str()`.
Token ids and masks are given to torch both as the NumPy array and as the equivalent tensor.
"""

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from conformance import InputError, init_params, preset  # noqa: E402


CONFIG = preset("default", max_len=6, src_vocab_size=10, tgt_vocab_size=12)
PARAMS = init_params(CONFIG, seed=0)
NUMPY = impl_numpy.Model(CONFIG, PARAMS)
TORCH = impl_torch.Model(CONFIG, PARAMS)
SRC = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
TGT = np.array([[1, 2, 3], [4, 5, 0]])


def outcome(call):
    """("ok", result) or ("error", type, argument, message)."""
    try:
        return ("ok", call())
    except ValueError as exc:
        return ("error", type(exc).__name__, getattr(exc, "argument", None), str(exc))


def tensor(x):
    """The torch tensor equivalent of a NumPy argument (as the user of torch would pass it)."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) and x.dtype.kind in "biuf" else x


def assert_same_error(numpy_call, torch_call):
    __tracebackhide__ = True
    expected, got = outcome(numpy_call), outcome(torch_call)
    assert expected[0] == "error", f"NumPy accepted the input: {expected}"
    assert expected[1] == "InputError", f"NumPy raised {expected[1:]}, not an InputError naming the argument"
    assert got == expected, f"torch raised {got[1:]}, NumPy raised {expected[1:]}"


BAD_IDS = {
    "float ids": np.array([[1.0, 2.0]]),
    "bool ids": np.array([[True, False]]),
    "string ids": np.array([["a", "b"]]),
    "rank 1": np.array([1, 2, 3]),
    "rank 3": np.ones((1, 2, 3), dtype=np.int64),
    "empty batch": np.zeros((0, 3), dtype=np.int64),
    "zero length": np.zeros((2, 0), dtype=np.int64),
    "longer than max_len": np.ones((1, 7), dtype=np.int64),
    "negative id": np.array([[1, -1, 2]]),
    "id == vocab size": np.array([[1, 10, 2]]),
    "huge id": np.array([[2**40]]),
    "uint8 out of range": np.array([[1, 200]], dtype=np.uint8),
    # torch has no min/max kernels for uint16/32/64, and uint64 ids can exceed int64's range.
    "uint16 out of range": np.array([[1, 300]], dtype=np.uint16),
    "uint32 out of range": np.array([[1, 70000]], dtype=np.uint32),
    "uint64 out of range": np.array([[1, 2**40]], dtype=np.uint64),
    "uint64 at 2**63": np.array([[1, 2**63]], dtype=np.uint64),
    "uint64 max": np.array([[2**64 - 1, 1]], dtype=np.uint64),
    "ragged rows": [[1, 2], [3]],
}


@pytest.mark.parametrize("name", sorted(BAD_IDS))
@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_bad_source_ids(name, as_tensor):
    bad = BAD_IDS[name]
    given_to_torch = tensor(bad) if as_tensor else bad
    assert_same_error(lambda: NUMPY(bad, TGT), lambda: TORCH(given_to_torch, TGT))
    assert_same_error(lambda: NUMPY.encode(bad), lambda: TORCH.encode(given_to_torch))


@pytest.mark.parametrize("name", sorted(BAD_IDS))
@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_bad_target_ids(name, as_tensor):
    bad = BAD_IDS[name]
    given_to_torch = tensor(bad) if as_tensor else bad
    assert_same_error(lambda: NUMPY(SRC, bad), lambda: TORCH(SRC, given_to_torch))


def test_batch_mismatch():
    tgt = np.ones((3, 2), dtype=np.int64)
    assert_same_error(lambda: NUMPY(SRC, tgt), lambda: TORCH(SRC, tgt))
    assert_same_error(lambda: NUMPY.decode(tgt, NUMPY.encode(SRC)), lambda: TORCH.decode(tgt, TORCH.encode(SRC)))


def derived_masks():
    return impl_numpy.make_masks(CONFIG, SRC, TGT)


def widened_src_mask():
    src_mask, _ = derived_masks()
    src_mask = src_mask.copy()
    src_mask[1, 0, 0, 3] = True  # lets every query see a padding key
    return src_mask


def widened_tgt_mask():
    _, tgt_mask = derived_masks()
    tgt_mask = np.broadcast_to(tgt_mask, (2, 4, 3, 3)).copy()
    tgt_mask[0, 2, 0, 1] = True  # lets position 0 see position 1: the future
    return tgt_mask


BAD_MASKS = {
    "src float mask": ("src_mask", lambda: derived_masks()[0].astype(np.float32)),
    "src int mask": ("src_mask", lambda: derived_masks()[0].astype(np.int64)),
    "src rank 2": ("src_mask", lambda: derived_masks()[0][:, 0, 0, :]),
    "src wrong length": ("src_mask", lambda: np.ones((2, 1, 1, 5), dtype=bool)),
    "src query axis": ("src_mask", lambda: np.ones((2, 1, 3, 4), dtype=bool)),
    "src wrong batch": ("src_mask", lambda: np.ones((3, 1, 1, 4), dtype=bool)),
    "src too many heads": ("src_mask", lambda: np.ones((2, 5, 1, 4), dtype=bool)),
    "src widens the ids": ("src_mask", widened_src_mask),
    "tgt float mask": ("tgt_mask", lambda: derived_masks()[1].astype(np.float64)),
    "tgt wrong shape": ("tgt_mask", lambda: np.ones((2, 1, 3, 2), dtype=bool)),
    "tgt rank 3": ("tgt_mask", lambda: derived_masks()[1][:, 0]),
    "tgt widens the ids": ("tgt_mask", widened_tgt_mask),
    "tgt all true": ("tgt_mask", lambda: np.ones((2, 1, 3, 3), dtype=bool)),
    "src ragged": ("src_mask", lambda: [[[[True, True, True, False]]], [[[True, True]]]]),
    "tgt ragged": ("tgt_mask", lambda: [[[[True], [True, True], [True, True, True]]], [[[True]]]]),
}


@pytest.mark.parametrize("name", sorted(BAD_MASKS))
@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_bad_masks(name, as_tensor):
    argument, make = BAD_MASKS[name]
    bad = make()
    given_to_torch = tensor(bad) if as_tensor else bad
    assert_same_error(lambda: NUMPY(SRC, TGT, **{argument: bad}), lambda: TORCH(SRC, TGT, **{argument: given_to_torch}))


def test_narrowing_masks_are_accepted_and_used():
    """The positive control: a mask that only narrows the derived one runs, identically."""
    src_mask, tgt_mask = derived_masks()
    src_mask = np.broadcast_to(src_mask, (2, 4, 1, 4)).copy()
    src_mask[0, 1, 0, 1] = False  # head 1 of row 0 may not see key 1
    expected = NUMPY(SRC, TGT, src_mask=src_mask, tgt_mask=tgt_mask)
    for as_tensor in (False, True):
        masks = dict(src_mask=tensor(src_mask), tgt_mask=tensor(tgt_mask)) if as_tensor else dict(src_mask=src_mask, tgt_mask=tgt_mask)
        got = TORCH(SRC, TGT, **masks)
        np.testing.assert_allclose(got.logits.detach().numpy(), expected.logits, rtol=1e-10, atol=1e-10)
        assert got.attention["encoder.0.self"][0, 1, :, 1].eq(0).all()


def bad_memory(encoded, array):
    return type(encoded)(memory=array, src_mask=encoded.src_mask)


BAD_MEMORY = {
    "float32 memory": lambda memory: memory.astype(np.float32),
    "rank 2": lambda memory: memory[:, 0],
    "wrong d_model": lambda memory: memory[..., :8],
    "empty source": lambda memory: memory[:, :0],
    "longer than max_len": lambda memory: np.concatenate([memory, memory], axis=1),  # S = 8 > 6
}


@pytest.mark.parametrize("name", sorted(BAD_MEMORY))
def test_bad_memory_in_decode(name):
    """`decode` checks `encoded.memory` (shape and the model's dtype) before any kernel sees it."""
    encoded_numpy, encoded_torch = NUMPY.encode(SRC), TORCH.encode(SRC)
    bad = BAD_MEMORY[name](encoded_numpy.memory)
    assert_same_error(lambda: NUMPY.decode(TGT, bad_memory(encoded_numpy, bad)),
                      lambda: TORCH.decode(TGT, bad_memory(encoded_torch, torch.from_numpy(bad))))


def test_float64_memory_for_a_float32_model_names_the_dtypes():
    model = impl_torch.Model(CONFIG, PARAMS, dtype=torch.float32)
    encoded = TORCH.encode(SRC)  # float64
    with pytest.raises(InputError) as info:
        model.decode(TGT, encoded)
    assert str(info.value) == "encoded: memory has dtype float64, the model computes in float32"


def params_with(**changes):
    params = dict(PARAMS)
    for name, value in changes.items():
        if value is None:
            params.pop(name)
        else:
            params[name] = value
    return params


def nan_at(name):
    value = PARAMS[name].copy()
    value.flat[3] = math.nan
    return value


BAD_PARAMS = {
    "missing": lambda: params_with(**{"decoder.norm.weight": None}) if "decoder.norm.weight" in PARAMS
    else params_with(**{"output.bias": None}),
    "unexpected": lambda: {**PARAMS, "encoder.extra.weight": np.zeros(3)},
    "wrong shape": lambda: params_with(**{"encoder.layers.0.ffn.linear1.weight": np.zeros((3, 3))}),
    "integer dtype": lambda: {k: v.astype(np.int64) for k, v in PARAMS.items()},
    "mixed dtypes": lambda: params_with(**{"output.bias": PARAMS["output.bias"].astype(np.float32)}),
    "NaN weight": lambda: params_with(**{"encoder.layers.1.self_attn.k_proj.weight": nan_at("encoder.layers.1.self_attn.k_proj.weight")}),
    "infinite bias": lambda: params_with(**{"decoder.layers.0.ffn.linear2.bias": np.full(CONFIG.d_model, math.inf)}),
}


@pytest.mark.parametrize("name", sorted(BAD_PARAMS))
@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_bad_params(name, as_tensor):
    bad = BAD_PARAMS[name]()
    given_to_torch = {k: torch.from_numpy(np.asarray(v)) for k, v in bad.items()} if as_tensor else bad
    assert_same_error(lambda: impl_numpy.Model(CONFIG, bad), lambda: impl_torch.Model(CONFIG, given_to_torch))


def overflowing(value):
    """PARAMS with one weight that is finite in float64 but not in a narrower dtype."""
    weight = PARAMS["encoder.layers.0.ffn.linear1.weight"].copy()
    weight.flat[5] = value
    return params_with(**{"encoder.layers.0.ffn.linear1.weight": weight})


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "tensor"])
def test_weights_that_overflow_the_cast_are_refused(as_tensor):
    """Finiteness holds for the weights the model computes with: 1e39 is inf in float32 and 1e5
    is inf in float16, so both casts are refused as NaN or infinite weights are."""
    convert = (lambda p: {k: torch.from_numpy(v) for k, v in p.items()}) if as_tensor else (lambda p: p)
    bad = overflowing(1e39)
    assert_same_error(lambda: impl_numpy.Model(CONFIG, bad, dtype="float32"),
                      lambda: impl_torch.Model(CONFIG, convert(bad), dtype=torch.float32))
    size = PARAMS["encoder.layers.0.ffn.linear1.weight"].size
    for dtype in (torch.float16, torch.bfloat16):
        value = 1e5 if dtype == torch.float16 else 1e39
        with pytest.raises(InputError) as info:
            impl_torch.Model(CONFIG, convert(overflowing(value)), dtype=dtype)
        assert str(info.value) == (f"params: parameter 'encoder.layers.0.ffn.linear1.weight' has 1 NaN or infinite "
                                   f"value(s) out of {size}")
    impl_torch.Model(CONFIG, convert(overflowing(6e4)), dtype=torch.float16)  # the control: still finite


@pytest.mark.parametrize("dtype", [torch.int32, "int64", np.float16.__name__ + "x", torch.complex64])
def test_a_dtype_torch_cannot_run_is_refused_by_name(dtype):
    with pytest.raises(InputError) as info:
        impl_torch.Model(CONFIG, PARAMS, dtype=dtype)
    assert info.value.argument == "dtype"
    assert "the torch backend cannot run" in str(info.value)
    assert "float32, float64, float16, bfloat16" in str(info.value)


@st.composite
def arbitrary_ids(draw):
    """Id arrays of any rank, size, integer or float dtype and values around the valid range."""
    shape = draw(st.lists(st.integers(0, 8), min_size=1, max_size=3).map(tuple))
    dtype = draw(st.sampled_from([np.int64, np.int32, np.int8, np.uint8, np.uint16, np.uint32, np.uint64, np.float32]))
    values = draw(st.lists(st.integers(-2, CONFIG.src_vocab_size + 1), min_size=math.prod(shape), max_size=math.prod(shape)))
    return np.array(values, dtype=np.int64).astype(dtype).reshape(shape)


@given(src=arbitrary_ids(), as_tensor=st.booleans())
def test_any_source_ids_give_the_same_outcome(src, as_tensor):
    """Whatever the ids, both backends either refuse them identically or agree on the logits."""
    expected = outcome(lambda: NUMPY.encode(src).memory)
    got = outcome(lambda: TORCH.encode(tensor(src) if as_tensor else src).memory)
    assert got[0] == expected[0], f"torch: {got[1:] if got[0] == 'error' else 'ok'}; numpy: {expected[1:] if expected[0] == 'error' else 'ok'}"
    if expected[0] == "error":
        assert got == expected
    else:
        np.testing.assert_allclose(got[1].detach().numpy(), expected[1], rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_out_of_range_ids_on_cuda_raise_the_shared_error_not_a_device_assert():
    model = impl_torch.Model(CONFIG, PARAMS, device="cuda")
    for bad in (np.array([[1, 10]]), torch.tensor([[1, 10]], device="cuda"), torch.tensor([[-1, 2]], device="cuda")):
        with pytest.raises(InputError, match="src_ids"):
            model(bad, TGT)
    torch.cuda.synchronize()  # a device-side assert would surface here
    assert model(SRC, TGT).logits.isfinite().all()


@pytest.mark.parametrize("lower", [torch.bfloat16, torch.float16])
def test_a_call_under_autocast_is_refused_by_every_entry_point(lower):
    """Autocast would recompute the products in its own dtype, silently (a float32 model's logits
    came back float32 and 0.04 away on this CPU) or with another output dtype: each entry point
    refuses it with an InputError that blames `torch.autocast` and says what to use instead."""
    model = impl_torch.Model(CONFIG, PARAMS, "float32")
    labels = np.roll(TGT, -1, axis=1)
    calls = {
        "forward": lambda: model(SRC, TGT),
        "encode": lambda: model.encode(SRC),
        "decode": lambda: model.decode(TGT, encoded),
        "loss_and_grads": lambda: model.loss_and_grads(SRC, TGT, labels),
        "generate": lambda: model.generate(SRC, max_len=4, bos_id=1, eos_id=2),
        "decode_step": lambda: model.decode_step(TGT[:, 0], model.start_cache(encoded, 4)),
    }
    encoded = model.encode(SRC)
    name = str(lower).removeprefix("torch.")
    for entry, call in calls.items():
        with torch.autocast("cpu", dtype=lower):
            with pytest.raises(InputError, match=rf"torch.autocast: is on for cpu \({name}\).*dtype={name}, "
                                                 "param_dtype=float32") as caught:
                call()
        assert caught.value.argument == "torch.autocast", entry
    with torch.autocast("cpu", dtype=lower, enabled=False):  # switched off: the model's own numbers
        expected = model(SRC, TGT).logits
    assert torch.equal(expected, model(SRC, TGT).logits)
