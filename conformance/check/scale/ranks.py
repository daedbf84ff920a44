"""The child of `conformance.check.scale.sharded.sharded_runs`: every job and plan on the mesh, recorded
for the parent to compare (`python -m conformance.check.scale.ranks JOBS OUT`).

JAX: this one process, with the mesh's devices (forced host devices on the CPU: the parent sets
XLA_FLAGS before JAX is imported), writes OUT. Torch: one process per rank (`start_ranks`), each
writing OUT.RANK: every rank's gathered record, which the parent holds bitwise equal
(`sharded.agreed`) before comparing one with the oracle.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np

from conformance.check.scale.sharded import TIMEOUT_S, WARMUP, Job
from conformance.core.errors import InputError
from conformance.core.sharding import AXES


def _child(jobs_path: str, out_path: str) -> None:
    spec = pickle.loads(Path(jobs_path).read_bytes())
    if spec["backend"] == "jax":
        _apply_plant(spec)
        Path(out_path).write_bytes(pickle.dumps(_jax_runs(spec)))
        return
    world = spec["mesh"][0] * spec["mesh"][1]
    if spec["device"] == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise SystemExit(f"a mesh of {world} ranks needs {world} CUDA devices; this machine has "
                             f"{torch.cuda.device_count()}")
    start_ranks(_torch_rank, world, (spec, out_path), fork=spec["device"] == "cpu")


def start_ranks(function, world: int, args: tuple, *, fork: bool) -> None:
    """`function(rank, world, port, *args)` in `world` processes, a free port for the rendezvous;
    `fork`: forked after this process imports torch.distributed's FSDP2 and tensor-parallel APIs
    and the torch backend (gloo on the CPU: each spawned rank would import them again, ~8 s),
    else spawned (CUDA does not survive a fork)."""
    import torch.multiprocessing as mp

    if fork:
        import torch.distributed.fsdp  # noqa: F401 - imported once, before the fork
        import torch.distributed.tensor.parallel  # noqa: F401

        from conformance.check import backends

        backends.import_backend("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(function, args=(world, port, *args), nprocs=world, join=True,
                       start_method="fork" if fork else "spawn")


def _apply_plant(spec: dict) -> None:
    for entry in spec["path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    if spec["plant"]:
        module, function, argument = spec["plant"]
        getattr(importlib.import_module(module), function)(argument)


def _jobs(spec: dict):
    from conformance.core.config import ModelConfig

    for job in spec["jobs"]:
        yield Job(ModelConfig.from_json(job["config"]), job["params"], job["src_ids"], job["tgt_ids"], job["labels"],
                  job["label_smoothing"])


def _jax_runs(spec: dict) -> list[dict]:
    import jax
    from jax.sharding import Mesh

    from conformance.check import backends
    from conformance.core.output import tensors_of

    impl_jax = backends.import_backend("jax")
    data, width = spec["mesh"]
    devices = jax.devices("cpu" if spec["device"] == "cpu" else "gpu")
    if len(devices) < data * width:
        raise SystemExit(f"a mesh of {data * width} devices needs {data * width} JAX {spec['device']} devices; "
                         f"there are {len(devices)}")
    mesh = Mesh(np.array(devices[:data * width]).reshape(data, width), AXES)
    results = []
    with impl_jax.enable_x64(), impl_jax.full_precision():
        for job in _jobs(spec):
            per_plan = {}
            for plan in spec["plans"]:
                try:
                    model = impl_jax.shard(impl_jax.Model(job.config, job.params, "float64"), mesh, plan)
                except InputError as exc:
                    per_plan[plan] = {"refused": str(exc)}
                    continue
                out = model(job.src_ids, job.tgt_ids)
                record = {"forward": {name: np.asarray(t) for name, t in tensors_of(out).items()}}
                loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels,
                                                   label_smoothing=job.label_smoothing)
                record["loss"], record["grads"] = np.asarray(loss), {k: np.asarray(g) for k, g in grads.items()}
                impl_jax.Adam(model, d_model=job.config.d_model, warmup=WARMUP).step(grads)
                record["stepped"] = {name: np.asarray(w) for name, w in model.params.items()}
                per_plan[plan] = record
            results.append(per_plan)
    return results


def _torch_rank(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _apply_plant(spec)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    # A collective that waits longer than the parent will is a hang: fail it inside the ranks too.
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        mesh = init_device_mesh("cuda" if cuda else "cpu", spec["mesh"], mesh_dim_names=AXES)
        results = []
        for job in _jobs(spec):
            results.append({plan: _torch_plan(job, mesh, plan, cuda) for plan in spec["plans"]})
        Path(f"{out_path}.{rank}").write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


def whole(t):
    """A DTensor gathered by its own collectives (a replicated one: this rank's copy), a plain
    tensor as it is; as a NumPy array on the host."""
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().cpu().numpy().copy()


def gathered(t, mesh, dim: str, axis: int):
    """Each rank's piece of a plain tensor `t` along `axis`, over the mesh's `dim`, concatenated."""
    from torch.distributed.tensor import DTensor, Shard

    if mesh[dim].size() == 1:
        return t
    return DTensor.from_local(t.contiguous(), mesh[dim], [Shard(axis)], run_check=False).full_tensor()


def _torch_plan(job: Job, mesh, plan: str, cuda: bool) -> dict:
    import torch

    from conformance.check import backends
    from conformance.core.output import tensors_of

    impl_torch = backends.import_backend("torch")
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    size, rank = mesh["data"].size(), mesh["data"].get_local_rank()

    def rows(a):  # this "data" rank's rows, as parallelize's loss_and_grads takes them
        n = len(a) // size
        return torch.as_tensor(a)[rank * n:(rank + 1) * n]

    try:
        with impl_torch.full_precision():
            model = impl_torch.parallelize(impl_torch.Model(job.config, job.params, torch.float64, device=device),
                                           mesh, plan)
            with torch.no_grad():
                out = model(rows(job.src_ids), rows(job.tgt_ids))
            record = {"forward": {}}
            for name, t in tensors_of(out).items():
                if "tp" in plan and name in (out.attention or {}):  # (B / data, H / model, Tq, Tk): the local heads
                    t = gathered(t, mesh, "model", 1)
                record["forward"][name] = whole(gathered(t, mesh, "data", 0))
            loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels, label_smoothing=job.label_smoothing)
            record["loss"], record["grads"] = whole(loss), {k: whole(g) for k, g in grads.items()}
            impl_torch.Adam(model, d_model=job.config.d_model, warmup=WARMUP).step(grads)
            record["stepped"] = {name: whole(p) for name, p in model.named_parameters()}
            return record
    except InputError as exc:  # raised on every rank alike, before any collective
        return {"refused": str(exc)}


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
