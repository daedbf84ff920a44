"""The layout engine on its own: exact round trips, detection, and an error that names the problem.

No framework is needed here: state dicts are NumPy arrays, made by exporting seeded canonical
parameters into each layout (the source-system tests check that those key spaces are the real
systems' own).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from conformance import init_params, preset
from conformance.convert import (
    AmbiguousLayoutError,
    KeyMismatchError,
    LayoutError,
    NoMatchingLayoutError,
    TensorError,
    builtin_layout_names,
    builtin_layouts,
    convert_arrays,
    detect_layout,
    export_state_dict,
    import_state_dict,
    load_layout,
)
from conformance.convert.trees import flatten
from conformance.core.errors import ConfigError, InputError
from conformance.core.positions import sinusoid_table
from conformance.core.config import ModelConfig
from conformance.core.presets import PRESETS

LAYOUTS = builtin_layout_names()
SIZES = dict(d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2, n_decoder_layers=3, max_len=11)

# Values for the switches a layout leaves to its user, different from the preset's, so that the
# round trip shows they are carried (and not silently reset to the preset's).
FREE_VALUES = {"pad_id": 3, "norm_placement": "pre", "activation": "gelu", "layer_norm_eps": 1e-6, "scale_embedding": False,
               "attention_temp": 2.0}


def config_for(layout, position=None, **changes):
    """A config of `layout`'s system with small sizes, every free switch off its preset value."""
    values = dict(SIZES, **{k: FREE_VALUES[k] for k in layout.free})
    shared = layout.base_switches().get("share_embeddings", False)
    one_vocabulary = shared or layout.base_switches().get("source") == "features"  # Whisper: no source vocabulary
    values.update(src_vocab_size=21 if one_vocabulary else 19, tgt_vocab_size=21)
    if position:
        values["position"] = position
    values.update(changes)
    return ModelConfig(**{**layout.base_switches(), **values})  # the preset and the layout's own [switches]


def import_overrides(layout, config):
    """What an import must be told: n_heads, max_len without a stored table, free switches."""
    told = {"n_heads": config.n_heads}
    if not layout.stores_positions():
        told["max_len"] = config.max_len
    told.update({k: getattr(config, k) for k in layout.free})
    return told


def params_for(config, dtype=np.float32):
    params = init_params(config, seed=4, dtype=dtype)
    if "decoder.position.table" in params:
        # Several systems keep one position buffer for both stacks: make them one table.
        params["decoder.position.table"] = params["encoder.position.table"].copy()
    return params


def exported_keys(layout, config, params):
    """`export_state_dict`'s result with its keys flat: a nested (Flax) layout returns a tree,
    whose paths joined with "." are the layout's keys."""
    exported = export_state_dict(config, params, layout)
    return flatten(exported) if layout.nested else exported


def positions_of(layout):
    forms = [PRESETS[layout.preset]["position"]]
    return forms + ["table"] if layout.computes_with_stored_positions() else forms


def detected(keys):
    """The layout auto-detection picks for `keys`, or its refusal (`AmbiguousLayoutError`)."""
    try:
        return detect_layout(keys).name
    except AmbiguousLayoutError as exc:
        return exc


CASES = [(name, position) for layout in builtin_layouts() for name, position in
         [(layout.name, p) for p in positions_of(layout)]]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16], ids=["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("name, position", CASES)
def test_export_then_import_is_bit_exact(name, position, dtype):
    layout = load_layout(name)
    config = config_for(layout, position)
    params = params_for(config, dtype)
    exported = exported_keys(layout, config, params)
    # Auto-detection names the layout, or refuses when the keys fit several systems that compute
    # different models (hf-bart's keys are PLBart's and BlenderbotSmall's; hf-mt5's are hf-t5's).
    # A layout that is never detected on its own (hf-mt5) may only lose to one computing the same.
    found = detected(exported)
    if isinstance(found, AmbiguousLayoutError):
        assert name in found.names and found.candidates, str(found)
    else:
        assert found == name if layout.detect else found != name
    back_config, back = import_state_dict(exported, name if isinstance(found, AmbiguousLayoutError) or not layout.detect
                                          else None, **import_overrides(layout, config))
    assert back_config == config
    assert list(back) == list(params)
    for key, value in params.items():
        assert back[key].dtype == value.dtype and back[key].tobytes() == value.tobytes(), key
    again = exported_keys(layout, back_config, back)
    assert list(again) == list(exported)
    assert all(again[k].tobytes() == exported[k].tobytes() and again[k].shape == exported[k].shape for k in exported)


def test_a_stored_sinusoid_is_written_from_the_shared_table():
    layout = load_layout("annotated-transformer")
    config = config_for(layout)
    exported = export_state_dict(config, params_for(config), layout)
    expected = sinusoid_table(config.max_len, config.d_model, "sinusoid-interleaved").astype(np.float32)
    np.testing.assert_array_equal(exported["src_embed.1.pe"], expected[None])
    np.testing.assert_array_equal(exported["tgt_embed.1.pe"], expected[None])


# -- Detection ---------------------------------------------------------------------------------


def closest_of(error: NoMatchingLayoutError) -> list:
    """The candidates tied for closest (the fewest missing and unexpected keys)."""
    best = len(error.candidates[0][1]) + len(error.candidates[0][2])
    return [c for c in error.candidates if len(c[1]) + len(c[2]) == best]


@pytest.mark.parametrize("name", [name for name in LAYOUTS if load_layout(name).detect])  # hf-mt5: hf-t5's keys
def test_a_near_miss_is_explained(name):
    layout = load_layout(name)
    config = config_for(layout)
    exported = exported_keys(layout, config, params_for(config))
    required = [k for k in exported if not any(e.optional and e.source.match(k) for e in layout.entries)]
    dropped = required[len(required) // 2]

    short = {k: v for k, v in exported.items() if k != dropped}
    with pytest.raises(NoMatchingLayoutError) as info:
        detect_layout(short)
    # Layouts with the same keys (hf-bart, hf-plbart, hf-blenderbot-small) tie for closest.
    assert (name, [dropped], []) in closest_of(info.value), info.value.candidates[:3]
    assert dropped in str(info.value) and name in str(info.value)

    longer = {**exported, "extra.weight": np.zeros(3, np.float32)}
    with pytest.raises(NoMatchingLayoutError) as info:
        detect_layout(longer)
    assert (name, [], ["extra.weight"]) in closest_of(info.value)
    with pytest.raises(KeyMismatchError, match="unexpected key.*extra.weight"):
        import_state_dict(longer, name, **import_overrides(layout, config))


def test_a_missing_layer_and_a_layer_gap_are_named():
    layout = load_layout("llmhub")
    config = config_for(layout, n_encoder_layers=3)
    exported = export_state_dict(config, params_for(config), layout)
    gap = {k: v for k, v in exported.items() if not k.startswith("encoder.layers.1.")}
    with pytest.raises(KeyMismatchError, match=r"every key of encoder layer 1 \(16 keys") as info:
        import_state_dict(gap, "llmhub", n_heads=2)
    assert sorted(info.value.missing) == sorted(k for k in exported if k.startswith("encoder.layers.1."))
    with pytest.raises(ConfigError, match="contradicts the state dict, which has encoder layers 0..2") as info:
        import_state_dict(exported, "llmhub", n_heads=2, n_encoder_layers=2)
    assert info.value.field == "n_encoder_layers"


def test_a_bias_the_system_does_not_have_is_unexpected():
    layout = load_layout("from-scratch")
    config = config_for(layout)
    exported = export_state_dict(config, params_for(config), layout)
    exported["encoder.layers.0.self_attn.W_q.bias"] = np.zeros(16, np.float32)
    with pytest.raises(KeyMismatchError) as info:
        import_state_dict(exported, "from-scratch", n_heads=2)
    assert info.value.unexpected == ["encoder.layers.0.self_attn.W_q.bias"] and not info.value.missing


# -- What the tensors cannot tell, and contradictions --------------------------------------------


@pytest.fixture(scope="module")
def annotated_state():
    layout = load_layout("annotated-transformer")
    config = config_for(layout)
    return config, export_state_dict(config, params_for(config), layout)


def test_sizes_come_from_shapes_and_contradictions_name_the_tensor(annotated_state):
    config, state = annotated_state
    with pytest.raises(ConfigError, match=r"64 \(given\) contradicts src_embed.0.lut.weight .*shape \(19, 16\)") as info:
        import_state_dict(state, None, n_heads=2, pad_id=3, d_model=64)
    assert info.value.field == "d_model"
    with pytest.raises(ConfigError, match="contradicts src_embed.1.pe") as info:
        import_state_dict(state, None, n_heads=2, pad_id=3, max_len=50)
    assert info.value.field == "max_len"
    with pytest.raises(ConfigError) as info:
        import_state_dict(state, None, n_heads=3, pad_id=3)
    assert info.value.field == "n_heads" and "not divisible" in str(info.value)


@pytest.mark.parametrize("missing, field", [({"pad_id": 3}, "n_heads"), ({"n_heads": 2}, "pad_id")])
def test_what_shapes_cannot_tell_must_be_given(annotated_state, missing, field):
    _, state = annotated_state
    with pytest.raises(ConfigError, match="--set") as info:
        import_state_dict(state, None, **missing)
    assert info.value.field == field


def test_max_len_must_be_given_when_no_table_is_stored():
    layout = load_layout("hyunwoongko")
    config = config_for(layout)
    state = export_state_dict(config, params_for(config), layout)
    with pytest.raises(ConfigError, match="no position table") as info:
        import_state_dict(state, None, n_heads=2)
    assert info.value.field == "max_len"


def test_overrides_are_validated(annotated_state):
    _, state = annotated_state
    with pytest.raises(ConfigError, match="not a ModelConfig field") as info:
        import_state_dict(state, None, n_head=2, pad_id=3)
    assert info.value.field == "n_head"
    with pytest.raises(ConfigError) as info:
        import_state_dict(state, None, n_heads=2, pad_id=3, activation="swish")
    assert info.value.field == "activation"


def test_switch_overrides_describe_a_changed_copy_of_the_system(annotated_state):
    config, state = annotated_state
    changed, _ = import_state_dict(state, None, n_heads=2, pad_id=3, mask_fill=float("-inf"))
    assert changed == config.replace(mask_fill=float("-inf"))


def test_free_switches_left_to_the_layout_are_named():
    """A free switch the import was not told takes the preset's value: said in the decisions (which
    `rosetta convert` prints) and in the config's notes, never silently."""
    layout = load_layout("hf-marian")
    config = config_for(layout, activation="silu", scale_embedding=True)
    state = export_state_dict(config, params_for(config), layout)
    result = convert_arrays(state, None, n_heads=2, pad_id=config.pad_id)
    assert result.config == config and result.config.notes["layout_defaults"] == "activation=silu, scale_embedding=true"
    said = [line for line in result.decisions if "(the layout's default" in line]
    assert len(said) == 2 and said[0].startswith("activation=silu (") and said[1].startswith("scale_embedding=true (")
    assert "--set scale_embedding=false if your model differs" in said[1] and "MarianConfig.scale_embedding" in said[1]
    told = convert_arrays(state, None, n_heads=2, pad_id=config.pad_id, activation="silu", scale_embedding=True)
    assert "layout_defaults" not in told.config.notes and not any("layout's default" in d for d in told.decisions)


@pytest.mark.parametrize("name", ["torch-nn-transformer", "hf-marian", "annotated-transformer"])
def test_a_required_switch_says_where_the_system_keeps_it(name):
    layout = load_layout(name)
    config = config_for(layout)
    state = export_state_dict(config, params_for(config), layout)
    told = import_overrides(layout, config)
    for field in sorted(layout.required):
        with pytest.raises(ConfigError, match=f"--set {field}=") as info:
            import_state_dict(state, name, **{k: v for k, v in told.items() if k != field})
        assert info.value.field == field and layout.hints[field] in str(info.value)


# -- Positions ---------------------------------------------------------------------------------


def float32_tutorial_sinusoid(rows, d):
    """The tutorials' table: exp(arange(0, d, 2) * -(ln 10000 / d)) and the products in float32."""
    position = np.arange(rows, dtype=np.float32)[:, None]
    div = np.exp(np.arange(0, d, 2, dtype=np.float32) * np.float32(-np.log(10000.0) / d))
    table = np.zeros((rows, d), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(position * div), np.cos(position * div)
    return table


def test_a_stored_table_is_kept_unless_it_is_exactly_our_sinusoid_or_asked_for():
    layout = load_layout("from-scratch")
    config = config_for(layout, position="table", max_len=300)
    params = params_for(config)
    tutorial = float32_tutorial_sinusoid(300, 16)
    assert not np.array_equal(tutorial, sinusoid_table(300, 16, "sinusoid-interleaved").astype(np.float32))
    params["encoder.position.table"] = params["decoder.position.table"] = tutorial
    state = export_state_dict(config, params, layout)

    kept = convert_arrays(state, "from-scratch", n_heads=2)
    assert kept.config.position == "table"
    np.testing.assert_array_equal(kept.params["decoder.position.table"], tutorial)

    recognised = convert_arrays(state, "from-scratch", n_heads=2, position="sinusoid-interleaved")
    assert recognised.config.position == "sinusoid-interleaved" and recognised.config.max_len == 300
    assert "encoder.position.table" not in recognised.params
    assert any("recognised" in line for line in recognised.decisions)

    with pytest.raises(TensorError, match="is not the sinusoid-split sinusoid") as info:
        convert_arrays(state, "from-scratch", n_heads=2, position="sinusoid-split")
    assert info.value.key == "positional_encoding.pe"


def test_a_learned_table_is_never_taken_for_a_sinusoid():
    layout = load_layout("llmhub")
    config = config_for(layout, position="table")
    state = export_state_dict(config, params_for(config), layout)
    with pytest.raises(TensorError, match="is not the sinusoid-interleaved sinusoid.*position='table'"):
        import_state_dict(state, "llmhub", n_heads=2, position="sinusoid-interleaved")
    assert import_state_dict(state, "llmhub", n_heads=2)[0].position == "table"


def test_one_buffer_for_both_stacks_cannot_hold_two_tables():
    layout = load_layout("sublayer-norm")
    config = config_for(layout, position="table")
    params = init_params(config, seed=1, dtype=np.float32)  # two different random tables
    with pytest.raises(TensorError, match="pos_encoder.pe: stores one tensor for encoder.position.table"):
        export_state_dict(config, params, layout)


# -- Tensors -----------------------------------------------------------------------------------


def torch_layout_state(name="torch-nn-transformer", **changes):
    layout = load_layout(name)
    config = config_for(layout, **changes)
    return config, export_state_dict(config, params_for(config), layout)


def test_transform_errors_name_the_foreign_key():
    config, state = torch_layout_state()
    told = import_overrides(load_layout("torch-nn-transformer"), config)
    bad = dict(state, **{"transformer.encoder.layers.0.self_attn.in_proj_weight": np.zeros((47, 16), np.float32)})
    with pytest.raises(TensorError, match="splits axis 0 into 3 equal parts") as info:
        import_state_dict(bad, None, **told)
    assert info.value.key == "transformer.encoder.layers.0.self_attn.in_proj_weight"
    bad = dict(state, **{"positional_encoding.pos_embedding": np.zeros((11, 2, 16), np.float32)})
    with pytest.raises(TensorError, match=r"has shape \(11, 2, 16\); a position table is \(max_len, d_model\), \(1, max_len, d_model\) or"):
        import_state_dict(bad, None, **told)
    bad = dict(state, **{"transformer.decoder.layers.2.linear1.weight": np.zeros((30, 16), np.float32),
                         "transformer.decoder.layers.2.linear1.bias": np.zeros(30, np.float32)})
    with pytest.raises(TensorError, match=r"has shape \(30, 16\).*needs \(16, 24\)") as info:
        import_state_dict(bad, None, **told)
    assert info.value.key == "transformer.decoder.layers.2.linear1.weight"


def test_dtypes_must_agree_or_be_cast_and_be_floats():
    config, state = torch_layout_state()
    told = import_overrides(load_layout("torch-nn-transformer"), config)
    mixed = dict(state, **{"generator.bias": state["generator.bias"].astype(np.float64)})
    with pytest.raises(TensorError, match="has dtype float64.*--dtype") as info:
        import_state_dict(mixed, None, **told)
    assert info.value.key == "generator.bias"
    cast, params = import_state_dict(mixed, None, dtype="float32", **told)
    assert cast == config and {v.dtype for v in params.values()} == {np.dtype(np.float32)}
    ints = dict(state, **{"generator.bias": state["generator.bias"].astype(np.int64)})
    with pytest.raises(TensorError, match="must be floating point"):
        import_state_dict(ints, None, **told)
    nan = dict(state, **{"generator.bias": np.full_like(state["generator.bias"], np.nan)})
    with pytest.raises(TensorError, match="generator.bias: has 21 NaN"):
        import_state_dict(nan, None, **told)


def test_the_input_is_never_modified_and_the_result_never_shares_memory():
    config, state = torch_layout_state()
    before = {k: v.copy() for k, v in state.items()}
    _, params = import_state_dict(state, None, **import_overrides(load_layout("torch-nn-transformer"), config))
    assert all(state[k].tobytes() == before[k].tobytes() for k in state)
    for key, value in params.items():
        assert value.flags.c_contiguous and value.flags.owndata, key
        assert not any(np.shares_memory(value, source) for source in state.values()), key


# -- Export ------------------------------------------------------------------------------------


def test_export_refuses_a_config_the_target_system_computes_differently():
    layout = load_layout("from-scratch")
    config = config_for(layout, norm_placement="pre")
    params = params_for(config)
    with pytest.raises(ConfigError, match="the from-scratch system computes norm_placement='post'") as info:
        export_state_dict(config, params, "from-scratch")
    assert info.value.field == "norm_placement"
    # A copy of the system changed to pre-LN can take it, when the caller says so.
    exported = export_state_dict(config, params, "from-scratch", norm_placement="pre")
    assert import_state_dict(exported, "from-scratch", n_heads=2, norm_placement="pre")[0] == config
    with pytest.raises(ConfigError) as info:
        export_state_dict(config_for(load_layout("llmhub"), position="table"),
                          params_for(config_for(load_layout("llmhub"), position="table")), "hyunwoongko")
    assert info.value.field in ("position", "layer_norm_eps", "mask_fill", "scale_embedding", "tgt_pad_mask")
    with pytest.raises(InputError):
        export_state_dict(config, {k: v for k, v in params.items() if k != "output.bias"}, "from-scratch", norm_placement="pre")


# -- Layout files ------------------------------------------------------------------------------

GOOD = """
preset = "llmhub"
matrices = "out-in"
[keys]
"emb.{s:enc=encoder|dec=decoder}" = "{s}.embedding.weight"
"""


@pytest.mark.parametrize("text, words", [
    ("this is = not toml [", "not valid TOML"),
    ('colour = "blue"\n' + GOOD, "unknown top-level key"),
    (GOOD.replace("llmhub", "nonesuch"), "unknown preset"),
    (GOOD + '"a.{i}.b" = "encoder.layers.{i}.self_attn.q_proj.weigth"\n', "'encoder.layers.0.self_attn.q_proj.weigth'.*not a canonical parameter"),
    (GOOD + '"a.b" = "encoder.layers.{i}.ffn_norm.weight"\n', "uses {i}, which the foreign pattern does not capture"),
    (GOOD + '"a.{i}.{w:weight|bias}" = "encoder.layers.{i}.ffn_norm.weight"\n', "must use every capture"),
    (GOOD + '"a.{i}" = { to = "encoder.layers.{i}.ffn_norm.weight", flip = true }\n', "unknown field"),
    (GOOD + '"a.{i}" = { split = ["encoder.layers.{i}.ffn_norm.weight"] }\n', "at least two canonical keys"),
    (GOOD + '"a.{i}.{p:q|q}" = "encoder.layers.{i}.self_attn.{p}_proj.bias"\n', "repeats a word"),
    (GOOD + '"a" = { same_as = "b.{i}" }\n', "may only use the captures"),
    (GOOD.replace('matrices = "out-in"\n', "") + '"w" = "output.weight"\n', "say how the system stores matrices"),
    (GOOD + "[switches]\nd_model = 8\n", "is a size"),
    (GOOD + '[switches]\nqkv_bias = "yes"\n', "must be true or false"),
    (GOOD + "[switches]\nwarp = 9\n", "not a ModelConfig switch"),
    (GOOD + '"a.{i}" = { to = "encoder.layers.{i}.ffn_norm.weight", recomputed = true }\n', "recomputed applies to position tables only"),
    ('free = ["pad_id"]\n' + GOOD.replace("[keys]", '[hints]\nactivation = "nn.Transformer(activation=...)"\n[keys]'), "not listed in free or required"),
    (GOOD.replace("[keys]", "[hints]\npad_id = 3\n[keys]"), r"\[hints\] must be a table"),
])
def test_layout_file_errors_name_the_problem(tmp_path, text, words):
    # TOML tables end at the next header: keep [switches] last so that [keys] lines stay in [keys].
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(LayoutError, match=words) as info:
        load_layout(path)
    assert str(path) in str(info.value)


def test_unknown_layout_names_are_refused():
    with pytest.raises(LayoutError, match="no built-in layout of that name"):
        load_layout("fairseq")


def test_a_users_own_layout_file(tmp_path):
    """A Flax-style key space (kernels stored (in, out), nested names, a step counter to drop)."""
    path = tmp_path / "flax-wmt.toml"
    path.write_text(textwrap.dedent('''
        description = "my Flax model"
        preset = "paper"
        matrices = "in-out"
        drop = ["*/step"]
        [keys]
        "params/shared_embedding/embedding" = "encoder.embedding.weight"
        "params/{s:encoder|decoder}/layer_{i}/{a:self_attention=self_attn|cross_attention=cross_attn}/{p:query=q|key=k|value=v|out=o}/{w:kernel=weight|bias=bias}" = "{s}.layers.{i}.{a}.{p}_proj.{w}"
        "params/{s:encoder|decoder}/layer_{i}/mlp/{m:wi=linear1|wo=linear2}/{w:kernel=weight|bias=bias}" = "{s}.layers.{i}.ffn.{m}.{w}"
        "params/{s:encoder|decoder}/layer_{i}/{n:ln_attn=self_attn_norm|ln_cross=cross_attn_norm|ln_mlp=ffn_norm}/{w:scale=weight|bias=bias}" = "{s}.layers.{i}.{n}.{w}"
    '''))
    layout = load_layout(path)
    # The paper's encoder has no cross-attention: the same rule must not invent one.
    config = preset("paper", **SIZES, src_vocab_size=21, tgt_vocab_size=21)
    params = params_for(config)
    state = export_state_dict(config, params, path)
    assert state["params/encoder/layer_1/self_attention/query/kernel"].tobytes() == \
        params["encoder.layers.1.self_attn.q_proj.weight"].tobytes()  # in-out: no transpose
    state["opt/step"] = np.array(7)
    result = convert_arrays(state, layout, n_heads=2, max_len=11)
    assert result.config == config and any("dropped 1 key" in d for d in result.decisions)
    assert all(result.params[k].tobytes() == params[k].tobytes() for k in params)


def test_the_porting_guides_example_layout_works(tmp_path):
    """The layout written out in docs/porting.md reads, and round-trips the model it describes."""
    import pathlib
    import re

    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "porting.md").read_text()
    # The full example (the guide also shows a short layout that extends a built-in one).
    text = next(block for block in re.findall(r"```toml\n(.*?)```", guide, re.S) if "enc.blocks" in block)
    path = tmp_path / "mine.toml"
    path.write_text(text)
    layout = load_layout(path)
    config = preset("paper", **SIZES, src_vocab_size=21, tgt_vocab_size=21, **layout.switches, position="table")
    params = params_for(config)
    state = export_state_dict(config, params, layout)
    assert state["enc.blocks.1.attn.qkv.weight"].shape == (48, 16) and state["pos"].shape == (1, 11, 16)
    assert "dec.blocks.0.cross.proj.bias" in state and "enc.blocks.0.cross.proj.bias" not in state
    state["steps"] = np.array(1000)
    back_config, back = import_state_dict(state, path, n_heads=2)
    assert back_config == config and all(back[k].tobytes() == params[k].tobytes() for k in params)


def test_builtin_layouts_do_not_repeat_their_presets():
    for layout in builtin_layouts():
        repeated = {k: v for k, v in layout.switches.items() if PRESETS[layout.preset].get(k) == v}
        assert not repeated, f"{layout.name} repeats preset switches {repeated}"
        assert layout.preset == layout.name, "each built-in layout starts from its system's preset"


def test_the_package_imports_and_converts_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        import conformance.cli, conformance.convert
        from conformance import init_params, preset
        from conformance.convert import export_state_dict, import_state_dict
        conformance.cli.build_parser()
        config = preset("llmhub", d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1, max_len=5)
        state = export_state_dict(config, init_params(config, dtype=np.float32), "llmhub")
        print(import_state_dict(state, None, n_heads=2)[0] == config)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_every_transformers_family_says_how_its_model_is_called():
    """conformance.compare's default run, a one-graph ONNX export's inputs and the check of a
    written folder all call a transformers model by its layout's [hf.call]: a family without one
    is called with nothing (the check of every `--to hf-<family>` failed so)."""
    from conformance.convert import builtin_layouts

    families = [layout for layout in builtin_layouts() if layout.hf is not None]
    assert len(families) >= 13
    missing = [layout.name for layout in families if "decoder_input_ids" not in layout.hf.call]
    assert not missing, f"layouts with [hf] and no [hf.call] decoder_input_ids: {missing}"
