"""Every `rosetta` command, given hostile arguments: exit status 2, one line naming the argument
(or the file) at fault, no traceback, and no file created or changed.

Each case is a usage a newcomer met (issue 16) or another of the same class: ids that do not fit
in int64, outputs whose folder is missing or that are folders, bad row indices, folders and text
files given as weights or layouts, accelerators that are absent or belong to another backend,
and a run that could write only part of what was asked. The directory the command runs in is
snapshotted (every file's bytes and mtime) before and after.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conformance.check import backends
from conformance.cli import main
from conformance.core import checkpoint, init_params, preset
from conformance.core.config import ModelConfig

HUGE = "99999999999999999999999"  # > 2**63: np.array(..., int64) raises OverflowError


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder of hostile inputs, shared by every case (none may change it)."""
    root = tmp_path_factory.mktemp("hostile")
    config = ModelConfig(src_vocab_size=40, tgt_vocab_size=45, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                         n_decoder_layers=1, max_len=8)
    checkpoint.save(root / "model.safetensors", config, init_params(config, seed=0, dtype=np.float32))
    (root / "folder").mkdir()
    (root / "folder.npz").mkdir()  # a folder whose name looks like an output file
    (root / "pics.png").mkdir()
    (root / "ids.npy").mkdir()
    (root / "out.safetensors").mkdir()  # an output name taken by a folder
    (root / "text.pt").write_text("hello, this is not a checkpoint\n")
    (root / "text.npz").write_text("hello, this is not an archive\n")
    (root / "text.safetensors").write_text("hello\n")
    (root / "bad.toml").write_text("[keys\n")
    (root / "binary.toml").write_bytes(b"\xff\xfe\x00garbage")
    (root / "notes.toml.txt").write_text("x")
    from conformance.core.checkpoint import write_tensors

    write_tensors(root / "foreign.safetensors", {"a": np.zeros(2, np.float32)}, {})
    return root


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
                                       p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def _gpu_present(backend: str) -> bool:
    return "cuda" in backends.present_devices(backend) or "gpu" in backends.present_devices(backend)


TORCH_CUDA = "run model.safetensors --backend torch --device cuda --src 1,2 --tgt 1,2 --out o.npz"
JAX_GPU = "run model.safetensors --backend jax --device gpu --src 1,2 --tgt 1,2 --out o.npz"
HOSTILE_WITHOUT_ACCELERATOR = {TORCH_CUDA: "torch", JAX_GPU: "jax"}

# (command line, words the one error line must contain: the argument or file it blames first)
CASES = [
    # -- run -----------------------------------------------------------------------------------
    ("run model.safetensors --backend numpy --src " + HUGE + " --tgt 1,2 --out o.npz", ["src", HUGE, "64-bit"]),
    ("run model.safetensors --backend numpy --src 1,2 --tgt -" + HUGE + " --out o.npz", ["tgt", "64-bit"]),
    ("run model.safetensors --backend numpy --src 1,2;3," + HUGE + " --tgt 1,2;1,2 --out o.npz", ["src", "64-bit"]),
    ("run model.safetensors --backend numpy --src 1,2 --tgt 1,2 --out nodir/o.npz", ["--out", "nodir", "does not exist"]),
    ("run model.safetensors --backend numpy --src 1,2 --tgt 1,2 --out folder.npz", ["--out", "is a directory"]),
    ("run model.safetensors --backend numpy --src 1,2 --tgt 1,2 --out o.txt", ["--out", ".npz"]),
    ("run model.safetensors --backend numpy --device cuda --src 1,2 --tgt 1,2 --out o.npz", ["--device", "numpy", "cpu"]),
    ("run model.safetensors --backend numpy --device gpu --src 1,2 --tgt 1,2 --out o.npz", ["--device", "numpy", "cpu"]),
    ("run model.safetensors --backend torch --device gpu --src 1,2 --tgt 1,2 --out o.npz", ["--device", "JAX's name"]),
    ("run model.safetensors --backend jax --device cuda --src 1,2 --tgt 1,2 --out o.npz", ["--device", "torch's name"]),
    (TORCH_CUDA, ["--device", "cuda is not available", "torch.cuda.is_available() is False"]),
    (JAX_GPU, ["--device", "gpu is not available"]),
    ("run text.pt --backend numpy --src 1,2 --tgt 1,2 --out o.npz", ["text.pt", "not a rosetta checkpoint", "rosetta convert text.pt"]),
    ("run text.npz --backend numpy --src 1,2 --tgt 1,2 --out o.npz", ["text.npz", "not a rosetta checkpoint", "rosetta convert"]),
    ("run foreign.safetensors --backend numpy --src 1,2 --tgt 1,2 --out o.npz", ["foreign.safetensors", "not a rosetta checkpoint", "rosetta convert"]),
    ("run folder --backend numpy --src 1,2 --tgt 1,2 --out o.npz", ["folder", "is a directory"]),
    ("run missing.safetensors --backend numpy --src 1,2 --tgt 1,2 --out o.npz", ["missing.safetensors", "no such file"]),
    ("run model.safetensors --backend numpy --src , --tgt 1,2 --out o.npz", ["src", "expected ids"]),
    ("run model.safetensors --backend numpy --src 1,99 --tgt 1,2 --out o.npz", ["--src:", "99"]),
    ("run model.safetensors --backend numpy --src missing.npy --tgt 1,2 --out o.npz", ["src", "no such file"]),
    ("run model.safetensors --backend numpy --src ids.npy --tgt 1,2 --out o.npz", ["src", "is a directory"]),
    # -- generate ------------------------------------------------------------------------------
    ("generate --src " + HUGE + ",1", ["src", "64-bit"]),
    ("generate model.safetensors --src 1," + HUGE + " --bos 1 --eos 2", ["src", "64-bit"]),
    ("generate --src 3,1 --max-len 0", ["--max-len:", "must be an int in [1, "]),
    ("generate --src 3,1 --max-len 100", ["--max-len:", "must be an int in [1, "]),  # the same words as for 0
    ("generate --src 3,1 --beams 0", ["--beams:"]),
    ("generate --src 3,1 --length-penalty nan", ["--length-penalty:"]),
    ("generate --src 3,1 --eos 99", ["--eos:"]),
    ("generate --src 3,1 --bos " + HUGE, ["--bos:", HUGE]),
    ("generate model.safetensors --src 1,2", ["--bos", "--eos"]),
    ("generate --src abc", ["src", "digits only"]),
    ("generate folder --src 3,1", ["folder", "is a directory"]),
    ("generate text.pt --src 3,1", ["text.pt", "not a rosetta checkpoint"]),
    # -- attention -----------------------------------------------------------------------------
    ("attention --src 3,1,4 --out nodir/a.png", ["--out", "nodir", "does not exist"]),
    ("attention --src 3,1,4 --out a", ["--out", ".png"]),
    ("attention --src 3,1,4 --out pics.png", ["--out", "is a directory"]),
    ("attention --src 3,1,4 --out a.png --row 5", ["--row", "5", "1 row"]),
    ("attention --src 3,1,4 --out a.png --row -1", ["--row", "-1"]),
    ("attention --src 3,1,4 --out a.png --row x", ["--row", "invalid int"]),
    ("attention model.safetensors --src 3,1,4 --out a.png", ["--tgt", "is required"]),
    ("attention --src 3,1,4 --tgt 1," + HUGE + " --out a.png", ["tgt", "64-bit"]),
    ("attention --src 3," + HUGE + " --out a.png", ["src", "64-bit"]),
    ("attention --src " + HUGE + " --out a.png", ["--src:", "exceeds max_len"]),  # digits, for the toy model
    # -- check ---------------------------------------------------------------------------------
    ("check --backends numpy --dtypes float32 --json nodir/r.json", ["--json", "nodir", "does not exist"]),
    ("check --backends numpy --dtypes float32 --json r.json --plot nodir/p.png", ["--plot", "nodir"]),  # no r.json left behind
    ("check --backends numpy --dtypes float32 --plot p.png --json nodir/r.json", ["--json", "nodir"]),
    ("check --backends numpy --dtypes float32 --json folder", ["--json", ".json"]),
    ("check --backends numpy --dtypes float32 --plot pics.png", ["--plot", "is a directory"]),
    ("check --backends numpy --dtypes float8", ["--dtypes", "float8"]),
    ("check --backends numpy --dtypes ,", ["--dtypes", "names no dtype"]),
    ("check --backends tensorflow", ["--backends", "tensorflow"]),
    ("check --backends numpy --devices tpu", ["--devices", "tpu"]),
    ("check text.pt --backends numpy", ["text.pt", "not a rosetta checkpoint"]),
    # -- convert -------------------------------------------------------------------------------
    ("convert text.pt new.safetensors", ["text.pt", "not a PyTorch file", "it is text"]),
    ("convert text.npz new.safetensors", ["text.npz", "not an .npz file", "it is text"]),
    ("convert folder new.safetensors", ["folder", "is a directory"]),
    ("convert missing.pt new.safetensors", ["missing.pt", "no such file"]),
    ("convert notes.toml.txt new.safetensors", ["notes.toml.txt", "unknown file type"]),
    ("convert foreign.safetensors nodir/out.safetensors", ["nodir", "does not exist"]),
    ("convert foreign.safetensors out.pt", ["out.pt", ".safetensors"]),
    ("convert foreign.safetensors out.safetensors", ["out.safetensors", "is a directory"]),
    ("convert foreign.safetensors new.safetensors --layout folder", ["layout folder", "is a directory"]),
    ("convert foreign.safetensors new.safetensors --layout missing.toml", ["missing.toml", "no such file"]),
    ("convert foreign.safetensors new.safetensors --layout bad.toml", ["bad.toml", "not valid TOML"]),
    ("convert foreign.safetensors new.safetensors --set n_heads=two", ["n_heads", "expected an integer"]),
    ("convert foreign.safetensors new.safetensors --set tie_output=maybe", ["tie_output", "expected true or false"]),
    ("convert foreign.safetensors new.safetensors --set warp=9", ["warp", "not a ModelConfig field"]),
    ("convert foreign.safetensors new.safetensors --key model", ["--key", "PyTorch files only"]),
    ("convert foreign.safetensors new.safetensors --rename emb", ["--rename", "OLD=NEW"]),
    ("convert foreign.safetensors new.safetensors --rename nothing.=x.", ["--rename", "no key starts with 'nothing.'"]),
    ("convert foreign.safetensors new.safetensors --rename a=b --rename a=c", ["--rename", "renamed twice"]),
    # -- layouts -------------------------------------------------------------------------------
    ("layouts folder", ["layout folder", "is a directory"]),
    ("layouts folder/", ["folder", "is a directory"]),
    ("layouts bad.toml", ["bad.toml", "not valid TOML"]),
    ("layouts binary.toml", ["binary.toml", "UTF-8"]),
    ("layouts no-such-layout", ["no-such-layout", "no built-in layout"]),
    # -- inspect -------------------------------------------------------------------------------
    ("inspect folder", ["folder", "is a directory"]),
    ("inspect text.pt", ["text.pt", "not a PyTorch file", "it is text"]),
    ("inspect text.npz", ["text.npz", "not an .npz file"]),
    ("inspect text.safetensors", ["text.safetensors", "truncated"]),
    ("inspect missing.pt", ["missing.pt", "no such file"]),
    ("inspect bad.toml", ["bad.toml", "unknown file type"]),
    ("inspect foreign.safetensors --layout folder", ["layout folder", "is a directory"]),
    ("inspect foreign.safetensors --layout nope", ["layout nope", "no built-in layout"]),
    # -- conformance ---------------------------------------------------------------------------
    ("conformance --backends tensorflow", ["--backends", "tensorflow"]),
    ("conformance --devices tpu", ["--devices", "tpu"]),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[argv.replace(HUGE, "HUGE")[:70] for argv, _ in CASES])
def test_a_hostile_usage_gets_one_line_exit_2_and_writes_nothing(argv, words, workdir, monkeypatch, capsys):
    backend = HOSTILE_WITHOUT_ACCELERATOR.get(argv)
    if backend is not None:
        if backends.availability([backend])[backend]:
            pytest.skip(f"the {backend} backend is not installed")
        if _gpu_present(backend):
            pytest.skip(f"this machine has a {backend} accelerator: the usage is not hostile here")
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("ROSETTA_BACKENDS", raising=False)
    monkeypatch.delenv("ROSETTA_DEVICES", raising=False)
    before = snapshot(workdir)
    try:
        status = main(argv.split(" "))
    except SystemExit as exc:  # argparse's own refusals (a non-integer --row)
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2, f"exit {status}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    error_lines = [line for line in lines if "error:" in line]
    assert len(error_lines) == 1, err
    for word in words:
        assert word in error_lines[0], f"{word!r} not in {error_lines[0]!r}"
    assert snapshot(workdir) == before, "a refused command created or changed a file"


def test_check_writes_both_outputs_together_and_says_so(workdir, tmp_path, monkeypatch, capsys):
    """The other half of 'only when every output can be written': when both can, both are, and
    each is named on stdout."""
    monkeypatch.chdir(tmp_path)
    status = main(["check", "--backends", "numpy", "--dtypes", "float32", "--json", "r.json", "--plot", "p.png"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "wrote r.json" in out and "wrote p.png" in out
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert '"passed": true' in (tmp_path / "r.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "r.json"]  # no temporary left behind


def test_attention_writes_exactly_the_file_it_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["attention", "--src", "3 1 4", "--out", "a.png"]) == 0
    assert "wrote a.png" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]


def test_write_outputs_leaves_every_target_alone_when_one_cannot_be_written(tmp_path):
    from conformance.cli.common import write_outputs
    from conformance.core.errors import InputError

    keep = tmp_path / "keep.json"
    keep.write_text("old")
    with pytest.raises(InputError) as info:
        write_outputs({"--json": (keep, b"new"), "--plot": (tmp_path / "gone" / "p.png", b"png")})
    assert info.value.argument == "--plot"
    assert keep.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.json"]


def test_an_npy_source_gets_no_digit_hint(workdir, tmp_path, monkeypatch, capsys):
    """`--src ids.npy` holds token ids; the toy model's hint on reading digits is not for it."""
    np.save(tmp_path / "s.npy", np.array([[3, 4, 5]]))
    assert main(["generate", "--src", str(tmp_path / "s.npy")]) == 0
    assert "read as" not in capsys.readouterr().err


def test_bad_arguments_are_refused_before_a_framework_is_imported(workdir, tmp_path):
    """Arguments that need no framework to check are checked before one is imported (seconds):
    one process runs every usage in turn, and neither torch nor jax is loaded at the end."""
    import subprocess
    import sys

    usages = [["check", "text.pt"], ["train-check", "--label-smoothing", "1.5"], ["train-check", "--warmup", "0"],
              ["train-check", "--steps", "0"], ["train-check", "text.pt"],
              ["run", "text.pt", "--backend", "torch", "--src", "1,2", "--tgt", "1,2", "--out", str(tmp_path / "o.npz")],
              ["run", "model.safetensors", "--backend", "jax", "--src", "1,x", "--tgt", "1,2", "--out", str(tmp_path / "o.npz")]]
    code = ("import sys; from conformance.cli import main\n"
            f"statuses = [main(argv) for argv in {usages!r}]\n"
            "print(statuses, sorted(m for m in ('torch', 'jax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"{[2] * len(usages)} []", done.stdout + done.stderr
    for flag in ("--label-smoothing:", "--warmup:", "--steps:", "text.pt", "--src:"):
        assert flag in done.stderr, (flag, done.stderr)


# -- a garbage .npy or .npz is said to be what it is, never "Python objects" (issue 45, item 19) ---


def cli(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def files(tmp_path):
    """A rosetta checkpoint (`model.safetensors`, float32) in a folder of the test's own."""
    config = preset("torch-nn-transformer", src_vocab_size=11, tgt_vocab_size=13, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=10)
    params = init_params(config, seed=3, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    return tmp_path, config, params


@pytest.mark.parametrize("data, words", [
    (b"hello, these are not ids\n", "it is text, starting 'hello, these are not"),
    (b"\x00\x01\x02\x03garbage\xff", "it starts with bytes"),
    (b"\x93NUMPY\x20\x67garbage", "not a readable .npy file"),
])
def test_a_garbage_npy_is_not_said_to_hold_python_objects(files, capsys, data, words):
    root, _, _ = files
    (root / "bad.npy").write_bytes(data)
    status, _, err = cli(capsys, "run", root / "model.safetensors", "--backend", "numpy", "--src", root / "bad.npy",
                         "--tgt", "1,2", "--out", root / "o.npz")
    assert status == 2 and f"--src: {root / 'bad.npy'}" in err and words in err, err
    assert "Python objects" not in err and len(err.strip().splitlines()) == 1


def test_a_pickle_named_npy_is_said_to_be_a_pickle(files, capsys):
    import pickle

    root, _, _ = files
    (root / "p.npy").write_bytes(pickle.dumps([[1, 2]]))
    status, _, err = cli(capsys, "run", root / "model.safetensors", "--backend", "numpy", "--src", root / "p.npy",
                         "--tgt", "1,2", "--out", root / "o.npz")
    assert status == 2 and "a Python pickle" in err and "never unpickled" in err, err


def test_a_garbage_npz_entry_is_not_said_to_hold_python_objects(tmp_path, capsys):
    with zipfile.ZipFile(tmp_path / "w.npz", "w") as archive:
        archive.writestr("a.npy", b"\x93NUMPY\x20\x67garbage")
    status, _, err = cli(capsys, "convert", tmp_path / "w.npz", tmp_path / "out.safetensors")
    assert status == 2 and "entry 'a'" in err and "not a readable array" in err, err
    assert "Python objects" not in err and err.count("w.npz") == 1, err
