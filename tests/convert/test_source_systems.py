"""Converted tutorial and library models reproduce their source systems' logits, on every backend.

Each source system is re-created in `tests/systems/` from variants.md (key names and numerics),
given random weights, run the way its own code runs it (its own masks), converted through the
auto-detected built-in layout, and compared in float32: max abs difference <= 1e-5, NaN exactly
where the source has NaN. A float64 run of each system against our float64 NumPy oracle holds the
numerics that float32 rounding hides (a LayerNorm epsilon) to 1e-9.
"""

from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the source systems are PyTorch modules")

from conformance import init_params, preset  # noqa: E402
from conformance.convert import (  # noqa: E402
    TensorError,
    as_arrays,
    convert_arrays,
    export_state_dict,
    from_torch_nn_transformer,
    load_layout,
)
from conformance.core.errors import ConfigError  # noqa: E402
from systems import (  # noqa: E402
    annotated,
    from_scratch,
    hyunwoongko,
    llmhub,
    pre_ln_tutorial,
    randomize_,
    sublayer_norm,
    torch_tutorial,
)
from systems.harness import (  # noqa: E402
    BACKEND_PARAMS,
    FLOAT64_BAR,
    WRONG_EPSILONS,
    assert_matches_source,
    matches_source,
    padded_batch,
    run_backend,
)

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)

# layout name -> (system module, what the import must be told beyond n_heads)
SYSTEMS = {
    "from-scratch": (from_scratch, {}),
    "llmhub": (llmhub, {}),
    "hyunwoongko": (hyunwoongko, {"max_len": SIZES["max_len"]}),  # its sinusoid is not in the state dict
    "sublayer-norm": (sublayer_norm, {}),
    "pre-ln-tutorial": (pre_ln_tutorial, {}),
    "annotated-transformer": (annotated, {"pad_id": annotated.PAD}),
    "torch-nn-transformer": (torch_tutorial, {"norm_placement": "post", "pad_id": torch_tutorial.PAD}),  # norm_first=False (the default); the tutorial's PAD_IDX
}


@pytest.fixture(autouse=True)
def _quiet_torch():
    # nn.Transformer warns about the tutorial's mixed float/bool masks and nested tensors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@functools.cache
def source(name: str, seed: int = 1):
    module, _ = SYSTEMS[name]
    return randomize_(module.make(**SIZES), seed)


# Systems that keep a sinusoid in their state dict: converted as it is (a stored table), and with
# the sinusoid recognised (`--set position=sinusoid-interleaved`), which drops the table and
# computes ours instead.
STORES_TABLE = [name for name in SYSTEMS if load_layout(name).stores_positions()]


@functools.cache
def converted(name: str, recognise: bool = False):
    _, extra = SYSTEMS[name]
    asked = {"position": load_layout(name).base_switches()["position"]} if recognise else {}
    return convert_arrays(as_arrays(source(name).state_dict()), None, n_heads=SIZES["n_heads"], **extra, **asked)


def source_logits(name: str, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    module, _ = SYSTEMS[name]
    with torch.no_grad():
        return module.logits(source(name), torch.from_numpy(src), torch.from_numpy(tgt)).numpy()


def batch(name: str, fully_masked: bool = False):
    module, _ = SYSTEMS[name]
    return padded_batch(module.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"], fully_masked=fully_masked)


def test_the_bar_is_an_absolute_difference():
    """1e-5 means 1e-5: not scaled by the logits' magnitude (a wrong LayerNorm epsilon on
    from-scratch moves logits of size ~3 by 2.1e-5, which a scaled bar of 3e-5 let through)."""
    reference = np.array([[10.0, -3.0, np.nan], [0.5, 2.0, 1.0]], dtype=np.float32)
    assert_matches_source(reference + np.float32(9e-6) * (reference != 10), reference, "within the bar")
    off = reference.copy()
    off[1, 0] += 2e-5
    with pytest.raises(AssertionError, match=r"max abs difference 2\.\d+e-05 at \(1, 0\)"):
        assert_matches_source(off, reference, "off by 2e-5 where |logits| <= 10")
    nan_moved = reference.copy()
    nan_moved[0, 2], nan_moved[1, 2] = 0.0, np.nan
    with pytest.raises(AssertionError, match="NaN"):
        assert_matches_source(nan_moved, reference, "NaN elsewhere")


@pytest.mark.parametrize("name", SYSTEMS)
def test_auto_detection_picks_the_systems_layout(name):
    result = converted(name)
    assert result.detected and result.layout.name == name
    assert result.config.n_encoder_layers == result.config.n_decoder_layers == SIZES["n_layers"]
    assert (result.config.d_model, result.config.d_ff) == (SIZES["d_model"], SIZES["d_ff"])
    assert (result.config.src_vocab_size, result.config.tgt_vocab_size) == (SIZES["src_vocab"], SIZES["tgt_vocab"])
    assert result.config.pad_id == SYSTEMS[name][0].PAD


# nn.Transformer's fully masked rows are not expressible (see the xfail below); every other
# system is checked on them too.
FULLY_MASKED = {name: name != "torch-nn-transformer" for name in SYSTEMS}


# Every system as stored on every backend; with the sinusoid recognised on NumPy and PyTorch,
# sparing JAX (which compiles per config) a second compile of the same model.
@pytest.mark.parametrize("name, recognise, backend", [
    pytest.param(name, recognise, backend.values[0], marks=backend.marks,
                 id=f"{name}{'-sinusoid-recognised' if recognise else ''}-{backend.values[0]}")
    for name in SYSTEMS for recognise in (False, True) for backend in BACKEND_PARAMS
    if not recognise or (name in STORES_TABLE and backend.values[0] != "jax")
])
def test_logits_match_the_source(name, recognise, backend):
    """Padded rows match; fully masked rows give NaN under -inf fills and a uniform average under
    finite fills, in the source and in the converted model alike. With the stored sinusoid
    recognised, our own sinusoid replaces the system's float32 one, within the same bar."""
    src, tgt = batch(name, fully_masked=FULLY_MASKED[name])
    reference = source_logits(name, src, tgt)
    result = converted(name, recognise)
    if recognise:
        assert result.config.position == "sinusoid-interleaved" and "encoder.position.table" not in result.params
        assert any("recognised the stored table as the sinusoid-interleaved sinusoid" in d for d in result.decisions)
    else:
        assert result.config.position == ("table" if name in STORES_TABLE else "sinusoid-interleaved")
    assert not np.isnan(reference[:3]).any()
    assert np.isnan(reference[3:]).any() == (FULLY_MASKED[name] and result.config.mask_fill == float("-inf"))
    ours = run_backend(backend, result.config, result.params, src, tgt)
    assert_matches_source(ours, reference, f"{name} on {backend}")


def test_torch_nn_transformer_fully_masked_rows():
    """PyTorch's nn.MultiheadAttention (need_weights=False, the SDPA path nn.Transformer takes)
    returns 0 for a query whose every key is masked: `empty_rows = "zeros"` (issue 58) says so,
    where the converted config's default (the softmax of a -inf row: NaN) does not."""
    name = "torch-nn-transformer"
    src, tgt = batch(name, fully_masked=True)
    result = converted(name)
    reference = source_logits(name, src, tgt)
    with pytest.raises(AssertionError):
        assert_matches_source(run_backend("numpy", result.config, result.params, src, tgt), reference, name)
    zeros = result.config.replace(empty_rows="zeros")
    assert_matches_source(run_backend("numpy", zeros, result.params, src, tgt), reference, name)


# Flipping any of these switches must break the agreement above: proof that the batch exercises
# them (a test that cannot fail proves nothing). field -> the wrong value for a right one.
FLIPS = {
    "norm_placement": {"post": "pre", "pre": "post"}.get,
    "scale_embedding": lambda v: not v,
    "tgt_pad_mask": {"keys": "queries", "queries": "keys"}.get,
    "cross_attn_src_mask": lambda v: not v,
    "layer_norm_form": {"standard": "std-eps", "std-eps": "standard"}.get,
    "activation": {"relu": "gelu"}.get,
    "pad_id": lambda v: 0 if v else 1,
    # Seen only on a fully masked row: NaN under -inf, a uniform average under a finite fill.
    "mask_fill": lambda v: -1e9 if v == float("-inf") else float("-inf"),
    # The systems' interleaved sinusoid (stored or computed) read as the split one.
    "position": lambda v: "sinusoid-split",
}


def flipped(result, field):
    config = result.config.replace(**{field: FLIPS[field](getattr(result.config, field))})
    params = result.params
    if field == "position":
        params = {k: v for k, v in params.items() if not k.endswith("position.table")}
    return config, params


@pytest.mark.parametrize("name", SYSTEMS)
def test_a_wrong_switch_is_caught(name):
    src, tgt = batch(name, fully_masked=FULLY_MASKED[name])
    reference = source_logits(name, src, tgt)
    result = converted(name)
    for field in FLIPS:
        if field == "mask_fill" and not FULLY_MASKED[name]:
            continue  # no fully masked row to show it (see the xfail above)
        ours = run_backend("numpy", *flipped(result, field), src, tgt)
        assert not matches_source(ours, reference), f"{name}: {field} flipped went unnoticed"


# -- float64: what float32 rounding hides (see FLOAT64_BAR) ----------------------------------------


def float32_sinusoid(name: str, model) -> tuple | None:
    """The (encoder, decoder) position tables of a system that keeps its sinusoid in float32
    whatever `.double()` does: hyunwoongko's is a plain tensor attribute (not a buffer), built
    with `.float()`. Ours is float64; they differ by ~7e-8 in the logits, which would sit between
    rounding and a wrong epsilon, so the float64 comparison hands our model that very table."""
    if name != "hyunwoongko":
        return None
    tables = (model.encoder.emb.pos_emb.encoding, model.decoder.emb.pos_emb.encoding)
    assert all(t.dtype == torch.float32 for t in tables), "hyunwoongko's sinusoid is float32 even in .double()"
    return tables


@functools.cache
def converted64(name: str):
    """(source in float64, config, params in float64)."""
    _, extra = SYSTEMS[name]
    model = copy.deepcopy(source(name)).double()
    result = convert_arrays(as_arrays(model.state_dict()), name, n_heads=SIZES["n_heads"], **extra)
    config, params = result.config, dict(result.params)
    assert all(v.dtype == np.float64 for v in params.values())
    tables = float32_sinusoid(name, model)
    if tables is not None:
        config = config.replace(position="table")
        params["encoder.position.table"], params["decoder.position.table"] = (t.double().numpy() for t in tables)
    return model, config, params


def float64_logits(name: str):
    module, _ = SYSTEMS[name]
    model, config, params = converted64(name)
    src, tgt = batch(name, fully_masked=FULLY_MASKED[name])
    with torch.no_grad():
        reference = module.logits(model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    assert reference.dtype == np.float64
    return reference, config, params, src, tgt


@pytest.mark.parametrize("name", SYSTEMS)
def test_float64_logits_match_the_source(name):
    reference, config, params, src, tgt = float64_logits(name)
    ours = run_backend("numpy", config, params, src, tgt, dtype="float64")
    assert_matches_source(ours, reference, f"{name} in float64", bar=FLOAT64_BAR)


@pytest.mark.parametrize("name", SYSTEMS)
def test_a_wrong_epsilon_is_caught_in_float64(name):
    reference, config, params, src, tgt = float64_logits(name)
    for eps in WRONG_EPSILONS:
        if eps != config.layer_norm_eps:
            ours = run_backend("numpy", config.replace(layer_norm_eps=eps), params, src, tgt, dtype="float64")
            assert not matches_source(ours, reference, FLOAT64_BAR), f"{name}: layer_norm_eps={eps:g} went unnoticed"


@pytest.mark.parametrize("name", SYSTEMS)
def test_exported_weights_go_home(name):
    """Our parameters, exported into a system's layout, load with `load_state_dict(strict=True)`
    and make that system compute our logits (so a model trained here can go back to its code)."""
    module, _ = SYSTEMS[name]
    layout = load_layout(name)
    config = preset(name, src_vocab_size=SIZES["src_vocab"], tgt_vocab_size=SIZES["tgt_vocab"], d_model=SIZES["d_model"],
                    n_heads=SIZES["n_heads"], d_ff=SIZES["d_ff"], n_encoder_layers=SIZES["n_layers"],
                    n_decoder_layers=SIZES["n_layers"], max_len=SIZES["max_len"], pad_id=module.PAD,
                    # A system that stores its table uses whatever it loads: send a random one.
                    position="table" if layout.stores_positions() else preset(name).position)
    params = init_params(config, seed=11, dtype=np.float32)
    if any(entry.kind == "copy" for entry in layout.entries):
        params["decoder.position.table"] = params["encoder.position.table"].copy()  # one buffer serves both
    state = export_state_dict(config, params, name)
    home = module.make(**SIZES)
    home.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    src, tgt = batch(name)
    with torch.no_grad():
        reference = module.logits(home, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    assert_matches_source(run_backend("numpy", config, params, src, tgt), reference, f"{name} loaded with our weights")


# -- from_torch_nn_transformer: a user's own wrapper, switches read from the modules -------------


# Every backend on pre-LN; post-LN nn.Transformer already runs on every backend above (the
# torch-nn-transformer system), so JAX, which compiles per config, is spared a second compile.


@pytest.mark.parametrize("norm_first, backend", [
    pytest.param(norm_first, backend.values[0], marks=backend.marks, id=f"{'pre' if norm_first else 'post'}-LN-{backend.values[0]}")
    for norm_first in (False, True) for backend in BACKEND_PARAMS if norm_first or backend.values[0] != "jax"
])
def test_from_torch_nn_transformer(norm_first, backend):
    """Both norm placements, and both batch layouts: batch_first changes how the user's code
    feeds the model (and which PyTorch kernels run), not the weights or the logits."""
    src, tgt = padded_batch(torch_tutorial.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    converted_models = []
    for batch_first in (False, True):
        model = randomize_(torch_tutorial.make(**SIZES, norm_first=norm_first, batch_first=batch_first), seed=5)
        config, params = from_torch_nn_transformer(model.transformer, model.src_tok_emb, model.tgt_tok_emb, model.generator,
                                                   pad_id=torch_tutorial.PAD)
        assert config.norm_placement == ("pre" if norm_first else "post")
        assert config.notes["batch_first"] == str(batch_first)
        # No position module is passed: the tutorial's sinusoid is computed (float64 here, float32
        # in the tutorial's buffer), which still agrees far inside the bar at these lengths.
        assert config.position == "sinusoid-interleaved" and config.max_len == 5000
        with torch.no_grad():
            reference = torch_tutorial.logits(model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
        converted_models.append((config, params, reference))
    (config, params, seq_first), (config_bf, params_bf, batch_first_reference) = converted_models
    assert config == config_bf and all(params[k].tobytes() == params_bf[k].tobytes() for k in params)
    ours = run_backend(backend, config, params, src, tgt)
    assert_matches_source(ours, seq_first, f"nn.Transformer (sequence-first) on {backend}")
    assert_matches_source(ours, batch_first_reference, f"nn.Transformer (batch-first) on {backend}")


def test_from_torch_nn_transformer_reads_activation_and_epsilon():
    model = randomize_(torch_tutorial.make(**SIZES, activation="gelu", layer_norm_eps=1e-3, norm_first=True), seed=6)
    config, params = from_torch_nn_transformer(model.transformer, model.src_tok_emb, model.tgt_tok_emb, model.generator,
                                                   pad_id=torch_tutorial.PAD)
    assert (config.activation, config.layer_norm_eps, config.n_heads) == ("gelu", 1e-3, SIZES["n_heads"])
    src, tgt = padded_batch(torch_tutorial.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    with torch.no_grad():
        reference = torch_tutorial.logits(model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    assert_matches_source(run_backend("numpy", config, params, src, tgt), reference, "gelu, eps 1e-3")


def test_from_torch_nn_transformer_defaults_are_overridable_but_module_facts_are_not():
    model = randomize_(torch_tutorial.make(**SIZES, norm_first=True), seed=7)
    parts = (model.transformer, model.src_tok_emb, model.tgt_tok_emb, model.generator)
    config, _ = from_torch_nn_transformer(*parts, pad_id=0, scale_embedding=False, max_len=64)
    assert (config.pad_id, config.scale_embedding, config.max_len) == (0, False, 64)
    with pytest.raises(ConfigError, match="norm_placement.*contradicts the model") as info:
        from_torch_nn_transformer(*parts, norm_placement="post")
    assert info.value.field == "norm_placement"
    with pytest.raises(ConfigError, match="n_heads"):
        from_torch_nn_transformer(*parts, n_heads=8)
    with pytest.raises(TypeError, match="torch.nn.Transformer"):
        from_torch_nn_transformer(model, *parts[1:])


def test_from_torch_nn_transformer_takes_plain_embeddings_and_a_bias_free_generator():
    transformer = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=24)
    src_emb, tgt_emb = torch.nn.Embedding(11, 16), torch.nn.Embedding(13, 16)
    generator = torch.nn.Linear(16, 13, bias=False)
    config, params = from_torch_nn_transformer(transformer.eval(), src_emb, tgt_emb, generator, pad_id=0)
    assert not config.output_bias and "output.bias" not in params
    assert (config.src_vocab_size, config.tgt_vocab_size) == (11, 13)
    np.testing.assert_array_equal(params["output.weight"], generator.weight.detach().numpy().T)
    np.testing.assert_array_equal(params["encoder.embedding.weight"], src_emb.weight.detach().numpy())
    # The result is a copy: writing to it never reaches the user's modules (or the other way).
    before = generator.weight.detach().clone()
    params["output.weight"] += 1.0
    assert torch.equal(generator.weight.detach(), before)


def test_from_torch_nn_transformer_reads_what_the_layout_requires():
    """The torch-nn-transformer layout requires norm_placement (a state dict cannot tell it); the
    module import reads it from norm_first, and without layers it places no norm at all."""
    empty = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=0, num_decoder_layers=0, dim_feedforward=24)
    config, _ = from_torch_nn_transformer(empty.eval(), torch.nn.Embedding(5, 16), torch.nn.Embedding(5, 16),
                                          torch.nn.Linear(16, 5), pad_id=0)
    assert config.n_encoder_layers == config.n_decoder_layers == 0 and config.norm_placement == "post"
    assert config.notes["layout_defaults"] == "activation=relu"


def test_from_torch_nn_transformer_refuses_what_modelconfig_cannot_express():
    transformer = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=24,
                                       bias=False)
    with pytest.raises(TensorError, match="LayerNorm without weight and bias") as info:
        from_torch_nn_transformer(transformer, torch.nn.Embedding(5, 16), torch.nn.Embedding(5, 16), torch.nn.Linear(16, 5))
    assert info.value.key == "transformer.encoder.layers.0.norm1.bias"
    custom = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=24,
                                  activation=torch.nn.Tanh())
    with pytest.raises(ConfigError, match="Tanh") as info:
        from_torch_nn_transformer(custom, torch.nn.Embedding(5, 16), torch.nn.Embedding(5, 16), torch.nn.Linear(16, 5))
    assert info.value.field == "activation"
