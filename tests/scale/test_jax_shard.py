"""`impl_jax.shard`: every plan on meshes 8x1, 4x2 and 2x4 of forced host CPU devices equals the
unsharded model within the tolerance table, and each parameter really is split as its plan says.

JAX fixes its device count when it is imported, and this process's JAX has one CPU device, so the
sharded runs happen in one subprocess started with `XLA_FLAGS=--xla_force_host_platform_device_count=8`
(this file run as a script): it pays the import and the compiles once for every mesh and plan and
prints a JSON record, which the tests below read. The expected shard shapes are written here from
the plans' definitions (docs/sharding.md), not read from `impl_jax.shard`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rooms import pythonpath
from sharding_common import BATCH, CONFIG, PLANS, SRC_LEN, TGT_LEN, mesh_env, meshes, step_errors, tolerance_of

# One worker under `--dist loadgroup`: the module's fixture (exports, subprocesses) is paid once, not per worker.
pytestmark = pytest.mark.xdist_group("jax-shard")

# Under the `ci` profile one mesh that splits both axes (CI time); `HYPOTHESIS_PROFILE=thorough` runs all three.
MESHES = meshes(every=((8, 1), (4, 2), (2, 4)), ci=((2, 4),))
FUSED_MESH = (2, 4)  # the fused train_step and generate run every plan on this mesh only (bigger compiles)
DEVICES = 8


# -- The subprocess: every mesh and plan, one JAX import ------------------------------------------


def _batch(config, seed: int = 0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, config.src_vocab_size, (BATCH, SRC_LEN))
    tgt = rng.integers(1, config.tgt_vocab_size, (BATCH, TGT_LEN))
    labels = rng.integers(1, config.tgt_vocab_size, (BATCH, TGT_LEN))
    src[1, -2:] = config.pad_id  # some padding, so the masks are not all True
    labels[2, -1] = config.pad_id
    return src, tgt, labels


def _run(model, src, tgt, labels, impl_jax, *, fused: bool) -> dict:
    """Forward logits, loss, gradients and the parameters after one Adam step, on the host: the
    fused `train_step` (`fused`), else `loss_and_grads`' gradients through `Adam.step` (a small
    program: the fused step compiles the whole backward pass again, so it runs on one mesh only)."""
    out = {"logits": np.asarray(model(src, tgt, return_attention=False).logits)}
    loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=0.1)
    out["loss"] = np.asarray(loss)
    out.update({f"grad:{name}": np.asarray(g) for name, g in grads.items()})
    optimizer = impl_jax.Adam(model, d_model=model.config.d_model, warmup=10)
    out["lr"], out["eps"] = optimizer.lr, optimizer.eps
    if fused:
        out["step loss"] = np.asarray(impl_jax.train_step(model, optimizer, src, tgt, labels, label_smoothing=0.1))
    else:
        optimizer.step(grads)
    out.update({f"stepped:{name}": np.asarray(w) for name, w in model.params.items()})
    return out


def _shards(model) -> dict:
    """Each parameter's local shape, read from the arrays' own addressable shards."""
    shapes = {}
    for name, w in model.params.items():
        local = {tuple(shard.data.shape) for shard in w.addressable_shards}
        assert len(local) == 1, f"{name}: uneven shards {local}"
        assert local == {tuple(w.sharding.shard_shape(w.shape))}, name
        shapes[name] = list(local.pop())
    return shapes


def _typed_errors(impl_jax, model, config, jax) -> dict:
    """What each bad input raises: {case: [type name, .argument, message]}."""
    from jax.sharding import Mesh

    from conformance.core.config import ModelConfig

    devices = np.array(jax.devices())
    src, tgt, _ = _batch(config)
    cases = {
        "unknown plan": lambda: impl_jax.shard(model, jax.make_mesh((4, 2), ("data", "model")), "zero3"),
        "mesh without the axes": lambda: impl_jax.shard(model, Mesh(devices.reshape(4, 2), ("batch", "model")), "dp"),
        "not a mesh": lambda: impl_jax.shard(model, "data=4,model=2", "dp"),
        "heads do not divide": lambda: impl_jax.shard(model, Mesh(devices.reshape(1, 8), ("data", "model")), "tp"),
        "vocabulary does not divide": lambda: impl_jax.shard(
            impl_jax.Model(ModelConfig(**{**CONFIG, "tgt_vocab_size": 31}), dtype="float64"),
            Mesh(devices.reshape(4, 2), ("data", "model")), "tp"),
        "no axis divides over data": lambda: impl_jax.shard(
            impl_jax.Model(ModelConfig(**{**CONFIG, "d_model": 12, "n_heads": 3, "d_ff": 36, "src_vocab_size": 30,
                                          "tgt_vocab_size": 30}), dtype="float64"),
            Mesh(devices.reshape(8, 1), ("data", "model")), "fsdp"),
        "batch does not divide over data": lambda: impl_jax.shard(
            model, Mesh(devices.reshape(4, 2), ("data", "model")), "dp")(src[:3], tgt[:3]),
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


def main() -> None:
    import jax

    import impl_jax
    from conformance.core.config import ModelConfig
    from conformance.core.params import init_params
    from impl_jax import compiled

    shard_module = importlib.import_module("impl_jax.shard")  # (impl_jax.shard is the function)

    start = time.perf_counter()
    assert len(jax.devices()) == DEVICES, jax.devices()
    record: dict = {"errors": {}, "shards": {}, "generate": {}, "batch rows": {}}
    with impl_jax.enable_x64():
        config = ModelConfig(**CONFIG)
        params = init_params(config, seed=0)
        src, tgt, labels = _batch(config)
        reference = {fused: _run(impl_jax.Model(config, params, "float64"), src, tgt, labels, impl_jax, fused=fused)
                     for fused in (False, True)}
        plain = impl_jax.Model(config, params, "float64")
        generated = np.asarray(plain.generate(src, max_len=6, bos_id=1, eos_id=2))
        for data, width in MESHES:
            mesh = jax.make_mesh((data, width), ("data", "model"))
            for plan in PLANS:
                key = f"{data}x{width} {plan}"
                sharded = impl_jax.shard(impl_jax.Model(config, params, "float64"), mesh, plan)
                record["shards"][key] = _shards(sharded)
                fused = (data, width) == FUSED_MESH
                record["errors"][key] = step_errors(reference[fused], _run(sharded, src, tgt, labels, impl_jax, fused=fused),
                                                       fused=fused)
                # Each call's arguments go through compiled.placed: the ids, as a call places them.
                ids = compiled.placed((src,), sharded.device)[0]
                record["batch rows"][key] = list(ids.sharding.shard_shape(ids.shape))
                record["shards"][key + " after a step"] = _shards(sharded)
                print(f"{key}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
                if (data, width) == FUSED_MESH:
                    ids = np.asarray(impl_jax.shard(plain, mesh, plan).generate(src, max_len=6, bos_id=1, eos_id=2))
                    record["generate"][key] = bool(ids.shape == generated.shape and (ids == generated).all())
        record["typed_errors"] = _typed_errors(impl_jax, plain, config, jax)
        # A planted break: "tp" forgets linear1's columns. The math is unchanged (GSPMD computes
        # the same products however the operands lie); only the shard shapes can show it.
        del shard_module.TP_SPLITS[("linear1", "weight")], shard_module.TP_SPLITS[("linear1", "bias")]
        record["broken tp"] = _shards(impl_jax.shard(plain, jax.make_mesh((4, 2), ("data", "model")), "tp"))
    print("RECORD " + json.dumps(record))


# -- The tests ------------------------------------------------------------------------------------


def _flags() -> str:
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    return f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


@pytest.fixture(scope="module")
def record() -> dict:
    env = {**os.environ, "XLA_FLAGS": _flags(), "JAX_PLATFORMS": "cpu", **mesh_env(MESHES), "PYTHONPATH": pythonpath()}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RECORD ")]
    assert run.returncode == 0 and lines, f"the sharded runs failed (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return json.loads(lines[-1][len("RECORD "):])


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mesh", [f"{d}x{m}" for d, m in MESHES])
def test_sharded_equals_unsharded(record, mesh, plan):
    from conformance.core.config import ModelConfig
    from conformance.core.params import param_shapes

    errors = record["errors"][f"{mesh} {plan}"]
    assert {"logits", "loss"} <= set(errors) and (("step loss" in errors) == (mesh == "{}x{}".format(*FUSED_MESH)))
    count = len(param_shapes(ModelConfig(**CONFIG)))
    assert sum(name.startswith("grad:") for name in errors) == sum(name.startswith("stepped:") for name in errors) == count
    # What the comparison of the step takes off (see sharding_common.adam_excess) stays small: rounding of zero gradients.
    assert max(e for name, e in errors.items() if name.startswith("raw ")) < 1e-9
    worst = {name: e for name, e in errors.items() if not name.startswith("raw ") and e > tolerance_of(name)}
    assert not worst, f"jax float64 cpu, mesh {mesh} (data x model), plan {plan}: beyond the table: {worst}"


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mesh", MESHES)
def test_the_batch_is_split_over_data(record, mesh, plan):
    """A call's ids go to the compiled program split by rows over "data", whole along the length
    (where the outputs lie is GSPMD's choice, not the plan's)."""
    data, width = mesh
    assert record["batch rows"][f"{data}x{width} {plan}"] == [BATCH // data, SRC_LEN]


@pytest.mark.parametrize("plan", PLANS)
def test_generate_on_a_mesh_equals_unsharded(record, plan):
    assert record["generate"][f"{FUSED_MESH[0]}x{FUSED_MESH[1]} {plan}"] is True


# The plans, as docs/sharding.md states them, for the expected shard shapes.
COLUMNS = ("q_proj", "k_proj", "v_proj", "linear1", "gate")


def _tp_axis(name: str) -> int | None:
    *_, module, part = ["", *name.split(".")]
    if module in COLUMNS:
        return 1 if part == "weight" else 0
    if module in ("o_proj", "linear2") and part == "weight":
        return 0
    if (module, part) == ("embedding", "weight") or (module, part) == ("output", "bias") or part == "final_logits_bias":
        return 0  # final_logits_bias is (V,)
    if (module, part) == ("output", "weight"):
        return 1
    return None


def _expected(shape: list[int], name: str, plan: str, data: int, width: int) -> list[int]:
    local = list(shape)
    axis = _tp_axis(name) if "tp" in plan else None
    if axis is not None:
        local[axis] //= width
    if "fsdp" in plan:  # the largest axis (after the model split) that divides, the first of equals
        fits = [i for i, n in enumerate(local) if n % data == 0]
        best = max(fits, key=lambda i: (local[i], -i))
        local[best] //= data
    return local


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mesh", MESHES)
def test_each_parameter_is_split_as_its_plan_says(record, mesh, plan):
    from conformance.core.config import ModelConfig
    from conformance.core.params import param_shapes

    data, width = mesh
    shapes = param_shapes(ModelConfig(**CONFIG))
    for when in ("", " after a step"):
        shards = record["shards"][f"{data}x{width} {plan}{when}"]
        assert list(shards) == list(shapes), "the canonical names, in checkpoint order"
        wrong = {name: (shards[name], _expected(list(shape), name, plan, data, width))
                 for name, shape in shapes.items() if shards[name] != _expected(list(shape), name, plan, data, width)}
        assert not wrong, f"mesh {data}x{width}, plan {plan}{when}: (local shape, the plan's): {wrong}"
    # Not replicated: under fsdp every parameter holds 1/data of itself on each device, under tp
    # each Megatron-split one 1/model (the expected shapes above say which, and how).
    whole = {name for name, shape in shapes.items() if np.prod(shards[name]) == np.prod(shape)}
    if "fsdp" in plan and data > 1:
        assert not whole, f"mesh {data}x{width}, plan {plan}: replicated: {sorted(whole)}"
    if "tp" in plan and width > 1:
        assert not {name for name in shapes if _tp_axis(name) is not None} & whole


def test_the_shape_check_catches_a_plan_that_silently_replicates(record):
    """The planted break (tp without linear1's columns) computes the same numbers; the expected
    shard shapes name the parameters it left whole."""
    from conformance.core.config import ModelConfig
    from conformance.core.params import param_shapes

    shards = record["broken tp"]
    wrong = sorted(name for name, shape in param_shapes(ModelConfig(**CONFIG)).items()
                   if shards[name] != _expected(list(shape), name, "tp", 4, 2))
    assert wrong and all(".ffn.linear1." in name for name in wrong), wrong
    assert len(wrong) == 2 * (CONFIG["n_encoder_layers"] + CONFIG["n_decoder_layers"])  # weight and bias per layer


def test_tp_splits_the_final_logits_bias_by_vocabulary():
    """final_logits_bias is stored (V,): "tp" splits its only axis (the sharded suite property drew a
    config with it and found the plan reading axis 1, an IndexError, before this was fixed)."""
    from jax.sharding import PartitionSpec as P

    from conformance.core.config import ModelConfig
    from conformance.core.params import param_shapes
    from impl_jax.shard import plan_specs

    config = ModelConfig(**{**CONFIG, "final_logits_bias": True})
    shapes = {name: tuple(shape) for name, shape in param_shapes(config).items()}
    assert shapes["final_logits_bias"] == (CONFIG["tgt_vocab_size"],)
    specs = {plan: plan_specs(config, shapes, {"data": 2, "model": 2}, plan)["final_logits_bias"] for plan in ("tp", "fsdp+tp")}
    assert specs == {"tp": P("model"), "fsdp+tp": P(("model", "data"))}, specs


@pytest.mark.parametrize("case, argument, words", [
    ("unknown plan", "plan", ["'zero3'", "dp", "fsdp+tp"]),
    ("mesh without the axes", "mesh", ["('data', 'model')", "('batch', 'model')"]),
    ("not a mesh", "mesh", ["jax.sharding.Mesh", "str"]),
    ("heads do not divide", "mesh", ["'model' axis of 8 devices", "n_heads=4"]),
    ("vocabulary does not divide", "mesh", ["'model' axis of 2 devices", "decoder.embedding.weight (31, 16)",
                                            "axis 0 (31)"]),
    ("no axis divides over data", "mesh", ["'data' axis of 8 devices", "(30, 12)", "fsdp"]),
    ("batch does not divide over data", "src_ids", ["3 rows", "'data' axis of 4 devices"]),
])
def test_bad_input_is_a_typed_error(record, case, argument, words):
    kind, found, message = record["typed_errors"][case]
    assert (kind, found) == ("InputError", argument), (case, kind, found, message)
    missing = [word for word in words if word not in message]
    assert not missing, f"{case}: {missing} not in {message!r}"


if __name__ == "__main__":
    main()
