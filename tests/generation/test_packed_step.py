"""impl_torch's cached step on the CPU in float32 multiplies oneDNN-packed weights (impl_torch/packed.py):
the same layers with packed products give the plain step's logits to float32 rounding and the same
ids, the packed weights follow every change of the parameters (a write through `.data` included),
and the plain step runs wherever packing does not apply."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.check.compare import assert_close, to_numpy
from conformance.check.tolerances import tolerance
from conformance.core.presets import preset

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
if not torch.backends.mkldnn.is_available():
    pytest.skip("this torch has no oneDNN (mkldnn)", allow_module_level=True)

import impl_torch  # noqa: E402
from impl_torch import packed  # noqa: E402
from impl_torch.model import Linear  # noqa: E402

SIZES = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1,
             n_decoder_layers=2, max_len=12)
# Each switch a step's products meet: tied and shared W_out (paper), an untied W_out with its bias
# (llmhub), final_logits_bias (hf-marian), scaled logits without q/k/v biases and T5's relative
# bias (hf-t5), the GLU gate (hf-t5-v1_1), pre-LN (pre-ln-tutorial), no q/k/v bias with query-side
# target padding (from-scratch).
PRESETS = ("paper", "llmhub", "hf-marian", "hf-t5", "hf-t5-v1_1", "pre-ln-tutorial", "from-scratch")
SRC = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 4, 3, 0, 0], [5, 5, 6, 0, 0, 0]])


@pytest.fixture(autouse=True)
def every_product_packed(monkeypatch):
    """These models are tiny: every product packed all the same (packed.MIN_ELEMENTS is base Marian's)."""
    monkeypatch.setattr(packed, "MIN_ELEMENTS", 0)


def model_of(name: str, seed: int = 0, dtype: str = "float32"):
    config = preset(name, **SIZES)
    src = np.where(SRC == 0, config.pad_id, SRC)
    return impl_torch.Model(config, impl_torch_params(config, seed), dtype), src


def impl_torch_params(config, seed: int):
    from conformance import init_params

    return init_params(config, seed=seed)


def steps(model, src, tokens, enabled: bool, monkeypatch) -> np.ndarray:
    """The step logits (T, B, V) after each column of `tokens` (B, T), packed or plain."""
    monkeypatch.setattr(packed, "ENABLED", enabled)
    with torch.inference_mode():
        cache = model.start_cache(model.encode(src, return_attention=False), tokens.shape[1])
        assert (cache.step_decoder is not None) is enabled
        return np.stack([to_numpy(model.decode_step(tokens[:, t], cache)) for t in range(tokens.shape[1])])


@pytest.mark.parametrize("name", PRESETS)
def test_packed_steps_give_the_plain_steps_logits_and_ids(name, monkeypatch):
    model, src = model_of(name)
    config = model.config
    tokens = np.random.default_rng(1).integers(0, config.tgt_vocab_size, size=(3, 6))
    tokens[:, 0] = 1
    plain = steps(model, src, tokens, False, monkeypatch)
    with_packing = steps(model, src, tokens, True, monkeypatch)
    assert_close(with_packing, plain, tolerance("float32"), tensor="step logits", backend="torch", dtype="float32",
                 config=config, against="the plain step (MKL products)")
    # The copy runs packed products exactly where a step multiplies; everything else is the model's own.
    with torch.inference_mode():
        decoder, _ = packed.packed_step(model)
    for copy, own in zip(decoder.modules(), model.decoder.modules()):
        if isinstance(copy, packed.PackedLinear):
            assert type(own) is Linear and copy.source is own
        elif isinstance(copy, packed.FusedPart):  # self-attention's q, k, v, cross-attention's k, v: one product
            assert type(own) is Linear and copy.fused.sources[copy.index] is own
        else:  # a cross-attention reads the memory once per source for all its beams (GroupedBeams)
            kind = (packed.GroupedBeams, type(own)) if any(own is layer.cross_attn for layer in model.decoder.layers) \
                else (type(own),)
            assert type(copy).__bases__ == kind if len(kind) == 2 else type(copy) is kind[0], (type(copy), kind)
            assert copy._parameters is own._parameters and copy._buffers is own._buffers
    linears = [m for m in model.decoder.modules() if type(m) is Linear]
    swapped = [m for m in decoder.modules() if isinstance(m, (packed.PackedLinear, packed.FusedPart))]
    assert len(swapped) == len(linears)  # self-attention's q, k, v and cross-attention's k, v fused
    assert sum(isinstance(m, packed.FusedPart) for m in swapped) == 5 * config.n_decoder_layers
    for beams in (1, 3):
        monkeypatch.setattr(packed, "ENABLED", False)
        expected = to_numpy(model.generate(src, 8, 1, 2, num_beams=beams))
        monkeypatch.setattr(packed, "ENABLED", True)
        np.testing.assert_array_equal(to_numpy(model.generate(src, 8, 1, 2, num_beams=beams)), expected)


def test_packed_weights_follow_every_change_of_the_parameters(monkeypatch):
    """Packed once and reused while nothing changes; packed again after an in-place update (which
    bumps the version counter), a write through `.data` (which does not), a parameter replaced by
    another, and load_state_dict; the step's logits are the plain step's after each."""
    model, src = model_of("paper")
    tokens = np.array([[1, 4, 5], [1, 6, 7], [1, 8, 9]])
    packed.release(model)
    steps(model, src, tokens, True, monkeypatch)
    first = {key: held[2] for key, held in packed._PACKED[model].held.items()}
    steps(model, src, tokens, True, monkeypatch)
    again = {key: held[2] for key, held in packed._PACKED[model].held.items()}
    assert all(again[key] is first[key] for key in first), "packed again although nothing changed"
    ffn = model.decoder.layers[1].ffn.linear1
    other = model_of("paper", seed=5)[0]

    def changes():
        with torch.no_grad():
            ffn.weight.mul_(-2.0)
        yield "an in-place update"
        ffn.weight.data[0, 0] = 7.0
        yield "one value written through .data"
        model.target_embedding.weight.data.mul_(0.5)
        yield "the tied output weight through .data"
        model.decoder.layers[0].self_attn.q_proj.weight = torch.nn.Parameter(ffn.weight.new_ones(16, 16))
        yield "a parameter replaced"
        model.load_state_dict(other.state_dict())
        yield "load_state_dict"

    for change in changes():
        expected = steps(model, src, tokens, False, monkeypatch)
        got = steps(model, src, tokens, True, monkeypatch)
        assert_close(got, expected, tolerance("float32"), tensor=f"step logits after {change}", backend="torch",
                     dtype="float32", config=model.config, against="the plain step")


def test_the_plain_step_runs_where_packing_does_not_apply(monkeypatch):
    monkeypatch.setattr(packed, "ENABLED", True)
    model, src = model_of("paper")
    with torch.inference_mode():
        encoded = model.encode(src, return_attention=False)
        assert model.start_cache(encoded, 4).step_decoder is not None
        handle = model.decoder.layers[0].ffn.register_forward_hook(lambda *args: None)  # the copy would skip it
        assert model.start_cache(encoded, 4).step_decoder is None
        handle.remove()
        monkeypatch.setattr(packed, "ENABLED", False)
        assert model.start_cache(encoded, 4).step_decoder is None
        monkeypatch.setattr(packed, "ENABLED", True)
    # Autograd recording: the step multiplies the parameters, which the gradient reaches.
    cache = model.start_cache(model.encode(src, return_attention=False), 4)
    assert cache.step_decoder is None
    model.decode_step(np.array([1, 1, 1]), cache).sum().backward()
    assert model.decoder.layers[0].ffn.linear1.weight.grad is not None
    for dtype in ("float64", "bfloat16"):
        other, _ = model_of("paper", dtype=dtype)
        with torch.inference_mode():
            assert other.start_cache(other.encode(src, return_attention=False), 4).step_decoder is None
    mixed = impl_torch.Model(model.config, impl_torch_params(model.config, 0), "float32", param_dtype="bfloat16")
    with torch.inference_mode():
        assert mixed.start_cache(mixed.encode(src, return_attention=False), 4).step_decoder is None
    assert model in packed._PACKED
    model.double()  # recast: a search on it drops what was packed
    with torch.inference_mode():
        model.start_cache(model.encode(src, return_attention=False), 4)
    assert model not in packed._PACKED


def test_a_model_with_packed_weights_still_copies_and_saves(tmp_path, monkeypatch):
    """The packed weights live beside the model, not in it: deepcopy and torch.save of the module
    never meet them, and the copy packs its own."""
    import copy

    monkeypatch.setattr(packed, "ENABLED", True)
    model, src = model_of("hf-marian")
    expected = to_numpy(model.generate(src, 6, 1, 2))
    clone = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    np.testing.assert_array_equal(to_numpy(clone.generate(src, 6, 1, 2)), expected)
    assert packed._PACKED[clone].decoder is not packed._PACKED[model].decoder


def test_only_products_of_at_least_min_elements_are_packed(monkeypatch):
    """Small products stay torch's (a oneDNN call's host cost is repaid only by products that stream
    from memory): the copy packs those of at least `packed.MIN_ELEMENTS` weights and keeps the rest
    as they are, W_out included, and the logits are the plain step's; at the default (base Marian's
    512 x 512) a tiny model runs the plain step."""
    model, src = model_of("paper")  # d_model 16, d_ff 24: q|k|v 768 weights, cross k|v 512, FFN 384, the rest 256
    tokens = np.array([[1, 4, 5], [1, 6, 7], [1, 8, 9]])
    expected = steps(model, src, tokens, False, monkeypatch)
    monkeypatch.setattr(packed, "MIN_ELEMENTS", 384)
    got = steps(model, src, tokens, True, monkeypatch)
    assert_close(got, expected, tolerance("float32"), tensor="step logits", backend="torch", dtype="float32",
                 config=model.config, against="the plain step")
    with torch.inference_mode():
        decoder, output = packed.packed_step(model)
        cache = model.start_cache(model.encode(src, return_attention=False), 4)
    assert output is None and not cache.output_weight.is_mkldnn  # W_out (13 x 16) the step's (D, V) copy
    for layer in decoder.layers:
        assert all(isinstance(m, packed.FusedPart) for m in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                             layer.self_attn.v_proj, layer.cross_attn.k_proj,
                                                             layer.cross_attn.v_proj))
        assert isinstance(layer.ffn.linear1, packed.PackedLinear) and isinstance(layer.ffn.linear2, packed.PackedLinear)
        assert all(type(m) is Linear for m in (layer.self_attn.o_proj, layer.cross_attn.q_proj, layer.cross_attn.o_proj))
    monkeypatch.setattr(packed, "MIN_ELEMENTS", 512 * 512)
    with torch.inference_mode():
        assert model.start_cache(model.encode(src, return_attention=False), 4).step_decoder is None


@pytest.mark.parametrize("name", ["paper", "from-scratch", "hf-t5"])
def test_a_sources_beams_read_its_memory_once(name, monkeypatch):
    """With the packed copy, `start_cache(..., rows=...)` (generate's beams, source-major) keeps the
    memory's keys, values and mask once per source, and each cross-attention takes a source's beams
    as its queries (packed.GroupedBeams): the steps' logits are those of the plain step over keys
    and values repeated per beam, for beams that differ."""
    from impl_torch import decode

    model, src = model_of(name)
    beams = 3
    rows = torch.arange(src.shape[0]).repeat_interleave(beams)
    tokens = np.random.default_rng(2).integers(0, model.config.tgt_vocab_size, size=(len(rows), 4))
    logits = {}
    for enabled in (True, False):
        monkeypatch.setattr(packed, "ENABLED", enabled)
        with torch.inference_mode():
            cache = decode.start_cache(model, model.encode(src, return_attention=False), 4, rows=rows)
            expected_rows = src.shape[0] if enabled else len(rows)
            assert cache.cross_keys[0].shape[0] == cache.cross_values[-1].shape[0] == expected_rows
            assert cache.cross_mask is None or cache.cross_mask.shape[0] == expected_rows
            logits[enabled] = np.stack([to_numpy(model.decode_step(tokens[:, t], cache)) for t in range(4)])
    assert_close(logits[True], logits[False], tolerance("float32"), tensor="step logits, beams grouped",
                 backend="torch", dtype="float32", config=model.config, against="keys and values repeated per beam")
