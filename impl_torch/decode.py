"""Decoding with the PyTorch model: the KV cache, the cached step and the search driver.

The decode room beside `model.py`, as Flax `examples/wmt` keeps `decode.py` beside `models.py`.
`model.py` holds the math; a cached step runs the very same decoder layers (`DecoderLayer.__call__`,
`MultiHeadAttention.__call__`) on one new position, with each attention's keys and values taken
from the cache instead of projected from a whole prefix:

- self-attention: the new position's key and value are projected as usual, written into the
  layer's buffers at `cache.length`, and the query attends to the positions so far (`Written`);
- cross-attention: the memory's keys and values, projected once per source (`Projected`).

`Model.start_cache`, `Model.decode_step`, `Model.reorder_cache` and `Model.generate` are the
public surface and call the functions here. The choice of tokens is written once, as the
reference in `conformance.core.generation.search` and for the device in `conformance.core.generation.device`,
which `generate` runs in this backend's arrays (docs/decoding.md).

Sections, in the same order in every backend: masks, the cache, the step, the search.
"""

from __future__ import annotations

import os

import torch

from conformance.core.config import ModelConfig
from conformance.core.generation.search import DecoderCache, uniforms
from conformance.core.generation.settings import check_sources
from conformance.core.generation.device import NumpyOps, newest, prefix, processor_data, rules_of, run, sampling_data
from conformance.core.inputs import check_generate
from conformance.core.output import Encoded, ModelOutput
from impl_torch import graphs, packed
from impl_torch.arrays import to_numpy
from impl_torch.fused import kernel_fix_ups

# -- Masks -------------------------------------------------------------------------------------


def step_mask(config: ModelConfig, tgt_ids: torch.Tensor, position: int) -> torch.Tensor:
    """(B, 1, 1, T): row `position` of `target_mask`, what the newest position may attend to.

    A cached decoding step has one query, at `position`; its keys are the positions so far.
    """
    tgt_pad = (tgt_ids != config.pad_id)[:, None, None, :]  # (B, 1, 1, T): the keys' padding
    if config.tgt_pad_mask == "queries":
        tgt_pad = tgt_pad[:, :, :, position:position + 1]  # (B, 1, 1, 1): the query's own padding
    elif config.tgt_pad_mask == "none":
        tgt_pad = tgt_pad | True
    return tgt_pad & (torch.arange(tgt_ids.shape[1], device=tgt_ids.device) <= position)  # (B, 1, 1, T)


# -- The cache ---------------------------------------------------------------------------------


class Written:
    """Layer i's self-attention keys and values for a cached step: the new position's, projected
    from `memory` (B, 1, D), are written at `cache.length`; the positions so far are attended to."""

    fix_ups = None  # the fused kernel's (model.fast_attention): they change with every step

    def __init__(self, cache: DecoderCache, i: int):
        self.cache, self.i = cache, i

    def keys_values(self, attention, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache, i, t = self.cache, self.i, self.cache.length
        k, v = attention.keys_values(memory)  # (B, H, 1, K)
        cache.keys[i][:, :, t:t + 1] = k  # one slice and one copy each, where [:, :, t] takes two selects
        cache.values[i][:, :, t:t + 1] = v
        return cache.keys[i][:, :, :t + 1], cache.values[i][:, :, :t + 1]  # (B, H, t + 1, K)


class Projected:
    """Layer i's cross-attention keys and values: the memory's, projected once per source."""

    def __init__(self, cache: DecoderCache, i: int):
        self.cache, self.i = cache, i
        # The fused kernel's mask and fix-ups (model.fast_attention) depend only on the values and
        # the source mask, so `start_cache` works them out once per source.
        self.fix_ups = None if cache.cross_fix_ups is None else cache.cross_fix_ups[i]

    def keys_values(self, attention, memory) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.cross_keys[self.i], self.cache.cross_values[self.i]  # (B, H, S, K)


def layer_caches(cache: DecoderCache) -> list[tuple[Written, Projected]]:
    """Where each decoder layer's two attentions take their keys and values from in a cached step."""
    return [(Written(cache, i), Projected(cache, i)) for i in range(len(cache.keys))]


def start_cache(model, encoded: Encoded, length: int, *, rows=None) -> DecoderCache:
    """An empty cache for up to `length` positions against `encoded` (one row per decoder row).

    `rows` (keyword-only; `generate`): (N,) the source row of each decoder row, source-major, where
    `encoded` holds each source once: the memory's keys and values are projected once per source
    (a beam-4 search projected 4x the rows) and repeated, or, where the step's copy of the decoder
    groups the beams (`packed.GroupedBeams`), kept once per source with the source mask."""
    config = model.config
    # On the CPU in float32, the search's products by oneDNN-packed weights (impl_torch/packed.py),
    # and its cross-attentions read the memory's keys and values once per source (packed.GroupedBeams).
    step_decoder, output_weight = packed.packed_step(model)
    repeat = rows is not None and not packed.groups_beams(step_decoder)
    batch = encoded.memory.shape[0] if rows is None else rows.shape[0]
    shape = (batch, config.n_heads, length, config.head_dim)  # (N, H, L, K)
    src_mask = encoded.src_mask[rows] if repeat else encoded.src_mask
    cache = DecoderCache(keys=[], values=[], cross_keys=[], cross_values=[],
                         tgt_ids=torch.full((batch, length), config.pad_id, dtype=torch.long, device=model.device),
                         cross_mask=src_mask if config.cross_attn_src_mask else None, step_decoder=step_decoder,
                         output_weight=step_output_weight(model) if output_weight is None else output_weight)
    for layer in (model.decoder if step_decoder is None else step_decoder).layers:
        cache.keys.append(torch.zeros(shape, dtype=model.dtype, device=model.device))
        cache.values.append(torch.zeros(shape, dtype=model.dtype, device=model.device))
        k, v = layer.cross_attn.keys_values(encoded.memory)  # (B, H, S, K)
        cache.cross_keys.append(k[rows] if repeat else k)  # (N, H, S, K), or (B, H, S, K) grouped
        cache.cross_values.append(v[rows] if repeat else v)
    cache.cross_fix_ups = cross_fix_ups(model, cache)
    return cache


def cross_fix_ups(model, cache: DecoderCache) -> list[tuple]:
    """Each layer's `kernel_fix_ups` of its cross-attention, worked out once per source instead of
    at every step (a mean of the values over every source position, a NaN test, the mask's empty
    rows: 7 ops per layer and step). Where nothing is to be replaced (no NaN value, no source row
    without keys: every source `generate` accepts), the replacement is dropped, after one host
    read for all layers, and a step's cross-attention is the kernel alone."""
    fix_ups = [kernel_fix_ups(v, cache.cross_mask, model.config.mask_fill, layer.cross_attn.empty_rows)
               for layer, v in zip(model.decoder.layers, cache.cross_values)]
    fixes = [fix.any() for _, fix, _ in fix_ups if fix is not None]  # none without a mask
    if not fixes or not torch.stack(fixes).any().item():
        fix_ups = [(mask, None, None) for mask, _, _ in fix_ups]
    return fix_ups


# `ROSETTA_TORCH_STEP_OUTPUT_COPY=0`: the steps multiply by the stored tied weight (no copy).
STEP_OUTPUT_COPY = os.environ.get("ROSETTA_TORCH_STEP_OUTPUT_COPY", "1").lower() not in ("0", "", "false", "no", "off")


def step_output_weight(model):
    """A tied W_out as a contiguous (D, V) copy for the steps of one search on the CPU, or None
    (the steps multiply by the stored weight).

    Tied to the embedding, W_out is the embedding's (V, D) read transposed. A step multiplies it
    by a few rows (N, D): a matrix-vector product that streams the whole weight once, and this
    torch's BLAS (MKL, on this machine's AMD EPYC) streams the transposed layout at about half
    the speed of a (D, V) one. Base Marian (V 32000, D 512), float32, one thread: one row 7-12 ms
    against 5-6 ms, eight rows 15-22 against 13-15 ms. The copy costs about 90 ms there (65 MB,
    fresh pages included), what some 15 steps save: a shorter search pays up to that much more.
    A copy per search, not one kept on the model, so that a change to the weight between searches
    (`.data` included) is seen; a search driven by hand that changes the weight between its steps
    keeps the copy it started with. Only for float32 and float64 weights (where BLAS runs it; the
    measurements are float32's), outside autograd (a step recorded for a gradient multiplies the
    stored weight, which the gradient reaches), and not on CUDA, where cuBLAS reads both layouts
    alike and a CUDA graph reads the stored weight (impl_torch/graphs.py). The logits are the
    stored weight's to float rounding (a GEMV's sums in another order)."""
    config = model.config
    if not (STEP_OUTPUT_COPY and config.tie_output and model.device.type == "cpu"):
        return None
    weight = model.target_embedding.weight
    if weight.dtype not in (torch.float32, torch.float64) or (torch.is_grad_enabled() and weight.requires_grad):
        return None
    return weight.detach().T.contiguous()  # (D, V)


def reorder_cache(model, cache: DecoderCache, rows, *, into: DecoderCache | None = None) -> DecoderCache:
    """The cache of the rows `rows` (N,), in that order: beam search continues row rows[i] in row i.

    `into` (keyword-only; `generate`): a cache of the same shapes that nothing reads any more (the
    one before `cache`), whose buffers receive the rows instead of new ones. On the CPU a new
    buffer's pages are mapped as they are first written, and a step writes into every one of them:
    12 fresh (32, 8, 65, 64) buffers took 12 ms a step to reorder, written over, 4 ms (base size,
    beam 4, position 32, one thread)."""
    rows = torch.as_tensor(rows, device=model.device)

    def rows_of(buffer: torch.Tensor, rows: torch.Tensor, length: int, out: torch.Tensor | None) -> torch.Tensor:
        # buffer[rows] (N, H, L, K) where it was written, positions < `length`; the positions after
        # are left unwritten, since a step writes position `length` before any query reads it. One
        # `index_select` of the written prefix: gathering the whole buffer by advanced indexing took
        # about 9x as long at half the length (0.9 ms against 0.1 ms, (32, 8, 64, 64) float32, this
        # CPU), a tenth of a base-size beam-4 step.
        out = buffer.new_empty((rows.shape[0],) + buffer.shape[1:]) if out is None else out  # (N, H, L, K)
        if buffer.requires_grad and torch.is_grad_enabled():  # out= takes no part in autograd
            out[:, :, :length] = buffer[:, :, :length].index_select(0, rows)
        else:
            torch.index_select(buffer[:, :, :length], 0, rows, out=out[:, :, :length])
        return out

    # One reorder per buffer (2 x layers ops). Buffers stacked into one (2, layers, N, H, L, K)
    # tensor would take one index_select, along axis 2, but on this CPU that was 7x slower (39 ms
    # against 5.7 ms for all 12 buffers, (32, 8, 65, 64) float32 with 40 positions written).
    spare_keys = [None] * len(cache.keys) if into is None else into.keys
    spare_values = [None] * len(cache.values) if into is None else into.values
    return DecoderCache(keys=[rows_of(k, rows, cache.length, out) for k, out in zip(cache.keys, spare_keys)],
                        values=[rows_of(v, rows, cache.length, out) for v, out in zip(cache.values, spare_values)],
                        cross_keys=cache.cross_keys, cross_values=cache.cross_values,
                        tgt_ids=cache.tgt_ids[rows], cross_mask=cache.cross_mask, length=cache.length,
                        cross_fix_ups=cache.cross_fix_ups, output_weight=cache.output_weight,
                        step_decoder=cache.step_decoder)


# -- The step ----------------------------------------------------------------------------------


def decode_step(model, tgt_ids, cache: DecoderCache) -> torch.Tensor:
    """The next-token logits (B, V) after the newest tokens tgt_ids (B,), at position
    `cache.length`; the cache advances by one. Equals the last row of `decode` on the whole prefix.

    One exception, by design: with position_ids "non-pad" (M2M100) a pad token earlier in the
    prefix is counted by the step, as transformers' cached step counts it, and not by `decode`."""
    tgt_ids = model._ids("tgt_ids", torch.as_tensor(tgt_ids).reshape(-1, 1), model.config.tgt_vocab_size)  # (B, 1)
    return advance(model, tgt_ids[:, 0], cache)


def advance(model, tgt_ids: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
    """`decode_step` without the id checks: tgt_ids (B,) int64 on the model's device, produced by
    the search (checking them would read them back to the host at every step)."""
    config = model.config
    tgt_ids = tgt_ids[:, None]  # (B, 1)
    t = cache.length
    cache.tgt_ids[:, t] = tgt_ids[:, 0]
    # With tgt_pad_mask "none" every position so far is a key: no mask (the kernel is then spared
    # the mask, and fast_attention its test for queries without keys).
    self_mask = None if config.tgt_pad_mask == "none" else step_mask(config, cache.tgt_ids[:, :t + 1], t)
    y = model.embed(tgt_ids, model.target_embedding, model.decoder.position, model.decoder.embedding_norm,
                    at=t, combine=model.decoder.embedding_sum)  # (B, 1, D)
    scratch = ModelOutput(logits=None)  # what the layers record, dropped
    scores_dtype = torch.promote_types(y.dtype, torch.float32)  # model.scores_dtype (model.py imports this module)
    bias = model.decoder.position.score_bias(1, t + 1, scores_dtype, first_query=t)  # (1, H, 1, t + 1), or None
    decoder = model.decoder if cache.step_decoder is None else cache.step_decoder  # the same layers, packed products
    y = decoder(y, None, self_mask, cache.cross_mask, scratch, bias=bias, return_attention=False,
                cache=layer_caches(cache))
    logits = model.logits(y, weight=cache.output_weight)[:, 0]  # (B, V)
    cache.length = t + 1
    return logits


# -- The search --------------------------------------------------------------------------------


class Ops(NumpyOps):
    """The array operations of the device search (`conformance.core.generation.device`) in this
    backend's arrays."""

    xp = torch
    int_dtype = torch.long
    bool_dtype = torch.bool
    sorted_top_k = 256  # the longest row `top_k` sorts whole (one stable sort) instead of two top-ks

    def __init__(self, device):
        self.device = torch.device(device)
        # On the CPU a host read is cheap (no queue to drain), so `top_k` and `ban` may look at the
        # data to skip work; on a GPU they stay branch-free (a test turns this off on the CPU too).
        self.host_reads = self.device.type == "cpu"
        self.descending = {}  # m -> m - arange(m), the tie key of `top_k`, made once per search
        self.banned = None, None  # `ban`'s last (V,) mask and its columns, found once per search

    def top_k(self, x, k: int):
        # The reference's order: the best first, equal scores the lower index first, and a NaN
        # score (a +inf logit makes its beam's log-softmax NaN, and the search goes on) after every
        # number, as NumPy's stable argsort of -x puts it. torch.topk and a descending sort rank
        # NaN first, and torch.topk says neither which of equal scores it keeps nor in what order.
        m = x.shape[-1]
        if m <= self.sorted_top_k:
            # A short row (beam search's 2 x beams open candidates, its 3 x beams finished ones):
            # one stable ascending sort of -x is the reference's order itself, in a few ops
            # instead of about 20. The key's zeros are made +0.0 and its NaNs +NaN: a sort on the
            # raw bits (CUDA's radix sorts) would put -0.0 before 0.0 and a NaN with its sign bit
            # set first, where a comparison sort sees equal zeros and NaN above +inf.
            key = torch.where(x.isnan(), torch.nan, 0.0 - x)  # 0.0 - x: -x, with +0.0 for either zero
            index = torch.sort(key, dim=-1, stable=True).indices[..., :k]
            return x.gather(-1, index), index
        if self.host_reads and k < m:
            # The k + 1 best show whether any score equal to the k-th best was left out. Where none
            # was (in every row), torch's k best are the reference's k, and only their order among
            # equal scores remains to be set: two sorts of k entries, instead of the tie key's
            # passes over all m scores and a second top-k (3 of a base beam-4 step's ~45 ms).
            values, index = torch.topk(x, k + 1, dim=-1)  # (..., k + 1), best first; NaN counts as largest
            has_nan, has_tie = torch.stack([values.isnan().any(), (values[..., k] == values[..., k - 1]).any()]).tolist()
            if not has_nan and not has_tie:
                index, _ = torch.sort(index[..., :k], dim=-1)
                values, order = torch.sort(x.gather(-1, index), dim=-1, descending=True, stable=True)
                return values, index.gather(-1, order)
        # Branch-free: NaN counts as -inf, below which it is put back at the end. Every score above
        # the k-th best is among torch's best k; of those equal to it, the k lowest indices join
        # them (a second top-k over a key: m - index + m where x equals it, m - index where it is
        # NaN and the k-th best is -inf, else 0); then (score, NaN, index) order picks the k.
        nan = x.isnan()
        ranked = torch.where(nan, -torch.inf, x)
        values, index = torch.topk(ranked, k, dim=-1)  # (..., k), best first
        if k < m:
            threshold = values[..., -1:]
            if m not in self.descending:
                self.descending[m] = m - torch.arange(m, device=x.device)
            key = torch.where(ranked == threshold, self.descending[m] + torch.where(nan, 0, m), 0)
            top = torch.topk(key, k, dim=-1).values  # (..., k)
            lowest = torch.where(top > m, 2 * m - top, m - top)  # their indices; m where fewer are equal
            index = torch.cat([torch.where(values > threshold, index, m), lowest], dim=-1)
        index, _ = torch.sort(index, dim=-1)  # m (no candidate) last
        inside = index.clamp(max=m - 1)
        late = torch.where(index < m, nan.gather(-1, inside), True)  # NaN and no candidate after the numbers
        index = index.gather(-1, torch.sort(late.to(torch.uint8), dim=-1, stable=True).indices)
        inside = index.clamp(max=m - 1)
        values = torch.where(index < m, ranked.gather(-1, inside), -torch.inf) + 0.0  # one zero (short rows' note)
        order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
        # At least k scores are the k-th best or better, so no m is among the first k.
        index = inside.gather(-1, order)
        return x.gather(-1, index), index

    def sort(self, x):
        return torch.sort(x, dim=-1, stable=True)

    def cumsum(self, x):
        return torch.cumsum(x, dim=-1)

    def log_softmax(self, x):
        return torch.log_softmax(x, dim=-1)  # one fused pass instead of five

    def take(self, x, index):
        index = index.reshape(index.shape + (1,) * (x.ndim - 2)).expand(index.shape + x.shape[2:])
        return torch.gather(x, 1, index)

    def cast(self, x, dtype):
        return torch.as_tensor(x, device=self.device).to(dtype)

    def full(self, shape, value, dtype):
        return torch.full(shape, value, dtype=dtype, device=self.device)

    def arange(self, n: int):
        return torch.arange(n, device=self.device)

    def concat(self, arrays):
        return torch.cat(arrays, dim=1)

    def reduce(self, name: str, x, axis=None, keepdims: bool = False):
        function = {"max": torch.amax, "min": torch.amin, "sum": torch.sum, "any": torch.any, "all": torch.all}[name]
        if axis is None:
            return function(x)
        return function(x, dim=axis, keepdim=keepdims)

    def argmax(self, x):
        # max's indices: the first of equal maxima, as argmax's (both documented so), and on the CPU
        # about a third of argmax's time over (8, 32000) float32
        return torch.max(x, dim=-1).indices

    def ban(self, scores, banned, owned: bool):
        if banned.ndim == 1 and self.host_reads:
            # The few banned columns written (found once per mask: `nonzero` would wait for a GPU),
            # instead of a `where` over every score; into the step's own array where it is one.
            if self.banned[0] is not banned:
                self.banned = banned, banned.nonzero()[:, 0]
            columns = self.banned[1]
            return scores.index_fill_(-1, columns, -torch.inf) if owned else scores.index_fill(-1, columns, -torch.inf)
        return scores.masked_fill_(banned, -torch.inf) if owned else torch.where(banned, -torch.inf, scores)

    def accumulate(self, owned, other):
        return owned.add_(other) if other.dtype == owned.dtype else owned + other

    def where(self, condition, a, b):
        if isinstance(condition, bool):
            return a if condition else b
        return torch.where(condition, a, b)

    def mark(self, index, size: int):
        out = torch.zeros((index.shape[0], size), dtype=torch.bool, device=index.device)
        return out.scatter_(-1, index, True)


def search_dtype(model):
    """The dtype the search scores in: float64 for a float64 model, else float32 (as Hugging Face
    upcasts float16 and bfloat16 logits)."""
    return torch.float64 if model.dtype == torch.float64 else torch.float32


def generate(model, src_ids, max_len=None, bos_id=None, eos_id=None, **options):
    """`Model.generate`: the arguments resolved against the checkpoint's generation note, the source
    encoded once, then the search of `conformance.core.generation.device` in this backend's arrays on
    the step logits (cached, or the whole decoder over the prefix with use_cache=False)."""
    settings = check_generate(model.config, max_len, bos_id, eos_id, **options)
    with torch.inference_mode():
        encoded = model.encode(src_ids, return_attention=False)
        check_sources(to_numpy(encoded.src_mask))  # a row of padding only is refused
        batch = encoded.memory.shape[0]
        rows = torch.arange(batch, device=model.device).repeat_interleave(settings.rows)  # (N,): per beam or sample
        # On the CPU, the memory's keys and values are projected once per source, then repeated (a
        # GPU's path, its CUDA graphs included, projects the repeated memory as it did: not run on one since).
        once = settings.use_cache and settings.rows > 1 and model.device.type == "cpu"
        ops, dtype, rules = Ops(model.device), search_dtype(model), rules_of(settings)
        # This backend's own step without the id checks (they would read the ids back to the host
        # every step); a subclass's decode_step (torch.compile'd, say) is called as it is.
        own = getattr(type(model).decode_step, "__module__", None) == __name__.rsplit(".", 1)[0] + ".model"
        # Beam search's first step on one row per source where the packed copy reads a source's
        # memory once for all its beams (packed.GroupedBeams): every beam holds the start token
        # then, so a source's rows have the same logits (CTranslate2 on the CPU does the same); the
        # first reorder then reads the cache by source. A 32-row step of base Marian is 8 rows' 4x.
        alone = once and own and rules.beams and packed.will_group_beams(model)
        if once:
            cache = {"now": start_cache(model, encoded, settings.max_len, rows=None if alone else rows)}
            if alone and not packed.groups_beams(cache["now"].step_decoder):  # packing did not apply after all
                alone, cache["now"] = False, start_cache(model, encoded, settings.max_len, rows=rows)
        else:
            encoded = Encoded(memory=encoded.memory[rows], src_mask=encoded.src_mask[rows])
            cache = {"now": start_cache(model, encoded, settings.max_len) if settings.use_cache else None}
        # On a GPU, the same step replayed from CUDA graphs once its shapes recur (impl_torch/graphs.py).
        room = graphs.room_for(model, cache["now"], advance) if settings.use_cache and own else None

        def step(state, i: int) -> torch.Tensor:
            if not settings.use_cache:
                return model.decode(prefix(ops, rules, state, i), encoded, return_attention=False).logits[:, -1]
            if room is not None:
                return room.step(i, newest(ops, rules, state), state["parents"] if settings.num_beams > 1 and i > 0
                                 else None)
            if settings.num_beams > 1 and i > 0:
                # On the CPU, the cache before the last is read no more: its buffers take this reorder's rows.
                spare = cache.get("spare") if model.device.type == "cpu" else None
                first = alone and i == 1  # the cache holds one row per source: a parent's row is its source's
                parents = state["parents"] // settings.num_beams if first else state["parents"]
                cache["now"], cache["spare"] = reorder_cache(model, cache["now"], parents, into=spare), \
                    None if first else cache["now"]
            ids = newest(ops, rules, state)
            if alone and i == 0:  # (B, V) of beam 0's rows, each source's row for all its beams
                return advance(model, ids[::settings.num_beams], cache["now"]).repeat_interleave(settings.num_beams, 0)
            return advance(model, ids, cache["now"]) if own else model.decode_step(ids, cache["now"])  # (N, V)

        source = to_numpy(torch.as_tensor(src_ids)) if settings.reads_source else None  # as given, padding included
        ids, scores, no_speech = driven(ops, rules, step, batch, settings, model.config.pad_id,
                                        model.config.tgt_vocab_size, dtype, mask_fill=model.config.mask_fill,
                                        src_ids=source)
    return settings.returned(ids, scores, no_speech)


def driven(ops, rules, step, batch: int, settings, pad_id: int, vocab_size: int, dtype, mask_fill=None,
           src_ids=None):
    """(ids, scores, each source row's no-speech probability or None) of the device search that
    `step` runs, on the banned mask, sampling's uniforms and the processors' data built from
    `settings` (a `decoding.Generation`) and the source ids `src_ids` (B, S) on the host (read by
    the encoder's processors; None without them).

    Here `step(state, i) -> logits (N, V)` is the decoder's, and `device_search.run` drives the
    steps from a Python loop, with one small host read per step. The arrays live on `ops.device`."""
    device = ops.device
    banned_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # (V,)
    banned_mask[list(settings.banned_ids)] = True
    rows = batch * settings.rows  # N: each source once per beam (or sample)
    drawn = uniforms(settings.seed, settings.max_len, rows) if settings.do_sample else None  # (max_len, N)
    sampling = sampling_data(settings, drawn, lambda name, value: ops.cast(value, dtype) if name == "uniforms"
                             else value)
    # The forced first id, the minimum length and the suppression's step as Python ints; the
    # bad-word table, the penalties (in the search dtype), the masks and the source on the device.
    def as_data(name, value):
        if isinstance(value, int):
            return value
        tensor = torch.as_tensor(value, device=device)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    data = processor_data(settings, as_data, src_ids, vocab_size)

    def read(*arrays) -> list:  # the one small host read per step
        return torch.stack([torch.as_tensor(a, device=device).long() for a in arrays]).tolist()

    records: dict = {}
    ids, scores = run(ops, rules, step, batch, settings.bos_id, settings.eos_id, pad_id, banned_mask,
                      settings.length_penalty, dtype, read, settings.num_return_sequences, sampling,
                      settings.return_scores, data, mask_fill, records)
    return ids, scores, records.get("no_speech_prob")


def search_steps(step, step_data: dict, batch: int, vocab_size: int, pad_id: int, settings, dtype: str = "float64",
                 device=None, src_ids=None):
    """The search `generate` runs, over the next-token logits of any decoder instead of this
    model's: (ids, scores) for `batch` source rows, in this backend's arrays on `device`.

    `step(step_data, ids, position) -> logits (N, V)`: the logits after the newest tokens ids (N,)
    of the N = batch x settings.rows decoder rows (each source's rows together), at decoder
    position `position` (the step); a pure function of its arguments, written in array indexing
    that NumPy, torch and jax.numpy read alike. `step_data` (names to NumPy arrays) is moved to
    the device as data. `settings`: a `decoding.Generation` (`conformance.core.generation.settings.resolve`);
    `dtype` the search dtype's name; `src_ids` (batch, S), the source ids the encoder's processors
    read. The suite drives it with a scripted decoder (conformance/suite/test_search_rules.py);
    `generate` runs the same driver (`driven`). Returns (ids, scores).

    Here `device` is "cpu", "cuda" or a torch.device (default: the CPU), and the search runs under
    `torch.inference_mode`."""
    device = torch.device(device or "cpu")
    ops, rules, dtype = Ops(device), rules_of(settings), getattr(torch, dtype)
    data = {name: torch.as_tensor(value, device=device) for name, value in step_data.items()}
    with torch.inference_mode():
        return driven(ops, rules, lambda state, i: step(data, newest(ops, rules, state), i), batch, settings, pad_id,
                      vocab_size, dtype, src_ids=src_ids)[:2]
