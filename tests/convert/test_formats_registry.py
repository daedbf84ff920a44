"""The registry of formats (`conformance.formats`, issue 55): `rosetta convert` parses its flags and
calls one function; which format reads the input and which writes the output is the registry's
to say, in its order; a new format is one module and one line in FORMATS, with no change to the
command line; and `staged` leaves nothing at the destination when anything goes wrong.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.cli import main
from conformance.core import checkpoint
from conformance.core.errors import CheckpointError
from conformance import formats
from conformance.formats import Options, format_for, format_of, staged

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "conformance" / "cli" / "convert.py"
# What a format-specific branch of the command line would name.
FORMAT_WORDS = ("onnx", "ctranslate2", "dcp", "orbax", "sharded", "hf_folder", "hf-", "msgpack", "safetensors",
                "checkpoint", "export", "import_", "write_", "is_hf_folder", "TORCH_SUFFIXES", "trial")


def names_in(function: ast.FunctionDef) -> set[str]:
    """Every identifier, attribute and string constant a function's body uses."""
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found


def format_branches(source: str) -> list[str]:
    """The format words the command line's code (all but its --help texts) uses."""
    tree = ast.parse(source)
    used = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name != "add_arguments":
            used |= names_in(node)
    return sorted({word for word in FORMAT_WORDS for name in used if word in name.lower()})


def test_rosetta_convert_has_no_format_specific_branch():
    assert format_branches(CLI.read_text()) == []
    tree = ast.parse(CLI.read_text())
    run = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run")
    assert "conformance.formats" in names_in(run) and "convert" in names_in(run)


def test_the_check_finds_the_branches_the_command_line_had():
    """The check above, on a command line that decides formats itself, as cli/convert.py did."""
    before = '''
def run(args):
    if args.to == ONNX:
        return export_onnx(src, dst, args)
    if sharded.kind(src) == "orbax":
        return import_sharded(src, dst, args)
'''
    assert "onnx" in format_branches(before) and "sharded" in format_branches(before)


@pytest.fixture
def files(tmp_path):
    config = preset("hf-bart", src_vocab_size=13, tgt_vocab_size=13, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=10)
    params = init_params(config, seed=0, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    checkpoint.write_tensors(tmp_path / "foreign.safetensors", {"a": params["encoder.embedding.weight"]}, {})
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text('{"model_type": "bart"}')
    return tmp_path


def test_the_registry_chooses_the_input_format_in_its_order(files):
    assert format_of(files / "model.safetensors") is formats.rosetta.FORMAT
    assert format_of(files / "folder") is formats.hf_folder.FORMAT
    assert format_of(files / "foreign.safetensors") is formats.state_dict.FORMAT
    with pytest.raises(CheckpointError, match="no such file or directory"):
        format_of(files / "absent.pt")


@pytest.mark.parametrize("to, dst, expected", [
    (None, "out.safetensors", "rosetta"), ("onnx", "graphs", "onnx"), ("ctranslate2", "ct2", "ctranslate2"),
    ("dcp", "dcp", "sharded"), ("orbax", "orbax", "sharded"), ("hf-bart", "bart", "hf_folder"),
    ("hf-bart", "bart.safetensors", "state_dict"), ("torch-nn-transformer", "t.pt", "state_dict"),
    ("flax-wmt", "wmt", "state_dict"), ("no-such-layout", "x", "state_dict"),
])
def test_the_registry_chooses_the_output_format_in_its_order(to, dst, expected):
    assert format_for(Options(to=to), Path(dst)) is getattr(formats, expected).FORMAT


class NpzDump(formats.Format):
    """A format of this test's own: `--to npz-dump` writes the parameters as an .npz, read back to check."""

    name = "npz dump"

    def writes(self, options, dst):
        return options.to == "npz-dump"

    def write(self, staged_path, read, options, dst):
        with open(staged_path, "wb") as f:
            np.savez(f, **read.params)
        return formats.Written(title="the parameters as an .npz")

    def verify(self, staged_path, read, options, progress):
        from conformance.formats import verify

        with np.load(staged_path) as held:
            differs = verify.params_differ(read.params, {k: held[k] for k in held.files})
        return [verify.failed("np.load", differs) if differs else verify.passed("np.load", "every parameter")]


def test_a_new_format_is_one_class_and_one_line_in_the_registry(files, capsys, monkeypatch):
    monkeypatch.setattr(formats, "FORMATS", (*formats.FORMATS[:-1], NpzDump(), formats.FORMATS[-1]))
    assert main(["convert", str(files / "model.safetensors"), str(files / "dump.npz"), "--to", "npz-dump"]) == 0
    printed = capsys.readouterr().out
    assert "(the parameters as an .npz)" in printed and "verified: np.load: every parameter" in printed, printed
    _, params = checkpoint.load(files / "model.safetensors")
    with np.load(files / "dump.npz") as held:
        assert sorted(held.files) == sorted(params)


def test_staged_leaves_nothing_and_names_the_destination(tmp_path):
    dst = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError) as caught:
        with staged(dst) as path:
            path.write_bytes(b"half")
            raise CheckpointError(path, "planted failure")
    assert str(caught.value) == f"{dst}: planted failure"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        with staged(dst) as path:
            path.mkdir()
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with staged(dst) as path:
        path.write_bytes(b"whole")
    assert dst.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
