"""JAX's persistent compilation cache, switched on with one call or one environment variable.

    impl_jax.enable_persistent_cache()            # ~/.cache/rosetta/jax (or $XDG_CACHE_HOME/rosetta/jax)
    impl_jax.enable_persistent_cache("/scratch/jax-cache")
    ROSETTA_JAX_CACHE=1 python train.py           # the same, before the first compile of the process
    ROSETTA_JAX_CACHE=/scratch/jax-cache python train.py
    impl_jax.clear_persistent_cache()             # or: rm -rf ~/.cache/rosetta/jax

Every executable a process compiles is then written to the directory, keyed by its program, the
compile options, the device and the JAX/jaxlib version, and any later process (or this one, after
`clear_cache`) that needs the same executable loads it instead of compiling it. Three JAX settings
make that true for this backend (docs/jax-compile.md):

- `jax_compilation_cache_dir`: the directory;
- `jax_persistent_cache_min_compile_time_secs = 0` and `jax_persistent_cache_min_entry_size_bytes
  = -1`: every executable is written, not only those that took a second (JAX's default), so that
  the small ones of a bucketed model are kept too;
- `jax_persistent_cache_enable_xla_caches = "all"`: XLA's own caches live in the same directory,
  in particular the GPU autotuning results (`xla_gpu_per_fusion_autotune_cache_dir`), which are
  what most of a cold float32-highest compile spends its time on on a GPU (issue 28). On a CPU
  there is no autotuning and the setting changes nothing.

Tracing still runs in every process (the cache key is the lowered program); only XLA's part is
saved. The cache is trusted code: do not point it at a directory others can write to.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "ROSETTA_JAX_CACHE"
_OFF = ("", "0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/rosetta/jax, or ~/.cache/rosetta/jax."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rosetta" / "jax"


def enable_persistent_cache(path: str | os.PathLike | None = None) -> Path:
    """Keep every compiled executable in `path` (default `default_cache_dir()`), created if needed,
    and load it from there in later processes; returns the directory.

    May be called at any time: executables compiled before it are not written, every compile
    after it is (JAX decides once per process whether the cache is on; this resets that decision)."""
    directory = Path(default_cache_dir() if path is None else path).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if "jax_persistent_cache_enable_xla_caches" in jax.config.values:  # JAX >= 0.4.36
        jax.config.update("jax_persistent_cache_enable_xla_caches", "all")
    compilation_cache.reset_cache()
    return directory


def disable_persistent_cache() -> None:
    """Stop reading and writing the persistent cache (its files stay on disk)."""
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


def persistent_cache_dir() -> Path | None:
    """The directory compiled executables are kept in, or None when the cache is off."""
    path = jax.config.jax_compilation_cache_dir
    return Path(path) if path and jax.config.jax_enable_compilation_cache else None


def clear_persistent_cache(path: str | os.PathLike | None = None) -> None:
    """Delete the cache's files: `path`, else the directory in use, else `default_cache_dir()`.
    The next process compiles from scratch (and fills the cache again)."""
    directory = Path(path) if path is not None else (persistent_cache_dir() or default_cache_dir())
    if directory.is_dir():
        shutil.rmtree(directory)
    if persistent_cache_dir() == directory.expanduser().resolve():
        directory.mkdir(parents=True, exist_ok=True)
        compilation_cache.reset_cache()


def enable_from_environment() -> Path | None:
    """`ROSETTA_JAX_CACHE`: unset, empty or 0 leaves the cache as JAX has it; 1 enables it in
    the default directory; anything else is the directory. Called when impl_jax is imported."""
    value = os.environ.get(ENV)
    if value is None or value.strip().lower() in _OFF:
        return None
    return enable_persistent_cache(None if value.strip().lower() in _ON else value)
