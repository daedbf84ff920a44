"""What `rosetta convert` writes (issue 45, items 7, 8, 9 and 18): an existing output is kept unless
`--force`; a write that fails names the destination, never the temporary file beside it; an
interrupted export leaves nothing behind; a rosetta checkpoint given as input is re-saved or cast;
a cast that overflows says so, by key; the writer follows the suffix, whatever its case;
`--to torch-nn-transformer` writes a `.pt` state dict that the tutorial's own model loads with
`weights_only=True`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.cli import main
from conformance.convert import export_state_dict, read_state_dict
from conformance.core import checkpoint

SIZES = dict(src_vocab_size=11, tgt_vocab_size=13, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1,
             n_decoder_layers=1, max_len=10)
# What the torch-nn-transformer layout cannot read from the tensors.
SETS = ["--set", "n_heads=2", "--set", "norm_placement=post", "--set", "pad_id=1"]
BIG_KEY = "encoder.layers.0.ffn.linear1.weight"  # the canonical key given a finite 1e5
BIG_FOREIGN = "transformer.encoder.layers.0.linear1.weight"  # the same tensor in the tutorial's key space


def cli(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def tutorial_config(**changes):
    return preset("torch-nn-transformer", **SIZES, **changes)


@pytest.fixture
def files(tmp_path):
    """A rosetta checkpoint (`model.safetensors`) and the same model in the tutorial's key space
    (`foreign.safetensors`), both float32."""
    config = tutorial_config()
    params = init_params(config, seed=3, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    checkpoint.write_tensors(tmp_path / "foreign.safetensors", export_state_dict(config, params, "torch-nn-transformer"), {})
    return tmp_path, config, params


def leftovers(directory, *expected):
    return sorted(p.name for p in directory.iterdir() if p.name not in expected)


# -- 7: an existing output is kept unless --force ---------------------------------------------


def test_an_existing_destination_is_kept_unless_force(files, capsys):
    root, config, params = files
    out = root / "out.safetensors"
    out.write_bytes(b"the user's earlier checkpoint")
    status, _, err = cli(capsys, "convert", root / "foreign.safetensors", out, *SETS)
    assert status == 2 and f"{out}: already exists" in err and "--force" in err, err
    assert out.read_bytes() == b"the user's earlier checkpoint"
    assert leftovers(root, "model.safetensors", "foreign.safetensors", "out.safetensors") == []

    status, _, err = cli(capsys, "convert", root / "foreign.safetensors", out, *SETS, "--force")
    assert status == 0, err
    again, loaded = checkpoint.load(out)
    assert again == config.replace(notes=again.notes) and all(np.array_equal(loaded[k], params[k]) for k in params)


def test_an_export_keeps_an_existing_file_unless_force(files, capsys):
    root, _, _ = files
    out = root / "tutorial.safetensors"
    out.write_bytes(b"keep me")
    status, _, err = cli(capsys, "convert", root / "model.safetensors", out, "--to", "torch-nn-transformer")
    assert status == 2 and "already exists" in err and "--force" in err and out.read_bytes() == b"keep me", err
    status, _, err = cli(capsys, "convert", root / "model.safetensors", out, "--to", "torch-nn-transformer", "--force")
    assert status == 0 and "transformer.encoder.layers.0.linear1.weight" in read_state_dict(out), err


def _refuse_temporaries(monkeypatch):
    """mkstemp as a read-only directory answers it (the tests run as root, whom chmod does not stop)."""
    def mkstemp(prefix="", dir=None, **_):
        raise PermissionError(13, "Permission denied", os.path.join(dir, f"{prefix}3ghl3eo7"))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("export", [False, True], ids=["import", "export"])
def test_a_read_only_directory_names_the_destination_not_the_temporary(files, capsys, monkeypatch, export):
    root, _, _ = files
    out = root / "x.safetensors"
    _refuse_temporaries(monkeypatch)
    argv = ([root / "model.safetensors", out, "--to", "torch-nn-transformer"] if export
            else [root / "foreign.safetensors", out, *SETS])
    status, _, err = cli(capsys, "convert", *argv)
    assert status == 2 and str(out) in err and "ermission denied" in err, err
    assert ".tmp-" not in err and "3ghl3eo7" not in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_directory_that_cannot_be_written_is_refused_before_converting(files, capsys, monkeypatch):
    root, _, _ = files
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(root / "ro")
                        else real_access(path, mode, **kw))
    (root / "ro").mkdir()
    status, out, err = cli(capsys, "convert", root / "foreign.safetensors", root / "ro" / "x.safetensors", *SETS)
    assert status == 2 and f"{root / 'ro' / 'x.safetensors'}: cannot write" in err and "permission denied" in err, err
    assert out == "", "refused before the conversion ran"


# -- 8: a rosetta checkpoint in ----------------------------------------------------------------


# Notes take no part in ModelConfig equality (compare=False), so they are compared on their own.
NOTES = {"source_file": "tutorial.pt", "generation": '{"eos_token_id": 2, "max_length": 20}'}


@pytest.fixture
def noted(tmp_path):
    """A rosetta checkpoint whose config carries notes, a "generation" note among them."""
    config = tutorial_config().replace(notes=NOTES)
    params = init_params(config, seed=3, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    return tmp_path, config, params


def test_a_rosetta_checkpoint_is_re_saved(noted, capsys):
    root, config, params = noted
    status, out, err = cli(capsys, "convert", root / "model.safetensors", root / "copy.safetensors")
    assert status == 0, err
    assert "rosetta checkpoint" in out and "no built-in layout" not in err
    again, loaded = checkpoint.load(root / "copy.safetensors")
    assert again == config and all(loaded[k].tobytes() == params[k].tobytes() for k in params)
    assert again.notes == config.notes == NOTES


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_a_rosetta_checkpoint_is_cast(noted, capsys, dtype):
    from conformance.core.params import host_dtype

    root, config, params = noted
    status, out, err = cli(capsys, "convert", root / "model.safetensors", root / "cast.safetensors", "--dtype", dtype)
    assert status == 0, err
    assert f"cast float32 -> {dtype}" in out, out
    again, loaded = checkpoint.load(root / "cast.safetensors")
    assert again == config and again.notes == config.notes == NOTES
    for key, value in params.items():
        assert loaded[key].dtype == host_dtype(dtype) and np.array_equal(loaded[key], value.astype(host_dtype(dtype)))


@pytest.mark.parametrize("argv, flag", [(["--layout", "torch-nn-transformer"], "--layout"),
                                        (["--set", "n_heads=4"], "--set"), (["--rename", "a.=b."], "--rename"),
                                        (["--key", "model"], "--key")])
def test_a_rosetta_checkpoint_refuses_what_only_a_foreign_file_takes(files, capsys, argv, flag):
    root, _, _ = files
    status, _, err = cli(capsys, "convert", root / "model.safetensors", root / "copy.safetensors", *argv)
    assert status == 2 and "rosetta checkpoint" in err and flag in err, err
    assert not (root / "copy.safetensors").exists()


# -- 9: a cast that overflows ------------------------------------------------------------------


@pytest.fixture
def big(tmp_path):
    """The checkpoint and its foreign copy, with one finite float32 weight of 1e5 (float16's
    largest finite value is 65504)."""
    config = tutorial_config()
    params = init_params(config, seed=3, dtype=np.float32)
    params[BIG_KEY] = params[BIG_KEY].copy()
    params[BIG_KEY][0, 1] = 1e5
    checkpoint.save(tmp_path / "big.safetensors", config, params)
    checkpoint.write_tensors(tmp_path / "foreign.safetensors", export_state_dict(config, params, "torch-nn-transformer"), {})
    return tmp_path


@pytest.mark.parametrize("rosetta_input", [False, True], ids=["foreign", "rosetta"])
def test_an_overflowing_cast_is_named_as_the_cast(big, capsys, rosetta_input):
    src = big / ("big.safetensors" if rosetta_input else "foreign.safetensors")
    sets = [] if rosetta_input else SETS
    status, _, err = cli(capsys, "convert", src, big / "half.safetensors", *sets, "--dtype", "float16")
    assert status == 2, err
    assert (BIG_KEY if rosetta_input else BIG_FOREIGN) in err, err
    assert "overflow" in err and "float16" in err and "100000" in err and "65504" in err, err
    assert "has 1 NaN or infinite" not in err, "the file holds no such value"
    assert not (big / "half.safetensors").exists()
    # The same weights go to a dtype that holds them.
    assert cli(capsys, "convert", src, big / "wide.safetensors", *sets, "--dtype", "float64")[0] == 0


def test_a_stored_infinity_is_still_blamed_on_the_file(tmp_path, capsys):
    config = tutorial_config()
    state = export_state_dict(config, init_params(config, seed=3, dtype=np.float32), "torch-nn-transformer")
    state[BIG_FOREIGN] = state[BIG_FOREIGN].copy()
    state[BIG_FOREIGN][0, 0] = np.inf
    checkpoint.write_tensors(tmp_path / "inf.safetensors", state, {})
    status, _, err = cli(capsys, "convert", tmp_path / "inf.safetensors", tmp_path / "out.safetensors", *SETS,
                         "--dtype", "float16")
    assert status == 2 and f"{BIG_FOREIGN}: has 1 NaN or infinite value(s)" in err and "overflow" not in err, err


def test_the_library_cast_names_no_command_line_flag():
    """A Python caller of `cast` typed no `--dtype`; the command line adds its flag itself."""
    from conformance.convert.engine import cast
    from conformance.convert.errors import TensorError

    with pytest.raises(TensorError) as caught:
        cast(np.array([1e5], dtype=np.float32), "float16", "w")
    assert "overflow" in str(caught.value) and "float16" in str(caught.value) and "--dtype" not in str(caught.value)


def test_the_command_line_names_its_flag_for_an_overflowing_cast(big, capsys):
    status, _, err = cli(capsys, "convert", big / "big.safetensors", big / "half.safetensors", "--dtype", "float16")
    assert status == 2 and "--dtype float16" in err, err


# -- items 7 and 18: the writer by suffix, the input, an interrupted export ----------------------


@pytest.mark.parametrize("name", ["OUT.SAFETENSORS", "Out.SafeTensors"])
def test_an_upper_case_suffix_chooses_the_writer_its_lower_case_does(files, capsys, name):
    root, _, _ = files
    out = root / name
    status, printed, err = cli(capsys, "convert", root / "model.safetensors", out, "--to", "torch-nn-transformer")
    assert status == 0, err
    assert out.is_file() and "(safetensors" in printed, printed
    assert BIG_FOREIGN in read_state_dict(out)


@pytest.mark.parametrize("name", ["OUT.PT", "out.Bin"])
def test_an_upper_case_torch_suffix_writes_a_state_dict(files, capsys, name):
    root, _, _ = files
    status, printed, err = cli(capsys, "convert", root / "model.safetensors", root / name, "--to", "torch-nn-transformer")
    assert status == 0 and (root / name).is_file() and "PyTorch state dict" in printed, err


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_an_export_never_overwrites_its_input(files, capsys, force):
    root, _, _ = files
    src = root / "model.safetensors"
    before = digest(src)
    status, _, err = cli(capsys, "convert", src, src, "--to", "torch-nn-transformer", *(["--force"] if force else []))
    assert status == 2 and "is the input" in err and len(err.strip().splitlines()) == 1, err
    assert digest(src) == before
    checkpoint.load(src)  # still the rosetta checkpoint


@pytest.fixture
def wmt_checkpoint(tmp_path):
    """A small rosetta checkpoint that exports to flax-wmt."""
    config = preset("flax-wmt", src_vocab_size=17, tgt_vocab_size=17, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=10, share_embeddings=True, tie_output=True,
                    output_bias=False, scale_logits=True)
    checkpoint.save(tmp_path / "model.safetensors", config, init_params(config, seed=3, dtype=np.float32))
    return tmp_path


def test_an_interrupted_msgpack_export_keeps_the_old_file(wmt_checkpoint, capsys, monkeypatch):
    """Ctrl-C (here: at the rename, once the new bytes are complete) leaves the old output as it
    was and no temporary beside it: the msgpack writer is the atomic one."""
    pytest.importorskip("flax")
    root = wmt_checkpoint
    out = root / "wmt.msgpack"
    out.write_bytes(b"the previous export")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["convert", str(root / "model.safetensors"), str(out), "--to", "flax-wmt", "--force"])
    assert out.read_bytes() == b"the previous export"
    assert leftovers(root, "model.safetensors", "wmt.msgpack") == []


def test_an_interrupted_folder_export_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """A Hugging Face folder is built in a hidden temporary folder beside it and renamed into place
    once complete: Ctrl-C while its last file is written leaves neither."""
    from pathlib import Path

    config = preset("hf-marian", src_vocab_size=13, tgt_vocab_size=13, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=10, pad_id=1)
    checkpoint.save(tmp_path / "model.safetensors", config, init_params(config, seed=3, dtype=np.float32))
    real_write_text = Path.write_text

    def interrupted(self, *args, **kwargs):
        if self.name == "config.json":
            raise KeyboardInterrupt
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["convert", str(tmp_path / "model.safetensors"), str(tmp_path / "marian"), "--to", "hf-marian"])
    assert leftovers(tmp_path, "model.safetensors") == []
    monkeypatch.undo()
    status, _, err = cli(capsys, "convert", tmp_path / "model.safetensors", tmp_path / "marian", "--to", "hf-marian")
    assert status == 0, err
    assert sorted(p.name for p in (tmp_path / "marian").iterdir())[:2] == ["config.json", "generation_config.json"]
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in (tmp_path / "marian").iterdir())
    assert ((tmp_path / "marian").stat().st_mode & 0o777) == 0o755 & ~_umask()
    assert leftovers(tmp_path, "model.safetensors", "marian") == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_interrupted_orbax_export_leaves_no_directory(wmt_checkpoint, capsys, monkeypatch):
    """Ctrl-C once Orbax has written every file (the latest moment before the export is done)
    leaves no directory: Orbax writes into a hidden directory, renamed into place at the end."""
    ocp = pytest.importorskip("orbax.checkpoint")
    root = wmt_checkpoint
    finish, save = ocp.StandardCheckpointer.wait_until_finished, ocp.StandardCheckpointer.save
    saved = []

    def interrupted(self):
        finish(self)
        if saved:  # save() waits for any earlier save first: not that call
            raise KeyboardInterrupt

    def saving(self, *args, **kwargs):
        save(self, *args, **kwargs)
        saved.append(True)

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", saving)

    monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["convert", str(root / "model.safetensors"), str(root / "wmt_orbax"), "--to", "flax-wmt"])
    assert leftovers(root, "model.safetensors") == []


# -- 18: a .pt state dict for the tutorial's model ---------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")  # nn.Transformer's nested-tensor notice
def test_to_torch_nn_transformer_writes_a_pt_state_dict_the_tutorial_loads(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from systems import torch_tutorial
    from systems.harness import assert_matches_source, padded_batch, run_backend

    config = tutorial_config(pad_id=torch_tutorial.PAD)
    params = init_params(config, seed=5, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    status, out, err = cli(capsys, "convert", tmp_path / "model.safetensors", tmp_path / "tutorial.pt",
                           "--to", "torch-nn-transformer")
    assert status == 0, err
    assert "PyTorch state dict" in out, out
    assert (tmp_path / "tutorial.pt").stat().st_mode & 0o777 == 0o644
    assert leftovers(tmp_path, "model.safetensors", "tutorial.pt") == []

    state = torch.load(tmp_path / "tutorial.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    model = torch_tutorial.make(SIZES["src_vocab_size"], SIZES["tgt_vocab_size"], SIZES["d_model"], SIZES["n_heads"],
                                SIZES["d_ff"], SIZES["n_encoder_layers"], SIZES["max_len"])
    model.load_state_dict(state, strict=True)
    src, tgt = padded_batch(torch_tutorial.PAD, SIZES["src_vocab_size"], SIZES["tgt_vocab_size"])
    with torch.no_grad():
        theirs = torch_tutorial.logits(model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    assert_matches_source(run_backend("numpy", config, params, src, tgt), theirs, "exported .pt in nn.Transformer")

    # And back: the .pt converts to the same checkpoint.
    status, _, err = cli(capsys, "convert", tmp_path / "tutorial.pt", tmp_path / "back.safetensors", *SETS)
    assert status == 0, err
    again, back = checkpoint.load(tmp_path / "back.safetensors")
    assert all(np.array_equal(back[k], params[k]) for k in params)


def test_a_pt_export_of_a_nested_layout_is_refused(files, capsys):
    root, _, _ = files
    status, _, err = cli(capsys, "convert", root / "model.safetensors", root / "wmt.pt", "--to", "flax-wmt")
    assert status == 2 and "wmt.pt" in err and ".msgpack" in err, err
    assert not (root / "wmt.pt").exists()
