"""Sharded runs beside the float64 oracle: every plan of `impl_jax.shard` and `impl_torch.parallelize`
on a (data, model) mesh, compared tensor by tensor (docs/sharding.md, issue 46).

    runs = sharded_runs("torch", "cpu", (2, 2), [job])     # {plan: SHARDED record} per job
    rows = compared(runs[0]["fsdp"], job, "cpu")            # forward, loss, gradients, one Adam step

A mesh of several devices needs several of them, which a test process does not have: JAX fixes its
device count when it is imported (on the CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=N`
before the import), and torch.distributed runs one process per rank. So the sharded runs happen in
a child process (`python -m conformance.check.sharded JOBS OUT`): for JAX one process with the
mesh's devices (forced host devices on the CPU); for torch `torch.multiprocessing.spawn` of one
rank per device, gloo on the CPU, NCCL on CUDA (rank i on cuda:i). Every plan of every job runs
in that one child, so a suite run pays one JAX import (and its compiles) or one spawn.

What is compared, in this order, each by the tolerance table (float64 rows):
  the forward tensors (`forward_order`: embeddings, attention maps, sublayer outputs, logits),
  the batch's rows and (under torch "tp") the heads gathered from the ranks;
  the loss and each gathered gradient (gradient row), the output's first (backward order);
  each parameter after one Adam step, against the oracle's Adam (impl_numpy) given the same
  gathered gradients: the step's own arithmetic on sharded parameters, apart from the gradients
  already compared (Adam's first step amplifies a rounding-level difference of a zero gradient
  1e7-fold, docs/sharding.md, so a step from the oracle's own gradients would not be a fair bound).

A plan the mesh cannot hold for a model (a size that does not divide) is recorded as refused with
the backend's `InputError` message, never replaced by another plan.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conformance.core.errors import InputError

PLANS = ("dp", "fsdp", "tp", "fsdp+tp")
AXES = ("data", "model")
WARMUP = 10  # Adam's warmup for the one step: the paper's 4000 would make the step ~1e-7 and blind
TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parents[2]


def parse_mesh(text: str, option: str = "--mesh") -> tuple[int, int]:
    """"data=D,model=M" (either may be left out: size 1) -> (D, M); InputError(option) otherwise."""
    sizes = {"data": 1, "model": 1}
    seen = set()
    for part in (p.strip() for p in str(text).split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in sizes or not value.strip().isdigit() or int(value) < 1 or name in seen:
            raise InputError(option, f"expected data=D,model=M with positive integers (e.g. data=2,model=2), "
                                      f"got {text!r}")
        seen.add(name)
        sizes[name] = int(value)
    return sizes["data"], sizes["model"]


def mesh_label(mesh: tuple[int, int]) -> str:
    return f"data={mesh[0]},model={mesh[1]}"


# The meshes a run uses when none is given: one per backend under the `ci` profile (CI time),
# issue 46's three under the others; a GPU's is 1x1 (one device is what a lent machine has).
CI_MESHES = {"torch": ((2, 2),), "jax": ((2, 2),)}
ALL_MESHES = {"torch": ((4, 1), (2, 2), (1, 4)), "jax": ((8, 1), (4, 2), (2, 4))}


# The plans a run under `ci` without --mesh checks against the oracle: JAX's compiles are the cost
# (four programs per plan, ~10 s of CPU each plan on a 1+1-layer model), and "fsdp+tp" places
# every parameter by both of the other splits. tests/test_jax_shard.py runs every plan against the
# unsharded JAX model under `ci`; --mesh and the other profiles run every plan here.
CI_PLANS = {"torch": PLANS, "jax": ("fsdp+tp",)}


def default_meshes(backend: str, device: str, profile: str) -> tuple[tuple[int, int], ...]:
    if device != "cpu":
        return ((1, 1),)
    return (CI_MESHES if profile == "ci" else ALL_MESHES)[backend]


@dataclass(frozen=True)
class ShardedTarget:
    """What the sharded property runs on: a backend and device kind, a (data, model) mesh, a plan."""

    backend: str
    device: str
    mesh: tuple[int, int]
    plan: str

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.device}/float64 {mesh_label(self.mesh)} {self.plan}"


@dataclass(frozen=True)
class Job:
    """One case to run sharded: a config, its float64 parameters, a batch whose rows divide over
    "data", labels and the label smoothing."""

    config: object
    params: dict
    src_ids: np.ndarray
    tgt_ids: np.ndarray
    labels: np.ndarray
    label_smoothing: float = 0.0


# -- The parent: start the child, read what it recorded -------------------------------------------


def sharded_runs(backend: str, device: str, mesh: tuple[int, int], jobs: list[Job], plans=PLANS,
                 plant: tuple[str, str, str] | None = None) -> list[dict]:
    """Run every job under every plan on `mesh` (data, model) in a child process; per job, {plan:
    record}: {"forward": {name: array}, "loss", "grads": {name: array}, "stepped": {name: array},
    "lr"} or {"refused": message}. `plant`: (module, function, argument) called in each child
    process before anything runs, with this process's sys.path: how tests plant a bug
    (tests/breaks.py). A child that fails is a RuntimeError carrying its stderr."""
    if backend not in ("torch", "jax"):
        raise InputError("backend", f"sharded runs exist for torch and jax, not {backend!r}")
    with tempfile.TemporaryDirectory(prefix="rosetta-sharded-") as folder:
        jobs_path, out_path = Path(folder) / "jobs.pkl", Path(folder) / "out.pkl"
        jobs_path.write_bytes(pickle.dumps({
            "backend": backend, "device": device, "mesh": tuple(mesh), "plans": tuple(plans), "plant": plant,
            "path": [p for p in sys.path if p], "jobs": [_portable(job) for job in jobs]}))
        # The child finds this package from anywhere; the rest of this process's sys.path (a plant's
        # module) is in the job and added by `_plant`.
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        if backend == "jax":
            env["JAX_PLATFORMS"] = "cpu" if device == "cpu" else "cuda"
            if device == "cpu":
                flag = f"--xla_force_host_platform_device_count={mesh[0] * mesh[1]}"
                env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        run = subprocess.run([sys.executable, "-m", "conformance.check.sharded", str(jobs_path), str(out_path)],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        if run.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the sharded {backend}/{device} runs on {mesh_label(mesh)} failed "
                               f"(exit {run.returncode}):\n{run.stderr[-4000:]}")
        return pickle.loads(out_path.read_bytes())


def _portable(job: Job) -> dict:
    return {"config": job.config.to_json(), "params": {k: np.asarray(v, np.float64) for k, v in job.params.items()},
            "src_ids": np.asarray(job.src_ids), "tgt_ids": np.asarray(job.tgt_ids), "labels": np.asarray(job.labels),
            "label_smoothing": float(job.label_smoothing)}


# -- The comparison with the oracle ---------------------------------------------------------------


@dataclass
class Row:
    """One compared tensor: its name ("logits", "loss", "grad:NAME", "step:NAME"), the comparison
    and the tolerance it was held to."""

    name: str
    comparison: object
    tolerance: object


def oracle(job: Job) -> dict:
    """The float64 NumPy model's forward tensors, loss and gradients for `job`."""
    from conformance.check import backends
    from conformance.check.backends import Target
    from conformance.check.compare import to_numpy
    from conformance.core.output import tensors_of

    model = backends.build(Target("numpy", "cpu", "float64"), job.config, job.params)
    forward = {name: to_numpy(t) for name, t in tensors_of(model(job.src_ids, job.tgt_ids)).items()}
    loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels, label_smoothing=job.label_smoothing)
    return {"forward": forward, "loss": np.asarray(loss), "grads": {k: np.asarray(g) for k, g in grads.items()}}


def oracle_step(job: Job, grads: dict) -> dict:
    """The oracle's parameters after one Adam step (impl_numpy.Adam, warmup `WARMUP`) from `grads`."""
    from conformance.check import backends

    impl_numpy = backends.import_backend("numpy")
    model = impl_numpy.Model(job.config, job.params, "float64")
    impl_numpy.Adam(model, d_model=job.config.d_model, warmup=WARMUP).step(grads)
    return {name: np.asarray(w) for name, w in model.params.items()}


def compared(record: dict, job: Job, device: str, expected: dict | None = None) -> list[Row]:
    """Every tensor of a sharded `record` against the oracle, in order (forward, loss, gradients
    in backward order, stepped parameters); a missing tensor is a failing row of its own."""
    from conformance.check.compare import Comparison, compare
    from conformance.check.tolerances import gradient_tolerance, tolerance
    from conformance.core.output import forward_order
    from conformance.core.params import param_shapes

    expected = expected or oracle(job)
    forward_tol, grad_tol = tolerance("float64", device), gradient_tolerance("float64", device)
    names = list(param_shapes(job.config))
    pairs = [(name, record["forward"].get(name), expected["forward"][name], forward_tol)
             for name in forward_order(job.config) if name in expected["forward"]]
    pairs.append(("loss", record.get("loss"), expected["loss"], grad_tol))
    pairs += [(f"grad:{name}", record["grads"].get(name), expected["grads"][name], grad_tol) for name in reversed(names)]
    if all(name in record["grads"] for name in names):
        stepped = oracle_step(job, record["grads"])
        pairs += [(f"step:{name}", record["stepped"].get(name), stepped[name], forward_tol) for name in names]
    rows = []
    for name, got, want, tol in pairs:
        result = (Comparison(passed=False, shape_problem="not returned by the sharded run") if got is None
                  else compare(got, want, tol))
        rows.append(Row(name, result, tol))
    return rows


def first_divergence(rows: list[Row]) -> Row | None:
    return next((row for row in rows if not row.comparison.passed), None)


def describe(name: str) -> str:
    """A row's name in words: the tensor, the loss, a parameter's gradient or stepped value."""
    if name.startswith("grad:"):
        return f"the gradient of {name[5:]}"
    if name.startswith("step:"):
        return f"{name[5:]} after one Adam step"
    return "the loss" if name == "loss" else f"tensor {name}"


# -- The child: every job and plan, on the mesh ---------------------------------------------------


def _child(jobs_path: str, out_path: str) -> None:
    spec = pickle.loads(Path(jobs_path).read_bytes())
    if spec["backend"] == "jax":
        _plant(spec)
        Path(out_path).write_bytes(pickle.dumps(_jax_runs(spec)))
        return
    import torch.multiprocessing as mp

    world = spec["mesh"][0] * spec["mesh"][1]
    if spec["device"] == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise SystemExit(f"a mesh of {world} ranks needs {world} CUDA devices; this machine has "
                             f"{torch.cuda.device_count()}")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_torch_rank, args=(world, port, spec, out_path), nprocs=world, join=True)


def _plant(spec: dict) -> None:
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
                optimizer = impl_jax.Adam(model, d_model=job.config.d_model, warmup=WARMUP)
                record["lr"] = float(optimizer.lr)
                optimizer.step(grads)
                record["stepped"] = {name: np.asarray(w) for name, w in model.params.items()}
                per_plan[plan] = record
            results.append(per_plan)
    return results


def _torch_rank(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _plant(spec)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cuda" if cuda else "cpu", spec["mesh"], mesh_dim_names=AXES)
        results = []
        for job in _jobs(spec):
            results.append({plan: _torch_plan(job, mesh, plan, cuda) for plan in spec["plans"]})
        if rank == 0:
            Path(out_path).write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


def _torch_plan(job: Job, mesh, plan: str, cuda: bool) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from conformance.check import backends
    from conformance.core.output import tensors_of

    impl_torch = backends.import_backend("torch")
    parallel = importlib.import_module(impl_torch.__name__ + ".parallel")  # local_rows
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"

    def host(t):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        return t.detach().cpu().numpy().copy()

    def gather(t, dim: str, axis: int):  # each rank's piece of `t` along `axis`, over the mesh's `dim`
        if mesh[dim].size() == 1:
            return t
        return DTensor.from_local(t.contiguous(), mesh[dim], [Shard(axis)], run_check=False).full_tensor()

    try:
        with impl_torch.full_precision():
            model = impl_torch.parallelize(impl_torch.Model(job.config, job.params, torch.float64, device=device),
                                           mesh, plan)
            rows = lambda a: parallel.local_rows(mesh, "ids", torch.as_tensor(a))  # noqa: E731
            with torch.no_grad():
                out = model(rows(job.src_ids), rows(job.tgt_ids))
            record = {"forward": {}}
            for name, t in tensors_of(out).items():
                if "tp" in plan and name in (out.attention or {}):  # (B / data, H / model, Tq, Tk): the local heads
                    t = gather(t, "model", 1)
                record["forward"][name] = host(gather(t, "data", 0))
            loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels, label_smoothing=job.label_smoothing)
            record["loss"], record["grads"] = host(loss), {k: host(g) for k, g in grads.items()}
            optimizer = impl_torch.Adam(model, d_model=job.config.d_model, warmup=WARMUP)
            record["lr"] = float(optimizer.lr)
            optimizer.step(grads)
            record["stepped"] = {name: host(p) for name, p in model.named_parameters()}
            return record
    except InputError as exc:  # raised on every rank alike, before any collective
        return {"refused": str(exc)}


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
