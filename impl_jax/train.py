"""Training in JAX: the paper's Adam as `optax.adam` with the warmup schedule as an optax schedule.

    optimizer = Adam(model, d_model=config.d_model)        # β1 0.9, β2 0.98, ε 1e-9, warmup 4000
    loss = train_step(model, optimizer, src_ids, tgt_ids, labels, label_smoothing=0.1)

The same names and signatures as `impl_numpy.train` (written out) and `impl_torch.train`
(torch.optim.Adam + LambdaLR); docs/training.md gives the equations all three compute. The update
is jit-compiled through `impl_jax.compiled` (one executable per parameter structure and dtype,
inside the same bounded cache as the forward).

`train_step` with this backend's `Adam` stepping the same model is one compiled step: the loss,
its gradients (`Model._loss_and_grads`, the very function `loss_and_grads` runs) and the update
(`_update`, the very function `Adam.step` runs) in one executable, whose parameter and optimizer
state buffers are donated, so XLA writes the new values over the old ones instead of holding both,
and no gradient goes back to the host in between. The numbers are those of `loss_and_grads`
followed by `Adam.step` (tests/training/test_optimizers.py). Any other optimizer takes the written-once
`conformance.core.training.train_step`.

The host side of a step is kept small, because on a GPU the step waits for it (docs/training.md):
the model's variables and structure (a `PyTreeDef`, which keys the `StepLayout` found once by
`nnx.split`) come from the flattening kept between calls (`step_layout`, impl_jax/flat.py: a
check of the structure, not two tree flattens, each step), arguments already on the device are
not put there again (`compiled.placed`), and the new values are set on the model's own variables,
where `nnx.split`, `jax.device_put` of every parameter and moment, and `nnx.update` took most of
a small model's step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax  # the JAX ecosystem's optimizers: the issue asks for optax.adam, not a re-derivation
from flax import nnx

from conformance.core.params import param_shapes
from conformance.core import training
from conformance.core.training import PAPER_BETAS, PAPER_EPS, PAPER_WARMUP, check_adam, check_grads, paper_lrate
from impl_jax import compiled, flat, host
from impl_jax.precision import model_precision

__all__ = ["Adam", "train_step"]


def schedule(d_model: int, warmup: int):
    """The paper's lrate as an optax schedule. optax counts updates from 0 (`scale_by_schedule`
    calls it with the count before incrementing), the paper from 1: lrate(count + 1)."""

    def lrate(count):
        step = jnp.asarray(count + 1, jnp.result_type(float))
        return d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup ** -1.5)

    return lrate


def transform(d_model: int, warmup: int, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """optax.adam: updates = -lrate · m̂ / (sqrt(v̂ + eps_root) + eps) with eps_root = 0, i.e. the
    paper's (and torch.optim.Adam's) m̂ / (sqrt(v̂) + ε)."""
    return optax.adam(learning_rate=schedule(d_model, warmup), b1=b1, b2=b2, eps=eps, eps_root=0.0)


def _update(_, params, grads, state, *, d_model, warmup, b1, b2, eps):
    """The compiled step: optax's update applied to the parameters (a dict by canonical name)."""
    updates, state = transform(d_model, warmup, b1, b2, eps).update(grads, state, params)
    return optax.apply_updates(params, updates), state


class Adam:
    """`optax.adam` with the paper's schedule, stepping an `impl_jax.Model` in place."""

    def __init__(self, model, d_model: int, warmup: int = PAPER_WARMUP, betas=PAPER_BETAS, eps: float = PAPER_EPS):
        self.d_model, self.warmup, self.betas, self.eps = check_adam(d_model, warmup, betas, eps)
        self.model = model
        self.steps = 0
        host.check_runnable(model.dtype, param_dtype=model.param_dtype)
        self.state = transform(self.d_model, self.warmup, *self.betas, self.eps).init(model.params)

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return paper_lrate(self.steps + 1, self.d_model, self.warmup)

    def step(self, grads) -> float:
        """One update of every parameter from `grads` (a dict by canonical name); returns the
        learning rate it used."""
        check_grads(param_shapes(self.model.config), list(grads), lambda name: np.shape(grads[name]))
        host.check_runnable(self.model.dtype, param_dtype=self.model.param_dtype)
        lr = self.lr
        variables, layout = step_layout(self.model)
        params = dict(zip(layout.param_names, layout.read(variables, layout.param_positions)))
        grads = {name: _as_array(grads[name], params[name].dtype) for name in params}
        beta1, beta2 = self.betas
        new, self.state = compiled.call(None, _update, (params, grads, self.state), self.model.device,
                                        d_model=self.d_model, warmup=self.warmup, b1=beta1, b2=beta2, eps=self.eps)
        layout.write(variables, [new[name] for name in layout.param_names])
        self.steps += 1
        return lr


class StepLayout:
    """Where a model's variables go in the fused step, for one model structure: the graphdef,
    and each variable's position among the model's variables in leaf order and its path
    in `nnx.split(model, nnx.Param, ...)`'s states (the parameters, then the rest)."""

    def __init__(self, model, key, variables):
        self.key = key  # (structure, sharing): see step_layout
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        position = {id(variable): i for i, variable in enumerate(variables)}
        self.param_paths, self.param_positions = self._paths(params, position)
        self.rest_paths, self.rest_positions = self._paths(rest, position)
        self.param_names = tuple(".".join(str(part) for part in path) for path in self.param_paths)

    # A static argument of the compiled step: equal for equal keys, which trace equal programs.
    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, StepLayout) and self.key == other.key

    @staticmethod
    def _paths(state, position) -> tuple[tuple, tuple[int, ...]]:
        flat = nnx.to_flat_state(state)
        return tuple(path for path, _ in flat), tuple(position[id(variable)] for _, variable in flat)

    @staticmethod
    def read(variables, positions) -> list:
        """The values of the variables at `positions`."""
        return [variables[i].get_raw_value() for i in positions]

    def write(self, variables, params) -> None:
        """The parameters' new values (a list in this layout's order) set on the model's own variables."""
        for i, value in zip(self.param_positions, params):
            variables[i].set_raw_value(value)

    def merge(self, params, rest):
        """The model, from the parameters' and the rest's values (lists in this layout's order)."""
        return nnx.merge(self.graphdef, nnx.from_flat_state(list(zip(self.param_paths, params))),
                         nnx.from_flat_state(list(zip(self.rest_paths, rest))))


# A model's structure (`jax.tree.flatten(model)`'s tree: its modules, their static attributes,
# each variable's type and metadata) and its sharing (which leaves are one variable: a tree does
# not say, nnx.split does) -> its StepLayout. Read again on every step (from impl_jax/flat.py's
# record, checked in about 0.2 ms for the base model; two tree flattens took 1.7 ms) where `nnx.split`
# and `nnx.update` cost tens of milliseconds (docs/training.md); a model whose structure or sharing changed gets another key. The
# compiled step receives its layout as a static argument, so emptying this table cannot pull a
# layout from under a trace running on another thread.
_LAYOUTS: dict = {}
MAX_LAYOUTS = 32  # distinct model structures stepped in one process before the table is emptied


def step_layout(model) -> tuple[list, StepLayout]:
    """(the model's variables in leaf order, the StepLayout of its structure and sharing)."""
    variables, key = flat.variables(model)  # kept between steps while the structure holds
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = StepLayout(model, key, variables)
    return variables, layout


def _as_array(x, dtype) -> jax.Array:
    """x as a JAX array of `dtype`: a JAX array of that dtype (`loss_and_grads`' own gradients) as
    it is, committed where it lies, anything else (a weakly typed array too, which would compile
    another program) through `jnp.asarray` (260 conversions a step otherwise, and results that
    `compiled.placed` must then put on the device again)."""
    if isinstance(x, jax.Array) and x.dtype == dtype and not x.weak_type:
        return x
    return jnp.asarray(x, dtype)


def _fused_step(_, params, state, rest, *args, layout, d_model, warmup, b1, b2, eps, **static):
    """The compiled step: the model rebuilt from its (donated) parameters, loss and gradients as
    `loss_and_grads` computes them, then `_update` as `Adam.step` applies it; returns the loss,
    the new parameters (a list, in the layout's order) and the new optimizer state."""
    model = compiled.in_layout(layout.merge(params, rest))
    with model_precision(model.precision):
        loss, grads = type(model)._loss_and_grads(model, *args, **static)
    flat = dict(zip(layout.param_names, params))
    new, state = _update(None, flat, grads, state, d_model=d_model, warmup=warmup, b1=b1, b2=b2, eps=eps)
    return loss, [new[name] for name in layout.param_names], state


def train_step(model, optimizer, src_ids, tgt_ids, labels, *, label_smoothing: float = 0.0):
    """Forward, loss, backward and one optimizer step; returns the loss. With this backend's `Adam`
    stepping `model`, one compiled step with donated buffers (see the module docstring); with any
    other optimizer, `model.loss_and_grads` then `optimizer.step` (conformance.core.training)."""
    if not isinstance(optimizer, Adam) or optimizer.model is not model:
        return training.train_step(model, optimizer, src_ids, tgt_ids, labels, label_smoothing=label_smoothing)
    args, static = model._loss_args(src_ids, tgt_ids, labels, label_smoothing, None)
    variables, layout = step_layout(model)
    params, rest = layout.read(variables, layout.param_positions), layout.read(variables, layout.rest_positions)
    beta1, beta2 = optimizer.betas
    loss, params, optimizer.state = compiled.call(
        None, _fused_step, (params, optimizer.state, rest, *args), model.device, donate=True,
        compute_dtype=model.dtype, layout=layout,
        d_model=optimizer.d_model, warmup=optimizer.warmup, b1=beta1, b2=beta2, eps=optimizer.eps, **static)
    layout.write(variables, params)
    optimizer.steps += 1
    return loss
