"""impl_torch's CUDA graphs of the cached step (impl_torch/graphs.py) give `generate` the eager
step's ids and scores, bit for bit.

On the CPU the rooms run through `graphs.Recorded`, a stand-in for CUDA capture that records by
running: that exercises the key, the static buffers loaded per call, the in-place beam reorder and
the invalidation. On a CUDA device the same comparisons run with real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import impl_torch  # noqa: E402
from impl_torch import graphs  # noqa: E402

from conformance.core.presets import preset  # noqa: E402

SIZES = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1,
             n_decoder_layers=2, max_len=12)
# The presets of tests/generation/test_generate.py: key- and query-side target padding, no cross mask,
# causal-only target masks, -inf and finite fills, final_logits_bias, pre-LN.
PRESETS = ("paper", "llmhub", "from-scratch", "hf-marian", "annotated-transformer")
OPTIONS = {
    "greedy": dict(),
    "beam-gnmt": dict(num_beams=3, length_penalty=0.6, length_penalty_form="gnmt", num_return_sequences=2),
    "flax-rule": dict(num_beams=3, beam_rule="flax"),
    "sampling": dict(do_sample=True, seed=5, temperature=0.6, top_k=5, num_return_sequences=2),
    # transformers' processors of shipped generation configs (docs/decoding.md, "What is scored");
    # the end token suppressed, so that every call runs to max_len and the second records it all
    "shipped-processors": dict(num_beams=2, repetition_penalty=1.3, encoder_repetition_penalty=1.2,
                               encoder_no_repeat_ngram_size=2, exponential_decay_length_penalty=(1, 1.4),
                               suppress_tokens=[3, 2], begin_suppress_tokens=[4], renormalize_logits=True),
}


def sources(config, seed):
    """(3, 6) sources of one shape, with padding that differs with the seed."""
    rng = np.random.default_rng(seed)
    real = np.array([i for i in range(config.src_vocab_size) if i != config.pad_id])
    src = rng.choice(real, size=(3, 6))
    src[1, 3 + seed % 3:] = config.pad_id
    src[2, 1 + seed % 2:] = config.pad_id
    return src


class Counted(graphs.Recorded):
    captured = 0

    def record(self, fn):
        Counted.captured += 1
        return super().record(fn)


def eager(model, src, **options):
    previous, graphs.ENABLED = graphs.ENABLED, False
    try:
        return model.generate(src, 7, 1, 2, return_scores=True, **options)
    finally:
        graphs.ENABLED = previous


def assert_same(got, want, what):
    (ids, scores), (want_ids, want_scores) = got, want
    assert ids.shape == want_ids.shape and bool((ids == want_ids).all()), (what, ids, want_ids)
    assert torch.equal(scores, want_scores), (what, scores, want_scores)


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(graphs, "CAPTURES", {"cpu": Counted, "cuda": graphs.CudaCapture})
    monkeypatch.setattr(graphs, "ENABLED", True)
    Counted.captured = 0


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("option", OPTIONS)
def test_replayed_steps_give_the_eager_ids_and_scores(recorded, name, option):
    """First call eager (the key is new), second call builds the room and records each position,
    third and fourth replay, each on other sources of the same shape: every call equals the eager
    search on its own sources, bit for bit."""
    config = preset(name, **SIZES)
    model = impl_torch.Model(config, dtype="float64")
    options = OPTIONS[option]
    for call, seed in enumerate((1, 2, 3, 4)):
        src = sources(config, seed)
        got = model.generate(src, 7, 1, 2, return_scores=True, **options)
        assert_same(got, eager(model, src, **options), f"{name}, {option}, call {call + 1}")
        if call == 0:
            assert Counted.captured == 0 and not model.__dict__.get("_graph_rooms"), "the first call of a key is eager"
        if call == 1:
            captured = Counted.captured
            assert captured > 0 and len(model._graph_rooms) == 1
    assert Counted.captured == captured, "the third and fourth calls replayed what the second recorded"


def test_a_new_shape_or_new_parameters_make_a_new_room_and_in_place_updates_are_read(recorded):
    config = preset("hf-marian", **SIZES)
    model = impl_torch.Model(config, dtype="float32")
    src = sources(config, 1)
    for _ in range(3):
        model.generate(src, 7, 1, 2, num_beams=2)
    assert len(model._graph_rooms) == 1
    # An in-place update (an optimizer step) is read by the replay, as by an eager step.
    with torch.no_grad():
        model.final_logits_bias.add_(torch.linspace(-3, 3, config.tgt_vocab_size))
    assert_same(model.generate(src, 7, 1, 2, num_beams=2, return_scores=True),
                eager(model, src, num_beams=2), "after an in-place update")
    # New parameter tensors (a cast) are a new key: eager first, then a room of their own.
    model.double()
    for _ in range(3):
        assert_same(model.generate(src, 7, 1, 2, num_beams=2, return_scores=True),
                    eager(model, src, num_beams=2), "after .double()")
    assert len(model._graph_rooms) == graphs.MAX_ROOMS
    # Another source length: another key; the least recently used room is dropped.
    longer = np.concatenate([src, src[:, :2]], axis=1)
    for _ in range(2):
        model.generate(longer, 7, 1, 2)
    assert len(model._graph_rooms) == graphs.MAX_ROOMS
    graphs.release(model)
    assert not model.__dict__.get("_graph_rooms")


def test_without_a_capture_for_the_device_or_switched_off_nothing_is_kept(monkeypatch):
    config = preset("paper", **SIZES)
    model = impl_torch.Model(config, dtype="float32")
    src = sources(config, 1)
    monkeypatch.setattr(graphs, "CAPTURES", {"cuda": graphs.CudaCapture})  # the shipped table: no CPU capture
    for _ in range(3):
        model.generate(src, 7, 1, 2)
    assert not model.__dict__.get("_graph_rooms")
    monkeypatch.setattr(graphs, "CAPTURES", {"cpu": Counted})
    monkeypatch.setattr(graphs, "ENABLED", False)
    for _ in range(3):
        model.generate(src, 7, 1, 2)
    assert not model.__dict__.get("_graph_rooms")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cuda_graphs_give_the_eager_ids_and_scores(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False (the CPU stand-in runs above)")
    for name in ("paper", "llmhub", "hf-marian"):
        config = preset(name, **SIZES)
        model = impl_torch.Model(config, dtype=dtype, device="cuda")
        for option, options in OPTIONS.items():
            graphs.release(model)
            for call, seed in enumerate((1, 2, 3, 4)):
                src = sources(config, seed)
                got = model.generate(src, 7, 1, 2, return_scores=True, **options)
                assert_same(got, eager(model, src, **options), f"{name}, {option}, {dtype}, call {call + 1}")
            assert len(model._graph_rooms) == 1
