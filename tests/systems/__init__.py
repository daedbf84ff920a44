"""Small re-creations of the systems in `variants.md`, as PyTorch modules, for the converter tests.

Each module re-creates one system from the facts in `../shared/spec/variants.md`: its exact
`state_dict()` key names and its numerics (masks, fills, norm forms and placement, final norms,
how cross-attention is masked). None of them imports anything from this project, so a converted
model agrees with one of them only if the conversion is right.

Every module offers `make(...) -> nn.Module` (in eval mode) and `logits(model, src, tgt)`, which
runs the model the way that system's own code runs it (building its masks its own way) and
returns `(B, T, V)` logits; `PAD` is the padding id the system uses.
"""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def randomize_(module: nn.Module, seed: int, buffers: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> nn.Module:
    """Give every parameter (except names containing a `skip` string) and the named `buffers`
    a seeded random value. Other buffers (position tables) keep what the system computed.

    Default initialisations hide mistakes: LayerNorm weights of exactly 1 and zero biases make a
    swapped weight/bias, a missing norm or a dropped bias invisible. Norm weights are drawn
    around 1, everything else around 0 with a visible spread; matrices scaled by 1/sqrt(fan_in).
    """
    generator = torch.Generator().manual_seed(seed)
    seen = set()
    named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n in buffers]
    for name, tensor in named:
        if id(tensor) in seen or any(s in name for s in skip):
            continue
        seen.add(id(tensor))
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        leaf = name.rsplit(".", 1)[-1]
        if tensor.ndim == 1 and ("norm" in name or leaf in ("gamma", "a_2")) and leaf in ("weight", "gamma", "a_2"):
            value = 1.0 + 0.2 * noise
        elif tensor.ndim >= 2:
            value = noise / math.sqrt(tensor.shape[-1])
        else:
            value = 0.2 * noise
        tensor.copy_(value.to(tensor.dtype))
    return module
