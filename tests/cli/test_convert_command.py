"""`rosetta convert | layouts | inspect | run`, through `conformance.cli.main`, on real files.

Also the safety promises: an unsafe pickle is refused before anything of it runs, the input
file is never modified, and a failed conversion leaves no output (not even a partial one).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.convert.layout import SWITCH_FIELDS

torch = pytest.importorskip("torch", reason="the CLI tests write PyTorch files")

import impl_numpy  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.cli.inspect import tensor_digest  # noqa: E402
from conformance.convert import import_state_dict, read_state_dict, readers  # noqa: E402
from conformance.convert.layout import LAYOUT_DIR  # noqa: E402
from systems import from_scratch, randomize_, torch_tutorial  # noqa: E402
from systems.harness import BACKEND_PARAMS, assert_matches_source, padded_batch, run_backend  # noqa: E402

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


@pytest.mark.parametrize("suffix", [".pth", ".bin"])
def test_pth_and_bin_files_are_pytorch_state_dicts(tmp_path, system, capsys, suffix):
    path = tmp_path / f"model{suffix}"
    torch.save(system.state_dict(), path)
    status, out, err = cli(capsys, "convert", path, tmp_path / "out.safetensors", "--set", "n_heads=2")
    assert status == 0, err
    assert "from-scratch (auto-detected)" in out
    config, params = checkpoint.load(tmp_path / "out.safetensors")
    expected_config, expected = import_state_dict(system.state_dict(), "from-scratch", n_heads=2)
    assert config == expected_config and config.notes["source_file"] == path.name
    assert all(params[k].tobytes() == expected[k].tobytes() for k in expected)
    status, out, _ = cli(capsys, "inspect", path)
    assert status == 0 and "keys match the built-in layout: from-scratch" in out


def test_convert_with_a_users_layout_file(tmp_path, system, capsys):
    """--layout mine.toml: a layout of the user's own, here the from-scratch system's under another
    name, with a training counter the layout drops."""
    text = (LAYOUT_DIR / "from-scratch.toml").read_text()
    text = text.replace('description = "', 'drop = ["steps"]\ndescription = "mine: ', 1)
    layout = tmp_path / "mine.toml"
    layout.write_text(text)
    state = dict(system.state_dict(), steps=torch.tensor(1000))
    torch.save(state, tmp_path / "model.pt")
    status, out, err = cli(capsys, "convert", tmp_path / "model.pt", tmp_path / "out.safetensors", "--layout", layout,
                           "--set", "n_heads=2")
    assert status == 0, err
    assert "layout: mine\n" in out and "dropped 1 key(s) the layout marks as not parameters: steps" in out
    config, params = checkpoint.load(tmp_path / "out.safetensors")
    expected_config, expected = import_state_dict(system.state_dict(), "from-scratch", n_heads=2)
    assert config == expected_config and config.notes["converted_from"] == "mine"
    assert all(params[k].tobytes() == expected[k].tobytes() for k in expected)
    # Without --layout the dropped key makes it fit no built-in layout.
    status, _, err = cli(capsys, "convert", tmp_path / "model.pt", tmp_path / "auto.safetensors", "--set", "n_heads=2")
    assert status == 2 and "unexpected: steps" in err


@pytest.mark.filterwarnings("ignore::UserWarning")  # nn.Transformer: norm_first, the tutorial's mixed masks
def test_torch_nn_transformer_needs_its_norm_placement_and_names_its_defaults(tmp_path, capsys):
    """nn.Transformer stores the same keys for norm_first=True and False, so the placement must be
    given; each other constructor argument the tensors cannot tell gets one line saying the value
    taken and how to change it."""
    model = randomize_(torch_tutorial.make(**SIZES, norm_first=True), seed=4)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    out_path = tmp_path / "out.safetensors"
    status, _, err = cli(capsys, "convert", tmp_path / "model.pt", out_path, "--set", "n_heads=2")
    assert status == 2 and "ModelConfig.norm_placement" in err, err
    assert "--set norm_placement=post|pre" in err and "norm_first=True" in err
    assert not out_path.exists()

    status, out, err = cli(capsys, "convert", tmp_path / "model.pt", out_path, "--set", "n_heads=2",
                           "--set", "norm_placement=pre", "--set", "layer_norm_eps=1e-5", "--set", "pad_id=1")
    assert status == 0, err
    lines = [line.strip() for line in out.splitlines()]
    defaulted = [line for line in lines if "(the layout's default" in line]
    assert [line.split(" ")[0] for line in defaulted] == ["activation=relu"], out
    assert "--set activation=gelu|gelu-tanh|silu|tanh if your model differs" in defaulted[0]
    assert "nn.Transformer(activation=...)" in defaulted[0]
    config, params = checkpoint.load(out_path)
    assert config.norm_placement == "pre" and config.notes["layout_defaults"] == "activation=relu"
    src, tgt = padded_batch(torch_tutorial.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    with torch.no_grad():
        reference = torch_tutorial.logits(model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    assert_matches_source(run_backend("numpy", config, params, src, tgt), reference, "pre-LN nn.Transformer")


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
    (["--set", "n_heads=two"], "expected an integer"),
    (["--set", "heads=2"], "ModelConfig.heads: is not a ModelConfig field"),
    (["--set", "n_heads=2", "--set", "mask_fill=-inf", "--set", "n_heads=4"],
     "ModelConfig.n_heads: given twice with different values: --set n_heads=2 and --set n_heads=4"),
    (["--set", "n_heads=2", "--set", "cross_attn_src_mask=true", "--set", "cross_attn_src_mask=no"],
     "--set cross_attn_src_mask=true and --set cross_attn_src_mask=no"),
    (["--set", "n_heads=2", "--layout", "llmhub"], "layout llmhub: the state dict does not fit"),
    (["--set", "n_heads=2", "--layout", "nonesuch"], "no built-in layout of that name"),
])
def test_a_failed_conversion_leaves_nothing(tmp_path, pt_file, capsys, argv, words):
    before = digest(pt_file)
    status, out, err = cli(capsys, "convert", pt_file, tmp_path / "out.safetensors", *argv)
    assert status == 2 and words in err, err
    assert leftovers(tmp_path, "model.pt") == [], "a failed conversion left a file behind"
    assert digest(pt_file) == before


@pytest.mark.parametrize("argv, named", [
    (["--set", "final_encoder_norm=false"], "--set final_encoder_norm=false"),
    (["--set", "final_encoder_norm=false", "--layout", "from-scratch"], "--set final_encoder_norm=false"),
    (["--set", "qkv_bias=true", "--set", "mask_fill=-inf", "--layout", "from-scratch"], "--set qkv_bias=true"),
    (["--set", "share_embeddings=true", "--set", "tie_output=true", "--layout", "from-scratch"],
     "--set share_embeddings=true, --set tie_output=true"),
])
def test_a_key_mismatch_names_the_overrides_that_changed_the_expected_keys(tmp_path, pt_file, capsys, argv, named):
    status, _, err = cli(capsys, "convert", pt_file, tmp_path / "out.safetensors", "--set", "n_heads=2", *argv)
    assert status == 2 and f"{named} change" in err and "which parameters the layout expects" in err, err
    assert "mask_fill" not in err  # not structural: it changes no key


def test_the_same_set_given_twice_is_fine(tmp_path, pt_file, capsys):
    status, _, err = cli(capsys, "convert", pt_file, tmp_path / "out.safetensors", "--set", "n_heads=2",
                         "--set", "cross_attn_src_mask=true", "--set", "cross_attn_src_mask=1", "--set", "n_heads=2")
    assert status == 0, err
    assert checkpoint.load(tmp_path / "out.safetensors")[0].cross_attn_src_mask


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


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_every_torch_load_is_weights_only(tmp_path, system, capsys, monkeypatch, suffix):
    """PyTorch 2.6+ defaults to weights_only=True; the readers must not rely on that default
    (an older PyTorch, or a changed default, would run the pickle)."""
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append((Path(sys._getframe(1).f_code.co_filename).resolve(), kwargs))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    path = tmp_path / f"model{suffix}"
    torch.save({"model": system.state_dict()}, path)
    read_state_dict(path, key="model")
    assert cli(capsys, "convert", path, tmp_path / "out.safetensors", "--key", "model", "--set", "n_heads=2")[0] == 0
    assert cli(capsys, "inspect", path, "--key", "model")[0] == 0
    ours = [kwargs for caller, kwargs in calls if caller == Path(readers.__file__).resolve()]
    assert len(ours) == 3, calls
    assert all(kwargs.get("weights_only") is True for kwargs in ours), ours


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
    assert "split axis 0 into 3" in out and "activation, layer_norm_eps\n" in out
    assert "required (--set): norm_placement, pad_id\n" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[keys]\n")
    status, _, err = cli(capsys, "layouts", bad)
    assert status == 2 and "[keys] must be a non-empty table" in err


def test_layouts_shows_every_switch_a_layout_implies(tmp_path, capsys):
    def switch_rows(out):
        lines = out.splitlines()
        start = lines.index("  switches (value, and where it comes from):") + 1
        end = next(i for i in range(start, len(lines)) if not lines[i].startswith("    "))
        return {line.split()[0]: line.split(None, 2)[1:] for line in lines[start:end]}

    status, out, _ = cli(capsys, "layouts", "hyunwoongko")
    assert status == 0
    rows = switch_rows(out)
    assert set(rows) == SWITCH_FIELDS  # every ModelConfig switch
    # The preset's switches, and ModelConfig's defaults for the ones the preset does not set.
    assert rows["layer_norm_eps"] == ["1e-12", "preset"] and rows["scale_embedding"] == ["false", "preset"]
    assert rows["mask_fill"] == ["-10000.0", "preset"] and rows["tgt_pad_mask"] == ["queries", "preset"]
    assert rows["activation"] == ["relu", "ModelConfig default"] and rows["qkv_bias"] == ["true", "ModelConfig default"]
    assert rows["pad_id"][0] == "1" and "free: --set pad_id=N" in rows["pad_id"][1]
    assert rows["position"] == ["sinusoid-interleaved", "preset"]

    status, out, _ = cli(capsys, "layouts", "torch-nn-transformer")
    assert status == 0
    rows = switch_rows(out)
    assert rows["norm_placement"][0] == "(--set)" and "required: --set norm_placement=post|pre" in rows["norm_placement"][1]
    assert "norm_first=True" in rows["norm_placement"][1]
    assert rows["position"][0] == "table" and "--set position=sinusoid-interleaved" in rows["position"][1]

    mine = tmp_path / "mine.toml"
    mine.write_text('matrices = "out-in"\n[switches]\nactivation = "gelu"\n[keys]\n"emb" = "encoder.embedding.weight"\n')
    status, out, _ = cli(capsys, "layouts", mine)
    assert status == 0 and "preset: (none: ModelConfig defaults)" in out
    assert switch_rows(out)["activation"] == ["gelu", "layout"]


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


def write_bad_npy(path, kind):
    if kind == "object":
        np.save(path, np.array([[1, "a"]], dtype=object), allow_pickle=True)
    elif kind == "corrupt":
        path.write_bytes(b"\x93NUMPY garbage")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "npz":
        with open(path, "wb") as f:
            np.savez(f, src=np.array([[3, 4]]))
    elif kind == "float":
        np.save(path, np.array([[3.0, 4.0]]))
    elif kind == "one-dimensional":
        np.save(path, np.array([3, 4]))


@pytest.mark.parametrize("kind, words", [
    ("object", "holds Python objects"), ("corrupt", "not a readable .npy file"), ("empty", "not a readable .npy file"),
    ("npz", "not a single array of ids"), ("float", "must hold integer token ids, got float64"),
    ("one-dimensional", "must be a (B, L) array of ids, got shape (2,)"),
])
def test_run_refuses_a_bad_npy_naming_the_argument(tmp_path, converted_checkpoint, capsys, kind, words):
    bad = tmp_path / "bad.npy"
    write_bad_npy(bad, kind)
    status, _, err = cli(capsys, "run", converted_checkpoint, "--backend", "numpy", "--src", bad, "--tgt", "1,2",
                         "--out", tmp_path / "run.npz")
    assert status == 2 and err.startswith(f"rosetta run: error: --src: {bad}") and words in err, err
    assert not (tmp_path / "run.npz").exists()


@pytest.mark.parametrize("src, words", [("1,2;3", "different lengths"), ("1,x", "expected ids"), ("1,99", "token id 99 out of range")])
def test_run_refuses_bad_ids_and_writes_nothing(tmp_path, converted_checkpoint, capsys, src, words):
    status, _, err = cli(capsys, "run", converted_checkpoint, "--backend", "numpy", "--src", src, "--tgt", "1,2",
                         "--out", tmp_path / "run.npz")
    assert status == 2 and words in err, err
    assert not (tmp_path / "run.npz").exists()


def test_convert_to_a_flat_layout_writes_its_state_dict(tmp_path, capsys):
    """`rosetta convert model.safetensors out.safetensors --to LAYOUT`: the foreign keys, no rosetta
    metadata; reading them back through the layout gives the same model."""
    from conformance import init_params, preset

    config = preset("annotated-transformer", src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=6, pad_id=2)
    params = init_params(config, seed=1, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    status, _, _ = cli(capsys, "convert", tmp_path / "model.safetensors", tmp_path / "at.safetensors", "--to",
                       "annotated-transformer")
    assert status == 0
    assert (tmp_path / "at.safetensors").stat().st_mode & 0o777 == 0o644, "readable like a checkpoint, not private"
    state = read_state_dict(tmp_path / "at.safetensors")
    assert "src_embed.0.lut.weight" in state
    back_config, back = import_state_dict(state, "annotated-transformer", n_heads=2, pad_id=2)
    assert back_config == config and all(np.array_equal(back[k], params[k]) for k in params)
    status, _, err = cli(capsys, "convert", tmp_path / "model.safetensors", tmp_path / "at.safetensors", "--to",
                         "annotated-transformer")
    assert status == 2 and "exists" in err, err


def test_an_export_the_system_lacks_keys_for_names_every_switch_and_key_at_once(tmp_path, capsys):
    """Shared and tied embeddings with no output bias, exported to torch-nn-transformer (separate
    embeddings, a generator with a bias): the file would lack three keys the wrapper loads, so the
    export refuses, naming all three switches (with their --set spelling) and the keys, in one run;
    with the switches said, it writes the file."""
    from conformance import init_params, preset

    config = preset("torch-nn-transformer", src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=12,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=6, share_embeddings=True, tie_output=True,
                    output_bias=False)
    checkpoint.save(tmp_path / "shared.safetensors", config, init_params(config, seed=1, dtype=np.float32))
    out = tmp_path / "tutorial.safetensors"
    status, _, err = cli(capsys, "convert", tmp_path / "shared.safetensors", out, "--to", "torch-nn-transformer")
    assert status == 2 and not out.exists(), err
    for words in ("--set output_bias=false", "--set share_embeddings=true", "--set tie_output=true",
                  "generator.bias", "generator.weight", "tgt_tok_emb.embedding.weight"):
        assert words in err, (words, err)
    status, _, err = cli(capsys, "convert", tmp_path / "shared.safetensors", out, "--to", "torch-nn-transformer",
                         "--set", "output_bias=false", "--set", "share_embeddings=true", "--set", "tie_output=true")
    assert status == 0, err
    assert "generator.weight" not in read_state_dict(out)
