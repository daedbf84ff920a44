"""One backend surface: the three packages offer the same names with the same signatures, and
the tools build, scope and report every backend through that surface alone."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from conformance import InputError, init_params, preset
from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.surface import BACKEND_API

PACKAGES = {name: backends.import_backend(name) for name in backends.BACKENDS}
CONFIG = preset("paper", src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=16,
                n_encoder_layers=1, n_decoder_layers=1, max_len=8, pad_id=0)
ROOT = Path(__file__).resolve().parents[2]


def test_the_three_public_surfaces_are_equal():
    surfaces = {name: list(module.__all__) for name, module in PACKAGES.items()}
    assert surfaces["numpy"] == surfaces["torch"] == surfaces["jax"] == list(BACKEND_API), surfaces
    for name, module in PACKAGES.items():
        missing = [n for n in [*module.__all__, *module.BACKEND_EXTRAS] if not hasattr(module, n)]
        assert not missing, f"impl_{name} lists names it does not have: {missing}"
        assert not set(module.BACKEND_EXTRAS) & set(module.__all__), "an extra is not part of the shared surface"


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_model_and_load_take_config_params_dtype_then_keyword_only_device(backend):
    module = PACKAGES[backend]
    # (from __init__: an nnx.Module's metaclass hides its constructor's signature behind *args)
    model = {k: v for k, v in inspect.signature(module.Model.__init__).parameters.items() if k != "self"}
    assert list(model)[:3] == ["config", "params", "dtype"]
    assert model["params"].default is None and model["dtype"].default is None
    assert model["device"].kind is inspect.Parameter.KEYWORD_ONLY and model["device"].default is None
    extras = [p for p in list(model)[3:] if model[p].kind is not inspect.Parameter.KEYWORD_ONLY]
    assert not extras, f"backend extras must be keyword-only: {extras}"
    load = inspect.signature(module.load).parameters
    assert list(load)[:2] == ["path", "dtype"] and load["dtype"].default is None
    assert load["device"].kind is inspect.Parameter.KEYWORD_ONLY and load["device"].default is None


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_supported_dtypes_are_read_from_the_backend(backend):
    assert backends.dtypes(backend) == list(PACKAGES[backend].SUPPORTED_DTYPES)


def test_no_tool_repeats_a_backend_dtype_list_or_branches_per_backend_to_build():
    """The tools read `SUPPORTED_DTYPES`; `build` is one call with no per-backend branch."""
    literal = '"float32", "float64", "float16", "bfloat16"'
    for path in [*(ROOT / "conformance" / "check").glob("*.py"), *(ROOT / "conformance" / "suite").glob("*.py")]:
        assert literal not in path.read_text(), f"{path} repeats a dtype list: read SUPPORTED_DTYPES"
    source = inspect.getsource(backends.build)
    assert not any(f'"{name}"' in source for name in backends.BACKENDS) and "kind(" not in source


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_build_and_load_on_the_cpu(backend, tmp_path):
    from conformance import checkpoint

    model = backends.build(Target(backend, "cpu", "float32"), CONFIG, init_params(CONFIG))
    src, tgt = np.array([[3, 4, 0]]), np.array([[1, 5]])
    expected = PACKAGES["numpy"].Model(CONFIG, init_params(CONFIG), "float32")(src, tgt).logits
    with backends.full_precision(backend):
        np.testing.assert_allclose(PACKAGES[backend].to_numpy(model(src, tgt).logits), expected, atol=1e-5)
    checkpoint.save(tmp_path / "m.safetensors", CONFIG, init_params(CONFIG))
    loaded = PACKAGES[backend].load(tmp_path / "m.safetensors", "float32", device="cpu")
    assert loaded.config == CONFIG
    assert "cpu" in str(loaded.device).lower()


# (backend, device) pairs that are refused here: unknown to the backend, or absent on this machine.
REFUSED = [("numpy", "cuda"), ("numpy", "gpu"), ("torch", "gpu"), ("torch", "tpu"), ("jax", "cuda"), ("jax", "tpu")]
ABSENT = [("torch", "cuda", "torch.cuda.is_available"), ("jax", "gpu", "jax.devices('gpu')")]


@pytest.mark.parametrize("backend, device", REFUSED)
def test_a_device_the_backend_does_not_know_is_an_input_error(backend, device):
    with pytest.raises(InputError) as caught:
        PACKAGES[backend].Model(CONFIG, init_params(CONFIG), "float32", device=device)
    assert caught.value.argument == "device" and repr(device) in str(caught.value) or device in str(caught.value)


@pytest.mark.parametrize("backend, device, probe", ABSENT)
def test_an_absent_accelerator_is_an_input_error_that_says_so(backend, device, probe):
    if device in backends.present_devices(backend):
        pytest.skip(f"{backend} has a {device} device here: nothing absent to refuse")
    with pytest.raises(InputError) as caught:
        PACKAGES[backend].Model(CONFIG, init_params(CONFIG), "float32", device=device)
    assert caught.value.argument == "device"
    assert "not available" in str(caught.value) and device in str(caught.value)


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_an_output_prints_as_shapes_not_values(backend):
    """`print(model(src, tgt))` shows each tensor's shape and dtype, as Hugging Face outputs do,
    not tens of thousands of characters of values; the same lines from every backend."""
    model = backends.build(Target(backend, "cpu", "float32"), CONFIG, init_params(CONFIG, seed=0))
    src, tgt = np.array([[3, 4, 5, 0]]), np.array([[1, 6, 7]])
    text = repr(model(src, tgt))
    assert len(text) < 2000 and "logits=(1, 3, 11) float32," in text, text
    assert "'decoder.0.cross': (1, 2, 3, 4) float32," in text and "'encoder.output': (1, 4, 8) float32," in text
    assert "e-" not in text and "array" not in text and "tensor" not in text, text
    assert repr(model.encode(src)).startswith("Encoded(\n  memory=(1, 4, 8) float32,")
