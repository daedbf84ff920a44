"""Every transformers family with an `[hf]` layout, against transformers itself (issue 42).

For BART, mBART, M2M100, Pegasus and Marian a tiny random model is built from its config class
with the family's own special ids, every parameter (and final_logits_bias) perturbed by a seeded
normal so that no LayerNorm scale or bias is trivial, and written by `save_pretrained`. Then:

- `rosetta convert FOLDER out.safetensors` with no --set reads every switch from config.json, and
  `from_hf(model)` reads the same from `model.config`;
- float64 NumPy logits equal transformers' own float64 forward (`model.double()`), and torch and
  JAX in float32 agree with its float32 forward under the float32 tolerance, on a batch with right
  padding in the source (`attention_mask` from the pad id) and decoder inputs that start with the
  decoder start id and are right-padded too;
- `--to hf-<family>` writes a folder whose `from_pretrained` gives the same logits;
- float64 `loss_and_grads` equals transformers' autograd (cross-entropy, ignore_index=pad, mean over
  counted tokens) for every trainable parameter, mapped back through the layout, the shared
  embedding's pad row included (`freeze_pad_embedding`: `nn.Embedding(padding_idx=...)`);
- the layout's `[taps]` read transformers' tensors where ours computes them (`conformance.compare`).

Where transformers' position term is a float32 computation that `.double()` only widens (Marian's
and Pegasus' split sinusoid, M2M100's fairseq sinusoid, whose torch kernels are an ulp off in a
few entries), the float64 comparisons hand it our float64 table: what is compared is then every
other equation at 1e-10; the tables themselves are compared in float32 on their own.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the families are PyTorch models")
transformers = pytest.importorskip("transformers", reason="the models are built by transformers")

from conformance.check.compare import compare  # noqa: E402
from conformance.check.tolerances import gradient_tolerance, tolerance  # noqa: E402
from conformance.check.training import scaled_error  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import export_state_dict, from_hf, from_hf_folder, load_layout  # noqa: E402
from conformance.convert.hf_config import HF_ACTIVATIONS  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import CheckpointError, ConfigError  # noqa: E402
from conformance.core.positions import position_table, sinusoid_table  # noqa: E402
from systems import randomize_  # noqa: E402
from systems.harness import BACKEND_PARAMS, exported_and_reloaded, run_backend, saved_and_converted  # noqa: E402

import impl_numpy  # noqa: E402

VOCAB = 64
SIZES = dict(vocab_size=VOCAB, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
             decoder_ffn_dim=32, encoder_layers=2, decoder_layers=2, max_position_embeddings=32)
# The brief's bar for float64 NumPy against transformers' float64 forward: max |ours - theirs|
# over max(1, max |theirs|).
FLOAT64_LOGITS = 1e-10


@dataclass(frozen=True)
class Family:
    layout: str
    config_class: str
    model_class: str
    ids: dict  # the family's realistic special ids
    start: int  # what every decoder input starts with
    # The frozen sinusoid (not trained, not perturbed), where the family has one as a parameter.
    frozen_positions: bool = False
    # The float32 position term that `.double()` only widens: handed our float64 table in float64.
    sinusoid: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def pad(self) -> int:
        return self.ids["pad_token_id"]


FAMILIES = {
    "bart": Family("hf-bart", "BartConfig", "BartForConditionalGeneration",
                   dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2),
                   start=2),
    # mBART starts decoding with a language id (no decoder_start_token_id in MBartConfig); 5 stands in.
    "mbart": Family("hf-mbart", "MBartConfig", "MBartForConditionalGeneration",
                    dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, forced_eos_token_id=2), start=5,
                    extra=dict(scale_embedding=True)),
    "m2m_100": Family("hf-m2m100", "M2M100Config", "M2M100ForConditionalGeneration",
                      dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2), start=2,
                      sinusoid=True),
    "pegasus": Family("hf-pegasus", "PegasusConfig", "PegasusForConditionalGeneration",
                      dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=1), start=0,
                      frozen_positions=True, sinusoid=True, extra=dict(activation_function="relu", scale_embedding=True)),
    # PLBart: BART's keys and modules, its embedding scaled by default; its decoder starts, as
    # mBART's, from a language id (5 stands in).
    "plbart": Family("hf-plbart", "PLBartConfig", "PLBartForConditionalGeneration",
                     dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, forced_eos_token_id=2), start=5),
    # Blenderbot: Pegasus' keys and modules, a learned table from row 0.
    "blenderbot": Family("hf-blenderbot", "BlenderbotConfig", "BlenderbotForConditionalGeneration",
                         dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                              forced_eos_token_id=2), start=1,
                         # BlenderbotConfig's default 3 is a rule rosetta's generate does not apply (it warns)
                         extra=dict(encoder_no_repeat_ngram_size=0)),
    # BlenderbotSmall: BART's keys, a table from row 0, the decoder's embedding LayerNorm before
    # the positions (decoder_embedding_norm = "tokens").
    "blenderbot_small": Family("hf-blenderbot-small", "BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration",
                               dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                    forced_eos_token_id=2), start=1),
    "marian": Family("hf-marian", "MarianConfig", "MarianMTModel",
                     dict(pad_token_id=VOCAB - 1, eos_token_id=0, decoder_start_token_id=VOCAB - 1, forced_eos_token_id=0),
                     start=VOCAB - 1, frozen_positions=True, sinusoid=True,
                     extra=dict(activation_function="swish", scale_embedding=True)),
}
NAMES = list(FAMILIES)


def build(name: str, **changes):
    family = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(**{**SIZES, **family.ids, **family.extra, **changes})
    model = getattr(transformers, family.model_class)(config).eval()
    model.generation_config.num_beams = 2
    skip = ("embed_positions",) if family.frozen_positions else ()
    return randomize_(model, 7, buffers=("final_logits_bias",), skip=skip)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (model, its save_pretrained folder, the folder converted with no --set), once."""
    return saved_and_converted(build, tmp_path_factory)


def batch(name: str):
    """(src, tgt, labels): right-padded sources; labels with padding at the end, and the decoder
    input their shift right behind the start id (so it is right-padded too)."""
    family = FAMILIES[name]
    rng = np.random.default_rng(11)
    real = np.array([i for i in range(VOCAB) if i not in family.ids.values() and i != family.start])
    src = np.full((3, 9), family.pad, dtype=np.int64)
    labels = np.full((3, 7), family.pad, dtype=np.int64)
    for row, (n_src, n_tgt) in enumerate([(9, 7), (5, 4), (2, 1)]):
        src[row, :n_src] = rng.choice(real, n_src)
        labels[row, :n_tgt] = rng.choice(real, n_tgt)
    tgt = np.concatenate([np.full((3, 1), family.start), labels[:, :-1]], axis=1)
    return src, tgt, labels


def hf_run(name: str):
    pad = FAMILIES[name].pad

    def run(model, src, tgt):
        src, tgt = torch.as_tensor(src), torch.as_tensor(tgt)
        return model(input_ids=src, attention_mask=(src != pad).long(), decoder_input_ids=tgt)

    return run


def hf_logits(name, model, src, tgt) -> np.ndarray:
    with torch.no_grad():
        return hf_run(name)(model, src, tgt).logits.numpy()


def in_float64(name: str, model, config):
    """`model.double()`, with our float64 position table where the family's is a float32 sinusoid."""
    model = copy.deepcopy(model).double()
    if FAMILIES[name].sinusoid:
        table = torch.from_numpy(position_table(config))
        for stack in (model.model.encoder, model.model.decoder):
            positions = stack.embed_positions
            buffer = positions.weight if hasattr(positions, "weight") else positions.weights
            assert buffer.shape == table.shape, (buffer.shape, table.shape)
            buffer.data.copy_(table)
    return model


def relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return scaled_error(np.asarray(ours, np.float64), np.asarray(theirs, np.float64))


# -- config.json and model.config --------------------------------------------------------------


EXPECTED = {  # what each family's converted config must say, beyond sizes
    "bart": dict(norm_placement="post", embedding_norm=True, position="table", position_offset=2, activation="gelu",
                 scale_embedding=False, final_logits_bias=True, final_encoder_norm=False),
    "mbart": dict(norm_placement="pre", embedding_norm=True, position="table", position_offset=2, activation="gelu",
                  scale_embedding=True, final_logits_bias=True, final_encoder_norm=True, final_decoder_norm=True),
    "m2m_100": dict(norm_placement="pre", embedding_norm=False, position="sinusoid-fairseq", position_offset=2,
                    position_ids="non-pad", activation="relu", scale_embedding=True, final_logits_bias=False,
                    final_encoder_norm=True, final_decoder_norm=True),
    "pegasus": dict(norm_placement="pre", embedding_norm=False, position="sinusoid-split", position_offset=0,
                    activation="relu", scale_embedding=True, final_logits_bias=True, final_encoder_norm=True),
    "plbart": dict(norm_placement="post", embedding_norm=True, position="table", position_offset=2, activation="gelu",
                   scale_embedding=True, final_logits_bias=True, final_encoder_norm=False),
    "blenderbot": dict(norm_placement="pre", embedding_norm=False, position="table", position_offset=0,
                       activation="gelu", scale_embedding=False, final_logits_bias=True, final_encoder_norm=True,
                       final_decoder_norm=True),
    "blenderbot_small": dict(norm_placement="post", embedding_norm=True, decoder_embedding_norm="tokens",
                             position="table", position_offset=0, activation="gelu", scale_embedding=False,
                             final_logits_bias=True, final_encoder_norm=False),
    "marian": dict(norm_placement="post", embedding_norm=False, position="sinusoid-split", activation="silu",
                   scale_embedding=True, final_logits_bias=True),
}


@pytest.mark.parametrize("name", NAMES)
def test_a_folder_converts_with_no_set_and_so_does_the_live_model(name, built, tmp_path, capsys):
    model, folder, (config, params) = built(name)
    family = FAMILIES[name]
    out = tmp_path / "ours.safetensors"
    assert main(["convert", str(folder), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"layout: {family.layout}" in printed and "the layout's default" not in printed, printed
    saved_config, saved = checkpoint.load(out)
    assert saved_config.replace(notes={}) == config.replace(notes={})
    for key, value in EXPECTED[name].items():
        assert getattr(config, key) == value, (name, key, getattr(config, key))
    assert (config.pad_id, config.n_heads, config.d_ff, config.max_len) == (family.pad, 2, 32, 32)
    assert config.share_embeddings and config.tie_output and config.freeze_pad_embedding and not config.output_bias
    assert config.tgt_pad_mask == "none" and config.mask_fill == -3.4028234663852886e38
    generation = json.loads(config.notes["generation"])
    assert generation["pad_token_id"] == family.pad and generation["num_beams"] == 2
    assert all(generation.get(k) == v for k, v in family.ids.items()), generation
    # The live model reads the same from model.config, and gives the same parameters.
    live_config, live = from_hf(model)
    assert live_config == config and sorted(live) == sorted(params)
    assert all(np.array_equal(live[k], params[k]) for k in params)


def test_the_tables_transformers_computes_are_ours():
    """Pegasus' split sinusoid (float64, rounded to float32) is ours bit for bit; M2M100's fairseq
    sinusoid (torch float32 kernels) is ours within one float32 ulp, the row of the pad id zero."""
    pegasus = transformers.models.pegasus.modeling_pegasus.PegasusSinusoidalPositionalEmbedding(32, 16)
    np.testing.assert_array_equal(pegasus.create_weight().numpy(), sinusoid_table(32, 16, "sinusoid-split").astype(np.float32))
    m2m = transformers.models.m2m_100.modeling_m2m_100.M2M100SinusoidalPositionalEmbedding.get_embedding(34, 16, 1)
    ours = sinusoid_table(34, 16, "sinusoid-fairseq", pad_id=1)
    assert np.abs(m2m.numpy() - ours).max() <= np.spacing(np.float32(1.0)) / 2 and not ours[1].any()


# -- logits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_float64_numpy_logits_equal_transformers_float64_forward(name, built):
    model, _, (config, params) = built(name)
    src, tgt, _ = batch(name)
    reference = hf_logits(name, in_float64(name, model, config), src, tgt)
    ours = impl_numpy.Model(config, {k: v.astype(np.float64) for k, v in params.items()}, dtype="float64")(src, tgt).logits
    error = relative(ours, reference)
    assert error <= FLOAT64_LOGITS, f"{name}: float64 NumPy vs transformers .double(): {error:.3e}"


@pytest.mark.parametrize("backend", [p for p in BACKEND_PARAMS if p.values[0] != "numpy"])
@pytest.mark.parametrize("name", NAMES)
def test_float32_backends_match_transformers(name, backend, built):
    model, _, (config, params) = built(name)
    src, tgt, _ = batch(name)
    result = compare(run_backend(backend, config, params, src, tgt), hf_logits(name, model, src, tgt), tolerance("float32"))
    assert result.passed, f"{name} on {backend}, float32: {result.describe()}"


@pytest.mark.parametrize("name", NAMES)
def test_export_folder_loads_in_transformers_with_the_same_logits(name, built, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, folder, _ = built(name)
    family = FAMILIES[name]
    loaded = exported_and_reloaded(folder, family, tmp_path, capsys)
    src, tgt, _ = batch(name)
    np.testing.assert_array_equal(hf_logits(name, loaded.eval(), src, tgt), hf_logits(name, model, src, tgt))
    for key in (*family.ids, "num_beams"):
        assert getattr(loaded.generation_config, key) == getattr(model.generation_config, key), key
    assert type(loaded.config) is type(model.config)
    for key in ("scale_embedding", "pad_token_id", "max_position_embeddings", "d_model", "vocab_size"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    # One function, two names ("swish" is "silu"): the export writes the config class's spelling.
    assert HF_ACTIVATIONS[loaded.config.activation_function] == HF_ACTIVATIONS[model.config.activation_function]


# -- gradients ------------------------------------------------------------------------------------


def hf_grads(name, model, src, tgt, labels) -> tuple[float, dict[str, np.ndarray]]:
    """transformers' loss (mean cross-entropy over labels that are not pad) and autograd gradients."""
    pad = FAMILIES[name].pad
    model.zero_grad(set_to_none=True)
    logits = hf_run(name)(model, src, tgt).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(labels).reshape(-1),
                                             ignore_index=pad)
    loss.backward()
    return loss.item(), {k: p.grad.numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", NAMES)
def test_float64_gradients_equal_transformers_autograd_pad_row_included(name, built):
    """Right-padded batches, and one whose decoder input holds a pad id before real labels: there
    a pad lookup reaches the loss (as Marian's and Pegasus' start token, their pad id, always
    does), and only `freeze_pad_embedding` keeps its gradient out of the pad row, as
    `nn.Embedding(padding_idx=pad)` does; the tied lm_head's gradient still reaches that row."""
    model, _, (config, params) = built(name)
    layout = load_layout(FAMILIES[name].layout)
    pad = FAMILIES[name].pad
    src, tgt, labels = batch(name)
    inner = tgt.copy()
    inner[0, 2] = pad
    reference = in_float64(name, model, config)
    params64 = {k: v.astype(np.float64) for k, v in params.items()}
    allowed = gradient_tolerance("float64").atol
    for decoder_input in (tgt, inner):
        theirs_loss, theirs = hf_grads(name, reference, src, decoder_input, labels)
        loss, grads = impl_numpy.Model(config, params64, dtype="float64").loss_and_grads(src, decoder_input, labels)
        assert abs(loss - theirs_loss) <= 1e-12 * max(1.0, abs(theirs_loss)), (loss, theirs_loss)
        ours = export_state_dict(config, grads, layout)
        # transformers trains what named_parameters() yields (tied weights once, as
        # model.shared.weight); its final_logits_bias is a buffer, and Marian's and Pegasus'
        # sinusoids are frozen.
        assert "final_logits_bias" not in theirs and "model.shared.weight" in theirs
        for key, grad in theirs.items():
            error = relative(ours[key], grad)
            assert error <= allowed, f"{name}: gradient of {key}: {error:.3e} (allowed {allowed:g})"
        shared = theirs["model.shared.weight"]
        assert np.abs(shared[pad]).max() > 0  # the tied lm_head's gradient reaches the pad row
    # Without freeze_pad_embedding the pad lookups add to that row, which transformers' do not.
    _, loose = impl_numpy.Model(config.replace(freeze_pad_embedding=False), params64, dtype="float64").loss_and_grads(
        src, inner, labels)
    assert np.abs(loose["encoder.embedding.weight"][pad] - shared[pad]).max() > 1e-6 * np.abs(shared[pad]).max()


# -- taps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_taps_read_transformers_tensors_where_ours_computes_them(name, built):
    """Every tapped tensor of the float64 model (eager attention, so that weights are returned)
    agrees with the float64 oracle: a tap at the wrong module (a pre-LN layer's sublayer output is
    no module's output) would diverge."""
    import conformance

    model, folder, (config, _) = built(name)
    model = in_float64(name, model, config)
    model.config._attn_implementation = "eager"
    src, tgt, _ = batch(name)
    layout = load_layout(FAMILIES[name].layout)
    told = layout.hf.read(model.config.to_dict(), "model.config")
    if config.position != "table" and layout.stores_positions():
        told["position"] = config.position  # our float64 table stands in for the sinusoid
    report = conformance.compare(model, layout, src, tgt, run=hf_run(name), dtype="float64", backends=(), **told)
    compared = {tensor: cell for (tensor, target), cell in report.cells.items() if target == report.yours.label}
    failed = {t: c.comparison.describe() for t, c in compared.items() if c.comparison is not None and not c.comparison.passed}
    assert not failed, f"{name}: {failed}"
    read = {t for t, c in compared.items() if c.comparison is not None}
    for tensor in ("encoder.embeddings", "encoder.1.self_attn", "encoder.1.ffn", "encoder.output", "decoder.embeddings",
                   "decoder.0.self", "decoder.1.self_attn", "decoder.1.cross_attn", "decoder.1.ffn", "decoder.output",
                   "logits"):
        assert tensor in read, f"{name}: {tensor} was not compared ({compared.get(tensor)})"


# -- what cannot convert --------------------------------------------------------------------------


@pytest.mark.parametrize("name, field, value, blamed", [
    ("bart", "tie_word_embeddings", False, "tie_output"),
    ("bart", "normalize_before", True, "norm_placement"),
    ("mbart", "decoder_attention_heads", 4, "n_heads"),
    ("m2m_100", "activation_function", "mish", "activation"),
    ("pegasus", "scale_embedding", "yes", "scale_embedding"),
])
def test_what_a_layout_cannot_express_is_named(name, field, value, blamed, built, tmp_path):
    _, folder, _ = built(name)
    copy_ = tmp_path / "edited"
    copy_.mkdir()
    for path in folder.iterdir():
        (copy_ / path.name).write_bytes(path.read_bytes())
    data = json.loads((copy_ / "config.json").read_text())
    data[field] = value
    (copy_ / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        from_hf_folder(copy_)
    assert info.value.field == blamed and field in str(info.value), str(info.value)


def test_a_folder_whose_model_type_names_another_family_says_which(built, tmp_path):
    _, folder, _ = built("pegasus")
    copy_ = tmp_path / "mislabelled"
    copy_.mkdir()
    for path in folder.iterdir():
        (copy_ / path.name).write_bytes(path.read_bytes())
    data = json.loads((copy_ / "config.json").read_text())
    (copy_ / "config.json").write_text(json.dumps({**data, "model_type": "mbart"}))
    with pytest.raises(CheckpointError, match="says model_type 'mbart'.*are those of layout .*hf-pegasus") as info:
        from_hf_folder(copy_)
    assert info.value.path == str(copy_ / "config.json")  # model_type is the file's field, not ModelConfig's


def test_an_m2m100_export_refuses_an_offset_its_pad_id_does_not_give(built, tmp_path):
    """M2M100 derives where positions start from pad_token_id: a config whose position_offset is
    not pad_id + 1 has no M2M100 folder."""
    _, _, (config, params) = built("m2m_100")
    from conformance.convert.hf_folder import write_folder

    odd = config.replace(position_offset=5)
    with pytest.raises(ConfigError, match="derives position_offset=2 from pad_token_id=1") as info:
        write_folder(tmp_path / "out", odd, export_state_dict(odd, params, "hf-m2m100"), "hf-m2m100")
    assert info.value.field == "position_offset" and not (tmp_path / "out").exists()


def test_from_hf_refuses_a_model_without_the_layouts_head():
    """BartModel has no lm_head and other keys: from_hf names the class the layout describes."""
    config = transformers.BartConfig(**SIZES, **FAMILIES["bart"].ids)
    with pytest.raises(TypeError, match="BartForConditionalGeneration"):
        from_hf(transformers.BartModel(config))


def test_rosetta_layouts_lists_every_family(capsys):
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    for family in FAMILIES.values():
        assert family.layout in out


def test_compare_reads_every_size_and_switch_from_model_config():
    """`conformance.compare` on a live transformers model needs no `n_heads=` or switch: they come
    from `model.config` (a Marian whose activation_function is gelu, not the preset's silu, is
    compared as gelu), and an override that contradicts the config is refused, naming the field."""
    import conformance

    model = build("marian", activation_function="gelu").double()
    src, tgt, _ = batch("marian")
    report = conformance.compare(model, "hf-marian", src, tgt, run=hf_run("marian"), dtype="float64", backends=())
    compared = {t: c for (t, target), c in report.cells.items() if target == report.yours.label}
    assert compared["logits"].comparison is not None and report.config.activation == "gelu"
    # A live model's state_dict holds its own position table, which the comparison then uses: float64 throughout.
    assert report.passed, report.to_text()
    with pytest.raises(ConfigError, match="n_heads"):
        conformance.compare(model, "hf-marian", src, tgt, run=hf_run("marian"), backends=(), n_heads=4)
