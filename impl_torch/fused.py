"""What PyTorch's fused attention kernel is handed and what is replaced in its result.

`model.fast_attention` runs attention through `F.scaled_dot_product_attention`, and where the
kernel and the config part ways the config wins (its docstring says where). `kernel_fix_ups` works
out the parts that depend only on the values and the mask, so that a cached decoding step
(`decode.cross_fix_ups`) computes the cross-attention's once per source instead of at every step.
Its own module, because both model.py and decode.py use it and model.py imports decode.py.
"""

from __future__ import annotations

import math


def kernel_fix_ups(v, mask, fill: float, empty_rows: float | None = None):
    """What `fast_attention` hands the kernel and what it replaces in the kernel's result, for the
    values v (B, H, Tk, K) and `mask`: (the kernel's mask, where to replace (B, H, Tq|1, K) or
    None for nowhere, the replacement).

    Without a mask there is nothing to replace: every query has every key, and the kernel weighs
    every key, so a NaN value reaches each query's result by itself (0 x NaN is NaN; checked on
    torch's CPU kernels in float32, float64 and bfloat16, with the NaN's weight underflowing to 0).
    A cached step's self-attention under tgt_pad_mask "none" is such a call."""
    if mask is None:
        return None, None, None
    mean = v.mean(dim=-2, keepdim=True)  # (B, H, 1, K): equal weights on every key
    fix = mean.isnan()  # the columns of v that hold a NaN
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, H|1, Tq, 1): the queries without keys
    mask = mask | empty  # each such query attends everywhere in the kernel; replaced below
    fix = fix | empty  # (B, H, Tq, K)
    if empty_rows is not None:  # weights `empty_rows` on every key: NaN in a NaN column of v, as `weights @ v` gives
        fixed = empty_rows * v.sum(dim=-2, keepdim=True)
    elif not math.isinf(fill):
        fixed = mean  # a NaN column of v is NaN in `mean` too, so the mean serves both cases
    else:
        fixed = math.nan
    return mask, fix, fixed
