"""How long `generate` runs (issue 45, item 14): a converted Hugging Face model without a max_length
stops where transformers does (its default length, capped by max_position_embeddings), a length
recorded in the generation note wins over that default, and `rosetta generate` shows a row the
length limit cut off as such."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance import preset
from conformance.check import backends, toy
from conformance.cli import main
from conformance.cli import generate
from conformance.core import checkpoint


# -- item 14: transformers' default length, and rows the limit cut off ---------------------------


def hf_config(**generation):
    return preset("hf-marian", src_vocab_size=16, tgt_vocab_size=16, d_model=16, n_heads=2, d_ff=32,
                  n_encoder_layers=1, n_decoder_layers=1, max_len=64, pad_id=15,
                  notes={"generation": json.dumps({"decoder_start_token_id": 15, "eos_token_id": 0, **generation})})


def endless_marian(positions: int):
    """A tiny random MarianMTModel whose generation config names no max_length (transformers'
    default applies) and whose end token never wins: its final_logits_bias holds it far down, so
    both searches run to their length limit. No forced end token: the last token is the model's."""
    import copy

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_hf_marian import marian

    model = copy.deepcopy(marian(max_position_embeddings=positions, forced_eos_token_id=None))
    assert model.generation_config.max_length is None and model.generation_config.max_new_tokens is None
    with torch.no_grad():
        model.final_logits_bias[0, model.generation_config.eos_token_id] = -1e4
    return model


ENDLESS_SRC = np.array([[3, 4, 5, 6, 7]])


def transformers_ids(model) -> np.ndarray:
    """transformers' greedy ids for ENDLESS_SRC, its start token dropped (ours are returned without it)."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ENDLESS_SRC), do_sample=False, num_beams=1)
    assert (out[:, 0] == model.generation_config.decoder_start_token_id).all()
    return out[:, 1:].numpy()


# 40 positions: transformers' 20 new tokens; 12: its max_length capped at max_position_embeddings,
# which counts the start token (11 new tokens).
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default:UserWarning")
@pytest.mark.parametrize("positions, new_tokens", [(40, 20), (12, 11)])
def test_a_converted_model_without_max_length_stops_where_transformers_does(positions, new_tokens):
    from conformance.check.compare import to_numpy
    from conformance.convert import from_hf_marian

    model = endless_marian(positions)
    expected = transformers_ids(model)
    assert expected.shape == (1, new_tokens)
    config, params = from_hf_marian(model)
    assert "max_length" not in json.loads(config.notes["generation"])
    ours = to_numpy(backends.build(backends.Target("numpy", "cpu", "float32"), config, params).generate(ENDLESS_SRC))
    assert ours.shape == expected.shape and (ours == expected).all(), f"ours {ours.tolist()}\nHF   {expected.tolist()}"
    # The CLI stops there too, says why, and shows the row as cut off (no end token).
    settings = generate.decoding(config)
    assert settings["max_len"] == new_tokens


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default:UserWarning")
def test_rosetta_generate_stops_where_transformers_does(tmp_path, capsys):
    from conformance.convert import from_hf_marian

    model = endless_marian(40)
    expected = transformers_ids(model)
    path = tmp_path / "marian.safetensors"
    checkpoint.save(path, *from_hf_marian(model))
    src = ",".join(map(str, ENDLESS_SRC[0]))
    assert main(["generate", str(path), "--src", src, "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    assert [int(label) for label in captured.out.split()] == expected[0].tolist(), captured.out
    assert "up to 20 tokens" in captured.err and "20 new tokens" in captured.err, captured.err
    assert "reached the length limit of 20 tokens" in captured.err, captured.err


def test_a_recorded_length_wins_over_transformers_default():
    from conformance.core.generation.note import generation_note

    # Hugging Face's max_length counts the decoder start token; max_new_tokens does not.
    assert generation_note(hf_config(max_length=40))["max_len"] == 39
    assert generation_note(hf_config(max_new_tokens=30))["max_len"] == 30
    assert generate.decoding(hf_config(max_length=40))["max_len"] == 39
    assert generate.decoding(hf_config(), max_len=50)["max_len"] == 50
    # Without a note (the toy model, a model trained here) the limit stays the model's max_len.
    toy_config = preset("paper", notes={"task": toy.TASK})
    assert generate.decoding(toy_config)["max_len"] == toy_config.max_len
    assert "max_len" not in generation_note(toy_config)


def test_a_row_cut_off_by_the_length_limit_is_shown(capsys):
    # Two rows: one cut off at 4 tokens, one that ended (3 digits and its end token).
    assert main(["generate", "--src", "6,4,7,4,8;6,4,7,0,0", "--max-len", "4", "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["5 1 4 1", "4 1 3"], captured.out
    notes = [line for line in captured.err.splitlines() if "end token" in line]
    assert len(notes) == 1, captured.err
    assert "row 0" in notes[0] and "row 1" not in notes[0] and "4 tokens" in notes[0] and "--max-len" in notes[0]


def test_a_row_that_ended_gets_no_cut_off_note(capsys):
    assert main(["generate", "--src", "3 1 4 1 5", "--backend", "numpy"]) == 0
    assert "end token" not in capsys.readouterr().err
