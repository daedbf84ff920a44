"""The `rosetta check` report: every backend against the float64 NumPy oracle, tensor by tensor.

Rows are tensors in forward order (embeddings, each layer's attention weights and sublayer
outputs, the final outputs, the logits); columns are targets (backend/device/dtype). The first
tensor that exceeds tolerance is named, because that is where a porting bug lives: everything
downstream of it differs too.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from conformance.check import backends
from conformance.check.compare import Comparison, Pieces, compare, on_host
from conformance.check.plan import (ONE_AT_A_TIME, ORACLE_DTYPE, OracleTensors, Plan, params_dtype, plan_batch, releaser,
                                    stored_dtype)
from conformance.core.output import forward_order
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.check.tolerances import tolerance


def fixed_batch(config: ModelConfig, seed: int = 0, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Three rows that exercise padding: none, trailing, and all but one token.

    Source and target are 7 and 6 tokens long (at most `max_len`), or both `length` tokens. A
    features source (Whisper's) gets three rows of log-mel features instead (standard normal, about
    the spread of Whisper's normalised log-mel), 2 x 7 frames (or 2 x `length`) for as many
    encoder positions, which have no padding.
    """
    longest = min(config.max_len, config.source_len)
    if length is not None and not 1 <= length <= longest:
        raise InputError("length", f"must be between 1 and the config's max_len {longest}, got {length}")
    rng = np.random.default_rng(seed)
    src_len, tgt_len = (length, length) if length is not None else (min(7, config.source_len), min(6, config.max_len))
    if config.source == "features":
        features = rng.standard_normal((3, config.n_mels, 2 * src_len))  # (B, n_mels, frames)
        tgt = ids_of(rng, config, config.tgt_vocab_size, tgt_len)
        return features, tgt
    return ids_of(rng, config, config.src_vocab_size, src_len), ids_of(rng, config, config.tgt_vocab_size, tgt_len)


def window_batch(config: ModelConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`fixed_batch`, with a features source's rows a whole window: 2 x max_source_len frames of
    standard-normal features, the only length openai-whisper's and transformers' encoders (and the
    graphs optimum exports from them) take. What a check of another system's copy of a model feeds it."""
    src, tgt = fixed_batch(config, seed)
    if config.source == "features":
        src = np.random.default_rng(seed).standard_normal((3, config.n_mels, 2 * config.source_len))
    return src, tgt


def ids_of(rng: np.random.Generator, config: ModelConfig, vocab: int, length: int) -> np.ndarray:
    """(3, length) ids that are not pad_id, the second row padded from length - 2, the third from 1."""
    choices = np.array([i for i in range(vocab) if i != config.pad_id])
    rows = rng.choice(choices, size=(3, length))
    rows[1, max(1, length - 2):] = config.pad_id
    rows[2, 1:] = config.pad_id
    return rows


# A passing cell with a relative error this large (1%) is footnoted: it looks like a bug and is not.
REL_NOTE = 1e-2


@dataclass
class Cell:
    comparison: Comparison | None = None
    error: str | None = None
    # Not compared, and why: a tensor a foreign model does not expose (conformance.compare). Such
    # a cell fails nothing and is shown as "not exposed", never as agreement.
    unavailable: str | None = None
    # A float64 comparison out of float64's tolerance whose error sits at float32 rounding, where
    # the foreign system's layout declares a float32 island (conformance.compare): its name. Such
    # a cell is expected, not a divergence.
    island: str | None = None

    @property
    def passed(self) -> bool:
        if self.unavailable is not None or self.island is not None:
            return True
        return self.error is None and self.comparison is not None and self.comparison.passed


@dataclass
class Report:
    config: ModelConfig
    source: str
    targets: list[backends.Target]
    tensors: list[str]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)  # (tensor, label) -> Cell
    skipped: dict[str, str] = field(default_factory=dict)  # label or backend -> reason
    errors: dict[str, str] = field(default_factory=dict)  # label -> error that stopped the run
    seconds: dict[str, float] = field(default_factory=dict)
    precision: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    # How the tensors were computed when not by one whole call per model (`--stream`: stream.FEED_NOTES).
    note: str = ""

    @property
    def checked(self) -> bool:
        """Whether anything ran: with every target deselected, absent or skipped, nothing did."""
        return bool(self.targets)

    @property
    def passed(self) -> bool:
        # all() of no cells is True: a run that compared nothing must not pass.
        return self.checked and not self.errors and all(cell.passed for cell in self.cells.values())

    def first_failure(self, target: backends.Target | None = None) -> tuple[str, str] | None:
        """(tensor, label) of the earliest failing tensor in forward order (for one target or any)."""
        labels = [target.label] if target else [t.label for t in self.targets]
        for tensor in self.tensors:
            for label in labels:
                cell = self.cells.get((tensor, label))
                if cell is not None and not cell.passed:
                    return tensor, label
        return None

    # Rendering ----------------------------------------------------------------------------------

    def to_text(self) -> str:
        labels = [t.label for t in self.targets]
        width = max(len(n) for n in self.tensors + ["tensor"])
        col = max(25, *(len(label) for label in labels)) if labels else 25
        lines = [
            f"rosetta check: {self.source}",
            f"config: {self.config.summary()}",
            "oracle: numpy/cpu/float64; each cell: max abs error, max rel error (where both are finite), "
            "verdict (FAIL:NaN: NaN where the oracle has none, or the reverse)",
            "verdict: ok when every |error| <= atol * scale, scale = max(1, max |oracle| of the tensor); the rel "
            "error does not decide it",
        ]
        if self.note:
            lines.append(f"run: {self.note}")
        lines.append("")
        if self.checked:  # with no target, a table of empty columns would only suggest agreement
            lines.append("tensor".ljust(width) + "  " + "  ".join(label.ljust(col) for label in labels))
            lines += [self._row(tensor, labels, width, col) for tensor in self.tensors]
            if any(self._near_zero(self.cells.get((tensor, label)), label) for tensor in self.tensors for label in labels):
                lines.append(f"ok*: passes with a max rel error >= {REL_NOTE:g}: it passes, so that element's |error| <= "
                             f"atol * scale, and its oracle value is near 0\n     (|oracle| <= {1 / REL_NOTE:g} * atol * "
                             "scale: an attention weight of ~0, a residual crossing 0), where any rounding is a large "
                             "fraction of the value")
            lines.append("")
        for target in self.targets:
            tol = tolerance(target.dtype, target.device)
            where = self.first_failure(target)
            if target.label in self.errors:
                status = f"ERROR: {self.errors[target.label]}"
            elif where:
                cell = self.cells[where]
                detail = cell.error or cell.comparison.describe()
                status = f"FAIL, first diverging tensor: {where[0]} ({detail})"
            else:
                status = "pass"
            lines.append(f"{target.label:<24} tol atol={tol.atol:g} rtol={tol.rtol:g}  {status}")
        for name, reason in self.skipped.items():
            lines.append(f"{name:<24} skipped: {reason}")
        first = self.first_failure()
        lines.append("")
        if not self.checked:
            lines.append("result: FAIL, nothing was checked: no backend, device and dtype asked for can run here "
                         "(see skipped above)")
        elif self.errors and not first:
            lines.append("result: FAIL (a backend could not run)")
        elif first:
            lines.append(f"result: FAIL; first diverging tensor: {first[0]} on {first[1]}")
        else:
            lines.append("result: every backend agrees with the oracle within tolerance")
        return "\n".join(lines)

    def _row(self, tensor: str, labels: list[str], width: int, col: int) -> str:
        row = []
        for label in labels:
            cell = self.cells.get((tensor, label))
            if label in self.errors:
                text = "ERROR"
            elif cell is None:
                text = "-"
            elif cell.unavailable is not None:
                text = "not exposed"
            elif cell.error:
                text = "ERROR"
            elif cell.island is not None:
                text = f"{cell.comparison.max_abs:8.1e} {cell.comparison.max_rel:8.1e} island"
            else:
                c = cell.comparison
                verdict = "FAIL:NaN" if c.nan_mismatches else "FAIL"
                if c.passed:
                    verdict = "ok*" if self._near_zero(cell, label) else "ok"
                text = f"{c.max_abs:8.1e} {c.max_rel:8.1e} {verdict}"
            row.append(text.ljust(col))
        return tensor.ljust(width) + "  " + "  ".join(row)

    def _near_zero(self, cell: Cell | None, label: str) -> bool:
        """A passing cell whose relative error alone would look like a failure (footnoted "ok*")."""
        if cell is None or cell.error or cell.comparison is None or not cell.comparison.passed:
            return False
        return cell.comparison.max_rel >= REL_NOTE

    def to_json(self) -> dict[str, Any]:
        first = self.first_failure()
        return ({"note": self.note} if self.note else {}) | {
            "source": self.source,
            "config": json.loads(self.config.to_json()),
            "passed": self.passed,
            "checked": self.checked,
            "first_failure": {"tensor": first[0], "target": first[1]} if first else None,
            "targets": [
                {"label": t.label, "backend": t.backend, "device": t.device, "dtype": t.dtype,
                 "atol": tolerance(t.dtype, t.device).atol, "rtol": tolerance(t.dtype, t.device).rtol,
                 "seconds": self.seconds.get(t.label), "error": self.errors.get(t.label)}
                for t in self.targets
            ],
            "skipped": self.skipped,
            "versions": self.versions,
            "precision": self.precision,
            "tensors": [
                {
                    "tensor": tensor,
                    "results": {
                        label: (
                            {"unavailable": cell.unavailable} if cell.unavailable is not None else
                            {"error": cell.error} if cell.error else ({} if cell.island is None else {
                                "island": cell.island}) | {
                                "max_abs": cell.comparison.max_abs,
                                "max_abs_at": cell.comparison.max_abs_at,
                                "max_rel": cell.comparison.max_rel,
                                "max_rel_at": cell.comparison.max_rel_at,
                                "nan_mismatches": cell.comparison.nan_mismatches,
                                "passed": cell.passed,
                            }
                        )
                        for (name, label), cell in self.cells.items() if name == tensor
                    },
                }
                for tensor in self.tensors
            ],
        }


def default_targets(names: list[str] | None = None, dtypes: list[str] | None = None,
                    devices: str | None = None) -> tuple[list[backends.Target], dict[str, str]]:
    """Every requested, installed backend on every selected, present device, at the requested
    dtypes; what cannot run is in the second result with its reason.

    `devices` is a comma-separated selection (default: $ROSETTA_DEVICES, else every device);
    `backends.device_skip_reason` decides, as it does for the conformance suite.
    """
    targets, skipped = [], {}
    for backend, reason in backends.availability(names).items():
        if reason:
            skipped[backend] = reason
            continue
        for device in backends.device_kinds(backend):
            why = backends.device_skip_reason(backend, device, devices)
            if why:
                skipped[f"{backend}/{device}"] = why
                continue
            for dtype in dtypes or ["float32", "float64"]:
                if backend == "numpy" and dtype == "float64":
                    continue  # that is the oracle itself
                if dtype in backends.dtypes(backend, device):
                    targets.append(backends.Target(backend, device, dtype))
                else:
                    skipped[f"{backend}/{device}/{dtype}"] = f"the {backend} backend does not run {dtype}"
    return targets, skipped


def run_check(config: ModelConfig, params: dict[str, np.ndarray] | Callable[[], dict[str, np.ndarray]], source: str,
              targets: list[backends.Target], skipped: dict[str, str] | None = None,
              src_ids: np.ndarray | None = None, tgt_ids: np.ndarray | None = None,
              plan: Plan | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Run the oracle and every target on the same batch and compare every tensor.
    `progress(message)` hears each model as it starts (a command's status line).

    `plan` says how the oracle's tensors are held (default: `plan_batch` against MemAvailable);
    the report is the same either way. One model is alive at a time, and every model hands each
    tensor over as it computes it (`sink=`): the oracle's to `OracleTensors`, a target's straight
    to its comparison, after which it is freed.

    `params` may be a function that reads them (from the checkpoint): it is then called once per
    model, so that the parameters as read are freed once each model is built, instead of being
    held beside a float64 model's own copy for the whole run.
    """
    import impl_numpy

    if src_ids is None or tgt_ids is None:
        src_ids, tgt_ids = fixed_batch(config)
    read = params if callable(params) else lambda: dict(params)  # a dict of its own to take apart
    if plan is None:
        plan = plan_batch(config, read(), [t.dtype for t in targets], src_ids, tgt_ids)
    report = Report(config=config, source=source, targets=targets, tensors=forward_order(config),
                    skipped=dict(skipped or {}))
    report.versions["numpy"] = backends.version("numpy")
    release = releaser(plan)  # hands freed memory back; a no-op for a small check (plan.RELEASE_ABOVE)
    with OracleTensors(plan.mode) as oracle:
        wanted = set(report.tensors)

        def keep(name: str, value: np.ndarray) -> None:
            if name in wanted:
                oracle.put(name, value)

        # Each tensor goes to `oracle` as it is computed (the sink), and the forward pass keeps no
        # backward caches: at most a layer's working tensors are in memory beside the model.
        progress = progress or (lambda message: None)
        progress(f"oracle (numpy/cpu/{ORACLE_DTYPE})")
        as_read = read()
        oracle_model = impl_numpy.Model(config, as_read, dtype=ORACLE_DTYPE, param_dtype=stored_dtype(
            params_dtype(as_read), ORACLE_DTYPE, impl_numpy.SUPPORTED_DTYPES))
        del as_read
        release()  # the parameters as read, when read again per model
        oracle_model(src_ids, tgt_ids, sink=keep)  # a call keeps no backward values (no tape)
        del oracle_model
        release()
        for number, target in enumerate(targets, 1):
            progress(f"{target.label} ({number} of {len(targets)})")
            _check_target(report, target, config, read, src_ids, tgt_ids, oracle, release)
            if plan.mode == ONE_AT_A_TIME:  # memory is short: nothing of this model may stay behind
                backends.release(target.backend)
            release()
    return report


# Backends whose target runs one batch row per call: JAX's compiled decoder returns all its tensors
# at once (0.99 GB in float64 for the base model at length 512), a third of that per row. Only
# where a row alone gives the same bits as on the batch, so that the report is the same: JAX in
# float32 and float64 does (measured, docs/check.md); torch float64 does not.
ROW_BY_ROW = ("jax",)


def _check_target(report: Report, target: backends.Target, config: ModelConfig, read: Callable[[], dict[str, np.ndarray]],
                  src_ids: np.ndarray, tgt_ids: np.ndarray, oracle: OracleTensors,
                  release: Callable[[], None]) -> None:
    report.versions.setdefault(target.backend, backends.version(target.backend))
    tol = tolerance(target.dtype, target.device)
    comparing = 0.0  # seconds spent comparing, left out of the target's own time

    pieces: dict[str, Pieces] = {}  # tensor -> its comparison so far, one row at a time

    def add_row(compared: Pieces, tensor: str, actual, index: int) -> None:
        """Add batch row `index` of a tensor to its comparison, against the oracle's row read
        piece by piece (`OracleTensors.row_pieces`): the same comparison as on the whole tensor."""
        flat, start = on_host(actual).reshape(-1), 0
        for expected in oracle.row_pieces(tensor, index):
            compared.add(flat[start:start + expected.size], expected)
            start += expected.size

    def record(tensor: str, value, row: int | None = None) -> None:
        """Compare each tensor as the model hands it over (the sink), so that it is freed at once;
        with `row`, the tensor of that batch row alone, added to the tensor's comparison."""
        nonlocal comparing
        if hasattr(value, "block_until_ready"):  # JAX dispatches asynchronously
            value.block_until_ready()
        started = time.perf_counter()
        if tensor not in oracle:  # every tensor of the report, and only those
            pass
        elif row is None and (not oracle.spilled or tuple(value.shape) != oracle.shapes[tensor]):
            report.cells[(tensor, target.label)] = Cell(comparison=compare(value, oracle[tensor], tol))
        elif row is None:  # spilled: the oracle's tensor read back one batch row at a time, the same comparison
            compared = Pieces(oracle.shapes[tensor], oracle.scales[tensor], tol)
            for index in range(value.shape[0]):
                add_row(compared, tensor, value[index:index + 1], index)
            report.cells[(tensor, target.label)] = Cell(comparison=compared.result())
        else:
            expected = (1, *oracle.shapes[tensor][1:])
            if tuple(value.shape) != expected:
                report.cells[(tensor, target.label)] = Cell(comparison=Comparison(passed=False, shape_problem=(
                    f"shape {tuple(value.shape)} of row {row} differs from the oracle's {expected}")))
            elif (tensor, target.label) not in report.cells:
                add_row(pieces.setdefault(tensor, Pieces(oracle.shapes[tensor], oracle.scales[tensor], tol)),
                        tensor, value, row)
        comparing += time.perf_counter() - started

    try:
        started = time.perf_counter()
        with backends.full_precision(target.backend), backends.dtype_scope(target):
            before = report.precision[target.backend] = backends.precision_settings(target.backend)
            if problems := backends.precision_problems(before):  # TF32 would pass float32 cells it should fail
                raise RuntimeError(f"full_precision() left reduced precision on: {', '.join(problems)}")
            as_read = read()
            model = backends.build(target, config, as_read, stored_dtype(params_dtype(as_read), target.dtype,
                                                                           backends.dtypes(target.backend)))
            del as_read
            release()  # the parameters as read and any host cast, before the run
            with backends.forward_only(target.backend):
                if backends.kind(target.backend) in ROW_BY_ROW:
                    for row in range(src_ids.shape[0]):
                        sink = functools.partial(record, row=row)
                        encoded = model.encode(src_ids[row:row + 1], sink=sink)
                        release()  # the encoder's tensors, before the decoder's
                        model.decode(tgt_ids[row:row + 1], encoded, sink=sink)
                        del encoded
                        release()  # the row's tensors, before the next row's
                else:
                    model(src_ids, tgt_ids, sink=record)
            del model
            after = backends.precision_settings(target.backend)
            if changed := [f"{name} {before[name]!r} -> {after.get(name)!r}" for name in before
                           if after.get(name) != before[name]]:
                raise RuntimeError(f"the model changed matmul precision while it ran: {', '.join(changed)}")
        for tensor, compared in pieces.items():
            report.cells.setdefault((tensor, target.label), Cell(comparison=compared.result()))
        report.seconds[target.label] = time.perf_counter() - started - comparing
    except Exception as exc:  # noqa: BLE001 - a backend that crashes is a finding, not a crash of the report
        report.errors[target.label] = f"{type(exc).__name__}: {exc}"
        for tensor in report.tensors:  # a run that stopped has no cells, not the first few
            report.cells.pop((tensor, target.label), None)
        return

    for tensor in report.tensors:
        if (tensor, target.label) not in report.cells:
            report.cells[(tensor, target.label)] = Cell(error=f"{target.backend} did not return {tensor!r}")

