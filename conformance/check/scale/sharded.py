"""Sharded runs beside the float64 oracle: every plan of `impl_jax.shard` and `impl_torch.parallelize`
on a (data, model) mesh, compared tensor by tensor (docs/sharding.md, issue 46).

    runs = sharded_runs("torch", "cpu", (2, 2), [job])     # {plan: SHARDED record} per job
    rows = compared(runs[0]["fsdp"], job, "cpu")            # forward, loss, gradients, one Adam step

A mesh of several devices needs several of them, which a test process does not have: JAX fixes its
device count when it is imported (on the CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=N`
before the import), and torch.distributed runs one process per rank. So the sharded runs happen in
a child process (`python -m conformance.check.scale.ranks JOBS OUT`): for JAX one process with
the mesh's devices (forced host devices on the CPU); for torch one process per rank
(`sharded_ranks.start_ranks`):
gloo ranks forked on the CPU after one import of torch.distributed's parallel APIs (a spawned rank
imports them again, ~8 s each), NCCL ranks spawned on CUDA (rank i on cuda:i; CUDA does not survive
a fork). Every plan of every job runs in that one child, so a suite run pays one JAX import (and
its compiles) or one start of the ranks. The child runs in a session of its own: past `TIMEOUT_S`
the whole group (the ranks too) is killed and the run is a RuntimeError.

Every torch rank records what it gathered; the parent holds them to be bitwise equal first (a
replicated DTensor's `full_tensor()` is that rank's own copy, so a bug on one rank shows only
there), naming the first rank and tensor that differ, then compares rank 0's with the oracle.

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

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conformance.core.errors import InputError
from conformance.core.sharding import PLANS

DEVICES = {"torch": ("cpu", "cuda"), "jax": ("cpu", "gpu")}  # the device kinds each backend shards on
WARMUP = 10  # Adam's warmup for the one step: the paper's 4000 would make the step ~1e-7 and blind
TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parents[3]


def parse_mesh(text: str, option: str = "--mesh") -> tuple[int, int]:
    """"data=D,model=M" (either may be left out: size 1) -> (D, M); InputError(option) otherwise."""
    sizes = {"data": 1, "model": 1}
    seen = set()
    for part in (p.strip() for p in str(text).split(",")):
        name, sep, value = part.partition("=")
        name = name.strip()
        digits = value.strip()
        # ASCII digits only: str.isdigit() also takes '²' and other scripts' digits, which int() refuses or reads
        if not sep or name not in sizes or not (digits.isascii() and digits.isdigit()) or int(digits) < 1 or name in seen:
            raise InputError(option, f"expected data=D,model=M with positive integers (e.g. data=2,model=2), "
                                      f"got {text!r}")
        seen.add(name)
        sizes[name] = int(value)
    return sizes["data"], sizes["model"]


def mesh_label(mesh: tuple[int, int]) -> str:
    return f"data={mesh[0]},model={mesh[1]}"


def repeated_rows(count: int, data: int) -> np.ndarray:
    """Row indices that repeat `count` rows cyclically to the next multiple of `data` (a batch
    whose rows divide over the mesh's "data")."""
    return np.arange(-(-count // data) * data) % count


def table_error(max_abs: float, scale: float) -> float:
    """The tolerance table's measure: the largest absolute difference over max(1, the scale)."""
    return max_abs / max(1.0, scale)


def max_error(actual, expected) -> float:
    """`table_error` of two arrays: max |actual - expected| / max(1, max |expected|)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return table_error(float(np.max(np.abs(actual - expected))), float(np.max(np.abs(expected))))


# The meshes a run uses when none is given: one per backend under the `ci` profile (CI time),
# issue 46's three under the others; a GPU's is 1x1 (one device is what a lent machine has).
CI_MESHES = {"torch": ((2, 2),), "jax": ((2, 2),)}
ALL_MESHES = {"torch": ((4, 1), (2, 2), (1, 4)), "jax": ((8, 1), (4, 2), (2, 4))}


# The plans a run under `ci` without --mesh checks against the oracle: JAX's compiles are the cost
# (four programs per plan, ~10 s of CPU each plan on a 1+1-layer model), and "fsdp+tp" places
# every parameter by both of the other splits. tests/scale/test_jax_shard.py runs every plan against the
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
    source: str = ""  # where the case came from, in words (a failure prints it)


# -- The parent: start the child, read what it recorded -------------------------------------------


def sharded_runs(backend: str, device: str, mesh: tuple[int, int], jobs: list[Job], plans=PLANS, *,
                 _plant: tuple[str, str, object] | None = None) -> list[dict]:
    """Run every job under every plan on `mesh` (data, model) in a child process; per job, {plan:
    record}: {"forward": {name: array}, "loss", "grads": {name: array}, "stepped": {name: array}}
    or {"refused": message}; a record whose ranks disagree also has "ranks": which rank and
    tensor first differ from rank 0's (`compared` fails it first). A child that fails or runs past
    `TIMEOUT_S` is a RuntimeError carrying its stderr.

    `_plant`, a test seam: (module, function, argument) called in each child process (each rank)
    before anything runs, with this process's sys.path: how tests plant a bug (tests/breaks.py)."""
    if backend not in DEVICES:
        raise InputError("backend", f"sharded runs exist for {' and '.join(DEVICES)}, not {backend!r}")
    if device not in DEVICES[backend]:
        raise InputError("device", f"{backend} shards on {' or '.join(DEVICES[backend])}, not {device!r}")
    unknown = [plan for plan in plans if plan not in PLANS]
    if unknown or not plans:
        raise InputError("plans", f"expected some of {', '.join(PLANS)}, got {list(plans)!r}")
    with tempfile.TemporaryDirectory(prefix="rosetta-sharded-") as folder:
        jobs_path, out_path = Path(folder) / "jobs.pkl", Path(folder) / "out.pkl"
        jobs_path.write_bytes(pickle.dumps({
            "backend": backend, "device": device, "mesh": tuple(mesh), "plans": tuple(plans), "plant": _plant,
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
        what = f"the sharded {backend}/{device} runs on {mesh_label(mesh)}"
        # A session of its own: on a timeout the group is killed, the ranks with their parent.
        child = subprocess.Popen([sys.executable, "-m", "conformance.check.scale.ranks", str(jobs_path), str(out_path)],
                                 env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
        try:
            _, stderr = child.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            _, stderr = child.communicate()
            raise RuntimeError(f"{what} timed out after {TIMEOUT_S} s (the child and its ranks were killed):\n"
                               f"{stderr[-4000:]}") from None
        paths = [out_path] if backend == "jax" else [Path(f"{out_path}.{rank}") for rank in range(mesh[0] * mesh[1])]
        if child.returncode != 0 or not all(path.exists() for path in paths):
            raise RuntimeError(f"{what} failed (exit {child.returncode}):\n{stderr[-4000:]}")
        return agreed([pickle.loads(path.read_bytes()) for path in paths])


def agreed(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's records, each marked with the first rank and tensor whose bytes differ from rank
    0's ("ranks"), if one does: every rank gathers the same whole tensors, so any difference is
    a rank that computed something else."""
    records = []
    for job, first in enumerate(per_rank[0]):
        marked = {}
        for plan, record in first.items():
            differs = next(filter(None, (_first_difference(record, others[job][plan], rank)
                                         for rank, others in enumerate(per_rank) if rank)), None)
            marked[plan] = record if differs is None else {**record, "ranks": differs}
        records.append(marked)
    return records


def _first_difference(mine: dict, theirs: dict, rank: int) -> str | None:
    if "refused" in mine or "refused" in theirs:
        return None if mine.get("refused") == theirs.get("refused") else f"rank {rank} refused differently"
    for name, a, b in _flattened(mine, theirs):
        if b is None:
            return f"rank {rank} did not record {name}"
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            gap = (f"max |difference| {float(np.max(np.abs(a - b))):.3g}" if a.shape == b.shape
                   else f"shape {b.shape} against {a.shape}")
            return f"rank {rank}'s {name} differs from rank 0's ({gap})"
    return None


def _flattened(mine: dict, theirs: dict):
    """(name, rank 0's, the other's) in `compared`'s order: forward, loss, gradients, stepped."""
    for name, t in mine["forward"].items():
        yield name, t, theirs["forward"].get(name)
    yield "loss", mine["loss"], theirs.get("loss")
    for key, prefix in (("grads", "grad:"), ("stepped", "step:")):
        for name, t in mine[key].items():
            yield prefix + name, t, theirs[key].get(name)


def _portable(job: Job) -> dict:  # plain arrays and the config's JSON: the child unpickles no class of ours
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
    rows = []
    if "ranks" in record:  # the ranks' own copies disagree: nothing gathered from one rank is the run's
        rows.append(Row("ranks", Comparison(passed=False, shape_problem=record["ranks"]), forward_tol))
    pairs = [(name, record["forward"].get(name), expected["forward"][name], forward_tol)
             for name in forward_order(job.config) if name in expected["forward"]]
    pairs.append(("loss", record.get("loss"), expected["loss"], grad_tol))
    pairs += [(f"grad:{name}", record["grads"].get(name), expected["grads"][name], grad_tol) for name in reversed(names)]
    if all(name in record["grads"] for name in names):
        stepped = oracle_step(job, record["grads"])
        pairs += [(f"step:{name}", record.get("stepped", {}).get(name), stepped[name], forward_tol) for name in names]
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
    if name == "ranks":
        return "the ranks' gathered copies (they disagree)"
    return "the loss" if name == "loss" else f"tensor {name}"
