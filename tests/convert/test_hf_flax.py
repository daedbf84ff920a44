"""Hugging Face Flax folders (transformers <= 4.x) against the Flax models that wrote them.

The folders under tests/fixtures/hf_flax/ were written by transformers 4.46's Flax classes
(tests/fixtures/make_flax_fixtures.py, in a throwaway environment: transformers 5 has no Flax
models): tiny random T5 v1.0, T5 v1.1, mT5, BART, mBART, Pegasus and Marian, every parameter
perturbed, plus the T5 model saved in shards (flax_model-0000i-of-00003.msgpack and
flax_model.msgpack.index.json). Each holds reference.npz: the ids (a right-padded source row),
the Flax model's float32 logits and its float64 logits (jax x64, float64 params; FlaxT5LayerNorm's
float32 variance kept in float64 for that pass only).

Each folder converts with no --set; our float64 NumPy logits equal the Flax float64 logits and
torch and JAX in float32 equal the Flax float32 logits within the float32 tolerance.

The float64 bar, FLAX_FLOAT64 = 1e-13 (max |ours - theirs| / max(1, max |theirs|)): measured on
these fixtures at most 5.7e-16 (T5, whose logits reach 3.5; BART family <= 4.8e-16), i.e. about
2.6 float64 epsilons, so the bar keeps a margin of 175x and still sits six orders of magnitude
below what a wrong switch costs (an epsilon of 1e-5 for 1e-6, a missing d_model^-1/2 or a
float32 position table all show at 1e-7 or more).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conformance.check.compare import compare
from conformance.check.tolerances import tolerance
from conformance.check.training import scaled_error
from conformance.cli import main
from conformance.convert import from_hf_folder
from conformance.convert.hf_folder import read_weights
from conformance.convert.readers import read_file
from conformance.core import checkpoint
from systems.harness import BACKEND_PARAMS, run_backend

import impl_numpy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_flax"
FLAX_FLOAT64 = 1e-13
# folder -> (layout, what the conversion must say beyond sizes)
EXPECTED = {
    "t5": ("hf-t5", dict(activation="relu", ffn_glu=False, tie_output=True, scale_logits=True)),
    "t5-sharded": ("hf-t5", dict(activation="relu", ffn_glu=False, tie_output=True, scale_logits=True)),
    "t5-v1_1": ("hf-t5", dict(activation="gelu-tanh", ffn_glu=True, tie_output=False, scale_logits=False)),
    "mt5": ("hf-mt5", dict(activation="gelu-tanh", ffn_glu=True, tie_output=False, scale_logits=False)),
    "bart": ("hf-bart", dict(norm_placement="post", embedding_norm=True, position="table", position_offset=2,
                             activation="gelu", scale_embedding=False, final_logits_bias=True)),
    "mbart": ("hf-mbart", dict(norm_placement="pre", embedding_norm=True, position="table", position_offset=2,
                               activation="gelu", scale_embedding=True, final_logits_bias=True)),
    "pegasus": ("hf-pegasus", dict(norm_placement="pre", position="sinusoid-split", activation="relu",
                                   scale_embedding=True, final_logits_bias=True)),
    "marian": ("hf-marian", dict(norm_placement="post", position="sinusoid-split", activation="silu",
                                 scale_embedding=True, final_logits_bias=True)),
}
NAMES = list(EXPECTED)
# The sharded folder is the t5 model again: its logits are checked on NumPy; JAX compiles once per model.
COMPILED = [name for name in NAMES if name != "t5-sharded"]


@pytest.fixture(scope="module")
def converted():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = from_hf_folder(FIXTURES / name)
        return cache[name]

    return get


def reference(name):
    with np.load(FIXTURES / name / "reference.npz") as data:
        ref = {k: data[k] for k in data.files}
    return ref["input_ids"].astype(np.int64), ref["decoder_input_ids"].astype(np.int64), ref


@pytest.mark.parametrize("name", NAMES)
def test_each_folder_converts_with_no_set(name, converted):
    config, params = converted(name)
    layout, expected = EXPECTED[name]
    assert config.notes["converted_from"] == layout
    for key, value in expected.items():
        assert getattr(config, key) == value, (name, key, getattr(config, key))
    assert (config.d_model, config.n_heads, config.d_ff, config.src_vocab_size) == (16, 2, 32, 64)
    src, _, ref = reference(name)
    # The fixture's attention_mask is exactly "not the pad id", which our masks assume.
    np.testing.assert_array_equal(src != config.pad_id, ref["attention_mask"].astype(bool))
    assert json.loads(config.notes["generation"])["decoder_start_token_id"] == json.loads(
        (FIXTURES / name / "generation_config.json").read_text())["decoder_start_token_id"]


@pytest.mark.parametrize("name", NAMES)
def test_float64_numpy_logits_equal_the_flax_models(name, converted):
    config, params = converted(name)
    src, tgt, ref = reference(name)
    ours = impl_numpy.Model(config, {k: v.astype(np.float64) for k, v in params.items()}, dtype="float64")(src, tgt).logits
    error = scaled_error(np.asarray(ours, np.float64), ref["logits_float64"])
    assert error <= FLAX_FLOAT64, f"{name}: float64 NumPy vs the Flax model in float64: {error:.3e}"


@pytest.mark.parametrize("backend", [p for p in BACKEND_PARAMS if p.values[0] != "numpy"])
@pytest.mark.parametrize("name", COMPILED)
def test_float32_backends_equal_the_flax_models(name, backend, converted):
    config, params = converted(name)
    src, tgt, ref = reference(name)
    result = compare(run_backend(backend, config, params, src, tgt), ref["logits"], tolerance("float32"))
    assert result.passed, f"{name} on {backend}, float32: {result.describe()}"


def test_flax_names_are_what_transformers_4_wrote():
    """The names the fixtures hold, as the converter reads them: FlaxT5LayerNorm's `weight` (not
    `scale`), nn.Embed's `embedding`, Dense `kernel`s (in, out), BART's 34-row position table
    (32 + offset 2), its layernorm_embedding `scale`/`bias`; FlaxT5 stores no lm_head when tied."""
    t5 = read_file(FIXTURES / "t5" / "flax_model.msgpack")
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.embedding" in t5
    assert t5["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.embedding"].shape == (8, 2)
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.embedding" not in t5  # block 0 only
    assert "shared.embedding" in t5 and "encoder.final_layer_norm.weight" in t5 and "lm_head.kernel" not in t5
    assert not any(k.endswith(".scale") for k in t5)
    v1_1 = read_file(FIXTURES / "t5-v1_1" / "flax_model.msgpack")
    assert v1_1["lm_head.kernel"].shape == (16, 64) and "encoder.block.0.layer.1.DenseReluDense.wi_0.kernel" in v1_1
    bart = read_file(FIXTURES / "bart" / "flax_model.msgpack")
    assert bart["model.encoder.embed_positions.embedding"].shape == (34, 16)
    assert bart["model.encoder.layers.0.self_attn.q_proj.kernel"].shape == (16, 16)
    assert {"model.encoder.layernorm_embedding.scale", "model.encoder.layernorm_embedding.bias"} <= set(bart)


def test_an_untied_flax_lm_head_is_kept(converted):
    """An untied Flax lm_head (T5 v1.1, Flan-T5) must not be lost on the way to PyTorch's names
    (cf. transformers issue #18092): ours is the Flax kernel (d_model, V) exactly, and differs
    from the shared embedding, which a lost head would silently stand in for."""
    config, params = converted("t5-v1_1")
    kernel = read_file(FIXTURES / "t5-v1_1" / "flax_model.msgpack")["lm_head.kernel"]
    np.testing.assert_array_equal(params["output.weight"], kernel)
    assert not np.array_equal(params["output.weight"], params["encoder.embedding.weight"].T)


def test_the_sharded_folder_is_the_whole_model(converted, tmp_path, capsys):
    """flax_model.msgpack.index.json names each parameter's shard by its "/"-joined path; the shards
    together are the one-file model, bit for bit, and `rosetta convert` reads them with no --set."""
    index = json.loads((FIXTURES / "t5-sharded" / "flax_model.msgpack.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3 and all("/" in key for key in index)
    whole, sharded = read_weights(FIXTURES / "t5"), read_weights(FIXTURES / "t5-sharded")
    assert sorted(whole) == sorted(sharded) and all(np.array_equal(whole[k], sharded[k]) for k in whole)
    out = tmp_path / "sharded.safetensors"
    assert main(["convert", str(FIXTURES / "t5-sharded"), str(out)]) == 0
    assert "layout: hf-t5" in capsys.readouterr().out
    config, params = checkpoint.load(out)
    one_config, one = converted("t5")
    assert config.replace(notes={}) == one_config.replace(notes={})
    assert all(np.array_equal(params[k], one[k]) for k in one)


def test_a_shard_that_holds_what_the_index_does_not_say_is_refused(tmp_path):
    from conformance.core.errors import CheckpointError

    folder = tmp_path / "bad"
    folder.mkdir()
    for path in (FIXTURES / "t5-sharded").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    index = json.loads((folder / "flax_model.msgpack.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "flax_model-00003-of-00003.msgpack"
    (folder / "flax_model.msgpack.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="which the index places in"):
        read_weights(folder)
