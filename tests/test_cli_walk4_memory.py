"""A config whose parameters cannot fit in the memory this process can hold is refused before anything is
allocated (issue 45, item 6): a typed error that says how much the parameters need and what
the machine has, the same from `init_params` and from every backend's `Model(config)`, and a
checkpoint file larger than the memory is refused before its data is read.
"""

from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.core import checkpoint
from conformance.core.errors import CheckpointError, ConfigError, InputError, TooLargeError
from conformance.core.memory import memory_limit
from conformance.core.params import check_numpy_params, param_bytes, param_count, param_shapes
from systems.harness import BACKEND_PARAMS


def huge():
    return preset("paper", n_encoder_layers=10**9)


def test_memory_limit_is_known_here():
    limit, source = memory_limit()
    assert limit is not None and limit > 2**20 and source


@pytest.mark.parametrize("config", [preset("paper"), preset("hf-bart", n_decoder_layers=3, tgt_vocab_size=999, src_vocab_size=999),
                                    preset("hf-t5", d_model=64, n_heads=2, d_ff=32)], ids=["paper", "bart", "t5"])
def test_param_bytes_counts_every_value_without_building_the_names(config):
    values = sum(int(np.prod(shape)) for shape in param_shapes(config).values())
    assert param_bytes(config, np.float32) == 4 * values and param_bytes(config, np.float64) == 8 * values
    assert param_bytes(config, "bfloat16") == 2 * values


def test_init_params_refuses_a_config_that_cannot_fit_before_allocating():
    started = time.monotonic()
    with pytest.raises(TooLargeError) as caught:
        init_params(huge())
    assert time.monotonic() - started < 2, "refused at once, not after building 10**9 layers' names"
    error = caught.value
    assert isinstance(error, ConfigError) and isinstance(error, MemoryError)
    assert error.field == "n_encoder_layers" and error.needed > error.limit
    assert error.needed == param_bytes(huge(), np.float64)
    message = str(error)
    assert "ModelConfig.n_encoder_layers" in message and "1000000000" in message, message
    assert "float64" in message and "TB" in message and "cannot fit" in message, message


def test_the_blamed_field_is_the_one_that_makes_the_parameters_large():
    with pytest.raises(TooLargeError) as caught:
        init_params(preset("torch-nn-transformer", tgt_vocab_size=10**11), dtype=np.float32)
    assert caught.value.field == "tgt_vocab_size"
    assert "float32" in str(caught.value)


def test_a_config_that_fits_is_drawn_as_before():
    config = preset("paper", d_model=16, n_heads=2, d_ff=32, src_vocab_size=20, tgt_vocab_size=20)
    params = init_params(config, seed=3, dtype=np.float32)
    assert sum(v.nbytes for v in params.values()) == param_bytes(config, np.float32)


def _backend_model(backend):
    if backend == "numpy":
        import impl_numpy

        return impl_numpy.Model
    if backend == "torch":
        import impl_torch

        return impl_torch.Model
    import impl_jax

    return impl_jax.Model


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_every_backend_refuses_it_the_same_way(backend):
    with pytest.raises(TooLargeError) as caught:
        _backend_model(backend)(huge())
    assert caught.value.field == "n_encoder_layers" and caught.value.needed == param_bytes(huge(), np.float64)


def test_params_given_for_a_huge_config_are_counted_before_their_names_are_built():
    started = time.monotonic()
    with pytest.raises(InputError, match=r"calls for [0-9,]+ parameters, 3 are given"):
        check_numpy_params(huge(), {"a": np.zeros(1), "b": np.zeros(1), "c": np.zeros(1)})
    assert time.monotonic() - started < 2
    assert param_count(huge()) > 10**9


def test_a_checkpoint_larger_than_memory_is_refused_before_its_data_is_read(tmp_path):
    """A sparse file: its header describes one tensor bigger than the machine's memory, its data
    section is holes (nothing is written to disk)."""
    limit, _ = memory_limit()
    count = limit // 4 + 1024  # float32 values
    header = json.dumps({"__metadata__": {"format": "rosetta-transformer"},
                         "w": {"dtype": "F32", "shape": [count], "data_offsets": [0, 4 * count]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * count)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        checkpoint.read_tensors(path)
    assert time.monotonic() - started < 2
    assert "cannot fit in the memory this process can hold" in str(caught.value) and str(path) in str(caught.value)


def test_an_address_space_limit_is_the_limit(tmp_path):
    """Under `ulimit -v 4G`, 6 GB of float64 parameters (which physical memory may hold) cannot fit."""
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))\n"
            "from conformance import init_params, preset\n"
            "from conformance.core.errors import TooLargeError\n"
            "from conformance.core.memory import memory_limit\n"
            "assert memory_limit() == (4 << 30, 'the address-space limit (ulimit -v)'), memory_limit()\n"
            "try:\n"
            "    init_params(preset('paper', d_model=1024, n_heads=16, d_ff=4096, n_encoder_layers=60))\n"
            "except TooLargeError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "n_encoder_layers=60" in result.stdout and "4.29 GB of the address-space limit (ulimit -v)" in result.stdout
