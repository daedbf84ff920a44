"""`rosetta compare FACTORY FOLDER --layout hf-*`: a folder written by `save_pretrained` loads into
the user's factory as `from_pretrained` would load it.

`save_pretrained` keeps a tied tensor once (BART: `model.shared.weight`, not `lm_head.weight` or
either stack's `embed_tokens.weight`; T5: `shared.weight`); the factory's model has every copy.
The copies are filled from the layout's ties (`same_as`), and what is really missing is still named.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the models are PyTorch models")
transformers = pytest.importorskip("transformers", reason="the models are built by transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from conformance.cli import main  # noqa: E402
from systems import randomize_  # noqa: E402

FACTORIES = {
    "hf-bart": ("transformers.BartForConditionalGeneration(transformers.BartConfig(vocab_size=40, d_model=16, "
                "encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, "
                "encoder_layers=2, decoder_layers=2, max_position_embeddings=32))"),
    "hf-t5": ("transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, "
              "num_heads=2, d_ff=32, num_layers=2, relative_attention_num_buckets=8, decoder_start_token_id=0))"),
}
TIED = {"hf-bart": ["lm_head.weight", "model.decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight"],
        "hf-t5": ["decoder.embed_tokens.weight", "encoder.embed_tokens.weight", "lm_head.weight"]}


def saved(layout: str, tmp_path):
    """(the factory file, a save_pretrained folder of a perturbed model of the same class)."""
    factory = tmp_path / "hfbuild.py"
    factory.write_text(f"import transformers\n\n\ndef build():\n    return {FACTORIES[layout]}.eval()\n")
    namespace = {"transformers": transformers}
    torch.manual_seed(0)
    model = randomize_(eval(FACTORIES[layout], namespace), 2)
    model.save_pretrained(tmp_path / "model")
    return factory, tmp_path / "model"


@pytest.mark.parametrize("layout", list(FACTORIES))
def test_a_saved_folder_loads_with_its_tied_copies_filled(layout, tmp_path, capsys):
    factory, folder = saved(layout, tmp_path)
    stored = set(load_file(folder / "model.safetensors"))
    assert not stored & set(TIED[layout]), "save_pretrained kept a tied copy: the test no longer shows the gap"
    status = main(["compare", f"{factory}:build", str(folder), "--layout", layout, "--backends", "none"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert f"{', '.join(TIED[layout])} filled from the tensor" in out.out
    assert "result: ok" in out.out


def test_a_tensor_no_tie_fills_is_still_missing(tmp_path, capsys):
    factory, folder = saved("hf-bart", tmp_path)
    state = load_file(folder / "model.safetensors")
    del state["model.shared.weight"], state["model.encoder.layers.0.fc1.bias"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    status = main(["compare", f"{factory}:build", str(folder), "--layout", "hf-bart", "--backends", "none"])
    err = capsys.readouterr().err
    assert status == 2
    assert "5 missing (lm_head.weight, model.decoder.embed_tokens.weight, model.encoder.embed_tokens.weight" in err
