"""Each ecosystem's habits (issue 16): a loaded PyTorch model is in eval() mode, and a call
with `return_attention=False` gives `attention=None` in every backend (an empty dict would read
as "this model has no attention layers")."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.check import backends
from conformance.core import checkpoint, init_params, preset
from conformance.core.output import tensors_of

CONFIG = preset("llmhub", d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1,
                src_vocab_size=12, tgt_vocab_size=12, max_len=8)
SRC = np.array([[3, 4, 5, 0], [6, 7, 0, 0]])
TGT = np.array([[1, 2, 3], [4, 5, 0]])


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_no_attention_asked_for_is_none(backend):
    if backends.availability([backend])[backend]:
        pytest.skip(f"{backend}: {backends.availability([backend])[backend]}")
    model = backends.build(backends.Target(backend, "cpu", "float32"), CONFIG, init_params(CONFIG, dtype=np.float32))
    full, fast = model(SRC, TGT), model(SRC, TGT, return_attention=False)
    assert fast.attention is None and set(full.attention) == {"encoder.0.self", "decoder.0.self", "decoder.0.cross"}
    encoded = model.encode(SRC, return_attention=False)
    assert encoded.attention is None
    # Decoding with attention after encoding without it gives the decoder's weights only.
    assert set(model.decode(TGT, encoded).attention) == {"decoder.0.self", "decoder.0.cross"}
    assert model.decode(TGT, encoded, return_attention=False).attention is None
    assert "logits" in tensors_of(fast) and not any(k.endswith((".self", ".cross")) for k in tensors_of(fast))


def test_a_loaded_torch_model_is_ready_for_inference(tmp_path):
    impl_torch = pytest.importorskip("impl_torch")
    checkpoint.save(tmp_path / "m.safetensors", CONFIG, init_params(CONFIG, dtype=np.float32))
    model = impl_torch.load(tmp_path / "m.safetensors")
    assert not model.training and not any(m.training for m in model.modules())


def test_a_torch_model_starts_in_the_same_mode_however_built_and_its_mode_changes_nothing():
    """`Model(...)` and `load` agree (eval), and the docstrings say plainly what the mode does:
    nothing; dropout comes from explicit masks, and with them a call is the same in either mode."""
    impl_torch = pytest.importorskip("impl_torch")
    import torch

    from conformance.core.dropout import draw_dropout

    model = impl_torch.Model(CONFIG, init_params(CONFIG, dtype=np.float32))
    assert not model.training and not any(m.training for m in model.modules())
    assert ".train()` does not switch dropout on" in impl_torch.Model.__doc__
    assert "call `.train()` to fine-tune" not in impl_torch.load.__doc__
    src, tgt = np.array([[3, 4, 5, 0]]), np.array([[1, 6, 7]])
    drop = draw_dropout(CONFIG, 1, 4, 3, rate=0.5, seed=1)
    with torch.no_grad():
        plain, dropped = model(src, tgt).logits, model(src, tgt, dropout=drop).logits
        model.train()
        assert torch.equal(model(src, tgt).logits, plain) and torch.equal(model(src, tgt, dropout=drop).logits, dropped)
    assert not torch.equal(plain, dropped)
