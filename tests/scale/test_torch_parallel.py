"""`impl_torch.parallelize`: every plan on meshes 4x1, 2x2 and 1x4 of gloo CPU processes equals the
unsharded model within the tolerance table, and each parameter really is sharded as its plan says.
(The planted tensor-parallel bug, the local shard split into the global number of heads, is
tests/scale/test_sharded_property.py's, against the oracle.)

The sharded runs happen in one subprocess (this file run as a script) that forks 4 gloo ranks
(`conformance.check.scale.ranks.start_ranks`), once for every mesh and plan; rank 0 writes a JSON
record, which the tests below read. The expected shard shapes are written here from the plans'
definitions (docs/sharding.md), not read from `impl_torch.parallel`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from rooms import pythonpath
from sharding_common import (BATCH, CONFIG, PLANS, SRC_LEN, TGT_LEN, adam_excess, max_error, mesh_env, meshes,
                             step_errors, table_bound, tolerance_of)

from conformance.check.scale.ranks import gathered, start_ranks, whole

# One worker under `--dist loadgroup`: the module's fixture (exports, subprocesses) is paid once, not per worker.
pytestmark = pytest.mark.xdist_group("torch-parallel")

ROOT = Path(__file__).resolve().parents[2]
# Under the `ci` profile one mesh that splits both axes (CI time); `HYPOTHESIS_PROFILE=thorough` runs all three.
MESHES = meshes(every=((4, 1), (2, 2), (1, 4)), ci=((2, 2),))
WORLD = 4


# -- The subprocess: 4 gloo ranks, every mesh and plan ---------------------------------------------


def _batch(config, seed: int = 0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, config.src_vocab_size, (BATCH, SRC_LEN))
    tgt = rng.integers(1, config.tgt_vocab_size, (BATCH, TGT_LEN))
    labels = rng.integers(1, config.tgt_vocab_size, (BATCH, TGT_LEN))
    src[1, -2:] = config.pad_id  # some padding, so the masks are not all True
    labels[2, -1] = config.pad_id  # and the data ranks count different numbers of tokens
    labels[5, -3:] = config.pad_id
    return src, tgt, labels


def _reference(impl_torch, config, params, src, tgt, labels) -> dict:
    """The unsharded model's forward logits and intermediates, loss, gradients and one Adam step."""
    import torch

    model = impl_torch.Model(config, params, torch.float64)
    with torch.no_grad():
        out = model(src, tgt)
    record = {"logits": out.logits.numpy().copy()}
    record.update({f"intermediate:{name}": t.numpy().copy() for name, t in out.intermediates.items()})
    loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=0.1)
    record["loss"] = loss.numpy().copy()
    record.update({f"grad:{name}": g.numpy().copy() for name, g in grads.items()})
    optimizer = impl_torch.Adam(model, d_model=config.d_model, warmup=10)
    record["lr"], record["eps"] = optimizer.lr, optimizer.eps
    optimizer.step(grads)
    record.update({f"stepped:{name}": p.detach().numpy().copy() for name, p in model.named_parameters()})
    return record


_whole = whole  # a DTensor gathered by its own collectives, a plain tensor as it is; as NumPy


def _sharded(impl_torch, config, params, mesh, plan, src, tgt, labels) -> tuple[dict, dict]:
    """The same record from a `parallelize`d model, gathered; and each parameter's local shard."""
    import torch

    from impl_torch import parallel

    model = impl_torch.parallelize(impl_torch.Model(config, params, torch.float64), mesh, plan)
    rows = lambda a: parallel.local_rows(mesh, "ids", torch.as_tensor(a))  # noqa: E731
    gather = lambda t: whole(gathered(t, mesh, "data", 0))  # noqa: E731
    with torch.no_grad():
        out = model(rows(src), rows(tgt))
    record = {"logits": gather(out.logits)}
    record.update({f"intermediate:{name}": gather(t) for name, t in out.intermediates.items()})
    loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=0.1)  # parallelize's own
    record["loss"] = loss.numpy().copy()
    record.update({f"grad:{name}": _whole(g) for name, g in grads.items()})
    shards = {name: _shard(p) for name, p in model.named_parameters()}
    optimizer = impl_torch.Adam(model, d_model=config.d_model, warmup=10)
    optimizer.step(grads)
    record.update({f"stepped:{name}": _whole(p) for name, p in model.named_parameters()})
    shards.update({f"{name} after a step": _shard(p) for name, p in model.named_parameters()})
    return record, shards


def _shard(p) -> dict:
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return {"local": list(p.shape), "placements": None, "dims": None}
    return {"local": list(p.to_local().shape), "placements": [str(x) for x in p.placements],
            "dims": list(p.device_mesh.mesh_dim_names)}


def _typed_errors(impl_torch, config, params, src, tgt, labels) -> dict:
    """What each bad input raises: {case: [type name, .argument, message]}."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from conformance.core.config import ModelConfig
    from impl_torch import parallel

    fresh = lambda **changes: impl_torch.Model(ModelConfig(**{**CONFIG, **changes}), None if changes else params,  # noqa: E731
                                               torch.float64)
    mesh = lambda d, m, names=("data", "model"): init_device_mesh("cpu", (d, m), mesh_dim_names=names)  # noqa: E731
    cases = {
        "unknown plan": lambda: impl_torch.parallelize(fresh(), mesh(2, 2), "zero3"),
        "mesh without the dims": lambda: impl_torch.parallelize(fresh(), mesh(2, 2, ("batch", "model")), "dp"),
        "not a mesh": lambda: impl_torch.parallelize(fresh(), "data=2,model=2", "dp"),
        "heads do not divide": lambda: impl_torch.parallelize(fresh(n_heads=2), mesh(1, 4), "tp"),
        "d_ff does not divide": lambda: impl_torch.parallelize(fresh(d_ff=30), mesh(1, 4), "fsdp+tp"),
        "not a precision policy": lambda: impl_torch.parallelize(fresh(), mesh(2, 2), "fsdp", mp_policy=torch.bfloat16),
        "batch does not divide over data": lambda: parallel.loss_and_grads(
            impl_torch.parallelize(fresh(), mesh(4, 1), "dp"), src[:3], tgt[:3], labels[:3]),
        # Decoding's cache is sized by the global head count: refused, never a cache of the wrong size.
        "generate on a parallelized model": lambda: impl_torch.parallelize(fresh(), mesh(2, 2), "tp").generate(
            src[:2], max_len=3, bos_id=1, eos_id=2),
    }
    found = {}
    for case, call in cases.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - recorded, judged by the tests
            found[case] = [type(exc).__name__, getattr(exc, "argument", None), str(exc)]
        else:
            found[case] = ["nothing raised", None, ""]
    return found


def _extras(impl_torch, config, params, src, tgt, labels) -> dict:
    """Beyond the plain step, on the 2x2 mesh: `train_step`, dropout masks and an FSDP2
    `MixedPrecisionPolicy`, each against the unsharded float64 model: {case: {tensor: error}}."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from conformance.core.dropout import draw_dropout

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
    fresh = lambda: impl_torch.Model(config, params, torch.float64)  # noqa: E731
    found = {}

    # train_step (the core's: model.loss_and_grads, then optimizer.step) on a parallelized model.
    plain, sharded = fresh(), impl_torch.parallelize(fresh(), mesh, "fsdp+tp")
    steps = [(model, impl_torch.Adam(model, d_model=config.d_model, warmup=10)) for model in (plain, sharded)]
    lr, eps = steps[0][1].lr, steps[0][1].eps  # the first step's
    losses = [impl_torch.train_step(model, optimizer, src, tgt, labels, label_smoothing=0.1) for model, optimizer in steps]
    found["train_step"] = {"loss": max_error(float(losses[1]), float(losses[0]))}
    _, reference_grads = fresh().loss_and_grads(src, tgt, labels, label_smoothing=0.1)
    named = dict(sharded.named_parameters())
    for name, p in plain.named_parameters():
        # The step's gradients stay inside: d is the most the gradient table allows (as JAX's fused step).
        g = reference_grads[name].numpy()
        found["train_step"][f"stepped:{name}"] = adam_excess(_whole(named[name]), p.detach().numpy(), g, g, lr, eps,
                                                             d=table_bound(g))
        found["train_step"][f"raw stepped:{name}"] = max_error(_whole(named[name]), p.detach().numpy())

    # Dropout: every rank takes its rows of the whole batch's masks.
    dropout = draw_dropout(config, BATCH, SRC_LEN, TGT_LEN, rate=0.1, seed=3)
    loss, grads = fresh().loss_and_grads(src, tgt, labels, label_smoothing=0.1, dropout=dropout)
    sharded_loss, sharded_grads = impl_torch.parallelize(fresh(), mesh, "fsdp+tp").loss_and_grads(
        src, tgt, labels, label_smoothing=0.1, dropout=dropout)
    found["dropout"] = {"loss": max_error(sharded_loss.numpy(), loss.numpy())}
    found["dropout"].update({f"grad:{name}": max_error(_whole(sharded_grads[name]), g.numpy()) for name, g in grads.items()})

    # FSDP2 mixed precision: float64 parameters, computed and reduced in float32.
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    model = impl_torch.parallelize(fresh(), mesh, "fsdp", mp_policy=policy)
    rows = lambda a: impl_torch.parallel.local_rows(mesh, "ids", torch.as_tensor(a))  # noqa: E731
    with torch.no_grad():
        logits = model(rows(src), rows(tgt)).logits
    with torch.no_grad():
        reference = fresh()(rows(src), rows(tgt)).logits
    loss, grads = fresh().loss_and_grads(src, tgt, labels, label_smoothing=0.1)
    mixed_loss, mixed_grads = model.loss_and_grads(src, tgt, labels, label_smoothing=0.1)
    found["mixed float32"] = {"logits dtype": str(logits.dtype), "logits": max_error(logits.numpy(), reference.numpy()),
                              "loss": max_error(mixed_loss.numpy(), loss.numpy())}
    found["mixed float32"].update({f"grad:{name}": max_error(_whole(mixed_grads[name]), g.numpy())
                                   for name, g in grads.items()})
    found["mixed float32"]["grad dtypes"] = sorted({str(g.dtype) for g in mixed_grads.values()})
    return found


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT))
    import impl_torch
    from conformance.core.config import ModelConfig
    from conformance.core.params import init_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    start = time.perf_counter()
    config = ModelConfig(**CONFIG)
    params = init_params(config, seed=0)
    src, tgt, labels = _batch(config)
    reference = _reference(impl_torch, config, params, src, tgt, labels)
    record: dict = {"errors": {}, "shards": {}}
    for data, width in MESHES:
        mesh = init_device_mesh("cpu", (data, width), mesh_dim_names=("data", "model"))
        for plan in PLANS:
            key = f"{data}x{width} {plan}"
            sharded, record["shards"][key] = _sharded(impl_torch, config, params, mesh, plan, src, tgt, labels)
            record["errors"][key] = step_errors(reference, sharded, skip="intermediate:")
            if rank == 0:
                print(f"{key}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    record["typed_errors"] = _typed_errors(impl_torch, config, params, src, tgt, labels)
    record["extras"] = _extras(impl_torch, config, params, src, tgt, labels)
    if rank == 0:
        Path(out_path).write_text(json.dumps(record))
    dist.destroy_process_group()


def main(out_path: str) -> None:
    sys.path.insert(0, str(ROOT))  # in this process, before the fork: the ranks inherit it
    start_ranks(_worker, WORLD, (out_path,), fork=True)


# -- The tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def record() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "record.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **mesh_env(MESHES), "PYTHONPATH": pythonpath()}
        run = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0 and out.exists(), f"the sharded runs failed (exit {run.returncode}):\n{run.stderr[-6000:]}"
        return json.loads(out.read_text())


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_sharded_equals_unsharded(record, mesh, plan):
    from conformance.core.config import ModelConfig
    from conformance.core.params import param_shapes

    errors = record["errors"][f"{mesh} {plan}"]
    assert {"logits", "loss"} <= set(errors)
    count = len(param_shapes(ModelConfig(**CONFIG)))
    assert sum(name.startswith("grad:") for name in errors) == sum(name.startswith("stepped:") for name in errors) == count
    # What the comparison of the step takes off (see sharding_common.adam_excess) stays small: rounding of zero gradients.
    assert max(e for name, e in errors.items() if name.startswith("raw ")) < 1e-9
    worst = {name: e for name, e in errors.items() if not name.startswith("raw ") and e > tolerance_of(name)}
    assert not worst, f"torch float64 cpu gloo, mesh {mesh} (data x model), plan {plan}: beyond the table: {worst}"


# The plans, as docs/sharding.md states them, for the expected shard shapes. Weights are (d_in, d_out).
COLUMNS = ("q_proj", "k_proj", "v_proj", "linear1", "gate")
ROWS = ("o_proj", "linear2")


def _expected_local(name: str, shape: tuple[int, ...], plan: str, data: int, width: int) -> list[int]:
    local = list(shape)
    *_, module, part = ["", *name.split(".")]
    if "tp" in plan:
        if module in COLUMNS:
            local[1 if part == "weight" else 0] //= width
        elif module in ROWS and part == "weight":
            local[0] //= width
    if "fsdp" in plan:
        local[0] //= data  # FSDP2 shards dim 0 (of the local tensor-parallel shard, under fsdp+tp)
    return local


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mesh", MESHES)
def test_each_parameter_is_sharded_as_the_plan_says(record, mesh, plan):
    from conformance.core.config import ModelConfig
    from conformance.core.params import param_shapes

    data, width = mesh
    shards = record["shards"][f"{data}x{width} {plan}"]
    for name, shape in param_shapes(ModelConfig(**CONFIG)).items():
        expected = _expected_local(name, tuple(shape), plan, data, width)
        for key in (name, f"{name} after a step"):
            assert shards[key]["local"] == expected, f"{plan} on {data}x{width}: {key} {shards[key]} vs {expected}"
            # Every parameter is a DTensor on the mesh ("data" always: the reduction of its gradient).
            assert "data" in shards[key]["dims"], (key, shards[key])
        tp_split = "tp" in plan and name.split(".")[-2] in COLUMNS + ROWS and not (
            name.split(".")[-2] in ROWS and name.endswith("bias"))
        dims, placements = shards[name]["dims"], shards[name]["placements"]
        over_model = "model" in dims and any(word in placements[dims.index("model")] for word in ("S(", "Shard"))
        assert over_model == tp_split, (name, shards[name])
        if plan in ("fsdp", "fsdp+tp") and data > 1:
            assert shards[name]["local"] != list(shape), f"{name} is whole under {plan}"


def test_train_step_steps_a_parallelized_model(record):
    """`impl_torch.train_step` (model.loss_and_grads, then Adam) on fsdp+tp, 2x2: `parallelize`
    replaced the model's own loss_and_grads, whose autograd.grad never reaches sharded parameters."""
    errors = record["extras"]["train_step"]
    assert max(e for name, e in errors.items() if name.startswith("raw ")) < 1e-9
    worst = {name: e for name, e in errors.items() if not name.startswith("raw ") and e > tolerance_of(name)}
    assert not worst and len(errors) > 2, worst


def test_dropout_masks_are_split_by_rows(record):
    errors = record["extras"]["dropout"]
    worst = {name: e for name, e in errors.items() if e > tolerance_of(name)}
    assert not worst and len(errors) > 2, worst


def test_an_fsdp2_mixed_precision_policy_is_applied(record):
    """MixedPrecisionPolicy(param_dtype=float32, reduce_dtype=float32) on a float64 model: the
    forward computes in float32 and the gradients come back in the parameters' float64, within
    the float32 rows of the table."""
    from conformance.check.tolerances import gradient_tolerance, tolerance

    found = record["extras"]["mixed float32"]
    assert found["logits dtype"] == "torch.float32" and found["grad dtypes"] == ["torch.float64"]
    assert found["logits"] <= tolerance("float32").atol and found["loss"] <= tolerance("float32").atol
    grads = {name: e for name, e in found.items() if name.startswith("grad:")}
    assert grads and max(grads.values()) <= gradient_tolerance("float32").atol, grads
    assert max(grads.values()) > 1e-12  # computed in float32 indeed, not float64


@pytest.mark.parametrize("case, kind, argument, words", [
    ("unknown plan", "InputError", "plan", ("zero3", "dp, fsdp, tp, fsdp+tp")),
    ("mesh without the dims", "InputError", "mesh", ("('batch', 'model')", "('data', 'model')")),
    ("not a mesh", "InputError", "mesh", ("DeviceMesh", "str")),
    ("heads do not divide", "InputError", "mesh", ("n_heads = 2", "size 4")),
    ("d_ff does not divide", "InputError", "mesh", ("d_ff = 30", "size 4")),
    ("not a precision policy", "InputError", "mp_policy", ("MixedPrecisionPolicy", "dtype")),
    ("batch does not divide over data", "InputError", "src_ids", ("3 rows", "size 4")),
    ("generate on a parallelized model", "InputError", "plan", ("generate", "'tp'", "docs/sharding.md")),
])
def test_bad_input_gets_a_typed_error(record, case, kind, argument, words):
    found_kind, found_argument, message = record["typed_errors"][case]
    assert (found_kind, found_argument) == (kind, argument), (case, message)
    for word in words:
        assert word in message, (case, message)


if __name__ == "__main__":
    main(sys.argv[1])
