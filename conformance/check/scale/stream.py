"""`rosetta check --stream`: the oracle and every backend one layer at a time, in memory that does
not grow with depth.

The model is cut into stages in forward order: the stem's embeddings, each encoder layer, the
encoder's output and the decoder's embeddings, each decoder layer, the decoder's output and the
logits. For each stage its parameters alone are read from the checkpoint (`Weights`: safetensors'
memory map, opened for that stage's keys and closed again), the float64 oracle runs it, then each
target in turn, and every tensor the stage records is compared at once (`report.compare`'s
comparison and tolerances). Then the stage's weights, modules and tensors are dropped. What
lives across stages is one residual stream per model and the encoder's memory.

Each backend's pieces are its own model.py modules, built from a subset of the parameters by
its `stream` module (`impl_numpy.stream`, from the backend's surface: the stem is `Model` on the
config with no layers; a layer, `EncoderLayer` or `DecoderLayer` from that layer's keys), and
the steps around the layers are model.py's own (masks, score biases, final norms, logits). A
backend without such pieces (onnxruntime, torch-compiled: whole graphs) is refused.

`feed` says what each stage of a target is given:
    "oracle" (the default): the oracle's own input from the stage below, cast to the target's
        dtype. A target's error is then that stage's own, not compounded through the layers below
        it: a bug still shows first where it lives, and a deep float32 stack is not blamed for
        the rounding it inherited.
    "own": the target's own output of the stage below, as an unstreamed call runs; the report is
        then the unstreamed one, bit for bit, for NumPy and PyTorch (tests/scale/test_stream.py); JAX's
        differs in the last bits, where XLA fuses across the layers of a whole call (docs/scale.md).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from conformance.check import backends
from conformance.check.compare import compare
from conformance.check.plan import ORACLE_DTYPE, stored_dtype
from conformance.check.report import Cell, Report
from conformance.check.tolerances import tolerance
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, InputError
from conformance.core.output import forward_order
from conformance.core.params import check_finite_array, param_shapes

FEEDS = ("oracle", "own")
FEED_NOTES = {
    "oracle": "streamed, one layer at a time; each layer of every backend is fed the oracle's own input from the "
              "layer below, so errors do not compound: each cell is that layer's own error",
    "own": "streamed, one layer at a time; each backend feeds each layer its own output from the layer below, as an "
           "unstreamed run does",
}


# -- Weights -----------------------------------------------------------------------------------


class Weights:
    """The parameters of a checkpoint, read a few keys at a time: `weights.read(keys)`.

    `Weights.open(path)` checks the file first, with bounded memory (`checkpoint.verify`: its
    header as `checkpoint.load` checks it, then the sha256 digest over header and data, read
    through a 16 MiB buffer). Each `read` then opens the file with
    safetensors' `safe_open` (a memory map), copies out those keys, checks their values are finite,
    and closes it: the map's pages are released with it, so the resident size does not grow with
    the number of stages read. A file replaced or written to since its digest was verified (its
    inode, size or modification time changed) is refused at the next read.

    `Weights.held(config, params)` serves a dict already in memory."""

    def __init__(self, config: ModelConfig, dtype: str, read: Callable[[list[str]], dict[str, np.ndarray]]):
        self.config, self.dtype, self._read = config, dtype, read

    def read(self, keys: list[str]) -> dict[str, np.ndarray]:
        return self._read(keys)

    @classmethod
    def held(cls, config: ModelConfig, params: Mapping[str, np.ndarray]) -> "Weights":
        dtype = np.asarray(next(iter(params.values()))).dtype.name
        return cls(config, dtype, lambda keys: {key: params[key] for key in keys})

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Weights":
        from safetensors import safe_open

        from conformance.core import checkpoint

        path = Path(path)
        before = _identity(path)
        config, dtype = checkpoint.verify(path)

        def read(keys: list[str]) -> dict[str, np.ndarray]:
            if _identity(path) != before:  # the digest was taken of another file than the one read now
                raise CheckpointError(path, "changed while it was being checked: it is not the file whose digest "
                                            "was verified")
            with safe_open(str(path), framework="numpy") as f:
                out = {key: f.get_tensor(key) for key in keys}
            try:
                for name, value in out.items():
                    check_finite_array(name, value)
            except InputError as exc:
                raise CheckpointError(path, exc.problem) from None
            return out

        return cls(config, dtype, read)


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is replaced or written to: device, inode, size, modification time."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


# -- Stages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One piece of the forward pass: `kind` is "embed", "encoder", "middle", "decoder" or "end"."""

    kind: str
    index: int = 0

    def label(self, config: ModelConfig) -> str:
        return {"embed": "encoder embeddings", "middle": "encoder output, decoder embeddings",
                "end": "decoder output, logits",
                "encoder": f"encoder layer {self.index + 1} of {config.n_encoder_layers}",
                "decoder": f"decoder layer {self.index + 1} of {config.n_decoder_layers}"}[self.kind]

    def keys(self, config: ModelConfig) -> list[str]:
        if self.kind in ("encoder", "decoder"):
            prefix = f"{self.kind}.layers.{self.index}."
            return [name for name in param_shapes(config) if name.startswith(prefix)]
        return list(param_shapes(stem_config(config)))


def stem_config(config: ModelConfig) -> ModelConfig:
    """The config without layers: its parameters are those outside the layers."""
    return config.replace(n_encoder_layers=0, n_decoder_layers=0)


def stages(config: ModelConfig) -> list[Stage]:
    return ([Stage("embed")] + [Stage("encoder", i) for i in range(config.n_encoder_layers)] + [Stage("middle")]
            + [Stage("decoder", i) for i in range(config.n_decoder_layers)] + [Stage("end")])


@dataclass
class Runner:
    """One model across the stages: its backend's stream module, what it carries from stage to
    stage (`carry`: x, memory, y, out), its masks and biases (`inputs`)."""

    backend: str
    device: str
    dtype: str
    param_dtype: str
    stream: Any
    code: Any
    carry: dict[str, Any] = field(default_factory=dict)
    inputs: Any = None
    precision: dict[str, Any] = field(default_factory=dict)  # its backend's settings as the first stage began


def streamable(backend: str) -> bool:
    """Whether `backend` has pieces to run a layer at a time: a built-in backend, or a registered
    copy of one's model.py (tests/breaks.py). Not `onnxruntime` or `torch-compiled`, whose graphs
    are whole models, nor an adapter."""
    if backend in backends.BACKENDS:
        return True
    return (backend not in backends.OPTIONAL_BACKENDS and backends.kind(backend) in backends.BACKENDS
            and hasattr(backends.import_backend(backend), "EncoderLayer"))


def refuse_unstreamable(names: list[str]) -> None:
    """`InputError` naming --backends for the first backend that cannot run a layer at a time."""
    for name in names:
        if not streamable(name):
            raise InputError("--backends", f"{name} cannot run a layer at a time (--stream)")


def runner(backend: str, device: str, dtype: str, params_dtype: str) -> Runner:
    source = backends.import_backend(backend)
    # A registered copy of a model.py (tests/breaks.py) is its own code, beside the real
    # backend's stream module; a backend package runs its own model.py.
    stream = source.stream
    code = source if hasattr(source, "EncoderLayer") else stream.model_py
    return Runner(backend, device, dtype, stored_dtype(params_dtype, dtype, backends.dtypes(backend)), stream, code)


def run_stage(stage: Stage, model: Runner, config: ModelConfig, params: dict[str, np.ndarray],
              given: Callable[[str], Any], src_ids: np.ndarray, tgt_ids: np.ndarray,
              sink: Callable[[str, Any], None], *, own: bool = True) -> None:
    """Run `stage` of `model`, its inputs from `given(name)` (name: x, memory, y, out), each tensor
    it records handed to `sink`; what it outputs goes to `model.carry`. `own`: the logits are of
    the model's own `decoder.output` from this stage, else of `given("out")`."""
    s, carry = model.stream, model.carry
    where = {"device": model.device}
    if stage.kind in ("embed", "middle", "end"):
        stem = s.stem(config, params, model.dtype, param_dtype=model.param_dtype, code=model.code, **where)
        if stage.kind == "embed":
            model.inputs = s.inputs(stem, src_ids, tgt_ids)
            carry["x"] = s.embeddings(stem, model.inputs)
            sink("encoder.embeddings", carry["x"])
        elif stage.kind == "middle":
            carry["memory"], carry["y"] = s.middle(stem, given("x"), model.inputs)
            sink("encoder.output", carry["memory"])
            sink("decoder.embeddings", carry["y"])
        else:
            carry["out"], logits = s.end(stem, given("y"), None if own else given("out"))
            sink("decoder.output", carry["out"])
            sink("logits", logits)
    elif stage.kind == "encoder":
        layer = s.encoder_layer(config, params, stage.index, param_dtype=model.param_dtype, code=model.code, **where)
        carry["x"] = s.run_encoder_layer(layer, given("x"), model.inputs, stage.index, sink)
    else:
        layer = s.decoder_layer(config, params, stage.index, param_dtype=model.param_dtype, code=model.code, **where)
        carry["y"] = s.run_decoder_layer(layer, given("y"), given("memory"), model.inputs, stage.index, sink)


@contextlib.contextmanager
def scope(model: Runner) -> Iterator[None]:
    """What a target runs under, as in `report._check_target`: full precision, its dtype's scope
    (JAX x64), no autograd record."""
    target = backends.Target(model.backend, model.device, model.dtype)
    with backends.full_precision(model.backend), backends.dtype_scope(target), backends.forward_only(model.backend):
        yield


def run_streamed(config: ModelConfig, weights: Weights, source: str, targets: list[backends.Target],
                 skipped: dict[str, str] | None, src_ids: np.ndarray, tgt_ids: np.ndarray, *, feed: str = "oracle",
                 progress: Callable[[str], None] | None = None,
                 oracle_sink: Callable[[str, np.ndarray], None] | None = None) -> Report:
    """The `rosetta check` report, computed a stage at a time (see the module's docstring).

    `progress(message)` hears each stage as it starts, with its number; `oracle_sink(name,
    tensor)` each tensor of the report the oracle computes (its whole call's, bit for bit)."""
    if feed not in FEEDS:
        raise InputError("feed", f"must be one of {', '.join(FEEDS)}, got {feed!r}")
    if config.source == "features":
        raise InputError("stream", "a features source (Whisper's front end) is not run a layer at a time yet: check "
                                   "it whole (rosetta check without --stream)")
    refuse_unstreamable([target.backend for target in targets])
    progress = progress or (lambda message: None)
    report = Report(config=config, source=source, targets=targets, tensors=forward_order(config),
                    skipped=dict(skipped or {}), note=FEED_NOTES[feed])
    report.versions["numpy"] = backends.version("numpy")
    oracle = runner("numpy", "cpu", ORACLE_DTYPE, weights.dtype)
    models = {}
    for target in targets:
        report.versions.setdefault(target.backend, backends.version(target.backend))
        models[target.label] = runner(target.backend, target.device, target.dtype, weights.dtype)
        report.seconds[target.label] = 0.0
    wanted = set(report.tensors)
    plan = stages(config)
    for number, stage in enumerate(plan, 1):
        progress(f"{stage.label(config)} ({number} of {len(plan)})")
        params = weights.read(stage.keys(config))
        expected: dict[str, np.ndarray] = {}

        def keep(name: str, value) -> None:
            if name in wanted:
                expected[name] = value
                if oracle_sink is not None:
                    oracle_sink(name, value)

        before = dict(oracle.carry)
        with backends.forward_only("numpy"):
            run_stage(stage, oracle, config, params, lambda name: oracle.carry[name], src_ids, tgt_ids, keep)
        # The oracle's inputs to this stage, and what it made within it for a later step of the
        # same stage (the decoder's output, for the logits: `end` of the oracle's `decoder.output`).
        fed = {**oracle.carry, **before}
        for target in targets:
            if target.label not in report.errors:
                _run_target(report, stage, models[target.label], target, config, params, fed, expected, feed,
                            src_ids, tgt_ids)
        del params, expected, before, fed
    for target in targets:
        if target.label in report.errors:
            continue
        for tensor in report.tensors:
            if (tensor, target.label) not in report.cells:
                report.cells[(tensor, target.label)] = Cell(error=f"{target.backend} did not return {tensor!r}")
    return report


def _run_target(report: Report, stage: Stage, model: Runner, target: backends.Target, config: ModelConfig,
                params: dict[str, np.ndarray], fed: dict[str, np.ndarray], expected: dict[str, np.ndarray], feed: str,
                src_ids: np.ndarray, tgt_ids: np.ndarray) -> None:
    tol = tolerance(target.dtype, target.device)
    comparing = 0.0

    def record(tensor: str, value) -> None:
        nonlocal comparing
        started = time.perf_counter()
        if tensor in expected:
            report.cells[(tensor, target.label)] = Cell(comparison=compare(value, expected[tensor], tol))
        comparing += time.perf_counter() - started

    if feed == "oracle":
        def given(name: str):
            return model.stream.array(fed[name], model.dtype, device=model.device)
    else:
        def given(name: str):
            return model.carry[name]

    started = time.perf_counter()
    try:
        with scope(model):
            if stage.kind == "embed":
                before = model.precision = report.precision[target.backend] = backends.precision_settings(target.backend)
                if problems := backends.precision_problems(before):
                    raise RuntimeError(f"full_precision() left reduced precision on: {', '.join(problems)}")
            run_stage(stage, model, config, params, given, src_ids, tgt_ids, record, own=feed == "own")
            if feed == "oracle":  # nothing of the target's own is carried: the next stage gets the oracle's
                model.carry.clear()
            after, before = backends.precision_settings(target.backend), model.precision
            if changed := [f"{name} {before[name]!r} -> {after.get(name)!r}" for name in before
                           if after.get(name) != before[name]]:
                raise RuntimeError(f"the model changed matmul precision while it ran: {', '.join(changed)}")
    except Exception as exc:  # noqa: BLE001 - a backend that crashes is a finding, not a crash of the report
        report.errors[target.label] = f"{type(exc).__name__}: {exc}"
        for tensor in report.tensors:  # a run that stopped has no cells, not the first few
            report.cells.pop((tensor, target.label), None)
        model.carry.clear()
        return
    report.seconds[target.label] += time.perf_counter() - started - comparing
