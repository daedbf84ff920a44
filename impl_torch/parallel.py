"""Sharded runs of the PyTorch model on `torch.distributed`'s own engines (docs/sharding.md).

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))   # gloo; "cuda": NCCL
    model = impl_torch.parallelize(model, mesh, "fsdp+tp")       # in place, and returned
    loss, grads = model.loss_and_grads(src_ids, tgt_ids, labels)  # this module's, installed by parallelize
    optimizer.step(grads)                                        # impl_torch.Adam, built after parallelize

Nothing here writes a collective. The plans are compositions of PyTorch's parallel APIs:

| plan      | what runs                                                                              |
| --------- | -------------------------------------------------------------------------------------- |
| `dp`      | `replicate` (FSDP2's DDP) over "data": parameters whole, gradients all-reduced          |
| `fsdp`    | FSDP2 `fully_shard` over "data" on each layer, then the root                            |
| `tp`      | `parallelize_module` over "model" (Megatron: q, k, v, linear1 by columns; o, linear2 by rows), then `replicate` over "data" |
| `fsdp+tp` | `parallelize_module` over "model", then `fully_shard` over "data" (2-D)                 |

In every plan each "data" rank computes its own rows of the batch (`loss_and_grads`).
"""

from __future__ import annotations

import types
from functools import partial

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from conformance.core.dropout import Dropout
from conformance.core.errors import InputError
from conformance.core.inputs import check_label_smoothing, host_labels
from conformance.core.params import param_shapes
from conformance.core.sharding import AXES, PLANS
from impl_torch import model as model_module
from impl_torch.arrays import to_numpy

MESH_DIMS = AXES

# Megatron-LM's split (Shoeybi et al. 2019, section 3), by the last part of a module's name.
# The canonical Linear stores W (d_in, d_out): "by columns" is weight axis 1 (and the bias),
# "by rows" weight axis 0, its bias whole (added once after the partial products are summed).
COLUMNS = ("q_proj", "k_proj", "v_proj", "linear1", "gate")
ROWS = ("o_proj", "linear2")


class CanonicalColwise(ColwiseParallel):
    """`ColwiseParallel` for the model's own `Linear`, whose weight is stored (d_in, d_out):
    the weight is split along axis 1 (nn.Linear's (d_out, d_in) would be axis 0), the bias along
    axis 0. The input and output layouts are ColwiseParallel's: replicated in, the last axis
    split out, handed on as the local shard (the local heads)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for name, param in module.named_parameters():
            placement = Shard(1) if param.dim() == 2 else Shard(0)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                         requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class CanonicalRowwise(RowwiseParallel):
    """`RowwiseParallel` for the model's own `Linear`: the weight (d_in, d_out) split along axis 0,
    the bias replicated; the input is the local shard of the last axis, the output summed
    (replicated) by the DTensor the product gives."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for name, param in module.named_parameters():
            placement = Shard(0) if param.dim() == 2 else Replicate()
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                         requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def tp_plan(model: nn.Module) -> dict[str, ColwiseParallel | RowwiseParallel]:
    """`parallelize_module`'s plan for `model`: every Linear named in COLUMNS or ROWS, by its module path."""
    plan = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, model_module.Linear) and last in COLUMNS + ROWS:
            plan[name] = CanonicalColwise() if last in COLUMNS else CanonicalRowwise()
    return plan


def check_mesh(mesh) -> None:
    """InputError("mesh") unless `mesh` is a DeviceMesh whose dims are exactly ("data", "model")."""
    if not isinstance(mesh, DeviceMesh):
        raise InputError("mesh", f"expected a torch.distributed DeviceMesh with dims {MESH_DIMS}, got {type(mesh).__name__}")
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise InputError("mesh", f"expected a DeviceMesh with dims {MESH_DIMS}, got {mesh.mesh_dim_names}")


def check_tp(config, model_size: int) -> None:
    """InputError("mesh") unless the "model" dim splits whole heads and whole FFN units; InputError("plan")
    for T5's relative position bias, whose (buckets, H) table this plan does not split by heads."""
    if config.position == "relative":
        raise InputError("plan", "tensor parallelism does not split T5's relative position bias (buckets, H) "
                                 "by heads: not supported for position \"relative\"")
    for field in ("n_heads", "d_ff"):
        size = getattr(config, field)
        if size % model_size:
            raise InputError("mesh", f'{field} = {size} does not divide over the mesh\'s "model" dim of size '
                                     f"{model_size}: tensor parallelism splits whole heads and whole FFN units")


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: str, *, mp_policy=None) -> nn.Module:
    """Shard `model` (an `impl_torch.Model`) over `mesh` as `plan` says, in place; returns it.

    `mesh`: a `DeviceMesh` with dims ("data", "model"). `plan`: "dp", "fsdp", "tp" or "fsdp+tp"
    (module docstring). `mp_policy` (keyword-only): an FSDP2 `MixedPrecisionPolicy` for the
    data-parallel wrapper ("fsdp", "fsdp+tp", and the `replicate` of "dp" and "tp"); None keeps the
    parameters' dtype. Parameters keep their canonical names. Build the optimizer afterwards: it
    must hold the sharded parameters.
    """
    if plan not in PLANS:
        raise InputError("plan", f"unknown plan {plan!r}; the plans are {', '.join(PLANS)}")
    check_mesh(mesh)
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise InputError("mp_policy", f"expected a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                                      f"got {type(mp_policy).__name__}")
    if "tp" in plan:
        check_tp(model.config, mesh["model"].size())
        parallelize_module(model, mesh["model"], tp_plan(model))
    data = mesh["data"]
    options = {"mesh": data, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if plan in ("fsdp", "fsdp+tp"):
        for layer in (*model.encoder.layers, *model.decoder.layers):
            fully_shard(layer, **options)
        fully_shard(model, **options)
    else:
        replicate(model, **options)
    # Each data rank's loss is its share of the whole batch's mean (`loss_and_grads`), so the
    # gradients are summed over "data", not averaged: in every module FSDP2 manages (each layer's
    # parameter group reduces on its own). A plain SUM on the wire: gloo has neither AVG nor the
    # PREMUL_SUM FSDP2 otherwise picks for float32 and bfloat16 reductions.
    wrappers = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not wrappers:  # torch's private class tree moved: gradients would be averaged, silently
        raise RuntimeError(f"plan {plan!r}: no FSDP2 module found after fully_shard/replicate, so the gradients' "
                           "reduction cannot be set to a sum; this torch version is not supported by parallelize")
    for module in wrappers:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    model.mesh, model.plan = mesh, plan
    # The model's own `loss_and_grads` differentiates with `torch.autograd.grad` at its parameters,
    # which FSDP2 and DTensor never reach (it would return zeros): the sharded one replaces it, so
    # `impl_torch.train_step` steps a parallelized model too.
    model.loss_and_grads = types.MethodType(loss_and_grads, model)
    for name in ("generate", "start_cache", "decode_step"):  # its cache is sized by config.n_heads, untested sharded
        setattr(model, name, types.MethodType(_not_sharded(name, plan), model))
    return model


def _not_sharded(name: str, plan: str):
    """A stand-in for `name` on a parallelized model: a clear error, not a cache of the wrong size."""
    def refused(model, *args, **kwargs):
        raise InputError("plan", f"{name} is not supported on a model parallelized with plan {plan!r} yet (its KV "
                                 "cache is sized by the global head count): decode with the unsharded model; "
                                 "see docs/sharding.md")
    return refused


def local_rows(mesh: DeviceMesh, argument: str, array: torch.Tensor) -> torch.Tensor:
    """This "data" rank's rows of a whole batch (B, ...); InputError unless B divides over "data"."""
    size, rank = mesh["data"].size(), mesh["data"].get_local_rank()
    if array.shape[0] % size:
        raise InputError(argument, f'{array.shape[0]} rows do not divide over the mesh\'s "data" dim of size {size}')
    rows = array.shape[0] // size
    return array[rank * rows:(rank + 1) * rows]


def loss_and_grads(model: nn.Module, src_ids, tgt_ids, labels, *, label_smoothing: float = 0.0, dropout=None):
    """The loss of docs/training.md and its gradients for a `parallelize`d model (which also has
    it as `model.loss_and_grads`).

    Every rank is given the whole batch; each computes the rows of its "data" coordinate. Its loss
    is the sum over its counted tokens divided by N, the whole batch's count, so that the sum over
    "data" (the gradient reduction of `parallelize`, and the loss's own) is the one-device mean.
    Returns the loss (a 0-d tensor, the same on every rank) and the gradients by canonical name,
    each as the DTensor its parameter is: `.full_tensor()` gathers one. The ids are checked as by
    `forward`; `dropout`: the whole batch's masks (`draw_dropout`), of which each rank takes its rows.
    """
    mesh, config = model.mesh, model.config
    epsilon = check_label_smoothing(label_smoothing)
    src_ids, tgt_ids = torch.as_tensor(src_ids), torch.as_tensor(tgt_ids)
    # Checked as the one-device loss checks them: shape, range, at least one counted token.
    labels = torch.as_tensor(host_labels(config, to_numpy(labels), tuple(tgt_ids.shape)))
    counted = int((labels != config.pad_id).sum())  # N, the whole batch's
    src, tgt, targets = (local_rows(mesh, name, a) for name, a in
                         (("src_ids", src_ids), ("tgt_ids", tgt_ids), ("labels", labels)))
    if isinstance(dropout, Dropout):  # anything else goes to the model, which names what is wrong
        dropout = Dropout(dropout.rate, {site: local_rows(mesh, "dropout", mask) for site, mask in dropout.masks.items()})
    targets = targets.to(device=model.device, dtype=torch.long)
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(src, tgt, return_attention=False, empty_rows=0.0, dropout=dropout).logits  # (B / data, T, V)
        selected = model_module.at_least_float32(torch.where((targets != config.pad_id)[..., None], logits, 0.0))
        loss = summed_cross_entropy(selected, targets, config.pad_id, epsilon) / counted
        loss.backward()
    named = dict(model.named_parameters())
    grads = {name: named[name].grad for name in param_shapes(config)}  # checkpoint order
    model.zero_grad(set_to_none=True)
    # The whole batch's loss: the sum of the data ranks' shares, by DTensor's own reduction.
    whole = DTensor.from_local(loss.detach()[None], mesh["data"], [Partial()], run_check=False).full_tensor()[0]
    return whole, grads


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, pad_id: int, epsilon: float) -> torch.Tensor:
    """The summed label-smoothed cross-entropy of the counted tokens (`Model._loss_and_grads`' sum)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=pad_id,
                                       label_smoothing=epsilon, reduction="sum")
