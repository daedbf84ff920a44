"""`final_logits_bias` is a registered buffer in transformers (Marian, BART, mBART, Pegasus, PLBart, Blenderbot, BlenderbotSmall), not
a parameter: fine-tuning never moves it. `ModelConfig.freeze_final_logits_bias`, set by the
Hugging Face importers, gives it a zero gradient in every backend's `loss_and_grads`, so that our
Adam leaves it as it is too (issue 56, item 4: before, it got the logits' gradient and moved).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from conformance.check import backends
from conformance.check.compare import to_numpy
from systems.harness import BACKEND_PARAMS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SRC = np.array([[5, 6, 7, 8, 2], [9, 10, 2, 1, 1]])
TGT = np.array([[2, 5, 6, 7], [2, 9, 10, 1]])  # BART: the decoder starts from its end id 2
LABELS = np.array([[5, 6, 7, 2], [9, 10, 2, 1]])  # pad id 1 does not count


@functools.cache
def bart():
    config = transformers.BartConfig(vocab_size=23, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                     decoder_ffn_dim=24, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval().double()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # not zero: a moved bias would show
    return model


def test_transformers_does_not_train_final_logits_bias():
    """The reference behaviour: a buffer, outside named_parameters, unchanged by an Adam step."""
    model = bart()
    assert "final_logits_bias" in dict(model.named_buffers())
    assert "final_logits_bias" not in dict(model.named_parameters())
    trained = transformers.BartForConditionalGeneration(model.config).double()
    trained.load_state_dict(model.state_dict())
    before = trained.final_logits_bias.clone()
    optimizer = torch.optim.Adam(trained.parameters(), lr=1e-2)
    logits = trained(input_ids=torch.from_numpy(SRC), attention_mask=torch.from_numpy(SRC != 1).long(),
                     decoder_input_ids=torch.from_numpy(TGT)).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(LABELS).reshape(-1),
                                      ignore_index=1).backward()
    optimizer.step()
    assert torch.equal(trained.final_logits_bias, before)


def final_bias_after_a_step(backend: str, config, params) -> tuple[np.ndarray, np.ndarray]:
    """(the gradient of final_logits_bias, the bias after one of our Adam steps) in `backend`."""
    import importlib

    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        _, grads = model.loss_and_grads(SRC, TGT, LABELS)
        train = importlib.import_module(f"impl_{backend}.train")
        optimizer = train.Adam(model, config.d_model, warmup=1)
        train.train_step(model, optimizer, SRC, TGT, LABELS)
        after = model.state_dict() if backend == "torch" else model.params
        return to_numpy(grads["final_logits_bias"]), to_numpy(after["final_logits_bias"])


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_our_import_freezes_it_in_every_backend(backend):
    from conformance.convert import from_hf

    config, params = from_hf(bart())
    assert config.final_logits_bias and config.freeze_final_logits_bias
    params = {name: value.astype(np.float64) for name, value in params.items()}
    gradient, after = final_bias_after_a_step(backend, config, params)
    assert not gradient.any(), gradient
    assert np.array_equal(after, params["final_logits_bias"])
    # The switch is what holds it: without it the bias gets the logits' gradient and moves.
    gradient, after = final_bias_after_a_step(backend, config.replace(freeze_final_logits_bias=False), params)
    assert gradient.any() and not np.array_equal(after, params["final_logits_bias"])


def test_every_hf_family_with_the_bias_freezes_it():
    from conformance.core.presets import PRESETS

    with_bias = sorted(name for name, switches in PRESETS.items() if switches.get("final_logits_bias"))
    # transformers keeps the bias as a buffer (nn.Buffer / register_buffer) in every one of them
    assert with_bias == ["hf-bart", "hf-blenderbot", "hf-blenderbot-small", "hf-marian", "hf-mbart", "hf-pegasus",
                         "hf-plbart"], with_bias
    assert all(PRESETS[name].get("freeze_final_logits_bias") for name in with_bias)
