"""`rosetta check [CHECKPOINT] --mesh data=D,model=M`: a checkpoint (default: the built-in default
model) run sharded, every plan asked for, beside the float64 oracle (issue 46; docs/sharding.md).

    exit_code = run_mesh_check("data=2,model=2", devices="cpu", checkpoint="model.safetensors")

For each backend that shards (torch, jax) and device kind asked for: one child process runs every
plan on the mesh (`conformance.check.scale.sharded`: forced host devices for JAX on the CPU, gloo ranks
for torch on the CPU, NCCL ranks on CUDA, JAX's GPUs), and the report gives, per plan, either the
largest error over every compared tensor or the first tensor, loss, gradient or stepped parameter
that diverges. The batch is `report.fixed_batch`'s three rows, repeated to a multiple of "data",
with next-token labels and label smoothing 0.1.

Exit status: 0 when every plan asked for ran and passed, and one of them split something (the
batch over data > 1, or heads and columns over model > 1 under a "tp" plan); 1 when one diverged,
a child failed, nothing split was checked, or a plan asked for was not run. A plan the mesh cannot
place for this model (a size that does not divide) is reported as refused, with the backend's
reason, counted apart ("K refused (not checked)"): asked for and not checked, it makes the exit
status 1, as a check that checked nothing does (`plans` asks for fewer). The default model's
vocabulary is 13, which no "model" size above 1 divides: JAX's "tp" and "fsdp+tp" (which split the
embedding's vocabulary axis) are refused on every such mesh; a checkpoint whose sizes divide checks
them, and so does the sharded property (`rosetta conformance --mesh`) on drawn configs.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from conformance.check.scale.sharded import (Job, compared, describe, first_divergence, mesh_label, oracle, parse_mesh,
                                      repeated_rows, sharded_runs, table_error)
from conformance.core.sharding import PLANS, splits

SHARDING_BACKENDS = ("torch", "jax")


def default_job(data: int) -> Job:
    """The default model, and `fixed_batch`'s rows repeated (cyclically) to a multiple of `data`,
    labelled with the next token (the last position: the first real id), pads kept."""
    from conformance.check.defaults import default_model
    from conformance.check.report import fixed_batch

    config, params, source = default_model()
    return job_for(config, params, data, source)


def checkpoint_job(path: str, data: int) -> Job:
    """`default_job`'s batch and labels for a checkpoint's model, its parameters widened to float64
    (exact) for the float64 runs."""
    from conformance.core import checkpoint

    config, params = checkpoint.load(path)
    return job_for(config, {k: np.asarray(v, np.float64) for k, v in params.items()}, data, str(path))


def job_for(config, params, data: int, source: str) -> Job:
    """`fixed_batch`'s rows repeated (cyclically) to a multiple of `data`, labelled with the next
    token (the last position: the first real id), pads kept."""
    from conformance.check.report import fixed_batch

    src, tgt = fixed_batch(config)
    rows = repeated_rows(len(src), data)
    src, tgt = src[rows], tgt[rows]
    pad = config.pad_id
    labels = np.concatenate([tgt[:, 1:], np.full((len(tgt), 1), 1 if pad != 1 else 2)], axis=1)
    labels = np.where((tgt == pad) | (labels == pad), pad, labels)
    return Job(config, params, src, tgt, labels, 0.1, source)


def run_mesh_check(mesh_spec: str, devices: str | None = None, backend_names: str | None = None, *,
                   checkpoint: str | None = None, plans=PLANS, out: Callable[[str], None] = print,
                   _plant=None) -> int:
    """Check every plan in `plans` of the model in `checkpoint` (default: the built-in default
    model) on the mesh `mesh_spec` ("data=D,model=M") for each sharding backend (`backend_names`,
    as --backends; default torch and jax) and device kind (`devices`, as --devices: cpu, cuda,
    gpu; default every one present); print a line per plan with `out`; return the exit status
    (module docstring). `plans` and the test seam `_plant`: as `sharded_runs`."""
    from conformance.check import backends
    from conformance.core.errors import InputError

    mesh = parse_mesh(mesh_spec)
    try:
        asked = backends.requested_devices(devices)
        names = [n for n in backends.requested_backends(backend_names) if n in SHARDING_BACKENDS]
    except ValueError as exc:
        raise InputError("--devices" if "device" in str(exc) else "--backends", str(exc)) from None
    unknown = [plan for plan in plans if plan not in PLANS]
    if unknown or not plans:
        raise InputError("--plans", f"unknown plan {unknown[0]!r}; expected some of {', '.join(PLANS)}" if unknown
                         else f"names no plan; expected some of {', '.join(PLANS)}")
    job = default_job(mesh[0]) if checkpoint is None else checkpoint_job(checkpoint, mesh[0])
    expected = oracle(job)
    out(f"rosetta check --mesh {mesh_label(mesh)}: {job.source}, {job.config.summary()}; "
        f"batch {job.src_ids.shape[0]} rows, float64, against the float64 NumPy oracle")
    checked, failed, refused, split = 0, 0, 0, 0
    for name in names:
        reason = backends.availability([name])[name]
        if reason:
            out(f"  {name}: skipped ({reason})")
            continue
        for device in backends.device_kinds(name):
            why = backends.device_skip_reason(name, device, devices)
            if why == backends.DESELECTED or (asked is None and why):  # not asked for, or absent and not asked for
                continue
            if why:
                out(f"  {name}/{device}: skipped ({why})")
                continue
            try:
                records = sharded_runs(name, device, mesh, [job], plans, _plant=_plant)[0]
            except RuntimeError as exc:
                failed += 1
                out(f"  {name}/{device}: FAILED to run: {exc}")
                continue
            for plan in plans:
                verdict, ok = _verdict(records[plan], job, device, expected)
                checked += ok is not None
                failed += ok is False
                refused += ok is None
                split += ok is True and splits(plan, mesh)
                out(f"  {name}/{device} {plan:<8} {verdict}")
    not_checked = f"; {refused} refused (not checked)" if refused else ""
    if not checked and not failed:
        out(f"nothing was checked: no sharding backend and device asked for could run{not_checked} (exit 1)")
        return 1
    out((f"{checked - failed} of {checked} plan runs equal the oracle" if not failed else f"{failed} failed")
        + not_checked)
    if failed:
        return 1
    if refused:
        out(f"{refused} plan run{'s' if refused > 1 else ''} asked for could not run on {mesh_label(mesh)} for this "
            "model (refused above): not checked (exit 1); choose the plans with --plans, or a mesh whose sizes "
            "divide the model's")
    if not split:
        out(f"nothing split was checked: on {mesh_label(mesh)} every plan that ran kept the batch and the "
            "parameters whole (exit 1)")
    return 1 if refused or not split else 0


def _verdict(record: dict, job: Job, device: str, expected: dict) -> tuple[str, bool | None]:
    """(the plan's line, True passed / False diverged / None refused)."""
    if "refused" in record:
        return f"refused: {record['refused']}", None
    rows = compared(record, job, device, expected)
    first = first_divergence(rows)
    if first is not None:
        return (f"FAILED: first diverges in {describe(first.name)} ({first.name!r}): {first.comparison.describe()} "
                f"[tolerance atol={first.tolerance.atol:g}]"), False
    error, worst = max((table_error(row.comparison.max_abs, row.comparison.scale), row.name) for row in rows)
    return f"ok: {len(rows)} tensors within the table; largest error {error:.1e} ({worst})", True
