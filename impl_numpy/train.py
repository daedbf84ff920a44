"""Training in NumPy: the paper's Adam with its warmup schedule, written out (section 5.3).

    optimizer = Adam(model, d_model=config.d_model)        # β1 0.9, β2 0.98, ε 1e-9, warmup 4000
    loss = train_step(model, optimizer, src_ids, tgt_ids, labels, label_smoothing=0.1)

The same names and signatures as `impl_torch.train` (torch.optim.Adam + LambdaLR) and
`impl_jax.train` (optax.adam with a schedule); docs/training.md gives the equations all three
compute. The parameters are updated in place, on private copies the optimizer gives the model.
"""

from __future__ import annotations

import numpy as np

from conformance.core.params import param_shapes
from conformance.core.training import (PAPER_BETAS, PAPER_EPS, PAPER_WARMUP, check_adam, check_grads, paper_lrate,
                                       train_step)

__all__ = ["Adam", "train_step"]  # train_step: one training step, written once in the core


class Adam:
    """Adam (Kingma & Ba) with the paper's schedule; step t = 1, 2, ... computes

        lrate_t = d_model^-0.5 · min(t^-0.5, t · warmup^-1.5)
        m = β1 m + (1 - β1) g                 v = β2 v + (1 - β2) g²
        m̂ = m / (1 - β1^t)                   v̂ = v / (1 - β2^t)
        p = p - lrate_t · m̂ / (sqrt(v̂) + ε)

    (ε outside the root, added to the bias-corrected root: torch.optim.Adam's and optax.adam's
    eps with eps_root = 0.)
    """

    def __init__(self, model, d_model: int, warmup: int = PAPER_WARMUP, betas=PAPER_BETAS, eps: float = PAPER_EPS):
        self.d_model, self.warmup, self.betas, self.eps = check_adam(d_model, warmup, betas, eps)
        self.model = model
        self.steps = 0
        # The model may share its arrays with the caller (a checkpoint's, or the very arrays another
        # backend's model was built from: JAX on the CPU can alias a NumPy buffer). Updating those in
        # place would change them behind the caller's back, so the model is rebuilt once on private
        # copies, which the steps then update in place (its layers hold these very arrays).
        model.__init__(model.config, {name: np.array(value) for name, value in model.params.items()}, model.dtype,
                       param_dtype=model.param_dtype)
        self.m = {name: np.zeros_like(value) for name, value in model.params.items()}
        self.v = {name: np.zeros_like(value) for name, value in model.params.items()}

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return paper_lrate(self.steps + 1, self.d_model, self.warmup)

    def step(self, grads) -> float:
        """One update of every parameter from `grads` (a dict by canonical name); returns the
        learning rate it used."""
        grads = {name: np.asarray(g) for name, g in grads.items()}
        check_grads(param_shapes(self.model.config), list(grads), lambda name: grads[name].shape)
        (beta1, beta2), t, lr = self.betas, self.steps + 1, self.lr
        for name, p in self.model.params.items():
            g = grads[name].astype(p.dtype)
            m = self.m[name] = beta1 * self.m[name] + (1 - beta1) * g
            v = self.v[name] = beta2 * self.v[name] + (1 - beta2) * g * g
            m_hat = m / (1 - beta1 ** t)
            v_hat = v / (1 - beta2 ** t)
            p -= (lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(p.dtype)  # in place
        self.steps = t
        return lr
