"""What tests/test_jax_shard.py and tests/test_torch_parallel.py share: the model, the plans, the
meshes each profile runs, and the tolerance table's measure. Both run their cases in a subprocess
(`python tests/test_X.py`), which imports this module from the same folder."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import settings

PLANS = ("dp", "fsdp", "tp", "fsdp+tp")
CONFIG = dict(d_model=16, n_heads=4, d_ff=32, src_vocab_size=32, tgt_vocab_size=32, n_encoder_layers=1,
              n_decoder_layers=1, max_len=16)
BATCH, SRC_LEN, TGT_LEN = 8, 6, 5


def meshes(every: tuple, ci: tuple) -> tuple:
    """The (data, model) meshes to run: the parent's choice in the subprocess ($ROSETTA_TEST_MESHES),
    else `ci` under the `ci` profile (CI time) and `every` under the others."""
    chosen = os.environ.get("ROSETTA_TEST_MESHES")
    if chosen:
        return tuple(tuple(int(n) for n in mesh.split("x")) for mesh in chosen.split(","))
    return every if settings._current_profile != "ci" else ci


def mesh_env(chosen: tuple) -> dict:
    """The environment that hands `chosen` meshes to the subprocess."""
    return {"ROSETTA_TEST_MESHES": ",".join(f"{d}x{m}" for d, m in chosen)}


def max_error(actual, expected) -> float:
    """max |actual - expected| / max(1, max |expected|): the tolerance table's measure."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(1.0, float(np.max(np.abs(expected)))))
