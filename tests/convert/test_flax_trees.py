"""Flax parameter trees in, and Flax files out: nested dicts, `nnx.State`, msgpack, Orbax.

A linen examples/wmt model (tests/systems/flax_wmt.py, random weights) is handed over in every
form a JAX user keeps it, converted with the layout detected from its keys, and must give the
same canonical parameters; through `rosetta convert` and `rosetta run` its logits match wmt's on
every backend. A corrupt or foreign file is a `CheckpointError` naming it.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="Flax trees need flax")
pytest.importorskip("orbax.checkpoint", reason="Orbax checkpoints need orbax-checkpoint")

from flax import nnx, serialization, traverse_util  # noqa: E402

from conformance.cli import main  # noqa: E402
from conformance.convert import import_state_dict, read_state_dict  # noqa: E402
from conformance.convert.trees import write_msgpack, write_orbax  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import CheckpointError  # noqa: E402
from systems import flax_wmt as wmt  # noqa: E402
from systems.harness import BACKEND_PARAMS, assert_matches_source, padded_batch  # noqa: E402

MAX_LEN = 12
CONFIG = wmt.WmtConfig(vocab_size=17, output_vocab_size=17, share_embeddings=True, logits_via_embedding=True,
                       emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=24, num_layers=1, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def tree():
    return wmt.init(CONFIG, seed=5)


@pytest.fixture(scope="module")
def expected(tree):
    return import_state_dict(traverse_util.flatten_dict(tree, sep="."), "flax-wmt", max_len=MAX_LEN)


def same(a, b):
    (config_a, params_a), (config_b, params_b) = a, b
    assert config_a == config_b
    assert sorted(params_a) == sorted(params_b)
    for key in params_a:
        assert np.array_equal(params_a[key], params_b[key]), key


def test_nested_dict_variables_and_nnx_state_import_alike(tree, expected):
    same(import_state_dict(tree, max_len=MAX_LEN), expected)  # linen variables["params"], auto-detected
    same(import_state_dict({"params": tree}, max_len=MAX_LEN), expected)  # the whole variables dict
    same(import_state_dict(nnx.State(tree), max_len=MAX_LEN), expected)


def test_msgpack_and_orbax_files_read_to_the_same_keys(tmp_path, tree):
    flat = traverse_util.flatten_dict(tree, sep=".")
    (tmp_path / "model.msgpack").write_bytes(serialization.to_bytes(tree))
    write_orbax(tmp_path / "ckpt", {"params": tree, "step": np.array(7)})
    from_msgpack = read_state_dict(tmp_path / "model.msgpack")
    from_orbax = read_state_dict(tmp_path / "ckpt", key="params")
    for read in (from_msgpack, from_orbax):
        assert sorted(read) == sorted(flat)
        for key in flat:
            assert read[key].dtype == flat[key].dtype and np.array_equal(read[key], flat[key]), key
    whole = read_state_dict(tmp_path / "ckpt")  # a training state: --key params selects the parameters
    assert "step" in whole and f"params.{sorted(flat)[0]}" in whole


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_orbax_checkpoint_converts_and_runs_on_every_backend(tmp_path, capsys, tree, backend):
    write_orbax(tmp_path / "ckpt", tree)
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "keys match the built-in layout: flax-wmt" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"), "--set", "max_len=12"]) == 0
    src, tgt = padded_batch(0, CONFIG.vocab_size, CONFIG.output_vocab_size, seed=6)
    shifted = np.pad(tgt, ((0, 0), (1, 0)))[:, :-1]
    np.save(tmp_path / "src.npy", src)
    np.save(tmp_path / "tgt.npy", shifted)
    out = tmp_path / "out.npz"
    assert main(["run", str(tmp_path / "model.safetensors"), "--backend", backend, "--src", str(tmp_path / "src.npy"),
                 "--tgt", str(tmp_path / "tgt.npy"), "--out", str(out)]) == 0
    with np.load(out) as result:
        logits = result["logits"]
    source = wmt.apply(CONFIG, tree, src, tgt)
    real = tgt > 0
    result = assert_matches_source(logits[real], source[real], f"rosetta run {backend} vs examples/wmt")
    print(f"Orbax -> rosetta convert -> rosetta run {backend}: {result.describe()}")


def test_corrupt_and_foreign_files_name_themselves(tmp_path):
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"\xc1 not msgpack")
    with pytest.raises(CheckpointError, match="bad.msgpack.*not a readable Flax msgpack"):
        read_state_dict(bad)
    scalar = tmp_path / "scalar.msgpack"
    scalar.write_bytes(serialization.msgpack_serialize([1, 2]))
    with pytest.raises(CheckpointError, match="scalar.msgpack"):
        read_state_dict(scalar)
    fake = tmp_path / "fake_ckpt"
    fake.mkdir()
    (fake / "_CHECKPOINT_METADATA").write_text("{not json")
    with pytest.raises(CheckpointError, match="fake_ckpt.*not a readable Orbax checkpoint"):
        read_state_dict(fake)
    plain = tmp_path / "plain_dir"
    plain.mkdir()
    with pytest.raises(CheckpointError, match="plain_dir.*neither a model folder.*nor an Orbax checkpoint"):
        read_state_dict(plain)


def test_a_model_trained_in_pytorch_exports_to_wmt_files_that_reproduce_its_logits(tmp_path, capsys):
    """Trained a few steps with torch autograd, saved as a rosetta checkpoint, then written out
    with `rosetta convert --to flax-wmt` as msgpack and as Orbax; wmt's apply on either file
    gives the torch model's logits."""
    import torch

    import impl_torch
    from conformance import init_params, preset

    config = preset("flax-wmt", src_vocab_size=17, tgt_vocab_size=17, d_model=16, n_heads=2, d_ff=24,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=MAX_LEN, share_embeddings=True,
                    tie_output=True, output_bias=False, scale_logits=True)
    model = impl_torch.Model(config, init_params(config, seed=3, dtype=np.float32))
    src, tgt = padded_batch(0, 17, 17, seed=8)
    shifted = np.pad(tgt, ((0, 0), (1, 0)))[:, :-1]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        logits = model(src, shifted, return_attention=False).logits
        loss = torch.nn.functional.cross_entropy(logits[tgt > 0], torch.as_tensor(tgt[tgt > 0]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    params = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    checkpoint.save(tmp_path / "trained.safetensors", config, params)
    with torch.no_grad():
        ours = model(src, shifted).logits.numpy()

    wmt_config = wmt.WmtConfig(vocab_size=17, output_vocab_size=17, share_embeddings=True, logits_via_embedding=True,
                               emb_dim=16, num_heads=2, qkv_dim=16, mlp_dim=24, num_layers=1, max_len=MAX_LEN)
    real = tgt > 0
    for out in (tmp_path / "trained.msgpack", tmp_path / "trained_orbax"):
        assert main(["convert", str(tmp_path / "trained.safetensors"), str(out), "--to", "flax-wmt"]) == 0
        if out.suffix == ".msgpack":
            tree = serialization.msgpack_restore(out.read_bytes())
        else:
            import orbax.checkpoint as ocp

            tree = ocp.StandardCheckpointer().restore(out.resolve())
        source = wmt.apply(wmt_config, tree, src, tgt)
        assert_matches_source(ours[real], source[real], f"torch-trained model vs examples/wmt from {out.name}")
    capsys.readouterr()
