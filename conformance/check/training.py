"""`rosetta train-check`'s engine: N training steps in every backend from the same weights on the
same batches, each step compared with the float64 NumPy run.

Each target (backend, device, dtype) trains its own model with its own backend's optimizer (the
paper's Adam, `impl_X.Adam`); the reference run is `impl_numpy` in float64, whose
`loss_and_grads` is the hand-written gradient oracle. At every step, for every target:

- the loss against the reference loss;
- the gradients against the reference gradients, parameter by parameter in *backward order* (the
  reverse of the checkpoint's forward order: the output projection first, the embeddings last),
  so that the first parameter out of tolerance is where a wrong gradient enters, not one of the
  parameters upstream that inherit it;
- after the optimizer step, the largest parameter difference against the reference run.

A gradient (or loss) passes when |x - reference| <= atol · max(1, max |reference|) with the
per-dtype `atol` of `conformance.check.tolerances` (the forward table: the gradient table measured
by the suite replaces it when it exists).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Callable

import numpy as np

from conformance.check import backends
from conformance.check.tolerances import gradient_tolerance
from conformance.core.config import ModelConfig
from conformance.core.params import param_shapes

REFERENCE = backends.Target("numpy", "cpu", "float64")


def training_batches(config: ModelConfig, steps: int, *, seed: int = 0, batch: int = 4,
                     length: int | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`steps` batches (src (B, S), tgt (B, T), labels (B, T)) drawn from `seed`, any config.

    Rows have random real lengths and are padded at the end with `pad_id`; the labels are the
    target shifted left by one (the next token), `pad_id` where the target is padding, so every
    batch has padded, uncounted positions."""
    length = min(length or 8, config.max_len)
    rng = np.random.default_rng(seed)

    def ids(vocab: int, shape) -> np.ndarray:
        values = rng.integers(0, vocab - 1, size=shape)
        return np.where(values >= config.pad_id, values + 1, values)  # never the pad id

    out = []
    for _ in range(steps):
        src, tgt = ids(config.src_vocab_size, (batch, length)), ids(config.tgt_vocab_size, (batch, length + 1))
        src_real = rng.integers(1, length + 1, size=batch)
        tgt_real = rng.integers(2, length + 2, size=batch)
        for row in range(batch):
            src[row, src_real[row]:] = config.pad_id
            tgt[row, tgt_real[row]:] = config.pad_id
        labels = np.where(tgt[:, 1:] == config.pad_id, config.pad_id, tgt[:, 1:])
        out.append((src, tgt[:, :-1].copy(), labels))
    return out


def backward_order(config: ModelConfig) -> list[str]:
    """The canonical parameter names in the order backpropagation reaches them."""
    return list(reversed(list(param_shapes(config))))


def host_params(model) -> dict[str, np.ndarray]:
    """A model's parameters as float64 host arrays, from any backend."""
    values = model.state_dict() if hasattr(model, "state_dict") else model.params
    to_numpy = backends.import_backend(model.backend).to_numpy if model.backend in backends.BACKENDS else np.asarray
    return {name: np.asarray(to_numpy(value), dtype=np.float64) for name, value in values.items()}


def host_grads(grads: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, g in grads.items():
        if hasattr(g, "detach"):  # a torch tensor, possibly on an accelerator
            g = g.detach().cpu().double().numpy()
        out[name] = np.asarray(g, dtype=np.float64)
    return out


def scaled_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max(1, max |expected|); NaN in either is an infinite error."""
    if np.isnan(actual).any() or np.isnan(expected).any():
        return float("inf")
    return float(np.abs(actual - expected).max() / max(1.0, float(np.abs(expected).max())))


@dataclass
class StepResult:
    step: int
    target: str
    loss: float
    reference_loss: float
    loss_error: float
    worst_grad_error: float
    worst_grad: str
    first_bad_grad: str | None  # in backward order
    param_diff: float  # max |param - reference param| after the step
    allowed: float


@dataclass
class TrainCheck:
    source: str
    reference: str
    steps: int
    label_smoothing: float
    rows: list[StepResult] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def failures(self) -> list[StepResult]:
        return [r for r in self.rows if r.first_bad_grad is not None or r.loss_error > r.allowed]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and not self.failures

    def first_failure(self) -> StepResult | None:
        return self.failures[0] if self.failures else None

    def to_text(self) -> str:
        lines = [f"rosetta train-check: {self.source}", f"reference: {self.reference}, {self.steps} steps, "
                 f"label smoothing {self.label_smoothing}, the paper's Adam"]
        for step in range(1, self.steps + 1):
            lines.append(f"step {step}: reference loss {self.reference_losses[step - 1]:.12g}")
            for r in (r for r in self.rows if r.step == step):
                verdict = "ok" if r.first_bad_grad is None and r.loss_error <= r.allowed else "FAIL"
                lines.append(f"  {r.target:<22} loss {r.loss:.12g}  loss err {r.loss_error:.2e}  "
                             f"grad err {r.worst_grad_error:.2e} ({r.worst_grad})  max |param diff| "
                             f"{r.param_diff:.2e}  allowed {r.allowed:.0e}  {verdict}")
        for name, reason in self.skipped.items():
            lines.append(f"skipped {name}: {reason}")
        failure = self.first_failure()
        if failure is None:
            lines.append("PASS: every gradient and loss within tolerance at every step" if self.rows
                         else "nothing was checked")
        elif failure.first_bad_grad is not None:
            lines.append(f"FAIL: {failure.target}, step {failure.step}: the first gradient out of tolerance in "
                         f"backward order is {failure.first_bad_grad}")
        else:
            lines.append(f"FAIL: {failure.target}, step {failure.step}: the loss is out of tolerance "
                         f"({failure.loss_error:.2e} > {failure.allowed:.0e}) while every gradient is within")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        failure = self.first_failure()
        return {"source": self.source, "reference": self.reference, "steps": self.steps,
                "label_smoothing": self.label_smoothing, "passed": self.passed,
                "reference_losses": self.reference_losses, "rows": [asdict(r) for r in self.rows],
                "first_failure": None if failure is None else asdict(failure), "skipped": self.skipped}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, default=float)


def _loss_and_grads(target, model, batch, label_smoothing):
    src, tgt, labels = batch
    with backends.dtype_scope(target), backends.full_precision(backends.kind(target.backend)):
        loss, grads = model.loss_and_grads(src, tgt, labels, label_smoothing=label_smoothing)
        return float(np.asarray(loss.detach().cpu() if hasattr(loss, "detach") else loss)), grads


def run_train_check(config: ModelConfig, params: dict[str, np.ndarray], source: str, targets, steps: int, *,
                    skipped: dict[str, str] | None = None, batches=None, label_smoothing: float = 0.1,
                    warmup: int = 4000, reference: backends.Target = REFERENCE,
                    progress: Callable[[str], None] | None = None) -> TrainCheck:
    """Train every target and the reference for `steps` steps and compare them step by step.
    `progress(message)` hears what is being computed, as it starts (a command's status line).

    Raises `NotImplementedError` when a backend (the reference or a target) has no `loss_and_grads`."""
    batches = batches if batches is not None else training_batches(config, steps)
    progress = progress or (lambda message: None)
    report = TrainCheck(source, reference.label, steps, label_smoothing, skipped=dict(skipped or {}))
    order = backward_order(config)

    def start(target):
        progress(f"building {target.label}")
        with backends.dtype_scope(target):
            model = backends.build(target, config, params)
            if not hasattr(model, "loss_and_grads"):
                raise NotImplementedError(f"{target.backend} has no loss_and_grads")
            return model, backends.import_backend(target.backend).Adam(model, config.d_model, warmup=warmup)

    ref_model, ref_optimizer = start(reference)
    runs = {target: start(target) for target in targets if target != reference}
    for step, batch in enumerate(batches[:steps], 1):
        progress(f"step {step}/{steps}: {reference.label}")
        ref_loss, ref_grads = _loss_and_grads(reference, ref_model, batch, label_smoothing)
        ref_grads = host_grads(ref_grads)
        with backends.dtype_scope(reference):
            ref_optimizer.step(ref_grads)
            ref_params = host_params(ref_model)
        report.reference_losses.append(ref_loss)
        for target, (model, optimizer) in runs.items():
            allowed = gradient_tolerance(target.dtype, target.device).atol
            progress(f"step {step}/{steps}: {target.label}")
            loss, grads = _loss_and_grads(target, model, batch, label_smoothing)
            errors = {name: scaled_error(g, ref_grads[name]) for name, g in host_grads(grads).items()}
            first_bad = next((name for name in order if errors[name] > allowed), None)
            worst = max(order, key=lambda name: errors[name])
            with backends.dtype_scope(target):
                optimizer.step(grads)
                now = host_params(model)
            diff = max(float(np.abs(now[name] - ref_params[name]).max()) for name in ref_params)
            loss_error = abs(loss - ref_loss) / max(1.0, abs(ref_loss)) if np.isfinite(loss) else float("inf")
            report.rows.append(StepResult(step, target.label, loss, ref_loss, loss_error, errors[worst], worst,
                                          first_bad, diff, allowed))
    return report


def plot_train_check(report: TrainCheck, path: str | os.PathLike | BinaryIO) -> tuple[int, int]:
    """Draw `train_check_figure` as a PNG to `path` (a file name, or a binary file such as the
    `io.BytesIO` the CLI writes atomically); returns its size in pixels."""
    from conformance.check.plots import _pyplot

    fig = train_check_figure(report)
    fig.savefig(path, format="png")  # a file object has no suffix: never matplotlib's default format
    width, height = fig.canvas.get_width_height()
    _pyplot().close(fig)
    return width, height


def train_check_figure(report: TrainCheck):
    """Two panels against the step (whole numbers): the loss of every run, the reference's in
    black, and the largest parameter difference from the reference run, one line per target."""
    from matplotlib.ticker import MaxNLocator

    from conformance.check.plots import _pyplot

    plt = _pyplot()
    fig, (loss_ax, diff_ax) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    steps = list(range(1, len(report.reference_losses) + 1))
    loss_ax.plot(steps, report.reference_losses, color="black", linewidth=2.5, label=report.reference)
    for label in dict.fromkeys(r.target for r in report.rows):
        rows = [r for r in report.rows if r.target == label]
        loss_ax.plot([r.step for r in rows], [r.loss for r in rows], marker="o", label=label)
        diff_ax.plot([r.step for r in rows], [max(r.param_diff, 1e-300) for r in rows], marker="o", label=label)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("training loss")
    diff_ax.set_yscale("log")
    diff_ax.set_ylabel(f"max |param - {report.reference}|")
    diff_ax.set_title("divergence from the float64 NumPy run")
    for ax in (loss_ax, diff_ax):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # there is no step 1.5
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
