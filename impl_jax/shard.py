"""Sharded runs on JAX's own SPMD partitioner: the model's parameters placed on a device mesh.

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = impl_jax.shard(model, mesh, "fsdp+tp")      # a Model; the same canonical parameter names
    out = sharded(src_ids, tgt_ids)                       # jit-compiled, the batch split over "data"
    loss, grads = sharded.loss_and_grads(src_ids, tgt_ids, labels)
    impl_jax.train_step(sharded, impl_jax.Adam(sharded, d_model), src_ids, tgt_ids, labels)
    sharded.generate(src_ids, max_len, bos_id, eos_id)

Nothing here partitions a computation or writes a collective. Each parameter is put on the mesh
with a `NamedSharding` chosen by the plan, each call's batch with `NamedSharding(mesh, P("data"))`,
and `jax.jit` (GSPMD) partitions the very programs the unsharded model runs, inserting the
all-gathers and reductions the placement implies. A placement therefore changes where values live
and in which order sums are reduced, never what is computed: the sharded results equal the
unsharded ones within the tolerance table (tests/scale/test_jax_shard.py measures it, docs/sharding.md).

The plans (`PLANS`), over a mesh whose axes are ("data", "model"):
    "dp"       every parameter replicated; the batch split over "data".
    "tp"       Megatron's tensor parallelism (Shoeybi et al. 2019, section 3) over "model": q, k, v,
               linear1 and the gate split by columns (their biases with them), o and linear2 by
               rows (their biases replicated: added after the sum), the vocabulary split for the
               embeddings, the output weight and its biases (final_logits_bias included); LayerNorms and position tables
               replicated. Heads stay whole on a device, so n_heads must divide by the axis size.
    "fsdp"     every parameter split over "data" along its largest axis that divides by the
               axis size (ties: the first such axis).
    "fsdp+tp"  "tp", then every parameter also split over "data" along its largest axis (after
               the "model" split) that still divides.
The batch is split over "data" in every plan (a size-1 axis splits nothing).

What cannot be placed as the plan says is an `InputError` before anything moves: an unknown plan,
a mesh without the two axes, an axis size that does not divide the tensor the plan splits (naming
the parameter, its shape, the axis and the sizes), and a call whose batch does not divide over
"data". Nothing is silently replicated instead of split: `shard_shapes(model)` reports each
parameter's local shape, and tests/scale/test_jax_shard.py checks them against the plan.

The mesh's axes are used as "auto" (GSPMD chooses the intermediate layouts); a mesh built with
explicit axes (`jax.make_mesh`'s default in recent JAX) is re-made over the same devices with auto
axes, because explicit-sharding mode rejects products whose operands' shardings conflict.

Limits: `shard` builds the sharded model from the unsharded one's parameters, so the whole model
is held once on the host and on the mesh's first device while it is placed; results come back as
global (sharded) arrays, which `np.asarray` gathers. Executables are compiled per placement,
in the same bounded cache as the unsharded model's (impl_jax/compiled.py).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from conformance.core.errors import InputError
from conformance.core.sharding import AXES, PLANS
from impl_jax.model import Model


# Megatron's splits, by the last parts of a canonical name: the axis of the stored parameter that
# is split over "model". Weights are stored (d_in, d_out), so columns are axis 1 and rows axis 0;
# a column-split layer's bias goes with its columns, a row-split layer's bias is added after the
# partial products are summed and stays whole. Tables are (V, D); output.weight is (D, V).
TP_SPLITS: dict[tuple[str, ...], int] = {
    **{(proj, "weight"): 1 for proj in ("q_proj", "k_proj", "v_proj", "linear1", "gate")},
    **{(proj, "bias"): 0 for proj in ("q_proj", "k_proj", "v_proj", "linear1", "gate")},
    ("o_proj", "weight"): 0,
    ("linear2", "weight"): 0,
    ("embedding", "weight"): 0,  # the vocabulary rows
    ("output", "weight"): 1,  # the vocabulary columns
    ("output", "bias"): 0,
    ("final_logits_bias",): 0,  # (V,), as conformance.core.params stores it
}


def tp_axis(name: str) -> int | None:
    """The axis of parameter `name` that "tp" splits over "model" (None: it stays whole)."""
    parts = tuple(name.split("."))
    for key in (parts[-2:], parts[-1:]):
        if key in TP_SPLITS:
            return TP_SPLITS[key]
    return None


def check_mesh(mesh) -> Mesh:
    """`mesh` as a `jax.sharding.Mesh` with axes ("data", "model") and auto axis types; anything
    else is an `InputError` on "mesh"."""
    if not isinstance(mesh, Mesh):
        raise InputError("mesh", f"must be a jax.sharding.Mesh with axes {AXES}, got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise InputError("mesh", f"must have the axes {AXES} (in that order; size 1 for an axis not used), "
                                 f"got {tuple(mesh.axis_names)}")
    if all(kind == AxisType.Auto for kind in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def check_plan(plan) -> str:
    if plan not in PLANS:
        raise InputError("plan", f"must be one of {PLANS}, got {plan!r}")
    return plan


def plan_specs(config, shapes: dict[str, tuple[int, ...]], sizes: dict[str, int], plan: str) -> dict[str, P]:
    """Each parameter's `PartitionSpec` under `plan` on a mesh of `sizes` ({"data": n, "model": m}),
    by canonical name; an `InputError` where the plan cannot be followed."""
    plan = check_plan(plan)
    model_size, data_size = sizes["model"], sizes["data"]
    if "tp" in plan and config.n_heads % model_size:
        raise InputError("mesh", f"the 'model' axis of {model_size} devices cannot split n_heads={config.n_heads} "
                                 "heads evenly: tensor parallelism keeps whole heads on each device")
    specs = {}
    for name, shape in shapes.items():
        axes: list = [None] * len(shape)
        axis = tp_axis(name) if "tp" in plan else None
        if axis is not None:
            if shape[axis] % model_size:
                raise InputError("mesh", f"the 'model' axis of {model_size} devices cannot split {name} {tuple(shape)} "
                                         f"along its axis {axis} ({shape[axis]}): not a multiple of {model_size}")
            axes[axis] = "model"
        if "fsdp" in plan:
            axes = _fsdp_axes(name, shape, axes, model_size, data_size)
        specs[name] = P(*axes)
    return specs


def _fsdp_axes(name: str, shape, axes: list, model_size: int, data_size: int) -> list:
    """`axes` with "data" added on the axis whose local size (after any "model" split) is largest
    among those that still divide by `data_size` (ties: the first)."""
    local = [n // (model_size if a == "model" else 1) for n, a in zip(shape, axes)]
    fits = [i for i, n in enumerate(local) if n % data_size == 0]
    if not fits:
        raise InputError("mesh", f"the 'data' axis of {data_size} devices cannot split {name} {tuple(shape)} "
                                 f"(local shape {tuple(local)} on each 'model' shard): no axis is a multiple of "
                                 f"{data_size}; fsdp splits every parameter")
    best = max(fits, key=lambda i: (local[i], -i))
    axes = list(axes)
    axes[best] = "data" if axes[best] is None else ("model", "data")
    return axes


class Placement(NamedSharding):
    """Where a sharded model's calls run: replicated over the mesh (what `jax.device_put(x,
    model.device)` gives), with the platform `impl_jax.compiled` reads and `place`, which puts a
    call's arguments: the batch split over "data", what is already on the mesh as it lies."""

    def __init__(self, mesh: Mesh):
        super().__init__(mesh, P())
        self.platform = mesh.devices.flat[0].platform
        self._devices = frozenset(mesh.devices.flat)
        self._batch = NamedSharding(mesh, P("data"))

    def place(self, args: tuple) -> tuple:
        data = self.mesh.shape["data"]

        def put(x):
            if isinstance(x, jax.Array) and x.committed and x.sharding.device_set == self._devices:
                return x  # a parameter, an optimizer moment, a result of an earlier call
            shape = np.shape(x)
            batched = len(shape) >= 2 and shape[0] > 1 and shape[0] % data == 0  # (B, ...): ids, masks, memory
            return jax.device_put(x, self._batch if batched else self)

        return tuple(jax.tree.map(put, arg) for arg in args)


@functools.lru_cache(maxsize=16)
def _placement(mesh: Mesh) -> Placement:
    return Placement(mesh)


class ShardedModel(Model):
    """A `Model` whose variables live on `mesh`, the parameters placed by `plan` (see the module
    docstring); `device` is the mesh's `Placement`. Built by `shard`."""

    def __init__(self, config, params, dtype=None, *, mesh: Mesh, plan: str, param_dtype=None, buckets=None,
                 precision: str = "highest"):
        mesh, plan = check_mesh(mesh), check_plan(plan)
        super().__init__(config, params, dtype, device=mesh.devices.flat[0], param_dtype=param_dtype,
                         buckets=buckets, precision=precision)
        self.mesh, self.plan = mesh, plan
        specs = plan_specs(config, {name: tuple(w.shape) for name, w in self.params.items()}, dict(mesh.shape), plan)
        for path, variable in nnx.to_flat_state(nnx.state(self)):
            name = ".".join(str(part) for part in path)
            # Constants of the config (sinusoid tables, bucket maps) go everywhere, as dp's parameters.
            sharding = NamedSharding(mesh, specs[name]) if name in specs else _placement(mesh)
            variable.set_raw_value(jax.device_put(variable.get_raw_value(), sharding))

    @property
    def device(self) -> Placement:
        """Where every call runs: the mesh, as a `Placement` (a replicated `NamedSharding`)."""
        return _placement(self.mesh)

    def _ids(self, argument: str, ids, vocab_size: int) -> np.ndarray:
        ids = super()._ids(argument, ids, vocab_size)
        data = self.mesh.shape["data"]
        if ids.ndim == 2 and ids.shape[0] % data:
            raise InputError(argument, f"a batch of {ids.shape[0]} rows does not split over the mesh's 'data' "
                                       f"axis of {data} devices; give a multiple of {data} rows")
        return ids


def shard(model: Model, mesh, plan: str) -> ShardedModel:
    """`model` on `mesh` (a `jax.sharding.Mesh` with axes ("data", "model")) by `plan` ("dp",
    "fsdp", "tp" or "fsdp+tp"): a new model with the same config, dtypes, buckets, precision and
    parameter values, each parameter placed with a `NamedSharding` (see the module docstring).
    `model` itself is left as it is."""
    if not isinstance(model, Model):
        raise InputError("model", f"must be an impl_jax.Model, got {type(model).__name__}")
    mesh, plan = check_mesh(mesh), check_plan(plan)
    # The plan is checked before any parameter is copied.
    plan_specs(model.config, {name: tuple(w.shape) for name, w in model.params.items()}, dict(mesh.shape), plan)
    params = {name: np.asarray(w) for name, w in model.params.items()}
    return ShardedModel(model.config, params, model.dtype, mesh=mesh, plan=plan, param_dtype=model.param_dtype,
                        buckets=model.buckets, precision=model.precision)


def shard_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on one device (its shard's), by canonical name."""
    return {name: tuple(w.sharding.shard_shape(w.shape)) for name, w in model.params.items()}


__all__ = ["PLANS", "Placement", "ShardedModel", "plan_specs", "shard", "shard_shapes"]
