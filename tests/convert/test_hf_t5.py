"""T5, T5 v1.1 / Flan-T5 and mT5 against transformers itself (hf-t5, hf-mt5).

Tiny random models (d_model 16, 3 heads of d_kv 8, so the attention is 24 wide and not d_model;
d_ff 32; 2 + 2 blocks; vocabulary 64; 8 relative buckets up to distance 20, so that rows of 10-12
tokens reach the logarithmic buckets in both stacks), every parameter perturbed by a seeded normal
(the v1.1 and mT5 lm_head apart from the shared embedding, as in released checkpoints), written by
`save_pretrained`:

- `rosetta convert FOLDER out.safetensors` with no --set reads every switch from config.json; the
  live model (`from_hf`) gives the same; a bare state dict without config.json detects hf-t5 and
  reads the heads, d_head, the buckets, the FFN form and the tie from the tensors;
- float64 NumPy logits equal transformers' float64 forward to 1e-10 (relative) on right-padded
  sources and decoder inputs that start with 0 (the pad id, T5's decoder start); torch and JAX
  in float32 agree with its float32 forward within the float32 tolerance;
- `--to hf-t5` / `--to hf-mt5` writes a folder that from_pretrained loads with the same logits;
- float64 `loss_and_grads` equals transformers' autograd (cross-entropy, pad labels ignored,
  mean), relative_attention_bias and the shared embedding included;
- the layout's `[taps]` read transformers' tensors where ours computes them.

T5LayerNorm computes its variance in float32 whatever the input dtype (for half precision), so
`model.double()` alone is float64 except there (3e-7 apart, measured); the float64 references
run with that one line kept in float64 (`float64_variance`), as the Flax fixtures' float64 pass
did. The float32 comparisons run transformers as it is.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="T5 is a PyTorch model here")
transformers = pytest.importorskip("transformers", reason="the models are built by transformers")

from transformers.models.mt5 import modeling_mt5  # noqa: E402
from transformers.models.t5 import modeling_t5  # noqa: E402
from transformers.models.umt5 import modeling_umt5  # noqa: E402

import conformance  # noqa: E402
from conformance.check.compare import compare  # noqa: E402
from conformance.check.tolerances import gradient_tolerance, tolerance  # noqa: E402
from conformance.check.training import scaled_error  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import AmbiguousLayoutError, export_state_dict, from_hf, from_hf_folder, import_state_dict, load_layout  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import ConfigError  # noqa: E402
from systems import randomize_  # noqa: E402
from systems.harness import BACKEND_PARAMS, exported_and_reloaded, run_backend, saved_and_converted  # noqa: E402

import impl_numpy  # noqa: E402

VOCAB, PAD, EOS = 64, 0, 1
SIZES = dict(vocab_size=VOCAB, d_model=16, d_kv=8, num_heads=3, d_ff=32, num_layers=2, num_decoder_layers=2,
             relative_attention_num_buckets=8, relative_attention_max_distance=20, pad_token_id=PAD, eos_token_id=EOS)
FLOAT64_LOGITS = 1e-10  # max |ours - theirs| / max(1, max |theirs|)


@dataclass(frozen=True)
class Family:
    layout: str
    config_class: str
    model_class: str
    extra: dict = field(default_factory=dict)
    untie: bool = False  # an lm_head of its own (v1.1, Flan-T5, mT5)
    expected: dict = field(default_factory=dict)


FAMILIES = {
    "t5": Family("hf-t5", "T5Config", "T5ForConditionalGeneration", dict(decoder_start_token_id=0),
                 expected=dict(activation="relu", ffn_glu=False, tie_output=True, scale_logits=True)),
    "t5-v1_1": Family("hf-t5", "T5Config", "T5ForConditionalGeneration",
                      dict(decoder_start_token_id=0, feed_forward_proj="gated-gelu", tie_word_embeddings=False), untie=True,
                      expected=dict(activation="gelu-tanh", ffn_glu=True, tie_output=False, scale_logits=False)),
    "mt5": Family("hf-mt5", "MT5Config", "MT5ForConditionalGeneration",
                  dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False), untie=True,
                  expected=dict(activation="gelu-tanh", ffn_glu=True, tie_output=False, scale_logits=False)),
    # UMT5: a relative position table in every self-attention layer; the logits always scaled.
    "umt5": Family("hf-umt5", "UMT5Config", "UMT5ForConditionalGeneration",
                   dict(feed_forward_proj="gated-gelu", decoder_start_token_id=0), untie=True,
                   expected=dict(activation="gelu-tanh", ffn_glu=True, tie_output=False, scale_logits=True,
                                 relative_bias_per_layer=True)),
}
NAMES = list(FAMILIES)


def build(name: str, **changes):
    family = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(**{**SIZES, **family.extra, **changes})
    model = getattr(transformers, family.model_class)(config).eval()
    if family.untie:  # a head of its own, as v1.1/mT5 checkpoints load (their lm_head differs)
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    model.generation_config.num_beams = 2
    return randomize_(model, 7)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (model, its save_pretrained folder, the folder converted with no --set), once."""
    return saved_and_converted(build, tmp_path_factory)


def batch():
    """(src, tgt, labels): sources of 12, 7 and 3 real tokens, right-padded; labels of 11, 6 and 2,
    and the decoder input their shift right behind the start id 0 (= the pad id)."""
    rng = np.random.default_rng(11)
    real = np.arange(2, VOCAB)
    src = np.full((3, 12), PAD, dtype=np.int64)
    labels = np.full((3, 11), PAD, dtype=np.int64)
    for row, (n_src, n_tgt) in enumerate([(12, 11), (7, 6), (3, 2)]):
        src[row, :n_src] = rng.choice(real, n_src)
        labels[row, :n_tgt] = rng.choice(real, n_tgt)
    tgt = np.concatenate([np.full((3, 1), PAD), labels[:, :-1]], axis=1)
    return src, tgt, labels


def hf_run(model, src, tgt):
    src, tgt = torch.as_tensor(src), torch.as_tensor(tgt)
    return model(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt)


def hf_logits(model, src, tgt) -> np.ndarray:
    with torch.no_grad():
        return hf_run(model, src, tgt).logits.numpy()


@contextlib.contextmanager
def float64_variance():
    """T5LayerNorm (and mT5's copy) with its variance in the input's dtype when that is wider than
    float32: the same equation, the one float32 cast of a float64 model removed."""

    def forward(self, hidden_states):
        wide = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))
        variance = wide.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    saved = [(cls, cls.forward) for cls in (modeling_t5.T5LayerNorm, modeling_mt5.MT5LayerNorm, modeling_umt5.UMT5LayerNorm)]
    try:
        for cls, _ in saved:
            cls.forward = forward
        yield
    finally:
        for cls, original in saved:
            cls.forward = original


def relative(ours, theirs) -> float:
    return scaled_error(np.asarray(ours, np.float64), np.asarray(theirs, np.float64))


def ours64(config, params, src, tgt) -> np.ndarray:
    return impl_numpy.Model(config, {k: v.astype(np.float64) for k, v in params.items()}, dtype="float64")(src, tgt).logits


# -- config.json, model.config and a bare state dict ---------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_folder_converts_with_no_set_and_so_does_the_live_model(name, built, tmp_path, capsys):
    model, folder, (config, params) = built(name)
    family = FAMILIES[name]
    out = tmp_path / "ours.safetensors"
    assert main(["convert", str(folder), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"layout: {family.layout}" in printed and "the layout's default" not in printed, printed
    saved_config, _ = checkpoint.load(out)
    assert saved_config.replace(notes={}) == config.replace(notes={})
    for key, value in family.expected.items():
        assert getattr(config, key) == value, (name, key, getattr(config, key))
    assert (config.n_heads, config.d_head, config.inner_dim, config.d_model, config.d_ff) == (3, 8, 24, 16, 32)
    assert (config.relative_buckets, config.relative_max_distance, config.position) == (8, 20, "relative")
    assert (config.layer_norm_form, config.layer_norm_eps, config.scale_scores, config.norm_placement) == ("rms", 1e-6, False, "pre")
    assert config.share_embeddings and not config.freeze_pad_embedding and not config.output_bias
    assert config.max_len == 512  # T5 has no limit: config.json's n_positions, else 512
    assert config.tgt_pad_mask == "none" and config.mask_fill == -3.4028234663852886e38 and config.pad_id == PAD
    generation = json.loads(config.notes["generation"])
    assert generation["decoder_start_token_id"] == PAD and generation["eos_token_id"] == EOS
    assert generation["num_beams"] == 2
    live_config, live = from_hf(model)
    assert live_config == config and sorted(live) == sorted(params)
    assert all(np.array_equal(live[k], params[k]) for k in params)


def test_a_bare_state_dict_tells_heads_head_size_buckets_ffn_and_tie():
    """Without config.json: n_heads and relative_buckets from relative_attention_bias (buckets,
    H), d_head from the query's width 24 over 3 heads, the gated FFN from wi_0, and the untied
    (so unscaled) head from lm_head holding other values than shared; only the bucket distance
    and max_len are not in the tensors."""
    model = build("t5-v1_1")
    config, params = import_state_dict(model.state_dict(), None, relative_max_distance=20, max_len=32)
    assert config.notes["converted_from"] == "hf-t5"
    assert (config.n_heads, config.d_head, config.relative_buckets) == (3, 8, 8)
    assert config.ffn_glu and config.activation == "gelu-tanh" and not config.tie_output and not config.scale_logits
    src, tgt, _ = batch()
    with float64_variance():
        reference = hf_logits(copy.deepcopy(model).double(), src, tgt)
    assert relative(ours64(config, params, src, tgt), reference) <= FLOAT64_LOGITS
    # A saved copy of a tied head is a duplicate (transformers ties equal weights at load). A tied
    # head is where T5 and mT5 part: T5 v1.0 scales its input by d_model^-1/2, mT5 never does, and
    # no key tells them apart, so auto-detection refuses, naming both and the switch; by name, it converts.
    tied = build("t5")
    state = {**tied.state_dict()}
    assert "lm_head.weight" in state
    with pytest.raises(AmbiguousLayoutError) as refused:
        import_state_dict(state, None, relative_max_distance=20, max_len=32)
    assert refused.value.names == ["hf-mt5", "hf-t5"] and "scale_logits" in str(refused.value), str(refused.value)
    assert "--layout hf-t5" in str(refused.value) and "trial forward pass cannot catch" in str(refused.value)
    config, _ = import_state_dict(state, "hf-t5", relative_max_distance=20, max_len=32)
    assert config.tie_output and config.scale_logits and config.activation == "relu" and not config.ffn_glu


def test_a_mislabelled_config_is_refused_by_name(built, tmp_path):
    _, folder, _ = built("t5")
    edited = tmp_path / "edited"
    edited.mkdir()
    for path in folder.iterdir():
        (edited / path.name).write_bytes(path.read_bytes())
    data = json.loads((edited / "config.json").read_text())
    data.pop("dense_act_fn")
    data.pop("is_gated_act")
    (edited / "config.json").write_text(json.dumps({**data, "feed_forward_proj": "gated-mish"}))
    with pytest.raises(ConfigError, match="feed_forward_proj 'gated-mish'") as info:
        from_hf_folder(edited)
    assert info.value.field == "activation"
    (edited / "config.json").write_text(json.dumps({**data, "num_heads": 4}))  # 24 is not 4 heads of d_kv 8
    with pytest.raises(ConfigError) as info:
        from_hf_folder(edited)
    assert info.value.field == "n_heads"


def test_tied_and_unscaled_as_transformers_5_builds_it(tmp_path):
    """`T5Config(tie_word_embeddings=False)` builds a tied head (5.23 forces the tie) that is not
    scaled; its folder says so (scale_decoder_outputs false) and converts to exactly that."""
    model = build("t5", tie_word_embeddings=False)
    assert model.lm_head.weight is model.shared.weight and not model.config.scale_decoder_outputs
    folder = tmp_path / "tied-unscaled"
    model.save_pretrained(folder)
    config, params = from_hf_folder(folder)
    assert config.tie_output and not config.scale_logits
    src, tgt, _ = batch()
    with float64_variance():
        reference = hf_logits(copy.deepcopy(model).double(), src, tgt)
    assert relative(ours64(config, params, src, tgt), reference) <= FLOAT64_LOGITS
    export_folder(config, params, "hf-t5", tmp_path / "out")
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert loaded.lm_head.weight is loaded.shared.weight and not loaded.config.scale_decoder_outputs
    np.testing.assert_array_equal(hf_logits(loaded, src, tgt), hf_logits(model, src, tgt))


def test_a_config_without_a_decoder_start_records_t5s(tmp_path):
    """T5Config has no decoder_start_token_id field: a model built without one cannot generate in
    transformers. The conversion records T5's (its pad id), so that `generate` needs no ids."""
    model = build("t5", decoder_start_token_id=None)
    assert model.generation_config.decoder_start_token_id is None
    folder = tmp_path / "no-start"
    model.save_pretrained(folder)
    config, _ = from_hf_folder(folder)
    assert json.loads(config.notes["generation"])["decoder_start_token_id"] == PAD
    from conformance.core.generation.note import generation_note

    assert generation_note(config)["bos_id"] == PAD and generation_note(config)["eos_id"] == EOS


# -- logits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_float64_numpy_logits_equal_transformers_float64_forward(name, built):
    model, _, (config, params) = built(name)
    src, tgt, _ = batch()
    with float64_variance():
        reference = hf_logits(copy.deepcopy(model).double(), src, tgt)
    error = relative(ours64(config, params, src, tgt), reference)
    assert error <= FLOAT64_LOGITS, f"{name}: float64 NumPy vs transformers .double(): {error:.3e}"


@pytest.mark.parametrize("backend", [p for p in BACKEND_PARAMS if p.values[0] != "numpy"])
@pytest.mark.parametrize("name", NAMES)
def test_float32_backends_match_transformers(name, backend, built):
    model, _, (config, params) = built(name)
    src, tgt, _ = batch()
    result = compare(run_backend(backend, config, params, src, tgt), hf_logits(model, src, tgt), tolerance("float32"))
    assert result.passed, f"{name} on {backend}, float32: {result.describe()}"


def export_folder(config, params, layout, out):
    from conformance.convert.hf_folder import write_folder

    write_folder(out, config, export_state_dict(config, params, layout), layout)


@pytest.mark.parametrize("name", NAMES)
def test_export_folder_loads_in_transformers_with_the_same_logits(name, built, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, folder, _ = built(name)
    family = FAMILIES[name]
    loaded = exported_and_reloaded(folder, family, tmp_path, capsys)
    assert (loaded.lm_head.weight is loaded.shared.weight) == (model.lm_head.weight is model.shared.weight)
    src, tgt, _ = batch()
    np.testing.assert_array_equal(hf_logits(loaded.eval(), src, tgt), hf_logits(model, src, tgt))
    for key in ("decoder_start_token_id", "eos_token_id", "pad_token_id", "num_beams"):
        assert getattr(loaded.generation_config, key) == getattr(model.generation_config, key), key
    assert type(loaded.config) is type(model.config)
    for key in ("d_model", "d_kv", "num_heads", "d_ff", "relative_attention_num_buckets", "relative_attention_max_distance",
                "layer_norm_epsilon", "dense_act_fn", "is_gated_act", "vocab_size", "pad_token_id"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    if name not in ("mt5", "umt5"):  # mT5 never scales; UMT5 always does: neither config has the field
        assert loaded.config.scale_decoder_outputs == model.config.scale_decoder_outputs


@pytest.mark.parametrize("preset_name, layout", [("hf-t5", "hf-t5"), ("hf-t5-v1_1", "hf-t5"), ("hf-mt5", "hf-mt5")])
def test_a_preset_model_of_our_own_exports_to_a_folder_transformers_computes_alike(preset_name, layout, tmp_path):
    """A model that never was a transformers one (the presets, d_head 0 = d_model / H) gets a
    folder whose d_kv is the head size, whose special ids are T5's, and whose float64 logits are
    ours."""
    from conformance import init_params, preset

    config = preset(preset_name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=24,
                    n_encoder_layers=2, n_decoder_layers=1, relative_buckets=8, relative_max_distance=20, max_len=16)
    params = init_params(config, seed=3)
    export_folder(config, params, layout, tmp_path / "out")
    cls = getattr(transformers, FAMILIES["mt5" if layout == "hf-mt5" else "t5"].model_class)
    loaded, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.d_kv == 8 and loaded.generation_config.decoder_start_token_id == PAD
    src, tgt, _ = batch()
    with float64_variance():
        reference = hf_logits(loaded.eval().double(), src, tgt)
    assert relative(ours64(config, params, src, tgt), reference) <= FLOAT64_LOGITS
    back, _ = from_hf_folder(tmp_path / "out")
    assert back.replace(notes={}) == config.replace(d_head=8, notes={})


def test_an_mt5_export_refuses_scaled_logits(built):
    """MT5ForConditionalGeneration never scales: a tied, scaled (T5 v1.0) config has no mT5 folder."""
    _, _, (config, params) = built("t5")
    with pytest.raises(ConfigError, match="scale_logits") as info:
        export_state_dict(config, params, "hf-mt5")
    assert info.value.field == "scale_logits"


# -- gradients ------------------------------------------------------------------------------------


def hf_grads(model, src, tgt, labels) -> tuple[float, dict[str, np.ndarray]]:
    """transformers' loss (mean cross-entropy over labels that are not pad) and autograd gradients."""
    model.zero_grad(set_to_none=True)
    logits = hf_run(model, src, tgt).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(labels).reshape(-1),
                                             ignore_index=PAD)
    loss.backward()
    return loss.item(), {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", NAMES)
def test_float64_gradients_equal_transformers_autograd(name, built):
    """Every trainable parameter, by transformers' key: relative_attention_bias of both stacks and
    the shared embedding included (T5's has no padding_idx: the decoder's start id, the pad id,
    sends its lookup gradient to row 0, as ours does with freeze_pad_embedding off)."""
    model, _, (config, params) = built(name)
    layout = load_layout(FAMILIES[name].layout)
    src, tgt, labels = batch()
    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    reference = copy.deepcopy(model).double()
    with float64_variance():
        theirs_loss, theirs = hf_grads(reference, src, tgt, labels)
    loss, grads = impl_numpy.Model(config, params64, dtype="float64").loss_and_grads(src, tgt, labels)
    assert abs(loss - theirs_loss) <= 1e-12 * max(1.0, abs(theirs_loss)), (loss, theirs_loss)
    ours = export_state_dict(config, grads, layout)
    for key in ("shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"):
        assert key in theirs and np.abs(theirs[key]).max() > 0, key
    assert ("lm_head.weight" in theirs) == FAMILIES[name].untie
    allowed = gradient_tolerance("float64").atol
    for key, grad in theirs.items():
        error = relative(ours[key], grad)
        assert error <= allowed, f"{name}: gradient of {key}: {error:.3e} (allowed {allowed:g})"


# -- taps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t5", "t5-v1_1", "mt5", "umt5"])
def test_taps_read_transformers_tensors_where_ours_computes_them(name, built):
    """Every tapped tensor of the float64 model (eager attention, so that weights are returned)
    agrees with the float64 oracle: a tap at the wrong module would diverge."""
    model, _, _ = built(name)
    model = copy.deepcopy(model).double()
    model.set_attn_implementation("eager")  # the stacks hold copies of the config: set on every one
    src, tgt, _ = batch()
    layout = load_layout(FAMILIES[name].layout)
    told = layout.hf.read(model.config.to_dict(), "model.config")
    with float64_variance():
        report = conformance.compare(model, layout, src, tgt, run=hf_run, dtype="float64", backends=(), **told)
    compared = {tensor: cell for (tensor, target), cell in report.cells.items() if target == report.yours.label}
    failed = {t: c.comparison.describe() for t, c in compared.items() if c.comparison is not None and not c.comparison.passed}
    assert not failed, f"{name}: {failed}"
    read = {t for t, c in compared.items() if c.comparison is not None}
    for tensor in ("encoder.embeddings", "encoder.0.self", "encoder.1.self_attn", "encoder.1.ffn", "encoder.output",
                   "decoder.embeddings", "decoder.1.self", "decoder.1.self_attn", "decoder.0.cross", "decoder.1.cross_attn",
                   "decoder.1.ffn", "decoder.output", "logits"):
        assert tensor in read, f"{name}: {tensor} was not compared ({compared.get(tensor)})"


def test_rosetta_layouts_shows_the_t5_families(capsys):
    assert main(["layouts", "hf-t5"]) == 0
    out = capsys.readouterr().out
    for words in ("relative_attention_bias.weight", "-> {s}.position.relative_bias", "when tie_output = False",
                  "holding other values than shared.weight", "scale_decoder_outputs", "decides over other fields"):
        assert words in out, words
    assert main(["layouts", "hf-mt5"]) == 0
    assert "MT5ForConditionalGeneration" in capsys.readouterr().out


@pytest.mark.parametrize("text, words", [
    ('[keys]\n"lm_head.weight" = [{ to = "output.weight" }, { same_as = "shared.weight" }]\n', "each alternative needs when"),
    ('[keys]\n"lm_head.weight" = [{ to = "output.weight", when = { tie_output = false } }]\n', "at least two"),
    ('[[infer]]\nkey = "lm_head.weight"\ndiffers_from = 3\n', "differs_from"),
    ('detect = "no"\n', "detect must be true or false"),
    ('[hf]\nmodel_types = ["t5"]\narchitectures = ["T5ForConditionalGeneration"]\n[hf.fields]\n'
     'feed_forward_proj = { to = "activation", values = { relu = "mish" } }\n', "'mish' is not a ModelConfig activation"),
    ('[hf]\nmodel_types = ["t5"]\narchitectures = ["T5ForConditionalGeneration"]\n[hf.fields]\n'
     'scale_decoder_outputs = { to = "scale_logits", wins = "yes" }\n', "wins must be true or false"),
])
def test_the_layout_features_t5_uses_are_validated(text, words, tmp_path):
    from conformance.convert import LayoutError

    path = tmp_path / "mine.toml"
    path.write_text('extends = "hf-t5"\n' + text)
    with pytest.raises(LayoutError, match=words):
        load_layout(path)
