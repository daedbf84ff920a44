"""Sharded checkpoints (docs/sharded-checkpoints.md): PyTorch Distributed Checkpoint directories
written by 2 gloo ranks under "fsdp" and "tp", and Orbax directories written from a mesh of 4
forced host devices, convert with `rosetta convert DIR out.safetensors` into the very file they
came from, byte for byte; and a checkpoint converted `--to dcp` / `--to orbax` loads into a model
parallelized on another mesh with every parameter bit for bit.

The ranks run in subprocesses (this file run as a script, "torch" or "jax"), as in
tests/test_torch_parallel.py and tests/test_jax_shard.py; each writes its directories and a JSON
record into a folder the tests below read. No JAX program is compiled: placing and restoring
arrays only moves them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
from sharding_common import CONFIG

# One worker under `--dist loadgroup`: the module's fixtures (two subprocesses) are paid once.
pytestmark = pytest.mark.xdist_group("sharded-checkpoints")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2  # gloo ranks
DEVICES = 4  # forced host devices
# (plan, (data, model)): where each directory is written, and the other mesh it is read back on.
TORCH_WRITES = {"fsdp": (2, 1), "tp": (1, 2)}
TORCH_READS = {"fsdp": ("tp", (1, 2)), "tp": ("fsdp", (2, 1)), "converted": ("fsdp+tp", (2, 1))}
JAX_WRITES = {"fsdp": (4, 1), "tp": (1, 4)}
JAX_READS = {"fsdp": ("tp", (2, 2)), "tp": ("fsdp", (2, 2)), "converted": ("fsdp+tp", (2, 2))}


def _config():
    from conformance.core.config import ModelConfig

    return ModelConfig(**CONFIG)


def _params():
    """The model's parameters, float64 so that every bit of a mantissa counts."""
    from conformance.core.params import init_params

    return {name: np.asarray(w, np.float64) for name, w in init_params(_config(), seed=0).items()}


def _differing(loaded: dict, expected: dict) -> list[str]:
    """The names whose arrays are not bit for bit the expected ones (dtype, shape and bytes)."""
    return [name for name, w in expected.items() if name not in loaded or loaded[name].dtype != w.dtype
            or loaded[name].shape != w.shape or loaded[name].tobytes() != w.tobytes()]


# -- The torch subprocess: 2 gloo ranks ------------------------------------------------------------


def _torch_worker(rank: int, port: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(ROOT))
    import impl_torch
    from conformance.core.errors import CheckpointError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    folder = Path(folder)
    mesh = lambda shape: init_device_mesh("cpu", shape, mesh_dim_names=("data", "model"))  # noqa: E731
    record: dict = {"loaded": {}, "errors": {}}
    for plan, shape in TORCH_WRITES.items():
        model = impl_torch.parallelize(impl_torch.load(folder / "model.safetensors"), mesh(shape), plan)
        impl_torch.save_distributed(model, folder / f"dcp-{plan}")
    original = {name: np.asarray(w) for name, w in _params().items()}
    for written, (plan, shape) in TORCH_READS.items():
        target = impl_torch.parallelize(impl_torch.Model(_config(), None, torch.float64), mesh(shape), plan)
        impl_torch.load_distributed(target, folder / f"dcp-{written}")
        whole = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
                 for name, p in target.named_parameters()}
        local = {name: list(p.to_local().shape) for name, p in target.named_parameters() if isinstance(p, DTensor)}
        record["loaded"][written] = {"differing": _differing(whole, original), "count": len(whole), "local": local}
    cases = {
        "exists": lambda: impl_torch.save_distributed(
            impl_torch.parallelize(impl_torch.Model(_config(), None, torch.float64), mesh((2, 1)), "fsdp"),
            folder / "dcp-fsdp"),
        "other config": lambda: impl_torch.load_distributed(
            impl_torch.Model(dataclasses.replace(_config(), d_ff=64), None, torch.float64), folder / "dcp-fsdp"),
        "other dtype": lambda: impl_torch.load_distributed(
            impl_torch.Model(_config(), None, torch.float32), folder / "dcp-fsdp"),
    }
    for case, call in cases.items():
        try:
            call()
        except CheckpointError as exc:
            record["errors"][case] = str(exc)
        else:
            record["errors"][case] = "nothing raised"
    if rank == 0:
        (folder / "torch.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _torch_main(folder: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_torch_worker, args=(port, folder), nprocs=WORLD, join=True)


# -- The JAX subprocess: 4 forced host devices ----------------------------------------------------


def _jax_main(folder: str) -> None:
    import jax

    sys.path.insert(0, str(ROOT))
    import impl_jax
    from conformance.core.errors import CheckpointError
    from impl_jax.shard import shard_shapes

    jax.config.update("jax_enable_x64", True)
    folder = Path(folder)
    original = _params()
    record: dict = {"loaded": {}, "errors": {}}
    mesh = lambda shape: jax.make_mesh(shape, ("data", "model"))  # noqa: E731
    for plan, shape in JAX_WRITES.items():
        impl_jax.save_sharded(impl_jax.shard(impl_jax.load(folder / "model.safetensors"), mesh(shape), plan),
                              folder / f"orbax-{plan}")
    for written, (plan, shape) in JAX_READS.items():
        target = impl_jax.shard(impl_jax.Model(_config(), None, "float64"), mesh(shape), plan)
        expected = shard_shapes(target)
        impl_jax.load_sharded(target, folder / f"orbax-{written}")
        whole = {name: np.asarray(w) for name, w in target.params.items()}
        local = {name: sorted({tuple(s.data.shape) for s in w.addressable_shards}) for name, w in target.params.items()}
        record["loaded"][written] = {"differing": _differing(whole, original), "count": len(whole),
                                     "unsharded as planned": [n for n, shapes in local.items()
                                                              if shapes != [expected[n]]],
                                     "split": sum(list(expected[n]) != list(w.shape) for n, w in target.params.items())}
    cases = {
        "exists": lambda: impl_jax.save_sharded(impl_jax.Model(_config(), None, "float64"), folder / "orbax-fsdp"),
        "other config": lambda: impl_jax.load_sharded(impl_jax.Model(dataclasses.replace(_config(), d_ff=64), None, "float64"),
                                                      folder / "orbax-fsdp"),
        "other dtype": lambda: impl_jax.load_sharded(impl_jax.Model(_config(), None, "float32"), folder / "orbax-fsdp"),
    }
    for case, call in cases.items():
        try:
            call()
        except CheckpointError as exc:
            record["errors"][case] = str(exc)
        else:
            record["errors"][case] = "nothing raised"
    (folder / "jax.json").write_text(json.dumps(record))


# -- The tests ------------------------------------------------------------------------------------


def _rosetta(*argv) -> int:
    from conformance.cli import main

    return main(["convert", *(str(a) for a in argv)])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """model.safetensors and the directories converted from it (`--to dcp`, `--to orbax`)."""
    from conformance.core import checkpoint

    folder = tmp_path_factory.mktemp("sharded")
    checkpoint.save(folder / "model.safetensors", _config(), _params())
    assert _rosetta(folder / "model.safetensors", folder / "dcp-converted", "--to", "dcp") == 0
    assert _rosetta(folder / "model.safetensors", folder / "orbax-converted", "--to", "orbax") == 0
    return folder


@pytest.fixture(scope="module")
def records(folder) -> dict:
    """{"torch": ..., "jax": ...}: both subprocesses, started together (each mostly waits on its imports)."""
    pytest.importorskip("torch")
    pytest.importorskip("orbax.checkpoint")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    envs = {"torch": {"OMP_NUM_THREADS": "1"}, "jax": {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}}
    runs = {which: subprocess.Popen([sys.executable, __file__, which, str(folder)], env={**os.environ, **env},
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for which, env in envs.items()}
    found = {}
    for which, run in runs.items():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, f"the {which} subprocess failed (exit {run.returncode}):\n{err[-6000:]}"
        found[which] = json.loads((folder / f"{which}.json").read_text())
    return found


@pytest.fixture(scope="module")
def torch_record(records) -> dict:
    return records["torch"]


@pytest.fixture(scope="module")
def jax_record(records) -> dict:
    return records["jax"]


@pytest.mark.parametrize("kind, plan", [("dcp", "fsdp"), ("dcp", "tp"), ("orbax", "fsdp"), ("orbax", "tp")])
def test_a_sharded_directory_converts_to_the_file_it_came_from_byte_for_byte(folder, torch_record, jax_record,
                                                                            kind, plan):
    """Written by the ranks from model.safetensors; `rosetta convert DIR out.safetensors` gives
    that file back: the same header (config, names, shapes, dtypes, digest) and every byte of data."""
    out = folder / f"back-{kind}-{plan}.safetensors"
    assert _rosetta(folder / f"{kind}-{plan}", out) == 0
    assert out.read_bytes() == (folder / "model.safetensors").read_bytes()


@pytest.mark.parametrize("written", list(TORCH_READS))
def test_dcp_loads_bit_for_bit_into_a_model_parallelized_on_another_mesh(torch_record, written):
    plan, shape = TORCH_READS[written]
    loaded = torch_record["loaded"][written]
    assert loaded["count"] == len(_params()) and loaded["differing"] == [], (written, plan, shape, loaded["differing"])
    # Read into the target's own shards: under fsdp every parameter's local dim 0 is split over "data".
    assert loaded["local"], "the target held no DTensor: it was not parallelized"
    if "fsdp" in plan:
        full = {name: w.shape for name, w in _params().items()}
        assert all(local[0] * shape[0] == full[name][0] for name, local in loaded["local"].items() if full[name][0] % 2 == 0)


@pytest.mark.parametrize("written", list(JAX_READS))
def test_orbax_restores_bit_for_bit_into_a_model_sharded_on_another_mesh(jax_record, written):
    loaded = jax_record["loaded"][written]
    assert loaded["count"] == len(_params()) and loaded["differing"] == [], (written, loaded["differing"])
    # Restored straight into the target's NamedShardings, and those really split the parameters.
    assert loaded["unsharded as planned"] == [] and loaded["split"] > len(_params()) // 2, loaded


def test_each_rank_writes_only_its_own_shards(folder, torch_record):
    """Under fsdp on 2 ranks DCP's metadata records each parameter as 2 chunks, half of dim 0
    each, stored in the two ranks' own files: nobody gathered the model to write it."""
    from conformance.convert import sharded

    metadata = sharded._safe_reader(folder / "dcp-fsdp").read_metadata()
    files: dict = {}
    for index, where in metadata.storage_data.items():
        files.setdefault(index.fqn, {})[tuple(index.offset)] = where.relative_path
    for name, w in _params().items():
        chunks = metadata.state_dict_metadata[name].chunks
        if w.shape[0] % WORLD:
            continue  # FSDP2 pads an uneven dim 0; every parameter of this config divides
        assert sorted(tuple(c.sizes) for c in chunks) == [(w.shape[0] // WORLD, *w.shape[1:])] * WORLD, name
        assert sorted(files[name].values()) == ["__0_0.distcp", "__1_0.distcp"], (name, files[name])


@pytest.mark.parametrize("case, words", [
    ("exists", ("already exists",)),
    ("other config", ("d_ff", "differs")),
    ("other dtype", ("float64", "float32")),
])
def test_saving_and_loading_refuse_with_a_typed_error(torch_record, jax_record, case, words):
    for record in (torch_record, jax_record):
        message = record["errors"][case]
        assert all(word in message for word in words), (case, message)


def test_the_converter_holds_one_tensor_at_a_time(folder, monkeypatch):
    """A spy on the per-tensor read: when each tensor is read, at most the one before it is still
    alive (the generator's last binding); the rest were written and dropped."""
    from conformance.convert import sharded

    read, alive, most = sharded.DcpSource.read, [], []

    def spy(self, name):
        value = read(self, name)
        most.append(sum(ref() is not None for ref in alive))
        alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(sharded.DcpSource, "read", spy)
    assert _rosetta(folder / "dcp-converted", folder / "spied.safetensors") == 0
    assert len(most) == len(_params()) and max(most) <= 1, most
    assert (folder / "spied.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def _dcp(path: Path, state: dict, config=True) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({k: torch.from_numpy(v) for k, v in state.items()}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    if config:
        (path / "rosetta_config.json").write_text(_config().to_json())
    return path


def test_bad_directories_get_typed_errors(tmp_path):
    pytest.importorskip("torch")
    from conformance.convert import sharded
    from conformance.core.errors import CheckpointError

    params = _params()
    first = next(iter(params))
    cases = {
        "neither": (tmp_path / "empty", ("neither", ".metadata")),
        "missing": (_dcp(tmp_path / "missing", {k: v for k, v in params.items() if k != first}), ("missing", first)),
        "shape": (_dcp(tmp_path / "shape", {**params, first: params[first][:1]}), ("shape", first)),
        "no config": (_dcp(tmp_path / "bare", params, config=False), ("rosetta_config.json",)),
    }
    (tmp_path / "empty").mkdir()
    for case, (path, words) in cases.items():
        with pytest.raises(CheckpointError) as caught:
            sharded.to_safetensors(path, tmp_path / f"{case}.safetensors")
        assert all(word in str(caught.value) for word in words), (case, str(caught.value))
        assert not (tmp_path / f"{case}.safetensors").exists(), case


def test_a_foreign_dcp_directory_converts_by_its_layout(tmp_path):
    """A DCP directory of another system's state dict, without rosetta's config: read whole, by
    key, and converted by the layout its keys match, as the same state dict in a .pt file is."""
    pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from systems import from_scratch, randomize_

    from conformance.convert import import_state_dict
    from conformance.core import checkpoint

    state = randomize_(from_scratch.make(src_vocab=23, tgt_vocab=19, d_model=16, n_heads=2, d_ff=24, n_layers=2,
                                         max_len=12), seed=2).state_dict()
    dcp.save({k: v.detach().clone() for k, v in state.items()}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "foreign")),
             no_dist=True)
    assert _rosetta(tmp_path / "foreign", tmp_path / "out.safetensors", "--set", "n_heads=2") == 0
    config, params = checkpoint.load(tmp_path / "out.safetensors")
    expected_config, expected = import_state_dict(state, "from-scratch", n_heads=2)
    assert config.replace(notes={}) == expected_config.replace(notes={})
    assert _differing(params, expected) == [] and len(params) == len(expected)


def test_a_hostile_dcp_metadata_is_refused_before_it_runs(tmp_path):
    """DCP's `.metadata` is a pickle; torch reads it with a bare pickle.load. The converter's
    reader allows only DCP's metadata classes, so a crafted one is refused, not run."""
    pytest.importorskip("torch")
    from conformance.convert import sharded
    from conformance.core.errors import CheckpointError

    path = _dcp(tmp_path / "hostile", _params())
    witness = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match="refused: the metadata names"):
        sharded.to_safetensors(path, tmp_path / "out.safetensors")
    assert not witness.exists()


def test_the_cli_refuses_layout_flags_and_existing_directories(folder, capsys):
    assert _rosetta(folder / "dcp-converted", folder / "x.safetensors", "--set", "n_heads=4") == 2
    assert "--set" in capsys.readouterr().err
    assert _rosetta(folder / "model.safetensors", folder / "dcp-converted", "--to", "dcp") == 2
    assert "already exists" in capsys.readouterr().err


def test_the_two_backends_name_the_same_config_file():
    pytest.importorskip("torch")
    from conformance.convert import sharded
    from impl_torch import distributed_checkpoint

    assert distributed_checkpoint.CONFIG_FILE == sharded.CONFIG_FILE


if __name__ == "__main__":
    {"torch": _torch_main, "jax": _jax_main}[sys.argv[1]](sys.argv[2])
