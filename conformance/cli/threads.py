"""How many intra-op threads torch uses for a tiny model: one, unless the user chose.

torch starts with one intra-op (OpenMP) thread per core. A tiny model's operations (the toy's
64-wide matrices) are microseconds long, so every one of them costs more in handing work to the
second thread and waiting for it at the barrier than it saves; and when the machine is busy, a
thread that waits at that barrier for one the scheduler has put aside waits for its whole time
slice. Measured on a 2-core machine shared with other jobs (load average 2.5-6): the toy's 50
training steps (`examples/train_toy.py --backend torch --steps 50`) took 5.1-35.1 s with 2
threads and 5.6-7.1 s with 1 (the training steps alone: 13.8-26.6 s against 3.1-3.7 s); a
greedy decode of a 0.7M-parameter model took 330-590 ms with 2 and 83 ms with 1. A 48M-parameter
model took 12-17 s with 2 threads and 0.4-0.9 s with 1 as the load rose to 6, while at 7.6M
parameters, with the load lower, 2 threads were 1.3-2.1x faster: so only models below
`SMALL_MODEL_PARAMETERS` are moved to one thread, and a larger one keeps torch's default
(OMP_NUM_THREADS=1 is the answer on a busy machine; docs/decoding.md).

A count the user chose wins: with OMP_NUM_THREADS or MKL_NUM_THREADS set, nothing is changed.
"""

from __future__ import annotations

import os

# Below this many parameters, a second intra-op thread costs more than it gives (see above).
SMALL_MODEL_PARAMETERS = 2_000_000
# The environment variables by which a user sets torch's thread count (torch reads both).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def parameter_count(config) -> int:
    """The number of parameter values of `config`'s model, from its shapes (no weights needed)."""
    from conformance.core.params import param_bytes

    return param_bytes(config, "float64") // 8


def user_chose_threads() -> bool:
    return any(os.environ.get(name, "").strip() for name in THREAD_VARIABLES)


def fit_torch_threads(config) -> int | None:
    """One intra-op thread for a model below `SMALL_MODEL_PARAMETERS`, unless the user set a
    count (`THREAD_VARIABLES`); returns the count set, or None when nothing was changed."""
    import torch

    if user_chose_threads() or parameter_count(config) >= SMALL_MODEL_PARAMETERS or torch.get_num_threads() == 1:
        return None
    torch.set_num_threads(1)
    return 1
