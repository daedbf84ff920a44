"""What `torch.compile` must leave eager, said without importing TorchDynamo.

`torch.compiler.disable` imports `torch._dynamo` where it decorates (about a second on a CPU:
every `rosetta` call on a torch backend paid it at `import impl_torch`, compiling or not).
`eager_under_compile` defers that to the first call made once TorchDynamo is loaded: before
then nothing can be compiling (`torch.compile` imports it), so the function runs as it is.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def eager_under_compile(fn: F) -> F:
    """`fn` run eagerly, outside any graph, under `torch.compile` (as `torch.compiler.disable`
    makes it), with TorchDynamo imported only once something else has imported it."""
    disabled = []  # torch.compiler.disable(fn), made at the first call with TorchDynamo loaded

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            if "torch._dynamo" not in sys.modules:  # nothing compiles without it
                return fn(*args, **kwargs)
            import torch

            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call
