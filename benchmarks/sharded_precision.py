"""Sharded mixed precision, measured (issue 46; docs/tolerances.md, "Sharded mixed precision").

    python benchmarks/sharded_precision.py            # the table quoted in docs/tolerances.md
    python benchmarks/sharded_precision.py --no-jax   # torch only (no JAX compiles)

Every run starts from the same float32 parameters (the seeded `init_params`, rounded once to
float32: the master weights) and is compared with the float64 NumPy oracle given those values:

  torch fsdp bf16/f32   FSDP2 `fully_shard` over 2 gloo ranks (`impl_torch.parallelize(...,
                        "fsdp", mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16,
                        reduce_dtype=float32))`): float32 shards, gathered and computed in
                        bfloat16, gradients reduce-scattered in float32, Adam on float32 shards
  torch fsdp bf16-averaged (planted bug)
                        the same, with the gradients reduced in bfloat16 and averaged over the
                        ranks instead of summed (each gradient 1/2 of its value): neither the
                        forward nor the gradient bfloat16 row sees it (both 2e-1); the
                        comparison with the unsharded run does
  torch bf16/f32        the unsharded model with the same split (`Model(config, params,
                        torch.bfloat16, param_dtype=torch.float32)`)
  torch bf16            the unsharded pure bfloat16 model (the table's bfloat16 row)
  jax fsdp bf16/f32     `impl_jax.shard(Model(config, params, "bfloat16", param_dtype="float32"),
                        mesh, "fsdp")` on 2 forced host devices, in a child process
  jax bf16/f32          the same model unsharded, in that child

Each is measured on the logits, the loss, every gathered gradient (the worst is printed) and
one Adam step (each parameter against the oracle's Adam given the run's own gradients, as
`conformance.check.scale.sharded.compared` does, so the step's arithmetic is measured apart from the
gradients'), in the tolerance table's measure: max |run - oracle| / max(1, max |oracle|). The
last column holds the worst gradient and the loss to the table's bfloat16 gradient row
(`gradient_tolerance`), as the gradient property does.

The rows "A - B" are run A's difference from run B: what sharding alone changes.
`run_torch_fsdp` (the forked gloo ranks) is what tests/scale/test_sharded_precision.py runs.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conformance.check.scale.sharded import WARMUP, Job, max_error, oracle, oracle_step  # noqa: E402
from conformance.check.scale.ranks import gathered, start_ranks  # noqa: E402
from conformance.core.errors import InputError  # noqa: E402

WORLD = 2  # gloo ranks / forced host devices: the mesh is (WORLD, 1), plan "fsdp"
BATCH, SRC_LEN, TGT_LEN = 8, 6, 5
LABEL_SMOOTHING = 0.1
# (d_model, layers a side): the suite's sizes, so the bfloat16 row (measured up to d_model 64,
# 3 layers) is the claim being tested.
SIZES = ((16, 1), (32, 2), (64, 3))
PLANTED = "torch fsdp bf16-averaged (planted bug)"
RUNS = ("torch fsdp bf16/f32", PLANTED, "torch bf16/f32", "torch bf16", "jax fsdp bf16/f32", "jax bf16/f32")
# "reduce": the gradients' reduction as `parallelize` sets it (a sum of each rank's share of the
# batch mean), in float32; "bf16-averaged": a planted precision bug, the reduction in bfloat16
# and averaged over the ranks instead of summed (every gradient 1/WORLD of its value).
REDUCTIONS = ("reduce", "bf16-averaged")


def config_of(d_model: int, layers: int):
    from conformance.core.config import ModelConfig

    return ModelConfig(d_model=d_model, n_heads=4, d_ff=2 * d_model, src_vocab_size=32, tgt_vocab_size=32,
                       n_encoder_layers=layers, n_decoder_layers=layers, max_len=16)


def job_of(d_model: int, layers: int, seed: int = 0) -> Job:
    """A job whose parameters are float32 values (held as float64, so the oracle sees exactly the
    master weights every run starts from), with padding and uneven counted tokens per rank."""
    from conformance.core.params import init_params

    config = config_of(d_model, layers)
    params = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in init_params(config, seed=seed).items()}
    rng = np.random.default_rng(seed)
    src = rng.integers(1, config.src_vocab_size, (BATCH, SRC_LEN))
    tgt = rng.integers(1, config.tgt_vocab_size, (BATCH, TGT_LEN))
    labels = rng.integers(1, config.tgt_vocab_size, (BATCH, TGT_LEN))
    src[1, -2:] = config.pad_id
    labels[2, -1] = config.pad_id
    labels[5, -3:] = config.pad_id
    return Job(config, params, src, tgt, labels, LABEL_SMOOTHING, source=f"d_model {d_model}, {layers}+{layers} layers")


def host(t) -> np.ndarray:
    """A tensor (a DTensor gathered by its own collectives) as a float64 NumPy array."""
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().cpu().double().numpy()


# -- torch: FSDP2 over forked gloo ranks ------------------------------------------------------------


def _fsdp_rank(rank: int, world: int, port: int, jobs: list[Job], reduction: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import impl_torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data", "model"))
        reduce_dtype = torch.float32 if reduction == "reduce" else torch.bfloat16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        n, index = mesh["data"].size(), mesh["data"].get_local_rank()
        rows = lambda a: torch.as_tensor(a)[index * len(a) // n:(index + 1) * len(a) // n]  # noqa: E731 - this rank's
        records = []
        for job in jobs:
            with impl_torch.full_precision():
                records.append(_fsdp_record(job, mesh, policy, reduction, rows, world))
        if rank == 0:
            Path(out_path).write_bytes(pickle.dumps(records))
    finally:
        dist.destroy_process_group()


def _fsdp_record(job: Job, mesh, policy, reduction: str, rows, world: int) -> dict:
    """One job's gathered record on this rank (see `run_torch_fsdp`)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    import impl_torch

    model = impl_torch.parallelize(impl_torch.Model(job.config, job.params, torch.float32), mesh, "fsdp",
                                   mp_policy=policy)
    if reduction == "bf16-averaged":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(world))
    with torch.no_grad():
        out = model(rows(job.src_ids), rows(job.tgt_ids))
    record = {"logits dtype": str(out.logits.dtype),
              "logits": host(gathered(out.logits, mesh, "data", 0))}
    loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels,
                                       label_smoothing=job.label_smoothing)
    record["loss"], record["grads"] = host(loss), {k: host(g) for k, g in grads.items()}
    record["grad dtypes"] = sorted({str(g.dtype) for g in grads.values()})
    impl_torch.Adam(model, d_model=job.config.d_model, warmup=WARMUP).step(grads)
    record["stepped"] = {name: host(p) for name, p in model.named_parameters()}
    return record


def run_torch_fsdp(jobs: list[Job], reduction: str = "reduce") -> list[dict]:
    """Each job under FSDP2 bf16/f32 on WORLD forked gloo ranks: rank 0's gathered record
    {"logits", "loss", "grads", "stepped", ...}. `reduction`: one of REDUCTIONS."""
    if reduction not in REDUCTIONS:
        raise InputError("reduction", f"expected one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    with tempfile.TemporaryDirectory(prefix="rosetta-sharded-precision-") as folder:
        out = Path(folder) / "out.pkl"
        start_ranks(_fsdp_rank, WORLD, (jobs, reduction, str(out)), fork=True)
        return pickle.loads(out.read_bytes())


def run_torch_unsharded(job: Job, *, mixed: bool) -> dict:
    """The unsharded torch model in bfloat16 (`mixed`: with float32 parameters) on the whole batch."""
    import torch

    import impl_torch

    model = impl_torch.Model(job.config, job.params, torch.bfloat16, param_dtype=torch.float32 if mixed else None)
    with impl_torch.full_precision():
        with torch.no_grad():
            record = {"logits": host(model(job.src_ids, job.tgt_ids).logits)}
        loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels, label_smoothing=job.label_smoothing)
        record["loss"], record["grads"] = host(loss), {k: host(g) for k, g in grads.items()}
        impl_torch.Adam(model, d_model=job.config.d_model, warmup=WARMUP).step(grads)
        record["stepped"] = {name: host(p) for name, p in model.named_parameters()}
    return record


# -- JAX: a child process with forced host devices --------------------------------------------------


def _jax_child(jobs_path: str, out_path: str) -> None:
    import jax
    from jax.sharding import Mesh

    import impl_jax

    jobs = pickle.loads(Path(jobs_path).read_bytes())
    mesh = Mesh(np.array(jax.devices("cpu")[:WORLD]).reshape(WORLD, 1), ("data", "model"))
    results = []
    with impl_jax.full_precision():
        for job in jobs:
            results.append(_jax_job(impl_jax, job, mesh))
    Path(out_path).write_bytes(pickle.dumps(results))


def _jax_job(impl_jax, job: Job, mesh) -> dict:
    """{run: record} for the unsharded and the sharded JAX bf16/f32 model."""
    params32 = {k: np.asarray(v, np.float32) for k, v in job.params.items()}  # exact: they are float32 values
    plain = impl_jax.Model(job.config, params32, "bfloat16", param_dtype="float32")
    sharded = impl_jax.shard(plain, mesh, "fsdp")  # placed before `plain` takes its step
    per_run = {}
    for run, model in (("jax bf16/f32", plain), ("jax fsdp bf16/f32", sharded)):
        record = {"logits": np.asarray(model(job.src_ids, job.tgt_ids).logits, np.float64)}
        loss, grads = model.loss_and_grads(job.src_ids, job.tgt_ids, job.labels, label_smoothing=job.label_smoothing)
        record["loss"] = np.asarray(loss, np.float64)
        record["grads"] = {k: np.asarray(g, np.float64) for k, g in grads.items()}
        impl_jax.Adam(model, d_model=job.config.d_model, warmup=WARMUP).step(grads)
        record["stepped"] = {k: np.asarray(w, np.float64) for k, w in model.params.items()}
        per_run[run] = record
    return per_run


def run_jax(jobs: list[Job]) -> list[dict]:
    """Per job {run: record} for the two JAX runs, from a child with WORLD forced host devices."""
    with tempfile.TemporaryDirectory(prefix="rosetta-sharded-precision-") as folder:
        jobs_path, out_path = Path(folder) / "jobs.pkl", Path(folder) / "out.pkl"
        jobs_path.write_bytes(pickle.dumps(jobs))
        flag = f"--xla_force_host_platform_device_count={WORLD}"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        child = subprocess.run([sys.executable, __file__, "--jax-child", str(jobs_path), str(out_path)], env=env,
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
        if child.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the JAX child failed (exit {child.returncode}):\n{child.stderr[-4000:]}")
        return pickle.loads(out_path.read_bytes())


# -- The measure ------------------------------------------------------------------------------------


def errors(record: dict, job: Job, expected: dict | None = None) -> dict:
    """The table's measure of `record` against the oracle: {"logits", "loss", "grads", "step"}
    (the worst gradient and stepped parameter), with "grads at" and "step at" naming them."""
    expected = expected or oracle(job)
    found = {"logits": max_error(record["logits"], expected["forward"]["logits"]),
             "loss": max_error(record["loss"], expected["loss"])}
    grads = {name: max_error(record["grads"][name], g) for name, g in expected["grads"].items()}
    stepped = oracle_step(job, record["grads"])
    step = {name: max_error(record["stepped"][name], w) for name, w in stepped.items()}
    found["grads at"] = max(grads, key=grads.get)
    found["grads"] = grads[found["grads at"]]
    found["step at"] = max(step, key=step.get)
    found["step"] = step[found["step at"]]
    return found


def differences(record: dict, other: dict) -> dict:
    """The table's measure of `record` against another run's `other` (not the oracle): what
    sharding alone changes, {"logits", "loss", "grads", "step"} (the worst of each)."""
    return {"logits": max_error(record["logits"], other["logits"]), "loss": max_error(record["loss"], other["loss"]),
            "grads": max(max_error(g, other["grads"][name]) for name, g in record["grads"].items()),
            "step": max(max_error(w, other["stepped"][name]) for name, w in record["stepped"].items())}


def measure(sizes=SIZES, *, with_jax: bool = True) -> list[tuple[str, str, dict]]:
    """(size, run, errors) for every size and run; the run "A - B" is A's difference from B."""
    jobs = [job_of(d, n) for d, n in sizes]
    expected = [oracle(job) for job in jobs]
    sharded, planted = run_torch_fsdp(jobs), run_torch_fsdp(jobs, "bf16-averaged")
    jax_runs = run_jax(jobs) if with_jax else [{} for _ in jobs]
    rows = []
    for job, want, fsdp, wrong, jax_records in zip(jobs, expected, sharded, planted, jax_runs):
        records = {"torch fsdp bf16/f32": fsdp, PLANTED: wrong, "torch bf16/f32": run_torch_unsharded(job, mixed=True),
                   "torch bf16": run_torch_unsharded(job, mixed=False), **jax_records}
        rows += [(job.source, run, errors(records[run], job, want)) for run in RUNS if run in records]
        for run, other in (("torch fsdp bf16/f32", "torch bf16/f32"), ("jax fsdp bf16/f32", "jax bf16/f32")):
            if run in records:
                rows.append((job.source, f"{run} - {other}", differences(records[run], records[other])))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-jax", action="store_true", help="torch runs only")
    parser.add_argument("--jax-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jax_child:
        _jax_child(*args.jax_child)
        return
    from conformance.check.tolerances import gradient_tolerance, tolerance

    start = time.perf_counter()
    rows = measure(with_jax=not args.no_jax)
    gradient_row = gradient_tolerance("bfloat16", "cpu").atol
    print("| model | run | logits | loss | worst gradient | one Adam step | gradient row |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size, run, e in rows:
        at = f" ({e['grads at']})" if "grads at" in e else ""
        # A difference between two runs ("A - B") is no error against the oracle: no row holds it.
        verdict = "" if " - " in run else "within" if max(e["grads"], e["loss"]) <= gradient_row else "BEYOND"
        print(f"| {size} | {run} | {e['logits']:.2e} | {e['loss']:.2e} | {e['grads']:.2e}{at} | {e['step']:.2e} "
              f"| {verdict} |")
    print(f"\nbfloat16 rows of the table: forward {tolerance('bfloat16', 'cpu').atol}, gradient {gradient_row}; "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
