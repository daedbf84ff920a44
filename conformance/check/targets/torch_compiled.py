"""The `torch-compiled` target: impl_torch's model with its tensor work under `torch.compile`.

    rosetta conformance --backends numpy,torch,torch-compiled        (CPU, and CUDA when present)
    ROSETTA_TORCH_COMPILE=aot_eager rosetta conformance --backends torch-compiled

A user who runs `torch.compile(model)` runs other code than the eager model: TorchDynamo traces
the Python into graphs (guards, graph breaks, in-place updates replayed as side effects) and
Inductor fuses the graphs into new kernels (other reduction orders, other intermediate dtypes).
This target is that code path, with impl_torch's surface, so every property of the suite runs
through it. The model is `impl_torch.Model` (see its docstring: the host-side input checks stay
eager, `torch.compiler.disable`) whose three entry points into tensor work are compiled:
`encode`, `decode` (so `forward`, `loss_and_grads` and its backward, which call them) and
`decode_step` (the cached decoding of `generate`).

Compile cost is bounded like JAX's (`backends.COMPILING`): the compiled code is shared by every
model instance, so each (config, dtype, shape) compiles once for the whole suite, and
`dynamic=None` (torch's default) compiles the first shapes static and a shape that changes once
more with dynamic shapes. The `ci` profile runs this target on the covering rows' shapes and the
drawn ones as it does JAX (`ci_compiling_dtypes`). Measured on the 2-core CPU machine, loaded:
Inductor ~25 CPU-seconds per graph (a C++ compile), aot_eager ~6, eager ~2.

`ROSETTA_TORCH_COMPILE` picks torch.compile's backend: `inductor` (the default, what
`torch.compile` runs), `aot_eager` (Dynamo and AOTAutograd without code generation: the tracing
and the functionalised backward, minus Inductor's kernels) or `eager` (Dynamo only). The project's
own CI test (tests/runtimes/test_torch_compiled.py) uses aot_eager for the whole suite and Inductor for the
forward property's covering rows.

A compiled function whose cache is full would silently run eagerly (torch's `recompile_limit`);
here that is an error instead (`fail_on_recompile_limit_hit`), with a limit high enough for a
whole suite's configs, so a pass is never an eager pass in disguise.
"""

from __future__ import annotations

import functools
import os

import impl_torch
import numpy as np
import torch

NAME = "torch-compiled"
BACKEND_ENV = "ROSETTA_TORCH_COMPILE"
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# One cache entry per (config, dtype, shape) a compiled function met: the suite's ci profile meets
# a few hundred; past this the run fails (never falls back to eager silently).
RECOMPILE_LIMIT = 4096
COMPILED = ("encode", "decode", "decode_step")

# The rest of impl_torch's surface, as it is: the masks, attention functions, precision switches.
for _name in [*impl_torch.__all__, *impl_torch.BACKEND_EXTRAS]:
    globals()[_name] = getattr(impl_torch, _name)
SUPPORTED_DTYPES = impl_torch.SUPPORTED_DTYPES
__all__ = list(impl_torch.__all__)
BACKEND_EXTRAS = tuple(impl_torch.BACKEND_EXTRAS)


def compile_backend() -> str:
    """torch.compile's backend from $ROSETTA_TORCH_COMPILE (default inductor); ValueError otherwise."""
    chosen = os.environ.get(BACKEND_ENV, "").strip() or "inductor"
    if chosen not in COMPILE_BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={chosen!r}: expected one of {list(COMPILE_BACKENDS)}")
    return chosen


@functools.lru_cache(maxsize=None)
def _compiled(base: type, method_name: str, backend: str):
    """The compiled form of `base.<method_name>`, one per backend for every instance (the guards
    tell configs, dtypes and shapes apart; the code is compiled once for each)."""
    USED.add(backend)
    return torch.compile(getattr(base, method_name), backend=backend, dynamic=None)


USED: set[str] = set()  # the torch.compile backends this process has compiled with


# The ids each compiled method takes first, and the vocabulary they index (decode_step's (B,)
# tokens are made a tensor as its first line does, `torch.as_tensor`, and checked there).
IDS = {"encode": ("src_ids", "src_vocab_size"), "decode": ("tgt_ids", "tgt_vocab_size"), "decode_step": None}


def _calling_compiled(base: type, method_name: str):
    def method(self, ids, *args, **kwargs):
        if isinstance(ids, np.ndarray) and torch.is_inference_mode_enabled():
            # A NumPy array entering a compiled frame under torch.inference_mode (`generate`)
            # fails TorchDynamo's own guard in torch 2.13: "Guard failed on the same frame it was
            # created ... tensor '___from_numpy(src_ids)' dispatch key set mismatch". The
            # model's own host check (`_ids`, eager as it always is) turns them into a tensor
            # first, with the same checks and errors; the compiled frame checks the tensor again.
            if IDS[method_name] is None:
                ids = torch.as_tensor(ids)
            else:
                argument, vocab = IDS[method_name]
                ids = self._ids(argument, ids, getattr(self.config, vocab))
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT,
                                        fail_on_recompile_limit_hit=True):
            return _compiled(base, method_name, self.compile_backend)(self, ids, *args, **kwargs)

    method.__name__ = method_name
    method.__doc__ = f"`{base.__module__}.Model.{method_name}` under torch.compile (backend `compile_backend`)."
    return method


def compiled_class(base: type) -> type:
    """A subclass of a torch `Model` class (impl_torch's, or a meta-test's broken copy) whose
    `COMPILED` methods run under torch.compile (backend: $ROSETTA_TORCH_COMPILE, read when a
    model is built; default inductor). Same arguments, same results within the dtype's
    tolerance: what the suite checks."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self.compile_backend = compile_backend()

    members = {"__init__": __init__, "__doc__": compiled_class.__doc__, "__module__": __name__,
               **{name: _calling_compiled(base, name) for name in COMPILED}}
    return type("Model", (base,), members)


Model = compiled_class(impl_torch.Model)


def load(path, dtype=None, *, device=None, param_dtype=None) -> Model:
    """`impl_torch.load`, as this target's compiled `Model`."""
    from conformance.core import checkpoint

    config, params = checkpoint.load(path)
    return Model(config, params, dtype, device=device, param_dtype=param_dtype)


def compile_stats() -> dict[str, int]:
    """What torch.compile did so far in this process: frames compiled and graphs made."""
    from torch._dynamo.utils import counters

    return {"backends": ",".join(sorted(USED)), "frames compiled": counters["stats"]["unique_graphs"],
            "calls traced": counters["stats"]["calls_captured"]}
