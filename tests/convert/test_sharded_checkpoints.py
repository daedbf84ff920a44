"""Sharded checkpoints (docs/sharded-checkpoints.md): PyTorch Distributed Checkpoint directories
written by 2 gloo ranks under "fsdp" and "tp", and Orbax directories written from a mesh of 4
forced host devices, convert with `rosetta convert DIR out.safetensors` into the very file they
came from, byte for byte; and a checkpoint converted `--to dcp` / `--to orbax` loads into a model
parallelized on another mesh with every parameter bit for bit.

The ranks run in subprocesses (this file run as a script, "torch" or "jax"), as in
tests/scale/test_torch_parallel.py and tests/scale/test_jax_shard.py; each first converts model.safetensors
`--to dcp` / `--to orbax` (so that the two subprocesses' imports overlap), then writes its
directories and a JSON record into a folder the tests below read. The torch subprocess imports
torch once and forks its 2 ranks. No JAX program is compiled: placing and restoring arrays only
moves them.
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

import ml_dtypes
import numpy as np
import pytest
from rooms import pythonpath
from sharding_common import CONFIG

# One worker under `--dist loadgroup`: the module's fixtures (two subprocesses) are paid once.
pytestmark = pytest.mark.xdist_group("sharded-checkpoints")

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2  # gloo ranks
DEVICES = 4  # forced host devices
# (plan, (data, model)): where each directory is written, and the other mesh it is read back on.
# ("fsdp+tp" on 2x1 is fsdp with a model axis of 1: two ranks give no 2-D mesh.)
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



def _raised(cases: dict) -> dict:
    """Each case's CheckpointError message, or "nothing raised"."""
    from conformance.core.errors import CheckpointError

    said = {}
    for case, call in cases.items():
        try:
            call()
        except CheckpointError as exc:
            said[case] = str(exc)
        else:
            said[case] = "nothing raised"
    return said

def _torch_worker(rank: int, port: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(ROOT))
    import impl_torch

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
    record["errors"].update(_raised(cases))
    if rank == 0:
        (folder / "torch.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _torch_main(folder: str) -> None:
    # Imported once here and forked into the ranks (spawn would import torch in each again).
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT))
    import impl_torch  # noqa: F401

    assert _rosetta(Path(folder) / "model.safetensors", Path(folder) / "dcp-converted", "--to", "dcp") == 0
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_torch_worker, args=(port, folder), nprocs=WORLD, join=True, start_method="fork")


# -- The JAX subprocess: 4 forced host devices ----------------------------------------------------


def _jax_main(folder: str) -> None:
    import jax

    sys.path.insert(0, str(ROOT))
    import impl_jax
    from impl_jax.shard import shard_shapes

    jax.config.update("jax_enable_x64", True)
    folder = Path(folder)
    assert _rosetta(folder / "model.safetensors", folder / "orbax-converted", "--to", "orbax") == 0
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
    record["errors"].update(_raised(cases))
    (folder / "jax.json").write_text(json.dumps(record))


# -- The tests ------------------------------------------------------------------------------------


def _rosetta(*argv) -> int:
    from conformance.cli import main

    return main(["convert", *(str(a) for a in argv)])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """model.safetensors, and after `records` the directories the subprocesses wrote from it (the
    ranks' and `--to dcp` / `--to orbax`'s, "dcp-converted" and "orbax-converted")."""
    from conformance.core import checkpoint

    folder = tmp_path_factory.mktemp("sharded")
    checkpoint.save(folder / "model.safetensors", _config(), _params())
    return folder


@pytest.fixture(scope="module")
def records(folder) -> dict:
    """{"torch": ..., "jax": ...}: both subprocesses, started together (each mostly waits on its imports)."""
    pytest.importorskip("torch")
    pytest.importorskip("orbax.checkpoint")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    envs = {"torch": {"OMP_NUM_THREADS": "1"}, "jax": {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}}
    runs = {which: subprocess.Popen([sys.executable, __file__, which, str(folder)],
                                    env={**os.environ, **env, "PYTHONPATH": pythonpath()},
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
    # Read into the target's own shards: under fsdp every parameter's local dim 0 is split over
    # "data"; under tp (1x2) a column-split weight (d_in, d_out) keeps half its dim 1, a row-split
    # one half its dim 0 (impl_torch.parallel.COLUMNS, ROWS).
    assert loaded["local"], "the target held no DTensor: it was not parallelized"
    full = {name: w.shape for name, w in _params().items()}
    if "fsdp" in plan:
        assert all(full[name][0] % shape[0] == 0 for name in loaded["local"]), "a dim 0 fsdp would pad"
        assert all(local[0] * shape[0] == full[name][0] for name, local in loaded["local"].items()), loaded["local"]
    if plan == "tp":
        from impl_torch.parallel import COLUMNS, ROWS

        layer = lambda name: name.rsplit(".", 2)[-2]  # noqa: E731  ("...self_attn.q_proj.weight" -> "q_proj")
        columns = {name: loaded["local"].get(name) for name in full if len(full[name]) == 2 and layer(name) in COLUMNS}
        rows = {name: loaded["local"].get(name) for name in full if len(full[name]) == 2 and layer(name) in ROWS}
        assert columns and rows, sorted(full)
        assert all(local == [full[n][0], full[n][1] // shape[1]] for n, local in columns.items()), columns
        assert all(local == [full[n][0] // shape[1], full[n][1]] for n, local in rows.items()), rows


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

    metadata = sharded.safe_reader(folder / "dcp-fsdp").read_metadata()
    files: dict = {}
    for index, where in metadata.storage_data.items():
        files.setdefault(index.fqn, {})[tuple(index.offset)] = where.relative_path
    for name, w in _params().items():
        chunks = metadata.state_dict_metadata[name].chunks
        assert w.shape[0] % WORLD == 0, (name, "FSDP2 pads an uneven dim 0: choose a config whose dims divide")
        assert sorted(tuple(c.sizes) for c in chunks) == [(w.shape[0] // WORLD, *w.shape[1:])] * WORLD, name
        assert sorted(files[name].values()) == ["__0_0.distcp", "__1_0.distcp"], (name, files[name])


@pytest.mark.parametrize("case, words", [
    ("exists", ("already exists",)),
    ("other config", ("differs", "d_ff (stored 32, the model's 64)")),
    ("other dtype", ("float64", "float32")),
])
def test_saving_and_loading_refuse_with_a_typed_error(torch_record, jax_record, case, words):
    for record in (torch_record, jax_record):
        message = record["errors"][case]
        assert all(word in message for word in words), (case, message)


@pytest.mark.parametrize("kind", ["dcp", "orbax"])
def test_the_converter_holds_one_tensor_at_a_time(folder, records, monkeypatch, kind):
    """A spy on the per-tensor read: when each tensor is read, at most the one before it is still
    alive (the generator's last binding); the rest were written and dropped."""
    from conformance.convert import sharded

    source = {"dcp": sharded.DcpSource, "orbax": sharded.OrbaxSource}[kind]
    read, alive, most = source.read, [], []

    def spy(self, name):
        value = read(self, name)
        most.append(sum(ref() is not None for ref in alive))
        alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(source, "read", spy)
    out = folder / f"spied-{kind}.safetensors"
    assert _rosetta(folder / f"{kind}-converted", out) == 0
    assert len(most) == len(_params()) and max(most) <= 1, most
    assert out.read_bytes() == (folder / "model.safetensors").read_bytes()


def test_save_streamed_writes_saves_file_whatever_the_byte_order(tmp_path):
    """`checkpoint.save_streamed`, given big-endian arrays one at a time, writes `save`'s file:
    the values stored little-endian, as safetensors requires."""
    from conformance.core import checkpoint
    from conformance.core.errors import CheckpointError
    from conformance.core.params import param_shapes

    params = _params()
    checkpoint.save(tmp_path / "saved.safetensors", _config(), params)
    dtypes = {name: "float64" for name in params}
    ordered = list(param_shapes(_config()))
    checkpoint.save_streamed(tmp_path / "streamed.safetensors", _config(), dtypes,
                             ((name, params[name].astype(">f8")) for name in ordered))
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "saved.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="nothing came where"):  # one short: no file, no temporary
        checkpoint.save_streamed(tmp_path / "short.safetensors", _config(), dtypes,
                                 ((name, params[name]) for name in ordered[:-1]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved.safetensors", "streamed.safetensors"]


def _dcp(path: Path, state: dict, config=True) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()},
             storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    if config:
        (path / "rosetta_config.json").write_text(_config().to_json())
    return path


def test_bad_directories_get_typed_errors(tmp_path):
    """Each refused with a CheckpointError naming the problem, and the destination never appears
    (a non-finite value is found mid-stream: the half-written temporary is removed)."""
    pytest.importorskip("torch")
    from conformance.convert import sharded
    from conformance.core.errors import CheckpointError

    params = _params()
    first, last = next(iter(params)), list(params)[-1]
    nan = params[last].copy()
    nan.flat[3] = np.nan
    cases = {
        "neither": (tmp_path / "empty", ("neither", ".metadata")),
        "missing": (_dcp(tmp_path / "missing", {k: v for k, v in params.items() if k != first}), ("missing", first)),
        "unexpected": (_dcp(tmp_path / "unexpected", {**params, "encoder.extra": params[first]}),
                       ("unexpected", "encoder.extra")),
        "shape": (_dcp(tmp_path / "shape", {**params, first: params[first][:1]}), ("shape", first)),
        "non-finite": (_dcp(tmp_path / "nan", {**params, last: nan}), (last, "NaN or infinite")),
        "not a tensor": (_dcp(tmp_path / "step", {**params, "step": 7}), ("'step'", "not a tensor")),
        "no config": (_dcp(tmp_path / "bare", params, config=False), ("rosetta_config.json",)),
    }
    (tmp_path / "empty").mkdir()
    for case, (path, words) in cases.items():
        with pytest.raises(CheckpointError) as caught:
            sharded.to_safetensors(path, tmp_path / f"{case}.safetensors")
        assert all(word in str(caught.value) for word in words), (case, str(caught.value))
        assert not (tmp_path / f"{case}.safetensors").exists(), case
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "a temporary was left behind"


def test_a_foreign_dcp_directory_converts_by_its_layout(tmp_path):
    """A DCP directory of another system's training state, without rosetta's config: DCP flattens
    {"model": state_dict, "step": 7} into "model.<key>" tensors and a bytes entry; `--key model`
    keeps the former (without the prefix), the step is left out, and the state dict converts by
    the layout its keys match, as the same state dict in a .pt file does."""
    pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from systems import from_scratch, randomize_

    from conformance.convert import import_state_dict
    from conformance.core import checkpoint

    state = randomize_(from_scratch.make(src_vocab=23, tgt_vocab=19, d_model=16, n_heads=2, d_ff=24, n_layers=2,
                                         max_len=12), seed=2).state_dict()
    dcp.save({"model": {k: v.detach().clone() for k, v in state.items()}, "step": 7},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "foreign")), no_dist=True)
    assert _rosetta(tmp_path / "foreign", tmp_path / "out.safetensors", "--key", "model", "--set", "n_heads=2") == 0
    config, params = checkpoint.load(tmp_path / "out.safetensors")
    expected_config, expected = import_state_dict(state, "from-scratch", n_heads=2)
    assert config.replace(notes={}) == expected_config.replace(notes={})
    assert _differing(params, expected) == [] and len(params) == len(expected)


def test_a_foreign_orbax_composite_is_not_taken_for_rosettas(tmp_path, capsys):
    """An Orbax composite checkpoint with items "params" and "config" whose config is not a
    ModelConfig (another trainer's) is refused with the command that converts its params item."""
    pytest.importorskip("orbax.checkpoint")
    import orbax.checkpoint as ocp

    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    checkpointer.save((tmp_path / "foreign").resolve(), ocp.args.Composite(
        params=ocp.args.StandardSave({"dense": {"kernel": np.ones((4, 4), np.float32)}}),
        config=ocp.args.JsonSave({"learning_rate": 0.1})))
    checkpointer.close()
    assert _rosetta(tmp_path / "foreign", tmp_path / "out.safetensors") == 2
    err = capsys.readouterr().err
    assert "not written by rosetta" in err and f"rosetta convert {tmp_path / 'foreign' / 'params'}" in err, err
    assert "learning_rate" in err, err


@pytest.mark.parametrize("kind", ["dcp", "orbax"])
def test_bfloat16_goes_to_a_directory_and_back_bit_for_bit(tmp_path, kind):
    """bfloat16, which NumPy lacks (ml_dtypes' on our side, torch's or JAX's on theirs), by its bits."""
    pytest.importorskip("torch" if kind == "dcp" else "orbax.checkpoint")
    from conformance.core import checkpoint

    checkpoint.save(tmp_path / "bf16.safetensors", _config(), {name: w.astype(ml_dtypes.bfloat16)
                                                                for name, w in _params().items()})
    assert _rosetta(tmp_path / "bf16.safetensors", tmp_path / "dir", "--to", kind) == 0
    assert _rosetta(tmp_path / "dir", tmp_path / "back.safetensors") == 0
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "bf16.safetensors").read_bytes()


@pytest.mark.parametrize("kind", ["dcp", "orbax"])
def test_inspect_describes_a_sharded_directory_from_its_metadata(folder, records, capsys, kind):
    from conformance.cli import main
    from conformance.core.params import param_shapes

    assert main(["inspect", str(folder / f"{kind}-converted")]) == 0
    out = capsys.readouterr().out
    assert "config and tensor index agree" in out and f"d_ff = {CONFIG['d_ff']}" in out, out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.startswith("  ")
            and len(line.split()) == 4}
    assert all(rows.get(name) == ["x".join(map(str, shape)), "float64"] for name, shape in param_shapes(_config()).items()), rows
    assert f"total: {len(_params())} tensors" in out, out


def test_writing_a_directory_without_its_engine_is_a_typed_error(folder, monkeypatch, capsys):
    """`--to dcp` without PyTorch (`--to orbax` without Orbax): exit 2 and what to install."""
    for kind, module in (("dcp", "torch.distributed.checkpoint"), ("orbax", "orbax.checkpoint")):
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError
        assert _rosetta(folder / "model.safetensors", folder / f"absent-{kind}", "--to", kind) == 2
        err = capsys.readouterr().err
        assert "--to" in err and "pip install" in err, (kind, err)
        assert not (folder / f"absent-{kind}").exists()


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
    with pytest.raises(CheckpointError, match="refused: the metadata names posix.system, which this reader's allow-list"):
        sharded.to_safetensors(path, tmp_path / "out.safetensors")
    assert not witness.exists()


def test_the_cli_refuses_layout_flags_and_existing_directories(folder, records, capsys):
    assert _rosetta(folder / "dcp-converted", folder / "x.safetensors", "--set", "n_heads=4") == 2
    assert "--set" in capsys.readouterr().err
    assert _rosetta(folder / "model.safetensors", folder / "dcp-converted", "--to", "dcp") == 2
    assert "already exists" in capsys.readouterr().err


if __name__ == "__main__":
    {"torch": _torch_main, "jax": _jax_main}[sys.argv[1]](sys.argv[2])


def test_load_state_reads_a_directory_saved_from_a_mesh_on_one_device(folder, records):
    """`impl_jax.save_sharded` from 4 devices (the jax subprocess), `impl_jax.load_state` in this
    process, which has one: every parameter bit for bit (no "Topology mismatch")."""
    import jax

    import impl_jax

    assert len(jax.devices()) == 1
    with impl_jax.enable_x64():
        model = impl_jax.load_state(folder / "orbax-fsdp")
        assert _differing({name: np.asarray(w) for name, w in model.params.items()}, _params()) == []
