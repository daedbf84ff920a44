"""MLCommons AlgoPerf's WMT Transformer, PyTorch and Flax, in all four workload variants.

The sources are the two models re-created in `tests/systems/algoperf_torch.py` and
`tests/systems/algoperf_flax.py` (random weights, random biases and LayerNorm scales), each run
through its own forward with its own masks on padded batches. Our model is fed the decoder
input AlgoPerf builds itself, `shift_right(targets)`; AlgoPerf masks the decoder from the
unshifted targets, so only positions whose label is real are compared (the others are padding
in both).

Variants (`algoperf/workloads/wmt/*/workload.py`): base (pre-LN, ReLU), post-LN
(`WmtWorkloadPostLN`), GLU with tanh (`WmtWorkloadGLUTanH`) and attention temperature 4.0
(`WmtWorkloadAttentionTemp`). The key set tells the first three apart; the temperature is a
constructor argument, so the import is told it.

One model size and one batch shape for every case, so that JAX compiles once per config.
"""

from __future__ import annotations

import numpy as np
import pytest

# One worker with tests/check/test_side_by_side_algoperf.py: both build and run the same AlgoPerf Flax
# and torch models, whose eager ops and compiled programs the second file then finds ready
# (measured: the two files in two processes 42.0 CPU-s, in one 33.4, imports included).
pytestmark = pytest.mark.xdist_group("algoperf")

pytest.importorskip("flax", reason="the Flax source system is a flax.linen model")
torch = pytest.importorskip("torch", reason="the PyTorch source system is a torch.nn model")

import jax  # noqa: E402
from flax import serialization, traverse_util  # noqa: E402

from conformance.cli import main  # noqa: E402
from conformance.convert import convert_arrays, export_state_dict  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import ConfigError  # noqa: E402
from conformance.core.presets import FLOAT32_MIN  # noqa: E402
from systems import algoperf_flax, algoperf_torch, randomize_  # noqa: E402
from systems.harness import BACKEND_PARAMS, assert_matches_source, padded_batch, run_backend  # noqa: E402

VARIANTS = sorted(algoperf_torch.VARIANTS)
VOCAB, D, HEADS, LAYERS, MAX_LEN = 29, 32, 4, 2, 16


def d_hid(variant: str) -> int:
    # AlgoPerf's torch decoder layer builds its gate as (d_hid, d_hid) on D-wide inputs: a GLU
    # model runs only with d_hid == d_model. The other variants keep them apart (48 vs 32), so a
    # swapped (d_in, d_out) shows.
    return D if variant == "glu-tanh" else 48


def told(variant: str) -> dict:
    """What the import must be told beyond the tensors: the temperature of that variant."""
    return {"attention_temp": 4.0} if variant == "attention-temp" else {}


def torch_source(variant: str, seed: int = 1):
    model = algoperf_torch.make(variant, ntoken=VOCAB, d_model=D, nhead=HEADS, d_hid=d_hid(variant), nlayers=LAYERS,
                                max_len=MAX_LEN)
    return randomize_(model, seed)


def torch_state(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def flax_source(variant: str, seed: int = 1):
    c = algoperf_flax.config(variant, vocab_size=VOCAB, emb_dim=D, num_heads=HEADS, num_layers=LAYERS, qkv_dim=D,
                             mlp_dim=d_hid(variant), max_len=MAX_LEN)
    return c, algoperf_flax.init(c, seed=seed)


def flat(params) -> dict:
    return traverse_util.flatten_dict(params, sep=".")


def batch():
    """Inputs and targets padded with 0 (AlgoPerf's pad); our decoder input is the shifted targets."""
    src, tgt = padded_batch(0, VOCAB, VOCAB, seed=3)
    return src, tgt, np.pad(tgt, ((0, 0), (1, 0)))[:, :-1]


EXPECTED = {  # what the key set (and the temperature told) gives, per variant
    "base": dict(norm_placement="pre", final_encoder_norm=True, ffn_glu=False, activation="relu", attention_temp=1.0),
    "post-ln": dict(norm_placement="post", final_encoder_norm=False, ffn_glu=False, activation="relu", attention_temp=1.0),
    "glu-tanh": dict(norm_placement="pre", final_encoder_norm=True, ffn_glu=True, activation="tanh", attention_temp=1.0),
    "attention-temp": dict(norm_placement="pre", final_encoder_norm=True, ffn_glu=False, activation="relu",
                           attention_temp=4.0),
}


def assert_variant(config, variant):
    for name, value in EXPECTED[variant].items():
        assert getattr(config, name) == value, (variant, name, getattr(config, name))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_logits_reproduced_in_float32(variant, backend):
    model = torch_source(variant)
    src, tgt, shifted = batch()
    source = algoperf_torch.logits(model, src, tgt).numpy()
    converted = convert_arrays(torch_state(model), None, n_heads=HEADS, **told(variant))  # auto-detected
    assert converted.layout.name == "algoperf-wmt-torch"
    assert_variant(converted.config, variant)
    assert converted.config.position == "table" and converted.config.max_len == MAX_LEN  # pos_encoder.pe, as stored
    ours = run_backend(backend, converted.config, converted.params, src, shifted)
    real = tgt > 0
    result = assert_matches_source(ours[real], source[real], f"{backend} vs AlgoPerf torch ({variant}), float32")
    print(f"algoperf torch {variant} {backend} float32: {result.describe()}")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_flax_logits_reproduced_in_float32(variant, backend):
    c, params = flax_source(variant)
    src, tgt, shifted = batch()
    source = algoperf_flax.apply(c, params, src, tgt)
    converted = convert_arrays(flat(params), None, max_len=MAX_LEN, **told(variant))  # n_heads from the kernels
    assert converted.layout.name == "algoperf-wmt-flax" and converted.config.n_heads == HEADS
    assert_variant(converted.config, variant)
    ours = run_backend(backend, converted.config, converted.params, src, shifted)
    real = tgt > 0
    result = assert_matches_source(ours[real], source[real], f"{backend} vs AlgoPerf Flax ({variant}), float32")
    print(f"algoperf flax {variant} {backend} float32: {result.describe()}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_state_dict_round_trip_is_bit_exact_and_loads_strictly(variant):
    model = torch_source(variant, seed=2)
    state = torch_state(model)
    converted = convert_arrays(state, "algoperf-wmt-torch", n_heads=HEADS, **told(variant))
    exported = export_state_dict(converted.config, converted.params, "algoperf-wmt-torch")
    assert sorted(exported) == sorted(state)  # the shared embedding and table under all three names
    for key, value in state.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    fresh = algoperf_torch.make(variant, ntoken=VOCAB, d_model=D, nhead=HEADS, d_hid=d_hid(variant), nlayers=LAYERS,
                                max_len=MAX_LEN)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    src, tgt, _ = batch()
    assert torch.equal(algoperf_torch.logits(fresh, src, tgt), algoperf_torch.logits(model, src, tgt))


@pytest.mark.parametrize("variant", VARIANTS)
def test_flax_tree_round_trip_is_bit_exact(variant):
    c, nested = flax_source(variant, seed=4)
    tree = flat(nested)
    converted = convert_arrays(tree, "algoperf-wmt-flax", max_len=MAX_LEN, **told(variant))
    exported = export_state_dict(converted.config, converted.params, "algoperf-wmt-flax")
    assert jax.tree_util.tree_structure(exported) == jax.tree_util.tree_structure(nested)
    back = flat(exported)
    assert sorted(back) == sorted(tree)
    for key, value in tree.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_weights_ported_to_flax_reproduce_the_torch_logits(variant):
    """torch AlgoPerf weights in, Flax AlgoPerf weights out, through our checkpoint.

    The two AlgoPerf models are not quite one function, and the port says where it crosses over:
    - the torch buffer `pe` is the t2t sinusoid computed in float32; Flax recomputes it in float64
      and rounds once: the import recognises it as that sinusoid (`position="sinusoid-t2t"`,
      checked within the float32-computation tolerance) and the Flax model brings its own;
    - torch's LayerNorm is two-pass, Flax's fast-variance: the same function up to rounding;
    - torch fills masked scores with -1e10, Flax with finfo(float32).min: the same softmax in
      every row with a real key (each masked weight is exactly 0 either way), which is every row
      compared here."""
    model = torch_source(variant, seed=5)
    src, tgt, _ = batch()
    source = algoperf_torch.logits(model, src, tgt).numpy()
    converted = convert_arrays(torch_state(model), "algoperf-wmt-torch", n_heads=HEADS, position="sinusoid-t2t",
                               **told(variant))
    as_flax = converted.config.replace(layer_norm_form="fast-variance", mask_fill=FLOAT32_MIN)
    tree = export_state_dict(as_flax, converted.params, "algoperf-wmt-flax")
    c = algoperf_flax.config(variant, vocab_size=VOCAB, emb_dim=D, num_heads=HEADS, num_layers=LAYERS, qkv_dim=D,
                             mlp_dim=d_hid(variant), max_len=MAX_LEN)
    ported = algoperf_flax.apply(c, tree, src, tgt)
    real = tgt > 0
    result = assert_matches_source(ported[real], source[real], f"AlgoPerf Flax with ported torch weights ({variant})")
    print(f"algoperf torch -> flax {variant}: {result.describe()}")


def test_the_variants_differ_where_the_keys_do_not_tell():
    """The temperature is in no tensor: left out, the import gives 1.0 and other logits, and
    says it defaulted it."""
    model = torch_source("attention-temp")
    src, tgt, shifted = batch()
    source = algoperf_torch.logits(model, src, tgt).numpy()
    untold = convert_arrays(torch_state(model), "algoperf-wmt-torch", n_heads=HEADS)
    assert untold.config.attention_temp == 1.0
    assert any(line.startswith("attention_temp=1.0 (the layout's default") for line in untold.decisions)
    ours = run_backend("numpy", untold.config, untold.params, src, shifted)
    assert np.abs(ours - source)[tgt > 0].max() > 1e-2


def test_a_torch_glu_model_needs_d_hid_equal_to_d_model():
    """AlgoPerf's torch decoder gate is (d_hid, d_hid): a canonical GLU model with F != D has no
    such torch model, and an import of one with the wrong gate shape names the tensor."""
    model = torch_source("glu-tanh")
    state = torch_state(model)
    state["decoder.decoder.layers.0.linear_glu.weight"] = np.zeros((D, 48), np.float32)
    with pytest.raises(Exception, match="decoder.decoder.layers.0.linear_glu.weight"):
        convert_arrays(state, "algoperf-wmt-torch", n_heads=HEADS)


def test_export_refuses_what_algoperf_cannot_compute():
    model = torch_source("base")
    converted = convert_arrays(torch_state(model), "algoperf-wmt-torch", n_heads=HEADS)
    with pytest.raises(ConfigError, match="qkv_bias"):
        params = dict(converted.params)
        config = converted.config.replace(qkv_bias=True)
        for stack, kinds in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "cross_attn"))):
            for i in range(LAYERS):
                for kind in kinds:
                    for p in "qkv":
                        params[f"{stack}.layers.{i}.{kind}.{p}_proj.bias"] = np.zeros(D, np.float32)
        export_state_dict(config, params, "algoperf-wmt-torch")


def test_rosetta_convert_reads_both_files_with_at_most_n_heads_max_len_and_the_temperature(tmp_path, capsys):
    """The CLI, from a torch.save'd state dict and from a Flax msgpack, for the variant the keys
    cannot tell (the attention temperature); then back out to both systems' files."""
    model = torch_source("attention-temp", seed=6)
    pt = tmp_path / "algoperf.pt"
    torch.save(model.state_dict(), pt)
    ours = tmp_path / "from_torch.safetensors"
    assert main(["convert", str(pt), str(ours), "--set", "n_heads=4", "--set", "attention_temp=4.0"]) == 0
    config, params = checkpoint.load(ours)
    assert config.attention_temp == 4.0 and config.n_heads == HEADS and config.notes["converted_from"] == "algoperf-wmt-torch"

    c, tree = flax_source("glu-tanh", seed=6)
    packed = tmp_path / "algoperf.msgpack"
    packed.write_bytes(serialization.to_bytes(tree))
    ours_flax = tmp_path / "from_flax.safetensors"
    assert main(["convert", str(packed), str(ours_flax), "--set", f"max_len={MAX_LEN}"]) == 0
    config, _ = checkpoint.load(ours_flax)
    assert config.ffn_glu and config.activation == "tanh" and config.notes["converted_from"] == "algoperf-wmt-flax"

    back = tmp_path / "back.msgpack"
    assert main(["convert", str(ours_flax), str(back), "--to", "algoperf-wmt-flax"]) == 0
    restored = flat(serialization.msgpack_restore(back.read_bytes()))
    assert sorted(restored) == sorted(flat(tree))
    assert all(np.array_equal(restored[k], v) for k, v in flat(tree).items())
    back_pt = tmp_path / "back.safetensors"
    assert main(["convert", str(ours), str(back_pt), "--to", "algoperf-wmt-torch"]) == 0
    capsys.readouterr()


# -- Beam search -------------------------------------------------------------------------------


def up_to_the_end(ids: np.ndarray, eos_id: int, width: int) -> np.ndarray:
    """Each row up to and including its first end token, then 0 (AlgoPerf's pad), `width` wide:
    AlgoPerf's torch port repeats the end token to the end of the row, ours pads after it."""
    out = np.zeros((len(ids), width), dtype=np.int64)
    for i, row in enumerate(np.asarray(ids, dtype=np.int64)):
        ended = np.flatnonzero(row == eos_id)
        row = row[: ended[0] + 1] if ended.size else row
        out[i, : len(row)] = row
    return out


# Seeds where Hugging Face's rule (with the same GNMT penalty) chooses other ids on every row.
BEAM_SEEDS = {"base": 9, "glu-tanh": 5}


@pytest.mark.parametrize("variant", sorted(BEAM_SEEDS))
def test_generate_with_the_flax_beam_rule_gives_algoperf_beam_search_ids(variant):
    """AlgoPerf's torch beam search (tests/systems/algoperf_beam.py; beam 4, alpha 0.6, eos 2,
    start token 0, max_decode_len 9 = 8 generated tokens), float32, against our
    generate(..., beam_rule="flax") on the converted weights in float32, in every backend, up to
    each row's end token; Hugging Face's rule gives other ids on these rows."""
    from conformance.check import backends
    from conformance.check.compare import to_numpy
    from systems import algoperf_beam

    model = torch_source(variant, seed=BEAM_SEEDS[variant])
    src, _, _ = batch()
    theirs = up_to_the_end(algoperf_beam.beam_search(model, src, beam_size=4, alpha=0.6, eos_id=2, max_decode_len=9),
                           2, 8)
    converted = convert_arrays(torch_state(model), "algoperf-wmt-torch", n_heads=HEADS)
    for param in BACKEND_PARAMS:
        backend = param.values[0]
        if backends.availability().get(backend):
            continue
        target = backends.Target(backend, "cpu", "float32")
        with backends.full_precision(backend):
            ours = backends.build(target, converted.config, converted.params)
            flax_rule = to_numpy(ours.generate(src, 8, 0, 2, num_beams=4, length_penalty=0.6, beam_rule="flax"))
            hf_rule = to_numpy(ours.generate(src, 8, 0, 2, num_beams=4, length_penalty=0.6, length_penalty_form="gnmt"))
        assert np.array_equal(up_to_the_end(flax_rule, 2, 8), theirs), (backend, flax_rule, theirs)
        assert (up_to_the_end(hf_rule, 2, 8) != theirs).any(axis=1).all(), (backend, hf_rule, theirs)
