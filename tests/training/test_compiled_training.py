"""Training through `torch.compile` (docs/training.md, "Compiled training"): a model compiled in
place with `model.compile()` gives the eager model's loss and gradients, and a compiled
`train_step` the eager step's loss and parameters, within the float32 gradient tolerance table.

One small config and one batch shape: Inductor compiles the forward and the backward once (C++
on the CPU: minutes on a loaded machine the first time, seconds from its cache afterwards).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")

import impl_torch  # noqa: E402
from conformance import init_params, param_shapes, preset  # noqa: E402
from conformance.check.tolerances import gradient_tolerance  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile's Inductor needs a C++ compiler on the CPU; none found")

CONFIG = preset("default", d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
                src_vocab_size=40, tgt_vocab_size=40, max_len=16, tgt_pad_mask="queries")
# Padding on both sides; with the -inf fill and query-side target padding the padded target rows
# are empty attention rows, so the compiled graph carries the loss's empty-row rule too.
SRC = np.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12]])
TGT = np.array([[2, 3, 4, 0, 0], [2, 5, 6, 7, 8]])
LABELS = np.where(TGT == CONFIG.pad_id, CONFIG.pad_id, (TGT + 1) % CONFIG.tgt_vocab_size)


def assert_within_table(got: dict, expected: dict, what: str):
    """max |g - g_eager| <= atol * max(1, max |g_eager|) per parameter, atol from the table."""
    atol = gradient_tolerance("float32").atol
    assert list(got) == list(expected) == list(param_shapes(CONFIG)), what
    for name, value in expected.items():
        error = float((got[name] - value).abs().max())
        assert error <= atol * max(1.0, float(value.abs().max())), f"{what}: {name} off by {error:.3g}"


def test_a_compiled_model_gives_the_eager_loss_gradients_and_steps():
    torch._dynamo.reset()
    params = init_params(CONFIG, seed=0)
    eager = impl_torch.Model(CONFIG, params, "float32")
    compiled = impl_torch.Model(CONFIG, params, "float32")
    compiled.compile()  # nn.Module.compile: every call of the model runs compiled, loss_and_grads' too
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    loss, grads = compiled.loss_and_grads(SRC, TGT, LABELS, label_smoothing=0.1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames, "nothing was compiled"
    expected_loss, expected = eager.loss_and_grads(SRC, TGT, LABELS, label_smoothing=0.1)
    assert torch.isfinite(loss) and abs(float(loss) - float(expected_loss)) <= 1e-5 * abs(float(expected_loss))
    assert_within_table(grads, expected, "compiled vs eager gradients")
    assert any(float(g.abs().max()) > 0 for g in grads.values())

    # Two steps of the paper's Adam: the same losses, and the parameters stay within the table.
    optimizers = impl_torch.Adam(compiled, CONFIG.d_model), impl_torch.Adam(eager, CONFIG.d_model)
    for _ in range(2):
        got = impl_torch.train_step(compiled, optimizers[0], SRC, TGT, LABELS, label_smoothing=0.1)
        want = impl_torch.train_step(eager, optimizers[1], SRC, TGT, LABELS, label_smoothing=0.1)
        assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    state, eager_state = compiled.state_dict(), eager.state_dict()
    assert_within_table({k: state[k] for k in param_shapes(CONFIG)},
                        {k: eager_state[k] for k in param_shapes(CONFIG)}, "parameters after two steps")
    assert not all(torch.equal(state[k], torch.from_numpy(np.asarray(params[k], np.float32))) for k in state)
