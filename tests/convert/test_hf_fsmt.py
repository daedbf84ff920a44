"""FSMT (fairseq's WMT19 transformers in transformers), against transformers itself (issue 53).

A tiny FSMTForConditionalGeneration with separate source and target vocabularies, every parameter
perturbed (LayerNorm scales and biases included), written by `save_pretrained`, then:

- `rosetta convert FOLDER out.safetensors` with no --set: separate vocabularies and embeddings,
  fairseq's sinusoid from pad + 1 (the stored table), post-LN, an untied output_projection;
- logits in NumPy, torch and JAX (float32) and NumPy float64 equal transformers' forward on a
  right-padded batch whose decoder input starts with the end token (FSMT's start) and is
  right-padded too;
- greedy and beam-4 ids equal transformers' generate (float64, nothing but the beams passed);
- float64 `loss_and_grads` equals transformers' autograd for every trainable parameter;
- `--to hf-fsmt` writes a folder `from_pretrained` loads with the same logits.

Two transformers 5.23 facts shape the reference (docs/variants.md): FSMTModel builds the decoder's
causal and padding masks only when `use_cache` is False (with the default True a multi-token
forward attends to later positions), so the forward is called with use_cache=False; and that path
cannot run in float64 (`fill_with_neg_inf` converts finfo(float64).min to float32 and overflows),
so the float64 rows fill in the model's own dtype instead (`float64_fill`: the same -inf-like
fill, no other change).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="FSMT is a PyTorch model")
transformers = pytest.importorskip("transformers", reason="the model is built by transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers beside the rooms

from conformance.check import backends  # noqa: E402
from conformance.check.compare import compare, to_numpy  # noqa: E402
from conformance.check.tolerances import gradient_tolerance, tolerance  # noqa: E402
from conformance.check.training import scaled_error  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import export_state_dict, import_state_dict, load_layout  # noqa: E402
from conformance.convert.readers import as_arrays  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from systems import randomize_  # noqa: E402
from systems.harness import BACKEND_PARAMS, run_backend  # noqa: E402

import impl_numpy  # noqa: E402

PAD, EOS, SRC_VOCAB, TGT_VOCAB = 1, 2, 30, 40
SIZES = dict(langs=["en", "de"], src_vocab_size=SRC_VOCAB, tgt_vocab_size=TGT_VOCAB, d_model=16, encoder_layers=2,
             decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
             decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=0,
             decoder_start_token_id=EOS, forced_eos_token_id=EOS)


def build():
    torch.manual_seed(0)
    model = transformers.FSMTForConditionalGeneration(transformers.FSMTConfig(**SIZES)).eval()
    model.generation_config.update(num_beams=1, max_length=12, no_repeat_ngram_size=2)
    return randomize_(model, 7, skip=("embed_positions",))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = build()
    root = tmp_path_factory.mktemp("fsmt")
    model.save_pretrained(root / "folder")
    out = root / "fsmt.safetensors"
    assert main(["convert", str(root / "folder"), str(out)]) == 0
    config, params = checkpoint.load(out)
    return model, root / "folder", config, params


def batch():
    rng = np.random.default_rng(5)
    src = np.full((3, 8), PAD)
    labels = np.full((3, 6), PAD)
    for row, (n_src, n_tgt) in enumerate([(8, 6), (5, 3), (2, 1)]):
        src[row, :n_src] = rng.integers(3, SRC_VOCAB, n_src)
        labels[row, :n_tgt] = rng.integers(3, TGT_VOCAB, n_tgt)
    tgt = np.concatenate([np.full((3, 1), EOS), labels[:, :-1]], axis=1)
    return src, tgt, labels


@contextlib.contextmanager
def float64_fill():
    """FSMT's causal mask in the model's dtype (its own converts finfo(float64).min to float32)."""
    from transformers.models.fsmt import modeling_fsmt

    original = modeling_fsmt.fill_with_neg_inf
    modeling_fsmt.fill_with_neg_inf = lambda t: t.fill_(torch.finfo(t.dtype).min)
    try:
        yield
    finally:
        modeling_fsmt.fill_with_neg_inf = original


def hf_forward(model, src, tgt):
    src, tgt = torch.as_tensor(src), torch.as_tensor(tgt)
    return model(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt, use_cache=False).logits


def hf_logits(model, src, tgt) -> np.ndarray:
    with torch.no_grad(), float64_fill():
        return hf_forward(model, src, tgt).numpy()


def test_the_folder_converts_with_no_set(built):
    model, _, config, params = built
    assert (config.src_vocab_size, config.tgt_vocab_size, config.pad_id, config.position_offset) == (30, 40, 1, 2)
    assert config.position == "table" and config.position_ids == "non-pad" and config.max_len == 32
    assert config.norm_placement == "post" and not (config.final_encoder_norm or config.embedding_norm)
    assert not (config.share_embeddings or config.tie_output or config.output_bias or config.final_logits_bias)
    assert config.scale_embedding and config.tgt_pad_mask == "keys" and config.activation == "relu"
    # A bare state dict is FSMT's alone: detected, and the same config with the heads given.
    bare, _ = import_state_dict(as_arrays(model.state_dict()), None, n_heads=2, max_len=32)
    assert bare.notes["converted_from"] == "hf-fsmt" and bare.replace(notes={}) == config.replace(notes={})


def test_float64_numpy_logits_equal_transformers(built):
    model, _, config, params = built
    src, tgt, _ = batch()
    reference = hf_logits(copy.deepcopy(model).double(), src, tgt)
    ours = impl_numpy.Model(config, {k: v.astype(np.float64) for k, v in params.items()}, dtype="float64")(src, tgt).logits
    assert scaled_error(ours, reference) <= 1e-10


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_float32_backends_match_transformers(built, backend):
    model, _, config, params = built
    src, tgt, _ = batch()
    result = compare(run_backend(backend, config, params, src, tgt), hf_logits(model, src, tgt), tolerance("float32"))
    assert result.passed, f"{backend}: {result.describe()}"


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_generate_gives_transformers_ids(built, backend, num_beams):
    model, _, config, params = built
    src, _, _ = batch()
    with torch.no_grad():
        out = copy.deepcopy(model).double().generate(input_ids=torch.from_numpy(src),
                                                     attention_mask=torch.from_numpy(src != PAD).long(),
                                                     num_beams=num_beams, do_sample=False)
    assert (out[:, 0] == EOS).all()
    expected = out[:, 1:].numpy()
    target = backends.Target(backend, "cpu", "float64")
    with backends.full_precision(backend), backends.dtype_scope(target):
        ours = backends.build(target, config, {k: v.astype(np.float64) for k, v in params.items()})
        ids = to_numpy(ours.generate(src, num_beams=num_beams)).astype(np.int64)
    assert ids.shape == expected.shape and (ids == expected).all(), f"ours {ids.tolist()}\nHF   {expected.tolist()}"


def test_float64_gradients_equal_transformers_autograd(built):
    model, _, config, params = built
    src, tgt, labels = batch()
    reference = copy.deepcopy(model).double()
    reference.zero_grad(set_to_none=True)
    with float64_fill():
        logits = hf_forward(reference, src, tgt)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(labels).reshape(-1),
                                             ignore_index=PAD)
    loss.backward()
    theirs = {k: p.grad.numpy() for k, p in reference.named_parameters() if p.grad is not None}
    ours_loss, grads = impl_numpy.Model(config, {k: v.astype(np.float64) for k, v in params.items()},
                                        dtype="float64").loss_and_grads(src, tgt, labels)
    assert abs(ours_loss - loss.item()) <= 1e-12 * max(1.0, abs(loss.item()))
    ours = export_state_dict(config, grads, load_layout("hf-fsmt"))
    assert {"model.decoder.output_projection.weight", "model.encoder.embed_tokens.weight"} <= set(theirs)
    allowed = gradient_tolerance("float64").atol
    for key, grad in theirs.items():
        assert scaled_error(ours[key], grad) <= allowed, key


def test_the_export_folder_loads_in_transformers_with_the_same_logits(built, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, folder, _, _ = built
    ours = tmp_path / "ours.safetensors"
    assert main(["convert", str(folder), str(ours)]) == 0
    assert main(["convert", str(ours), str(tmp_path / "back"), "--to", "hf-fsmt"]) == 0
    loaded = transformers.FSMTForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    src, tgt, _ = batch()
    np.testing.assert_array_equal(hf_logits(loaded, src, tgt), hf_logits(model, src, tgt))
    assert loaded.config.src_vocab_size == SRC_VOCAB and loaded.config.tgt_vocab_size == TGT_VOCAB


def test_taps_read_transformers_tensors_where_ours_computes_them(built):
    """Every tapped tensor of transformers' float64 FSMT (its layers sequence-first, batch_axis 1)
    agrees with the float64 oracle: the residual stream after each sublayer and the embeddings."""
    import conformance

    model, _, _, _ = built
    model = copy.deepcopy(model).double()
    src, tgt, _ = batch()
    layout = load_layout("hf-fsmt")
    told = layout.hf.read(model.config.to_dict(), "model.config")

    def run(m, s, t):
        return hf_forward(m, s, t)

    with float64_fill():
        report = conformance.compare(model, layout, src, tgt, run=run, dtype="float64", backends=(), **told)
    assert report.ok, report.to_text()
    compared = {t for (t, label), c in report.cells.items() if label == report.yours.label and c.comparison is not None}
    assert {"encoder.embeddings", "encoder.1.ffn", "decoder.embeddings", "decoder.1.self_attn", "decoder.1.cross_attn",
            "decoder.1.ffn", "logits"} <= compared, compared
