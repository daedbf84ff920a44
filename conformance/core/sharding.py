"""The sharding plans and mesh axes every sharded backend and check names (docs/sharding.md).

    PLANS  "dp", "fsdp", "tp", "fsdp+tp": what each splits is docs/sharding.md's table
    AXES   ("data", "model"): a mesh's axes, in that order (size 1 for an axis a plan does not use)
"""

from __future__ import annotations

PLANS = ("dp", "fsdp", "tp", "fsdp+tp")
AXES = ("data", "model")


def splits(plan: str, mesh: tuple[int, int]) -> bool:
    """Whether `plan` on a (data, model) mesh splits anything: every plan splits the batch's rows
    over "data" (size > 1), the tensor-parallel ones the heads and columns over "model" (size > 1)."""
    data, model = mesh
    return data > 1 or ("tp" in plan and model > 1)
