"""`rosetta generate --beams N --length-penalty A` on every backend, special ids read from the
checkpoint's "generation" note (a Marian port records its own), and the built-in toy model
decoded with beam 4."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.check import backends, toy
from conformance.check.backends import Target
from conformance.check.compare import to_numpy
from conformance.check.defaults import default_model
from conformance.cli import main
from conformance.cli.generate import recorded_generation
from conformance.core import checkpoint

UNSEEN_SEED = 31415  # as tests/check/test_toy_model.py: sources neither training nor early stopping saw


def runnable(backend: str) -> bool:
    return not backends.availability([backend])[backend]


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_rosetta_generate_with_beams_prints_the_reversal(backend, capsys):
    if not runnable(backend):
        pytest.skip(f"{backend} is not installed")
    assert main(["generate", "--src", "3 1 4 1 5", "--beams", "4", "--length-penalty", "0.6", "--backend", backend]) == 0
    assert capsys.readouterr().out.strip() == "5 1 4 1 3"


def test_toy_model_decodes_with_beam_4_at_95_percent_exact_match():
    config, params, _ = default_model()
    src = toy.held_out(seed=UNSEEN_SEED)
    for backend in ("numpy", "torch"):
        if not runnable(backend):
            continue
        model = backends.build(Target(backend, "cpu", "float32"), config, params)
        out = to_numpy(model.generate(src, max_len=config.max_len, bos_id=toy.BOS, eos_id=toy.EOS, num_beams=4))
        accuracy = toy.exact_match(out, src)
        assert accuracy >= 0.95, f"{backend}: beam-4 exact match on unseen sources {accuracy:.3f} < 0.95"


def test_a_marian_port_records_its_generation_ids_and_the_cli_uses_them(tmp_path, capsys):
    pytest.importorskip("transformers", reason="the Marian port needs transformers")
    from conformance.convert import from_hf_marian
    from test_hf_marian import PAD, marian

    config, params = from_hf_marian(marian())
    recorded = json.loads(config.notes["generation"])
    assert recorded["decoder_start_token_id"] == PAD and recorded["eos_token_id"] == 0
    assert recorded["forced_eos_token_id"] == 0 and recorded["pad_token_id"] == PAD
    defaults = recorded_generation(config)
    assert defaults["bos_id"] == PAD and defaults["eos_id"] == 0 and defaults["forced_eos"] is True

    path = tmp_path / "marian.safetensors"
    checkpoint.save(path, config, params)
    src = np.array([[5, 6, 7, 8]])
    assert main(["generate", str(path), "--src", "5,6,7,8", "--beams", "2", "--max-len", "6", "--backend", "numpy"]) == 0
    printed = capsys.readouterr().out.split()
    model = backends.build(Target("numpy", "cpu", "float32"), *checkpoint.load(path))
    expected = model.generate(src, 6, PAD, 0, num_beams=2, forced_eos=True)
    ended = np.flatnonzero(expected[0] == 0)  # the CLI prints each row up to its <eos>
    assert ended.size, "this case is meant to end with the forced <eos>"
    assert printed == [str(int(i)) for i in expected[0][: ended[0]]]
    # Without the note, the ids must be given: the CLI says so rather than guessing.
    bare = config.replace(notes={key: value for key, value in config.notes.items() if key != "generation"})
    checkpoint.save(tmp_path / "bare.safetensors", bare, params)
    assert main(["generate", str(tmp_path / "bare.safetensors"), "--src", "5,6,7,8", "--backend", "numpy"]) != 0
    assert "pass --bos and --eos" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_rosetta_generate_samples_the_ids_generate_samples(backend, capsys):
    """`--sample --temperature T --top-k K --top-p P --seed S` prints what generate(do_sample=True)
    draws, the same in every backend (the uniforms come from the NumPy seed)."""
    if not runnable(backend):
        pytest.skip(f"{backend} is not installed")
    argv = ["generate", "--src", "3 1 4 1 5 9 2 6", "--sample", "--temperature", "3", "--top-k", "6",
            "--top-p", "0.95", "--seed", "4", "--backend", backend]
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    config, params, _ = default_model()
    model = backends.build(Target("numpy", "cpu", "float32"), config, params)
    src = np.array([toy.encode_text("31415926")])
    ids = to_numpy(model.generate(src, config.max_len, toy.BOS, toy.EOS, do_sample=True, temperature=3.0, top_k=6,
                                  top_p=0.95, seed=4))
    expected = []
    for row in ids:
        ended = np.flatnonzero(row == toy.EOS)
        expected.append(toy.decode_ids(row[: ended[0]] if ended.size else row))
    assert printed == expected
    assert printed != ["6 2 9 5 1 4 1 3"], "this seed and temperature are meant to sample something else than greedy"


@pytest.mark.parametrize("argv, flag, words", [
    ("--sample --temperature 0", "--temperature", "> 0"),
    ("--sample --temperature -1", "--temperature", "> 0"),
    ("--sample --top-k -1", "--top-k", ">= 0"),
    ("--sample --top-p 0", "--top-p", "(0, 1]"),
    ("--sample --top-p 1.5", "--top-p", "(0, 1]"),
    ("--sample --seed -3", "--seed", ">= 0"),
    ("--temperature 0.5", "--temperature", "only with --sample"),
    ("--seed 1", "--seed", "only with --sample"),
    ("--sample --beams 4", "--beams", "beam sampling"),
    ("--sample --beam-rule flax", "--beam-rule", "--sample samples instead"),
])
def test_bad_sampling_flags_get_one_line_naming_the_flag(argv, flag, words, capsys):
    status = main(["generate", "--src", "3 1 4", *argv.split(), "--backend", "numpy"])
    err = capsys.readouterr().err
    assert status == 2, err
    error_lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "Traceback" not in err, err
    assert f"{flag}:" in error_lines[0] and words in error_lines[0], error_lines[0]


def test_rosetta_generate_with_the_flax_beam_rule(capsys):
    assert main(["generate", "--src", "3 1 4 1 5", "--beams", "4", "--length-penalty", "0.6", "--beam-rule", "flax",
                 "--backend", "numpy"]) == 0
    assert capsys.readouterr().out.strip() == "5 1 4 1 3"


def test_a_pad_start_token_is_refused_from_the_cli(capsys):
    """Issue 27 item 3: the toy model masks target padding, so --bos 0 (its pad id) is refused
    with one line naming --bos, instead of decoding wrong digits."""
    config, _, _ = default_model()
    assert config.pad_id == 0 and config.tgt_pad_mask != "none"
    assert main(["generate", "--src", "3 1 4", "--bos", "0", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "--bos: is the pad id 0" in err and 'tgt_pad_mask="none"' in err, err
