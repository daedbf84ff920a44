"""CUDA graphs of the cached decoding step and of the training step: on a GPU, `generate` replays
each step instead of launching its ~250 kernels one by one from Python, and `loss_and_grads` its
forward and backward instead of ~2000.

Why. On one H100 at batch 16 (base Marian size), a cached greedy step spent about 4.6 ms on the
host and 0.9 ms in GPU kernels (torch.profiler, docs/decoding.md): the step is bound by Python and
kernel launches, not by the GPU. transformers' eager step is bound the same way, with fewer ops. A
CUDA graph records the step's kernels once and replays them in one launch, which is what takes the
host out of the loop (and why, at batch 1, the cached loop can be more than 5x the uncached one:
the uncached loop reruns the decoder over the prefix, also launch by launch).

What is captured. One graph per step position `t` of a "room": the same model, rows N, cache length
L, source length S and the same kind of cross-attention fix-ups (`decode.cross_fix_ups`). A graph
records exactly `decode.advance` at `cache.length = t` (and, for beam search after the first step,
the in-place reorder of the cache by the parents), on the room's static buffers: the cache, the
newest ids (N,) and the parents (N,). The math is the eager step's, op for op; only where its
results live is fixed. A room is built the second time its key is seen, so one-off shapes (a
stream of varied source lengths) never pay for a capture, and at most `MAX_ROOMS` rooms are kept
(the least recently used is dropped): each holds a cache, (N, H, L, K) keys and values per layer.

What invalidates a graph. The graphs read the parameters where they were at capture time: the key
holds every parameter's and buffer's address (with its dtype and shape), so parameters moved or
recast to other memory (`.to(...)`, a reload with new tensors) make a new room, while an in-place
update (an optimizer step) is read by the next replay as by an eager step.

The training step. `loss_and_grads` (so `train_step`) is bound by the host the same way: on an H100
at batch 32 a float32 step issued ~2000 ops from Python for ~26 ms of kernels (docs/training.md).
Once a call's key recurs (the shapes, ε, the compute dtype, the parameters' and buffers' addresses,
dtypes and shapes, which parameters require grad, and the settings that choose kernels: float32
matmul precision and TF32, reduced-precision reductions, deterministic algorithms, the SDPA
backends, the BLAS library), its tensor work (`Model._loss_and_grads`: forward, loss, backward, the
casts of a mixed-precision step) is one graph of a `TrainRoom`, replayed on static ids, targets and
outputs. The checks of the ids and labels stay eager, before the replay (the forward skips its own
check of the static ids while recording: `checked_static_input`); the optimizer is not captured
(fused Adam is a couple of host calls). The gradients come back in one flat buffer, copied at every
call, so that a caller's gradients are never overwritten by the next replay. A call runs eagerly
where a graph could not replay it: with dropout masks, under inference mode or anomaly detection
(autocast is refused before, by the model's input checks), with a module or parameter hook or a
TorchFunction/TorchDispatch mode active (Python that a replay would skip), on a compiled model or a
subclass. A recording that fails (out of memory, say)
warns once, and that key's calls run eagerly from then on. Each room keeps its step's memory in its
graph's pool between calls (float32, base size, batch 32, lengths 64 on an H100: 1.2-1.5 GiB more
allocated between steps than eagerly; benchmarks/train_graphs.py), at most `MAX_TRAIN_ROOMS` rooms
(pad batches to a few shapes, as for JAX).

Switched off with `ROSETTA_TORCH_CUDA_GRAPHS=0`, `impl_torch.graphs.ENABLED = False`, or on one
thread inside `with impl_torch.graphs.switched_off():` (both uses); used only for the model's own
step on a CUDA device (a subclass's `decode_step`, e.g. torch.compile'd, runs as it is). `Recorded`
stands in for CUDA capture on the CPU, so that the tests exercise the rooms, the static buffers and
the in-place reorder without a GPU; docs/decoding.md and docs/training.md have the measurements.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from conformance.core.generation.search import DecoderCache

ENABLED = os.environ.get("ROSETTA_TORCH_CUDA_GRAPHS", "1").lower() not in ("0", "", "false", "no", "off")
MAX_ROOMS = 2
MAX_TRAIN_ROOMS = 2


class CudaCapture:
    """CUDA stream capture: `record(fn)` captures fn's kernels into a graph, then replays it once
    (a capture runs nothing). All graphs of a room share one memory pool, replayed in order."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None:
        """One eager run on the capture stream before its first capture (cuBLAS' workspace and
        handles), as torch's docs ask."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)

    def record(self, fn: Callable[[], torch.Tensor]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        graph.replay()
        return graph.replay, out


class Recorded:
    """A stand-in for `CudaCapture` on any device: `record` runs fn and keeps it as the "replay".
    The tests run the rooms through it on the CPU."""

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> None:
        fn()

    def record(self, fn: Callable[[], torch.Tensor]):
        out = fn()  # a tensor, or a tuple of tensors

        def replay():
            new = fn()
            for static, fresh in zip(*((out, new) if isinstance(out, tuple) else ((out,), (new,)))):
                static.copy_(fresh)

        return replay, out


CAPTURES: dict[str, Callable[[], object]] = {"cuda": CudaCapture}  # device type -> capture


def reorder_in_place(cache: DecoderCache, rows: torch.Tensor, length: int) -> None:
    """`decode.reorder_cache` into the same buffers: the written prefix of each self-attention
    buffer and the ids so far take rows `rows` (N,), in that order."""
    for buffer in cache.keys + cache.values:
        buffer[:, :, :length].copy_(buffer[:, :, :length].index_select(0, rows))
    cache.tgt_ids.copy_(cache.tgt_ids.index_select(0, rows))


def _addresses(model, params: list | None = None) -> tuple:
    """Where every parameter and buffer lives, and as what: memory reused by another dtype or
    shape (a recast freed and then allocated again) is another key. `params`: the model's
    parameters, where the caller has them already (each walk over the modules costs host time)."""
    params = list(model.parameters()) if params is None else params
    return tuple((t.data_ptr(), t.dtype, t.shape) for t in params + list(model.buffers()))


def _room(model, tables: tuple[str, str], key, build: Callable, limit: int):
    """The model's room of `key` from its tables (attribute names: rooms, keys seen once), built
    by `build()` the second time the key is seen (so one-off shapes never pay for a capture), or
    None the first time; at most `limit` rooms are kept, the least recently used dropped."""
    rooms = model.__dict__.setdefault(tables[0], OrderedDict())
    seen = model.__dict__.setdefault(tables[1], OrderedDict())
    if key not in rooms:
        if key not in seen:
            seen[key] = None
            while len(seen) > 64:  # the keys seen once, most recent kept
                seen.popitem(last=False)
            return None
        rooms[key] = build()
        while len(rooms) > limit:
            rooms.popitem(last=False)
    rooms.move_to_end(key)
    return rooms[key]


def _fix_up_kind(cache: DecoderCache) -> tuple:
    return tuple(tuple(part is None for part in fix) for fix in (cache.cross_fix_ups or ()))


def _sources(cache: DecoderCache) -> list:
    """The cache's tensors made for each call (from the source, and a copy of the output weight
    where a step takes one, `decode.step_output_weight`): copied into a room's at every call."""
    tensors = cache.cross_keys + cache.cross_values + ([] if cache.cross_mask is None else [cache.cross_mask])
    for fix in cache.cross_fix_ups or ():
        tensors += [part for part in fix if isinstance(part, torch.Tensor)]
    return tensors + ([] if cache.output_weight is None else [cache.output_weight])


class Room:
    """The static buffers and the per-position graphs of one key (see the module docstring)."""

    def __init__(self, model, cache: DecoderCache, capture, advance: Callable):
        self.model, self.cache, self.capture, self.advance = model, cache, capture, advance
        rows = cache.tgt_ids.shape[0]
        self.ids = torch.zeros(rows, dtype=torch.long, device=cache.tgt_ids.device)
        self.parents = torch.arange(rows, device=cache.tgt_ids.device)
        self.graphs: dict[tuple[int, bool], tuple[Callable, torch.Tensor]] = {}
        self.warm = False

    def load(self, cache: DecoderCache) -> None:
        """A new call's source-dependent tensors into this room's buffers; the ids start over."""
        if cache is not self.cache:
            for static, new in zip(_sources(self.cache), _sources(cache)):
                static.copy_(new)
            self.cache.tgt_ids.fill_(self.model.config.pad_id)
        self.cache.length = 0

    def step(self, t: int, ids: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
        """The logits (N, V) of step t after the newest ids (N,), the cache first reordered by
        `parents` (N,) when given: a replay of the graph of (t, reorder), captured on first use."""
        self.ids.copy_(ids)
        if parents is not None:
            self.parents.copy_(parents)
        key = (t, parents is not None)
        if key not in self.graphs:
            if not self.warm:  # position 0, no reorder: rerunning it later writes the same values
                self.capture.warm_up(lambda: self._step(0, False))
                self.warm = True
            self.graphs[key] = self.capture.record(lambda: self._step(t, parents is not None))
        else:
            self.graphs[key][0]()
        self.cache.length = t + 1
        return self.graphs[key][1].clone()  # the graph's output buffer is overwritten by the next replay

    def _step(self, t: int, reorder: bool) -> torch.Tensor:
        """What a graph records (and `Recorded` reruns): the step at position t, from the static buffers."""
        if reorder:
            reorder_in_place(self.cache, self.parents, t)
        self.cache.length = t
        return self.advance(self.model, self.ids, self.cache)


def room_for(model, cache: DecoderCache, advance: Callable) -> Room | None:
    """The room for this call's cache (its buffers loaded), or None: graphs off, no capture for
    the model's device, or the key seen for the first time."""
    capture = CAPTURES.get(model.device.type) if enabled() else None
    if capture is None:
        return None
    key = (tuple(cache.keys[0].shape) if cache.keys else None, tuple(cache.cross_keys[0].shape) if cache.cross_keys
           else None, cache.cross_mask is None, _fix_up_kind(cache), cache.output_weight is None, model.dtype,
           _addresses(model))
    room = _room(model, ("_graph_rooms", "_graph_keys_seen"), key, lambda: Room(model, cache, capture(), advance),
                 MAX_ROOMS)
    if room is not None:
        room.load(cache)
    return room


def release(model) -> None:
    """Drop the model's rooms and their graphs (their memory returns to torch's allocator)."""
    for name in ("_graph_rooms", "_graph_keys_seen", "_train_rooms", "_train_keys_seen", "_train_keys_eager"):
        model.__dict__.pop(name, None)


_LOCAL = threading.local()  # per thread: switched_off's depth, the static inputs being recorded


def enabled() -> bool:
    """Whether graphs may be recorded and replayed here: `ENABLED`, and not inside `switched_off()`."""
    return ENABLED and not getattr(_LOCAL, "off", 0)


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Inside the block, on this thread, no graph is recorded or replayed: every step runs
    eagerly, as on a CPU. For side-by-side measurements (benchmarks/bench_train.py)."""
    _LOCAL.off = getattr(_LOCAL, "off", 0) + 1
    try:
        yield
    finally:
        _LOCAL.off -= 1


# -- The training step ---------------------------------------------------------------------------

_LOCK = threading.Lock()  # the training rooms' tables, across threads


def checked_static_input(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a static input of the training graph this thread is recording now: ids
    (or a features source's features) that `loss_and_grads` checked on the host before copying them there. The forward skips its own
    check of them while recording (a check reads the ids on the host, which a capture forbids)."""
    return id(tensor) in getattr(_LOCAL, "recording", ())


def _settings() -> tuple:
    """The process's settings that choose a training step's kernels or their rounding (part of a
    room's key: a replay keeps the kernels of its recording)."""
    cuda = torch.backends.cuda

    def read(owner, name):
        value = getattr(owner, name, None)
        return str(value() if callable(value) else value)

    return (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
            *(read(cuda.matmul, name) for name in ("allow_tf32", "allow_bf16_reduced_precision_reduction",
                                                   "allow_fp16_reduced_precision_reduction")),
            *(read(cuda, name) for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled",
                                            "cudnn_sdp_enabled", "preferred_blas_library")))


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _python_inside(model, params: list) -> str | None:
    """What would run Python code, or read values on the host, inside a training step (a graph
    replays only its kernels): None, or what it is. `params`: the model's parameters."""
    if torch.is_anomaly_enabled():
        return "anomaly detection"
    if torch.overrides._get_current_function_mode_stack() or _get_current_dispatch_mode() is not None:
        return "a TorchFunctionMode or TorchDispatchMode"
    if any(getattr(torch.nn.modules.module, f"_global{name}", None) for name in _MODULE_HOOKS):
        return "a global module hook"
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
            return "a module hook"
    if any(p._backward_hooks or p._post_accumulate_grad_hooks for p in params):
        return "a parameter hook"
    return None


class TrainRoom:
    """The static inputs, the graph and the static outputs of `Model._loss_and_grads` for one key
    (see the module docstring): the graph is recorded at the room's first call and replayed at
    every call after."""

    def __init__(self, model, src_ids: torch.Tensor, tgt_ids: torch.Tensor, targets: torch.Tensor,
                 epsilon: float, capture):
        self.model = weakref.ref(model)  # the model holds its rooms: no cycle that only gc could free
        self.epsilon, self.capture = epsilon, capture
        self.src_ids, self.tgt_ids, self.targets = (torch.empty_like(t) for t in (src_ids, tgt_ids, targets))
        self.shapes = [p.shape for p in model.parameters()]
        self.sizes = [p.numel() for p in model.parameters()]
        self.replay = None

    def _loss_and_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the graph records (and `Recorded` reruns): the loss and every gradient, flattened
        into one buffer in `named_parameters` order, from the static inputs."""
        loss, grads = self.model()._loss_and_grads(self.src_ids, self.tgt_ids, self.targets, self.epsilon, None)
        return loss, torch.cat([g.reshape(-1) for g in grads])

    def run(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor, targets: torch.Tensor):
        """`Model._loss_and_grads` of these (checked, on the device) ids and targets: the loss and
        the gradients in `named_parameters` order, copies of the graph's outputs."""
        for static, new in ((self.src_ids, src_ids), (self.tgt_ids, tgt_ids), (self.targets, targets)):
            static.copy_(new)
        if self.replay is None:  # record (which runs the graph once)
            self.capture.warm_up(self._loss_and_grads)
            _LOCAL.recording = (id(self.src_ids), id(self.tgt_ids))
            try:
                self.replay, (self.loss, self.flat) = self.capture.record(self._loss_and_grads)
            finally:
                _LOCAL.recording = ()
        else:
            self.replay()
        # Copies, because the next replay overwrites the outputs: one for the loss, one for all the
        # gradients, then views of it (no kernel each; so one gradient kept keeps them all)
        flat = self.flat.clone()
        return self.loss.clone(), [part.view(shape) for part, shape in zip(flat.split(self.sizes), self.shapes)]


def replayed_loss_and_grads(model, src_ids: torch.Tensor, tgt_ids: torch.Tensor, targets: torch.Tensor,
                            epsilon: float):
    """`Model._loss_and_grads` without dropout from this call's room (recorded now if it is new),
    or None where the call is to run eagerly: graphs off, no capture for the model's device, a
    call that must run eagerly (module docstring), the key seen for the first time, or a key whose
    recording failed (with a warning, once: those calls run eagerly from then on)."""
    capture = CAPTURES.get(model.device.type) if enabled() else None
    if (capture is None or torch.is_inference_mode_enabled() or torch.is_autocast_enabled(model.device.type)
            or model.__dict__.get("_compiled_call_impl") is not None):
        return None
    params = list(model.parameters())
    if _python_inside(model, params) is not None:
        return None
    if len({p.dtype for p in params}) != 1:  # the gradients would not fit one flat buffer
        return None
    # The parameters read once for the whole key (each walk over the base model's 180 modules
    # costs ~0.35 ms of host time on this project's CPU)
    key = (tuple(src_ids.shape), tuple(tgt_ids.shape), epsilon, model.dtype, _addresses(model, params),
           tuple(p.requires_grad for p in params), _settings())
    with _LOCK:
        eager = model.__dict__.setdefault("_train_keys_eager", set())
        if key in eager:
            return None
        room = _room(model, ("_train_rooms", "_train_keys_seen"), key,
                     lambda: TrainRoom(model, src_ids, tgt_ids, targets, epsilon, capture()), MAX_TRAIN_ROOMS)
        if room is None:
            return None
    recorded = room.replay is not None
    try:
        return room.run(src_ids, tgt_ids, targets)
    except Exception as exc:
        if recorded:  # a replay's failure is the device's: not hidden
            raise
        with _LOCK:
            model.__dict__["_train_rooms"].pop(key, None)
            eager.add(key)
        warnings.warn(f"impl_torch: recording the training step as a CUDA graph failed ({type(exc).__name__}: "
                      f"{exc}); calls of these shapes run eagerly", RuntimeWarning, stacklevel=3)
        return None
