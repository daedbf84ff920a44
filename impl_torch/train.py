"""Training in PyTorch: the paper's Adam as `torch.optim.Adam` with a `LambdaLR` warmup schedule.

    optimizer = Adam(model, d_model=config.d_model)        # β1 0.9, β2 0.98, ε 1e-9, warmup 4000
    loss = train_step(model, optimizer, src_ids, tgt_ids, labels, label_smoothing=0.1)

The same names and signatures as `impl_numpy.train` (written out) and `impl_jax.train` (optax);
docs/training.md gives the equations all three compute.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn

from conformance.core.params import param_shapes
from conformance.core.training import (PAPER_BETAS, PAPER_EPS, PAPER_WARMUP, check_adam, check_grads, paper_lrate,
                                       train_step)

__all__ = ["Adam", "train_step"]  # train_step: one training step, written once in the core


def leaf_in(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A leaf of autograd's graph holding p's values in `dtype` (call under `torch.no_grad()`): the
    cast itself, or, where p already is in `dtype`, a detached view, so that marking the leaf as
    requiring grad never touches p (a frozen parameter stays frozen)."""
    leaf = p.to(dtype)
    return (p.detach() if leaf is p else leaf).requires_grad_()


@contextlib.contextmanager
def parameters_replaced(module: nn.Module, tensors: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Inside the block, `module` reads each parameter p as `tensors[id(p)]` (parameters not
    named there stay); outside it, as before, whatever the block raised.

    What `torch.func.functional_call` does for a dict of parameters, by the same means (the
    module's own `_parameters` entries, swapped and restored), without its per-name lookups and
    tie analysis: for the base model's 260 parameters functional_call spends 1.6 ms of host time
    a training step, this 0.35 ms, one walk over the modules (`loss_and_grads` with a
    `param_dtype`, docs/training.md)."""
    if not tensors:
        yield
        return
    swapped = []  # (owner, attribute, parameter)
    try:
        for owner in module.modules():
            for attribute, parameter in list(owner._parameters.items()):
                if parameter is not None and id(parameter) in tensors:
                    owner._parameters[attribute] = tensors[id(parameter)]
                    swapped.append((owner, attribute, parameter))
        yield
    finally:
        for owner, attribute, parameter in swapped:
            owner._parameters[attribute] = parameter


class Adam:
    """`torch.optim.Adam(lr=1, fused=True)` scaled by `LambdaLR` to the paper's lrate_t at step t = 1, 2, ...

    torch.optim.Adam computes p -= (lr / (1 - β1^t)) · m / (sqrt(v) / sqrt(1 - β2^t) + ε): the
    same equation as m̂ / (sqrt(v̂) + ε), arranged differently (so it rounds differently, by an
    ulp or so). `LambdaLR` multiplies the base lr (1.0) by its lambda of the epoch, which counts
    from 0 at the first step: lambda(e) = lrate_{e+1}.
    """

    def __init__(self, model, d_model: int, warmup: int = PAPER_WARMUP, betas=PAPER_BETAS, eps: float = PAPER_EPS):
        self.d_model, self.warmup, self.betas, self.eps = check_adam(d_model, warmup, betas, eps)
        self.model = model
        self.steps = 0
        named = dict(model.named_parameters())
        self.names = list(param_shapes(model.config))
        self.params = [named[name] for name in self.names]
        # fused: one kernel for all parameters (CPU and CUDA) instead of a loop of elementwise ops
        # per tensor: the same equation, 7x faster on 96M float32 values on a CPU (bench_train).
        self.optimizer = torch.optim.Adam(self.params, lr=1.0, betas=self.betas, eps=self.eps, fused=True)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda epoch: paper_lrate(epoch + 1, self.d_model, self.warmup))

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self, grads) -> float:
        """One update of every parameter from `grads` (a dict by canonical name); returns the
        learning rate it used."""
        check_grads(param_shapes(self.model.config), list(grads), lambda name: grads[name].shape)
        lr = self.lr
        for name, p in zip(self.names, self.params):
            grad = grads[name]
            # loss_and_grads' own gradients are used as they are (the fused kernel reads them and
            # writes only the parameter and its moments), without the three host dispatches of
            # as_tensor, detach and to (260 tensors a step, on a launch-bound GPU step:
            # docs/training.md); anything else goes through them (a copy where dtype or device
            # differ, a view that does not require grad where one does)
            if not (isinstance(grad, torch.Tensor) and grad.device == p.device and grad.dtype == p.dtype
                    and not grad.requires_grad):
                grad = torch.as_tensor(grad).detach().to(device=p.device, dtype=p.dtype)
            p.grad = grad
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return lr
