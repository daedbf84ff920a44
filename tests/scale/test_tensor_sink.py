"""A model call with `sink=`: every backend hands each tensor over in forward order, bit for bit
the tensor the same call returns without a sink, and keeps none of them in its output.

Also the NumPy backend's tape: the oracle's forward keeps no backward values on its modules; what
the backward pass reads lives on a tape, and a forward with one gives the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import ModelConfig, init_params
from conformance.check import backends
from conformance.core.output import forward_order, tensors_of

# Small, with padded target queries and a -inf fill (NaN rows to hand over too), pre-LN with
# final norms and a final logits bias: every recorded tensor and every branch before the logits.
CONFIG = ModelConfig(
    src_vocab_size=50, tgt_vocab_size=40, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2,
    n_decoder_layers=2, max_len=12, mask_fill=float("-inf"), tgt_pad_mask="queries", norm_placement="pre",
    final_encoder_norm=True, final_decoder_norm=True, final_logits_bias=True,
)
SRC = np.array([[5, 6, 7, 8, 9, 10, 11], [4, 5, 6, 7, 8, 0, 0], [3, 0, 0, 0, 0, 0, 0]])
TGT = np.array([[5, 6, 7, 8, 9, 10], [4, 5, 6, 7, 0, 0], [3, 0, 0, 0, 0, 0]])


def host(backend: str, value) -> np.ndarray:
    return np.array(backends.import_backend(backend).to_numpy(value))  # a copy: the sink keeps nothing alive


@pytest.mark.parametrize("backend", backends.BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_sink_receives_every_tensor_in_forward_order_with_the_returned_values(backend, dtype):
    pytest.importorskip(f"impl_{backend}")
    params = init_params(CONFIG, seed=3)
    target = backends.Target(backend, "cpu", dtype)
    with backends.dtype_scope(target), backends.full_precision(backend):
        model = backends.build(target, CONFIG, params)
        returned = {name: host(backend, value) for name, value in tensors_of(model(SRC, TGT)).items()}
        received = []
        out = model(SRC, TGT, sink=lambda name, value: received.append((name, host(backend, value))))
    assert [name for name, _ in received] == forward_order(CONFIG)
    for name, value in received:
        assert value.dtype == returned[name].dtype and value.shape == returned[name].shape, name
        np.testing.assert_array_equal(value, returned[name], err_msg=f"{backend} {dtype} {name}")
    assert np.isnan(returned["decoder.0.self"]).any()  # the NaN rows were handed over too
    assert out.logits is None and not out.attention and not out.intermediates


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_a_sink_without_attention_receives_the_intermediates_and_logits_only(backend):
    pytest.importorskip(f"impl_{backend}")
    model = backends.build(backends.Target(backend, "cpu", "float32"), CONFIG, init_params(CONFIG, seed=3))
    received = []
    out = model(SRC, TGT, return_attention=False, sink=lambda name, value: received.append(name))
    assert received == [n for n in forward_order(CONFIG) if not n.endswith((".self", ".cross"))]
    assert out.attention is None and out.logits is None


def test_the_numpy_forward_keeps_nothing_and_the_loss_keeps_its_tape_to_itself():
    """A plain NumPy call keeps no backward values on the model (they live on the tape that
    `loss_and_grads` passes), and a forward with a tape gives the same bits as one without."""
    import impl_numpy
    from impl_numpy.backward import Tape

    model = impl_numpy.Model(CONFIG, init_params(CONFIG, seed=3), "float64")
    expected = tensors_of(model(SRC, TGT))
    tape = Tape()
    got = tensors_of(model.decode(TGT, model.encode(SRC, tape=tape), tape=tape))
    for name in forward_order(CONFIG):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    layer = model.decoder.layers[1]
    assert {layer.self_attn, layer.ffn, layer.ffn.linear1, layer.cross_attn_norm, model.output} <= set(tape)
    model.loss_and_grads(SRC, TGT, np.where(np.arange(3)[:, None] == 0, TGT, 0))  # the row without NaN counts
    arrays = [value for module in (model, model.output, layer, layer.self_attn, layer.ffn, layer.ffn.linear1,
                                   layer.cross_attn_norm) for value in vars(module).values()]
    # Parameters are at most 2-D; an activation kept on a module would be (B, L, ...) or a tuple of them.
    assert not any(isinstance(value, tuple) or np.ndim(value) >= 3 for value in arrays)


def test_jax_hands_bucket_padded_tensors_over_cut_in_forward_order():
    """Padded to a bucket, JAX's tensors are cut after the call: handed over then, one at a time."""
    impl_jax = pytest.importorskip("impl_jax")
    params = init_params(CONFIG, seed=3)
    model = impl_jax.Model(CONFIG, params, "float32", buckets=(8, 12))
    returned = {name: np.array(value) for name, value in tensors_of(model(SRC, TGT)).items()}
    received = []
    out = model(SRC, TGT, sink=lambda name, value: received.append((name, np.array(value))))
    assert [name for name, _ in received] == forward_order(CONFIG)
    for name, value in received:
        assert value.shape == returned[name].shape, name  # cut back to 7 and 6 positions
        np.testing.assert_array_equal(value, returned[name], err_msg=name)
    assert out.logits is None and not out.attention and not out.intermediates

