"""A search's products on the CPU through oneDNN's prepacked float32 linear (issue 57).

Why. A cached step multiplies a few rows (N = batch x beams) by every weight of the decoder and by
W_out: base Marian streams about 150 MB of float32 weights per step, so a step costs what its GEMMs
take to read them. torch's CPU products run MKL's sgemm, which on this project's AMD EPYC (AVX-512)
read them at about half the speed of oneDNN's inner product on weights packed once into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then `torch.ops.mkldnn._linear_pointwise`,
the pair Inductor's CPU freezing passes use). CTranslate2 runs oneDNN's sgemm on that CPU.
Measured there (one thread, 6 layers' distinct weights, batch 8): the decoder's 48 products 14 ms
with MKL against 7 ms packed, the output product 10-14 ms against 5 ms (docs/performance.md).
A oneDNN call costs about 15 us on the host against addmm's 4, which a product of base size repays
many times over, and a tiny model does not (d_model 64: a greedy step 1 ms slower).

What. `packed_step(model)` gives `start_cache` a copy of `model.decoder`, a tree of modules that
shares every module's parameters and buffers, in which each `Linear` is a `PackedLinear`, or a
`FusedPart` of a product taken once for a group of them (`Fused`: self-attention's q, k and v of
the step's input; cross-attention's k and v of the memory, once per source); its forward is the
same code, `Decoder.forward` and the layers' own. And W_out packed. The products are float32 like
MKL's, in another summation order: the logits equal the stored weights' to float32 rounding
(tests/generation/test_packed_step.py), not bit for bit; the fused groups give the same bits as
their Linears packed one by one.

Freshness. Packing base Marian's decoder and W_out takes about a tenth of a second, several steps,
so the packed weights are kept beside the model and reused by the next search. Each search first
checks that every packed weight's parameter holds, byte for byte, what it was packed from (against
a snapshot, by memcmp: an in-place write through `.data` bumps no version counter, so the
counters cannot tell), and packs again what changed: about 11 ms for base Marian's 150 MB, one
thread, about one step. A parameter replaced by another tensor, or of another dtype, shape or
device, or a module replaced in the decoder, is packed again too. The snapshots and the packed
copies hold twice those 150 MB; `release(model)` drops them.

When. A float32 model on the CPU, parameters stored in float32, oneDNN present, outside autograd
(a step recorded for a gradient multiplies the parameters, which the gradient reaches), no hook
on the decoder's modules (the copy would not run it), and `ROSETTA_TORCH_PACKED_STEP` not 0/off.
Otherwise, and on every other device (CUDA replays its own graphs, impl_torch/graphs.py), the
search runs `model.decoder` and the stored W_out as before.
"""

from __future__ import annotations

import copy
import os
import threading
import weakref

import torch
from torch import nn

ENABLED = os.environ.get("ROSETTA_TORCH_PACKED_STEP", "1").lower() not in ("0", "", "false", "no", "off")
# The fewest weights a product packs: base Marian's smallest (512 x 512). A oneDNN call's host
# cost is repaid by a product that streams from memory, not by small ones that stay in the caches:
# with every product packed, a d_model 128 model's greedy step took 20% longer, a d_model 256
# one's 12% less (V 8000, one thread), base size's 16-27% less.
MIN_ELEMENTS = 512 * 512
_LOCK = threading.Lock()  # one packing at a time per process: two searches starting together share it
# model -> its `Packed`, beside the model rather than in it: a deepcopy, a pickle or `torch.save` of
# the module never meets the packed (opaque) tensors, and they go with the model.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def available(model) -> bool:
    """Whether `model`'s cached steps may multiply packed weights now (the module docstring's "When")."""
    if not (ENABLED and model.device.type == "cpu" and model.dtype == torch.float32
            and model.param_dtype == torch.float32 and torch.backends.mkldnn.is_available()):
        return False
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        return False
    return not _hooked(model.decoder)


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook would run on `module` or one of its modules (the copy would skip it)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W (d_in, d_out) in oneDNN's blocked layout for `linear` (`_linear_pointwise` takes
    nn.Linear's (d_out, d_in)); packed without a batch-size hint: one packing serves every N
    (measured: the hint changed no time and no bit for N = 8, 32 and 256)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().T.contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W + b for x (..., d_in) and W packed by `pack`: (..., d_out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """A `Linear` whose weight is oneDNN-packed: the same y = x W + b. The bias is the Linear's own
    parameter, read at each call."""

    def __init__(self, source: nn.Module, packed: torch.Tensor):
        super().__init__()
        self.__dict__["source"] = source  # not a submodule: the copy holds no parameter of its own
        self.packed = packed

    def extra_repr(self) -> str:
        return f"packed {tuple(self.packed.shape)} (d_out, d_in)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.source.bias)


class Fused:
    """Projections of one input as one product, x [W_q W_k W_v] + [b_q b_k b_v] (self-attention's
    three; cross-attention's k and v, of the memory): read from one packed weight, each column's
    sum the same as in its own product (measured bit for bit, N = 8 and 32). The `FusedPart`s that
    stand in for the Linears ask it for their part; the product is taken once per input."""

    def __init__(self, sources: list[nn.Module], packed: torch.Tensor):
        self.sources, self.packed = sources, packed
        self.width = sources[0].weight.shape[1]
        self.bias = None
        self.last = None  # (x, its three parts): the input the product was last taken of

    def refresh(self) -> None:
        """The biases concatenated again (each search: they are small, and a parameter like any other)."""
        biases = [m.bias for m in self.sources]
        present = [b for b in biases if b is not None]
        self.bias = None if not present else torch.cat(
            [(b if b is not None else present[0].new_zeros(self.width)).detach() for b in biases])
        self.last = None

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.last is None or self.last[0] is not x:
            self.last = (x, linear(x, self.packed, self.bias).split(self.width, dim=-1))
        return self.last[1]


class FusedPart(nn.Module):
    """One Linear of a `Fused` group (`index`: its place in the group, q, k, v or k, v)."""

    def __init__(self, fused: Fused, index: int):
        super().__init__()
        self.__dict__["fused"] = fused
        self.index = index

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused product {tuple(self.fused.packed.shape)} (d_out, d_in)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.parts(x)[self.index]


def step_products(decoder: nn.Module) -> dict[int, list[nn.Module]]:
    """The products a search takes with the decoder's weights, as the `Linear`s each reads: per
    layer, self-attention's q, k and v in one (keyed by the attention) and cross-attention's k and v
    in one (`start_cache`, once per source); one for every other Linear, keyed by itself. A subclass
    of Linear (whose forward may be another) is left as it is, and so is a group whose Linears are
    not all plain ones of one shape."""
    skipped, products = set(), {}
    for layer in decoder.layers:
        for attention, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.cross_attn, ("k_proj", "v_proj"))):
            group = [getattr(attention, name) for name in names]
            if all(is_linear(m) for m in group) and len({m.weight.shape for m in group}) == 1:
                products[id(attention)] = group
                skipped.update(map(id, group))
    for m in decoder.modules():
        if is_linear(m) and id(m) not in skipped:
            products[id(m)] = [m]
    return {key: group for key, group in products.items() if sum(m.weight.numel() for m in group) >= MIN_ELEMENTS}


def is_linear(module: nn.Module) -> bool:
    """Whether `module` is exactly model.py's `Linear` (by name: model.py imports this module)."""
    return (type(module).__module__, type(module).__qualname__) == ("impl_torch.model", "Linear")


def _copy_tree(module: nn.Module, replaced: dict, classes: dict) -> nn.Module:
    """`module` copied with each module in `replaced` (by id) swapped; every other module is a
    shallow copy that shares its parameters and buffers (the same dicts), so a change to them is
    seen, of the class `classes` gives it (by id), else of its own."""
    if id(module) in replaced:
        return replaced[id(module)]
    clone = copy.copy(module)  # a new __dict__ holding the same _parameters and _buffers dicts
    clone._modules = {name: None if child is None else _copy_tree(child, replaced, classes)
                      for name, child in module._modules.items()}
    if id(module) in classes:
        clone.__class__ = classes[id(module)]
    return clone


class GroupedBeams:
    """A cross-attention (mixed into model.py's MultiHeadAttention, `grouped`) whose cached keys
    and values are the memory's once per source (B rows) while its queries come once per beam,
    N = B x beams rows, source-major: the beams of a source are taken as that source's queries,
    x (N, 1, D) as (B, beams, D), and the result read back as (N, 1, D). Each query's attention is
    the same softmax(q K^T / sqrt(K)) V over the same keys (cross-attention has no mask between
    queries); a step reads each source's keys and values once instead of once per beam. Measured
    in a base beam-4 step (one thread): a layer's cross-attention took 0.7 ms with the keys and
    values repeated per beam, read from memory after the step's weights had passed through the
    caches, against 0.2 ms when they are cache-hot: it is their traffic, 4 MB a layer and step."""

    def forward(self, x, memory, mask, **options):
        cache = options.get("cache")
        if cache is None or options.get("return_attention", True):
            return super().forward(x, memory, mask, **options)
        rows = cache.keys_values(self, memory)[0].shape[0]  # the keys' rows: B, or N as the queries'
        if rows == x.shape[0]:
            return super().forward(x, memory, mask, **options)
        out, weights = super().forward(x.reshape(rows, -1, x.shape[-1]), memory, mask, **options)  # (B, beams, D)
        return out.reshape(x.shape), weights  # (N, 1, D); weights None


_GROUPED: dict[type, type] = {}


def grouped(base: type) -> type:
    """`base` (model.py's MultiHeadAttention) with `GroupedBeams` mixed in, one class per base."""
    if base not in _GROUPED:
        _GROUPED[base] = type(f"Grouped{base.__name__}", (GroupedBeams, base), {"__module__": __name__})
    return _GROUPED[base]


def is_attention(module: nn.Module) -> bool:
    """Whether `module` is exactly model.py's `MultiHeadAttention` (by name, as `is_linear`)."""
    return (type(module).__module__, type(module).__qualname__) == ("impl_torch.model", "MultiHeadAttention")


def groups_beams(decoder: nn.Module | None) -> bool:
    """Whether `decoder` (a copy from `packed_step`) takes every cross-attention's keys and values
    once per source (`GroupedBeams`): `start_cache` then keeps them unrepeated."""
    return decoder is not None and all(isinstance(layer.cross_attn, GroupedBeams) for layer in decoder.layers)


def will_group_beams(model) -> bool:
    """Whether a search of `model` started now would run a copy that `groups_beams`."""
    return available(model) and packable(model) and all(is_attention(layer.cross_attn) for layer in model.decoder.layers)


def stored_output(model) -> torch.Tensor:
    """W_out's parameter: `output.weight` (D, V), or the tied embedding (V, D)."""
    return model.target_embedding.weight if model.config.tie_output else model.output.weight


def unchanged(parameter: torch.Tensor, snapshot: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether `now` is `parameter`, the tensor packed, of the same dtype, shape and device, and
    holds the snapshot's values bit for bit (a +0.0 written over a -0.0 counts as a change)."""
    if now is not parameter or now.dtype != snapshot.dtype or now.shape != snapshot.shape \
            or now.device != snapshot.device:
        return False
    return same_bytes(now.detach(), snapshot)


def _memcmp():
    """The C library's memcmp, or None where ctypes cannot find it."""
    import ctypes
    import ctypes.util

    try:
        library = ctypes.CDLL(ctypes.util.find_library("c") or None) if os.name != "nt" else ctypes.cdll.msvcrt
        function = library.memcmp
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return function


_MEMCMP = _memcmp()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU tensors of one dtype and shape hold the same bytes: memcmp over contiguous
    memory (base Marian's 150 MB of step weights against their snapshots: 11 ms, one thread,
    where `torch.equal` of int32 views took 29 ms), else `torch.equal` of integer views."""
    if _MEMCMP is not None and a.is_contiguous() and b.is_contiguous():
        return _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


class Packed:
    """A model's packed step: the decoder copy, W_out packed, and what each was packed from."""

    def __init__(self):
        # key -> (parameters, their snapshots, the packed weight): a product's key from
        # `step_products`, W_out's the model's id
        self.held: dict[int, tuple] = {}
        self.decoder = None
        self.fused: list[Fused] = []
        self.tree = None  # the module tree the copy mirrors (ids)

    def refresh(self, model) -> None:
        """Packs again every weight whose parameter changed since it was packed (module docstring)."""
        products = step_products(model.decoder)
        wanted = {key: [m.weight for m in linears] for key, linears in products.items()}
        if stored_output(model).numel() >= MIN_ELEMENTS:
            wanted[id(model)] = [stored_output(model)]
        changed = False
        for key, parameters in wanted.items():
            held = self.held.get(key)
            if held is None or len(held[0]) != len(parameters) or not all(
                    unchanged(*old, now) for old, now in zip(zip(held[0], held[1]), parameters)):
                snapshots = [p.detach().clone() for p in parameters]
                if key == id(model):  # (d_in, d_out): the tied embedding (V, D) read transposed
                    weight = snapshots[0].T if model.config.tie_output else snapshots[0]
                else:
                    weight = snapshots[0] if len(snapshots) == 1 else torch.cat(snapshots, dim=1)
                self.held[key] = (parameters, snapshots, pack(weight))
                changed = True
        for key in set(self.held) - set(wanted):
            del self.held[key]
        tree = tuple(map(id, model.decoder.modules()))
        if changed or tree != self.tree:
            replaced, self.fused = {}, []
            for key, linears in products.items():
                if len(linears) == 1:
                    replaced[key] = PackedLinear(linears[0], self.held[key][2])
                else:
                    fused = Fused(linears, self.held[key][2])
                    replaced.update((id(m), FusedPart(fused, i)) for i, m in enumerate(linears))
                    self.fused.append(fused)
            classes = {id(layer.cross_attn): grouped(type(layer.cross_attn)) for layer in model.decoder.layers
                       if is_attention(layer.cross_attn)}
            self.decoder = _copy_tree(model.decoder, replaced, classes)
            self.tree = tree
        for fused in self.fused:
            fused.refresh()


def packable(model) -> bool:
    """Whether any product is large enough to pack (`MIN_ELEMENTS`), and every weight the search
    would pack is a plain float32 CPU tensor (not a DTensor shard, say)."""
    weights = [m.weight for linears in step_products(model.decoder).values() for m in linears]
    if stored_output(model).numel() >= MIN_ELEMENTS:
        weights.append(stored_output(model))
    return bool(weights) and all(type(w.detach()) is torch.Tensor and w.layout == torch.strided for w in weights)


def packed_step(model) -> tuple[nn.Module | None, torch.Tensor | None]:
    """(the decoder copy a search runs, W_out packed) for this search, both up to date; W_out None
    where it is too small to pack, and (None, None) where packing does not apply (`available`,
    `packable`)."""
    if not available(model) or not packable(model):
        if model.device.type != "cpu" or model.dtype != torch.float32:
            release(model)  # moved or recast: what was packed is of no further use
        return None, None
    with _LOCK, torch.inference_mode():
        held = _PACKED.get(model)
        if held is None:
            held = _PACKED[model] = Packed()
        held.refresh(model)
        output = held.held.get(id(model))
        return held.decoder, None if output is None else output[2]


def release(model) -> None:
    """Drop the model's packed weights and their snapshots (the next search packs them again)."""
    with _LOCK:
        _PACKED.pop(model, None)


def product(y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """y @ W_out (..., V) for W_out packed by `packed_step`."""
    return linear(y, packed, None)
