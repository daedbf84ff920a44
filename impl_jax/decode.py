"""Decoding with the JAX model: the KV cache, the cached step and the search driver.

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

The cache is a fixed-size buffer and the position a traced scalar: `_start_cache`, `_decode_step`
and `_reorder_cache` compile once per (rows, source length, buffer length), whatever the number
of steps (`generate` always asks for config.max_len positions). The buffers keep their full
length L; the positions after `cache.length` are not keys yet and get weight exactly 0
(`real_keys` of the attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.generation.search import DecoderCache, search, uniforms
from conformance.core.generation.settings import check_sources
from conformance.core.generation.device import (NumpyOps, Rules, counter, nan_error, newest, processor_data,
                                                prompt_of, recorded_no_speech, result, rules_of, sampling_data, start,
                                                update, with_records)
from conformance.core.errors import InputError
from conformance.core.inputs import check_generate
from conformance.core.output import Encoded, ModelOutput
from impl_jax import compiled, host
from impl_jax.precision import reduction_dtype

# -- Masks -------------------------------------------------------------------------------------


def step_mask(config: ModelConfig, tgt_ids: jax.Array, position) -> jax.Array:
    """(B, 1, 1, T): row `position` of `target_mask`, what the newest position may attend to.

    A cached decoding step has one query, at `position`; its keys are the positions so far.
    `position` may be traced (one executable serves every step).
    """
    tgt_pad = (tgt_ids != config.pad_id)[:, None, None, :]  # (B, 1, 1, T): the keys' padding
    if config.tgt_pad_mask == "queries":
        tgt_pad = jax.lax.dynamic_slice_in_dim(tgt_pad, position, 1, axis=3)  # (B, 1, 1, 1): the query's own padding
    elif config.tgt_pad_mask == "none":
        tgt_pad = tgt_pad | True
    return tgt_pad & (jnp.arange(tgt_ids.shape[1]) <= position)  # (B, 1, 1, T)


# -- The cache ---------------------------------------------------------------------------------


class Written:
    """Layer i's self-attention keys and values for a cached step: the new position's, projected
    from `memory` (B, 1, D), are written at `cache.length`; the positions so far are attended to."""

    def __init__(self, cache: DecoderCache, i: int):
        self.cache, self.i = cache, i

    def keys_values(self, attention, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        cache, i, t = self.cache, self.i, self.cache.length
        k, v = attention.keys_values(memory)  # (B, H, 1, K)
        cache.keys[i] = jax.lax.dynamic_update_slice_in_dim(cache.keys[i], k, t, axis=2)
        cache.values[i] = jax.lax.dynamic_update_slice_in_dim(cache.values[i], v, t, axis=2)
        return cache.keys[i], cache.values[i]  # (B, H, L, K): the positions after t are not real keys


class Projected:
    """Layer i's cross-attention keys and values: the memory's, projected once per source."""

    def __init__(self, cache: DecoderCache, i: int):
        self.cache, self.i = cache, i

    def keys_values(self, attention, memory) -> tuple[jax.Array, jax.Array]:
        return self.cache.cross_keys[self.i], self.cache.cross_values[self.i]  # (B, H, S, K)


def layer_caches(cache: DecoderCache) -> list[tuple[Written, Projected]]:
    """Where each decoder layer's two attentions take their keys and values from in a cached step."""
    return [(Written(cache, i), Projected(cache, i)) for i in range(len(cache.keys))]


def start_cache(model, encoded: Encoded, length: int) -> DecoderCache:
    """An empty cache for up to `length` positions against `encoded` (one row per decoder row)."""
    host.check_runnable(model.dtype, param_dtype=model.param_dtype)
    cross_mask = encoded.src_mask if model.config.cross_attn_src_mask else None
    (cache,) = compiled.call(model, _start_cache, (encoded.memory, cross_mask), model.device, length=length)
    return cache


def _start_cache(model, memory, cross_mask, *, length: int):
    """The compiled part of `start_cache`."""
    config = model.config
    batch = memory.shape[0]
    shape = (batch, config.n_heads, length, config.head_dim)  # (B, H, L, K)
    cache = DecoderCache(keys=[], values=[], cross_keys=[], cross_values=[],
                         tgt_ids=jnp.full((batch, length), config.pad_id, dtype=jnp.int32),
                         cross_mask=cross_mask, length=jnp.zeros((), dtype=jnp.int32))
    for layer in model.decoder.layers:
        cache.keys.append(jnp.zeros(shape, dtype=model.dtype))
        cache.values.append(jnp.zeros(shape, dtype=model.dtype))
        k, v = layer.cross_attn.keys_values(memory)  # (B, H, S, K)
        cache.cross_keys.append(k)
        cache.cross_values.append(v)
    return (cache,)


def reorder_cache(model, cache: DecoderCache, rows) -> DecoderCache:
    """The cache of the rows `rows` (N,), in that order: beam search continues row rows[i] in row i."""
    (cache,) = compiled.call(model, _reorder_cache, (cache, np.asarray(rows, dtype=np.int32)), model.device)
    return cache


def _reorder_cache(model, cache: DecoderCache, rows):
    """The compiled part of `reorder_cache`."""
    return (DecoderCache(keys=[k[rows] for k in cache.keys], values=[v[rows] for v in cache.values],
                         cross_keys=cache.cross_keys, cross_values=cache.cross_values,
                         tgt_ids=cache.tgt_ids[rows], cross_mask=cache.cross_mask, length=cache.length),)


# -- The step ----------------------------------------------------------------------------------


def decode_step(model, tgt_ids, cache: DecoderCache) -> jax.Array:
    """The next-token logits (B, V) after the newest tokens tgt_ids (B,), at position
    `cache.length`; the cache advances by one. Equals the last row of `decode` on the whole prefix.

    One exception, by design: with position_ids "non-pad" (M2M100) a pad token earlier in the
    prefix is counted by the step, as transformers' cached step counts it, and not by `decode`."""
    tgt_ids = model._ids("tgt_ids", np.asarray(tgt_ids).reshape(-1, 1), model.config.tgt_vocab_size)  # (B, 1)
    if int(cache.length) >= cache.tgt_ids.shape[1]:
        raise InputError("cache", f"is full: it holds {cache.tgt_ids.shape[1]} positions")
    host.check_runnable(model.dtype, param_dtype=model.param_dtype)
    logits, advanced = compiled.call(model, _decode_step, (tgt_ids[:, 0], cache), model.device)
    cache.__dict__.update(advanced.__dict__)  # in place, as in the other backends
    return logits


def _decode_step(model, tgt_ids, cache: DecoderCache):
    """The compiled part of `decode_step`: ids (B,) checked, position traced."""
    config = model.config
    t = cache.length
    cache = DecoderCache(keys=list(cache.keys), values=list(cache.values), cross_keys=cache.cross_keys,
                         cross_values=cache.cross_values, cross_mask=cache.cross_mask, length=t,
                         tgt_ids=jax.lax.dynamic_update_slice_in_dim(cache.tgt_ids, tgt_ids[:, None], t, axis=1))
    self_mask = step_mask(config, cache.tgt_ids, t)  # (B, 1, 1, L)
    written = jnp.arange(cache.tgt_ids.shape[1]) <= t  # (L,): the positions that are keys so far
    y = model.embed(tgt_ids[:, None], model.target_embedding, model.decoder.position, model.decoder.embedding_norm,
                    at=t, combine=model.decoder.embedding_sum)  # (B, 1, D)
    scratch = ModelOutput(logits=None)  # what the layers record, dropped
    bias = model.decoder.position.score_bias(1, cache.tgt_ids.shape[1], reduction_dtype(y.dtype),
                                             first_query=t)  # (1, H, 1, L), or None
    y = model.decoder(y, None, self_mask, cache.cross_mask, scratch, bias=bias, tgt_real=written,
                      cache=layer_caches(cache))
    logits = model.logits(y)[:, 0]  # (B, V)
    cache.length = t + 1
    return logits, cache


# -- The search --------------------------------------------------------------------------------


class Ops(NumpyOps):
    """The array operations of the device search (`conformance.core.generation.device`) in this
    backend's arrays."""

    xp = jnp
    int_dtype = jnp.int32  # int64 would need x64
    bool_dtype = jnp.bool_

    def __init__(self, device):
        self.device = device  # the arrays are traced inside one compiled program: placed by jit

    def top_k(self, x, k: int):
        return jax.lax.top_k(x, k)  # equal elements: the lower index first, as the reference

    def sort(self, x):
        index = jnp.argsort(x, axis=-1, stable=True)
        return jnp.take_along_axis(x, index, axis=-1), index.astype(jnp.int32)

    def cumsum(self, x):
        return jnp.cumsum(x, axis=-1)

    def divide(self, x, y):
        # XLA's algebraic simplifier rewrites x / broadcast(y) as x * broadcast(1 / y), an ulp off
        # the quotient in float64 too, and a length penalty divides whole arrays by one number:
        # finished hypotheses that tie in the reference were ranked in another order. The barrier
        # keeps the division a division (found by conformance/suite/test_search_rules.py).
        return x / jax.lax.optimization_barrier(jnp.broadcast_to(y, jnp.shape(x)))

    def take(self, x, index):
        return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)

    def cast(self, x, dtype):
        return jnp.asarray(x).astype(dtype)

    def full(self, shape, value, dtype):
        return jnp.full(shape, value, dtype=dtype)

    def arange(self, n: int):
        return jnp.arange(n, dtype=jnp.int32)

    def concat(self, arrays):
        return jnp.concatenate(arrays, axis=1)

    def reduce(self, name: str, x, axis=None, keepdims: bool = False):
        return getattr(jnp, name)(x, axis=axis, keepdims=keepdims)

    def argmax(self, x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def where(self, condition, a, b):
        if isinstance(condition, bool):
            return a if condition else b
        return jnp.where(condition, a, b)

    def mark(self, index, size: int):
        rows = jnp.arange(index.shape[0])[:, None]  # (N, 1)
        return jnp.zeros((index.shape[0], size), dtype=jnp.bool_).at[rows, index].set(True)

    def cond(self, condition, if_true, if_false):
        if isinstance(condition, (bool, np.bool_)):
            return if_true() if condition else if_false()
        # One branch runs (a forced prompt step is a few writes; the search's step is the rest). The
        # two return the same state; their leaves are made alike (strong types, the same dtypes).
        true_out, false_out = jax.eval_shape(if_true), jax.eval_shape(if_false)
        dtypes = jax.tree_util.tree_map(lambda a, b: jnp.promote_types(a.dtype, b.dtype), true_out, false_out)

        def alike(function):
            return lambda: jax.tree_util.tree_map(lambda x, dtype: jnp.asarray(x, dtype=dtype), function(), dtypes)

        return jax.lax.cond(condition, alike(if_true), alike(if_false))


def search_dtype(model):
    """The dtype the search scores in: float64 for a float64 model, else float32 (as Hugging Face
    upcasts float16 and bfloat16 logits)."""
    return jnp.float64 if jnp.dtype(model.dtype) == jnp.float64 else jnp.float32


def _search(model, memory, cross_mask, ids, banned, length_penalty, sampling, data, *, rules: Rules):
    """The compiled search: start_cache, then one `lax.while_loop` whose body reorders the cache,
    runs the cached step and updates the search state, until the state says stop (Flax
    examples/wmt's and t5x's shape). One program per (rows, source length, rules); the ids, the
    banned mask, the length penalty, sampling's uniforms and warper settings, the forced first id,
    the minimum length and the bad-word table (`processor_data`, one program per table shape) are
    data."""
    (cache,) = _start_cache(model, memory, cross_mask, length=rules.max_len)

    def reorder(cache, rows):
        (cache,) = _reorder_cache(model, cache, rows)
        return cache

    return (_loop(rules, search_dtype(model), memory.shape[0], lambda tokens, cache: _decode_step(model, tokens, cache),
                  reorder, cache, ids, banned, length_penalty, sampling, data),)


def _loop(rules: Rules, dtype, rows: int, decoder, reorder, carry, ids, banned, length_penalty, sampling, data):
    """The search's `lax.while_loop` over any decoder: `decoder(tokens (N,), carry) -> (logits (N,
    V), carry)`, whose carry (the KV cache) follows the beams by `reorder(carry, rows)` (None: a
    decoder without such state). Returns the search state when it says stop."""
    ops = Ops(None)
    bos_id, eos_id, pad_id = ids[0], ids[1], ids[2]
    state = start(ops, rules, rows // rules.num_beams if rules.beams else rows, bos_id, pad_id, dtype)
    state = with_records(ops, state, data, rows, dtype)
    state[counter(rules)] = jnp.asarray(state[counter(rules)], dtype=jnp.int32)
    state["bad"] = jnp.asarray(-1, dtype=jnp.int32)

    def body(loop_carry):
        state, carry = loop_carry
        if rules.num_beams > 1 and reorder is not None:  # the rows each beam continues (the identity at first)
            carry = reorder(carry, state["parents"])
        logits, carry = decoder(newest(ops, rules, state), carry)
        state = update(ops, rules, state, logits.astype(dtype), banned, eos_id, pad_id, length_penalty, sampling,
                       data=data)
        return state, carry

    state, _ = jax.lax.while_loop(lambda loop_carry: ~loop_carry[0]["stop"], body, (state, carry))
    return state


@functools.partial(jax.jit, static_argnames=("step", "rows", "rules"))
def _search_steps(step_data, ids, banned, length_penalty, sampling, data, *, step, rows: int, rules: Rules):
    """The compiled search over `search_steps`'s decoder: one program per (step, rows, shapes,
    rules), outside `compiled.call` (no model)."""

    def decoder(tokens, position):  # the carry is the position; nothing follows the beams
        return step(step_data, tokens, position), position + 1

    return _loop(rules, length_penalty.dtype, rows, decoder, None, jnp.zeros((), dtype=jnp.int32), ids, banned,
                 length_penalty, sampling, data)


def generate(model, src_ids, max_len=None, bos_id=None, eos_id=None, **options):
    """`Model.generate`: the arguments resolved against the checkpoint's generation note, the source
    encoded once, then the search of `conformance.core.generation.device` in this backend's arrays on
    the step logits (cached, or the whole decoder over the prefix with use_cache=False).

    Here use_cache=False runs the reference search, `conformance.core.generation.search.search`, on the host."""
    # With the cache, the whole search is one compiled lax.while_loop (`_search`): one program per
    # (rows, source length, max_len, rules), and the host reads the result once. Without it, the
    # reference search drives the steps from the host; each new prefix length is a new shape:
    # with `buckets` set, at most len(buckets) + 1 compiles serve every step; without, one per length.
    settings = check_generate(model.config, max_len, bos_id, eos_id, **options)
    encoded = model.encode(src_ids, return_attention=False)
    check_sources(np.asarray(encoded.src_mask))  # a row of padding only is refused
    batch = encoded.memory.shape[0]
    rows = np.repeat(np.arange(batch), settings.rows)  # (N,): each source once per beam (or sample)
    encoded = Encoded(memory=encoded.memory[rows], src_mask=encoded.src_mask[rows])
    if not settings.use_cache:  # the reference search, on the host

        def reference_step(tokens: np.ndarray, parents) -> jax.Array:
            return model.decode(tokens, encoded, return_attention=False).logits[:, -1]  # (N, V)

        found = search(reference_step, batch, settings.max_len, settings.bos_id, settings.eos_id,
                       model.config.pad_id, **settings.search_options(), as_numpy=np.asarray,
                       mask_fill=model.config.mask_fill, src_ids=np.asarray(src_ids))
        ids = jax.device_put(found[0].astype(np.int32), model.device)  # int64 would need x64
        floats = [x if jax.config.jax_enable_x64 else x.astype(np.float32) for x in found[1:]]
        scores, no_speech = (jax.device_put(x, model.device) for x in (floats + [np.zeros(0)])[:2])
        return settings.returned(ids, scores, no_speech)
    host.check_runnable(model.dtype, param_dtype=model.param_dtype)
    ops, dtype, rules = Ops(model.device), search_dtype(model), rules_of(settings)
    cross_mask = encoded.src_mask if model.config.cross_attn_src_mask else None

    def step(*search_data) -> tuple:  # the whole search, one compiled program
        return compiled.call(model, _search, (encoded.memory, cross_mask, *search_data), model.device, rules=rules)

    source = np.asarray(src_ids) if settings.reads_source else None  # the ids as given, padding included
    ids, scores, no_speech = driven(ops, rules, step, batch, settings, model.config.pad_id,
                                    model.config.tgt_vocab_size, dtype, mask_fill=model.config.mask_fill, src_ids=source)
    return settings.returned(ids, scores, no_speech)


def driven(ops, rules, step, batch: int, settings, pad_id: int, vocab_size: int, dtype, mask_fill=None,
           src_ids=None):
    """(ids, scores, each source row's no-speech probability or None) of the device search that
    `step` runs, on the banned mask, sampling's uniforms and the processors' data built from
    `settings` (a `decoding.Generation`) and the source ids `src_ids` (B, S) on the host (read by
    the encoder's processors; None without them).

    Here `step(ids, banned, length_penalty, sampling, data) -> (state,)` is the whole compiled
    search (the (bos, eos, pad) ids, the banned mask (V,), the length penalty, sampling's and the
    processors' data, as NumPy arrays: int32, since int64 would need x64); then one read of its
    counters (the reference's InputError if an open row's logits were NaN) and one of the result's
    width."""
    banned_mask = np.zeros(vocab_size, dtype=bool)  # (V,)
    banned_mask[list(settings.banned_ids)] = True
    rows = batch * settings.rows  # N: each source once per beam (or sample)
    drawn = uniforms(settings.seed, settings.max_len, rows) if settings.do_sample else None  # (max_len, N)
    sampling = sampling_data(settings, drawn, lambda name, value: np.asarray(value, dtype=np.int32 if name == "top_k"
                                                                                else dtype))
    def as_data(name, value):  # ids as int32 (int64 would need x64), penalties in the search dtype
        value = np.asarray(value)
        return value.astype(dtype if value.dtype.kind == "f" else np.bool_ if value.dtype == bool else np.int32)

    data = processor_data(settings, as_data, src_ids, vocab_size)
    ids = np.array([settings.bos_id, settings.eos_id, pad_id], dtype=np.int32)
    (state,) = step(ids, banned_mask, np.asarray(settings.length_penalty, dtype=dtype), sampling, data)
    bad, count = (int(x) for x in jax.device_get((state["bad"], state[counter(rules)])))  # one read
    if bad >= 0:
        raise nan_error(count - (2 if rules.beams else 1), bad, mask_fill)

    def read(*arrays) -> list:
        return [int(x) for x in jax.device_get(arrays)]

    found = result(ops, rules, state, jnp.asarray(settings.length_penalty, dtype=dtype), count, dtype, read,
                   settings.num_return_sequences, prompt_of(data))
    return (*found, recorded_no_speech(rules, state, settings.num_return_sequences))


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

    Here `device` is "cpu", "gpu" or a jax.Device (default: JAX's default device), float64 needs
    x64 on (`impl_jax.enable_x64`), and the search is one compiled `lax.while_loop` (`_loop`, as
    `generate`'s) whose position is traced; `step` is part of the program's key, so pass one
    object across calls (a module's function)."""
    device, dtype, rules = host.resolve_device(device), jnp.dtype(dtype), rules_of(settings)
    rows = batch * settings.rows

    def program(*search_data) -> tuple:
        placed = jax.device_put((step_data, *search_data), device)
        return (_search_steps(*placed, step=step, rows=rows, rules=rules),)

    return driven(Ops(device), rules, program, batch, settings, pad_id, vocab_size, dtype, src_ids=src_ids)[:2]
