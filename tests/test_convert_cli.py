"""`rosetta convert | layouts | inspect | run`, through `conformance.cli.main`, on real files.

Also the safety promises: an unsafe pickle is refused before anything of it runs, the input
file is never modified, and a failed conversion leaves no output (not even a partial one).
"""

from __future__ import annotations

import hashlib
import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CLI tests write PyTorch files")

import impl_numpy  # noqa: E402
from conformance import checkpoint  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.commands.inspect import tensor_digest  # noqa: E402
from conformance.convert import import_state_dict  # noqa: E402
from systems import from_scratch, randomize_  # noqa: E402
from systems.harness import BACKEND_PARAMS, run_backend  # noqa: E402

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=16, n_heads=2, d_ff=24, n_layers=2, max_len=12)


@pytest.fixture(scope="module")
def system():
    return randomize_(from_scratch.make(**SIZES), seed=2)


@pytest.fixture
def pt_file(tmp_path, system):
    path = tmp_path / "model.pt"
    torch.save(system.state_dict(), path)
    return path


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def leftovers(directory, *expected):
    return sorted(p.name for p in directory.iterdir() if p.name not in expected)


def cli(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


# -- convert -----------------------------------------------------------------------------------


def test_convert_a_pytorch_state_dict(tmp_path, pt_file, system, capsys):
    before = digest(pt_file)
    status, out, err = cli(capsys, "convert", pt_file, tmp_path / "out.safetensors", "--set", "n_heads=2")
    assert status == 0, err
    assert "from-scratch (auto-detected)" in out and "kept the stored table" in out
    config, params = checkpoint.load(tmp_path / "out.safetensors")
    expected_config, expected = import_state_dict(system.state_dict(), "from-scratch", n_heads=2)
    assert config == expected_config and config.notes["source_file"] == "model.pt"
    assert all(params[k].tobytes() == expected[k].tobytes() for k in expected)
    assert digest(pt_file) == before, "the input file was modified"
    assert leftovers(tmp_path, "model.pt", "out.safetensors") == []


def test_convert_safetensors_and_npz_with_explicit_layout_and_typed_sets(tmp_path, system, capsys):
    from safetensors.torch import save_file

    save_file(system.state_dict(), str(tmp_path / "model.safetensors"))
    np.savez(tmp_path / "model.npz", **{k: v.numpy() for k, v in system.state_dict().items()})
    outputs = []
    for name in ("model.safetensors", "model.npz"):
        out = tmp_path / f"{name}.rosetta.safetensors"
        status, _, err = cli(capsys, "convert", tmp_path / name, out, "--layout", "from-scratch", "--set", "n_heads=2",
                             "--set", "mask_fill=-inf", "--set", "cross_attn_src_mask=true", "--dtype", "float64")
        assert status == 0, err
        outputs.append(checkpoint.load(out))
    (a_config, a), (b_config, b) = outputs
    assert a_config == b_config and a_config.mask_fill == float("-inf") and a_config.cross_attn_src_mask
    assert all(a[k].dtype == np.float64 and a[k].tobytes() == b[k].tobytes() for k in a)


def test_a_nested_pytorch_checkpoint_needs_key(tmp_path, system, capsys):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": system.state_dict(), "epoch": 3}, path)
    status, _, err = cli(capsys, "convert", path, tmp_path / "out.safetensors", "--set", "n_heads=2")
    assert status == 2 and "--key NAME (candidates: model)" in err
    status, _, err = cli(capsys, "convert", path, tmp_path / "out.safetensors", "--set", "n_heads=2", "--key", "model")
    assert status == 0, err


@pytest.mark.parametrize("argv, words", [
    ([], "ModelConfig.n_heads: cannot be read from tensor shapes"),
    (["--set", "n_heads=2", "--set", "d_model=64"], "ModelConfig.d_model: 64 (given) contradicts encoder_embedding.weight"),
    (["--set", "n_heads=two"], "expected a int"),
    (["--set", "heads=2"], "ModelConfig.heads: is not a ModelConfig field"),
    (["--set", "n_heads=2", "--layout", "llmhub"], "layout llmhub: the state dict does not fit"),
    (["--set", "n_heads=2", "--layout", "nonesuch"], "no built-in layout of that name"),
])
def test_a_failed_conversion_leaves_nothing(tmp_path, pt_file, capsys, argv, words):
    before = digest(pt_file)
    status, out, err = cli(capsys, "convert", pt_file, tmp_path / "out.safetensors", *argv)
    assert status == 2 and words in err, err
    assert leftovers(tmp_path, "model.pt") == [], "a failed conversion left a file behind"
    assert digest(pt_file) == before


def test_a_failed_conversion_keeps_an_existing_output(tmp_path, pt_file, capsys):
    existing = tmp_path / "out.safetensors"
    existing.write_bytes(b"the previous checkpoint")
    status, _, _ = cli(capsys, "convert", pt_file, existing)  # n_heads missing
    assert status == 2 and existing.read_bytes() == b"the previous checkpoint"
    assert leftovers(tmp_path, "model.pt", "out.safetensors") == []


def test_no_matching_layout_lists_the_closest(tmp_path, system, capsys):
    state = {k: v for k, v in system.state_dict().items() if k != "fc_out.bias"}
    state["fc_out.scale"] = torch.ones(3)
    path = tmp_path / "odd.pt"
    torch.save(state, path)
    status, _, err = cli(capsys, "convert", path, tmp_path / "out.safetensors", "--set", "n_heads=2")
    assert status == 2
    assert "no built-in layout matches" in err and "from-scratch: 1 missing, 1 unexpected" in err
    assert "missing: fc_out.bias" in err and "unexpected: fc_out.scale" in err


def test_converting_never_writes_over_its_input(tmp_path, capsys):
    config, params = import_state_dict(randomize_(from_scratch.make(**SIZES), 3).state_dict(), "from-scratch", n_heads=2)
    path = tmp_path / "model.safetensors"
    checkpoint.save(path, config, params)
    before = digest(path)
    status, _, err = cli(capsys, "convert", path, path, "--set", "n_heads=2")
    assert status == 2 and "is the input file" in err and digest(path) == before
    status, _, err = cli(capsys, "convert", path, tmp_path / "out.pt", "--set", "n_heads=2")
    assert status == 2 and "*.safetensors" in err


class Exploit:
    """Unpickling this runs `os.system(...)`: exactly what weights_only=True must refuse."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("container", ["torch.save", "raw pickle"])
def test_an_unsafe_pickle_is_refused_before_it_runs(tmp_path, capsys, container):
    marker = tmp_path / "exploited"
    path = tmp_path / "evil.pt"
    if container == "torch.save":
        torch.save({"encoder_embedding.weight": torch.zeros(2, 2), "trap": Exploit(marker)}, path)
    else:  # a bare pickle in the protocol torch.load reads, no tensors at all
        path.write_bytes(pickle.dumps({"trap": Exploit(marker)}, protocol=2))
    before = digest(path)
    for argv in (["convert", path, tmp_path / "out.safetensors", "--set", "n_heads=2"], ["inspect", path]):
        status, _, err = cli(capsys, *argv)
        assert status == 2 and f"{path}: refused" in err and "posix.system" in err, err
    assert not marker.exists(), "the pickle's code ran"
    assert digest(path) == before and leftovers(tmp_path, "evil.pt") == []


def test_a_pickled_module_is_refused(tmp_path, system, capsys):
    path = tmp_path / "whole.pt"
    torch.save(system, path)
    status, _, err = cli(capsys, "convert", path, tmp_path / "out.safetensors", "--set", "n_heads=2")
    assert status == 2 and "refused" in err and "state dict" in err


def test_unreadable_files_are_named(tmp_path, capsys):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a pickle at all")
    status, _, err = cli(capsys, "convert", garbage, tmp_path / "o.safetensors")
    assert status == 2 and str(garbage) in err
    status, _, err = cli(capsys, "convert", tmp_path / "absent.npz", tmp_path / "o.safetensors")
    assert status == 2 and "no such file" in err
    status, _, err = cli(capsys, "convert", tmp_path / "model.onnx", tmp_path / "o.safetensors")
    assert status == 2 and "unknown file type '.onnx'" in err


# -- layouts and inspect -----------------------------------------------------------------------


def test_layouts_lists_and_explains(tmp_path, capsys):
    status, out, _ = cli(capsys, "layouts")
    assert status == 0
    for name in ("torch-nn-transformer", "hf-marian", "annotated-transformer", "from-scratch", "llmhub",
                 "hyunwoongko", "sublayer-norm", "pre-ln-tutorial"):
        assert name in out
    status, out, _ = cli(capsys, "layouts", "torch-nn-transformer")
    assert status == 0 and "transformer.encoder.layers.{i}.self_attn.in_proj_{w:weight|bias}" in out
    assert "split axis 0 into 3" in out and "free (the user's to set): activation, layer_norm_eps, norm_placement, pad_id" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[keys]\n")
    status, _, err = cli(capsys, "layouts", bad)
    assert status == 2 and "[keys] must be a non-empty table" in err


def test_inspect_a_rosetta_checkpoint(tmp_path, pt_file, capsys):
    out_path = tmp_path / "out.safetensors"
    assert cli(capsys, "convert", pt_file, out_path, "--set", "n_heads=2")[0] == 0
    status, out, _ = cli(capsys, "inspect", out_path)
    config, params = checkpoint.load(out_path)
    assert status == 0
    assert "rosetta checkpoint, format_version 1: valid" in out and config.summary() in out
    assert "encoder.layers.1.ffn.linear1.weight" in out and "16x24" in out
    assert f"total: {len(params)} tensors, {sum(v.size for v in params.values()):,} values" in out
    assert f"sha256 (tensors): {tensor_digest(params)}" in out


def test_inspect_foreign_files_without_running_them(tmp_path, system, capsys):
    from safetensors.torch import save_file

    state = system.state_dict()
    save_file(state, str(tmp_path / "foreign.safetensors"), metadata={"producer": "someone"})
    torch.save(dict(reversed(list(state.items()))), tmp_path / "foreign.pt")
    outputs = {}
    for name in ("foreign.safetensors", "foreign.pt"):
        status, out, _ = cli(capsys, "inspect", tmp_path / name)
        assert status == 0 and "not a rosetta checkpoint" in out
        assert "keys match the built-in layout: from-scratch" in out
        outputs[name] = next(line for line in out.splitlines() if "sha256 (tensors)" in line)
    # The digest is of the tensors, not the container or its order.
    assert outputs["foreign.safetensors"] == outputs["foreign.pt"]


def test_inspect_reports_a_damaged_checkpoint(tmp_path, pt_file, capsys):
    out_path = tmp_path / "out.safetensors"
    assert cli(capsys, "convert", pt_file, out_path, "--set", "n_heads=2")[0] == 0
    data = bytearray(out_path.read_bytes())
    data[-3] ^= 0xFF
    out_path.write_bytes(bytes(data))
    status, _, err = cli(capsys, "inspect", out_path)
    assert status == 2 and "sha256 digest does not match" in err


# -- run ---------------------------------------------------------------------------------------


@pytest.fixture
def converted_checkpoint(tmp_path, pt_file, capsys):
    path = tmp_path / "model.safetensors"
    assert cli(capsys, "convert", pt_file, path, "--set", "n_heads=2")[0] == 0
    return path


def test_run_writes_logits_and_attention(tmp_path, converted_checkpoint, capsys):
    np.save(tmp_path / "src.npy", np.array([[3, 4, 5, 0], [6, 7, 0, 0]]))
    status, out, err = cli(capsys, "run", converted_checkpoint, "--backend", "numpy", "--src", tmp_path / "src.npy",
                           "--tgt", "1,2,3;4,5,0", "--out", tmp_path / "run.npz", "--intermediates")
    assert status == 0, err
    result = np.load(tmp_path / "run.npz", allow_pickle=False)
    config, params = checkpoint.load(converted_checkpoint)
    expected = impl_numpy.Model(config, params, dtype="float32")(np.array([[3, 4, 5, 0], [6, 7, 0, 0]]),
                                                                  np.array([[1, 2, 3], [4, 5, 0]]))
    assert result["logits"].dtype == np.float32 and result["logits"].tobytes() == expected.logits.tobytes()
    assert sorted(k for k in result.files if k.startswith("attention/")) == sorted(f"attention/{k}" for k in expected.attention)
    np.testing.assert_array_equal(result["attention/decoder.1.cross"], expected.attention["decoder.1.cross"])
    assert "intermediates/encoder.output" in result.files and str(result["config"]) == config.to_json()
    assert "logits (2, 3, 19)" in out


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_run_on_each_backend(tmp_path, converted_checkpoint, capsys, backend):
    status, _, err = cli(capsys, "run", converted_checkpoint, "--backend", backend, "--src", "3,4,5,0;6,7,0,0",
                         "--tgt", "1,2,3;4,5,0", "--out", tmp_path / f"{backend}.npz")
    assert status == 0, err
    config, params = checkpoint.load(converted_checkpoint)
    src, tgt = np.array([[3, 4, 5, 0], [6, 7, 0, 0]]), np.array([[1, 2, 3], [4, 5, 0]])
    expected = run_backend(backend, config, params, src, tgt)
    np.testing.assert_array_equal(np.load(tmp_path / f"{backend}.npz")["logits"], expected)


@pytest.mark.parametrize("src, words", [("1,2;3", "different lengths"), ("1,x", "expected ids"), ("1,99", "token id 99 out of range")])
def test_run_refuses_bad_ids_and_writes_nothing(tmp_path, converted_checkpoint, capsys, src, words):
    status, _, err = cli(capsys, "run", converted_checkpoint, "--backend", "numpy", "--src", src, "--tgt", "1,2",
                         "--out", tmp_path / "run.npz")
    assert status == 2 and words in err, err
    assert not (tmp_path / "run.npz").exists()
