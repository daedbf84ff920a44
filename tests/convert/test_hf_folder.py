"""Hugging Face model folders as published convert with no --set: config.json gives every switch.

A small random MarianMTModel (GELU, not the hf-marian layout's default SiLU, and a scaled
embedding) is written by `save_pretrained` (one safetensors file, then shards with their index,
then a plain `pytorch_model.bin`); `rosetta convert FOLDER out.safetensors` reads it without
importing transformers, and the converted model's logits match transformers' on padded batches.
generation_config.json lands in the checkpoint's notes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="Marian is a PyTorch model")
transformers = pytest.importorskip("transformers", reason="the folder is written by transformers' save_pretrained")

from conformance.cli import main  # noqa: E402
from conformance.convert import from_hf_folder, read_state_dict  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import CheckpointError, ConfigError  # noqa: E402
from systems import randomize_  # noqa: E402
from systems.harness import assert_matches_source, padded_batch, run_backend  # noqa: E402

VOCAB = 29
PAD = VOCAB - 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=VOCAB, decoder_vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=40, pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=0,
        forced_eos_token_id=0, activation_function="gelu", scale_embedding=True,
    )
    model = transformers.MarianMTModel(config).eval()
    model.generation_config.num_beams = 3
    model.generation_config.max_length = 21
    model.generation_config.length_penalty = 0.7
    model.generation_config.bad_words_ids = [[PAD]]
    return randomize_(model, 3, buffers=("final_logits_bias",), skip=("embed_positions",))


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("hf") / "opus-mt-random"
    model.save_pretrained(path)
    return path


def hf_logits(model, src, tgt):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src != PAD).long(),
                     decoder_input_ids=torch.from_numpy(tgt)).logits.numpy()


def test_a_saved_folder_converts_with_no_set_and_matches_transformers(tmp_path, capsys, folder, model):
    assert (folder / "model.safetensors").is_file() and (folder / "generation_config.json").is_file()
    out = tmp_path / "marian.safetensors"
    assert main(["convert", str(folder), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layout_defaults" not in printed and "the layout's default" not in printed  # nothing assumed
    config, params = checkpoint.load(out)
    assert (config.activation, config.scale_embedding, config.pad_id, config.n_heads, config.max_len) == ("gelu", True, PAD, 4, 40)
    generation = json.loads(config.notes["generation"])
    assert generation == {"decoder_start_token_id": PAD, "eos_token_id": 0, "pad_token_id": PAD, "forced_eos_token_id": 0,
                          "num_beams": 3, "max_length": 21, "length_penalty": 0.7, "bad_words_ids": [[PAD]],
                          **({"bos_token_id": generation["bos_token_id"]} if "bos_token_id" in generation else {})}
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    reference = hf_logits(model, src, tgt)
    for backend in ("numpy", "torch"):
        result = assert_matches_source(run_backend(backend, config, params, src, tgt), reference, f"Marian folder on {backend}")
        print(f"Marian folder (gelu, scaled) {backend} float32: {result.describe()}")


def test_a_weights_file_of_a_folder_converts_with_the_config_beside_it(tmp_path, capsys, folder):
    """`rosetta convert folder/model.safetensors`: the file alone cannot tell GELU from the layout's
    default SiLU, nor the embedding scale, so the config.json beside it is read as the folder's
    would be; a --set that contradicts it is refused naming both, and the "not a rosetta
    checkpoint" hint names the folder, not the file."""
    whole, single = tmp_path / "folder.safetensors", tmp_path / "file.safetensors"
    assert main(["convert", str(folder), str(whole)]) == 0
    assert main(["convert", str(folder / "model.safetensors"), str(single)]) == 0
    printed = capsys.readouterr().out
    assert "config.json, beside model.safetensors" in printed and "the layout's default" not in printed, printed
    (config, params), (want, expected) = checkpoint.load(single), checkpoint.load(whole)
    assert (config.activation, config.scale_embedding) == ("gelu", True)
    assert config.replace(notes={}) == want.replace(notes={}) and all(np.array_equal(params[k], expected[k]) for k in params)
    bad = tmp_path / "bad.safetensors"
    assert main(["convert", str(folder / "model.safetensors"), str(bad), "--set", "activation=silu"]) == 2
    err = capsys.readouterr().err
    assert "activation" in err and "config.json has activation='gelu'" in err and not bad.exists(), err
    assert main(["convert", str(folder / "model.safetensors"), str(bad), "--layout", "annotated-transformer"]) == 2
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"rosetta convert {folder} "):
        checkpoint.load(folder / "model.safetensors")


def test_sharded_and_bin_folders_give_the_same_parameters(tmp_path, folder, model):
    expected_config, expected = from_hf_folder(folder)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(folder / "config.json", binary / "config.json")
    torch.save(model.state_dict(), binary / "pytorch_model.bin")
    for other in (sharded, binary):
        config, params = from_hf_folder(other)
        assert config == expected_config and sorted(params) == sorted(expected)
        for key in expected:
            assert np.array_equal(params[key], expected[key]), (other.name, key)
    assert sorted(read_state_dict(sharded)) == sorted(read_state_dict(folder))


@pytest.mark.parametrize("field, value", [
    ("share_encoder_decoder_embeddings", False), ("normalize_before", True), ("decoder_vocab_size", VOCAB + 1),
    ("activation_function", "mish"),
])
def test_what_hf_marian_cannot_express_is_named(tmp_path, folder, field, value):
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    data = json.loads((copy / "config.json").read_text())
    data[field] = value
    (copy / "config.json").write_text(json.dumps(data))
    name = {"activation_function": "activation", "share_encoder_decoder_embeddings": "share_encoder_decoder_embeddings"}.get(field, field)
    with pytest.raises(ConfigError, match=name):
        from_hf_folder(copy)


def test_a_marian_folder_labelled_bart_is_refused_on_its_config_file(tmp_path, folder):
    copy = tmp_path / "labelled"
    shutil.copytree(folder, copy)
    data = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**data, "model_type": "bart"}))
    with pytest.raises(CheckpointError, match="says model_type 'bart'") as info:
        from_hf_folder(copy)
    assert info.value.path == str(copy / "config.json")


def test_a_folder_without_weights_or_with_broken_json_names_the_file(tmp_path, folder):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(folder / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="holds no weights"):
        from_hf_folder(empty)
    (empty / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json.*JSON"):
        from_hf_folder(empty)


def test_a_flax_marian_folder_reads_as_the_same_model(tmp_path, folder, model):
    """transformers 5 has no Flax models, so this folder's flax_model.msgpack is written here by
    the naming rule transformers <= 4.x used (kernel = weight transposed, scale / embedding =
    weight; tied lm_head and the sinusoid tables not saved): it checks our reading of that rule
    and the plumbing, not a file written by transformers itself."""
    from flax import serialization, traverse_util

    expected_config, expected = from_hf_folder(folder)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()
             if k not in ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
             and "embed_positions" not in k}
    flax_flat = {}
    for key, value in state.items():
        stem, _, leaf = key.rpartition(".")
        if key == "model.shared.weight":
            flax_flat["model.shared.embedding"] = value
        elif leaf == "weight" and value.ndim == 2:
            flax_flat[f"{stem}.kernel"] = value.T
        elif leaf == "weight":
            flax_flat[f"{stem}.scale"] = value
        else:
            flax_flat[key] = value
    flax_folder = tmp_path / "flax"
    flax_folder.mkdir()
    shutil.copy(folder / "config.json", flax_folder / "config.json")
    (flax_folder / "flax_model.msgpack").write_bytes(
        serialization.msgpack_serialize(traverse_util.unflatten_dict(flax_flat, sep=".")))
    config, params = from_hf_folder(flax_folder)
    assert config == expected_config and sorted(params) == sorted(expected)
    for key in expected:
        assert np.array_equal(params[key], expected[key]), key


def test_inspect_reads_a_folder(capsys, folder):
    assert main(["inspect", str(folder)]) == 0
    assert "keys match the built-in layout: hf-marian" in capsys.readouterr().out


def test_rosetta_generate_decodes_a_folder_as_its_generation_config_says(tmp_path, capsys, folder, model):
    """No decoding flag at all: the start, end and banned ids, the beam count, the length penalty,
    the maximum length and forced EOS all come from the folder's generation_config.json, and the
    ids are those of transformers' `generate` with the same defaults."""
    out = tmp_path / "marian.safetensors"
    assert main(["convert", str(folder), str(out)]) == 0
    capsys.readouterr()
    src = np.array([[5, 6, 7, 8, 9, 10]])
    assert main(["generate", str(out), "--src", ",".join(map(str, src[0])), "--backend", "numpy"]) == 0
    printed = [int(token) for token in capsys.readouterr().out.split()]
    with torch.no_grad():
        expected = model.generate(input_ids=torch.from_numpy(src), attention_mask=torch.ones_like(torch.from_numpy(src)))
    assert model.generation_config.num_beams == 3 and model.generation_config.length_penalty == 0.7
    row = expected[0, 1:].numpy()  # after the decoder start token
    ended = np.flatnonzero(row == 0)  # eos_token_id = 0: the CLI prints each row up to its end
    assert printed == row[: ended[0] if ended.size else len(row)].tolist()


def test_export_to_hf_marian_writes_a_folder_transformers_loads(tmp_path, capsys, folder, model, monkeypatch):
    """`rosetta convert ckpt.safetensors OUT --to hf-marian` with no suffix: a model folder, not an
    Orbax directory. `MarianMTModel.from_pretrained` (offline) loads it with no missing or unexpected
    weight, and gives the source model's logits on a padded batch and its generation settings; the
    files are world-readable like checkpoints, and a second export to the same folder is refused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours, out = tmp_path / "marian.safetensors", tmp_path / "marian-copy"
    assert main(["convert", str(folder), str(ours)]) == 0
    assert main(["convert", str(ours), str(out), "--to", "hf-marian"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir())
    loaded, info = transformers.MarianMTModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert not [k for k in info["unexpected_keys"] if "embed_positions" not in k], info
    loaded = loaded.eval()
    src, tgt = padded_batch(PAD, VOCAB, VOCAB)
    np.testing.assert_allclose(hf_logits(loaded, src, tgt), hf_logits(model, src, tgt), rtol=0, atol=1e-5)
    for name in ("num_beams", "max_length", "length_penalty", "decoder_start_token_id", "eos_token_id", "bad_words_ids"):
        assert getattr(loaded.generation_config, name) == getattr(model.generation_config, name), name
    assert (loaded.config.activation_function, loaded.config.scale_embedding) == ("gelu", True)
    capsys.readouterr()
    assert main(["convert", str(ours), str(out), "--to", "hf-marian"]) == 2
    assert "exists" in capsys.readouterr().err


def test_rosetta_attention_draws_a_folder_with_no_tgt(tmp_path, capsys, folder, monkeypatch):
    """`rosetta attention` with no --tgt on a checkpoint that records its generation settings: the
    decoder input is the recorded start id followed by what `rosetta generate` prints for it."""
    from conformance.check import plots

    out = tmp_path / "marian.safetensors"
    assert main(["convert", str(folder), str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--src", "5,6,7,8"]) == 0
    generated = capsys.readouterr().out.split()
    drawn = {}
    monkeypatch.setattr(plots, "plot_attention", lambda attention, src, tgt, *a, **k: drawn.update(tgt=tgt) or (1, 1))
    assert main(["attention", str(out), "--src", "5,6,7,8", "--out", str(tmp_path / "a.png")]) == 0
    assert drawn["tgt"] == [str(PAD), *generated], (drawn, generated)
    bare = tmp_path / "bare.safetensors"
    config, params = checkpoint.load(out)
    checkpoint.save(bare, config.replace(notes={}), params)
    assert main(["attention", str(bare), "--src", "5,6,7,8", "--out", str(tmp_path / "b.png")]) == 2
    assert "--tgt: is required for a checkpoint that records no special ids" in capsys.readouterr().err


def test_config_json_generation_fields_apply_only_without_a_generation_config(tmp_path, folder):
    """transformers' `from_pretrained` reads generation_config.json when the folder has one and
    then ignores config.json's generation fields (`max_length`, `num_beams`, ...); only a folder
    without it takes them from config.json. The converted note says what transformers applies."""
    from conformance.core.generation.note import HF_DEFAULT_NEW_TOKENS, generation_note

    both = tmp_path / "both"
    shutil.copytree(folder, both)
    hf = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({**hf, "max_length": 7, "num_beams": 2, "length_penalty": 0.5}))
    (both / "generation_config.json").write_text(json.dumps(
        {"decoder_start_token_id": PAD, "eos_token_id": 0, "pad_token_id": PAD}))
    config_only = tmp_path / "config-only"
    shutil.copytree(both, config_only)
    (config_only / "generation_config.json").unlink()

    loaded = transformers.GenerationConfig.from_pretrained(both)
    assert (loaded.max_length, loaded.num_beams, loaded.length_penalty) == (None, None, None)
    config, _ = from_hf_folder(both)
    note = generation_note(config)
    assert note["max_len"] == HF_DEFAULT_NEW_TOKENS and "num_beams" not in note and "length_penalty" not in note
    assert (note["bos_id"], note["eos_id"]) == (PAD, 0)

    loaded = transformers.MarianMTModel.from_pretrained(config_only).generation_config
    assert (loaded.max_length, loaded.num_beams, loaded.length_penalty) == (7, 2, 0.5)
    note = generation_note(from_hf_folder(config_only)[0])
    assert (note["max_len"], note["num_beams"], note["length_penalty"]) == (6, 2, 0.5)
