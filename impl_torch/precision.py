"""Matmul precision: full float32 (TF32 off) whenever results are compared, and a report of it.

On Ampere and later GPUs, PyTorch may run float32 matmuls on TF32 tensor cores, which read only
10 bits of mantissa: errors near 1e-3, far outside the float32 tolerance. The conformance suite
therefore runs every torch computation inside `full_precision()` and prints
`precision_settings()` in its header.

PyTorch has two APIs for the same switches. The legacy one (`torch.backends.cuda.matmul.
allow_tf32`, `torch.backends.cudnn.allow_tf32`, `torch.set_float32_matmul_precision`) is what
this module uses. The newer per-backend `fp32_precision` properties (PyTorch >= 2.9) refuse to be
mixed with it: once a program has set them, reading a legacy flag raises RuntimeError. In that
case `full_precision` switches the new properties to "ieee" instead, and restores them after.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from conformance.core.errors import InputError

# (backend, op) pairs of the new API that can lower float32 matmul/conv precision.
_NEW_API = (("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))


def _new_api() -> list[tuple[str, str]]:
    """The pairs this torch has (none before 2.9)."""
    return [(b, o) for b, o in _NEW_API if hasattr(getattr(getattr(torch.backends, b, None), o, None), "fp32_precision")]


def _new_get(backend: str, op: str) -> str:
    return getattr(getattr(torch.backends, backend), op).fp32_precision


def _new_set(backend: str, op: str, value: str) -> None:
    getattr(getattr(torch.backends, backend), op).fp32_precision = value


def _legacy_state() -> tuple[bool, bool, str]:
    """The three legacy settings; RuntimeError if the program already drives the new API."""
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


def _set_legacy(state: tuple[bool, bool, str]) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = state[0], state[1]
    torch.set_float32_matmul_precision(state[2])


def _reduced_reductions() -> tuple[bool, bool]:
    """Whether float16 / bfloat16 GEMMs on CUDA may accumulate in reduced precision."""
    matmul = torch.backends.cuda.matmul
    return matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction


def _set_reduced_reductions(state: tuple[bool, bool]) -> None:
    matmul = torch.backends.cuda.matmul
    matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = state


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Full-precision matmuls for the duration, then the previous settings back.

    Sets `torch.backends.cuda.matmul.allow_tf32 = False`, `torch.backends.cudnn.allow_tf32 =
    False` and `torch.set_float32_matmul_precision("highest")`, and makes float16/bfloat16 GEMMs
    accumulate in float32 (`allow_fp16/bf16_reduced_precision_reduction = False`). These are
    process-wide switches: do not enter it from several threads with different intentions.
    """
    reductions = _reduced_reductions()
    # The new API's per-op values are saved too: setting the legacy flags rewrites them (from
    # "none" to "ieee", say), and restoring them makes the state after exactly the state before.
    new = {pair: _new_get(*pair) for pair in _new_api()}
    try:
        legacy = _legacy_state()
    except RuntimeError:  # the program drives the new API: do the same
        legacy = None
    try:
        _set_reduced_reductions((False, False))
        if legacy is not None:
            _set_legacy((False, False, "highest"))
        else:
            for pair in new:
                _new_set(*pair, "ieee")
        yield
    finally:
        _set_reduced_reductions(reductions)
        if legacy is not None:
            _set_legacy(legacy)
        for pair, value in new.items():
            _new_set(*pair, value)


def precision_settings() -> dict[str, Any]:
    """Every switch that decides torch's matmul precision, by name, for reports and headers."""
    report: dict[str, Any] = {}
    try:
        allow_tf32, cudnn_tf32, precision = _legacy_state()
        report["float32_matmul_precision"] = precision
        report["cuda.matmul.allow_tf32"] = allow_tf32
        report["cudnn.allow_tf32"] = cudnn_tf32
    except RuntimeError:
        report["legacy flags"] = "unreadable (the program set the fp32_precision API)"
    fp16, bf16 = _reduced_reductions()
    report["cuda.matmul.allow_fp16_reduced_precision_reduction"] = fp16
    report["cuda.matmul.allow_bf16_reduced_precision_reduction"] = bf16
    for backend, op in _new_api():
        report[f"{backend}.{op}.fp32_precision"] = _new_get(backend, op)
    report["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "not available"
    return report


def check_no_autocast(device: torch.device) -> None:
    """Refuse a call under `torch.autocast` for the model's device type, with an `InputError`.

    Autocast recomputes chosen operations (matmuls, linear layers) in its lower dtype whatever the
    tensors' dtype, so the model would silently compute in a precision that neither its `dtype` nor
    the conformance tolerances describe: on a CPU, a float32 model's logits came back float32 and
    0.04 away from its own; elsewhere the output changed dtype. The model's precision is its
    `dtype` (and `param_dtype` for mixed precision: `dtype=bfloat16, param_dtype=float32` is what
    autocast's bfloat16 training is measured against, docs/training.md)."""
    if torch.is_autocast_enabled(device.type):
        lower = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
        raise InputError("torch.autocast", f"is on for {device.type} ({lower}): it would recompute the model's "
                                           "products in that dtype, which the model's dtype does not describe; "
                                           f"leave autocast off and give the model dtype={lower}, "
                                           "param_dtype=float32 for mixed precision")
