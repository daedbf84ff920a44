"""Sharded checkpoint directories in rosetta's own names: a PyTorch Distributed Checkpoint with
`rosetta_config.json` beside it, or an Orbax checkpoint of `impl_jax.save_state`'s form
(`conformance.convert.sharded`; docs/sharded-checkpoints.md).

    read     a directory one tensor at a time (its config stored beside the tensors); the rosetta
             writer streams it into the safetensors file and checks it one tensor at a time
    write    `--to dcp` / `--to orbax`: convert.sharded.write
    verify   the runtime that reads such a directory onto a mesh: `impl_torch.load_distributed`
             (torch.distributed.checkpoint) or `impl_jax.load_sharded` (Orbax) into a model whose
             parameters are zeros; the loader refuses a stored config other than the model's, and
             every parameter the model then holds must be the checkpoint's, bit for bit. A model
             with the checkpoint's config and parameters is the checkpoint's model: its forward
             pass would add time (a JAX compile), not evidence
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.formats import verify
from conformance.formats.base import Format, Options, Read, Written, check_new_directory


class ShardedDirectory(Format):
    name = "sharded checkpoint directory"

    def recognises(self, path: Path) -> bool:
        from conformance.convert import sharded

        # A foreign DCP directory (no rosetta config) goes by its layout: conformance.formats.state_dict.
        return sharded.kind(path) == "orbax" or sharded.has_config(path)

    def writes(self, options: Options, dst: Path) -> bool:
        from conformance.convert import sharded

        return options.to in sharded.KINDS

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        from conformance.core.errors import InputError

        given = options.given("layout", "sets", "renames", "key", "force", "dtype", "taps", "quantization")
        if given:
            raise InputError(given[0], f"--to {options.to} writes a rosetta checkpoint as it is stored, under its own "
                             "names, into a new directory: nothing to choose, set, rename, cast or replace")
        check_new_directory(dst, "a sharded checkpoint goes")

    def read(self, src: Path, options: Options, progress) -> Read:
        from conformance.convert import sharded
        from conformance.core.errors import InputError

        source = sharded.open_source(src)  # an Orbax directory whose config item is not rosetta's is refused here
        given = options.given("layout", "sets", "renames", "key")
        if given:
            raise InputError(given[0], f"{src} is a sharded checkpoint in rosetta's own names with its config stored "
                             "beside it: there is no layout to choose and nothing to set or rename; convert it with "
                             "--dtype only (or none)")
        progress(f"reading {src} one tensor at a time")
        what = 'PyTorch Distributed Checkpoint' if sharded.kind(src) == 'dcp' else 'rosetta Orbax checkpoint'
        line = f"a {what}, read one tensor at a time" + (f", cast to {options.dtype}" if options.dtype else "")
        return Read(source.config, None, source=source, lines=[line], counts=True)

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.convert import sharded

        sharded.write(staged, options.to, read.config, read.params)
        what = "PyTorch Distributed Checkpoint" if options.to == "dcp" else "Orbax checkpoint (impl_jax.save_state's form)"
        return Written(title=f"{what}, rosetta's parameter names")

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        progress(f"checking the written directory with {'impl_torch.load_distributed' if options.to == 'dcp' else 'impl_jax.load_sharded'}")
        return [(load_dcp if options.to == "dcp" else load_orbax)(staged, read.config, read.params)]


def _zeros(params) -> dict[str, np.ndarray]:
    """Parameters that only a load can make right: a key the load skipped keeps its zeros."""
    return {key: np.zeros_like(np.asarray(value)) for key, value in params.items()}


def _checked(runtime: str, params, held: dict[str, np.ndarray]) -> verify.Verdict:
    differs = verify.params_differ(params, held)
    if differs:
        return verify.failed(runtime, differs)
    return verify.passed(runtime, "its stored config is the checkpoint's, and every parameter loaded bit for bit into "
                                  "a model of zeros")


def _compute(params) -> str:
    stored = verify.stored(params)
    return stored if stored in ("float32", "float64") else "float32"


def load_dcp(path: Path, config, params) -> verify.Verdict:
    runtime = "impl_torch.load_distributed (torch.distributed.checkpoint)"
    try:
        import impl_torch
        from conformance.convert.arrays import as_numpy
    except ImportError as exc:
        return verify.not_run(f"the directory was not loaded: impl_torch cannot be imported ({exc})")
    import warnings

    model = impl_torch.Model(config, _zeros(params), _compute(params), param_dtype=verify.stored(params))
    with warnings.catch_warnings():  # that one process reads every rank's shards is the point
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        impl_torch.load_distributed(model, path)  # refuses a stored config other than the model's
    held = {key: as_numpy(value.detach(), key) for key, value in model.state_dict().items() if key in params}
    return _checked(runtime, params, held)


def load_orbax(path: Path, config, params) -> verify.Verdict:
    runtime = "impl_jax.load_sharded (Orbax)"
    try:
        import impl_jax
    except ImportError as exc:
        return verify.not_run(f"the directory was not loaded: impl_jax cannot be imported ({exc})")
    model = impl_jax.Model(config, _zeros(params), _compute(params), param_dtype=verify.stored(params))
    impl_jax.load_sharded(model, path)  # refuses a stored config other than the model's
    return _checked(runtime, params, {key: np.asarray(value) for key, value in model.params.items()})


FORMAT = ShardedDirectory()
