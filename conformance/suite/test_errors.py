"""Property: every backend refuses the same bad input with the same error type, argument and message.

Hypothesis generates the bad inputs (out-of-range and negative ids, float ids, wrong ranks,
empty batches, zero-length sequences, lengths beyond max_len, masks of the wrong shape or dtype,
masks that contradict the ids, a batch-size mismatch, an unsupported dtype, mismatched or
non-finite parameters). The NumPy backend's error is the reference; the others must match it
exactly, so a user never learns a different failure per framework.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.errors import InputError
from conformance.core.params import init_params
from conformance.core.presets import preset

CONFIG = preset("default", d_model=16, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1,
                src_vocab_size=11, tgt_vocab_size=13, max_len=6)


def good_ids(draw, vocab, batch=None, length=None):
    batch = batch or draw(st.integers(1, 3))
    length = length or draw(st.integers(1, CONFIG.max_len))
    return np.array([[draw(st.integers(1, vocab - 1)) for _ in range(length)] for _ in range(batch)], dtype=np.int64)


@st.composite
def bad_calls(draw):
    """(kind, kwargs for model(...)) with exactly one thing wrong."""
    src = good_ids(draw, CONFIG.src_vocab_size)
    tgt = good_ids(draw, CONFIG.tgt_vocab_size, batch=src.shape[0])
    which = draw(st.sampled_from(["src_ids", "tgt_ids"]))
    ids = src if which == "src_ids" else tgt
    vocab = CONFIG.src_vocab_size if which == "src_ids" else CONFIG.tgt_vocab_size
    kind = draw(st.sampled_from([
        "out-of-range", "negative", "float", "rank-1", "rank-3", "empty-batch", "zero-length",
        "beyond-max-len", "batch-mismatch", "mask-shape", "mask-dtype", "mask-contradicts-ids",
    ]))
    call = {"src_ids": src, "tgt_ids": tgt}
    if kind == "out-of-range":
        ids = ids.copy()
        ids.flat[draw(st.integers(0, ids.size - 1))] = draw(st.integers(vocab, 10**6))
    elif kind == "negative":
        ids = ids.copy()
        ids.flat[draw(st.integers(0, ids.size - 1))] = draw(st.integers(-(10**6), -1))
    elif kind == "float":
        ids = ids.astype(draw(st.sampled_from([np.float32, np.float64])))
    elif kind == "rank-1":
        ids = ids[0]
    elif kind == "rank-3":
        ids = ids[None]
    elif kind == "empty-batch":
        ids = ids[:0]
    elif kind == "zero-length":
        ids = ids[:, :0]
    elif kind == "beyond-max-len":
        ids = np.ones((ids.shape[0], CONFIG.max_len + draw(st.integers(1, 5))), dtype=np.int64)
    elif kind == "batch-mismatch":
        which = "tgt_ids"
        ids = good_ids(draw, CONFIG.tgt_vocab_size, batch=src.shape[0] + draw(st.integers(1, 2)))
    if kind.startswith("mask"):
        which = draw(st.sampled_from(["src_mask", "tgt_mask"]))
        B, S, T = src.shape[0], src.shape[1], tgt.shape[1]
        good_shape = (B, 1, 1, S) if which == "src_mask" else (B, 1, T, T)
        if kind == "mask-shape":
            H = CONFIG.n_heads
            expected = (B, H, 1, S) if which == "src_mask" else (B, H, T, T)
            shape = list(good_shape)
            axis = draw(st.integers(0, 3))
            shape[axis] = expected[axis] + draw(st.integers(1, 3))  # neither 1 nor the expected size
            shape = draw(st.sampled_from([tuple(shape), good_shape[1:], (1,) + good_shape]))
            call[which] = np.ones(shape, dtype=bool)
        elif kind == "mask-dtype":
            call[which] = np.ones(good_shape, dtype=draw(st.sampled_from([np.int64, np.float32, np.uint8])))
        else:
            # All-True: lets every query see every key, including the future (target) or a
            # padding key, which we put in the source.
            if which == "src_mask":
                src = src.copy()
                src[0, -1] = CONFIG.pad_id
                call["src_ids"] = src
            elif T == 1:
                tgt = np.concatenate([tgt, tgt], axis=1)
                call["tgt_ids"] = tgt
                good_shape = (B, 1, 2, 2)
            call[which] = np.ones(good_shape, dtype=bool)
        return kind, which, call
    call[which] = ids
    return kind, which, call


def error_of(target: Target, make_call) -> InputError:
    with backends.dtype_scope(target):
        model = backends.build(target, CONFIG, init_params(CONFIG, seed=0))
        with pytest.raises(InputError) as info:
            make_call(model)
    return info.value


@pytest.mark.dtypes("float32")
@given(bad=bad_calls())
def test_bad_calls_fail_the_same_way_everywhere(target, bad):
    kind, argument, call = bad
    reference = error_of(Target("numpy", "cpu", "float64"), lambda m: m(**call))
    assert reference.argument == argument, f"{kind}: numpy blamed {reference.argument!r}, expected {argument!r}"
    got = error_of(target, lambda m: m(**call))
    assert type(got) is type(reference)
    assert str(got) == str(reference), f"{target.label} {kind}: {str(got)!r} != numpy's {str(reference)!r}"


@pytest.mark.dtypes("float32")
@given(problem=st.sampled_from(["missing", "unexpected", "shape", "nan", "inf", "mixed-dtype"]))
def test_bad_params_fail_the_same_way_everywhere(target, problem):
    params = init_params(CONFIG, seed=0, dtype=np.float32)
    name = "encoder.layers.0.ffn.linear1.weight"
    if problem == "missing":
        del params[name]
    elif problem == "unexpected":
        params["encoder.layers.7.ffn.linear1.weight"] = params[name]
    elif problem == "shape":
        params[name] = params[name][:, :3]
    elif problem in ("nan", "inf"):
        params[name][1, 2] = np.nan if problem == "nan" else -np.inf
    else:
        params[name] = params[name].astype(np.float64)

    def build(t: Target):
        with backends.dtype_scope(t), pytest.raises(InputError) as info:
            backends.build(t, CONFIG, params)
        return info.value

    reference = build(Target("numpy", "cpu", "float32"))
    assert reference.argument == "params"
    got = build(target)
    assert str(got) == str(reference), f"{target.label} {problem}: {str(got)!r} != {str(reference)!r}"


@pytest.mark.dtypes("float32")
def test_unsupported_dtypes_are_refused(target):
    import numpy

    unsupported = {"numpy": "float16", "torch": "int32", "jax": "int32"}[backends.kind(target.backend)]
    odd = Target(target.backend, target.device, unsupported)
    with pytest.raises(InputError) as info:
        backends.build(odd, CONFIG, init_params(CONFIG, seed=0, dtype=numpy.float32))
    assert info.value.argument == "dtype"
    named = backends.kind(target.backend) in str(info.value) or target.backend in str(info.value)
    assert unsupported in str(info.value) and named, f"{target.label}: {info.value}"
