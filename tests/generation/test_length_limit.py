"""Issue 45 (a fourth newcomer walk), `rosetta generate`'s part: the toy model's trained range is
stated and a source outside it warned about (item 4); a NaN from an overflow names the first
non-finite tensor, not --src and a -inf fill the config does not have (item 10); a converted
Hugging Face model without a max_length stops where transformers does, and a row cut off by the
length limit is shown as such (item 14); a tiny torch model runs on one intra-op thread unless the
user chose a count (item 16)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.check import backends, toy
from conformance.cli import main
from conformance.cli import generate
from conformance.core import checkpoint


def runnable(backend: str) -> bool:
    return not backends.availability([backend])[backend]


# -- item 4: the toy model's range ---------------------------------------------------------------


@pytest.mark.parametrize("src, digits", [("7", 1), ("3 1", 2), ("3 1 4 1 5 9 2 6 5 3 5 8 9", 13)])
def test_a_toy_source_outside_the_trained_range_is_warned_about(src, digits, capsys):
    assert main(["generate", "--src", src, "--backend", "numpy"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning:" in line]
    assert len(warning) == 1, err
    assert f"trained on sources of {toy.MIN_DIGITS} to {toy.MAX_DIGITS} digits" in warning[0], warning[0]
    assert f"{digits} digit" in warning[0], warning[0]


@pytest.mark.parametrize("src", ["3 1 4", "3 1 4 1 5 9 2 6 5 3 5 8"])
def test_a_toy_source_in_the_trained_range_gets_no_warning(src, capsys):
    assert main(["generate", "--src", src, "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err, captured.err
    assert captured.out.split() == src.split()[::-1]


def test_the_toy_range_is_stated_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert f"{toy.MIN_DIGITS}-{toy.MAX_DIGITS} digits" in " ".join(capsys.readouterr().out.split())


def test_the_range_warning_reads_ids_rows_too():
    """The toy model's ids form ("6,4,7"), one row at a time, padding not counted."""
    src = np.array([[6, 4, 7, 0], [6, 4, 7, 8]])
    assert toy.range_warning(src) is None
    assert "row 0 has 1 digit" in toy.range_warning(np.array([[6, 0, 0], [6, 4, 7]]))


# -- item 10: an overflow is named where it happens ----------------------------------------------

OVERFLOW_SCALE = 1e20  # a Marian embedding times this: q.k overflows float32 in the first attention


def overflowing_checkpoint(tmp_path):
    """A model with a finite mask fill whose embeddings are finite but make q.k overflow float32."""
    config = preset("hf-marian", src_vocab_size=16, tgt_vocab_size=16, d_model=16, n_heads=2, d_ff=32,
                     n_encoder_layers=1, n_decoder_layers=1, max_len=16, pad_id=15,
                     notes={"generation": json.dumps({"decoder_start_token_id": 15, "eos_token_id": 0})})
    assert np.isfinite(config.mask_fill)
    params = init_params(config, seed=0, dtype=np.float32)
    params["encoder.embedding.weight"] = params["encoder.embedding.weight"] * np.float32(OVERFLOW_SCALE)
    assert np.isfinite(params["encoder.embedding.weight"]).all()
    path = tmp_path / "overflow.safetensors"
    checkpoint.save(path, config, params)
    return path


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_an_overflow_names_the_first_non_finite_tensor(backend, tmp_path, capsys):
    if not runnable(backend):
        pytest.skip(f"{backend} is not installed")
    path = overflowing_checkpoint(tmp_path)
    assert main(["generate", str(path), "--src", "5,6,7,8", "--backend", backend]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if "error:" in line]
    assert len(error) == 1 and "Traceback" not in err, err
    # As `rosetta check` reads a report: in forward order, where the attention weights come
    # before the sublayer's output; q.k overflows in the first layer's self-attention.
    assert "first non-finite tensor is encoder.0.self (attention weights" in error[0], error[0]
    assert "encoder.embeddings, being finite" in error[0] and "overflowed float32" in error[0], error[0]
    assert "mask_fill=-inf" not in error[0] and "--src:" not in error[0], error[0]
    assert str(path) in error[0], error[0]


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


# -- item 16: threads for a tiny torch model -----------------------------------------------------


@pytest.fixture
def torch_threads():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def test_a_tiny_model_runs_on_one_thread_unless_the_user_chose(torch_threads, monkeypatch):
    from conformance.cli import threads

    torch = torch_threads
    config, _, _ = __import__("conformance.check.defaults", fromlist=["default_model"]).default_model()
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    assert threads.fit_torch_threads(config) == 1 and torch.get_num_threads() == 1
    # The user's own count (an environment variable) is left as it is.
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.fit_torch_threads(config) is None and torch.get_num_threads() == 2
    # A model past the threshold keeps torch's default.
    monkeypatch.delenv("OMP_NUM_THREADS")
    big = preset("paper", d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                 src_vocab_size=8000, tgt_vocab_size=8000)
    assert threads.parameter_count(big) > threads.SMALL_MODEL_PARAMETERS
    assert threads.fit_torch_threads(big) is None and torch.get_num_threads() == 2


def test_rosetta_generate_on_torch_uses_one_thread_for_the_toy_model(torch_threads, monkeypatch, capsys):
    from conformance.cli import threads

    torch = torch_threads
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    assert main(["generate", "--src", "3 1 4", "--backend", "torch"]) == 0
    assert capsys.readouterr().out.strip() == "4 1 3"
    assert torch.get_num_threads() == 1
