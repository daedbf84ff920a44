"""`rosetta generate`'s Whisper flags (--prefix, --timestamps/--no-timestamps,
--max-initial-timestamp-index, --beam-rule openai with --patience, --no-speech-prob) give the ids,
and the no-speech probability to the printed precision, of the Python API's `generate` with the
same arguments, and bad values exit 2 naming the flag.

The model is docs/whisper_tiny.py's transformers Whisper (a released model's generation config for
its 64 ids: the language detected among <|en|> 47 and <|de|> 48, <|transcribe|> 50, the
no-timestamps id 54, the first timestamp within 4), converted by `rosetta convert` with no --set,
on three rows of standard-normal features of its whole 16-frame window. Each case also checks that
its flag changes the API's ids on this model, so that a flag that did not reach `generate` fails.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="docs/whisper_tiny.py builds the model with transformers")
pytest.importorskip("tokenizers", reason="docs/whisper_tiny.py writes a tokenizer")

from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402

import impl_numpy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EOS = 45  # <|endoftext|>, also the pad id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """{"plain": the converted checkpoint, "timestamps": the same whose note asks for timestamps
    (return_timestamps true, as a generation config may), "features": a .npy (3, 8, 16)}."""
    root = tmp_path_factory.mktemp("whisper-flags")
    folder = runpy.run_path(str(ROOT / "docs" / "whisper_tiny.py"))["write"](root / "whisper-tiny")
    plain = root / "tiny.safetensors"
    assert main(["convert", str(folder), str(plain)]) == 0
    config, params = checkpoint.load(plain)
    note = dict(json.loads(config.notes["generation"]), return_timestamps=True)
    timestamps = root / "tiny-timestamps.safetensors"
    checkpoint.save(timestamps, dataclasses.replace(config, notes={**config.notes, "generation": json.dumps(note)}),
                    params)
    features = root / "features.npy"
    np.save(features, np.random.default_rng(0).standard_normal((3, 8, 16)).astype(np.float32))
    return {"plain": plain, "timestamps": timestamps, "features": features}


def api(path: Path, features: Path, **arguments):
    """The Python API's `generate` (impl_numpy, float32, as the command loads it)."""
    config, params = checkpoint.load(path)
    return impl_numpy.Model(config, params).generate(np.load(features), **arguments)


def rows(ids) -> list[list[int]]:
    """Each row up to its end token, as the command prints it."""
    out = []
    for row in np.asarray(ids):
        ended = np.flatnonzero(row == EOS)
        out.append([int(i) for i in (row[: ended[0]] if ended.size else row)])
    return out


def printed(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.split("\n") if line]


def command(tiny, which: str, flags: list[str]) -> list[str]:
    return ["generate", str(tiny[which]), "--src", str(tiny["features"]), *flags]


# (flags, the API's arguments, the API's arguments without the flag under test: None where the
# flag gives what the checkpoint's note gives anyway, as 'detect' does on this model)
CASES = {
    "--prefix": (["--prefix", "47,50,54"], dict(prefix=[47, 50, 54]), {}),
    "--prefix detect": (["--prefix", "detect,50,54"], dict(prefix=[None, 50, 54]), None),
    "--prefix ''": (["--prefix", ""], dict(prefix=[]), {}),
    "--timestamps": (["--timestamps"], dict(return_timestamps=True), {}),
    "--max-initial-timestamp-index 0": (["--timestamps", "--max-initial-timestamp-index", "0"],
                                        dict(return_timestamps=True, max_initial_timestamp_index=0),
                                        dict(return_timestamps=True)),
    "--max-initial-timestamp-index none": (["--timestamps", "--max-initial-timestamp-index", "none"],
                                           dict(return_timestamps=True, max_initial_timestamp_index=False),
                                           dict(return_timestamps=True)),
    "--beam-rule openai": (["--beams", "4", "--beam-rule", "openai", "--timestamps"],
                           dict(num_beams=4, beam_rule="openai", return_timestamps=True),
                           dict(num_beams=4, return_timestamps=True)),
    "--patience 3": (["--beams", "2", "--beam-rule", "openai", "--patience", "3", "--timestamps"],
                     dict(num_beams=2, beam_rule="openai", patience=3.0, return_timestamps=True),
                     dict(num_beams=2, beam_rule="openai", return_timestamps=True)),
    "--patience 0.5": (["--beams", "2", "--beam-rule", "openai", "--patience", "0.5", "--timestamps"],
                       dict(num_beams=2, beam_rule="openai", patience=0.5, return_timestamps=True),
                       dict(num_beams=2, beam_rule="openai", return_timestamps=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_flag_gives_the_apis_ids(tiny, case, capsys):
    flags, arguments, without = CASES[case]
    expected = rows(api(tiny["plain"], tiny["features"], **arguments))
    if without is not None:  # the flag matters here: a flag that did not reach generate would fail
        assert expected != rows(api(tiny["plain"], tiny["features"], **without)), case
    assert main(command(tiny, "plain", ["--max-len", "15", *flags])) == 0
    assert [line.split() for line in printed(capsys)] == [[str(i) for i in row] for row in expected]


def test_no_timestamps_turns_off_the_notes_timestamps(tiny, capsys):
    expected = rows(api(tiny["timestamps"], tiny["features"], return_timestamps=False))
    assert expected != rows(api(tiny["timestamps"], tiny["features"]))  # the note's timestamps are on
    assert main(command(tiny, "timestamps", ["--no-timestamps"])) == 0
    assert [line.split() for line in printed(capsys)] == [[str(i) for i in row] for row in expected]
    assert expected[0][2] == 54  # the note's prompt keeps its no-timestamps id


def test_no_speech_prob_is_printed_after_each_rows_ids(tiny, capsys):
    ids, no_speech = api(tiny["plain"], tiny["features"], return_no_speech_prob=True)
    assert main(command(tiny, "plain", ["--no-speech-prob"])) == 0
    lines = printed(capsys)
    assert len(lines) == len(no_speech) == 3
    for line, row, probability in zip(lines, rows(ids), no_speech):
        shown, _, said = line.partition("\t")
        assert shown.split() == [str(i) for i in row]
        assert said == f"no_speech_prob={float(probability):.6g}", line
    assert len({line.partition("\t")[2] for line in lines}) == 3  # each row its own source's


@pytest.mark.parametrize("flags, words", [
    (["--prefix", "47,x"], "must be ids like"),
    (["--prefix", "99"], "[0, 64)"),
    (["--prefix", "45,50"], "end id 45"),
    (["--prefix", "detect,50", "--timestamps", "--forced-bos", "47"], None),  # two first tokens: --forced-bos
    (["--beams", "2", "--beam-rule", "openai", "--patience", "-1"], "must be a number > 0"),
    (["--beams", "2", "--beam-rule", "openai", "--patience", "nan"], "finite number"),
    (["--beams", "2", "--patience", "2"], "--beam-rule openai"),
    (["--timestamps", "--max-initial-timestamp-index", "-1"], "an int >= 0 (the first timestamp's bound)"),
    (["--timestamps", "--max-initial-timestamp-index", "x"], "'none' for no bound"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_bad_value_exits_2_naming_its_flag(tiny, flags, words, capsys):
    assert main(command(tiny, "plain", flags)) == 2
    err = capsys.readouterr().err
    flag = "--forced-bos" if words is None else flags[-2]
    assert f"rosetta generate: error: {flag}: " in err, err
    assert words is None or words in err, err


def test_a_patience_that_is_no_number_exits_2_naming_it(tiny, capsys):
    with pytest.raises(SystemExit) as stopped:  # argparse's own refusal of a type
        main(command(tiny, "plain", ["--beam-rule", "openai", "--patience", "abc"]))
    assert stopped.value.code == 2 and "argument --patience: invalid float value: 'abc'" in capsys.readouterr().err


def test_no_speech_prob_needs_a_whisper_note(capsys):
    assert main(["generate", "--src", "3 1 4", "--no-speech-prob"]) == 2  # the built-in toy model
    assert "rosetta generate: error: --no-speech-prob: needs the checkpoint's no_timestamps_token_id" in \
        capsys.readouterr().err
