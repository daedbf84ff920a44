"""Precision in NumPy: nothing to pin, and a report that says so.

NumPy computes float32 and float64 matmuls in their own dtype through BLAS, with no reduced-
precision mode like TF32 to switch off. `full_precision()` exists so that the three backends
offer the same surface (the suite and `rosetta check` call it on every backend); here it changes
nothing. `precision_settings()` records what decides the numbers, as the other backends do.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """A no-op scope: NumPy's matmuls always run at the full precision of their dtype."""
    yield


def precision_settings() -> dict[str, Any]:
    """What decides the numbers, as printable values (the suite records them)."""
    config = np.show_config(mode="dicts") if "mode" in np.show_config.__code__.co_varnames else {}
    blas = config.get("Build Dependencies", {}).get("blas", {}).get("name", "unknown")
    return {"matmul": "in the array's own dtype (no reduced-precision mode)", "blas": blas}


def to_numpy(array: Any) -> np.ndarray:
    """The result as a host NumPy array (it already is one): the same helper every backend has."""
    return np.asarray(array)
