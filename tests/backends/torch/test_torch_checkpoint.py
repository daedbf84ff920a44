"""Checkpoints through impl_torch: load, save, and nothing changes by a single bit.

checkpoint -> impl_torch.load -> impl_torch.save -> checkpoint is byte-identical in every dtype,
and a dtype cast on load gives exactly the weights NumPy's `astype` gives every other backend.
"""

import hashlib

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from conformance import CheckpointError, init_params, preset  # noqa: E402
from conformance.core import checkpoint


NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CONFIGS = {
    "marian (shared, tied, final_logits_bias)": preset("hf-marian", d_model=16, n_heads=2, d_ff=32, max_len=8),
    "stored position tables, no biases": preset("default", position="table", qkv_bias=False, out_proj_bias=False,
                                                 output_bias=False, notes={"layout": "test"}),
}


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(path, config, dtype, seed=0):
    params = {k: v.astype(NUMPY_DTYPES[dtype]) for k, v in init_params(config, seed=seed).items()}
    checkpoint.save(path, config, params)
    return params


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
def test_checkpoint_round_trip_is_bit_exact(tmp_path, dtype, config_name):
    config = CONFIGS[config_name]
    original = tmp_path / "original.safetensors"
    params = write(original, config, dtype)
    model = impl_torch.load(original)
    assert model.dtype == getattr(torch, dtype) and model.config == config and model.config.notes == config.notes
    for name, value in params.items():  # the weights in memory are the stored bits
        got = impl_torch.to_numpy(model.state_dict()[name])
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), name
    again = tmp_path / "again.safetensors"
    impl_torch.save(model, again)
    assert digest(again) == digest(original)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_cast_on_load_rounds_as_numpy_does(tmp_path, dtype):
    """float64 checkpoint loaded as `dtype` == the float64 weights cast by NumPy (correct rounding:
    torch's own float64 -> float16 cast rounds twice and differs in about one value in 10^4)."""
    # Big enough (287k weights) that torch's double rounding hits some of them in float16.
    config = preset("default", d_model=64, d_ff=256, src_vocab_size=256, tgt_vocab_size=256, position="table")
    if dtype == "float16":
        double_rounded = sum(int((torch.from_numpy(v).half().numpy() != v.astype(np.float16)).sum())
                             for v in init_params(config).values())
        assert double_rounded > 0, "the config no longer tells a correct cast from torch's own"
    write(tmp_path / "f64.safetensors", config, "float64")
    write(tmp_path / "direct.safetensors", config, dtype)
    impl_torch.save(impl_torch.load(tmp_path / "f64.safetensors", dtype=getattr(torch, dtype)), tmp_path / "cast.safetensors")
    _, cast = checkpoint.load(tmp_path / "cast.safetensors")
    _, direct = checkpoint.load(tmp_path / "direct.safetensors")
    for name, value in direct.items():
        differ = int((cast[name].view(np.uint8) != value.view(np.uint8)).sum())
        assert differ == 0, f"{name}: {differ} byte(s) differ from NumPy's astype({dtype})"
    assert digest(tmp_path / "cast.safetensors") == digest(tmp_path / "direct.safetensors")


def test_a_model_changed_in_torch_goes_to_numpy_intact(tmp_path):
    """The hand-off: train (here: one SGD step) in PyTorch, save, run the same weights in NumPy."""
    config = preset("default")
    model = impl_torch.Model(config, dtype=torch.float64)
    src = np.array([[3, 4, 5, 0], [6, 7, 8, 9]])
    tgt = np.array([[1, 2, 3], [4, 5, 0]])
    loss = model(src, tgt, return_attention=False).logits.logsumexp(-1).mean()
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            assert parameter.grad is not None and parameter.grad.isfinite().all()
            parameter -= 0.1 * parameter.grad
    path = tmp_path / "trained.safetensors"
    impl_torch.save(model, path)
    loaded_config, params = checkpoint.load(path)
    assert loaded_config == config
    for name, value in model.state_dict().items():
        assert np.array_equal(params[name], value.numpy()), name
    with torch.inference_mode():
        expected = model(src, tgt).logits.numpy()
    np.testing.assert_allclose(impl_numpy.Model(config, params)(src, tgt).logits, expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(impl_numpy.Model(config, init_params(config))(src, tgt).logits, expected)


def test_save_after_to_dtype_writes_the_new_dtype(tmp_path):
    config = preset("default")
    model = impl_torch.Model(config, dtype=torch.float32).to(torch.bfloat16)
    impl_torch.save(model, tmp_path / "bf16.safetensors")
    _, params = checkpoint.load(tmp_path / "bf16.safetensors")
    assert {v.dtype for v in params.values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_loading_a_bad_file_is_the_shared_checkpoint_error(tmp_path):
    path = tmp_path / "broken.safetensors"
    write(path, preset("default"), "float32")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the data: the digest catches it
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as torch_error:
        impl_torch.load(path)
    with pytest.raises(CheckpointError) as numpy_error:
        impl_numpy.load(path)
    assert str(torch_error.value) == str(numpy_error.value)
