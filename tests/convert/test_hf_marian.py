"""A Hugging Face MarianMTModel, built offline from a small MarianConfig, converts and agrees.

Nothing is downloaded: the model is random, built from a config. Its masks are passed the way
Hugging Face users pass them (`attention_mask`, `decoder_attention_mask` from the padding id).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="Marian is a PyTorch model")
transformers = pytest.importorskip("transformers", reason="the Marian test builds a transformers MarianMTModel")

from conformance import init_params, preset  # noqa: E402
from conformance.convert import (  # noqa: E402
    KeyMismatchError,
    TensorError,
    export_state_dict,
    from_hf_marian,
    import_state_dict,
)
from conformance.core.errors import ConfigError  # noqa: E402
from conformance.core.presets import FLOAT32_MIN  # noqa: E402
from systems import randomize_  # noqa: E402
from systems.harness import (  # noqa: E402
    BACKEND_PARAMS,
    FLOAT64_BAR,
    WRONG_EPSILONS,
    assert_matches_source,
    matches_source,
    padded_batch,
    run_backend,
)

VOCAB = 29
PAD = VOCAB - 1  # opus-mt models put <pad> last; Marian's decoder_start_token_id is the pad id


def marian_config(**changes):
    values = dict(
        vocab_size=VOCAB, decoder_vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=40, pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=0,
        forced_eos_token_id=0,
        # What released opus-mt models use (the MarianConfig defaults are gelu and no scaling).
        activation_function="swish", scale_embedding=True,
    )
    values.update(changes)
    return transformers.MarianConfig(**values)


@functools.cache
def marian(**changes):
    torch.manual_seed(0)
    model = transformers.MarianMTModel(marian_config(**changes)).eval()
    # The sinusoid tables stay as Marian computed them; final_logits_bias (a zero buffer) and the
    # LayerNorms get visible random values so that a dropped or swapped one shows.
    return randomize_(model, 3, buffers=("final_logits_bias",), skip=("embed_positions",))


def hf_logits(model, src, tgt, decoder_mask=False):
    """Marian's logits. Without `decoder_mask` the target is masked causally only, as Marian's own
    generate() and training do (and as tgt_pad_mask="none" says)."""
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src != PAD).long(),
            decoder_input_ids=torch.from_numpy(tgt),
            decoder_attention_mask=torch.from_numpy(tgt != PAD).long() if decoder_mask else None,
        ).logits.numpy()


GELU_UNSCALED = {"activation_function": "gelu", "scale_embedding": False}


# The released form on every backend; the config-default form (the same code path with two
# switches read differently) on NumPy and PyTorch, sparing JAX a compile.
@pytest.mark.parametrize("variant, backend", [
    pytest.param(variant, backend.values[0], marks=backend.marks, id=f"{label}-{backend.values[0]}")
    for variant, label in (({}, "released-swish-scaled"), (GELU_UNSCALED, "config-defaults-gelu-unscaled"))
    for backend in BACKEND_PARAMS if not variant or backend.values[0] != "jax"
])
def test_marian_logits_match(variant, backend):
    model = marian(**variant)
    config, params = from_hf_marian(model)
    assert config.activation == ("silu" if not variant else "gelu")
    assert config.scale_embedding == (not variant)
    assert (config.pad_id, config.n_heads, config.d_ff) == (PAD, 4, 48)
    # Marian's frozen table is our split sinusoid bit for bit, so it is recognised, not stored.
    assert config.position == "sinusoid-split" and config.max_len == 40 and "encoder.position.table" not in params
    assert config.share_embeddings and config.tie_output and config.final_logits_bias
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    assert_matches_source(run_backend(backend, config, params, src, tgt), hf_logits(model, src, tgt), f"Marian on {backend}")


def test_marian_in_float64_down_to_the_layer_norm_epsilon():
    """In float64 (see FLOAT64_BAR) a wrong LayerNorm epsilon shows, which float32 rounding can hide.
    Marian's sinusoid is a parameter, so `.double()` casts it and it converts as a stored table."""
    model = copy.deepcopy(marian()).double()
    config, params = from_hf_marian(model)
    assert all(v.dtype == np.float64 for v in params.values())
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    reference = hf_logits(model, src, tgt)
    assert reference.dtype == np.float64
    assert_matches_source(run_backend("numpy", config, params, src, tgt, dtype="float64"), reference, "Marian in float64",
                          bar=FLOAT64_BAR)
    for eps in WRONG_EPSILONS:
        if eps != config.layer_norm_eps:
            ours = run_backend("numpy", config.replace(layer_norm_eps=eps), params, src, tgt, dtype="float64")
            assert not matches_source(ours, reference, FLOAT64_BAR), f"layer_norm_eps={eps:g} went unnoticed"


def test_marian_fully_masked_rows_match_eager_attention():
    """Marian's eager attention adds finfo.min: a fully masked row is a uniform average, as ours."""
    model = marian(attn_implementation="eager")
    config, params = from_hf_marian(model)
    assert config.mask_fill == FLOAT32_MIN
    src, tgt = padded_batch(PAD, VOCAB, VOCAB, fully_masked=True)
    reference = hf_logits(model, src, tgt)
    assert not np.isnan(reference).any()
    assert_matches_source(run_backend("numpy", config, params, src, tgt), reference, "Marian (eager), fully masked rows")


def test_marian_sdpa_attention_differs_only_on_an_all_padding_source():
    """A default MarianMTModel runs SDPA attention, which gives a query whose every key is masked
    something else than eager attention's uniform average (docs/porting.md, Known limits): only
    the all-padding source row differs, by far more than rounding."""
    model = marian()
    assert model.config._attn_implementation == "sdpa"
    config, params = from_hf_marian(model)
    src, tgt = padded_batch(PAD, VOCAB, VOCAB, fully_masked=True)
    empty = (src == PAD).all(axis=1)
    assert empty.tolist() == [False, False, False, False, True, False]
    reference, ours = hf_logits(model, src, tgt), run_backend("numpy", config, params, src, tgt)
    assert_matches_source(ours[~empty], reference[~empty], "Marian (SDPA), rows with a real source token")
    assert not matches_source(ours[empty], reference[empty])


def test_marian_decoder_start_token_is_the_pad_id():
    """Marian starts every decoder input with its pad id (decoder_start_token_id) and masks the
    target causally only: tgt_pad_mask="none", or the start token would be hidden from every query."""
    model = marian()
    config, params = from_hf_marian(model)
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    tgt = np.concatenate([np.full((len(tgt), 1), PAD), tgt[:, :-1]], axis=1)  # shifted right behind the start token
    reference = hf_logits(model, src, tgt)
    valid = (tgt != PAD) | (np.arange(tgt.shape[1]) == 0)  # positions that predict a real next token
    ours = run_backend("numpy", config, params, src, tgt)
    assert_matches_source(ours[valid], reference[valid], "Marian with its decoder start token")


def test_marian_with_a_decoder_attention_mask_is_target_padding_on_the_keys():
    """A caller who passes `decoder_attention_mask = tgt != pad` masks padding on the keys, the start
    token included: `tgt_pad_mask="keys"` says the same, down to the start token's fully masked
    row (eager attention: a uniform average, as with our finite fill)."""
    model = marian(attn_implementation="eager")
    config, params = from_hf_marian(model, tgt_pad_mask="keys")
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    tgt = np.concatenate([np.full((len(tgt), 1), PAD), tgt[:, :-1]], axis=1)
    reference = hf_logits(model, src, tgt, decoder_mask=True)
    assert_matches_source(run_backend("numpy", config, params, src, tgt), reference, "Marian with decoder_attention_mask")


def test_save_pretrained_state_dict_needs_the_sizes_it_lacks():
    """`save_pretrained` drops the tied duplicates and the sinusoid buffers: still hf-marian."""
    model = marian()
    state = {k: v for k, v in model.state_dict().items()
             if k not in ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
             and "embed_positions" not in k}
    with pytest.raises(ConfigError) as info:
        import_state_dict(state, None, n_heads=4, pad_id=PAD)
    assert info.value.field == "max_len"
    with pytest.raises(ConfigError) as info:
        import_state_dict(state, None, n_heads=4, max_len=40)
    assert info.value.field == "pad_id" and "hf-marian" in str(info.value)
    config, params = import_state_dict(state, None, n_heads=4, max_len=40, pad_id=PAD)
    reference, expected_params = from_hf_marian(model)
    assert config == reference
    assert all(params[k].tobytes() == expected_params[k].tobytes() for k in expected_params)


def test_a_tied_duplicate_must_be_identical():
    state = dict(marian().state_dict())
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][0, 0] += 1
    with pytest.raises(TensorError, match="lm_head.weight.*tied") as info:
        import_state_dict(state, "hf-marian", n_heads=4, pad_id=PAD)
    assert info.value.key == "lm_head.weight"


def test_only_a_tied_duplicate_stands_in_for_the_shared_embedding():
    state = dict(marian().state_dict())
    shared = state.pop("model.shared.weight")
    config, params = import_state_dict(state, None, n_heads=4, pad_id=PAD)
    np.testing.assert_array_equal(params["encoder.embedding.weight"], shared.numpy())


def test_untied_or_unshared_marian_models_are_refused_clearly():
    with pytest.raises(ConfigError) as info:
        from_hf_marian(transformers.MarianMTModel(marian_config(share_encoder_decoder_embeddings=False)))
    assert info.value.field == "share_embeddings"
    with pytest.raises(ConfigError) as info:
        from_hf_marian(transformers.MarianMTModel(marian_config(encoder_attention_heads=2)))
    assert info.value.field == "n_heads"


def test_a_missing_marian_layer_is_named_as_a_layer():
    state = {k: v for k, v in marian().state_dict().items() if not k.startswith("model.decoder.layers.0.")}
    with pytest.raises(KeyMismatchError, match="every key of decoder layer 0") as info:
        import_state_dict(state, "hf-marian", n_heads=4, pad_id=PAD)
    assert all(k.startswith("model.decoder.layers.0.") for k in info.value.missing)


def test_exported_weights_load_into_marian_and_agree():
    config = preset("hf-marian", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48,
                    n_encoder_layers=2, n_decoder_layers=2, max_len=40, pad_id=PAD)
    params = init_params(config, seed=12, dtype=np.float32)
    state = export_state_dict(config, params, "hf-marian")
    home = transformers.MarianMTModel(marian_config()).eval()
    home.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    assert_matches_source(run_backend("numpy", config, params, src, tgt), hf_logits(home, src, tgt), "Marian with our weights")


@pytest.mark.parametrize("position", ["sinusoid-interleaved", "table"])
def test_export_to_marian_refuses_a_position_term_marian_would_replace(position):
    """Marian rebuilds its split sinusoid when a model is loaded (`from_pretrained`; the tables are
    not even saved), so exported weights with another position term would change silently."""
    config = preset("hf-marian", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=40, pad_id=PAD, position=position)
    params = init_params(config, seed=12, dtype=np.float32)
    with pytest.raises(ConfigError, match="recomputes its position tables as position='sinusoid-split'") as info:
        export_state_dict(config, params, "hf-marian")
    assert info.value.field == "position"


def test_a_save_pretrained_directory_converts_from_the_command_line(tmp_path, capsys):
    from conformance.core import checkpoint
    from conformance.cli import main

    model = marian()
    model.save_pretrained(tmp_path / "opus-mt-tiny")  # model.safetensors without duplicates or tables
    source = tmp_path / "opus-mt-tiny" / "model.safetensors"
    before = source.read_bytes()
    status = main(["convert", str(source), str(tmp_path / "rosetta.safetensors"),
                   "--set", "n_heads=4", "--set", f"pad_id={PAD}", "--set", "max_len=40"])
    assert status == 0, capsys.readouterr().err
    # The file's folder has save_pretrained's config.json beside it: its switches are read (the
    # --set values agree with it), not the layout's defaults.
    assert "switches read from" in capsys.readouterr().out
    config, params = checkpoint.load(tmp_path / "rosetta.safetensors")
    expected_config, expected = from_hf_marian(model)
    assert config.replace(notes={}) == expected_config.replace(notes={}) and all(params[k].tobytes() == expected[k].tobytes() for k in expected)
    assert source.read_bytes() == before
