"""Decoding with the NumPy model: the KV cache, the cached step and the search driver.

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

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.generation.search import DecoderCache, uniforms
from conformance.core.generation.settings import check_sources
from conformance.core.generation.device import NumpyOps, newest, prefix, processor_data, rules_of, run, sampling_data
from conformance.core.inputs import check_generate
from conformance.core.output import Encoded, ModelOutput

# -- Masks -------------------------------------------------------------------------------------


def step_mask(config: ModelConfig, tgt_ids: np.ndarray, position: int) -> np.ndarray:
    """(B, 1, 1, T): row `position` of `target_mask`, what the newest position may attend to.

    A cached decoding step has one query, at `position`; its keys are the positions so far.
    """
    tgt_pad = (tgt_ids != config.pad_id)[:, None, None, :]  # (B, 1, 1, T): the keys' padding
    if config.tgt_pad_mask == "queries":
        tgt_pad = tgt_pad[:, :, :, position:position + 1]  # (B, 1, 1, 1): the query's own padding
    elif config.tgt_pad_mask == "none":
        tgt_pad = tgt_pad | True
    return tgt_pad & (np.arange(tgt_ids.shape[1]) <= position)  # (B, 1, 1, T)


# -- The cache ---------------------------------------------------------------------------------


class Written:
    """Layer i's self-attention keys and values for a cached step: the new position's, projected
    from `memory` (B, 1, D), are written at `cache.length`; the positions so far are attended to."""

    def __init__(self, cache: DecoderCache, i: int):
        self.cache, self.i = cache, i

    def keys_values(self, attention, memory: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cache, i, t = self.cache, self.i, self.cache.length
        k, v = attention.keys_values(memory)  # (B, H, 1, K)
        cache.keys[i][:, :, t] = k[:, :, 0]
        cache.values[i][:, :, t] = v[:, :, 0]
        return cache.keys[i][:, :, :t + 1], cache.values[i][:, :, :t + 1]  # (B, H, t + 1, K)


class Projected:
    """Layer i's cross-attention keys and values: the memory's, projected once per source."""

    def __init__(self, cache: DecoderCache, i: int):
        self.cache, self.i = cache, i

    def keys_values(self, attention, memory) -> tuple[np.ndarray, np.ndarray]:
        return self.cache.cross_keys[self.i], self.cache.cross_values[self.i]  # (B, H, S, K)


def layer_caches(cache: DecoderCache) -> list[tuple[Written, Projected]]:
    """Where each decoder layer's two attentions take their keys and values from in a cached step."""
    return [(Written(cache, i), Projected(cache, i)) for i in range(len(cache.keys))]


def start_cache(model, encoded: Encoded, length: int) -> DecoderCache:
    """An empty cache for up to `length` positions against `encoded` (one row per decoder row)."""
    config = model.config
    batch = encoded.memory.shape[0]
    shape = (batch, config.n_heads, length, config.head_dim)  # (B, H, L, K)
    cache = DecoderCache(keys=[], values=[], cross_keys=[], cross_values=[],
                         tgt_ids=np.full((batch, length), config.pad_id, dtype=np.int64),
                         cross_mask=encoded.src_mask if config.cross_attn_src_mask else None)
    for layer in model.decoder.layers:
        cache.keys.append(np.zeros(shape, dtype=model.dtype))
        cache.values.append(np.zeros(shape, dtype=model.dtype))
        k, v = layer.cross_attn.keys_values(encoded.memory)  # (B, H, S, K)
        cache.cross_keys.append(k)
        cache.cross_values.append(v)
    return cache


def reorder_cache(model, cache: DecoderCache, rows) -> DecoderCache:
    """The cache of the rows `rows` (N,), in that order: beam search continues row rows[i] in row i."""
    rows = np.asarray(rows)
    return DecoderCache(keys=[k[rows] for k in cache.keys], values=[v[rows] for v in cache.values],
                        cross_keys=cache.cross_keys, cross_values=cache.cross_values,
                        tgt_ids=cache.tgt_ids[rows], cross_mask=cache.cross_mask, length=cache.length)


# -- The step ----------------------------------------------------------------------------------


def decode_step(model, tgt_ids, cache: DecoderCache) -> np.ndarray:
    """The next-token logits (B, V) after the newest tokens tgt_ids (B,), at position
    `cache.length`; the cache advances by one. Equals the last row of `decode` on the whole prefix.

    One exception, by design: with position_ids "non-pad" (M2M100) a pad token earlier in the
    prefix is counted by the step, as transformers' cached step counts it, and not by `decode`."""
    tgt_ids = model._ids("tgt_ids", np.asarray(tgt_ids).reshape(-1, 1), model.config.tgt_vocab_size)  # (B, 1)
    return advance(model, tgt_ids[:, 0], cache)


def advance(model, tgt_ids: np.ndarray, cache: DecoderCache) -> np.ndarray:
    """`decode_step` without the id checks: tgt_ids (B,) int64 on the model's device, produced by
    the search (checking them would read them back to the host at every step)."""
    config = model.config
    tgt_ids = tgt_ids[:, None]  # (B, 1)
    t = cache.length
    cache.tgt_ids[:, t] = tgt_ids[:, 0]
    self_mask = step_mask(config, cache.tgt_ids[:, :t + 1], t)  # (B, 1, 1, t + 1)
    y = model.embed(tgt_ids, model.target_embedding, model.decoder.position, model.decoder.embedding_norm,
                    at=t, combine=model.decoder.embedding_sum)  # (B, 1, D)
    scratch = ModelOutput(logits=None)  # what the layers record, dropped
    bias = model.decoder.position.score_bias(1, t + 1, model.dtype, first_query=t)  # (1, H, 1, t + 1), or None
    y = model.decoder(y, None, self_mask, cache.cross_mask, scratch, bias=bias, cache=layer_caches(cache))
    logits = model.logits(y)[:, 0]  # (B, V)
    cache.length = t + 1
    return logits


# -- The search --------------------------------------------------------------------------------


class Ops(NumpyOps):
    """The array operations of the device search (`conformance.core.generation.device`) in this
    backend's arrays."""

    def __init__(self, device):
        self.device = device  # the host: NumPy has no other


def search_dtype(model):
    """The dtype the search scores in: float64 for a float64 model, else float32 (as Hugging Face
    upcasts float16 and bfloat16 logits)."""
    return np.float64 if np.dtype(model.dtype) == np.float64 else np.float32


def generate(model, src_ids, max_len=None, bos_id=None, eos_id=None, **options):
    """`Model.generate`: the arguments resolved against the checkpoint's generation note, the source
    encoded once, then the search of `conformance.core.generation.device` in this backend's arrays on
    the step logits (cached, or the whole decoder over the prefix with use_cache=False)."""
    settings = check_generate(model.config, max_len, bos_id, eos_id, **options)
    encoded = model.encode(src_ids, return_attention=False)
    check_sources(encoded.src_mask)  # a row of padding only is refused
    batch = encoded.memory.shape[0]
    rows = np.repeat(np.arange(batch), settings.rows)  # (N,): each source once per beam (or sample)
    encoded = Encoded(memory=encoded.memory[rows], src_mask=encoded.src_mask[rows])
    cache = {"now": start_cache(model, encoded, settings.max_len) if settings.use_cache else None}
    ops, dtype, rules = Ops("cpu"), search_dtype(model), rules_of(settings)

    def step(state, i: int) -> np.ndarray:
        if not settings.use_cache:
            return model.decode(prefix(ops, rules, state, i), encoded, return_attention=False).logits[:, -1]  # (N, V)
        if settings.num_beams > 1 and i > 0:
            cache["now"] = reorder_cache(model, cache["now"], state["parents"])
        return advance(model, newest(ops, rules, state), cache["now"])  # (N, V)

    source = np.asarray(src_ids) if settings.reads_source else None  # the ids as given, padding included
    ids, scores, no_speech = driven(ops, rules, step, batch, settings, model.config.pad_id,
                                    model.config.tgt_vocab_size, dtype, mask_fill=model.config.mask_fill, src_ids=source)
    return settings.returned(ids.astype(np.int64), scores, no_speech)


def driven(ops, rules, step, batch: int, settings, pad_id: int, vocab_size: int, dtype, mask_fill=None,
           src_ids=None):
    """(ids, scores, each source row's no-speech probability or None) of the device search that
    `step` runs, on the banned mask, sampling's uniforms and the processors' data built from
    `settings` (a `decoding.Generation`) and the source ids `src_ids` (B, S) on the host (read by
    the encoder's processors; None without them).

    Here `step(state, i) -> logits (N, V)` is the decoder's, and `device_search.run` drives the
    steps from a Python loop, with one small host read per step; `mask_fill`, the model's, names
    the causes of NaN logits (None: no model, as `search_steps`)."""
    banned_mask = np.zeros(vocab_size, dtype=bool)  # (V,)
    banned_mask[list(settings.banned_ids)] = True
    rows = batch * settings.rows  # N: each source once per beam (or sample)
    drawn = uniforms(settings.seed, settings.max_len, rows) if settings.do_sample else None  # (max_len, N)
    sampling = sampling_data(settings, drawn, lambda name, value: value.astype(dtype) if name == "uniforms" else value)
    # The forced first id, min length, bad-word table, penalties (in the search dtype), ...
    data = processor_data(settings, lambda name, value: value.astype(dtype) if np.asarray(value).dtype.kind == "f"
                          else value, src_ids, vocab_size)
    records: dict = {}
    ids, scores = run(ops, rules, step, batch, settings.bos_id, settings.eos_id, pad_id, banned_mask,
                      settings.length_penalty, dtype, lambda *arrays: [a.item() for a in arrays],
                      settings.num_return_sequences, sampling, settings.return_scores, data, mask_fill, records)
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

    Here `device` is the host (NumPy has no other)."""
    ops, rules, dtype = Ops(device), rules_of(settings), np.dtype(dtype).type
    data = {name: np.asarray(value) for name, value in step_data.items()}
    return driven(ops, rules, lambda state, i: step(data, newest(ops, rules, state), i), batch, settings, pad_id,
                  vocab_size, dtype, src_ids=src_ids)[:2]
