"""Running one conformance case on one target, the same way for every property.

A user's adapter (`conformance.check.targets.adapter`) is a target like any backend, on the cases its
model can be: `for_target` holds a drawn case's switches to those the adapter declares, and a
property compares it on that case, with the oracle run on the same one.

Every run happens with full-float32 matmul precision (TF32 off) and inside the scope its dtype
needs (JAX float64 turns x64 on only for the run). Results come back as NumPy arrays so that the
comparison code never touches a framework.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np

from conformance.check import backends
from conformance.check.backends import Target, precision_problems
from conformance.check.compare import to_numpy
from conformance.core.output import tensors_of
from conformance.suite.covering import RECORDER, relu_kink_distance  # noqa: F401 - runner.relu_kink_distance, as before
from conformance.suite.strategies import Case

# The float64 NumPy model every property compares with.
ORACLE = Target("numpy", "cpu", "float64")

# Wall time spent per target, so the session summary can show where the minutes went.
TIMINGS: dict[str, float] = defaultdict(float)
# Called as PROGRESS(target, case, seconds) after every run when set: the plugin prints a line per
# full-size model run under the `scale` profile, where one run takes a minute.
PROGRESS: Callable[[Target, Case, float], None] | None = None


@contextmanager
def precise(target: Target) -> Iterator[None]:
    """The scope every run happens in: full precision (TF32 off) and the dtype's scope. Checked on
    the way in (a backend whose `full_precision` leaves TF32 on) and on the way out (a model that
    turns it on while it runs): an AssertionError names the switch, on every device; TF32 changes
    numbers only on a GPU, where it would pass float32 comparisons it should fail."""
    with backends.full_precision(target.backend), backends.dtype_scope(target):
        before = backends.precision_settings(target.backend)
        problems = precision_problems(before)
        assert not problems, f"{target.label}: full_precision() left reduced precision on: {', '.join(problems)}"
        yield
        after = backends.precision_settings(target.backend)
        changed = [f"{name} {before[name]!r} -> {after.get(name)!r}" for name in before if after.get(name) != before[name]]
        assert not changed, f"{target.label}: the model changed matmul precision while it ran: {', '.join(changed)}"


def run(target: Target, case: Case, *, src_mask=None, tgt_mask=None, split: bool = False,
        return_attention: bool = True, repeat: int = 1) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
    """All tensors of one model call (`encode` then `decode` when `split`), as host arrays.
    With `return_attention=False` the call's `attention` must be None (AssertionError otherwise).

    With `repeat` > 1, the same model is called that many times and a list is returned.
    """
    started = time.perf_counter()
    case = for_target(target, case)
    record(target, case)
    try:
        with precise(target):
            model = backends.build(target, case.config, case.params())
            results = []
            for _ in range(repeat):
                if split:
                    encoded = model.encode(case.src_ids, src_mask, return_attention=return_attention)
                    output = model.decode(case.tgt_ids, encoded, tgt_mask, return_attention=return_attention)
                else:
                    output = model(case.src_ids, case.tgt_ids, src_mask, tgt_mask, return_attention=return_attention)
                # Not asked for is None in every backend: an empty dict would read as "no attention layers".
                assert return_attention or output.attention is None, (
                    f"{target.label}: return_attention=False must give attention=None, got {output.attention!r:.80}")
                results.append({name: to_numpy(value) for name, value in tensors_of(output).items()})
            return results[0] if repeat == 1 else results
    finally:
        TIMINGS[target.label] += time.perf_counter() - started
        if PROGRESS is not None:
            PROGRESS(target, case, time.perf_counter() - started)


# A large result is kept for a few examples only: a full-size one (d_model 1024, 1024 tokens) is
# ~2.5 GB of float64 with its attention weights, and a long one (2048 tokens, one layer) up to
# 0.8 GB in its three (B, H, L, L) maps. 256 of them would not fit in memory (the first scale runs
# reached 16 GB resident, and a meta-test over long cases 17 GB, with one shared cache).
LARGE_RESULT_BYTES = 32 * 2**20
LARGE_CACHED = 3


def oracle(case: Case) -> dict[str, np.ndarray]:
    """The float64 NumPy result for a case (cached: several properties share examples)."""
    key = (case.config.to_json(), case.seed, case.scale, case.src_ids.tobytes(),
           case.src_ids.shape, case.tgt_ids.tobytes(), case.tgt_ids.shape, case.trained, case.src_ids.dtype.name)
    if result_bytes(case) >= LARGE_RESULT_BYTES:
        return _large_oracle_cached(*key)
    return _oracle_cached(*key)


def result_bytes(case: Case) -> int:
    """The float64 bytes of a case's oracle result: attention maps, residual streams, logits."""
    c = case.config
    batch, t = case.tgt_ids.shape
    s = case.src_ids.shape[2] // 2 if c.source == "features" else case.src_ids.shape[1]  # features: 2 S frames
    maps = c.n_encoder_layers * s * s + c.n_decoder_layers * (t * t + t * s)  # per row and head
    streams = (2 * c.n_encoder_layers + 2) * s + (3 * c.n_decoder_layers + 2) * t  # per row, of D
    return 8 * batch * (c.n_heads * maps + c.d_model * streams + t * c.tgt_vocab_size)


@lru_cache(maxsize=LARGE_CACHED)
def _large_oracle_cached(*key) -> dict[str, np.ndarray]:
    return _oracle_cached.__wrapped__(*key)


def clear_oracle_cache() -> None:
    """Forget every oracle result kept for reuse (`oracle`): for a caller that runs many sizes in
    one process and would otherwise keep each size's tensors (benchmarks/tolerance_law.py)."""
    _oracle_cached.cache_clear()
    _large_oracle_cached.cache_clear()


@lru_cache(maxsize=256)
def _oracle_cached(config_json, seed, scale, src_bytes, src_shape, tgt_bytes, tgt_shape, trained=None,
                   src_dtype="int64") -> dict[str, np.ndarray]:
    from conformance.core.config import ModelConfig

    case = Case(ModelConfig.from_json(config_json), seed, scale,
                np.frombuffer(src_bytes, src_dtype).reshape(src_shape),  # ids, or a features source's float64
                np.frombuffer(tgt_bytes, np.int64).reshape(tgt_shape), trained)
    return run(ORACLE, case)


def record(target: Target, case: Case) -> None:
    """Note what a property ran on a target (`covering.RECORDER`); the oracle's runs are not a
    target's, and an adapter's cover the switches it declares, not every value (docs/own-backend.md)."""
    if target != ORACLE and not backends.is_adapter(target.backend):
        RECORDER.add(target.label, case)


def for_target(target: Target, case):
    """The case (a `Case`, or a generation or training case holding one) as `target` runs it: the
    same object for a backend; for an adapter, the same example under its config held to the
    switches the adapter declares (`adapter.conform`). A held pad id swaps places with the drawn
    one in every id (source, target, labels, start and end tokens, the ids in the options), so that
    padding stays padding and no real token becomes the pad id. The example is rejected when the
    held config is no valid config, reads another source (token ids where features were drawn), or breaks what its strategy assumed (a first decoding step
    that is NaN, a label where the held config's logits are NaN). A property that compares an
    adapter with the oracle runs both on this case."""
    if not backends.is_adapter(target.backend):
        return case
    import dataclasses

    from hypothesis import reject

    from conformance.core.errors import ConfigError
    from conformance.core.inputs import nan_positions

    adapter = backends.adapter_of(target.backend)
    if hasattr(case, "bos_id"):  # a GenerationCase: a search the adapter's generate runs (`searches`)
        if "openai" not in adapter.searches:
            case = without_whisper(case)
        case = dataclasses.replace(case, options=as_search(case.options, adapter.searches, case.case.config))
    inner = getattr(case, "case", case)
    drawn = inner.config
    try:
        config = adapter.conform(drawn)
    except ConfigError:
        reject()  # the drawn sizes admit none of the adapter's models (shared embeddings, two vocabularies)
    if config == drawn:
        return case
    if config.source != drawn.source:
        reject()  # the drawn source (token ids or log-mel features) is not one the adapter's model reads
    swap = pad_swap(drawn.pad_id, config.pad_id)
    inner = dataclasses.replace(inner, config=config, src_ids=swap(inner.src_ids), tgt_ids=swap(inner.tgt_ids))
    if not hasattr(case, "case"):
        return inner
    if hasattr(case, "bos_id"):  # a GenerationCase (strategies.generation)
        held = dataclasses.replace(case, case=inner, bos_id=swap(case.bos_id), eos_id=swap(case.eos_id),
                                   options=tuple((k, swap_option(k, v, swap)) for k, v in case.options))
        first = np.full((len(inner.src_ids), 1), held.bos_id)
        if nan_positions(config, inner.src_ids, first).any():
            reject()  # generation_cases' assumption: a first step that is not NaN
        return held
    held = dataclasses.replace(case, case=inner, labels=swap(case.labels))  # a TrainingCase (strategies.training)
    may_count = (inner.tgt_ids != config.pad_id) & ~nan_positions(config, inner.src_ids, inner.tgt_ids)
    if (held.labels[~may_count] != config.pad_id).any() or not (held.labels[may_count] != config.pad_id).any():
        reject()  # training_cases' assumptions: labels only where the logits are finite, and one at least
    return held


def search_of(options) -> str:
    """The search a generation case's options run (`conformance.check.targets.adapter.SEARCHES`)."""
    options = dict(options)
    if options.get("do_sample"):
        return "sample"
    if options.get("beam_rule") in ("flax", "openai"):
        return options["beam_rule"]
    if options.get("num_beams", 1) == 1:
        return "greedy"
    return "beam" if options.get("length_penalty_form", "hf") == "hf" else "beam-gnmt"


def as_search(options: tuple, searches: tuple[str, ...], drawn) -> tuple:
    """A generation case's options run by one of `searches`: its own search when it is one of them,
    else one chosen by a hash of the drawn config (as a held switch is), the drawn beams (2 at
    least for a beam search), penalty and stopping rule kept where the search has them, sampling's
    warpers and the other beam rules (openai's with its patience) dropped. The logits processors stay."""
    search = search_of(options)
    if search in searches:
        return options
    import zlib

    chosen = searches[zlib.crc32(f"search {drawn.to_json()}".encode()) % len(searches)]
    sampling = ("do_sample", "seed", "temperature", "top_k", "top_p", "num_return_sequences", "beam_rule", "patience")
    kept = {k: v for k, v in options if k not in sampling}
    beams = max(2, dict(options).get("num_return_sequences", 1), kept.get("num_beams", 1))
    if chosen == "greedy":
        kept["num_beams"] = 1
    elif chosen == "sample":  # from a seed of the drawn config's hash, as many samples as there were beams
        kept.pop("early_stopping", None)
        kept.update(num_beams=1, do_sample=True, num_return_sequences=beams,
                    seed=zlib.crc32(drawn.to_json().encode()) % 2**16)
    elif chosen in ("flax", "openai"):
        kept.pop("early_stopping", None)
        kept.update(num_beams=beams, beam_rule=chosen)
    else:
        kept.setdefault("early_stopping", False)
        kept.update(num_beams=beams, length_penalty_form="hf" if chosen == "beam" else "gnmt")
    return tuple(kept.items())


def without_whisper(gcase):
    """A generation case without Whisper's decoding, for an adapter that does not declare it (the
    "openai" search, `conformance.check.targets.adapter.SEARCHES`): its Whisper options dropped and
    its config's generation note removed (its prompt would apply where no prefix is given), the
    start and end ids kept."""
    import dataclasses

    from conformance.suite.strategies.generation import WHISPER_OPTIONS

    config = gcase.case.config
    if "generation" not in config.notes and not any(k in WHISPER_OPTIONS for k, _ in gcase.options):
        return gcase
    notes = {k: v for k, v in config.notes.items() if k != "generation"}
    return dataclasses.replace(gcase, case=dataclasses.replace(gcase.case, config=config.replace(notes=notes)),
                               options=tuple((k, v) for k, v in gcase.options if k not in WHISPER_OPTIONS))


def frozen_parameters(target: Target, config) -> set[str]:
    """The canonical parameters of `config` an adapter target declares frozen (none for a backend)."""
    if not backends.is_adapter(target.backend):
        return set()
    from conformance.core.params import param_shapes

    adapter = backends.adapter_of(target.backend)
    return {name for name in param_shapes(config) if adapter.is_frozen(name)}


def pad_swap(drawn: int, held: int) -> Callable:
    """Ids (an array or an int) with `drawn` and `held` swapped: the pad id an example was drawn
    with becomes the one an adapter holds, and a real token that was the held id takes the drawn
    one's place. Both are ids of every drawn vocabulary (the config is valid with either)."""

    def swap(ids):
        if drawn == held:
            return ids
        if isinstance(ids, np.ndarray):
            return np.where(ids == drawn, held, np.where(ids == held, drawn, ids))
        return held if ids == drawn else drawn if ids == held else ids

    return swap


# Generation options that hold token ids (docs/decoding.md): a held pad id swaps them too.
ID_OPTIONS = {"forced_bos_id": "id", "bad_words_ids": "words", "banned_ids": "ids", "suppress_tokens": "ids",
              "begin_suppress_tokens": "ids", "prefix": "ids"}


def swap_option(name: str, value, swap: Callable):
    what = ID_OPTIONS.get(name)
    if what == "id":
        return swap(value)
    if what == "ids":
        return tuple(i if i is None else swap(i) for i in value)  # a prefix's None: the language detected
    if what == "words":
        return tuple(tuple(swap(i) for i in word) for word in value)
    return value


def compared_names(target: Target, config, got: dict[str, np.ndarray]) -> list[str] | None:
    """The tensors a property compares on `target`: every one (None) for a backend. For an adapter,
    those its model returned, in forward order, and the logits; the others are noted as not
    exposed (`Adapter.not_exposed`), for the run's report."""
    if not backends.is_adapter(target.backend):
        return None
    from conformance.core.output import forward_order

    order = forward_order(config)
    backends.adapter_of(target.backend).not_exposed.setdefault(target.label, set()).update(
        n for n in order if n not in got)
    return [n for n in order if n in got]


def masks(target: Target, case: Case) -> tuple[Any, Any]:
    """The backend's own `make_masks` for the case's ids, as host arrays."""
    record(target, case)
    module = backends.import_backend(target.backend)
    src_mask, tgt_mask = module.make_masks(case.config, case.src_ids, case.tgt_ids)
    return to_numpy(src_mask), to_numpy(tgt_mask)


def generate(target: Target, gcase) -> tuple[np.ndarray, np.ndarray | None]:
    """`model.generate` of a `GenerationCase` on one target: the ids as a host int64 array, and
    each source row's no-speech probability as float64 where the case asks for it (else None)."""
    started = time.perf_counter()
    gcase = for_target(target, gcase)
    record(target, gcase.case)
    try:
        case = gcase.case
        with precise(target):
            model = backends.build(target, case.config, case.params())
            out = model.generate(case.src_ids, gcase.max_len, gcase.bos_id, gcase.eos_id, **gcase.arguments())
            if not dict(gcase.options).get("return_no_speech_prob"):
                return to_numpy(out).astype(np.int64), None
            ids, no_speech = out
            return to_numpy(ids).astype(np.int64), to_numpy(no_speech).astype(np.float64)
    finally:
        TIMINGS[target.label] += time.perf_counter() - started


def gradients(target: Target, training, *more) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
    """`loss_and_grads` of one training case on one target, as host arrays: the loss under the
    name "loss", then every parameter's gradient by its canonical name.

    With `more` training cases (of the same case: its config, weights and ids), the same model is
    called on each in turn and a list is returned, one result per call: a backend may run a
    repeated step another way (impl_torch replays it from a CUDA graph)."""
    started = time.perf_counter()
    assert all(other.case is training.case for other in more), "repeated calls run on one model: the same case"
    training, more = for_target(target, training), tuple(for_target(target, other) for other in more)
    case = training.case
    record(target, case)
    try:
        with precise(target):
            model = backends.build(target, case.config, case.params())
            results = []
            for call in (training, *more):
                loss, grads = model.loss_and_grads(case.src_ids, case.tgt_ids, call.labels,
                                                   label_smoothing=call.label_smoothing)
                results.append({"loss": to_numpy(loss), **{name: to_numpy(g) for name, g in grads.items()}})
            return results if more else results[0]
    finally:
        TIMINGS[target.label] += time.perf_counter() - started


def oracle_generate(gcase) -> tuple[np.ndarray, list[dict], np.ndarray | None]:
    """The float64 NumPy ids of a `GenerationCase`, the search's closest calls per step
    (`conformance.core.generation.search.search`'s `trace`) and each source row's no-speech
    probability where the case asks for it (else None), from the oracle's cached decoder: the same
    steps as its `generate`, with the trace switched on."""
    from conformance.core.generation.settings import resolve
    from conformance.core.generation.search import search
    from conformance.core.output import Encoded

    case = gcase.case
    settings = resolve(case.config, gcase.max_len, gcase.bos_id, gcase.eos_id, **gcase.arguments())
    model = backends.build(ORACLE, case.config, case.params())
    encoded = model.encode(case.src_ids, return_attention=False)
    rows = np.repeat(np.arange(len(case.src_ids)), settings.rows)  # each source once per beam (or sample)
    encoded = Encoded(memory=encoded.memory[rows], src_mask=encoded.src_mask[rows])
    state = {"cache": model.start_cache(encoded, gcase.max_len)}

    def step(tokens, parents):
        if parents is not None:
            state["cache"] = model.reorder_cache(state["cache"], parents)
        return model.decode_step(tokens[:, -1], state["cache"])

    trace: list[dict] = []
    found = search(step, len(case.src_ids), settings.max_len, settings.bos_id, settings.eos_id, case.config.pad_id,
                   trace=trace, src_ids=case.src_ids, **settings.search_options())
    return found[0], trace, found[2] if settings.return_no_speech_prob else None


def has_gradients(target: Target) -> bool:
    """Whether the target's backend offers `Model.loss_and_grads` (issue 13: not every one yet; an
    adapter's model when it has the method)."""
    if backends.is_adapter(target.backend):
        return "loss_and_grads" in backends.adapter_of(target.backend).offers()
    return hasattr(backends.import_backend(target.backend).Model, "loss_and_grads")
