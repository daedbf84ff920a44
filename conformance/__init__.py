"""Rosetta Transformer's contract and its checks, in rooms by role.

    conformance/core/     the contract every backend imports: ModelConfig and presets, the
                          canonical parameter key space, the checkpoint format, positions, input
                          checks, result types and errors. Framework-free (NumPy, ml_dtypes).
    conformance/convert/  the weight converters: foreign layouts to the canonical key space and
                          back. Imports core only (PyTorch and Flax lazily, for their own files).
    conformance/check/    the check-and-report tools: which backends and devices are here, how
                          to build a model on any of them, comparison, tolerances, the report,
                          plots, the built-in default model, conformance.compare. Imports core,
                          convert, and backends lazily.
    conformance/suite/    the hypothesis conformance suite and its pytest plugin
                          (`-p conformance.suite.pytest_plugin`). Imports core and check.
    conformance/formats/  the formats `rosetta convert` reads and writes, one module each in one
                          registry, each checking what it wrote with the runtime that reads it.
                          Imports core, convert, check, and backends and runtimes lazily.
    conformance/cli/      the `rosetta` command line. May import everything above.

Import direction (tests/test_architecture.py enforces it): core <- backends (impl_*) <- check <-
suite <- cli, with convert beside the backends (it imports core only) and formats beside the suite. This package's own names
are the core's public surface, importable with only NumPy installed:

    from conformance import ModelConfig, checkpoint, preset, init_params

One name more is the check tools', imported only when first used (PEP 562), so that `import
conformance` still needs no framework:

    conformance.compare(model, "from-scratch", src_ids, tgt_ids)   # conformance.check.foreign.side_by_side
"""

import sys as _sys

from conformance import core as _core
from conformance.core import *  # noqa: F403 (the core's public names: one list, `conformance.core.__all__`)
from conformance.core import checkpoint

__all__ = list(_core.__all__)

# `import conformance.checkpoint` (the contract's name for the format) keeps working: it is the
# core's module, registered under its public name, not a copy.
_sys.modules[__name__ + ".checkpoint"] = checkpoint


def __getattr__(name: str):
    if name == "compare":  # the user's model beside ours (docs/porting.md); imports the check tools
        from conformance.check.foreign.side_by_side import compare

        return compare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ += ["compare"]
