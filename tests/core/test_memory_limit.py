"""A config whose parameters cannot fit in the memory this process can hold is refused before anything is
allocated (issue 45, item 6): a typed error that says how much the parameters need and what
the machine has, the same from `init_params` and from every backend's `Model(config)`, and a
checkpoint file larger than the memory is refused before its data is read.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

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


@pytest.mark.parametrize("name, config", [
    ("d_ff", preset("paper", d_ff=10**9)),
    ("d_model", preset("paper", d_model=2**20)),
    ("d_head", preset("hf-t5", d_head=10**9)),
    ("relative_buckets", preset("hf-t5", relative_buckets=10**12, relative_max_distance=10**12)),
    ("src_vocab_size", preset("torch-nn-transformer", src_vocab_size=10**11)),
    ("n_decoder_layers", preset("paper", n_decoder_layers=10**7)),
], ids=lambda value: value if isinstance(value, str) else "config")
def test_the_blame_falls_on_the_size_that_is_large_not_on_a_layer_count(name, config):
    """A weight is a product of sizes: d_ff=10**9 makes each of the six layers large, and it, not
    n_decoder_layers, is what the user must change."""
    with pytest.raises(TooLargeError) as caught:
        init_params(config, dtype=np.float32)
    assert caught.value.field == name, str(caught.value)
    assert f"{name}={getattr(config, name)} gives parameters" in str(caught.value)


def test_the_sizes_live_in_their_own_module_and_params_still_answers_for_them():
    from conformance.core import params, sizes

    assert params.param_count is sizes.param_count and params.param_bytes is sizes.param_bytes
    assert params.init_params.__module__ == "conformance.core.params"
    assert len(Path(params.__file__).read_text().splitlines()) <= 400


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
    """Under `ulimit -v` (half of what this machine can hold, at most 4 GiB) a config needing more
    than that, which memory may hold, cannot fit. The limit is chosen from the machine, so the
    test holds on a small runner too."""
    import subprocess
    import sys

    code = ("import resource\n"
            "from conformance import init_params, preset\n"
            "from conformance.core.errors import TooLargeError\n"
            "from conformance.core.memory import memory_limit, size_words\n"
            "from conformance.core.sizes import param_bytes\n"
            "limit = min(4 << 30, memory_limit()[0] // 2)\n"
            "if limit < 1 << 30:\n"
            "    print('SKIP', limit); raise SystemExit(0)\n"
            "resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))\n"
            "assert memory_limit() == (limit, 'the address-space limit (ulimit -v)'), memory_limit()\n"
            "small = preset('paper', d_model=16, n_heads=2, d_ff=32, src_vocab_size=20, tgt_vocab_size=20)\n"
            "per_layer = param_bytes(small.replace(n_encoder_layers=7), 'float64') - param_bytes(small.replace(n_encoder_layers=6), 'float64')\n"
            "layers = limit // per_layer + 1\n"
            "try:\n"
            "    init_params(small.replace(n_encoder_layers=layers))\n"
            "except TooLargeError as error:\n"
            "    print(layers, size_words(limit)); print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("SKIP"):
        pytest.skip(f"this machine holds too little for a safe address-space limit ({result.stdout.strip()})")
    first, message = result.stdout.split("\n", 1)
    layers, limit_words = first.split(" ", 1)
    assert f"n_encoder_layers={layers} gives parameters" in message, result.stdout
    assert f"{limit_words} of the address-space limit (ulimit -v)" in message, result.stdout


# -- what memory_limit reads: swap, cgroups v1 and v2, a malformed /proc/self/cgroup -------------

GIB = 1 << 30


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fake /proc and /sys/fs/cgroup: `machine(swap=..., cgroup=..., files={...})`."""
    from conformance.core import memory

    def make(swap_kb: int = 0, cgroup: str = "", files: dict[str, str] | None = None):
        (tmp_path / "meminfo").write_text(f"MemTotal:       16384000 kB\nSwapTotal:      {swap_kb} kB\n")
        (tmp_path / "cgroup").write_text(cgroup)
        for name, text in (files or {}).items():
            (tmp_path / "sys" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "sys" / name).write_text(text)
        monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
        monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "cgroup")
        monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "sys")
        return memory

    return make


def _physical() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _no_rlimit():
    import resource

    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        pytest.skip("this process runs under an address-space limit")


def test_swap_is_memory_a_process_can_hold(machine):
    _no_rlimit()
    memory = machine(swap_kb=8 * 1024 * 1024)
    assert memory.swap_total() == 8 * GIB
    assert memory.memory_limit() == (_physical() + 8 * GIB, "physical memory and swap")
    assert machine(swap_kb=0).memory_limit() == (_physical(), "physical memory")


@pytest.mark.parametrize("swap_max, expected", [("536870912", GIB + GIB // 2), ("max", 3 * GIB), (None, 3 * GIB),
                                                ("0", GIB)])
def test_a_cgroup_v2_limit_counts_the_swap_it_allows(machine, swap_max, expected):
    files = {"box/memory.max": f"{GIB}\n", **({"box/memory.swap.max": swap_max + "\n"} if swap_max else {})}
    memory = machine(swap_kb=2 * 1024 * 1024, cgroup="0::/box\n", files=files)
    assert memory._cgroup_limit(memory.swap_total()) == expected


@pytest.mark.parametrize("memsw, expected", [(str(2 * GIB), 2 * GIB), (None, 5 * GIB),
                                             (str(2**63 - 4096), 5 * GIB)])
def test_a_cgroup_v1_limit_counts_memory_and_swap(machine, memsw, expected):
    files = {"memory/box/memory.limit_in_bytes": str(GIB),
             **({"memory/box/memory.memsw.limit_in_bytes": memsw} if memsw else {})}
    memory = machine(swap_kb=4 * 1024 * 1024, cgroup="4:memory:/box\n0::/\n", files=files)
    assert memory._cgroup_limit(memory.swap_total()) == expected


def test_a_malformed_proc_self_cgroup_line_is_skipped(machine):
    _no_rlimit()
    memory = machine(cgroup="garbage without colons\n\n3:cpu\n4:memory:/box\n",
                     files={"memory/box/memory.limit_in_bytes": str(GIB)})
    assert memory.memory_limit() == (min(GIB, _physical()), "the memory cgroup's limit")


# -- the error's place among its siblings -------------------------------------------------------


def test_too_large_error_is_importable_from_conformance():
    import conformance
    from conformance.core.errors import TooLargeError

    assert conformance.TooLargeError is TooLargeError and "TooLargeError" in conformance.__all__
