"""Running one conformance case on one target, the same way for every property.

Every run happens with full-float32 matmul precision (TF32 off) and inside the scope its dtype
needs (JAX float64 turns x64 on only for the run). Results come back as NumPy arrays so that the
comparison code never touches a framework.
"""

from __future__ import annotations

import time
from collections import defaultdict
from functools import lru_cache
from typing import Any, Callable

import numpy as np

from conformance.check import backends
from conformance.check.backends import Target
from conformance.check.compare import to_numpy
from conformance.core.output import tensors_of
from conformance.suite.strategies import Case

# Wall time spent per target, so the session summary can show where the minutes went.
TIMINGS: dict[str, float] = defaultdict(float)
# Called as PROGRESS(target, case, seconds) after every run when set: the plugin prints a line per
# full-size model run under the `scale` profile, where one run takes a minute.
PROGRESS: Callable[[Target, Case, float], None] | None = None


def run(target: Target, case: Case, *, src_mask=None, tgt_mask=None, split: bool = False,
        return_attention: bool = True, repeat: int = 1) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
    """All tensors of one model call (`encode` then `decode` when `split`), as host arrays.

    With `repeat` > 1, the same model is called that many times and a list is returned.
    """
    started = time.perf_counter()
    try:
        with backends.full_precision(target.backend), backends.dtype_scope(target):
            model = backends.build(target, case.config, case.params())
            results = []
            for _ in range(repeat):
                if split:
                    encoded = model.encode(case.src_ids, src_mask, return_attention=return_attention)
                    output = model.decode(case.tgt_ids, encoded, tgt_mask, return_attention=return_attention)
                else:
                    output = model(case.src_ids, case.tgt_ids, src_mask, tgt_mask, return_attention=return_attention)
                results.append({name: to_numpy(value) for name, value in tensors_of(output).items()})
            return results[0] if repeat == 1 else results
    finally:
        TIMINGS[target.label] += time.perf_counter() - started
        if PROGRESS is not None:
            PROGRESS(target, case, time.perf_counter() - started)


# A full-size result (d_model >= 512, 1024 tokens: ~2.5 GB of float64 with its attention weights)
# is kept for the few examples of the `scale` profile only: 256 of them would not fit in memory
# (the first scale runs reached 16 GB resident with the shared cache).
FULL_SIZE_D_MODEL = 512
FULL_SIZE_CACHED = 3


def oracle(case: Case) -> dict[str, np.ndarray]:
    """The float64 NumPy result for a case (cached: several properties share examples)."""
    key = (case.config.to_json(), case.seed, case.scale, case.src_ids.tobytes(),
           case.src_ids.shape, case.tgt_ids.tobytes(), case.tgt_ids.shape, case.trained)
    if case.config.d_model >= FULL_SIZE_D_MODEL:
        return _full_size_oracle_cached(*key)
    return _oracle_cached(*key)


@lru_cache(maxsize=FULL_SIZE_CACHED)
def _full_size_oracle_cached(*key) -> dict[str, np.ndarray]:
    return _oracle_cached.__wrapped__(*key)


@lru_cache(maxsize=256)
def _oracle_cached(config_json, seed, scale, src_bytes, src_shape, tgt_bytes, tgt_shape, trained=None) -> dict[str, np.ndarray]:
    from conformance.core.config import ModelConfig

    case = Case(ModelConfig.from_json(config_json), seed, scale,
                np.frombuffer(src_bytes, np.int64).reshape(src_shape),
                np.frombuffer(tgt_bytes, np.int64).reshape(tgt_shape), trained)
    return run(Target("numpy", "cpu", "float64"), case)


def masks(target: Target, case: Case) -> tuple[Any, Any]:
    """The backend's own `make_masks` for the case's ids, as host arrays."""
    module = backends.import_backend(target.backend)
    src_mask, tgt_mask = module.make_masks(case.config, case.src_ids, case.tgt_ids)
    return to_numpy(src_mask), to_numpy(tgt_mask)
