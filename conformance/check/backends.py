"""Which backends and devices are here, and one way to build a model on any of them.

Backends are imported lazily, only when asked for: the conformance package itself never imports
PyTorch or JAX. `ROSETTA_BACKENDS=numpy,torch` (or `--backends`) restricts the set;
`ROSETTA_DEVICES=cpu` (or `--devices`) restricts devices, the CPU included. A backend that is
asked for but not importable, and a device that is deselected or absent, are reported with the
reason (`device_skip_reason`), never silently dropped.

A user's own model joins as an adapter (`conformance.check.targets.adapter`, docs/own-backend.md):
`--backends numpy,my_pkg.adapter:build` or the name of an installed `rosetta.backends` entry point.
It is a target of kind `ADAPTER`, on the CPU, in the dtypes its factory declares.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

# The targets asked for by name only (OPTIONAL_BACKENDS), and those checked in a section of their
# own: one registry, conformance.check.targets.
from conformance.check.targets import SECTION_TARGETS, TARGETS as OPTIONAL_BACKENDS

BACKENDS = ("numpy", "torch", "jax")
ADAPTER = "adapter"  # the kind of a user's own backend, given by an adapter

# Extra backends registered at run time (name -> (module, the built-in backend it behaves like)),
# e.g. the deliberately broken copies the meta-tests use to prove the suite catches bugs.
_EXTRA: dict[str, tuple[Any, str]] = {}


def register_backend(name: str, module: Any, like: str) -> None:
    """Make `module` (with the API of backend `like`) available as backend `name`."""
    if like not in BACKENDS:
        raise ValueError(f"unknown backend {like!r} to behave like; expected one of {list(BACKENDS)}")
    _EXTRA[name] = (module, like)


def unregister_backend(name: str) -> None:
    _EXTRA.pop(name, None)


def register_adapter(name: str):
    """Load the adapter `name` (MODULE:FACTORY or an installed entry point's name) and make it
    backend `name`, once per process; `adapter.AdapterError` (a ValueError) says why it cannot be."""
    if name not in _EXTRA:
        from conformance.check.targets import adapter

        _EXTRA[name] = (adapter.Adapter(name, adapter.load_factory(name)).backend(), ADAPTER)
    return _EXTRA[name][0]


def is_adapter(name: str) -> bool:
    return kind(name) == ADAPTER


def refuse_adapters(names: list[str], argument: str) -> None:
    """InputError when an adapter is among `names`: `check` and `compare` call a backend's model
    with rosetta's own keywords (a tensor sink, explicit masks) beyond the adapter protocol, which
    the conformance suite holds an adapter to."""
    adapters = [name for name in names if is_adapter(name)]
    if adapters:
        from conformance.core.errors import InputError

        raise InputError(argument, f"{', '.join(adapters)} is an adapter (your own backend): adapters run under "
                         f"rosetta conformance --backends {','.join(adapters)} (docs/own-backend.md), not here")


def adapter_of(name: str):
    """The `conformance.check.targets.adapter.Adapter` behind backend `name` (an adapter's)."""
    return import_backend(name).adapter


def kind(name: str) -> str:
    """The built-in backend whose API `name` has (itself, for a built-in)."""
    if name in _EXTRA:
        return _EXTRA[name][1]
    return OPTIONAL_BACKENDS[name][1] if name in OPTIONAL_BACKENDS else name


# Backends that compile every new (config, shape): the suite bounds what they run under `ci`.
# `onnxruntime` exports a pair of graphs per new model (about 15 s for a tiny one): bounded alike.
COMPILING_KINDS = frozenset({"jax"})
COMPILING_NAMES = frozenset({"torch-compiled", "onnxruntime"})


def compiles(name: str) -> bool:
    """Whether backend `name` (or the built-in it copies) compiles per (config, shape)."""
    return kind(name) in COMPILING_KINDS or name in COMPILING_NAMES


@dataclass(frozen=True)
class Target:
    """One place a model can run: a backend, a device kind and a dtype."""

    backend: str
    device: str  # "cpu", "cuda" (torch), "gpu" (jax)
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.device}/{self.dtype}"


def import_backend(name: str):
    """The backend's package (`impl_numpy`, `impl_torch`, `impl_jax`); ImportError if missing."""
    if name in _EXTRA:
        return _EXTRA[name][0]
    if name in OPTIONAL_BACKENDS:
        return importlib.import_module(OPTIONAL_BACKENDS[name][0])
    if name not in BACKENDS:
        return register_adapter(name)
    return importlib.import_module(f"impl_{name}")


def known_backends() -> list[str]:
    """Every name `--backends` accepts by itself: the three backends (the default set), the optional
    targets and the installed adapters (`rosetta.backends` entry points); a MODULE:FACTORY also."""
    from conformance.check.targets.adapter import installed

    return [*BACKENDS, *OPTIONAL_BACKENDS, *sorted(set(installed()) - set(BACKENDS) - set(OPTIONAL_BACKENDS))]


def requested_backends(option: str | None = None) -> list[str]:
    text = option or os.environ.get("ROSETTA_BACKENDS", "")
    names = [n.strip() for n in text.split(",") if n.strip()] or list(BACKENDS)
    for name in names:
        if name in BACKENDS or name in OPTIONAL_BACKENDS or name in _EXTRA:
            continue
        if name in SECTION_TARGETS:
            raise ValueError(f"{name} (in ROSETTA_BACKENDS/--backends) is no backend here: {SECTION_TARGETS[name]}")
        from conformance.check.targets.adapter import AdapterError, looks_like_adapter

        try:
            register_adapter(name)
        except AdapterError as exc:
            if looks_like_adapter(name):
                raise ValueError(f"{exc} (in ROSETTA_BACKENDS/--backends)") from None
            raise ValueError(f"unknown backend {name!r} in ROSETTA_BACKENDS/--backends; expected {known_backends()} "
                             f"or MODULE:FACTORY, an adapter (docs/own-backend.md)") from None
    return names


def availability(names: list[str] | None = None) -> dict[str, str | None]:
    """backend -> None if importable, else the reason it is not."""
    result: dict[str, str | None] = {}
    for name in names or requested_backends():
        try:
            import_backend(name)
            result[name] = None
        except ImportError as exc:
            result[name] = f"not importable: {exc}"
    return result


# The device kinds each built-in backend can run on; "cuda" is torch's accelerator, "gpu" JAX's.
DEVICE_KINDS = {"numpy": ("cpu",), "torch": ("cpu", "cuda"), "jax": ("cpu", "gpu"), ADAPTER: ("cpu",)}
DESELECTED = "deselected by --devices/ROSETTA_DEVICES"


def device_kinds(backend: str) -> tuple[str, ...]:
    """Every device kind `backend` could run on, present or not."""
    return DEVICE_KINDS[kind(backend)]


def requested_devices(option: str | None = None) -> list[str] | None:
    """The device kinds asked for (`--devices` or $ROSETTA_DEVICES), or None for all of them."""
    text = option if option is not None else os.environ.get("ROSETTA_DEVICES", "")
    names = [d.strip() for d in text.split(",") if d.strip()]
    known = sorted({d for kinds in DEVICE_KINDS.values() for d in kinds})
    for name in names:
        if name not in known:
            raise ValueError(f"unknown device {name!r} in ROSETTA_DEVICES/--devices; expected some of {known}")
    return names or None


def present_devices(backend: str) -> list[str]:
    """The device kinds this machine has for a backend: "cpu", plus "cuda"/"gpu" when present."""
    found = ["cpu"]
    if kind(backend) == "torch":
        import torch

        if torch.cuda.is_available():
            found.append("cuda")
    elif kind(backend) == "jax":
        import jax

        try:
            if jax.devices("gpu"):
                found.append("gpu")
        except RuntimeError:
            pass
    return found


def device_skip_reason(backend: str, device: str, requested: str | None = None) -> str | None:
    """Why `backend` does not run on `device`, or None when it does.

    The one place that decides which devices run, the CPU included: a device left out of
    `requested` (default: $ROSETTA_DEVICES) is deselected, whether present or not; a device that
    is selected but absent is reported as absent.
    """
    wanted = requested_devices(requested)
    if wanted is not None and device not in wanted:
        return DESELECTED
    if device not in present_devices(backend):
        return accelerator_skip_reason(backend)
    return None


def devices(backend: str, requested: str | None = None) -> list[str]:
    """The device kinds `backend` runs on: present and selected."""
    return [d for d in device_kinds(backend) if device_skip_reason(backend, d, requested) is None]


def accelerator_skip_reason(backend: str) -> str:
    return {
        "torch": "no CUDA device: torch.cuda.is_available() is False",
        "jax": "no JAX GPU device: jax.devices('gpu') found none",
    }.get(kind(backend), f"the {backend} backend runs on the CPU only")


def dtypes(backend: str, device: str | None = None) -> list[str]:
    """The dtypes a backend supports (its own `SUPPORTED_DTYPES`, read, never repeated here)."""
    return list(import_backend(backend).SUPPORTED_DTYPES)


def build(target: Target, config, params, param_dtype: str | None = None) -> Any:
    """A model of `target.backend` on `target.device` in `target.dtype`, its parameters stored in
    `param_dtype` (default: `target.dtype`): one call, the same for every backend
    (`Model(config, params, dtype, *, device, param_dtype)` is the shared surface)."""
    return import_backend(target.backend).Model(config, params, target.dtype, device=target.device,
                                                param_dtype=param_dtype)


@contextlib.contextmanager
def full_precision(backend: str) -> Iterator[None]:
    """Full-float32 matmuls (TF32 off) for the duration, where the backend has such a switch."""
    with import_backend(backend).full_precision():
        yield


@contextlib.contextmanager
def dtype_scope(target: Target) -> Iterator[None]:
    """What a dtype needs to run: JAX float64 needs x64, enabled only for this scope."""
    if kind(target.backend) == "jax" and target.dtype == "float64":
        with import_backend(target.backend).enable_x64():
            yield
    else:
        yield


@contextlib.contextmanager
def forward_only(backend: str) -> Iterator[None]:
    """No autograd record for the duration: a torch model's parameters require gradients, so a
    forward pass outside `torch.inference_mode` keeps every activation for a backward pass that a
    check never takes (1.5 GB more for a base-size model at length 512). The NumPy model keeps
    what its backward pass reads only on a tape that `loss_and_grads` passes, never in a call, and
    JAX keeps nothing outside a traced gradient: nothing to switch off for them."""
    if kind(backend) == "torch":
        import torch

        with torch.inference_mode():
            yield
    else:
        yield


def release(backend: str) -> None:
    """Drop what a backend keeps between calls once its model is done with: JAX's compiled
    executables (`clear_cache`) hold on to the buffers of the last run, 0.85 GB for the base model
    at length 512 in float32, which the next model would otherwise find still resident (measured,
    docs/check.md); `rosetta check` drops them when memory is short. A backend without such a cache
    has nothing to drop."""
    clear = getattr(import_backend(backend), "clear_cache", None)
    if clear is not None:
        clear()


def precision_settings(backend: str) -> dict[str, Any]:
    """The backend's matmul-precision settings, for reports and the pytest header."""
    return dict(import_backend(backend).precision_settings())


# Settings that would let a float32 matmul round its inputs (TF32, bfloat16 passes) or a half-precision
# GEMM accumulate below float32: none may be on while a property compares (`precision_problems`).
REDUCED_PRECISION = {"tf32", "high", "medium"}


def precision_problems(settings: dict[str, Any]) -> list[str]:
    """The settings of `backends.precision_settings` that are not full precision: any TF32 or
    reduced-precision-reduction switch on, any float32 matmul precision below "highest"."""
    problems = []
    for name, value in settings.items():
        on = value is True and ("tf32" in name or "reduced_precision" in name)
        reduced = isinstance(value, str) and ("matmul" in name or name.endswith("matmul_precision")) \
            and value.lower() in REDUCED_PRECISION
        if on or reduced:
            problems.append(f"{name}={value!r}")
    return problems


def version(backend: str) -> str:
    if is_adapter(backend):
        return adapter_of(backend).describe()
    if backend in OPTIONAL_BACKENDS and hasattr(import_backend(backend), "version"):
        return import_backend(backend).version()  # a runtime of its own (onnxruntime)
    if backend in OPTIONAL_BACKENDS and kind(backend) == "torch":
        import torch

        return f"torch {torch.__version__}, torch.compile backend {import_backend(backend).compile_backend()}"
    backend = kind(backend)
    if backend == "numpy":
        import numpy

        return f"numpy {numpy.__version__}"
    if backend == "torch":
        import torch

        return f"torch {torch.__version__}"
    import flax
    import jax

    return f"jax {jax.__version__}, flax {flax.__version__}"


def compile_report() -> list[str]:
    """Lines describing compile work of already-imported backends (JAX: compiles and seconds)."""
    import sys

    lines = []
    modules = {name: f"impl_{name}" for name in BACKENDS} | {name: m for name, (m, _) in OPTIONAL_BACKENDS.items()}
    for name, module_name in modules.items():
        module = sys.modules.get(module_name)
        stats = getattr(module, "compile_stats", None) if module else None
        if stats is not None:
            lines.append(f"{name} compiles: " + ", ".join(f"{k}={v}" for k, v in stats().items()))
    return lines


def release_compiled() -> None:
    """Drop the executables that already-imported compiling backends keep (JAX: `clear_cache`)."""
    import sys

    modules = {name: f"impl_{name}" for name in BACKENDS} | {name: m for name, (m, _) in OPTIONAL_BACKENDS.items()}
    for module_name in modules.values():
        clear = getattr(sys.modules.get(f"{module_name}.compiled"), "clear_cache", None)
        if clear is not None:
            clear()
