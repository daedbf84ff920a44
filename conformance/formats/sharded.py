"""Sharded checkpoint directories in rosetta's own names: a PyTorch Distributed Checkpoint with
`rosetta_config.json` beside it, or an Orbax checkpoint of `impl_jax.save_state`'s form
(`conformance.convert.sharded`; docs/sharded-checkpoints.md).

    read     a directory one tensor at a time (its config stored beside the tensors); the rosetta
             writer streams it into the safetensors file and checks it one tensor at a time
             against the directory read again by its own library (`reread`: torch DCP's load,
             Orbax's restore, of one tensor, apart from the reader and the cast that wrote it)
    write    `--to dcp` / `--to orbax`: convert.sharded.write
    verify   the runtime that reads such a directory onto a mesh: `impl_torch.load_distributed`
             (torch.distributed.checkpoint) or `impl_jax.load_sharded` (Orbax) into a model whose
             parameters are zeros; the loader refuses a stored config other than the model's, and
             every parameter the model then holds must be the checkpoint's, bit for bit. A model
             with the checkpoint's config and parameters is the checkpoint's model: its forward
             pass would add time (a JAX compile), not evidence
"""

from __future__ import annotations

import warnings
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
        return Read(source.config, None, source=source, lines=[line], counts=True,
                    reference=reread(source, options.dtype))

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        from conformance.convert import sharded

        sharded.write(staged, options.to, read.config, read.params)
        what = "PyTorch Distributed Checkpoint" if options.to == "dcp" else "Orbax checkpoint (impl_jax.save_state's form)"
        return Written(title=f"{what}, rosetta's parameter names")

    def verify(self, staged: Path, read: Read, options: Options, progress) -> list:
        progress(f"checking the written directory with {'impl_torch.load_distributed' if options.to == 'dcp' else 'impl_jax.load_sharded'}")
        return [(load_dcp if options.to == "dcp" else load_orbax)(staged, read.config, read.params)]


def reread(source, dtype: str | None):
    """Each parameter of the rosetta directory that `source` (a `conformance.convert.sharded.Source`)
    opened, as the directory holds it: read again, one tensor at a time, by the directory's own
    library (torch.distributed.checkpoint's `load`, Orbax's partial `restore`) into a tensor of
    zeros, apart from `Source.read` and `convert.engine.cast`, which wrote the checkpoint, and cast
    to `dtype` by `verify.reference_cast`. The shapes and dtypes are the directory's metadata."""
    from conformance.convert import sharded

    path, index = source.path, source.index

    def from_dcp(name: str):
        import torch
        import torch.distributed.checkpoint as dcp

        from conformance.convert.arrays import as_numpy

        shape, stored = index[name]
        one = {name: torch.zeros(shape, dtype=getattr(torch, stored))}
        with warnings.catch_warnings():  # one process reading every rank's shards is the point
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(one, storage_reader=sharded.safe_reader(path), no_dist=True)
        return verify.reference_cast(as_numpy(one[name], name), dtype)

    def from_orbax(name: str):
        import jax
        import orbax.checkpoint as ocp

        from conformance.core.checkpoint import ORBAX_ITEMS
        from conformance.core.params import flatten_dotted, nest_dotted

        shape, stored = index[name]
        restored = ocp.PyTreeCheckpointer().restore(
            path.resolve() / ORBAX_ITEMS[0], args=ocp.args.PyTreeRestore(
                item=nest_dotted({name: jax.ShapeDtypeStruct(shape, np.dtype(stored))}),
                restore_args=nest_dotted({name: ocp.RestoreArgs(restore_type=np.ndarray)}), partial_restore=True))
        return verify.reference_cast(np.array(flatten_dotted(restored)[name]), dtype)

    return from_dcp if sharded.kind(path) == "dcp" else from_orbax


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
