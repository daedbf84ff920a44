"""A foreign model's own tensors, read where a layout's `[taps]` say it computes them.

Three kinds of model are read, each the way its framework lets a caller watch a forward pass:

    torch.nn.Module     forward hooks (`register_forward_hook(..., with_kwargs=True)`) on the
                        tapped modules, removed afterwards
    flax.linen Module   `nn.intercept_methods` around the model's run: every `__call__` of a
                        module whose path (`module.path`, joined with ".") is tapped; the model is
                        a bound module (`module.bind(variables)`) or a `(module, variables)` pair
    flax.nnx Module     each tapped submodule's `__call__` wrapped for the run and restored

Each tap reads a module's output, an element or field of it, an input (positional or keyword),
or an attribute the module set during its call (`conformance.convert.layout.Tap`). What a tap
cannot read (a module that did not run, a value that is None, a module called more than once
without `call = k`) is reported with its reason, never replaced by something nearby.

The user's code runs here; nothing is compiled around it (an nnx model must run eagerly, as a
linen one does under `apply`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from conformance.check.compare import to_numpy
from conformance.core.errors import InputError

# Canonical attention weights are (B, H, Tq, Tk) in every system that returns them batch-first.
ATTENTION = (".self", ".cross")


@dataclass
class Captured:
    """What a run of the foreign model gave: canonical tensor -> float64 (or the model's dtype)
    NumPy array in the canonical layout, and for each tapped tensor that could not be read, why."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    logits: Any = None


def framework(model: Any) -> str:
    """"torch", "linen" or "nnx": which kind of model this is; TypeError for anything else."""
    if hasattr(model, "named_modules") and hasattr(model, "register_forward_hook"):
        return "torch"
    if isinstance(model, tuple) and len(model) == 2 and is_linen(model[0]):
        return "linen"
    if is_linen(model):
        if getattr(model, "scope", None) is None:
            raise TypeError("a flax.linen module needs its variables: pass module.bind(variables) or (module, variables)")
        return "linen"
    if type(model).__module__.startswith("flax.nnx") or any(c.__module__.startswith("flax.nnx") for c in type(model).__mro__):
        return "nnx"
    raise TypeError(f"expected a torch.nn.Module, a flax.linen module with its variables or an nnx.Module, got "
                    f"{type(model).__name__}")


def is_linen(obj: Any) -> bool:
    return any(c.__module__ == "flax.linen.module" and c.__name__ == "Module" for c in type(obj).__mro__)


def linen_parts(model: Any) -> tuple[Any, dict]:
    """(unbound module, variables) of a bound linen module or a (module, variables) pair."""
    if isinstance(model, tuple):
        module, variables = model
        return module, dict(variables) if "params" in variables else {"params": variables}
    module, variables = model.unbind()
    return module, dict(variables)


def tapped(layout, tensors: list[str], switches: dict[str, Any] | None = None) -> dict[str, tuple[str, Any]]:
    """canonical tensor -> (foreign module path, Tap) for every tensor the layout taps: the first
    of its taps whose `when` holds for the converted model's `switches` (all, when None)."""
    out = {}
    for tensor in tensors:
        for tap in layout.taps:
            path = tap.module_for(tensor)
            if path is not None and (switches is None or tap.applies(switches)):
                out[tensor] = (path, tap)
                break
    return out


def not_applying(layout, tensor: str, switches: dict[str, Any]) -> str | None:
    """Why a tensor the layout taps only under other switches is not read, or None."""
    taps = [tap for tap in layout.taps if tap.module_for(tensor) is not None]
    if not taps or any(tap.applies(switches) for tap in taps):
        return None
    return "the layout taps it only " + "; ".join(
        "when " + ", ".join(f"{k} = {v!r}" for k, v in tap.when.items()) for tap in taps) + (
        " (this model: " + ", ".join(f"{k} = {switches.get(k)!r}" for k in dict.fromkeys(
            k for tap in taps for k in tap.when)) + ")")


def _pick(tap, args: tuple, kwargs: dict, output: Any, module: Any) -> Any:
    """The value a tap reads from one call; a str is the reason it cannot."""
    if tap.input is not None:
        if isinstance(tap.input, int):
            return args[tap.input] if tap.input < len(args) else (
                f"called with {len(args)} positional argument(s), no input {tap.input}")
        return kwargs[tap.input] if tap.input in kwargs else f"not called with a keyword {tap.input!r}"
    if tap.attribute is not None:
        return getattr(module, tap.attribute, f"has no attribute {tap.attribute!r} after its call")
    if tap.output is None:
        return output
    if isinstance(tap.output, int):
        if isinstance(output, (tuple, list)) and tap.output < len(output):
            return output[tap.output]
        return f"returns {type(output).__name__}, which has no element {tap.output}"
    if hasattr(output, tap.output):
        return getattr(output, tap.output)
    if isinstance(output, dict) and tap.output in output:
        return output[tap.output]
    return f"returns {type(output).__name__}, which has no field {tap.output!r}"


class _Recorder:
    """Keeps, per tapped module path, what each of its calls gave for each tap there."""

    def __init__(self, taps: dict[str, tuple[str, Any]]):
        self.by_path: dict[str, list[tuple[str, Any]]] = {}
        for tensor, (path, tap) in taps.items():
            self.by_path.setdefault(path, []).append((tensor, tap))
        self.calls: dict[str, list[dict[str, Any]]] = {path: [] for path in self.by_path}

    def record(self, path: str, args: tuple, kwargs: dict, output: Any, module: Any) -> None:
        picked = {}
        for tensor, tap in self.by_path[path]:
            value = _pick(tap, args, kwargs, output, module)
            picked[tensor] = value if value is None or isinstance(value, str) else to_numpy(value)
        self.calls[path].append(picked)

    def result(self, taps: dict[str, tuple[str, Any]], batch_axis: int, missing_paths: set[str]) -> Captured:
        captured = Captured()
        for tensor, (path, tap) in taps.items():
            calls = self.calls[path]
            if path in missing_paths:
                captured.unavailable[tensor] = f"the model has no module {path!r} (the layout's tap {tap.describe()})"
                continue
            if not calls:
                captured.unavailable[tensor] = f"{path} did not run in this forward pass"
                continue
            if tap.call is None and len(calls) > 1:
                captured.unavailable[tensor] = (f"{path} ran {len(calls)} times; the tap must say which call "
                                                "(call = 0, 1, ...)")
                continue
            index = 0 if tap.call is None else tap.call
            if index >= len(calls):
                captured.unavailable[tensor] = f"{path} ran {len(calls)} time(s), no call {index}"
                continue
            value = calls[index][tensor]
            if value is None:
                captured.unavailable[tensor] = f"{tap.describe()} is None"
            elif isinstance(value, str):
                captured.unavailable[tensor] = f"{path} {value}"
            else:
                if batch_axis == 1 and value.ndim >= 2 and not tensor.endswith(ATTENTION):
                    value = np.swapaxes(value, 0, 1)
                captured.values[tensor] = value
        return captured


def capture(model: Any, layout, tensors: list[str], run: Callable, src_ids, tgt_ids,
            switches: dict[str, Any] | None = None) -> Captured:
    """Run `run(model, src, tgt)` once (as that framework's arrays) and read every tapped tensor
    (the taps whose `when` holds for `switches`, the converted model's).

    The logits are the run's return value (its `.logits` when it returns an output object).
    """
    taps = tapped(layout, tensors, switches)
    recorder = _Recorder(taps)
    kind = framework(model)
    if kind == "torch":
        logits, missing = _run_torch(model, run, src_ids, tgt_ids, recorder)
    elif kind == "linen":
        logits, missing = _run_linen(model, run, src_ids, tgt_ids, recorder)
    else:
        logits, missing = _run_nnx(model, run, src_ids, tgt_ids, recorder)
    captured = recorder.result(taps, layout.tap_options["batch_axis"], missing)
    captured.logits = to_numpy(logits)
    return captured


def output_logits(result: Any) -> Any:
    """A run's logits: the value itself, or its `.logits` (a Hugging Face output object)."""
    return result.logits if hasattr(result, "logits") and not hasattr(result, "shape") else result


def torch_ids(ids: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))


def torch_source(model, src: np.ndarray):
    """The source as the model takes it: ids (`torch_ids`), or a features source's log-mel features
    in the dtype of the model's parameters (a float32 Whisper takes float32 features)."""
    import torch

    if np.asarray(src).dtype.kind != "f":
        return torch_ids(src)
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    return torch.from_numpy(np.ascontiguousarray(src)).to(torch.float32 if first is None else first.dtype)


def _run_torch(model, run, src_ids, tgt_ids, recorder: _Recorder):
    import torch

    modules: dict[str, Any] = dict(model.named_modules(remove_duplicate=False))
    missing = {path for path in recorder.by_path if path not in modules}
    handles = []
    for path in recorder.by_path:
        if path in modules:
            def hook(module, args, kwargs, output, path=path):
                recorder.record(path, args, kwargs, output, module)
            handles.append(modules[path].register_forward_hook(hook, with_kwargs=True))
    # No graph is kept, except where PyTorch's fused inference path would run: nn.Transformer's
    # layers take it under no_grad and skip the submodules whose hooks read the tensors.
    fused = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer, torch.nn.MultiheadAttention)
    grad_mode = torch.enable_grad() if any(isinstance(m, fused) for m in modules.values()) else torch.no_grad()
    try:
        with grad_mode:
            logits = output_logits(run(model, torch_source(model, src_ids), torch_ids(tgt_ids)))
    finally:
        for handle in handles:
            handle.remove()
    return logits, missing


def linen_path(module) -> str:
    return ".".join(str(p) for p in module.path)


def _run_linen(model, run, src_ids, tgt_ids, recorder: _Recorder):
    import jax.numpy as jnp
    from flax import linen as nn

    module, variables = linen_parts(model)

    def interceptor(next_fun, args, kwargs, context):
        output = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            path = linen_path(context.module)
            if path in recorder.by_path:
                recorder.record(path, args, kwargs, output, context.module)
        return output

    with _x64_for(variables), nn.intercept_methods(interceptor):
        logits = output_logits(run(module.bind(variables), jnp.asarray(src_ids), jnp.asarray(tgt_ids)))
        logits = np.asarray(logits)
    # linen makes its submodules as it runs: one that never ran and one that does not exist are
    # the same to it, and both read "did not run".
    return logits, set()


def _x64_for(tree) -> contextlib.AbstractContextManager:
    """64-bit JAX for the run when the model's parameters are float64 (else JAX would cast them)."""
    import jax

    if any(getattr(leaf, "dtype", None) == np.float64 for leaf in jax.tree_util.tree_leaves(tree)):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def nnx_modules(model) -> dict[str, Any]:
    return {".".join(str(p) for p in path): module for path, module in model.iter_modules()}


def _run_nnx(model, run, src_ids, tgt_ids, recorder: _Recorder):
    import jax.numpy as jnp
    from flax import nnx

    modules = nnx_modules(model)
    missing = {path for path in recorder.by_path if path not in modules}
    wanted = {id(modules[path]): path for path in recorder.by_path if path in modules}
    originals = {}
    for path in recorder.by_path:
        if path in modules:
            cls = type(modules[path])
            if cls not in originals:
                originals[cls] = cls.__call__

    def wrap(cls, original):
        def call(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            if id(self) in wanted:
                recorder.record(wanted[id(self)], args, kwargs, output, self)
            return output
        return call

    try:
        for cls, original in originals.items():
            cls.__call__ = wrap(cls, original)
        with _x64_for(nnx.state(model, nnx.Param)):
            logits = np.asarray(output_logits(run(model, jnp.asarray(src_ids), jnp.asarray(tgt_ids))))
    finally:
        for cls, original in originals.items():
            cls.__call__ = original
    return logits, missing


# -- The model's parameters as a flat foreign state dict, and their gradients -------------------


def foreign_state(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under its own keys: torch `state_dict()`, linen `params` flattened
    with ".", nnx `Param`s flattened with "."."""
    kind = framework(model)
    if kind == "torch":
        return {k: to_numpy_exact(v) for k, v in model.state_dict().items()}
    if kind == "linen":
        return _flatten(linen_parts(model)[1]["params"])
    from flax import nnx

    return _flatten(nnx.state(model, nnx.Param).to_pure_dict())


def to_numpy_exact(x: Any) -> np.ndarray:
    """A tensor as a NumPy array in its own dtype (bfloat16 as float32)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy().copy()
    return np.array(x)


def _flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) or (hasattr(value, "items") and not hasattr(value, "shape")):
            out.update(_flatten(dict(value.items()), name + "."))
        else:
            out[name] = np.array(value)
    return out


class LogitsShapeError(InputError):
    """The run's logits do not fit the loss's (B, T) labels: a divergence at the logits (the
    model computes another shape than ours), found before the cross-entropy would fail on it."""


def _check_logits(shape: tuple[int, ...], labels_shape: tuple[int, ...]) -> None:
    if tuple(shape[:-1]) != tuple(labels_shape):
        raise LogitsShapeError("logits", f"{tuple(shape)} from your model, and the loss needs (B, T, V) for the "
                                         f"{tuple(labels_shape)} labels: a shape mismatch at the logits")


def foreign_loss_and_grads(model: Any, run: Callable, src_ids, tgt_ids, labels, *, pad_id: int,
                           label_smoothing: float) -> tuple[float, dict[str, np.ndarray]]:
    """The loss of docs/training.md (token cross-entropy with label smoothing, labels equal to
    pad_id ignored, averaged over the rest) on the model's own logits, and its gradient for every
    parameter by the model's own autograd (torch) or `jax.grad` (Flax), under the model's keys.

    Logits whose leading axes are not the labels' are a LogitsShapeError, before the loss."""
    labels = np.asarray(labels)
    kind = framework(model)
    if kind == "torch":
        import torch
        import torch.nn.functional as F

        params = dict(model.named_parameters())
        for p in params.values():
            p.grad = None
        with torch.enable_grad():
            logits = output_logits(run(model, torch_ids(src_ids), torch_ids(tgt_ids)))
            _check_logits(tuple(logits.shape), labels.shape)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch_ids(labels).reshape(-1),
                                   ignore_index=pad_id, label_smoothing=label_smoothing)
            loss.backward()
        grads = {name: to_numpy_exact(p.grad) for name, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None
        return float(loss.detach()), grads
    import jax
    import jax.numpy as jnp

    def cross_entropy(logits):
        _check_logits(tuple(logits.shape), labels.shape)  # static under jit: checked while tracing
        logp = jax.nn.log_softmax(logits, axis=-1)
        target = jnp.asarray(labels)
        nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        smooth = -logp.mean(axis=-1)
        per_token = (1.0 - label_smoothing) * nll + label_smoothing * smooth
        counted = target != pad_id
        return jnp.where(counted, per_token, 0.0).sum() / counted.sum()

    src, tgt = jnp.asarray(src_ids), jnp.asarray(tgt_ids)
    if kind == "linen":
        module, variables = linen_parts(model)

        def loss_fn(params):
            return cross_entropy(output_logits(run(module.bind({**variables, "params": params}), src, tgt)))

        with _x64_for(variables["params"]):
            # One compiled program: op by op, a linen model's first backward pass dispatches and
            # compiles every primitive on its own (flax-wmt here: 27 s, compiled 13 s, measured).
            loss, grads = jax.jit(jax.value_and_grad(loss_fn))(variables["params"])
            return float(loss), _flatten(jax.tree_util.tree_map(np.asarray, grads))
    from flax import nnx

    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def nnx_loss(params):
        return cross_entropy(output_logits(run(nnx.merge(graph, params, rest), src, tgt)))

    with _x64_for(params):
        loss, grads = jax.jit(jax.value_and_grad(nnx_loss))(params)  # compiled, as for linen
        return float(loss), _flatten(grads.to_pure_dict())
