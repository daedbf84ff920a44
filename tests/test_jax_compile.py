"""Compiling in the JAX backend: the persistent compilation cache (one call or one environment
variable), the notice before a long compile, and the layer stacks under `lax.scan`.

Each cache test runs fresh Python processes, because what it checks is what a second process
gains: the first fills the directory, the second loads its executables from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import impl_jax
from impl_jax import cache

ROOT = Path(__file__).resolve().parents[1]

# One small model's forward pass, then what the process compiled and loaded.
PROGRAM = """
import json, sys, numpy as np
import impl_jax
from conformance import init_params
sys.path.insert(0, {tests!r})
from batches import SRC, TGT, small
config = small(d_ff=52)  # a config only this test compiles
impl_jax.Model(config, init_params(config, dtype=np.float32))(SRC, TGT)
stats = impl_jax.compile_stats()
print(json.dumps({{"compiles": stats["compiles"], "hits": stats["persistent_hits"],
                  "dir": str(impl_jax.persistent_cache_dir())}}))
"""


def run(env: dict[str, str]) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("ROSETTA_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    environment.update(env, PYTHONPATH=str(ROOT), ROSETTA_JAX_QUIET="1")
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(tests=str(ROOT / "tests"))], env=environment,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_environment_variable_fills_the_cache_and_a_second_process_loads_from_it(tmp_path):
    directory = tmp_path / "jax-cache"
    first = run({"ROSETTA_JAX_CACHE": str(directory)})
    assert first["dir"] == str(directory.resolve())
    assert first["compiles"] == 2 and first["hits"] == 0  # _encode and _decode, compiled
    written = [p for p in directory.iterdir() if p.name.startswith("jit__traced")]
    assert len(written) == 2, sorted(p.name for p in directory.iterdir())
    second = run({"ROSETTA_JAX_CACHE": str(directory)})
    assert second["hits"] == 2, second  # both loaded, none compiled
    without = run({})
    assert without["hits"] == 0 and without["dir"] == "None"  # off unless asked for


def test_the_environment_variable_reads_on_off_and_a_directory(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cache, "enable_persistent_cache", lambda path=None: calls.append(path) or path)
    for value in ("", "0", "off"):
        monkeypatch.setenv(cache.ENV, value)
        assert cache.enable_from_environment() is None
    monkeypatch.setenv(cache.ENV, "1")
    cache.enable_from_environment()
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    cache.enable_from_environment()
    assert calls == [None, str(tmp_path)]


def test_enable_in_process_sets_every_option_and_clear_empties(tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir
    try:
        directory = impl_jax.enable_persistent_cache(tmp_path / "c")
        assert directory == (tmp_path / "c").resolve() and directory.is_dir()
        assert impl_jax.persistent_cache_dir() == directory
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_enable_xla_caches == "all"
        (directory / "entry").write_text("x")
        impl_jax.clear_persistent_cache()
        assert directory.is_dir() and not any(directory.iterdir())
        impl_jax.disable_persistent_cache()
        assert impl_jax.persistent_cache_dir() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_a_long_compile_prints_one_notice(monkeypatch, capsys):
    import numpy as np
    from conformance import init_params
    from impl_jax import compiled
    from batches import SRC, TGT, small

    monkeypatch.setattr(compiled, "NOTICE_AFTER", 0.0)  # every compile counts as long
    config = small(d_ff=56)
    impl_jax.Model(config, init_params(config, dtype=np.float32))(SRC, TGT)
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("impl_jax: tracing and compiling")]
    assert len(notices) == 2 and "Model._encode" in notices[0] and "Model._decode" in notices[1], err
    impl_jax.Model(config, init_params(config, dtype=np.float32))(SRC, TGT)  # compiled: silent
    assert "impl_jax:" not in capsys.readouterr().err
