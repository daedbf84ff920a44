"""How `rosetta check` holds the oracle's tensors: the one place that decides, from a memory budget.

A check runs the float64 oracle once and then every target, each on the same batch, and compares
tensor by tensor. The oracle's tensors are needed until the last target has been compared; at
length 512 they outweigh the model (a base-size model's 18 attention maps alone are 0.9 GB in
float64). Two ways to hold them, with the same report:

    all-at-once    the oracle's tensors stay in memory for the whole run (fastest)
    one-at-a-time  they are written to a temporary directory as they leave the oracle and read
                   back one tensor at a time, so only one of them is in memory during a comparison

In both, every model hands each tensor over as it computes it (the model call's `sink`), a
target's model is released before the next one is built, and each of its tensors is released
once compared. `plan_check` estimates the peak of both paths (`estimate`) and takes
all-at-once when it fits the budget: `--max-memory`, else the kernel's MemAvailable. The estimate
counts the check's own data (parameters, tensors, comparisons), not the interpreter and the
frameworks, which are loaded before the plan is made (0.4 GB for NumPy, PyTorch, JAX and Flax).
"""

from __future__ import annotations

import ctypes
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np

from conformance.check.compare import CHUNK, tensor_scale
from conformance.core.config import ModelConfig
from conformance.core.inputs import source_real
from conformance.core.errors import InputError
from conformance.core.output import forward_order
from conformance.core.params import param_shapes, widened_at_use

ALL_AT_ONCE = "all-at-once"
ONE_AT_A_TIME = "one-at-a-time"
ORACLE_DTYPE = "float64"

# compare() works in chunks of `compare.CHUNK` elements and holds about this many float64 arrays
# of a chunk at once (both operands, the absolute and relative errors, their temporaries).
COMPARE_COPIES = 8


def tensor_shapes(config: ModelConfig, batch: int, src_len: int, tgt_len: int) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a model call records (`forward_order`), from the config alone."""
    b, h, d = batch, config.n_heads, config.d_model
    shapes = {}
    for name in forward_order(config):
        side = name.split(".")[0]
        if name == "logits":
            shapes[name] = (b, tgt_len, config.tgt_vocab_size)
        elif name.endswith(".self"):
            length = src_len if side == "encoder" else tgt_len
            shapes[name] = (b, h, length, length)  # (B, H, Tq, Tk)
        elif name.endswith(".cross"):
            shapes[name] = (b, h, tgt_len, src_len)  # (B, H, T, S)
        else:
            shapes[name] = (b, src_len if side == "encoder" else tgt_len, d)  # (B, L, D)
    return shapes


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


# Casts that are exact: every value of the first dtype is a value of the second.
EXACT_WIDENINGS = frozenset({("float16", "float32"), ("float16", "float64"), ("bfloat16", "float32"),
                             ("bfloat16", "float64"), ("float32", "float64")})


# What every backend can store its parameters in (NumPy's SUPPORTED_DTYPES, the narrowest set).
EVERY_BACKEND_STORES = ("float32", "float64")


def stored_dtype(source: str | None, dtype: str, supported: Iterable[str] = EVERY_BACKEND_STORES) -> str:
    """The dtype a checked model of compute dtype `dtype` keeps its parameters in (`param_dtype`):
    the parameters' own dtype `source` when widening it to `dtype` is exact and the backend can
    store it (`supported`: NumPy cannot hold float16 or bfloat16), else `dtype`. A float64 model
    of a float32 checkpoint then holds the float32 values (half the memory) and widens each one
    where it is used, with the same bits as a model built from the widened set
    (tests/backends/test_param_dtype.py)."""
    return source if (source, dtype) in EXACT_WIDENINGS and source in tuple(supported) else dtype


def params_dtype(params: Mapping[str, np.ndarray]) -> str:
    """The one dtype of a checked parameter set (`checkpoint.load` refuses mixed sets)."""
    return np.asarray(next(iter(params.values()))).dtype.name


@dataclass(frozen=True)
class Estimate:
    """Bytes, by what holds them; `peak(mode)` is the most held at once on that path.

    Every model hands each tensor over as it computes it (the `sink` of a model call), so a model
    step holds its parameters, the tensors one call holds at once, and one comparison. NumPy and
    torch hold about a layer's working tensors, at most the logits and their sum with the bias;
    JAX's compiled encoder and decoder each return all their tensors together, for one batch row
    (the check runs JAX row by row): `call_held` is the larger of the two, in the step's dtype.
    A model keeps its parameters in `stored_dtype` and, where that is narrower than its compute
    dtype, widens each where it is used: `widened` is the largest piece a model widens at once
    (`widened_at_use`: the output projection a block of columns at a time, embeddings by rows).
    """

    source_params: int  # the parameters as the caller holds them (read again per model: while building one)
    reread: bool  # whether the parameters are read again per model rather than held for the whole run
    model_params: dict[str, int]  # dtype -> one model's parameters, as a model of that dtype stores them
    widened: dict[str, int]  # dtype -> the largest piece of a parameter cast to that dtype at use (0: stored in it)
    outputs: dict[str, int]  # dtype -> every tensor of one model call in that dtype
    call_held: dict[str, int]  # dtype -> the tensors one call may hold at once (see above)
    largest_tensor: int  # the largest tensor, in float64 (the oracle's, read back to compare)

    def step(self, dtype: str) -> int:
        """One model in `dtype`: built (the parameters as read, a host cast and the backend's own
        copy), then run (its parameters, the tensors it holds at once, the oracle's tensor read
        back and compare()'s chunks)."""
        source = self.source_params if self.reread else 0  # otherwise counted once, in `peak`
        build = source + 2 * self.model_params[dtype]
        working = self.largest_tensor + COMPARE_COPIES * CHUNK * 8
        run = self.model_params[dtype] + self.widened[dtype] + self.call_held[dtype] + working
        return max(build, run)

    def peak(self, mode: str, dtypes: Iterable[str]) -> int:
        steps = max([self.step(ORACLE_DTYPE)] + [self.step(d) for d in dtypes])
        held = self.outputs[ORACLE_DTYPE] if mode == ALL_AT_ONCE else 0
        return (0 if self.reread else self.source_params) + held + steps


def estimate(config: ModelConfig, params: Mapping[str, np.ndarray], dtypes: Iterable[str],
             batch: int, src_len: int, tgt_len: int, *, reread: bool = False) -> Estimate:
    """The memory a check of `config` on a (batch, src_len) x (batch, tgt_len) batch needs;
    `reread`: the parameters are read again for each model (`run_check` given a reader)."""
    count = sum(int(np.prod(shape)) for shape in param_shapes(config).values())
    elements = {name: int(np.prod(shape)) for name, shape in tensor_shapes(config, batch, src_len, tgt_len).items()}
    halves = [sum(n for name, n in elements.items() if name.startswith("encoder")),
              sum(n for name, n in elements.items() if not name.startswith("encoder"))]
    dtypes = sorted(set(dtypes) | {ORACLE_DTYPE})
    source = params_dtype(params) if params else None  # none given: each model stores its own dtype
    largest = widened_at_use(config)
    return Estimate(
        source_params=sum(int(np.asarray(value).nbytes) for value in params.values()),
        reread=reread,
        model_params={d: count * _itemsize(stored_dtype(source, d)) for d in dtypes},
        widened={d: largest * _itemsize(d) if stored_dtype(source, d) != d else 0 for d in dtypes},
        outputs={d: sum(elements.values()) * _itemsize(d) for d in dtypes},
        call_held={d: max(2 * max(elements.values()), max(halves) // batch) * _itemsize(d) for d in dtypes},
        largest_tensor=max(elements.values()) * 8,
    )


@dataclass(frozen=True)
class Plan:
    mode: str  # ALL_AT_ONCE or ONE_AT_A_TIME
    budget: int | None  # bytes, None when unknown
    budget_source: str  # "--max-memory", "MemAvailable" or "unknown"
    peaks: dict[str, int]  # mode -> estimated peak bytes

    def describe(self) -> str:
        budget = f"{_size(self.budget)} ({self.budget_source})" if self.budget is not None else "unknown"
        text = (f"memory plan: {self.mode}; estimated peak {_size(self.peaks[ALL_AT_ONCE])} all at once, "
                f"{_size(self.peaks[ONE_AT_A_TIME])} one at a time; budget {budget}")
        if self.budget is not None and self.peaks[self.mode] > self.budget:
            text += "; the estimate exceeds the budget even one at a time"
        return text


def _size(nbytes: int) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes} bytes"


def plan_check(estimated: Estimate, dtypes: Iterable[str], budget: int | None = None,
               budget_source: str = "--max-memory") -> Plan:
    """All at once when its estimated peak fits the budget, else one at a time.

    `budget=None` reads the kernel's MemAvailable; where that is unknown (not Linux), all at once.
    """
    dtypes = list(dtypes)
    if budget is None:
        budget, budget_source = available_memory(), "MemAvailable"
        if budget is None:
            budget_source = "unknown"
    peaks = {mode: estimated.peak(mode, dtypes) for mode in (ALL_AT_ONCE, ONE_AT_A_TIME)}
    fits = budget is None or peaks[ALL_AT_ONCE] <= budget
    return Plan(mode=ALL_AT_ONCE if fits else ONE_AT_A_TIME, budget=budget, budget_source=budget_source, peaks=peaks)


def plan_batch(config: ModelConfig, params: Mapping[str, np.ndarray], dtypes: Iterable[str],
               src_ids: np.ndarray, tgt_ids: np.ndarray, budget: int | None = None, *, reread: bool = False) -> Plan:
    """The plan for checking `config` at `dtypes` on this (B, S) x (B, T) batch (`plan_check`)."""
    dtypes = list(dtypes)
    src_len = source_real(config, np.asarray(src_ids)).shape[1]  # a features source: frames / 2
    needed = estimate(config, params, dtypes, src_ids.shape[0], src_len, tgt_ids.shape[1], reread=reread)
    return plan_check(needed, dtypes, budget)


def available_memory(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (the kernel's estimate of what can be allocated without swapping)."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str, argument: str = "--max-memory") -> int:
    """'900M', '2G', '1.5G' or a plain byte count (K, M, G, T are powers of 1024)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in UNITS and value[-1:] else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise InputError(argument, f"expected a size like 900M, 2G or a byte count, got {text!r}") from None
    if not np.isfinite(number) or number <= 0:
        raise InputError(argument, f"must be a positive size, got {text!r}")
    return int(number * UNITS[unit])


# The estimated peak (`Plan.peaks`) from which a check hands freed memory back between models
# (`releaser`). Below it, what a collection could give back is not worth its time: a full
# `gc.collect()` took 0.38 s in a process that has imported torch and JAX, and about 1 s in a test
# run's worker (6 calls made 2.3 s of a 2.6 s `compare` on a 2-layer model, cProfile), while the
# model's tensors were a few megabytes.
RELEASE_ABOVE = 256 * 2**20


def releaser(plan: Plan) -> Callable[[], None]:
    """`release_freed_memory` for a check whose estimated peak reaches `RELEASE_ABOVE`, and for any
    one-at-a-time plan (memory is short); a no-op otherwise."""
    if plan.mode == ONE_AT_A_TIME or plan.peaks.get(plan.mode, 0) >= RELEASE_ABOVE:
        return release_freed_memory
    return lambda: None


def release_freed_memory() -> None:
    """Hand memory freed by the last model back to the system before the next one is built.

    glibc's malloc keeps freed blocks of up to 32 MB (its mmap threshold grows to the largest
    block freed) in its heaps for reuse; a model's tensors are 6 to 50 MB each at length 512, so
    without `malloc_trim` the resident size only grows from one backend to the next. A no-op where
    the C library has no `malloc_trim` (not glibc).
    """
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


class OracleTensors:
    """The oracle's tensors by name, held as the plan's mode says: in memory, or one `.npy` file
    each in a private temporary directory (removed on `close`) and read back one at a time."""

    def __init__(self, mode: str):
        if mode not in (ALL_AT_ONCE, ONE_AT_A_TIME):
            raise ValueError(f"unknown memory plan mode {mode!r}; expected {ALL_AT_ONCE!r} or {ONE_AT_A_TIME!r}")
        self._spill = tempfile.TemporaryDirectory(prefix="rosetta-check-") if mode == ONE_AT_A_TIME else None
        self._held: dict[str, np.ndarray | Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.scales: dict[str, float] = {}  # tensor_scale of each, for comparing one row at a time

    def put(self, name: str, value: np.ndarray) -> None:
        self.shapes[name], self.scales[name] = value.shape, tensor_scale(value)
        if self._spill is None:
            self._held[name] = value
            return
        path = Path(self._spill.name) / f"{len(self._held)}.npy"
        np.save(path, value, allow_pickle=False)
        self._held[name] = path

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._held[name]
        return np.load(value, allow_pickle=False) if isinstance(value, Path) else value

    @property
    def spilled(self) -> bool:
        """Whether the tensors are on disk (one-at-a-time): then compare them a row at a time."""
        return self._spill is not None

    def row_pieces(self, name: str, index: int, size: int = CHUNK) -> Iterator[np.ndarray]:
        """Row `index` of a tensor, flattened, in consecutive pieces of at most `size` elements.
        When spilled, each piece is read from the file as it is asked for, with a plain read into a
        fresh array (a memory map would count the file's pages as resident while mapped): a
        comparison then holds one piece of the oracle's row, not the row (86 MB of float64 logits
        for the base model at length 512)."""
        value = self._held[name]
        if not isinstance(value, Path):
            flat = value[index].reshape(-1)
            for start in range(0, flat.size, size):
                yield flat[start:start + size]
            return
        with value.open("rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
            if fortran or not 0 <= index < shape[0]:  # np.save of a C-ordered array: a bug if not
                raise RuntimeError(f"cannot read row {index} of {name!r} ({shape}, fortran order {fortran})")
            count = int(np.prod(shape[1:]))
            f.seek(index * count * dtype.itemsize, 1)
            for start in range(0, count, size):
                piece = np.fromfile(f, dtype=dtype, count=min(size, count - start))
                if piece.size != min(size, count - start):  # a file cut short under the check
                    raise RuntimeError(f"{value} ended inside row {index} of {name!r}")
                yield piece

    def close(self) -> None:
        self._held.clear()
        if self._spill is not None:
            self._spill.cleanup()

    def __enter__(self) -> "OracleTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
