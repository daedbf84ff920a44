"""The cached decoding step's products on the CPU through oneDNN's prepacked float32 linear.

Why. A cached step multiplies a few rows (N = batch x beams) by every weight of the decoder and by
W_out: base Marian streams about 150 MB of float32 weights per step, so a step costs what its GEMMs
take to read them. torch's CPU products run MKL's sgemm, which on this project's AMD EPYC (AVX-512)
read them at about half the speed of oneDNN's inner product on weights packed once into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then `torch.ops.mkldnn._linear_pointwise`,
the pair Inductor's CPU freezing passes use). CTranslate2 runs the same oneDNN sgemm on that CPU.
Measured there (one thread, 6 layers' distinct weights, batch 8): the decoder's 48 products 14 ms
with MKL against 7 ms packed, the output product 10-14 ms against 5 ms (docs/performance.md, issue 57).

What. `step_decoder(model)` is `model.decoder` copied as a tree of modules that shares every
module's parameters and buffers, in which each `Linear` a cached step runs (self-attention's q, k,
v, o; cross-attention's q, o; the feed-forward's) is a `PackedLinear`; its forward is the same
code, `Decoder.forward` and the layers' own. `packed_step` hands it and W_out packed to `start_cache`. The products
are float32 like MKL's, in another summation order: the logits equal the stored weights' to float
rounding (tests/generation/test_packed_step.py), not bit for bit.

Freshness. Packing base Marian's decoder and W_out takes about a tenth of a second, several steps,
so the packed weights are kept with the model and reused by the next search. Each search first
checks that every packed weight's parameter holds, bit for bit, the values it was packed from
(against a snapshot: an in-place write through `.data` bumps no version counter, so the counters
cannot tell), and packs again what changed: about a sixth of a step for base Marian. A parameter
replaced by another tensor, or of another dtype, shape or device, is packed again too.

When. A float32 model on the CPU, parameters stored in float32, oneDNN present, outside autograd
(a step recorded for a gradient multiplies the parameters, which the gradient reaches), no hook
on the decoder's modules (the copy would not run it), and `ROSETTA_TORCH_PACKED_STEP` not 0/off.
Otherwise, and on every other device (CUDA replays its own graphs, impl_torch/graphs.py), the
step runs `model.decoder` and the stored W_out as before.
"""

from __future__ import annotations

import copy
import os
import threading
import weakref

import torch
from torch import nn

ENABLED = os.environ.get("ROSETTA_TORCH_PACKED_STEP", "1").lower() not in ("0", "", "false", "no", "off")
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
    """Self-attention's q, k and v projections of one input as one product, x [W_q W_k W_v] +
    [b_q b_k b_v]: the three are read from one packed weight, and each column's sum is the same
    as in its own product (measured bit for bit, N = 8 and 32). The three `FusedPart`s that stand
    in for q_proj, k_proj and v_proj ask it for their part; the product is taken once per input."""

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
    """q_proj, k_proj or v_proj (`index` 0, 1, 2) of a self-attention whose three are `Fused`."""

    def __init__(self, fused: Fused, index: int):
        super().__init__()
        self.__dict__["fused"] = fused
        self.index = index

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused q/k/v product {tuple(self.fused.packed.shape)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.parts(x)[self.index]


def step_products(decoder: nn.Module) -> dict[int, list[nn.Module]]:
    """The products a cached step takes, as the `Linear`s each reads: one per layer's self-attention
    q, k and v together (keyed by the attention), one for every other Linear the step runs, keyed
    by itself. Not cross-attention's keys and values, which `start_cache` projects once per
    source. A subclass of Linear (whose forward may be another) is left as it is, and so is a
    self-attention whose three are not all plain Linears."""
    skipped = {id(m) for layer in decoder.layers for m in (layer.cross_attn.k_proj, layer.cross_attn.v_proj)}
    products = {}
    for layer in decoder.layers:
        attention = layer.self_attn
        three = [attention.q_proj, attention.k_proj, attention.v_proj]
        if all(is_linear(m) for m in three) and len({m.weight.shape for m in three}) == 1:
            products[id(attention)] = three
            skipped.update(map(id, three))
    for m in decoder.modules():
        if is_linear(m) and id(m) not in skipped:
            products[id(m)] = [m]
    return products


def is_linear(module: nn.Module) -> bool:
    """Whether `module` is exactly model.py's `Linear` (by name: model.py imports this module)."""
    return (type(module).__module__, type(module).__qualname__) == ("impl_torch.model", "Linear")


def _copy_tree(module: nn.Module, replaced: dict) -> nn.Module:
    """`module` copied with each module in `replaced` (by id) swapped; every other module is a
    shallow copy that shares its parameters and buffers (the same dicts), so a change to them is seen."""
    if id(module) in replaced:
        return replaced[id(module)]
    clone = copy.copy(module)  # a new __dict__ holding the same _parameters and _buffers dicts
    clone._modules = {name: None if child is None else _copy_tree(child, replaced)
                      for name, child in module._modules.items()}
    return clone


def stored_output(model) -> torch.Tensor:
    """W_out's parameter: `output.weight` (D, V), or the tied embedding (V, D)."""
    return model.target_embedding.weight if model.config.tie_output else model.output.weight


def unchanged(parameter: torch.Tensor, snapshot: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether `now` is `parameter`, the tensor packed, of the same dtype, shape and device, and
    holds the snapshot's values bit for bit (a +0.0 written over a -0.0 counts as a change)."""
    if now is not parameter or now.dtype != snapshot.dtype or now.shape != snapshot.shape \
            or now.device != snapshot.device:
        return False
    return torch.equal(now.detach().view(torch.int32), snapshot.view(torch.int32))  # float32: 4 bytes


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
            self.decoder = _copy_tree(model.decoder, replaced)
            self.tree = tree
        for fused in self.fused:
            fused.refresh()


def packable(model) -> bool:
    """Whether every weight the step would pack is a plain float32 CPU tensor (not a DTensor shard, say)."""
    weights = [m.weight for linears in step_products(model.decoder).values() for m in linears]
    weights.append(stored_output(model))
    return all(type(w.detach()) is torch.Tensor and w.layout == torch.strided for w in weights)


def packed_step(model) -> tuple[nn.Module, torch.Tensor] | tuple[None, None]:
    """(the decoder copy a cached step runs, W_out packed) for this search, both up to date, or
    (None, None) where the packed step does not apply (`available`)."""
    if not available(model) or not packable(model):
        if model.device.type != "cpu" or model.dtype != torch.float32:
            release(model)  # moved or recast: what was packed is of no further use
        return None, None
    with _LOCK, torch.inference_mode():
        held = _PACKED.get(model)
        if held is None:
            held = _PACKED[model] = Packed()
        held.refresh(model)
        return held.decoder, held.held[id(model)][2]


def release(model) -> None:
    """Drop the model's packed weights and their snapshots (the next search packs them again)."""
    with _LOCK:
        _PACKED.pop(model, None)


def product(y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """y @ W_out (..., V) for W_out packed by `packed_step`."""
    return linear(y, packed, None)
