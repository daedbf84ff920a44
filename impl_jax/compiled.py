"""Compiled forward passes: one XLA executable per (model structure, dtype, shapes, flags), cached.

`call(model, Model._encode, args, device, return_attention=...)` runs a traced method of the model
through `jax.jit`. The model goes in as an argument (Flax NNX modules are pytrees): its
parameters are the executable's inputs, not constants baked into it, so updating a parameter in
place needs no recompilation. Flattening the model costs about a millisecond for the 6+6-layer
base model (`nnx.split` on every call would cost ten times that), and is done once and kept while
the model's structure holds (impl_jax/flat.py: a check of about 0.1 ms a call).

jit's cache key is everything the executable depends on: the method and flags, the model's tree
structure (its modules and their static attributes: the config and dtype), the shapes and dtypes of
the parameters and arguments, which optional arguments are None, the device, and JAX's config
(`jax_enable_x64`, `jax_default_matmul_precision`). Models with the same config, dtype and device
share executables, so building a fresh model per example (as the conformance suite does) does not
recompile.

The cost of a new shape. Each new (batch, source length, target length, mask shapes,
return_attention) traces and compiles `_encode` and `_decode` once. Measured on this project's
shared 2-core CPU machine (benchmarks/bench_jax.py): 0.1-0.2 s of tracing plus 1.3-1.6 s of XLA for
a 2+2-layer d_model 128 model, 0.3 s plus 1.5-1.7 s for the 6+6-layer d_model 512 base model, and
0.5-2 s for the 1-3-layer configs of the test suites (XLA:CPU compiles each fused kernel with LLVM;
a layer has about 25), against milliseconds (small) to 0.6 s (base) per call afterwards. A stream of
varied lengths therefore spends its time compiling; `Model(..., buckets=...)` pads lengths to a few
values so that at most len(buckets) + 1 lengths per side are ever compiled.

The number of live executables is bounded. XLA:CPU keeps each executable's JIT-compiled kernels
in memory mappings of their own: /proc/self/maps grows by 50-120 entries per compile (measured
for 1-12-layer models), and Linux allows a process vm.max_map_count of them (65530 by default).
Past that limit LLVM cannot map the next kernel ("LLVM compilation error: Cannot allocate
memory") and the process dies with SIGSEGV inside XLA compilation: measured here after 534
compiles of one 2+2-layer model, and it is what killed a CI run of the test suite. So once
`MAX_CACHED_EXECUTABLES` executables have been compiled since the cache was last emptied, or the
process holds more than `MAX_MAP_SHARE` of its allowed mappings after a compile, the next call
first drops every executable this backend cached (`clear_cache`), and the shapes still in use
compile again. Only this backend's cache is dropped, never the user's other jitted functions.

Compile work is counted through JAX's monitoring events, attributed to this backend only while one
of its calls is running, and reported by `compile_stats()` separately from run time.

The garbage collector pauses while a new program is traced. Tracing creates many short-lived Python
objects (a tracer, an equation and its variables for each of the 9,000 primitives of the base
model's training step), and Python's cyclic collector, which runs after every 700 net allocations,
ran 257 times during that trace, twice over all of the process's objects: 0.8-1.0 s by
`gc.callbacks`, on this project's 2-core CPU. So a trace starting inside one of this backend's
calls disables the collector, if it was enabled, until the call returns, and enables it again then;
cycles created meanwhile are collected at its next run, and reference counting frees everything
else at once. Side by side (benchmarks/bench_jax.py --compile --against, 4 fresh processes each)
the step's tracing took 2.07 s against 2.57 s, the forward's 0.41 against 0.53 s (less than the
collector's own time: the cycles are still collected, after the call, and single runs of the same
trace vary by a fifth): 3-4% of a cold compile, which XLA dominates; the process's peak memory was
the same (2.69 GB after the step's first call, either way). A call whose executable exists does not
trace and leaves the collector alone. `PAUSE_GC = False` turns this off. The collector is one per
process: with calls tracing on several threads at once, the first pause disables it (if it was
enabled) and the last call to finish enables it again; a `gc.disable()` made by other code while a
pause is running is undone then.

A notice before a long compile. A new shape of the base model takes seconds to trace and compile
(tens of seconds on a GPU at float32-highest, issue 28), which looks like a hang. When this
backend starts tracing a new program, a timer starts; if the trace and compile are still running
`NOTICE_AFTER` seconds later, one line goes to stderr saying what is being compiled and how to
keep it across processes (`impl_jax.enable_persistent_cache`). Compiles that finish sooner, and
executables loaded from the persistent cache, print nothing. `NOTICE_AFTER = None` (or
ROSETTA_JAX_QUIET=1) silences it. Why a timer rather than a prediction: the same program compiles
in 0.1 s from the persistent cache and in a minute without it, and nothing before the compile
tells the two apart.

Matrix products on a GPU. XLA's GPU compiler by default fuses each matrix product with its
neighbours into a Triton kernel and autotunes its tiling: for every distinct fusion it compiles and
times a set of candidate kernels. For float32 at precision "highest" that autotuning was most of a
cold compile on an H100 (issue 28: 61 s cold, 7 s with autotuning off, when the untuned kernels ran
5x slower). So this backend compiles its float32 and float64 programs for a GPU with XLA's
per-executable option `xla_gpu_enable_triton_gemm=False`: the products go to cuBLAS, chosen by its
own heuristics at no compile cost, and the user's other jitted functions keep XLA's defaults.
Measured on an H100 (docs/jax-compile.md, the option set for the whole process through
`XLA_FLAGS`, which compiles the same programs): the base forward's cold first call took 3.7 s
against 27.2 s for a plain linen copy of Flax `examples/wmt` at the same precision (3.5 s for that
copy with the option too), each call 14.9 against 13.0 ms; the training step compiled in 10.9 s
instead of 46.5 s and ran in 0.82x nn.Transformer's time instead of 0.93x. Other compute dtypes
(bfloat16, float16) keep XLA's default, for want of a measurement. `TRITON_GEMM`
(ROSETTA_JAX_TRITON_GEMM) chooses: "auto" (the above), "1" (XLA's default everywhere), "0" (no
Triton products on a GPU in any dtype). On other platforms the option does nothing and is not set.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import operator
import os
import sys
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import jax
import numpy as np
from flax import nnx

from impl_jax.flat import Flat, flattened
from impl_jax.precision import model_precision

# The event names JAX reports (jax._src.dispatch); stable since JAX 0.4.
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # an executable loaded from the persistent cache

# The bound on live executables (see the module docstring): 256 executables hold at most ~30000
# mappings, half the Linux default, and are far more shapes than a bucketed model ever needs.
MAX_CACHED_EXECUTABLES = 256
MAX_MAP_SHARE = 0.5
_MAPS = Path("/proc/self/maps")
_MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")

# Whether Python's cyclic garbage collector pauses while one of this backend's calls traces and
# compiles a new program (see the module docstring). Calls whose executable exists never touch it.
PAUSE_GC = True
_GC_PAUSES = 0  # calls pausing it now, across threads (the collector is one per process)
_GC_DISABLED_HERE = False  # whether the first of them disabled it (it was enabled), so the last enables it

# NumPy arguments (ids, masks) go to jit as they are, which transfers them in C++ on the way in,
# instead of one `jax.device_put` each first (`placed`; docs/jax-compile.md). False puts them first.
HOST_ARRAYS_TO_JIT = True

# A forward without a sink as one executable (`forward_in_one`) instead of the encoder's and the
# decoder's (impl_jax.Model.__call__; benchmarks/bench_jax_wmt.py --host measures both). Off by
# default: a process that also calls `encode`/`decode` or passes a sink on the same shapes then
# compiles three programs per shape, not two. ROSETTA_JAX_ONE_EXECUTABLE=1 turns it on for the
# process; `one_executable_forward(on)` for a block of one thread (or task).
_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "": False, "0": False, "false": False,
                 "no": False, "off": False}


def _switch(variable: str, default: str) -> bool:
    value = os.environ.get(variable, default).strip().lower()
    if value not in _SWITCH_WORDS:
        raise ValueError(f"{variable}={os.environ[variable]!r}: expected one of {sorted(w for w in _SWITCH_WORDS if w)}")
    return _SWITCH_WORDS[value]


ONE_EXECUTABLE_FORWARD: bool = _switch("ROSETTA_JAX_ONE_EXECUTABLE", "0")
_ONE_EXECUTABLE_HERE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("one_executable", default=None)


def one_executable() -> bool:
    """Whether a forward without a sink runs as one executable here: the innermost
    `one_executable_forward` block of this thread, else `ONE_EXECUTABLE_FORWARD`."""
    here = _ONE_EXECUTABLE_HERE.get()
    return ONE_EXECUTABLE_FORWARD if here is None else here


@contextlib.contextmanager
def one_executable_forward(on: bool = True):
    """`impl_jax.one_executable_forward(on=True)`: inside the block, a forward without a sink runs
    as one executable (`on`) or as the encoder's and the decoder's (not `on`), in this thread (a
    context variable: other threads and blocks around it keep their own); blocks nest."""
    token = _ONE_EXECUTABLE_HERE.set(bool(on))
    try:
        yield
    finally:
        _ONE_EXECUTABLE_HERE.reset(token)


# Triton products on a GPU (see the module docstring): "auto", "1" or "0".
TRITON_GEMM: str = os.environ.get("ROSETTA_JAX_TRITON_GEMM", "auto")
_TRITON_GEMM_CHOICES = {"auto": None, "1": True, "true": True, "on": True, "0": False, "false": False, "off": False}

# Seconds a trace and compile may run before the notice is printed (None: never).
NOTICE_AFTER: float | None = None if os.environ.get("ROSETTA_JAX_QUIET", "") not in ("", "0") else 1.0


@dataclass
class CompileStats:
    """Counters since the process started (or since `reset_stats`)."""

    compiles: int = 0  # XLA compilations (new executables), including those loaded from the persistent cache
    persistent_hits: int = 0  # of which loaded from the persistent cache (impl_jax.enable_persistent_cache)
    trace_seconds: float = 0.0  # tracing the Python code and lowering it to StableHLO
    compile_seconds: float = 0.0  # XLA compilation
    calls: int = 0  # compiled calls, new or cached
    cached: int = 0  # executables compiled since the cache was last emptied (live ones)
    evictions: int = 0  # times the cache was emptied to bound memory mappings


_STATS = CompileStats()
_LOCK = threading.Lock()
_ACTIVE = threading.local()  # set while this backend's call runs on this thread
_EVICT_NEXT = False  # set after a compile left the process close to its mapping limit


def _listener(event: str, duration: float, **_: Any) -> None:
    if not getattr(_ACTIVE, "on", False):
        return
    with _LOCK:
        if event == COMPILE_EVENT:
            _STATS.compiles += 1
            _STATS.compile_seconds += duration
        elif event in TRACE_EVENTS:
            _STATS.trace_seconds += duration


jax.monitoring.register_event_duration_secs_listener(_listener)


def _hit_listener(event: str, **_: Any) -> None:
    if event == CACHE_HIT_EVENT and getattr(_ACTIVE, "on", False):
        with _LOCK:
            _STATS.persistent_hits += 1


jax.monitoring.register_event_listener(_hit_listener)


def _notice(what: str) -> None:
    from impl_jax.cache import persistent_cache_dir

    where = persistent_cache_dir()
    keep = (f"kept in the persistent cache {where}" if where is not None else
            "once per process; impl_jax.enable_persistent_cache() or ROSETTA_JAX_CACHE=1 keeps it across processes")
    print(f"impl_jax: tracing and compiling {what}, a new shape: this takes seconds ({keep})", file=sys.stderr, flush=True)


def _pause_gc() -> None:
    """This thread's call pauses the collector: the first of any concurrent pauses disables it if
    it was enabled, and only then does the last resume enable it again."""
    global _GC_PAUSES, _GC_DISABLED_HERE
    _ACTIVE.gc_paused = True  # first: an interrupt after it leaves at most a resume with nothing to undo
    with _LOCK:
        if _GC_PAUSES == 0:
            _GC_DISABLED_HERE = gc.isenabled()
            gc.disable()
        _GC_PAUSES += 1


def _resume_gc() -> None:
    global _GC_PAUSES, _GC_DISABLED_HERE
    _ACTIVE.gc_paused = False
    with _LOCK:
        _GC_PAUSES = max(_GC_PAUSES - 1, 0)
        if _GC_PAUSES == 0 and _GC_DISABLED_HERE:
            _GC_DISABLED_HERE = False
            gc.enable()


def _phase_started(event: str, value: float, **_: Any) -> None:
    """JAX records the start of each compile phase as a scalar: a trace starting inside one of
    this backend's calls pauses the cyclic garbage collector (`PAUSE_GC`) and arms the notice's
    timer (at most one per call)."""
    if event != TRACE_EVENTS[0] or not getattr(_ACTIVE, "on", False):
        return
    if PAUSE_GC and not getattr(_ACTIVE, "gc_paused", False):
        _pause_gc()
    if NOTICE_AFTER is None:
        return
    if getattr(_ACTIVE, "timer", None) is None:
        what = getattr(_ACTIVE, "what", None)
        _ACTIVE.timer = threading.Timer(NOTICE_AFTER, _notice, (_describe(*what) if what else "a program",))
        _ACTIVE.timer.daemon = True
        _ACTIVE.timer.start()


jax.monitoring.register_scalar_listener(_phase_started)


@dataclass(frozen=True)
class Stacks:
    """How the compiled functions run each stack's layers (impl_jax/stacks.py): unrolled, as
    model.py's loop (the default), or under one `lax.scan` over the stacked layer parameters
    (`scan`); `remat` rematerialises each scanned layer in the backward pass (`jax.checkpoint`).

    Unrolled is the default because it compiles faster on XLA:CPU, which already compiles each
    distinct fused kernel once however many layers repeat it: scanned, the base model's forward
    and training step took 1.3-1.9x the CPU time to compile (docs/jax-compile.md)."""

    scan: bool = False
    remat: bool = False


# The setting in force; part of every executable's cache key. ROSETTA_JAX_SCAN=1 scans.
STACKS = Stacks(scan=os.environ.get("ROSETTA_JAX_SCAN", "0") not in ("", "0", "false", "no", "off"))


def _unregistered(model, *, remat: bool):
    raise RuntimeError("impl_jax.stacks is not imported: import impl_jax (which registers the scanned stacks)")


_SCANNER: Callable = _unregistered  # impl_jax.stacks.scanned, registered by that module (it imports this one)


def register_scanner(scanner: Callable) -> None:
    """Set the function that gives a traced model scanned stacks (impl_jax.stacks.scanned)."""
    global _SCANNER
    _SCANNER = scanner


@contextmanager
def stacks(*, scan: bool | None = None, remat: bool | None = None) -> Iterator[Stacks]:
    """Run the compiled calls in this scope with the layers scanned or not, rematerialised or not
    (None keeps the current choice); the previous setting is restored on exit."""
    global STACKS
    previous = STACKS
    STACKS = Stacks(scan=previous.scan if scan is None else bool(scan),
                    remat=previous.remat if remat is None else bool(remat))
    try:
        yield STACKS
    finally:
        STACKS = previous


_TRACING = threading.local()  # the layout of the program being traced on this thread


def in_layout(model):
    """A model built inside a traced function (e.g. merged from donated state, impl_jax.train)
    given the layout of the program being traced, as `_traced` gives its model argument."""
    layout = getattr(_TRACING, "layout", STACKS)
    return _SCANNER(model, remat=layout.remat) if layout.scan and model is not None else model


def _traced(method: Callable, static: tuple[tuple[str, Any], ...], layout: Stacks, model, *args):
    _TRACING.layout = layout
    if isinstance(model, Flat):  # `call` hands jit the model flattened (impl_jax/flat.py)
        model = model.model()
    if layout.scan:
        model = _SCANNER(model, remat=layout.remat)
    with model_precision(getattr(model, "precision", "highest")):  # the model's choice (impl_jax/precision.py)
        outputs = method(model, *args, **dict(static))
    # JAX returns a plain dict with its keys sorted ("decoder.0.cross" before "decoder.0.self",
    # "encoder.10" before "encoder.2"); an OrderedDict keeps the forward order of the names.
    return tuple(OrderedDict(x) if isinstance(x, dict) else x for x in outputs)


def forward_in_one(model, src_ids, src_mask, src_real, tgt_ids, tgt_mask, tgt_real, encoder_dropout=None,
                   decoder_dropout=None, *, return_attention: bool, dropout_rate: float | None = None):
    """The traced forward of `Model._forward_in_one`: the model's `_encode` then its `_decode` in
    one program, the decoder's cross-attention mask taken from the source mask (`cross_mask`) as
    the two executables take it. Returns (logits, attention, intermediates), the encoder's names
    first."""
    memory, attention, intermediates = model._encode(src_ids, src_mask, src_real, encoder_dropout,
                                                     return_attention=return_attention, dropout_rate=dropout_rate)
    logits, decoder_attention, decoder_intermediates = model._decode(
        tgt_ids, tgt_mask, memory, model.cross_mask(src_mask), tgt_real, src_real, decoder_dropout,
        return_attention=return_attention, dropout_rate=dropout_rate)
    return logits, {**attention, **decoder_attention}, {**intermediates, **decoder_intermediates}


def triton_gemm(platform: str, dtype: Any) -> bool:
    """Whether a program computing in `dtype` on `platform` ("cpu", "gpu", ...) is compiled with
    XLA's default Triton products (True), or with `xla_gpu_enable_triton_gemm=False` (see the
    module docstring; `TRITON_GEMM` chooses)."""
    choice = _TRITON_GEMM_CHOICES.get(str(TRITON_GEMM).strip().lower(), "unknown")
    if choice == "unknown":
        raise ValueError(f"ROSETTA_JAX_TRITON_GEMM (impl_jax.compiled.TRITON_GEMM) is {TRITON_GEMM!r}; "
                         "it must be auto, 1 or 0")
    if platform != "gpu":
        return True
    return choice if choice is not None else jax.numpy.dtype(dtype).name not in ("float32", "float64")


# One jit per (donating, Triton products): the option is fixed per jit object. Donating: the first
# two arguments after the model are donated (their buffers are reused for the outputs):
# impl_jax.train's fused step donates the parameters and the optimizer state.
_JITS = {(donate, triton): jax.jit(_traced, static_argnums=(0, 1, 2), donate_argnums=(4, 5) if donate else (),
                                   compiler_options=None if triton else {"xla_gpu_enable_triton_gemm": False})
         for donate in (False, True) for triton in (True, False)}
_JIT = _JITS[(False, True)]


def lower(model: nnx.Module, method: Callable, args: tuple, device: jax.Device, **static: Any) -> jax.stages.Lowered:
    """The traced and lowered (not compiled) program of `method`, e.g. to read its StableHLO."""
    return _JIT.lower(method, tuple(sorted(static.items())), STACKS, flattened(model), *jax.device_put(args, device))


def mapping_pressure() -> float | None:
    """The share of its allowed memory mappings this process holds (Linux), else None."""
    try:
        limit = int(_MAX_MAP_COUNT.read_text())
        with _MAPS.open("rb") as maps:
            held = sum(1 for _ in maps)
    except (OSError, ValueError):
        return None
    return held / limit if limit > 0 else None


def placed(args: tuple, device: jax.Device, anchor=()) -> tuple:
    """The arguments as jit should receive them on `device`. An argument whose leaves are all
    committed to `device` goes as it is (`jax.device_put` would return a new array object on the
    same buffer, after about 30 µs of host work a leaf on this project's CPU: 27 ms for a training
    step's 790 parameters and optimizer moments). So does one whose other leaves are NumPy arrays,
    when a leaf of `anchor` (the model's) or of the arguments is committed to `device`: jit then
    runs there and transfers those arrays itself, in C++ (`HOST_ARRAYS_TO_JIT`). Any other argument
    is put whole with `jax.device_put`."""
    if hasattr(device, "place"):  # a mesh (impl_jax/shard.py): the batch split over "data", the rest as it lies
        return device.place(args)
    sharding = _single_device_sharding(device)

    def there(x) -> bool:
        return isinstance(x, jax.Array) and x.committed and x.sharding == sharding

    kept, hosted = [], []  # per argument: every leaf committed to `device`; every leaf that or a NumPy array
    pinned = False  # whether an argument with leaves has all of them committed to `device`
    for x in args:  # plain loops: a call's arguments are few, and each leaf is looked at once
        leaves = _leaves(x)
        all_there = all_hosted = True
        for leaf in leaves:
            if type(leaf) is np.ndarray:
                all_there = False
            elif not there(leaf):
                all_there = all_hosted = False
                break
        kept.append(all_there)
        hosted.append(all_hosted)
        pinned = pinned or (all_there and bool(leaves))
    if HOST_ARRAYS_TO_JIT and not all(kept) and (pinned or any(map(there, anchor))):
        kept = list(map(operator.or_, kept, hosted))
    if all(kept):
        return args
    return tuple([x if k else jax.device_put(x, device) for x, k in zip(args, kept)])


def _leaves(x) -> list:
    """`jax.tree.leaves(x)`, without a walk of the tree for the arguments a call mostly takes: None
    (no leaves), a NumPy array or a JAX array (a leaf each)."""
    if x is None:
        return []
    if type(x) is np.ndarray or isinstance(x, jax.Array):
        return [x]
    return jax.tree.leaves(x)


@functools.lru_cache(maxsize=None)
def _single_device_sharding(device: jax.Device) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device)


def call(model: nnx.Module, method: Callable, args: tuple, device: jax.Device, *, donate: bool = False,
         compute_dtype: Any = None, **static: Any) -> tuple:
    """`method(model, *args, **static)`, compiled for these shapes on `device` (cached by jit).
    `donate`: args[0] and args[1] are donated (their buffers are invalid after the call).
    `compute_dtype`: the dtype the program's products run in (default: the model's `dtype`; a
    program without products may leave both out), which chooses `triton_gemm`."""
    global _EVICT_NEXT
    flat = flattened(model)
    args = placed(args, device, () if flat is None else flat.leaves)
    dtype = compute_dtype if compute_dtype is not None else getattr(model, "dtype", None)
    jit = _JITS[(donate, True if dtype is None else triton_gemm(device.platform, dtype))]
    with _LOCK:
        evict = _EVICT_NEXT or _STATS.cached >= MAX_CACHED_EXECUTABLES
        compiles_before = _STATS.compiles  # (emptying the cache below compiles nothing)
    if evict:
        clear_jits()
        with _LOCK:
            _STATS.cached, _EVICT_NEXT = 0, False
            _STATS.evictions += 1
    _ACTIVE.on, _ACTIVE.what = True, (model, method, args)  # described only if a trace starts
    try:
        outputs = jit(method, tuple(sorted(static.items())), STACKS, flat, *args)
    finally:
        _ACTIVE.on, _ACTIVE.what = False, None
        if getattr(_ACTIVE, "gc_paused", False):
            _resume_gc()
        if getattr(_ACTIVE, "timer", None) is not None:
            _ACTIVE.timer.cancel()
            _ACTIVE.timer = None
    with _LOCK:
        _STATS.calls += 1
        compiled_now = _STATS.compiles - compiles_before
        _STATS.cached += compiled_now
    if compiled_now:  # reading the map list costs milliseconds: only after a compile
        pressure = mapping_pressure()
        if pressure is not None and pressure > MAX_MAP_SHARE:
            with _LOCK:
                _EVICT_NEXT = True
    return tuple([dict(x) if isinstance(x, OrderedDict) else x for x in outputs])


def _describe(model, method: Callable, args: tuple) -> str:
    """What a call compiles, for the notice: cheap (no flattening), read only if it is printed."""
    name = getattr(method, "__qualname__", getattr(method, "__name__", "a program"))
    config = getattr(model, "config", None)
    size = "" if config is None else f" ({config.n_encoder_layers}+{config.n_decoder_layers} layers, d_model {config.d_model})"
    shapes = ", ".join(str(tuple(a.shape)) for a in args[:2] if hasattr(a, "shape"))
    return f"{name}{size}" + (f" at {shapes}" if shapes else "")


def compile_stats() -> dict[str, Any]:
    """Compiles and their time (tracing and XLA separately), calls, live executables and
    evictions, for reports."""
    with _LOCK:
        stats = asdict(_STATS)
    stats["trace_seconds"] = round(stats["trace_seconds"], 3)
    stats["compile_seconds"] = round(stats["compile_seconds"], 3)
    return stats


def reset_stats() -> None:
    """Zero the counters (compiled executables stay cached and are still counted as live)."""
    global _STATS
    with _LOCK:
        _STATS = CompileStats(cached=_STATS.cached)


def clear_cache() -> None:
    """Drop every compiled executable (the next call of each shape compiles again)."""
    global _EVICT_NEXT
    clear_jits()
    with _LOCK:
        _STATS.cached, _EVICT_NEXT = 0, False


def clear_jits() -> None:
    """Empty every jit's cache of executables (the counters are the caller's)."""
    for jit in _JITS.values():
        jit.clear_cache()
