"""ModelConfig: JSON round trip, validation errors naming the field, presets, key space."""

import json
import math
from dataclasses import fields

import pytest
from hypothesis import given, strategies as st

from conformance import ConfigError, ModelConfig, PRESETS, param_shapes, preset
from conformance.core.params import param_count
from conformance.suite.strategies import configs as suite_configs
from conformance.core.config import FLOAT32_MAX, MAX_LEN_LIMIT


def configs():
    """The suite's config strategy (every switch, read from the config module) over wider sizes:
    no layers, d_model down to 2, vocabularies down to 2, any d_ff and max_len up to 512."""
    return suite_configs(min_layers=0, head_dims=range(2, 17, 2), d_models=(2, 64), vocabs=st.integers(2, 64),
                         d_ffs=st.integers(1, 128), max_lens=st.integers(1, 512), notes={"layout": "test"})


@given(configs())
def test_json_round_trip_is_exact(config):
    text = config.to_json()
    json.loads(text)  # strict JSON: no bare Infinity
    assert "Infinity" not in text
    again = ModelConfig.from_json(text)
    assert again == config
    assert again.notes == config.notes
    assert again.to_json() == text


def test_every_variants_switch_is_a_field():
    names = {f.name for f in fields(ModelConfig)}
    switches = {
        "src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_encoder_layers",
        "n_decoder_layers", "max_len", "norm_placement", "final_encoder_norm", "final_decoder_norm",
        "layer_norm_eps", "layer_norm_form", "scale_embedding", "position", "qkv_bias",
        "out_proj_bias", "mask_fill", "tgt_pad_mask", "cross_attn_src_mask", "pad_id", "activation",
        "share_embeddings", "tie_output", "output_bias", "final_logits_bias", "ffn_glu", "attention_temp",
    }
    assert switches <= names


@pytest.mark.parametrize(
    "changes, field, words",
    [
        (dict(d_model=30, n_heads=4), "n_heads", "not divisible"),
        (dict(d_model=0), "d_model", "positive"),
        (dict(n_heads=-1), "n_heads", "positive"),
        (dict(src_vocab_size=0), "src_vocab_size", "positive"),
        (dict(d_ff=0), "d_ff", "positive"),
        (dict(max_len=0), "max_len", "positive"),
        (dict(n_encoder_layers=-1), "n_encoder_layers", ">= 0"),
        (dict(norm_placement="middle"), "norm_placement", "unknown value"),
        (dict(layer_norm_form="rms-norm"), "layer_norm_form", "unknown value"),
        (dict(position="rotary"), "position", "unknown value"),
        (dict(position_ids="all"), "position_ids", "unknown value"),
        (dict(position_offset=-1), "position_offset", ">= 0"),
        (dict(position_offset=65536), "position_offset", "max_len + position_offset"),
        (dict(d_head=-1), "d_head", ">= 0"),
        (dict(d_model=30, n_heads=4), "n_heads", "not divisible"),
        (dict(relative_buckets=2), "relative_buckets", ">= 4"),
        (dict(relative_buckets=32, relative_max_distance=16), "relative_max_distance", "exceed"),
        (dict(position="sinusoid-fairseq", d_model=2, n_heads=1), "d_model", "d_model >= 4"),
        (dict(activation="softplus"), "activation", "unknown value"),
        (dict(attention_temp=0.0), "attention_temp", "positive and finite"),
        (dict(attention_temp=-4.0), "attention_temp", "positive and finite"),
        (dict(attention_temp=math.inf), "attention_temp", "positive and finite"),
        (dict(attention_temp=math.nan), "attention_temp", "positive and finite"),
        (dict(ffn_glu=1), "ffn_glu", "must be a bool"),
        (dict(tgt_pad_mask="sides"), "tgt_pad_mask", "unknown value"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps", "positive"),
        (dict(layer_norm_eps=math.nan), "layer_norm_eps", "positive"),
        (dict(mask_fill=0.0), "mask_fill", "negative"),
        (dict(mask_fill=math.nan), "mask_fill", "negative"),
        (dict(mask_fill=math.inf), "mask_fill", "negative"),
        (dict(pad_id=40), "pad_id", "not a valid id"),
        (dict(pad_id=-1), "pad_id", "not a valid id"),
        (dict(share_embeddings=True, src_vocab_size=10, tgt_vocab_size=12), "share_embeddings", "src_vocab_size == tgt_vocab_size"),
        (dict(d_model=5, n_heads=1, position="sinusoid-split"), "d_model", "even"),
        (dict(d_model=32.0), "d_model", "must be an int"),
        (dict(tie_output=1), "tie_output", "must be a bool"),
        (dict(n_heads=True), "n_heads", "must be an int"),
        (dict(layer_norm_eps="1e-5"), "layer_norm_eps", "must be a number"),
        (dict(n_decoder_layers=-1), "n_decoder_layers", ">= 0"),
        (dict(tgt_vocab_size=0), "tgt_vocab_size", "positive"),
        (dict(max_len=MAX_LEN_LIMIT + 1), "max_len", "exceeds the supported"),
        (dict(mask_fill=-1e300), "mask_fill", "representable in float32"),
        (dict(mask_fill=-(10**400)), "mask_fill", "too large for a float"),
        (dict(layer_norm_eps=10**400), "layer_norm_eps", "too large for a float"),
        (dict(notes=5), "notes", "must map strings to strings"),
        (dict(notes="ab"), "notes", "must map strings to strings"),
        (dict(notes={"a": 1}), "notes", "must map strings to strings"),
    ],
)
def test_validation_names_the_field(changes, field, words):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**changes)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert f"ModelConfig.{field}" in str(info.value)
    assert words in str(info.value)


def test_from_json_rejects_unknown_fields_and_bad_json():
    with pytest.raises(ConfigError, match="n_layers"):
        ModelConfig.from_dict({"n_layers": 6})
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("{")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json("[1, 2]")
    with pytest.raises(ConfigError, match="mask_fill"):
        ModelConfig.from_dict({"mask_fill": "minus infinity"})


def test_fills_at_the_edge_of_float32_are_valid():
    assert ModelConfig(mask_fill=-FLOAT32_MAX).mask_fill == -FLOAT32_MAX  # Hugging Face's finfo.min
    assert ModelConfig(mask_fill=-math.inf).mask_fill == -math.inf
    assert ModelConfig(mask_fill=-(10**9)).mask_fill == -1e9  # an int is taken as that float
    assert ModelConfig(max_len=MAX_LEN_LIMIT).max_len == MAX_LEN_LIMIT


def test_from_json_refuses_hostile_text_with_a_config_error():
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("[" * 100_000)  # Python's parser would raise RecursionError
    with pytest.raises(ConfigError, match="mask_fill"):
        ModelConfig.from_json('{"mask_fill": -1' + "0" * 400 + "}")


def test_a_complete_config_must_name_every_field():
    data = ModelConfig().to_dict()
    assert ModelConfig.from_dict(data, complete=True) == ModelConfig()
    del data["norm_placement"]
    assert ModelConfig.from_dict(data) == ModelConfig()  # defaults fill in, for hand-written configs
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data, complete=True)  # but never in a stored one
    assert info.value.field == "norm_placement" and "missing" in str(info.value)


def test_replace_validates_and_rejects_unknown_fields():
    config = ModelConfig()
    assert config.replace(d_model=64).d_model == 64
    with pytest.raises(ConfigError, match="n_heads"):
        config.replace(n_heads=5)
    with pytest.raises(ConfigError, match="heads"):
        config.replace(heads=2)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_overridable(name):
    config = preset(name, d_model=64, n_heads=8)
    assert config.d_model == 64 and config.n_heads == 8
    assert ModelConfig.from_json(config.to_json()) == config


def test_presets_cover_every_known_system():
    systems = {"from-scratch", "llmhub", "hyunwoongko", "sublayer-norm", "pre-ln-tutorial",
               "torch-nn-transformer", "hf-marian", "annotated-transformer"}
    assert systems <= set(PRESETS)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("gpt2")


def test_key_space_follows_the_switches():
    base = ModelConfig(n_encoder_layers=1, n_decoder_layers=1)
    keys = set(param_shapes(base))
    assert "decoder.layers.0.cross_attn.q_proj.weight" in keys
    assert param_shapes(base)["encoder.layers.0.ffn.linear1.weight"] == (base.d_model, base.d_ff)
    assert "encoder.position.table" not in keys
    assert "output.weight" in keys and "decoder.embedding.weight" in keys
    tied = set(param_shapes(base.replace(share_embeddings=True, tie_output=True, output_bias=False, final_logits_bias=True)))
    assert "decoder.embedding.weight" not in tied and "output.weight" not in tied and "output.bias" not in tied
    assert "final_logits_bias" in tied
    no_bias = set(param_shapes(base.replace(qkv_bias=False, out_proj_bias=False)))
    assert not any(k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")) for k in no_bias)
    finals = set(param_shapes(base.replace(final_encoder_norm=True, final_decoder_norm=True, position="table")))
    assert {"encoder.norm.weight", "decoder.norm.bias", "encoder.position.table", "decoder.position.table"} <= finals


@given(configs())
def test_param_count_is_the_size_of_the_key_space(config):
    assert param_count(config) == len(param_shapes(config))


def test_param_count_answers_for_absurd_layer_counts_without_building_the_key_space():
    config = ModelConfig(n_encoder_layers=10**9, n_decoder_layers=10**9)
    per_layer = len(param_shapes(config.replace(n_encoder_layers=1, n_decoder_layers=1))) - len(
        param_shapes(config.replace(n_encoder_layers=0, n_decoder_layers=0)))
    assert param_count(config) == len(param_shapes(config.replace(n_encoder_layers=0, n_decoder_layers=0))) + 10**9 * per_layer


def test_a_stored_config_from_before_the_added_fields_keeps_its_old_meaning():
    # Written before src_pad_mask and scale_logits existed: every other field is named.
    old = {k: v for k, v in ModelConfig().to_dict().items() if k not in ("src_pad_mask", "scale_logits")}
    config = ModelConfig.from_dict(old, complete=True)
    assert config.src_pad_mask == "keys" and config.scale_logits is False
    # Any other missing field is still refused by name.
    with pytest.raises(ConfigError, match="norm_placement"):
        ModelConfig.from_dict({k: v for k, v in old.items() if k != "norm_placement"}, complete=True)


def test_new_fields_round_trip_through_json():
    config = preset("flax-wmt", scale_logits=True, tie_output=True, output_bias=False, tgt_pad_mask="both")
    again = ModelConfig.from_json(config.to_json(), complete=True)
    assert again == config and again.src_pad_mask == "both" and again.layer_norm_form == "fast-variance"


def test_t2t_sinusoid_needs_four_dims():
    with pytest.raises(ConfigError, match="d_model"):
        ModelConfig(d_model=2, n_heads=1, position="sinusoid-t2t")


def test_unknown_src_pad_mask_is_named():
    with pytest.raises(ConfigError, match="src_pad_mask"):
        ModelConfig(src_pad_mask="queries")


def test_canonical_compares_a_model_however_its_derived_sizes_are_spelled():
    """d_head 0 is d_model / n_heads and max_source_len 0 is max_len: spelled either way it is one
    model, and `canonical()` says so; a size that differs in effect still differs."""
    zero = ModelConfig(d_model=16, n_heads=4, d_head=0)
    assert zero.canonical() == ModelConfig(d_model=16, n_heads=4, d_head=4).canonical()
    assert zero.canonical()["d_head"] == 4 and "notes" not in zero.canonical()
    assert zero.canonical() != ModelConfig(d_model=16, n_heads=4, d_head=8).canonical()
    whisper = dict(source="features", src_vocab_size=32, tgt_vocab_size=32, max_len=16)
    assert ModelConfig(**whisper, max_source_len=0).canonical()["max_source_len"] == 16
    assert ModelConfig(**whisper, max_source_len=0).canonical() != ModelConfig(**whisper, max_source_len=8).canonical()
    # the values are valid arguments: the model they build is the same one
    assert ModelConfig(**ModelConfig(**whisper).canonical()).canonical() == ModelConfig(**whisper).canonical()
