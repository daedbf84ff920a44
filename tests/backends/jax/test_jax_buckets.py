"""Bounded recompilation: lengths padded up to buckets give the unpadded results on the real
positions, including fully masked rows and NaN propagation, and compile once per bucket."""

from __future__ import annotations

import numpy as np
import pytest

import impl_jax
import impl_numpy
from conformance import InputError, init_params
from conformance.check.compare import assert_close
from conformance.check.tolerances import tolerance
from batches import SRC, TGT, small


# Each config is one way bucket padding could leak into the real positions:
#   finite fill:      the all-padding source row must average over its 6 real keys, not the 8
#                     of the bucket (added keys need a -inf score, not the fill);
#   -inf, queries:    added target rows are fully masked, so NaN; it must not reach real rows as
#                     0 * NaN in the next layer (added values are zeroed);
#   pre-LN, -inf:     NaN rows of the padding source row, final norms;
#   causal only:      target padding is not masked at all (Marian), so the added target keys
#                     must be hidden by the bucket itself, not by the padding mask.
CONFIGS = {
    "causal-only": small(tgt_pad_mask="none"),
    "finite-fill": small(),
    "inf-queries": small("llmhub", tgt_pad_mask="queries"),
    "pre-ln-inf": small("pre-ln-tutorial"),
}


def all_tensors(out) -> dict:
    return {**out.attention, **out.intermediates, "logits": out.logits}


def assert_same(got, expected, config, what: str):
    __tracebackhide__ = True
    got, expected = all_tensors(got), all_tensors(expected)
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert got[name].shape == np.shape(value), name
        assert_close(got[name], value, tolerance("float32"), tensor=name, backend=f"jax ({what})", config=config)


@pytest.mark.parametrize("buckets", [(4, 8), (4,)], ids=["4-8", "4-then-max_len"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bucketed_results_equal_the_oracle_on_the_real_positions(name, buckets):
    config = CONFIGS[name]
    params = init_params(config)
    oracle = impl_numpy.Model(config, params)(SRC, TGT)
    out = impl_jax.Model(config, params, dtype="float32", buckets=buckets)(SRC, TGT)
    assert_same(out, oracle, config, f"buckets {buckets}")
    plain = impl_jax.Model(config, params, dtype="float32")(SRC, TGT)
    assert_same(out, plain, config, f"buckets {buckets} against unbucketed")


def test_a_length_equal_to_a_bucket_and_explicit_masks():
    config = CONFIGS["inf-queries"]
    params = init_params(config)
    model = impl_jax.Model(config, params, dtype="float32", buckets=(4, 8))
    src, tgt = SRC[:, :4], TGT[:, :4]
    assert_same(model(src, tgt), impl_numpy.Model(config, params)(src, tgt), config, "length == bucket")
    src_mask, tgt_mask = impl_numpy.make_masks(config, SRC, TGT)
    per_head = np.broadcast_to(src_mask, (3, 2, 1, 6))
    assert_same(model(SRC, TGT, per_head, tgt_mask), model(SRC, TGT), config, "explicit masks")


def test_bucketed_encode_then_decode_equals_the_forward():
    config = CONFIGS["finite-fill"]
    model = impl_jax.Model(config, buckets=(4, 8))
    encoded = model.encode(SRC)
    assert encoded.memory.shape == (3, 6, 16) and encoded.src_mask.shape == (3, 1, 1, 6)
    assert encoded.attention["encoder.0.self"].shape == (3, 2, 6, 6)
    step = model.decode(TGT, encoded)
    full = model(SRC, TGT)
    for name, value in all_tensors(full).items():
        np.testing.assert_array_equal(np.asarray(all_tensors(step)[name]), np.asarray(value), err_msg=name)


def test_buckets_bound_the_number_of_compiles():
    config = small(n_encoder_layers=1, n_decoder_layers=1, d_ff=20)  # compiled by no other test
    model = impl_jax.Model(config, buckets=(4, 8))
    rng = np.random.default_rng(0)
    impl_jax.clear_cache()  # so that the bound on live executables cannot empty it mid-test
    before = impl_jax.compile_stats()["compiles"]
    for src_len in range(1, 9):
        for tgt_len in range(1, 9):
            src = rng.integers(1, 16, (2, src_len))
            tgt = rng.integers(1, 16, (2, tgt_len))
            model(src, tgt, return_attention=False)
    # _encode once per source bucket, _decode once per (target bucket, source bucket):
    # 2 + 4 executables for 64 shapes (unbucketed: 8 + 64).
    assert impl_jax.compile_stats()["compiles"] - before == 2 + 4


def test_bucket_lengths():
    assert [impl_jax.bucket_length(n, (4, 8), 16) for n in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]
    assert [impl_jax.bucket_length(n, (4, 32), 16) for n in (3, 5, 16)] == [4, 16, 16]  # capped at max_len
    assert impl_jax.bucket_length(7, None, 16) == 7


@pytest.mark.parametrize("buckets", [(), (8, 4), (4, 4), (0, 4), (4.0,), (True,), "8"])
def test_invalid_buckets_are_refused(buckets):
    with pytest.raises(InputError, match="^buckets: "):
        impl_jax.Model(small(), buckets=buckets)
